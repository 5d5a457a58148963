r"""Seconds per RLOO iteration, split into rollout, reward, reference and update; one JSON line.

The workload of the comparison with TRL and Tunix (workload.py's flags; docs/PERFORMANCE.md): a
random-weight Llama, one gradient step per rollout batch, beta = 0.05, the synthetic reward the
peers' scripts use too. Also the model FLOP/s (`rloo_jax.memory.flops`, remat not counted), what
the timed iterations trained on, the tokens the trainer's throughput metrics imply, `peak_rss_gb`.

    python experiments/bench_step.py --hidden 256 --layers 4   # size (b); (c): docs/SCALE.md
"""
import argparse
import json
import resource
import tempfile
import time

import numpy as np

import jax

from rloo_jax import experiment, tasks
from rloo_jax.algorithms.rloo import RLOO
from rloo_jax.config_utils import base_config
from rloo_jax.data import pipeline
from rloo_jax.models import lora, transformer
from rloo_jax.memory.flops import model_flops_per_iteration

from workload import add_workload_flags  # experiments/workload.py


class IdTokenizer:
  """Token ids <-> one private-use character each: prompts and completions survive a round trip.
  No bos token: a bench prompt is exactly its prompt_len random ids, wherever it is batched."""
  pad_id, bos_id, eos_id = 0, None, 2

  def __init__(self, vocab_size=256):
    self.vocab_size = vocab_size

  def encode(self, text):
    return [ord(ch) - 0xE000 for ch in text]

  def decode(self, ids):
    return "".join(chr(0xE000 + int(i)) for i in ids)


def synthetic_reward(prompts, completions, **fields):
  """Fraction of completion tokens with an even id: cheap, dense, and learnable."""
  return np.array([np.mean([(ord(c) - 0xE000) % 2 == 0 for c in s]) if s else 0.0
                   for s in completions], np.float32)


def delayed(reward, seconds: float):
  """`reward` after `seconds` of host time a call, as a slow verifier or a remote judge takes."""
  def fn(prompts, completions, **fields):
    time.sleep(seconds)
    return reward(prompts, completions, **fields)
  fn.__name__ = reward.__name__
  return fn


def bench_task(vocab, prompt_len, fixed_length=False):
  """512 random prompts of prompt_len ids; `fixed_length`: no end token, so every completion runs
  to max_new_tokens (a comparison's work does not depend on when a random policy samples id 2)."""
  tokenizer = IdTokenizer(vocab)
  if fixed_length:
    tokenizer.eos_id = None
  ids = np.random.default_rng(0).integers(3, vocab, size=(512, prompt_len))
  return tasks.Task("bench", tokenizer, [{"prompt": tokenizer.decode(row), "answer": ""}
                                         for row in ids], [])


def prompt_batches(task, num_prompts, prompt_len):
  """The bench prompts, `num_prompts` a batch (no bos: every prompt is exactly prompt_len)."""
  return pipeline.prompt_batches(task.train, task.tokenizer, global_batch_size=num_prompts,
                                 max_prompt_len=prompt_len, add_bos=False)


def build(config, task, workdir):
  """(RLOO algorithm, initial state) of `config` on the bench task: random initial weights."""
  algo = RLOO(experiment.build(config, workdir, task=task))
  # The starting policy is the base model (with LoRA the state adds fresh adapters to it).
  base = lora.base_config(algo.exp.model_config)
  return algo, algo.init_state(transformer.create(base, seed=0)[1])


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  add_workload_flags(p)
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                 help="activations (params, log-probs, KL and loss stay float32)")
  # config.train.shared_prefix, config.model.ref_dtype ('': the activations'), remat, ...
  p.add_argument("--shared_prefix", type=int, default=1, choices=(0, 1))
  p.add_argument("--ref_dtype", default="bfloat16", choices=("", "bfloat16", "float32"))
  p.add_argument("--remat", default="full", help="none | full | dots")
  p.add_argument("--microbatch_size", type=int, default=0)
  p.add_argument("--logprob_chunk_size", type=int, default=32)
  p.add_argument("--lora_rank", type=int, default=0, help="0: full fine-tuning")
  p.add_argument("--reward_delay_ms", type=float, default=0.0,
                 help="host latency added to each reward call (a slow verifier or judge)")
  p.add_argument("--fixed_length", type=int, default=0, choices=(0, 1),
                 help="1: no end token, every completion is --new_tokens long")
  p.add_argument("--peak_gflops", type=float, default=390.0,
                 help="float32 matmul peak of this machine, for the utilisation figure")
  args = p.parse_args()

  c = base_config()
  c.task = "bench"
  # The peers' model (bench_trl_rloo.py, bench_tunix_rloo.py): kv heads = heads, MLP 4 x hidden.
  c.model.update(hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                 num_kv_heads=args.heads, head_dim=args.hidden // args.heads,
                 intermediate_size=4 * args.hidden, max_seq_len=args.prompt_len + args.new_tokens,
                 dtype=args.dtype, ref_dtype=args.ref_dtype, remat=args.remat)
  c.model.lora.rank = args.lora_rank
  c.data.max_prompt_len = args.prompt_len
  c.rloo.update(k=args.k, num_prompts=args.prompts, max_new_tokens=args.new_tokens)
  c.kl.beta = 0.05
  c.train.update(num_epochs=1, num_minibatches=1, shared_prefix=bool(args.shared_prefix),
                 microbatch_size=args.microbatch_size,
                 logprob_chunk_size=args.logprob_chunk_size)
  c.rewards.update(fns=[delayed(synthetic_reward, args.reward_delay_ms / 1e3)
                        if args.reward_delay_ms else synthetic_reward], weights=[1.0])
  task = bench_task(args.vocab, args.prompt_len, bool(args.fixed_length))
  with tempfile.TemporaryDirectory() as workdir:
    algo, state = build(c, task, workdir)
    exp = algo.exp
    data = prompt_batches(task, args.prompts, args.prompt_len)
    rows = []
    for i in range(2 + args.iterations):  # the first two compile and warm up
      state, m = algo.iteration(state, next(data))
      rows += [m] if i >= 2 else []
  keys = ("rollout_s", "reward_s", "reference_s", "update_s", "iteration_s")
  med = {k: float(np.median([r[k] for r in rows])) for k in keys}
  mean = lambda key: float(np.mean([r[key] for r in rows]))  # noqa: E731
  flops = model_flops_per_iteration(exp.model_config, args.prompts, args.prompt_len, args.k,
                                    args.new_tokens, bool(args.shared_prefix))
  total = sum(flops.values())
  print(json.dumps({
      "framework": "rloo_jax", "jax": jax.__version__, "devices": str(jax.devices()[0].platform),
      "config": vars(args), "params": exp.model_config.num_params,
      "trainable_params": lora.num_params(exp.model_config) or exp.model_config.num_params,
      "median": {k: round(v, 5) for k, v in med.items()},
      "mean_completion_length": mean("completion_length"),
      "mean_reward": mean("reward_mean"), "mean_kl": mean("kl"), "mean_loss": mean("loss"),
      "mean_advantage": mean("advantage_mean"),
      # The tokens the trainer's throughput metrics were computed over, recovered from them.
      "update_tokens_per_iteration": round(float(np.median(
          [r["update_tokens_per_s"] * r["update_s"] for r in rows])), 2),
      "generated_tokens_per_iteration": round(float(np.mean(
          [r["rollout_tokens_per_s"] * r["rollout_s"] for r in rows])), 2),
      "model_gflop_per_iteration": round(total / 1e9, 3),
      "achieved_gflops": round(total / med["iteration_s"] / 1e9, 2),
      "update_gflops": round(flops["update"] / med["update_s"] / 1e9, 2),
      "fraction_of_peak": round(total / med["iteration_s"] / 1e9 / args.peak_gflops, 4),
      # The process's peak resident memory (Linux reports KiB): state, programs and runtime.
      "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
  }))


if __name__ == "__main__":
  main()

r"""Tunix's GRPOLearner with advantage_estimator='rloo' on experiments/bench_step.py's workload
(docs/PERFORMANCE.md "Against TRL and Tunix"), in its own virtual environment:

    bash experiments/setup_peer_venvs.sh tunix
    .venv-tunix/bin/python experiments/bench_tunix_rloo.py --hidden 64 --layers 2

No end token (eos -1: fixed-length completions); Adam as bench_step's. GRPOConfig skips
AlgorithmConfig's list check, which would reject the registered "rloo" estimator. Step times: the
gaps between reward calls (one a step), the first (the update's compile) dropped.
"""
import argparse
import json
import resource
import statistics
import time

import numpy as np

import jax
import optax
from flax import nnx

import tunix
from tunix.models.llama3 import model as llama3
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import grpo_learner
from tunix.rl.rollout import base_rollout

from workload import add_workload_flags  # experiments/workload.py

BASE = 0xE000  # token id i <-> the private-use character BASE + i, as bench_step's IdTokenizer


class IdTokenizer:
  """What Tunix's TokenizerAdapter asks of a plain tokenizer. No bos (a prompt is exactly its
  prompt_len ids) and no end token (-1 matches no id: completions are fixed-length)."""

  def encode(self, text, **kwargs):
    return [ord(ch) - BASE for ch in text]

  def decode(self, ids, **kwargs):
    return "".join(chr(BASE + int(i)) for i in ids if int(i) >= 0)

  def bos_id(self):
    return 0  # falsy: Tunix's sampler then adds no bos

  def eos_id(self):
    return -1

  def pad_id(self):
    return 0

def make_reward(times, lengths):
  def synthetic_reward(prompts, completions, **kwargs):
    times.append(time.perf_counter())
    lengths.extend(len(s) for s in completions)
    return [float(np.mean([(ord(c) - BASE) % 2 == 0 for c in s])) if s else 0.0
            for s in completions]
  return synthetic_reward


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  add_workload_flags(p, steps_help="timed steps after 2 warm-up steps")
  p.add_argument("--dtype", default="float32", choices=("float32",),
                 help="Tunix's Llama3 computes in its params' dtype: float32 here")
  args = p.parse_args()

  config = llama3.ModelConfig(
      num_layers=args.layers, vocab_size=args.vocab, embed_dim=args.hidden,
      hidden_dim=4 * args.hidden, num_heads=args.heads, head_dim=args.hidden // args.heads,
      num_kv_heads=args.heads, rope_theta=10_000, norm_eps=1e-6, weight_tying=False)
  mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  with jax.set_mesh(mesh):
    policy = llama3.Llama3(config, rngs=nnx.Rngs(0))
    reference = llama3.Llama3(config, rngs=nnx.Rngs(0))  # the same initial weights
  params = sum(x.size for x in jax.tree.leaves(nnx.state(policy, nnx.Param)))

  steps = args.iterations + 2
  rng = np.random.default_rng(0)
  ids = rng.integers(3, args.vocab, size=(steps * args.prompts, args.prompt_len))
  texts = ["".join(chr(BASE + int(i)) for i in row) for row in ids]
  train_ds = [{"prompts": np.array(texts[s * args.prompts:(s + 1) * args.prompts])}
              for s in range(steps)]

  optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                          optax.adamw(3e-4, b1=0.9, b2=0.95, weight_decay=0.0))
  cluster_config = rl_cluster_lib.ClusterConfig(
      role_to_mesh={rl_cluster_lib.Role.ACTOR: mesh, rl_cluster_lib.Role.REFERENCE: mesh,
                    rl_cluster_lib.Role.ROLLOUT: mesh},
      rollout_engine="vanilla", offload_to_cpu=False,
      training_config=rl_cluster_lib.RLTrainingConfig(
          actor_optimizer=optimizer, eval_every_n_steps=10**6, max_steps=steps,
          pbar_description=None),
      rollout_config=base_rollout.RolloutConfig(
          max_tokens_to_generate=args.new_tokens, max_prompt_length=args.prompt_len,
          kv_cache_size=args.prompt_len + args.new_tokens, temperature=1.0, top_p=1.0,
          top_k=None, eos_tokens=[-1], seed=0))
  cluster = rl_cluster_lib.RLCluster(actor=policy, reference=reference, tokenizer=IdTokenizer(),
                                     cluster_config=cluster_config)
  algo = grpo_learner.GRPOConfig(
      num_generations=args.k, num_iterations=1, beta=0.05, epsilon=0.2,
      advantage_estimator="rloo")
  times, lengths = [], []
  learner = grpo_learner.GRPOLearner(rl_cluster=cluster, algo_config=algo,
                                     reward_fns=[make_reward(times, lengths)])
  learner.train(train_ds)
  gaps = np.diff(times)[1:]  # the first gap holds the update's compilation
  print(json.dumps({
      "framework": "tunix", "tunix": tunix.__version__,
      "jax": jax.__version__, "config": vars(args), "params": int(params),
      "advantage_estimator": algo.advantage_estimator, "steps_run": len(times),
      "optimizer_steps": int(cluster.actor_trainer.train_steps),
      "completions": len(lengths), "mean_completion_length": float(np.mean(lengths)),
      "median_step_s": round(float(statistics.median(gaps)), 5), "steps_timed": len(gaps),
      "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)}))


if __name__ == "__main__":
  main()

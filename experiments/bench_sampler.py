"""Rollout latency of the sampler: prefix-shared KV cache vs unshared vs HF generate.

Prints ONE JSON line: seconds per rollout (median over --repeats after a compiling call), tokens/s
and ratios of each mode (docs/PERFORMANCE.md: shared, unshared, unstacked, and hf, transformers'
generate on the same weights, null without torch), timed round-robin so load hits them alike.

  python experiments/bench_sampler.py --prompt_len=512 --new_tokens=32 --modes=shared,unshared,hf
  python experiments/bench_sampler.py --prompt_len=64 --new_tokens=64 --modes=shared,unstacked
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rloo_jax import sampler, sampling  # noqa: E402
from rloo_jax.models import hf_export, transformer  # noqa: E402

MODES = {"shared": "shared", "unshared": "unshared", "unstacked": "unstacked",
         "hf": "hf_generate"}  # mode -> its key in the JSON


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  for flag, default in (("prompt_len", 64), ("new_tokens", 64), ("prompts", 8), ("k", 4),
                        ("vocab", 4096), ("hidden", 256), ("layers", 8), ("heads", 4),
                        ("kv_heads", 4), ("intermediate", 1024), ("repeats", 3)):
    p.add_argument(f"--{flag}", type=int, default=default)
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  p.add_argument("--modes", default=",".join(MODES), help="a comma-separated subset")
  args = p.parse_args(argv)
  args.modes = [m for m in args.modes.split(",") if m]
  unknown = set(args.modes) - set(MODES)
  if unknown:
    p.error(f"unknown modes {sorted(unknown)}")
  return args


def hf_generate_fn(config, params, tokens, args, eos_id, pad_id):
  """A transformers Llama of our weights (`hf_export`, float32, loaded back): a call generating k
  samples a prompt, its logits on the first two prompts (to compare with ours), the versions."""
  import torch
  import transformers

  with tempfile.TemporaryDirectory() as out:
    hf_export.save_pretrained(params, config, out, dtype="float32")
    hf = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
  hf = hf.eval().to(torch.float32 if config.dtype == "float32" else torch.bfloat16)
  gen_config = transformers.GenerationConfig(
      max_new_tokens=args.new_tokens, num_return_sequences=args.k, eos_token_id=eos_id,
      pad_token_id=pad_id, use_cache=True, do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
  input_ids = torch.from_numpy(np.asarray(tokens, np.int64))
  calls = [0]

  def run():
    torch.manual_seed(calls[0])
    calls[0] += 1
    with torch.inference_mode():
      return hf.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                         generation_config=gen_config)
  with torch.inference_mode():
    hf_logits = hf(input_ids[:2]).logits.float().numpy()
  return run, hf_logits, {"torch": torch.__version__, "transformers": transformers.__version__,
                          "torch_threads": torch.get_num_threads()}


def main(argv=None):
  args = parse_args(argv)
  config = transformer.TransformerConfig.llama(
      vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
      num_kv_heads=args.kv_heads, head_dim=args.hidden // args.heads,
      intermediate_size=args.intermediate, max_seq_len=args.prompt_len + args.new_tokens,
      dtype=args.dtype, param_dtype=args.dtype)
  graphdef, params = transformer.create(config, seed=0)
  fns = transformer.model_fns(graphdef)
  eos_id, pad_id = args.vocab - 1, 0
  tokens = jnp.asarray(np.random.default_rng(0).integers(2, args.vocab - 1,
                                                         (args.prompts, args.prompt_len)),
                       jnp.int32)
  lengths = jnp.full((args.prompts,), args.prompt_len, jnp.int32)
  method = sampling.Temperature(1.0)
  kw = dict(k=args.k, max_new_tokens=args.new_tokens, method=method, eos_id=eos_id, pad_id=pad_id)

  runners, compile_s, mean_len = {}, {}, {}
  for mode in (m for m in args.modes if m != "hf"):
    layout = {"mode": "shared", "unstack_layers": True} if mode == "unstacked" else {"mode": mode}

    def run(layout=layout, counter=[0]):  # noqa: B006
      counter[0] += 1  # a fresh rng per rollout, as in training
      return jax.block_until_ready(sampler.sample(fns, params, tokens, lengths,
                                                  jax.random.key(counter[0]), **layout, **kw))
    t0 = time.perf_counter()
    run()  # compiles both programs
    compile_s[mode] = round(time.perf_counter() - t0, 2)
    runners[mode] = run

  hf_note = None
  if "hf" in args.modes:
    try:
      runners["hf"], hf_logits, hf_note = hf_generate_fn(config, params, tokens, args, eos_id,
                                                         pad_id)
    except ImportError as e:
      hf_note = f"torch/transformers not importable: {e}"
    else:
      positions = jnp.broadcast_to(jnp.arange(args.prompt_len), (2, args.prompt_len))
      ours = jax.jit(fns.forward)(params, tokens[:2], positions,
                                  jnp.ones((2, args.prompt_len), bool))
      hf_note["logits_max_abs_diff_vs_ours"] = float(np.abs(hf_logits - np.asarray(ours)).max())
      runners["hf"]()  # warm-up

  times = {mode: [] for mode in runners}
  for _ in range(args.repeats):  # round-robin, so slow drifts in machine load hit all modes alike
    for mode, run in runners.items():
      t0 = time.perf_counter()
      out = run()
      times[mode].append(time.perf_counter() - t0)
      if mode != "hf":
        mean_len[mode] = float(np.mean(out.lengths_bk))

  med = {m: round(statistics.median(times[m]), 4) for m in times}
  result = {f"{key}_s": med.get(mode) for mode, key in MODES.items()}
  for mode, key in MODES.items():
    result[f"{key}_tokens_per_s"] = (round(args.prompts * args.k * args.new_tokens / med[mode], 1)
                                     if mode in med else None)
  for name, a, b in (("shared_over_unshared", "shared", "unshared"),
                     ("unstacked_over_shared", "unstacked", "shared"),
                     ("hf_generate_over_shared", "hf", "shared"),
                     ("hf_generate_over_unstacked", "hf", "unstacked")):
    result[name] = round(med[a] / med[b], 3) if a in med and b in med else None
  result.update({
      "config": {**{f: v for f, v in vars(args).items() if f != "modes"}, "method": repr(method),
                 "num_params": config.num_params, "jax": jax.__version__,
                 "backend": jax.default_backend(), "cpu_count": os.cpu_count()},
      "all_times_s": {m: [round(t, 4) for t in ts] for m, ts in times.items()},
      "compile_s": compile_s, "mean_completion_len": mean_len, "hf": hf_note})
  print(json.dumps(result))


if __name__ == "__main__":
  main()

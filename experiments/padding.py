r"""The update's padding with long-tailed lengths (docs/SCALE.md "Padding"): trimmed grouped rows
beside packed rows (config.train.microbatch_tokens, planned by rloo_jax.packing), on log-normal
lengths (completions: median `--median` x `--max_new_tokens`, sigma `--sigma`; prompts: median
`--prompt_median`), capped. Useful tokens: each prompt once, each completion but its last; trimmed
rows are [P | (T' - 1) x k], T' the longest completion rounded up to `--trim_bucket`. `--time`
times the update's gradient program too (a `--preset`, random weights, `--time_prompts` groups).

    python experiments/padding.py [--max_new_tokens 24576 --num_prompts 32]
    python experiments/padding.py --time --preset qwen2.5-1.5b --time_prompts 4   # on a GPU
"""
import argparse
import json
import tempfile
import types

import numpy as np

import jax
import jax.numpy as jnp

import bench_step  # experiments/, beside this file
import gpu_check
from rloo_jax import packing, rollout
from rloo_jax.config_utils import base_config
from rloo_jax.models import presets


def draws(a, rng, n):  # prompt lengths [n], completion lengths [n * k]
  draw = lambda m, median, cap, sigma: np.clip(  # noqa: E731
      np.round(rng.lognormal(np.log(median), sigma, m)), 1, cap).astype(np.int64)
  return (draw(n, a.prompt_median, a.max_prompt_len, 0.5),
          draw(n * a.k, a.median * a.max_new_tokens, a.max_new_tokens, a.sigma))


def time_update(a, p_b, len_n) -> dict:
  """Seconds of the gradient program on trimmed grouped rows and on packed ones (see above)."""
  b, k, p, t = len(p_b), a.k, a.max_prompt_len, a.max_new_tokens
  c = base_config()
  c.model.update(remat="full", max_seq_len=p + t)
  task = gpu_check.bench_job(c, types.SimpleNamespace(
      preset=a.preset, dtype="bfloat16", attention="auto", num_layers=a.num_layers, vocab_size=0,
      prompt_len=p, k=k, prompts=b, new_tokens=t))
  c.train.update(num_epochs=1, num_minibatches=1, microbatch_size=a.microbatch_groups)
  vocab, rng = presets.get(a.preset).vocab_size, np.random.default_rng(0)
  cols = min(-(-int(len_n.max()) // a.trim_bucket) * a.trim_bucket, t)  # today's trimming
  cmask = np.arange(cols)[None, :] < len_n[:, None]
  rows = jax.jit(rollout.make_rows, static_argnames=("k", "shared_prefix"))(
      jnp.asarray(rng.integers(1, vocab, (b, p)), jnp.int32), jnp.asarray(p_b, jnp.int32),
      jnp.asarray(np.where(cmask, rng.integers(1, vocab, cmask.shape), 0), jnp.int32),
      jnp.asarray(cmask), jnp.asarray(np.where(cmask, -2.0, 0.0), jnp.float32), k=k,
      shared_prefix=True)
  rows = rows.replace(advantages_n=jnp.asarray(rng.standard_normal(b * k), jnp.float32))
  useful, out = int((p_b + (len_n - 1).reshape(b, k).sum(1)).sum()), {}
  for name, budget in (("trimmed", 0), ("packed", p - 1 + k * t)):  # packed: a group's budget
    c.train.update(microbatch_size=0 if budget else a.microbatch_groups, microbatch_tokens=budget)
    with tempfile.TemporaryDirectory() as workdir:
      algo, state = bench_step.build(c, task, workdir)
    step = algo.step_fn
    x = rows if step.packer is None else step.packer(rows)
    s = gpu_check.median_s(lambda _: step.grad_fn(state.params, x), a.repeats)  # after a compile
    out[name] = dict(seconds=round(s, 4), useful_tokens_per_s=round(useful / s, 1))
  out["packed_speedup"] = round(out["trimmed"]["seconds"] / out["packed"]["seconds"], 3)
  return dict(out, useful_tokens=useful, trimmed_columns=cols, device=jax.devices()[0].device_kind)


def main():
  ap = argparse.ArgumentParser()
  # --devices: packed rows a microbatch; --num_layers 0: the preset's depth.
  for name, default in (("num_prompts", 128), ("k", 8), ("max_prompt_len", 1024),
                        ("prompt_median", 256), ("max_new_tokens", 8192), ("median", 0.25),
                        ("sigma", 1.0), ("trim_bucket", 32), ("devices", 8), ("seeds", 5),
                        ("preset", "qwen2.5-1.5b"), ("num_layers", 0), ("time_prompts", 4),
                        ("microbatch_groups", 1), ("repeats", 2)):
    ap.add_argument(f"--{name}", type=type(default), default=default)
  ap.add_argument("--time", action="store_true")
  a = ap.parse_args()
  b, k, p, t = a.num_prompts, a.k, a.max_prompt_len, a.max_new_tokens
  least = packing.min_tokens(p, t)
  budgets = {"one completion": least, "two completions": 2 * least, "one group": p - 1 + k * t}
  out, capped = {name: [] for name in ["trimmed", *budgets]}, []
  for seed in range(a.seeds):
    p_b, len_n = draws(a, np.random.default_rng(seed), b)
    capped.append(float((len_n == t).mean()))
    useful = int((p_b + (len_n - 1).reshape(b, k).sum(1)).sum())
    longest = min(-(-len_n.max() // a.trim_bucket) * a.trim_bucket, t)
    out["trimmed"].append(1 - useful / (b * (p + (longest - 1) * k)))
    for name, budget in budgets.items():
      pl = packing.plan(p_b, len_n, k=k, budget=budget, rows=a.devices)
      out[name].append(1 - useful / (pl.count * a.devices * budget))
  result = {name: float(np.median(v)) for name, v in out.items()}
  print(f"{b} prompts x k={k}, prompts <= {p} (median {a.prompt_median}), completions <= {t} "
        f"(log-normal, median {a.median:g} x cap, sigma {a.sigma:g}; "
        f"{100 * np.median(capped):.1f}% hit the cap), {a.devices} rows a packed microbatch")
  for name, what in (("trimmed", "trimmed grouped rows"),
                     *((n, f"packed, {v} tokens ({n})") for n, v in budgets.items())):
    print(f"  padding {100 * result[name]:5.1f}%  {what}")
  timed = time_update(a, *draws(a, np.random.default_rng(0), a.time_prompts)) if a.time else {}
  print(json.dumps(dict(padding=result, budgets=budgets, capped=float(np.median(capped)),
                        timed=timed, **vars(a))))


if __name__ == "__main__":
  main()

r"""The update's padding with long-tailed completion lengths: today's trimmed grouped rows beside
packed rows (config.train.microbatch_tokens), planned by rloo_jax.packing's own plan.

Completion lengths are log-normal with median `--median` x the cap (sigma `--sigma`), capped at
`--max_new_tokens` (a completion that hits the cap is cut there); prompt lengths log-normal with
median `--prompt_median`, capped at `--max_prompt_len`. Useful tokens are what the update must
compute: each prompt once and each completion but its last token. Trimmed: every group's row is
[P | (T' - 1) x k] with T' the rollout's longest completion rounded up to `--trim_bucket`.
Packed: the rows of each budget in use. Prints a table and one JSON line (medians over seeds).

`--time`: also times the update's gradient program on this device, a `--preset` with random
weights (bench_step.py's task), on one draw of `--time_prompts` groups: trimmed grouped rows,
`--microbatch_groups` a microbatch, beside packed rows of one group's budget; the medians of
`--repeats` calls after a compiling one, and useful tokens a second each.

    python experiments/padding.py
    python experiments/padding.py --max_new_tokens 24576 --num_prompts 32 --devices 8
    python experiments/padding.py --time --preset qwen2.5-1.5b --time_prompts 4   # on a GPU
    python experiments/padding.py --time --preset pythia-160m --num_layers 1 --time_prompts 2 \
        --max_prompt_len 16 --prompt_median 8 --max_new_tokens 64 --k 2 --repeats 1  # CPU smoke
"""
import argparse
import json
import statistics
import tempfile
import time

import numpy as np

import jax
import jax.numpy as jnp

import bench_step  # experiments/, beside this file
from rloo_jax import packing, rollout
from rloo_jax.config_utils import base_config
from rloo_jax.models import presets


def draw(rng, n, median, cap, sigma):
  return np.clip(np.round(rng.lognormal(np.log(median), sigma, n)), 1, cap).astype(np.int64)


def time_update(a, p_b, len_n) -> dict:
  """Seconds of the gradient program on trimmed grouped rows and on packed ones (see above)."""
  b, k, p, t = len(p_b), a.k, a.max_prompt_len, a.max_new_tokens
  c = base_config()
  c.task = "bench"
  c.model.update(preset=a.preset, dtype="bfloat16", remat="full", max_seq_len=p + t)
  if a.num_layers:  # the preset's family and widths at this depth
    m = presets.get(a.preset, num_layers=a.num_layers)
    c.model.update(preset="", **{f: getattr(m, f) for f in (
        "family", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
        "intermediate_size")})
  c.data.max_prompt_len = p
  c.rloo.update(k=k, num_prompts=b, max_new_tokens=t)
  c.rewards.update(fns=[bench_step.synthetic_reward], weights=[1.0])
  c.train.update(num_epochs=1, num_minibatches=1, microbatch_size=a.microbatch_groups)
  vocab = presets.get(a.preset).vocab_size
  task = bench_step.bench_task(vocab, p, fixed_length=True)
  rng = np.random.default_rng(0)
  cols = min(-(-int(len_n.max()) // a.trim_bucket) * a.trim_bucket, t)  # today's trimming
  cmask = np.arange(cols)[None, :] < len_n[:, None]
  rows = jax.jit(rollout.make_rows, static_argnames=("k", "shared_prefix"))(
      jnp.asarray(rng.integers(1, vocab, (b, p)), jnp.int32), jnp.asarray(p_b, jnp.int32),
      jnp.asarray(np.where(cmask, rng.integers(1, vocab, cmask.shape), 0), jnp.int32),
      jnp.asarray(cmask), jnp.asarray(np.where(cmask, -2.0, 0.0), jnp.float32), k=k,
      shared_prefix=True)
  rows = rows.replace(advantages_n=jnp.asarray(rng.standard_normal(b * k), jnp.float32))
  useful = int((p_b + (len_n - 1).reshape(b, k).sum(1)).sum())
  out = {}
  for name, budget in (("trimmed", 0), ("packed", p - 1 + k * t)):
    c.train.update(microbatch_size=0 if budget else a.microbatch_groups,
                   microbatch_tokens=budget)
    with tempfile.TemporaryDirectory() as workdir:
      algo, state = bench_step.build(c, task, workdir)
    step = algo.step_fn
    x = rows if step.packer is None else step.packer(rows)
    jax.block_until_ready(step.grad_fn(state.params, x))  # compiles
    times = []
    for _ in range(a.repeats):
      t0 = time.perf_counter()
      jax.block_until_ready(step.grad_fn(state.params, x))
      times.append(time.perf_counter() - t0)
    s = statistics.median(times)
    out[name] = dict(seconds=round(s, 4), useful_tokens_per_s=round(useful / s, 1))
  out["packed_speedup"] = round(out["trimmed"]["seconds"] / out["packed"]["seconds"], 3)
  return dict(out, useful_tokens=useful, trimmed_columns=cols, device=jax.devices()[0].device_kind)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--num_prompts", type=int, default=128)
  ap.add_argument("--k", type=int, default=8)
  ap.add_argument("--max_prompt_len", type=int, default=1024)
  ap.add_argument("--prompt_median", type=int, default=256)
  ap.add_argument("--max_new_tokens", type=int, default=8192)
  ap.add_argument("--median", type=float, default=0.25, help="of max_new_tokens")
  ap.add_argument("--sigma", type=float, default=1.0)
  ap.add_argument("--trim_bucket", type=int, default=32)
  ap.add_argument("--devices", type=int, default=8, help="packed rows a microbatch")
  ap.add_argument("--seeds", type=int, default=5)
  ap.add_argument("--time", action="store_true", help="also time the update on this device")
  ap.add_argument("--preset", default="qwen2.5-1.5b")
  ap.add_argument("--num_layers", type=int, default=0, help="0: the preset's depth")
  ap.add_argument("--time_prompts", type=int, default=4)
  ap.add_argument("--microbatch_groups", type=int, default=1)
  ap.add_argument("--repeats", type=int, default=2)
  a = ap.parse_args()
  b, k, p, t = a.num_prompts, a.k, a.max_prompt_len, a.max_new_tokens
  least = packing.min_tokens(p, t)
  budgets = {"one completion": least, "two completions": 2 * least,
             "one group": p - 1 + k * t}
  out = {name: [] for name in ["trimmed", *budgets]}
  capped = []
  for seed in range(a.seeds):
    rng = np.random.default_rng(seed)
    p_b = draw(rng, b, a.prompt_median, p, 0.5)
    len_n = draw(rng, b * k, a.median * t, t, a.sigma)
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
  print(f"{'update rows':<40}{'padding':>8}")
  print(f"{'trimmed grouped rows (today)':<40}{100 * result['trimmed']:>7.1f}%")
  for name, budget in budgets.items():
    print(f"{f'packed, {budget} tokens ({name})':<40}{100 * result[name]:>7.1f}%")
  timed = {}
  if a.time:
    rng = np.random.default_rng(0)
    n = a.time_prompts
    timed = time_update(a, draw(rng, n, a.prompt_median, p, 0.5),
                        draw(rng, n * k, a.median * t, t, a.sigma))
    print(f"update on {timed['device']}, {n} groups: trimmed {timed['trimmed']['seconds']} s, "
          f"packed {timed['packed']['seconds']} s: {timed['packed_speedup']}x")
  print(json.dumps(dict(padding=result, budgets=budgets, capped=float(np.median(capped)),
                        timed=timed, **vars(a))))


if __name__ == "__main__":
  main()

r"""The update's padding with long-tailed completion lengths: today's trimmed grouped rows beside
packed rows (config.train.microbatch_tokens), planned by rloo_jax.packing's own plan.

Completion lengths are log-normal with median `--median` x the cap (sigma `--sigma`), capped at
`--max_new_tokens` (a completion that hits the cap is cut there); prompt lengths log-normal with
median `--prompt_median`, capped at `--max_prompt_len`. Useful tokens are what the update must
compute: each prompt once and each completion but its last token. Trimmed: every group's row is
[P | (T' - 1) x k] with T' the rollout's longest completion rounded up to `--trim_bucket`.
Packed: the rows of each budget in use. Prints a table and one JSON line (medians over seeds).

    python experiments/padding.py
    python experiments/padding.py --max_new_tokens 24576 --num_prompts 32 --devices 8
"""
import argparse
import json

import numpy as np

from rloo_jax import packing


def draw(rng, n, median, cap, sigma):
  return np.clip(np.round(rng.lognormal(np.log(median), sigma, n)), 1, cap).astype(np.int64)


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
  print(json.dumps(dict(padding=result, budgets=budgets, capped=float(np.median(capped)),
                        **vars(a))))


if __name__ == "__main__":
  main()

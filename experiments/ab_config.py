r"""A/B of two trainer settings inside one process: bench_step.py's workload (the TRL comparison's
Llama shape) built twice, once with each value of one `config.train` flag, and their RL
iterations interleaved (A, B, then B, A, ...). This machine's speed drifts by 30% within minutes,
so whole-process runs taken one after the other (compare_commits.py, or bench_step.py twice) can
disagree by more than the effect being measured; back-to-back iterations in one process do not.

The two sides compile different programs (the flag changes the traced code or a static
argument), so this A/B does not fall into the memoised-`model_fns` pitfall that ab_compiled.py
avoids for module-level switches.

Prints one JSON line: for each phase (rollout, reference, update, iteration) the medians of A and
B and the median of the per-pair ratios B / A; and `first_iteration`, each side's reward, KL and
loss on its first iteration. Both sides start from the same weights, prompts and random numbers,
so a flag that only changes how the same quantities are computed (shared_prefix) must give the
same first iteration up to float rounding.

    python experiments/ab_config.py --flag shared_prefix
    python experiments/ab_config.py --flag shared_prefix --hidden 64 --layers 2
    python experiments/ab_config.py --flag model.remat --a none --b full --hidden 256 --layers 4
"""
import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_step  # noqa: E402
from compare_peers import round_order  # noqa: E402

PHASES = ("rollout_s", "reference_s", "update_s", "iteration_s")
FIRST_ITERATION = ("reward_mean", "kl", "loss", "completion_length")


def pair_summary(a_s, b_s) -> dict:
  """Each side's median seconds and the median of the per-pair ratios B / A."""
  a, b = np.asarray(a_s, float), np.asarray(b_s, float)
  return {"A_s": round(float(np.median(a)), 4), "B_s": round(float(np.median(b)), 4),
          "median_pair_ratio_B_over_A": round(float(np.median(b / a)), 3)}


def side(hidden, layers, flag, value):
  """[algorithm, state, batches] of bench_step's workload with config.<flag> = value (a
  `config.train` field, or `model.<field>`)."""
  if flag.startswith("model."):
    algo, state, task = bench_step.default_workload(hidden, layers, model={flag[6:]: value})
  else:
    algo, state, task = bench_step.default_workload(hidden, layers, **{flag: value})
  return [algo, state, bench_step.prompt_batches(task, 8, 16)]


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--flag", default="shared_prefix",
                 help="a config.train field, or model.<field>")
  p.add_argument("--a", default="false", help="side A's value (default false)")
  p.add_argument("--b", default="true", help="side B's value (default true)")
  p.add_argument("--hidden", type=int, default=256)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--pairs", type=int, default=24)
  args = p.parse_args()
  value = lambda text: {"true": True, "false": False}.get(text.lower(), text)  # noqa: E731
  a, b = value(args.a), value(args.b)
  sides = {"A": side(args.hidden, args.layers, args.flag, a),
           "B": side(args.hidden, args.layers, args.flag, b)}

  def iterate(name):
    algo, state, data = sides[name]
    sides[name][1], metrics = algo.iteration(state, next(data))
    return metrics

  first = {}
  for name in sides:  # compile and warm up
    m = iterate(name)
    first[name] = {key: float(m[key]) for key in FIRST_ITERATION}
    iterate(name)
  rows = {"A": [], "B": []}
  for i in range(args.pairs):
    for name in round_order(i, ("A", "B")):
      rows[name].append(iterate(name))
  result = {"flag": args.flag, "A": a, "B": b, "hidden": args.hidden,
            "layers": args.layers, "pairs": args.pairs, "first_iteration": first}
  for k in PHASES:
    result[k] = pair_summary([m[k] for m in rows["A"]], [m[k] for m in rows["B"]])
  print(json.dumps(result))


if __name__ == "__main__":
  main()

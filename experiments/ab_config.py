r"""A/B of two trainer settings inside one process: bench_step.py's workload (the TRL comparison's
Llama shape) built twice, once with each value of one `config.train` flag, and their RL
iterations interleaved (A, B, then B, A, ...). This machine's speed drifts by 30% within minutes,
so whole-process runs taken one after the other (compare_commits.py, or bench_step.py twice) can
disagree by more than the effect being measured; back-to-back iterations in one process do not.

The two sides compile different programs (the flag changes the traced code or a static
argument), so this A/B does not fall into the memoised-`model_fns` pitfall that ab_compiled.py
avoids for module-level switches.

Prints one JSON line: for each phase (rollout, reference, update, iteration) the medians of A and
B and the median of the per-pair ratios B / A.

    python experiments/ab_config.py --flag reuse_rollout_activations
    python experiments/ab_config.py --flag reuse_rollout_activations --hidden 64 --layers 2
"""
import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_step  # noqa: E402

from rloo_jax import trainer  # noqa: E402
from rloo_jax.data import pipeline  # noqa: E402

PHASES = ("rollout_s", "reference_s", "update_s", "iteration_s")


def side(hidden, layers, flag, value):
  """(experiment, state, batches) of bench_step's workload with config.train.<flag> = value."""
  exp, state, task = bench_step.default_workload(hidden, layers, **{flag: value})
  return [exp, state, pipeline.prompt_batches(task.train, exp.tokenizer, global_batch_size=8,
                                              max_prompt_len=16, add_bos=False)]


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--flag", default="reuse_rollout_activations",
                 help="a boolean config.train field: A = False, B = True")
  p.add_argument("--hidden", type=int, default=256)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--pairs", type=int, default=24)
  args = p.parse_args()
  sides = {"A": side(args.hidden, args.layers, args.flag, False),
           "B": side(args.hidden, args.layers, args.flag, True)}

  def iterate(name):
    exp, state, data = sides[name]
    sides[name][1], metrics = trainer.rl_iteration(exp, state, next(data))
    return metrics

  for name in sides:  # compile and warm up
    iterate(name)
    iterate(name)
  rows = {"A": [], "B": []}
  for i in range(args.pairs):
    for name in ("A", "B") if i % 2 == 0 else ("B", "A"):
      rows[name].append(iterate(name))
  result = {"flag": args.flag, "A": False, "B": True, "hidden": args.hidden,
            "layers": args.layers, "pairs": args.pairs}
  for k in PHASES:
    a = np.array([m[k] for m in rows["A"]])
    b = np.array([m[k] for m in rows["B"]])
    result[k] = {"A_s": round(float(np.median(a)), 4), "B_s": round(float(np.median(b)), 4),
                 "median_pair_ratio_B_over_A": round(float(np.median(b / a)), 3)}
  print(json.dumps(result))


if __name__ == "__main__":
  main()

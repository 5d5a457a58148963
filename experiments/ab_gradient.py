r"""A/B of the update's gradient program with the head's gradient fused into the log-prob pass
(config.train.fused_head_grad, `rloo_jax/head_loss.py`) and without (autodiff's two passes over
the head): bench_step's workload at a compare_peers size, one rollout's update inputs, both
programs compiled on them and run alternately (A, B, then B, A, ...) in one process.

Prints one JSON line: each side's median seconds, the median of the per-pair ratios B / A, the
largest gradient difference relative to the largest gradient entry, and both losses.
Only the gradient program differs between the sides (the optimizer step is the same program),
so this is the part of the update the flag changes, without two trainers in memory (at (c) one
holds 12 GB).

    python experiments/ab_gradient.py --size b --pairs 10
    python experiments/ab_gradient.py --size c --pairs 4
    python experiments/ab_gradient.py --size c --pairs 3 --trainer 1

With `--trainer 1` it times whole RL iterations of one trainer instead, its update step
swapped between the two settings from one iteration to the next (pairs in alternating order,
after one pair that compiles): the update as the trainer runs it, between the other programs.
"""
import argparse
import functools
import json
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trace_programs  # noqa: E402
from ab_config import pair_summary  # noqa: E402
from compare_peers import SIZES, round_order  # noqa: E402

from rloo_jax import update  # noqa: E402
from rloo_jax.algorithms.rloo import RLOO  # noqa: E402


def in_trainer(algo, state, data, pairs: int) -> dict:
  """Whole RL iterations of one trainer whose update step is swapped between the two settings
  from one iteration to the next (one state, so one model's memory): {'A'|'B': [metrics]}."""
  c = algo.exp.config
  steps = {}
  for name, fused in (("A", False), ("B", True)):
    with c.unlocked():
      c.train.fused_head_grad = fused
    steps[name] = RLOO(algo.exp).step_fn
  assert (steps["A"].fused_head, steps["B"].fused_head) == (False, True), "a side's flag is off"
  rows = {"A": [], "B": []}
  for i in range(pairs + 1):  # the first pair compiles
    for name in round_order(i, ("A", "B")):
      algo.step_fn = steps[name]
      state, m = algo.iteration(state, next(data))
      if i:
        rows[name].append(m)
  return rows


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--size", default="b", choices=sorted(SIZES))
  p.add_argument("--pairs", type=int, default=6)
  p.add_argument("--trainer", type=int, default=0, choices=(0, 1),
                 help="1: whole RL iterations instead, the update step swapped between the "
                      "settings each iteration; medians of update_s and iteration_s")
  args = p.parse_args()
  if args.pairs < 1:
    p.error(f"--pairs must be >= 1, got {args.pairs}")
  hidden, layers, work = trace_programs.size_work(args.size)
  algo, state, data, (params, rows) = trace_programs.workload(hidden, layers, work=work)
  exp, c = algo.exp, algo.exp.config
  if args.trainer:
    del params, rows
    iterations = in_trainer(algo, state, data, args.pairs)
    result = {"size": args.size, "pairs": args.pairs, "trainer": 1,
              "A": "fused_head_grad=False", "B": "fused_head_grad=True"}
    for key in ("update_s", "iteration_s"):
      result[key] = pair_summary(*([m[key] for m in iterations[n]] for n in ("A", "B")))
    print(json.dumps(result))
    return
  programs = {name: jax.jit(functools.partial(
      update.gradients, fns=exp.fns, spec=exp.loss_spec, k=algo.k,
      chunk_size=int(c.train.logprob_chunk_size), fused_head=fused))
      for name, fused in (("A", False), ("B", True))}
  out = {name: jax.block_until_ready(programs[name](params, rows)) for name in programs}
  times = {"A": [], "B": []}
  for i in range(args.pairs):
    for name in round_order(i, ("A", "B")):
      t0 = time.perf_counter()
      jax.block_until_ready(programs[name](params, rows))
      times[name].append(time.perf_counter() - t0)
  ga, gb = (jax.tree.leaves(out[name][0]) for name in ("A", "B"))
  scale = max(float(np.abs(np.asarray(x)).max()) for x in ga)
  diff = max(float(np.abs(np.asarray(x) - np.asarray(y)).max()) for x, y in zip(ga, gb))
  print(json.dumps({
      "size": args.size, "pairs": args.pairs, "A": "fused_head_grad=False",
      "B": "fused_head_grad=True", **pair_summary(times["A"], times["B"]),
      "loss": [float(out["A"][1]), float(out["B"][1])],
      "max_grad_diff_over_max_grad": diff / scale}))


if __name__ == "__main__":
  main()

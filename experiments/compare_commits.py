r"""experiments/bench_step.py at two commits, side by side in one run: what a change bought.

Checks the base revision out into a temporary git worktree and runs bench_step.py from it and from
this working tree, one after the other, `--rounds` times, alternating which goes first (this
machine's speed drifts by 30% within minutes, so only pairs taken back to back are compared).
Prints one JSON line per size: the median over rounds of each phase (rollout, reference, update,
iteration) on both sides and the median per-round ratio new / base.

    python experiments/compare_commits.py --base c6819af --sizes 256x4,64x2 --rounds 3
    python experiments/compare_commits.py --base <rev> --sizes 256x4 --bench_args "--reward_delay_ms 200"
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from compare_trl import last_json

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PHASES = ("rollout_s", "reward_s", "reference_s", "update_s", "iteration_s")


def bench(root, hidden, layers, iterations, extra=()):
  cmd = [sys.executable, os.path.join(root, "experiments", "bench_step.py"), "--hidden", hidden,
         "--layers", layers, "--iterations", str(iterations), *extra]
  # PYTHONPATH first: the worktree's rloo_jax shadows the installed (editable) one.
  return last_json(cmd, env=dict(os.environ, PYTHONPATH=root), cwd=root)["median"]


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--base", required=True, help="git revision to compare against")
  p.add_argument("--sizes", default="256x4,64x2", help="hidden x layers, comma separated")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--iterations", type=int, default=10)
  p.add_argument("--bench_args", default="",
                 help="more bench_step.py flags for both sides, e.g. '--reward_delay_ms 200'")
  args = p.parse_args()
  with tempfile.TemporaryDirectory() as tmp:
    base_root = os.path.join(tmp, "base")
    subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", "-f", base_root, args.base],
                   check=True, capture_output=True)
    try:
      for size in args.sizes.split(","):
        hidden, layers = size.split("x")
        rounds = []
        for r in range(args.rounds):
          sides = [("base", base_root), ("new", ROOT)]
          res = {name: bench(root, hidden, layers, args.iterations, args.bench_args.split())
                 for name, root in (sides if r % 2 == 0 else sides[::-1])}
          rounds.append(res)
        med = lambda side, k: round(statistics.median(x[side][k] for x in rounds), 4)
        print(json.dumps({
            "hidden": int(hidden), "layers": int(layers), "base": args.base,
            "base_median": {k: med("base", k) for k in PHASES},
            "new_median": {k: med("new", k) for k in PHASES},
            "median_ratio_new_over_base": {
                k: round(statistics.median(x["new"][k] / x["base"][k] for x in rounds), 3)
                for k in PHASES},
            "rounds": rounds}), flush=True)
    finally:
      subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", base_root],
                     capture_output=True)


if __name__ == "__main__":
  main()

r"""What glibc's malloc with transparent huge pages is worth to each framework: compare_peers'
bench scripts at one of its sizes, each run in a process of its own, alternately without (A)
and with (B) GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (`compare_peers.malloc_env`).

XLA:CPU (ours, Tunix's) and torch's CPU allocator take every large buffer of a step from malloc,
and glibc hands buffers over its mmap threshold straight back to the kernel when they are freed:
the next step faults each one in again, 4 KiB at a time, zero-filled. With the tunable glibc
madvises its mappings for huge pages (where the kernel's THP mode is `madvise` or `always`), and
a fault brings in 2 MiB. Prints one JSON line: per side, the median seconds of A and B, the
median of the per-pair ratios B / A, and the median minor page faults of a run (the child's
`ru_minflt`); for rloo_jax also its rollout / reference / update.

    python experiments/ab_malloc.py --size c --pairs 2 --sides rloo_jax,trl
    python experiments/ab_malloc.py --size b --pairs 4
"""
import argparse
import json
import os
import resource
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab_config import pair_summary  # noqa: E402
import compare_peers  # noqa: E402
from compare_peers import SIZES, SIDES  # noqa: E402

PARTS = ("rollout_s", "reference_s", "update_s")


def run(side, python, args, env):
  """(step seconds, the run's JSON, its minor page faults) of one bench run."""
  before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt
  result, failure = compare_peers.run_side(python, compare_peers.SCRIPTS[side], args,
                                           mem_limit_gb=20.0, env=env or None)
  if failure is not None:
    raise SystemExit(f"{side} failed: {json.dumps(failure)}")
  faults = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt - before
  return compare_peers.step_seconds(side, result), result, faults


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--size", default="b", choices=sorted(SIZES))
  p.add_argument("--pairs", type=int, default=4)
  p.add_argument("--sides", default="rloo_jax", help="comma separated: rloo_jax, trl, tunix")
  p.add_argument("--trl_python", default=compare_peers.venv_python("trl"))
  p.add_argument("--tunix_python", default=compare_peers.venv_python("tunix"))
  args = p.parse_args(argv)
  sides = [s for s in args.sides.split(",") if s]
  if not sides or set(sides) - set(SIDES):
    p.error(f"--sides {args.sides!r}: choose among {', '.join(SIDES)}")
  if args.pairs < 1:
    p.error(f"--pairs must be >= 1, got {args.pairs}")
  pythons = {"rloo_jax": sys.executable, "trl": args.trl_python, "tunix": args.tunix_python}
  missing = [s for s in sides if not os.path.exists(pythons[s])]
  if missing:
    p.error(f"no interpreter for {missing}: set it up with experiments/setup_<side>_venv.sh")
  size = SIZES[args.size]
  common = compare_peers.bench_args(size)
  envs = {"A": compare_peers.malloc_env(False), "B": compare_peers.malloc_env(True)}
  out = {"size": args.size, "pairs": args.pairs, "env_B": envs["B"],
         "thp": compare_peers.thp_mode(), "load_before": [round(x, 2) for x in os.getloadavg()]}
  for side in sides:
    seconds, faults, parts = {"A": [], "B": []}, {"A": [], "B": []}, {"A": [], "B": []}
    for i in range(args.pairs):
      for name in compare_peers.round_order(i, ["A", "B"]):
        s, result, n = run(side, pythons[side], common + compare_peers.side_args(side), envs[name])
        seconds[name].append(s)
        faults[name].append(n)
        if side == "rloo_jax":
          parts[name].append(result["median"])
    line = dict(pair_summary(seconds["A"], seconds["B"]), A_runs_s=seconds["A"],
                B_runs_s=seconds["B"], A_minor_faults=int(statistics.median(faults["A"])),
                B_minor_faults=int(statistics.median(faults["B"])))
    if side == "rloo_jax":
      line["parts"] = {k: pair_summary([m[k] for m in parts["A"]], [m[k] for m in parts["B"]])
                       for k in PARTS}
    out[side] = line
  out["load_after"] = [round(x, 2) for x in os.getloadavg()]
  print(json.dumps(out), flush=True)


if __name__ == "__main__":
  main()

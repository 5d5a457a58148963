r"""Our rollout against transformers' generate, each in a process of its own: bench_sampler.py
run once per mode per round (`--modes ours,peer`, default shared,hf), the order alternating, and
the median of the per-round ratios (the peer's seconds over ours). In one process torch's
spinning OpenMP threads and allocations share the cores and caches with XLA's (at size (c)'s
shape that slowed our rollout by about a fifth on a 2-core CPU). Every other flag goes to
bench_sampler.py unchanged; both sides run with compare_peers' `--malloc_hugepages`. The hf mode
needs torch and transformers beside jax (`--python .venv-hf/bin/python`, docs/PERFORMANCE.md).

    python experiments/compare_generate.py --python .venv-hf/bin/python --rounds 2 \
        --prompt_len=64 --new_tokens=64 --repeats=3
"""
import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_peers import HUGEPAGES_TUNABLE, malloc_env, round_order, run_side  # noqa: E402


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--modes", default="shared,hf", help="ours,peer: two bench_sampler modes")
  p.add_argument("--rounds", type=int, default=2)
  p.add_argument("--python", default=sys.executable,
                 help="the interpreter of both sides (one with torch for the hf mode)")
  p.add_argument("--malloc_hugepages", type=int, default=1, choices=(0, 1),
                 help=f"1: both sides with GLIBC_TUNABLES={HUGEPAGES_TUNABLE}")
  args, sampler_args = p.parse_known_args()
  modes = args.modes.split(",")
  if len(modes) != 2 or len(set(modes)) != 2:
    p.error(f"--modes takes two different modes (ours,peer), got {args.modes!r}")
  if args.rounds < 1:
    p.error(f"--rounds must be >= 1, got {args.rounds}")
  env = malloc_env(bool(args.malloc_hugepages))
  rounds = []
  for i in range(args.rounds):
    order = round_order(i, modes)
    seconds, config = {}, None
    for mode in order:  # a new process each, no memory limit
      out, failure = run_side(args.python, "bench_sampler.py", [*sampler_args, f"--modes={mode}"],
                              mem_limit_gb=0, env=env or None)
      if failure is not None:
        raise SystemExit(f"bench_sampler.py --modes={mode} failed (exit "
                         f"{failure['returncode']}):\n{failure['output_tail']}")
      seconds[mode] = out["hf_generate_s" if mode == "hf" else f"{mode}_s"]  # median seconds
      config = out["config"]
    rounds.append(dict(order=order, seconds=seconds,
                       ratio=round(seconds[modes[1]] / seconds[modes[0]], 3)))
  ours, peer = modes
  print(json.dumps(dict(ours=ours, peer=peer, rounds=rounds,
                        median_ours_s=statistics.median(r["seconds"][ours] for r in rounds),
                        median_peer_s=statistics.median(r["seconds"][peer] for r in rounds),
                        median_ratio=statistics.median(r["ratio"] for r in rounds),
                        env=env, config=config)), flush=True)


if __name__ == "__main__":
  main()

r"""rloo_jax against TRL's RLOOTrainer and Tunix's GRPOLearner (RLOO advantages), side by side:
bench_step.py, bench_trl_rloo.py and bench_tunix_rloo.py, each in its own interpreter, in rounds
of the same work, the order rotating; a size's figure is the median of its rounds' ratios (work,
sizes, huge pages, memory limit: docs/PERFORMANCE.md "Against TRL and Tunix"). A missing peer is
skipped, a failed one reported and not rerun. One JSON line per size, then a summary.

    bash experiments/setup_peer_venvs.sh
    python experiments/compare_peers.py --sizes a,b --rounds 3
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

WORK = dict(heads=4, vocab=256, prompts=8, prompt_len=16, k=4, new_tokens=32)
SIZES = {  # (a), (b), (c) of docs/PERFORMANCE.md; t: tiny, for the test
    "a": dict(WORK, hidden=64, layers=2, iterations=8),
    "b": dict(WORK, hidden=256, layers=4, iterations=8),
    "c": dict(hidden=896, layers=24, heads=14, vocab=151936, prompts=4, prompt_len=64, k=4,
              new_tokens=64, iterations=2),
    "t": dict(hidden=32, layers=1, heads=2, vocab=256, prompts=2, prompt_len=4, k=2,
              new_tokens=4, iterations=2),
}
SIDES = ("rloo_jax", "trl", "tunix")
SCRIPTS = {"rloo_jax": "bench_step.py", "trl": "bench_trl_rloo.py", "tunix": "bench_tunix_rloo.py"}
# Fixed-length completions (Tunix's bench has no end token to begin with); TRL's torch threads.
TRL_THREADS = 2
SIDE_ARGS = {"rloo_jax": ["--fixed_length", "1"], "tunix": [],
             "trl": ["--fixed_length", "1", "--threads", str(TRL_THREADS)]}
HUGEPAGES_TUNABLE = "glibc.malloc.hugetlb=1"
OOM_MARKS = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "MemoryError",
             "can't allocate memory", "std::bad_alloc", "Cannot allocate memory")


def malloc_env(hugepages: bool) -> dict:
  """Every side's environment: glibc's malloc madvising huge pages or not (other tunables kept)."""
  given = os.environ.get("GLIBC_TUNABLES", "")
  tunables = [t for t in given.split(":") if t and t != HUGEPAGES_TUNABLE]
  if hugepages:
    return {"GLIBC_TUNABLES": ":".join(tunables + [HUGEPAGES_TUNABLE])}
  return {"GLIBC_TUNABLES": ":".join(tunables)} if HUGEPAGES_TUNABLE in given.split(":") else {}


def thp_mode() -> str:
  """The kernel's transparent huge page mode ('always', 'madvise', 'never'), or '' unknown."""
  path = "/sys/kernel/mm/transparent_hugepage/enabled"
  text = open(path).read() if os.path.exists(path) else ""
  return text[text.find("[") + 1:text.find("]")] if "[" in text else ""


def load():
  return [round(x, 2) for x in os.getloadavg()]


def bench_args(size):
  """The flags every bench script shares (workload.py's), at `size`."""
  return [x for name, v in size.items() for x in (f"--{name}", str(v))] + ["--dtype", "float32"]


def run_side(python, script, args, mem_limit_gb, env=None):
  """(result JSON, None) of one bench run, or (None, failure dict)."""
  def limit():
    if mem_limit_gb > 0:
      n = int(mem_limit_gb * 2**30)
      resource.setrlimit(resource.RLIMIT_DATA, (n, n))
  start = time.perf_counter()
  proc = subprocess.run([python, os.path.join(HERE, script), *args], check=False,
                        capture_output=True, text=True, preexec_fn=limit, cwd=REPO,
                        env=None if env is None else {**os.environ, **env})
  wall = round(time.perf_counter() - start, 2)
  lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
  if proc.returncode == 0 and lines:
    return dict(json.loads(lines[-1]), wall_s=wall), None
  text = proc.stdout + proc.stderr
  return None, dict(returncode=proc.returncode, wall_s=wall,
                    out_of_memory=any(m in text for m in OOM_MARKS) or proc.returncode == -9,
                    mem_limit_gb=mem_limit_gb, output_tail=text[-1500:])


def compare_size(name, size, pythons, rounds, mem_limit_gb, omp_wait_policy, malloc):
  """One size's line: every round's seconds and ratios, the medians, and the peers' fate."""
  # Torch's OpenMP threads spin while they wait: beside a busy process a 2-thread TRL step at (a)
  # took 2.9 s (0.23 s PASSIVE), while passive doubles it on a quiet machine (0.27 vs 0.13-0.16 s).
  envs = {side: dict(malloc) for side in SIDES}
  if omp_wait_policy:
    envs["trl"]["OMP_WAIT_POLICY"] = omp_wait_policy
  status = {side: {"skipped": f"no interpreter at {pythons[side]}; set it up with "
                              f"experiments/setup_peer_venvs.sh {side}"}
            for side in SIDES[1:] if not os.path.exists(pythons[side])}  # side -> why not run
  load_before = load()
  per_round, last = [], {}
  for r in range(rounds):
    order = SIDES[r % len(SIDES):] + SIDES[:r % len(SIDES)]  # the sides rotated r places
    row = {"order": [side for side in order if side not in status]}
    for side in row["order"]:
      result, failure = run_side(pythons.get(side, sys.executable), SCRIPTS[side],
                                 bench_args(size) + SIDE_ARGS[side], mem_limit_gb,
                                 envs[side] or None)
      if failure is not None:
        if side == "rloo_jax":
          sys.exit(f"rloo_jax failed at size {name}: {json.dumps(failure)}")
        status[side] = {"failed": failure, "round": r}
        continue
      last[side] = result
      row[f"{side}_s"] = (result["median"]["iteration_s"] if side == "rloo_jax"
                          else result["median_step_s"])
      row[f"{side}_wall_s"] = result["wall_s"]
      if "peak_rss_gb" in result:  # bench_step's and Tunix's (TRL's bench does not say)
        row[f"{side}_peak_rss_gb"] = result["peak_rss_gb"]
    row["rloo_jax_split_s"] = last["rloo_jax"]["median"]
    for peer in SIDES[1:]:
      if f"{peer}_s" in row:
        row[f"vs_{peer}"] = round(row[f"{peer}_s"] / row["rloo_jax_s"], 3)
    per_round.append(row)

  def median_of(xs):
    xs = list(xs)
    return round(statistics.median(xs), 5) if xs else None

  ours = last["rloo_jax"]
  out = {"size": name, **size, "dtype": "float32", "fixed_length": True,
         "params": ours["params"], "rounds": rounds, "trl_threads": TRL_THREADS,
         "trl_env": envs["trl"], "env": malloc, "thp": thp_mode(),
         "median_rloo_jax_iteration_s": median_of(row["rloo_jax_s"] for row in per_round),
         "median_rloo_jax_rollout_s": median_of(row["rloo_jax_split_s"]["rollout_s"]
                                                for row in per_round)}
  for peer in SIDES[1:]:
    for key, field in ((f"median_{peer}_step_s", f"{peer}_s"), (f"median_vs_{peer}", f"vs_{peer}")):
      out[key] = median_of(row[field] for row in per_round if field in row)
    if peer in status:
      out[f"{peer}_status"] = status[peer]
  out["versions"] = {"jax": ours["jax"]}
  if "trl" in last:
    out["versions"].update(trl=last["trl"]["trl"], torch=last["trl"]["torch"])
  if "tunix" in last:
    out["versions"].update(tunix=last["tunix"]["tunix"], tunix_jax=last["tunix"]["jax"])
  for peer in ("tunix", "trl"):
    if peer in last and last[peer]["params"] != ours["params"]:
      out["warning"] = f"{peer}'s model has {last[peer]['params']} params, ours {ours['params']}"
  return dict(out, load_before=load_before, load_after=load(), per_round=per_round)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--sizes", default="a,b", help="comma separated: a, b, c (and t, tiny)")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--iterations", type=int, default=0, help="timed iterations a run (0: the size's)")
  p.add_argument("--trl_python", default=os.path.join(REPO, ".venv-trl", "bin", "python"))
  p.add_argument("--tunix_python", default=os.path.join(REPO, ".venv-tunix", "bin", "python"))
  p.add_argument("--trl_omp_wait_policy", default="", choices=("", "PASSIVE", "ACTIVE"),
                 help="OMP_WAIT_POLICY of the TRL side ('': torch's default, spinning)")
  p.add_argument("--mem_limit_gb", type=float, default=20.0, help="RLIMIT_DATA, GiB (0: none)")
  p.add_argument("--malloc_hugepages", type=int, default=1, choices=(0, 1),
                 help=f"1: every side with GLIBC_TUNABLES={HUGEPAGES_TUNABLE}")
  args = p.parse_args(argv)
  sizes = [s for s in args.sizes.split(",") if s]
  unknown = [s for s in sizes if s not in SIZES]
  if unknown:
    p.error(f"unknown sizes {unknown}; known: {sorted(SIZES)}")
  pythons = {"trl": args.trl_python, "tunix": args.tunix_python}
  malloc = malloc_env(bool(args.malloc_hugepages))
  summary = {"summary": True, "rounds": args.rounds, "mem_limit_gb": args.mem_limit_gb,
             "env": malloc, "thp": thp_mode(), "load_before": load(), "sizes": {}}
  for name in sizes:
    size = dict(SIZES[name], **({"iterations": args.iterations} if args.iterations else {}))
    line = compare_size(name, size, pythons, args.rounds, args.mem_limit_gb,
                        args.trl_omp_wait_policy, malloc)
    print(json.dumps(line), flush=True)
    summary["sizes"][name] = {
        k: line[k] for k in ("median_rloo_jax_iteration_s", "median_trl_step_s",
                             "median_tunix_step_s", "median_vs_trl", "median_vs_tunix")}
    for peer in SIDES[1:]:
      st = line.get(f"{peer}_status")
      if st:
        summary["sizes"][name][f"{peer}_status"] = st.get("skipped") or (
            "out of memory" if st["failed"]["out_of_memory"]
            else f"failed (exit {st['failed']['returncode']})")
  summary["load_after"] = load()
  print(json.dumps(summary), flush=True)


if __name__ == "__main__":
  main()

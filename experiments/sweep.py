r"""Sweep runner: one workdir per (run, seed), resumable, every algorithm through one entry point.

A sweep file (configs/sweeps/*.py) defines CONFIG (the base get_config file, "path[:arg]"),
COMMON (dotted overrides for every run), SEEDS and get_sweep() -> [{"name": ..., dotted
overrides...}]; a run's `algorithm` override picks what `rloo_jax.algorithms.run` trains: 'rloo'
(the default, with any registered advantage estimator), 'ppo' or 'dpo'.

    python experiments/sweep.py --sweep=configs/sweeps/table1_arithmetic.py --root=runs/t1 \
        --seeds=0 --only=rloo_k4,ppo --sft_from=/tmp/rloo_arith   # --config_arg: docs/TASKS.md

<root>/<name>/seed<s>/ holds a run's metrics.jsonl, summary.json and run.json (name, overrides,
seed, wall time, command); a run with a summary.json is skipped: a killed sweep resumes. Every
run starts from one SFT policy, trained once in <root>/_shared (seed 0) or copied from
`--sft_from` (a workdir whose sft/ has the same base config); compiles cached in <root>/_jax_cache
(env JAX_COMPILATION_CACHE_DIR wins, as it does for rloo_jax.train).
"""
import argparse
import copy
import importlib.util
import json
import os
import shutil
import sys
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_config(spec: str):
  from rloo_jax import config_utils  # every rloo_jax import here is lazy: --help stays fast
  path, _, arg = spec.partition(":")
  return config_utils.load_config_file(os.path.join(REPO, path), arg)  # an absolute path wins


def apply_overrides(config, overrides: dict):
  """Dotted overrides ('kl.beta': 0.1); `name` is skipped; new leaves are allowed."""
  config = copy.deepcopy(config)
  with config.unlocked():
    for key, value in overrides.items():
      if key == "name":
        continue
      node = config
      *parents, leaf = key.split(".")
      for p in parents:
        if p not in node:
          import ml_collections
          node[p] = ml_collections.ConfigDict()
        node = node[p]
      node[leaf] = value
  return config


def load_sweep(path: str):
  spec = importlib.util.spec_from_file_location("sweep_module", os.path.join(REPO, path))
  m = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(m)
  runs = m.get_sweep()
  names = [r["name"] for r in runs]
  if len(set(names)) != len(names):
    raise ValueError(f"{path}: run names must be unique, got {names}")
  return m, runs


def prepare_shared(base, root: str, sft_from: str, log):
  """The sweep's one SFT policy (and prepared data) in <root>/_shared."""
  from rloo_jax import sft
  shared = os.path.join(root, "_shared")
  if base.model.get("init_from", "") or sft.is_cached(base, shared):
    return shared  # a checkpoint policy (the paper's configs) has no SFT stage to share
  os.makedirs(shared, exist_ok=True)
  if sft_from:
    src = os.path.join(sft_from, "sft", base.sft.cache_key, str(base.sft.steps))
    if not os.path.isdir(src):
      raise FileNotFoundError(f"--sft_from={sft_from}: no sft/{base.sft.cache_key}/"
                              f"{base.sft.steps} in it; train one with the sweep's base config")
    shutil.copytree(os.path.join(sft_from, "sft"), os.path.join(shared, "sft"))
    log(f"[sweep] shared SFT policy copied from {sft_from}")
    return shared
  from rloo_jax import experiment, policy_init
  config = copy.deepcopy(base)
  config.seed = 0
  policy_init.initial_params(experiment.build(config, shared), log=log)
  return shared


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--sweep", required=True, help="configs/sweeps/<file>.py")
  parser.add_argument("--root", required=True, help="directory holding one workdir per run")
  parser.add_argument("--seeds", default="", help="comma-separated; default: the sweep's SEEDS")
  parser.add_argument("--only", default="", help="comma-separated run names")
  parser.add_argument("--sft_from", default="", help="workdir whose sft/ to share")
  parser.add_argument("--config_arg", help="replaces the argument of the sweep's CONFIG (path:arg)")
  parser.add_argument("--dry_run", action="store_true", help="validate and list, train nothing")
  parser.add_argument("--quiet", action="store_true")
  args = parser.parse_args(argv)

  module, runs = load_sweep(args.sweep)
  seeds = [int(s) for s in args.seeds.split(",") if s] or list(getattr(module, "SEEDS", (0,)))
  if args.only:
    wanted = set(args.only.split(","))
    unknown = wanted - {r["name"] for r in runs}
    if unknown:
      raise ValueError(f"--only names {sorted(unknown)} are not in {args.sweep}")
    runs = [r for r in runs if r["name"] in wanted]
  spec = (module.CONFIG if args.config_arg is None
          else f"{module.CONFIG.partition(':')[0]}:{args.config_arg}")
  base = apply_overrides(load_config(spec), getattr(module, "COMMON", {}))
  # One SFT policy for every method and seed of the sweep (seeds vary the RL stage only).
  base.sft.cache_key = base.sft.cache_key or "sweep"
  log = (lambda *a, **k: None) if args.quiet else print
  # Seed-major order: a sweep cut short still has every method at the first seeds.
  configs = [(r, seed, apply_overrides(base, dict(r, seed=seed))) for seed in seeds for r in runs]
  validate_all([c for _, _, c in configs])
  root = os.path.abspath(args.root)
  if args.dry_run:
    for r, seed, _ in configs:
      print(f"{r['name']}/seed{seed}: {json.dumps({k: v for k, v in r.items() if k != 'name'})}")
    return

  import jax  # after argument parsing: --help and --dry_run stay fast
  if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):  # set: jax already uses it (cli's rule)
    jax.config.update("jax_compilation_cache_dir", os.path.join(root, "_jax_cache"))
  if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
  from absl import logging
  logging.set_verbosity(logging.WARNING)  # Orbax logs every file it writes at INFO
  from rloo_jax import algorithms
  shared = prepare_shared(base, root, args.sft_from, log)
  failed = []
  for r, seed, config in configs:
    workdir = os.path.join(root, r["name"], f"seed{seed}")
    if os.path.exists(os.path.join(workdir, "summary.json")):
      print(f"[sweep] {r['name']}/seed{seed}: done, skipped")
      continue
    os.makedirs(workdir, exist_ok=True)
    for sub in ("sft", "data"):
      src, dst = os.path.join(shared, sub), os.path.join(workdir, sub)
      if os.path.isdir(src) and not os.path.exists(dst):
        shutil.copytree(src, dst)
    print(f"[sweep] {r['name']}/seed{seed}: running in {workdir}", flush=True)
    t0 = time.time()
    try:
      summary = algorithms.run(config, workdir, log=log)
    except Exception:  # pylint: disable=broad-except
      traceback.print_exc()
      failed.append(f"{r['name']}/seed{seed}")
      continue
    info = dict(name=r["name"], seed=seed, overrides={k: v for k, v in r.items() if k != "name"},
                sweep=args.sweep, config=module.CONFIG, common=getattr(module, "COMMON", {}),
                algorithm=config.get("algorithm", "rloo"), wall_s=time.time() - t0,
                command=" ".join(["python", "experiments/sweep.py"] + sys.argv[1:]))
    with open(os.path.join(workdir, "run.json"), "w") as f:
      json.dump(info, f, indent=1, default=str)
    print(f"[sweep] {r['name']}/seed{seed}: {json.dumps(summary.get('after'))} "
          f"({info['wall_s']:.0f}s)", flush=True)
  if failed:
    raise SystemExit(f"[sweep] failed runs: {failed}")


def validate_all(configs):
  """Every run's config checked before anything trains: `algorithms.validate`'s checks, unbuilt."""
  from rloo_jax import algorithms, experiment
  for config in configs:
    experiment.validate_config(algorithms.resolve(config)[1])


if __name__ == "__main__":
  main()

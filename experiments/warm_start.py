r"""Seconds to the first iteration of the smoke config, first start beside second start.

Both starts are fresh processes sharing one new, empty persistent compilation cache
(config.train.compilation_cache_dir='auto', under a temporary $XDG_CACHE_HOME): the first
compiles every program and stores it, the second loads them. Each runs in its own new workdir,
so nothing but the cache carries over.

    python experiments/warm_start.py [--config=configs/arithmetic.py:smoke] [--rounds=1]
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def first_iteration_s(config: str, workdir: str, env: dict) -> float:
  """Wall seconds from the process's start to its '[rloo] iteration 1:' line."""
  cmd = [sys.executable, "-m", "rloo_jax.train", f"--config={config}", f"--workdir={workdir}",
         "--config.train.num_iterations=1", "--config.train.progress_bar=False",
         "--config.train.eval_every=0"]
  t0 = time.perf_counter()
  proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  seen = None
  for line in proc.stdout:
    if seen is None and "] iteration 1:" in line:
      seen = time.perf_counter() - t0
  if proc.wait() or seen is None:
    raise SystemExit(f"{' '.join(cmd)} failed (exit {proc.returncode})")
  return seen


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config", default="configs/arithmetic.py:smoke")
  p.add_argument("--rounds", type=int, default=1, help="cold/warm pairs, each with a new cache")
  args = p.parse_args()
  cold, warm = [], []
  for _ in range(args.rounds):
    with tempfile.TemporaryDirectory() as tmp:
      env = dict(os.environ, XDG_CACHE_HOME=os.path.join(tmp, "cache"))
      env.pop("JAX_COMPILATION_CACHE_DIR", None)  # it would win over the config's 'auto'
      cold.append(first_iteration_s(args.config, os.path.join(tmp, "wd1"), env))
      warm.append(first_iteration_s(args.config, os.path.join(tmp, "wd2"), env))
      cached = sum(len(f) for _, _, f in os.walk(os.path.join(tmp, "cache", "rloo_jax", "xla")))
  c, w = statistics.median(cold), statistics.median(warm)
  print(f"{args.config}: seconds to the first iteration, median of {args.rounds}: first start "
        f"{c:.1f}, second start {w:.1f} ({c / w:.2f}x; {cached} programs cached)")


if __name__ == "__main__":
  main()

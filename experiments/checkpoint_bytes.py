"""Bytes a run keeps in checkpoints: each checkpoint's, and the frozen reference's, stored once
per run in <workdir>/reference (code from before that change keeps it inside every checkpoint
and writes no reference/: run this script with that code on PYTHONPATH for the before figure).

Trains the given config (default: the smoke config, 3 iterations, a checkpoint each, 3 kept),
then prints one JSON line.

    python experiments/checkpoint_bytes.py
    PYTHONPATH=<a checkout of the older code> python experiments/checkpoint_bytes.py
"""
import argparse
import json
import os
import tempfile

from rloo_jax import algorithms, config_utils


def du(path: str) -> int:
  return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", default="configs/arithmetic.py:smoke")
  parser.add_argument("--iterations", type=int, default=3)
  args = parser.parse_args()
  path, _, arg = args.config.partition(":")
  config = config_utils.load_config_file(path, arg or None)
  config.train.num_iterations = args.iterations
  with tempfile.TemporaryDirectory() as wd:
    algorithms.run(config, wd, log=lambda *a, **k: None)
    ckpts = os.path.join(wd, "checkpoints")
    steps = {s: du(os.path.join(ckpts, s)) for s in sorted(os.listdir(ckpts), key=int)}
    reference = du(os.path.join(wd, "reference"))  # 0 where there is none
  total = sum(steps.values())
  print(json.dumps({"config": args.config, "checkpoint_bytes": steps,
                    "reference_bytes": reference,
                    "total_bytes": total + reference}),
        flush=True)


if __name__ == "__main__":
  main()

"""Seconds of a run started again in the same process (a notebook's second cell), with the
programs shared across builds (`rloo_jax.platform.jit`) and without; one JSON line.

    python experiments/rerun.py --config=configs/arithmetic.py:smoke --repeats 3
"""
import argparse
import json
import statistics
import tempfile
import time

import jax

from rloo_jax import algorithms, platform
from rloo_jax.config_utils import load_config_file

parser = argparse.ArgumentParser()
parser.add_argument("--config", default="configs/arithmetic.py:smoke")
parser.add_argument("--repeats", type=int, default=3)
args = parser.parse_args()
config = load_config_file(*args.config.split(":", 1))
out = {}
for shared in (True, False):
  jax.clear_caches()
  platform._SHARED.clear()  # pylint: disable=protected-access
  platform._SHARED_MAX = 256 if shared else 0  # pylint: disable=protected-access
  seconds = []
  for _ in range(1 + args.repeats):  # the first run traces, compiles or loads every program
    with tempfile.TemporaryDirectory() as workdir:
      start = time.perf_counter()
      algorithms.run(config, workdir, log=lambda *a: None)
      seconds.append(time.perf_counter() - start)
  out["shared" if shared else "not_shared"] = dict(
      first_s=round(seconds[0], 2), again_median_s=round(statistics.median(seconds[1:]), 2))
out["again_speedup"] = round(out["not_shared"]["again_median_s"]
                             / out["shared"]["again_median_s"], 1)
print(json.dumps(out))

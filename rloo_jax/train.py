r"""Entry point: train a policy with RLOO.

    python -m rloo_jax.train --config=configs/arithmetic.py --workdir=/tmp/rloo_arith
    python -m rloo_jax.train --config=configs/arithmetic.py:smoke --workdir=/tmp/smoke \
        --config.rloo.k=2

Multi-host: start the same command once per process (docs/SHARDING.md), e.g. two CPU processes:

    python -m rloo_jax.train --config=configs/arithmetic.py:smoke --workdir=/tmp/mp \
        --coordinator_address=127.0.0.1:12355 --num_processes=2 --process_id=0 --num_cpu_devices=4

The logic lives in `rloo_jax.algorithms` and `rloo_jax.loop` so it can be imported, tested and
driven from a notebook; `--config.algorithm=ppo|dpo` trains a baseline through the same loop.
Running again with the same workdir resumes from its newest checkpoint.
"""
import os
import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from rloo_jax import algorithms
from rloo_jax import checkpoint
from rloo_jax import cli
from rloo_jax import loop
from rloo_jax import rewards
from rloo_jax import processes
from rloo_jax import workdir as workdir_lib


_CONFIG = config_flags.DEFINE_config_file("config", None, "get_config(arg) file (path[:arg])",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "directory for checkpoints, logs and data")
flags.mark_flags_as_required(["config", "workdir"])
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "multi-process: host:port of process 0 for jax.distributed "
    "(default: env JAX_COORDINATOR_ADDRESS; unset = one process)")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None,
                                      "multi-process: number of processes (env JAX_NUM_PROCESSES)")
_PROCESS_ID = flags.DEFINE_integer("process_id", None,
                                   "multi-process: this process's id (env JAX_PROCESS_ID)")
_CPU_DEVICES = flags.DEFINE_integer("num_cpu_devices", None,
                                    "simulate this many CPU devices per process (testing)")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    # Orbax logs every file it writes at INFO; --verbosity=0 brings that back.
    logging.set_verbosity(logging.WARNING)
  # Before any other jax call: the device set is fixed once the backend starts.
  multi = processes.initialize_distributed(_COORDINATOR.value, _NUM_PROCESSES.value,
                                           _PROCESS_ID.value, _CPU_DEVICES.value)
  cache = cli.setup_compilation_cache(_CONFIG.value)
  line = cli.unshared_cache_line(cache) if multi else None  # a collective: every process
  if line:
    print(line, flush=True)
  try:
    result = algorithms.run(_CONFIG.value, _WORKDIR.value)
  except USER_ERRORS as e:
    _fail(e)
  if result.get("preempted"):
    print(f"[train] stopped by a signal after iteration {result['iterations']}, checkpoint "
          "saved: exit 0", flush=True)


# Errors that name a setting or a workdir problem and its fix: printed without a traceback
# (RLOO_JAX_TRACEBACK=1 shows it).
USER_ERRORS = (ValueError, FileNotFoundError, workdir_lib.WorkdirLockedError,
               loop.NonFiniteError, loop.UnscorableError, checkpoint.CheckpointMismatchError,
               checkpoint.CheckpointSaveError, rewards.RewardTimeoutError,
               rewards.RewardReturnError, rewards.RewardFunctionError)


def _fail(e: BaseException):
  if os.environ.get("RLOO_JAX_TRACEBACK"):
    raise e
  print(cli.error_line("rloo_jax.train", e), file=sys.stderr, flush=True)
  sys.exit(1)


def run():
  try:
    cli.check_overrides(sys.argv[1:])
  except (ValueError, FileNotFoundError) as e:
    _fail(e)
  app.run(main)


if __name__ == "__main__":
  run()

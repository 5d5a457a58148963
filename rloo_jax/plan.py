r"""Prints the memory plan of an RLOO job (a table, then one JSON line) without data or weights.

    python -m rloo_jax.plan --config=configs/arithmetic.py:smoke
    python -m rloo_jax.plan --config=configs/arithmetic.py --config.model.preset=qwen2.5-1.5b \
        --config.model.dtype=bfloat16 --config.mesh.data=1 --config.mesh.fsdp=8 --devices=8

--target=NAME compiles every program with that accelerator's own compiler, deviceless, on this
host (`memory.targets`: tpu-v5e-8, tpu-v5p-8, tpu-v6e-8, h100-8, h200-8, other chip counts by
topology; `pip install -e ".[plan]"` brings the compilers): its memory analysis, its cost
analysis (FLOPs, bytes accessed) and the device's memory. Without an accelerator compiler,
--devices=N compiles for N simulated CPU devices standing for an N-chip accelerator job: CPU
temporaries approximate an accelerator's, compiled without the float32 copies of bf16 weights
only XLA:CPU makes (`memory.programs.ACCELERATOR_OPTIONS`; --as_compiled keeps them); without
it the plan is for this machine's devices, as they compile.
--num_layers=L replaces the architecture's depth after the preset / checkpoint is resolved.
A job that fits also gets the faster settings its spare memory allows ("faster, and fits":
less rematerialisation, bigger microbatches, under FSDP a decode on layers gathered once;
`memory.speedups`), each compiled; --nospeedups skips those compiles.
Exits 0 whether or not the job fits (the JSON says); 1 on a config error.
"""
import json
import os
import sys

from absl import app
from absl import flags
from absl import logging
import jax
from ml_collections import config_flags

from rloo_jax import cli  # registers the list parser before the config flag is defined

_CONFIG = config_flags.DEFINE_config_file("config", None, "get_config(arg) file (path[:arg])",
                                          lock_config=True)
flags.mark_flags_as_required(["config"])
_TARGET = flags.DEFINE_string("target", None, "compile for this accelerator (tpu-v5p-8, h100-8, "
                               "...) with its own compiler, deviceless")
_DEVICES = flags.DEFINE_integer("devices", None, "simulate this many CPU devices (an estimate: "
                                "XLA:CPU's programs corrected for what XLA:CPU alone does)")
_MEMORY = flags.DEFINE_float("device_memory_gb", None, "memory per device, GiB (default: the "
                             "target's, else 80)")
_LAYERS = flags.DEFINE_integer("num_layers", None, "override the architecture's depth")
_AS_COMPILED = flags.DEFINE_bool(
    "as_compiled", False, "with --devices: the programs as XLA:CPU compiles them, float32 "
    "copies of 16-bit weights included, instead of as for an accelerator")
_SPEEDUPS = flags.DEFINE_bool(
    "speedups", True, "a job that fits: also the faster settings its spare memory allows "
    "(less rematerialisation, bigger microbatches), each compiled to check it fits")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  if _DEVICES.value and not _TARGET.value:
    # Before any device is touched: the device set is fixed once the backend starts, and an
    # accelerator left out of it is never initialised (nor its memory preallocated).
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", int(_DEVICES.value))
  cli.setup_compilation_cache(_CONFIG.value)  # a --target turns it off (memory.targets)
  # Imported after the device set is fixed (nothing they import may touch a device, but the
  # order keeps it so).
  from rloo_jax import algorithms, experiment, memory  # pylint: disable=import-outside-toplevel
  from rloo_jax.memory import budget, targets  # pylint: disable=import-outside-toplevel
  try:
    if _TARGET.value and _DEVICES.value:
      raise ValueError("--target and --devices: give one (--target compiles for the "
                       "accelerator itself, --devices simulates CPU devices)")
    # The target's compiler gives the devices (and keeps this host's backend to the CPU).
    target = targets.parse(_TARGET.value) if _TARGET.value else None
    devices = targets.devices(target) if target else None
    # The run's checks, without resolving config.rewards: the plan needs no reward.
    checked = algorithms.validate(_CONFIG.value, devices=devices, with_rewards=False)
    if checked.name != "rloo":
      raise ValueError(f"config.algorithm={checked.name!r}: the memory plan covers the RLOO "
                       "programs only (config.algorithm='rloo')")
    exp = experiment.build_abstract(checked.config, devices=devices, num_layers=_LAYERS.value)
    memory_gb = _MEMORY.value or (target.memory_gb if target else memory.DEFAULT_DEVICE_MEMORY_GB)
    accelerator = bool(_DEVICES.value) and not _AS_COMPILED.value
    algo, report = budget.resolve(algorithms.ALGORITHMS["rloo"](exp), device_memory_gb=memory_gb,
                                  accelerator=accelerator, log=lambda s: print(s, file=sys.stderr))
    if report is None or _SPEEDUPS.value:  # the speed-ups compile variants the pick did not
      report = memory.plan(algo, device_memory_gb=memory_gb, accelerator=accelerator,
                           speedups=_SPEEDUPS.value, log=lambda s: print(s, file=sys.stderr))
  except (ValueError, FileNotFoundError) as e:
    if os.environ.get("RLOO_JAX_TRACEBACK"):
      raise
    print(f"rloo_jax.plan: error: {e}", file=sys.stderr, flush=True)
    sys.exit(1)
  report["target"] = (dict(name=target.name, platform=target.platform, chips=target.chips)
                      if target else None)
  if not target and report["platform"] == "cpu":
    report["estimate"] = ("XLA:CPU's programs" + (", corrected for what XLA:CPU alone does"
                                                  if report["accelerator_view"] else "")
                          + "; --target=<tpu-v5p-8|h100-8|...> compiles with the accelerator's "
                          "own compiler")
  print(memory.format_table(report))
  print(json.dumps(report), flush=True)


def run():
  try:
    cli.check_overrides(sys.argv[1:])
  except (ValueError, FileNotFoundError) as e:
    print(f"rloo_jax.plan: error: {e}", file=sys.stderr, flush=True)
    sys.exit(1)
  app.run(main)


if __name__ == "__main__":
  run()

"""Shared pytest setup: tests run on CPU; multi-device tests spawn their own processes.

Compiled XLA programs are cached on disk (the variables are inherited by the subprocesses the
resume, sharding and notebook tests start), so a program compiled once in a run is not compiled
again by a child process: compile time dominates this suite on a 2-core CPU.

`load_config` is a plain function, imported by the tests as `from conftest import load_config`
(pytest puts this directory on sys.path; subprocesses get it through the PYTHONPATH set below).
"""
import gc
import os
import socket
import subprocess
import sys
import tempfile

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
# This checkout's rloo_jax, here and in every subprocess the tests start (scripts in experiments/,
# `python -m rloo_jax.train`), whichever checkout `pip install -e` last pointed at.
sys.path.insert(0, REPO)
os.environ["PYTHONPATH"] = os.pathsep.join([REPO, TESTS] + [
    p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p not in ("", REPO, TESTS)])
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), "rloo_jax_test_xla_cache"))
# Every program, however small: the tests build the same few tiny models again and again, and a
# warm suite loads them from disk (the suite at 0.2 s: a third slower, cold or warm).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


def _xla_knows(flag: str) -> bool:
  """Whether this jaxlib's XLA takes `flag`: one it does not know in XLA_FLAGS aborts the process
  (jaxlib 0.12 has no --xla_cpu_use_fusion_emitters), so a child process tries it."""
  probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"],
                         env=dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu"),
                         capture_output=True, check=False)
  return probe.returncode == 0


# The suite's own CPU codegen where the caller set no optimisation level (.ci/run's numerics
# rerun sets one, and compiles with XLA's default emitters), a flag the caller set kept: the tests'
# tiny programs cost more to compile than to run, and LLVM unoptimised with XLA:CPU's older fusion
# emitters (not the MLIR ones) compiles the whole suite in about half the time (README). The
# xdist workers inherit the flags, so only the first process probes.
_flags = os.environ.get("XLA_FLAGS", "")
if "--xla_backend_optimization_level" not in _flags:
  _flags += " --xla_backend_optimization_level=0"
  _emitters = "--xla_cpu_use_fusion_emitters=false"
  if "--xla_cpu_use_fusion_emitters" not in _flags and _xla_knows(_emitters):
    _flags += " " + _emitters
  os.environ["XLA_FLAGS"] = _flags.strip()

# Tracing makes millions of short-lived objects: at Python's default thresholds a collection
# runs every 700 allocations and the older generations' walk every live jaxpr again and again.
gc.set_threshold(100_000, 50, 1000)

import jax  # noqa: E402  (after the environment above)
import pytest  # noqa: E402

from rloo_jax import config_utils  # noqa: E402  (after the environment above: it imports jax)

gc.freeze()  # the modules imported so far live as long as the worker: no collection walks them


def load_config(arg="smoke", name="arithmetic"):
  """`get_config(arg)` of configs/<name>.py (the shrunk smoke config by default)."""
  return config_utils.load_config_file(os.path.join(REPO, "configs", f"{name}.py"), arg)


def count_traces(monkeypatch, module, name: str) -> list:
  """A list that grows by one each time `module.<name>` runs in Python: for a function a
  program jits, once per trace, so its length is how many times the program was compiled."""
  calls, real = [], getattr(module, name)

  def counted(*args, **kwargs):
    calls.append(1)
    return real(*args, **kwargs)
  monkeypatch.setattr(module, name, counted)
  return calls


def free_port() -> int:
  """A free TCP port on 127.0.0.1: the jax.distributed coordinator of a multi-process test."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_processes(commands, *, env, timeout: float, cwd=None):
  """Starts every command (an argument list) at once, stdout and stderr merged, and returns
  [(returncode, log)] in order. Whatever is still running when one times out or fails to
  finish is killed: a process that failed leaves the others waiting on the coordinator."""
  procs = [subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for cmd in commands]
  try:
    logs = [p.communicate(timeout=timeout)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  return [(p.returncode, log) for p, log in zip(procs, logs)]


# The files that take longest (summed test durations, `--durations=60`, two workers), longest
# first: xdist hands out whole files in collection order (pytest.ini), so starting these first
# keeps one of them from being the tail that runs alone at the end.
SLOWEST_FIRST = ("test_sharding.py", "test_packing.py", "test_plan.py", "test_experiments_tools.py",
                 "test_reliability.py", "test_trainer.py", "test_attention_ops.py", "test_engine.py",
                 "test_trim.py", "test_paper_configs.py", "test_models.py", "test_loss.py",
                 "test_notebook.py", "test_experiments.py", "test_lora_train.py",
                 "test_hf_reward_source.py", "test_offpolicy.py", "test_export.py",
                 "test_head_loss.py", "test_sampler.py", "test_sampling.py", "test_winrate.py",
                 "test_reward_model.py", "test_lora_export.py", "test_policy.py")


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
  items.sort(key=lambda item: rank.get(os.path.basename(str(item.fspath)), len(rank)))


# The settings that enter every program's compilation-cache key beside the program (the cache
# directory is XLA's autotune directory in the compile options): a file that changes one makes
# every later file on its worker compile anew, in every run.
_CACHE_SETTINGS = ("jax_enable_compilation_cache", "jax_compilation_cache_dir",
                   "jax_persistent_cache_min_compile_time_secs")


def _cache_settings() -> dict:
  return {**{name: getattr(jax.config, name) for name in _CACHE_SETTINGS},
          "XLA_FLAGS": os.environ.get("XLA_FLAGS")}


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs(request):
  """Each test file's compiled programs released after it (the disk cache keeps them): kept,
  a worker's executables' memory mappings near Linux's vm.max_map_count by the suite's end, where
  XLA segfaults mapping one more, and the suite runs no faster. The cache's settings are put
  back after a file that changed them, which fails unless it sets CHANGES_COMPILATION_CACHE."""
  before = _cache_settings()
  yield
  jax.clear_caches()
  gc.collect()  # the file's garbage cycles, which the thresholds above leave for later
  changed = {k: v for k, v in _cache_settings().items() if v != before[k]}
  if changed:
    for name in set(changed) & set(_CACHE_SETTINGS):
      jax.config.update(name, before[name])
    if "XLA_FLAGS" in changed:
      os.environ["XLA_FLAGS"] = before["XLA_FLAGS"]
    if getattr(request.module, "CHANGES_COMPILATION_CACHE", False):
      return  # on purpose, and said in the file
    pytest.fail(f"{request.module.__name__} changed {changed} (was "
                f"{ {k: before[k] for k in changed} }): later files on this worker would compile "
                "anew; monkeypatch jax.config.update or the environment instead")

"""Shared pytest setup: tests run on CPU; multi-device tests spawn their own processes.

Compiled XLA programs are cached on disk (the variables are inherited by the subprocesses the
resume, sharding and notebook tests start), so a program compiled once in a run is not compiled
again by a child process: compile time dominates this suite on a 2-core CPU.

`load_config` is a plain function, imported by the tests as `from conftest import load_config`
(pytest puts this directory on sys.path; subprocesses get it through PYTHONPATH or by running a
script from here).
"""
import importlib.util
import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), "rloo_jax_test_xla_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)


def load_config(arg="smoke", name="arithmetic"):
  """`get_config(arg)` of configs/<name>.py (the shrunk smoke config by default)."""
  spec = importlib.util.spec_from_file_location(f"{name}_cfg",
                                                os.path.join(REPO, "configs", f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)

"""Shared pytest setup: tests run on CPU; multi-device tests spawn their own processes.

Compiled XLA programs are cached on disk (the variables are inherited by the subprocesses the
resume, sharding and notebook tests start), so a program compiled once in a run is not compiled
again by a child process: compile time dominates this suite on a 2-core CPU.
"""
import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), "rloo_jax_test_xla_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

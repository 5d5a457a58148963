"""Shared pytest setup: tests run on CPU; multi-device tests spawn their own processes."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

"""The mesh the model's programs are traced for, set around a run's and a plan's tracing
(`on_mesh`): what the model reads of the job's devices while it builds a program.

- `platform()`: their platform, which `config.model.attention='auto'` picks its kernel by (a
  compile-only TPU topology or GPU target included; the host's default backend is not it).
- `batch_ways()`: how many shards the batch axes split rows into ('data' x 'fsdp'), which the
  grouped forward shapes its rows by.
- `get()`: the mesh itself, over which 'splash' runs its Pallas kernel per shard (XLA cannot
  partition a Pallas call).

Not `jax.set_mesh`: under a context mesh flax reads the parameters' logical axis names as mesh
axes. Outside `on_mesh` the program is built for one device of the default backend.
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import jax

_MESH = contextvars.ContextVar('traced_mesh', default=None)
BATCH_AXES = ('data', 'fsdp')


@contextlib.contextmanager
def on_mesh(mesh):
  """Programs traced inside are built for `mesh` (a `jax.sharding.Mesh`)."""
  token = _MESH.set(mesh)
  try:
    yield
  finally:
    _MESH.reset(token)


def get():
  return _MESH.get()


def platform() -> str:
  mesh = _MESH.get()
  return (jax.devices() if mesh is None else mesh.devices.flat)[0].platform


def batch_ways() -> int:
  mesh = _MESH.get()
  if mesh is None:
    return 1
  return math.prod(mesh.shape[a] for a in BATCH_AXES if a in mesh.axis_names)

"""The mesh the model's programs are traced for, set around a run's and a plan's tracing
(`on_mesh`): what the model reads of the job's devices while it builds a program.

- `platform()`: their platform, which `config.model.attention='auto'` picks its kernel by (a
  compile-only TPU topology or GPU target included; the host's default backend is not it).
- `batch_ways()`: how many shards the batch axes split rows into ('data' x 'fsdp'), which the
  grouped forward shapes its rows by.
- `per_shard(fn, args, heads)`: `fn` run per shard of it (`shard_map`): 'splash' and the paged
  decode kernel, Pallas calls XLA cannot partition, and 'blockwise', whose loops then run to
  each device's own bounds.
- `shards_vmapped()`: inside the rollout engine's vmap over its batch shards (`vmapped_shards`),
  whose axis the vmap lays over the batch axes (its `spmd_axis_name`): there `per_shard` splits
  only the heads, each device's shard of the vmapped axis coming in whole.

Not `jax.set_mesh`: under a context mesh flax reads the parameters' logical axis names as mesh
axes. Outside `on_mesh` the program is built for one device of the default backend.
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import jax
from jax.sharding import PartitionSpec as P

_MESH = contextvars.ContextVar('traced_mesh', default=None)
_VMAPPED = contextvars.ContextVar('traced_mesh_shards_vmapped', default=None)
BATCH_AXES = ('data', 'fsdp')


@contextlib.contextmanager
def on_mesh(mesh):
  """Programs traced inside are built for `mesh` (a `jax.sharding.Mesh`)."""
  token = _MESH.set(mesh)
  try:
    yield
  finally:
    _MESH.reset(token)


@contextlib.contextmanager
def vmapped_shards(axes):
  """Traced inside: code vmapped over the batch shards (the rollout engine's) by
  `jax.vmap(..., spmd_axis_name=axes)`, `axes` the batch axes the shards lie over (None: one
  shard). `per_shard` then leaves the rows (a shard's own, not the mesh's) to the vmap."""
  token = _VMAPPED.set(axes)
  try:
    yield
  finally:
    _VMAPPED.reset(token)


def shards_vmapped() -> bool:
  mesh = _MESH.get()
  return _VMAPPED.get() is not None and mesh is not None and mesh.size > 1


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


def per_shard(fn, args, heads, out_head):
  """fn(*args) per shard of the traced mesh: each array's axis 0 (rows) over the batch axes, its
  axis heads[i] (None: none) over 'tensor' where that divides every such axis, a scalar or None
  whole (an array whose heads are its axis 0 has no rows); the output's rows and axis
  `out_head` alike (a tuple: one per output). fn(*args) as it is without a mesh of several
  devices or where neither the rows nor the heads split, except under `vmapped_shards`: there fn
  runs on each device's shard (a Pallas call must), the rows left to the vmap."""
  mesh = _MESH.get()
  if mesh is None or mesh.size == 1:
    return fn(*args)
  vmapped = shards_vmapped()
  b = next(x.shape[0] for x in args if x is not None and x.ndim)
  rows = tuple(a for a in BATCH_AXES if a in mesh.axis_names and mesh.shape[a] > 1)
  rows = rows if rows and b % math.prod(mesh.shape[a] for a in rows) == 0 else None
  rows = None if vmapped else rows  # the vmap lays its own axis over them
  tensor = mesh.shape['tensor'] if 'tensor' in mesh.axis_names else 1
  # Every headed axis splits, or none: a query's heads split apart from its keys' would pair
  # each device's queries with the wrong key heads.
  split = tensor > 1 and all(args[i].shape[h] % tensor == 0 for i, h in enumerate(heads)
                             if h is not None and args[i] is not None)
  if rows is None and not split and not vmapped:
    return fn(*args)  # nothing splits: XLA's own partitioning, as without a mesh

  def spec(ndim, head):
    dims = [rows if head != 0 else None] + [None] * (ndim - 1)
    if head is not None and split:
      dims[head] = 'tensor'
    return P(*dims)

  given = [i for i, x in enumerate(args) if x is not None]

  def local(*xs):
    full = list(args)
    for i, x in zip(given, xs):
      full[i] = x
    return fn(*full)

  in_specs = tuple(P() if args[i].ndim == 0 else spec(args[i].ndim, heads[i]) for i in given)
  out = (tuple(spec(h + 1, h) for h in out_head) if isinstance(out_head, tuple)
         else spec(out_head + 1, out_head))
  return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out,
                       check_vma=False)(*(args[i] for i in given))

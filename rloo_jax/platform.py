"""What a program compiles with on each platform: the XLA options a mesh's devices need, and a
jit that applies them (`jit_by_platform`), so one code path serves CPU, TPU and GPU meshes."""

from __future__ import annotations

import collections
import functools
from typing import Optional

import jax
from jax._src import core as jax_core  # trace_state_clean: no public equivalent


# The GPU compiler's Triton GEMM emitter finds no tiling for some fused matmuls of these programs
# (H100, XLA 0.10.2: `Couldn't find output tile sizes` on a bf16[10208, 1536] dot of Qwen2.5-1.5B's
# backward at 64 x 4 x (256 + 256), and on the TL;DR smoke's prefill); cuBLAS takes any shape.
# Set on the programs of a GPU mesh only (tests/test_accelerator_compile.py).
GPU_COMPILER_OPTIONS = {"xla_gpu_enable_triton_gemm": False}


def compiler_options(sharding) -> Optional[dict]:
  """The XLA options a program whose arrays carry `sharding` compiles with (None: defaults)."""
  if sharding is None:
    return None
  return dict(GPU_COMPILER_OPTIONS) if next(iter(sharding.device_set)).platform == "gpu" else None


class jit_by_platform:  # pylint: disable=invalid-name
  """`jax.jit(fn, **kw)` compiled with the `compiler_options` of `sharding` (or of the call's
  `batch_sharding` keyword): the GPU options on a GPU mesh, none elsewhere. Traced inside another
  program (eval_shape, an enclosing jit), it takes that program's options."""

  def __init__(self, fn, sharding=None, **kw):
    self._fn, self._sharding, self._kw, self._jits = fn, sharding, kw, {}
    functools.update_wrapper(self, fn)

  def _jit(self, kw):
    nested = not jax_core.trace_state_clean()
    options = None if nested else compiler_options(self._sharding or kw.get("batch_sharding"))
    key = tuple(sorted(options.items())) if options else ()
    if key not in self._jits:
      self._jits[key] = jax.jit(self._fn, compiler_options=options, **self._kw)
    return self._jits[key]

  def __call__(self, *args, **kw):
    return self._jit(kw)(*args, **kw)

  def lower(self, *args, **kw):
    return self._jit(kw).lower(*args, **kw)

  def _cache_size(self) -> int:
    return sum(j._cache_size() for j in self._jits.values())  # pylint: disable=protected-access


# The programs `jit` shared, least recently asked for first: enough for a run, its memory plan
# and a rebuilt experiment or two (jax.clear_caches() still drops their compiled executables).
_SHARED: collections.OrderedDict = collections.OrderedDict()
_SHARED_MAX = 256


def _key(x):
  """A hashable value equal for equal static arguments (a function by identity, a pytree by its
  structure and leaves); TypeError where a leaf is unhashable (an array)."""
  if isinstance(x, functools.partial):  # compared by identity otherwise
    return x.func, _key(x.args), _key(x.keywords)
  leaves, treedef = jax.tree.flatten(x)
  if treedef.num_nodes == 1 and treedef.num_leaves == 1:
    hash(x)
    return x
  return treedef, tuple(_key(leaf) for leaf in leaves)


def jit(fn, *, sharding=None, **kw) -> jit_by_platform:
  """`jit_by_platform(fn, sharding, **kw)`, one object for equal arguments (`fn` a
  functools.partial of equal arguments, equal shardings): an experiment built again, a memory
  plan's candidates or a notebook's second run trace and lower each program once."""
  try:
    key = _key((fn, sharding, kw))
  except TypeError:  # an array among the arguments: a program of its own
    return jit_by_platform(fn, sharding, **kw)
  hit = _SHARED.pop(key, None) or jit_by_platform(fn, sharding, **kw)
  _SHARED[key] = hit
  if len(_SHARED) > _SHARED_MAX:
    _SHARED.popitem(last=False)
  return hit

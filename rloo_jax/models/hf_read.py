"""Reading safetensors checkpoints for the import: `_Tensors` (name -> tensor, whole or as slices),
`_View` (a torch tensor's conversion to our layout, also per device block) and `_putters`, which
fill the abstract model's parameters, whole or straight into their shardings."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from rloo_jax.models.config import TransformerConfig


def _read_json(path: str) -> dict:
  with open(path) as f:
    return json.load(f)


class _Tensors:
  """Lazy name -> numpy array lookup over one safetensors file or a sharded index."""

  def __init__(self, path: str, arch: str):
    from safetensors import safe_open  # import here so the model code does not need it

    self.arch, self.path = arch, path
    index = os.path.join(path, 'model.safetensors.index.json')
    single = os.path.join(path, 'model.safetensors')
    if os.path.exists(index):
      self.file_of = {k: os.path.join(path, f) for k, f in _read_json(index)['weight_map'].items()}
    elif os.path.exists(single):
      with safe_open(single, framework='numpy') as f:
        self.file_of = {k: single for k in f.keys()}
    else:
      raise ValueError(f'{path}: no model.safetensors or model.safetensors.index.json '
                       '(only safetensors checkpoints are supported)')
    self._open, self._safe_open = {}, safe_open

  def __contains__(self, key: str) -> bool:
    return key in self.file_of

  def _file(self, key: str):
    if key not in self.file_of:
      raise ValueError(f'{self.arch}: tensor {key!r} missing from the checkpoint in {self.path}')
    fname = self.file_of[key]
    if fname not in self._open:
      # 'flax' rather than 'numpy': numpy's safetensors reader rejects bfloat16.
      self._open[fname] = self._safe_open(fname, framework='flax')
    return self._open[fname]

  def __call__(self, key: str) -> np.ndarray:
    return np.asarray(self._file(key).get_tensor(key))

  def shape(self, key: str) -> tuple:  # from the file's header: reads no data
    return tuple(self._file(key).get_slice(key).get_shape())

  def read(self, key: str, index: tuple) -> np.ndarray:  # tensor[slices], reading only those
    return np.asarray(self._file(key).get_slice(key)[index])


@dataclasses.dataclass(frozen=True)
class _View:
  """A torch tensor's conversion to our layout: `fn` for the whole tensor, `out` the source of
  each output axis, so a sharded load reads just the slice a device's block needs (`block`). An
  int: that raw axis whole; (r, 'h') / (r, 'd'): the heads / head_dim factor of raw axis r, laid
  out `offset` + heads x `group` x `d`, this tensor at place `j` of each group (GPT-2's fused
  c_attn: offset j * E; GPT-NeoX's per-head q, k, v: group 3). None: the tensor as it is."""
  fn: Callable = lambda w: w
  out: Any = None
  h: int = 0
  d: int = 0
  group: int = 1
  j: int = 0
  offset: int = 0
  total: int = 0  # the raw split axis's size (0: h * group * d)

  def shape(self, raw: tuple) -> tuple | None:
    """The converted shape from the raw one alone; None where the tensor does not fit."""
    axes, size = self.out or tuple(range(len(raw))), self.total or self.h * self.group * self.d
    if {o if isinstance(o, int) else o[0] for o in axes} != set(range(len(raw))) or any(
        not isinstance(o, int) and raw[o[0]] != size for o in axes):
      return None
    return tuple(raw[o] if isinstance(o, int) else self.h if o[1] == 'h' else self.d for o in axes)

  def block(self, read: Callable, ndim: int, index: list) -> np.ndarray:
    """fn(tensor)[index] (index: (start, stop) per output axis) from read(raw slices), which
    covers no more of the tensor than the block needs (all of each group, for group > 1)."""
    axes, raw, split = self.out or tuple(range(ndim)), [slice(None)] * ndim, None
    for o, (a, b) in zip(axes, index):
      if isinstance(o, int):
        raw[o] = slice(a, b)
      elif o[1] == 'h':
        span, split, heads = self.group * self.d, o[0], b - a
        raw[split] = slice(self.offset + a * span, self.offset + b * span)
      else:
        dims = slice(a, b)
    blk, labels = read(tuple(raw)), list(range(ndim))
    if split is not None:
      blk = blk.reshape(blk.shape[:split] + (heads, self.group, self.d) + blk.shape[split + 1:])
      blk = blk[(slice(None),) * (split + 1) + (self.j, dims)]
      labels[split:split + 1] = [(split, 'h'), (split, 'd')]
    return blk.transpose([labels.index(o) for o in axes])


_T = _View(lambda w: w.T, (1, 0))
H0, D0, H1, D1 = (0, 'h'), (0, 'd'), (1, 'h'), (1, 'd')  # heads / head_dim of raw axis 0 or 1


def _putters(get: _Tensors, c: TransformerConfig, dtype, shard_of=None):
  """(put, layer): put(var, key, view) fills a parameter with view(tensor `key`); layer(var, key,
  view) a stacked layer parameter (`key` formats the layer index). With `shard_of` (var ->
  NamedSharding) each device's block is read as slices of the files (`_View.block`)."""
  def fill(var, keys, view, stacked):
    want = tuple(var.shape[stacked:])
    for i, key in enumerate(keys):  # headers only: a wrong tensor fails before any is read
      if view.shape(get.shape(key)) != want:
        where = f' (layer {i} of the {c.family} model)' if stacked else ''
        raise ValueError(f'tensor {key!r} has shape {get.shape(key)}, which does not fit '
                         f'{want}{where}')
    if shard_of is None:  # whole tensors, converted one at a time
      values = [np.asarray(view.fn(get(key)), dtype) for key in keys]
      return var.set_value(jnp.asarray(np.stack(values) if stacked else values[0]))

    def block(key, bounds):  # one tensor's part of this device's block, in the param dtype
      return np.asarray(view.block(lambda r: get.read(key, r), len(get.shape(key)), bounds), dtype)

    sharding, shape, arrays, first = shard_of(var), tuple(var.shape), [], {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
      bounds = tuple(s.indices(n)[:2] for s, n in zip(index, shape))
      if bounds not in first:  # a replica is copied from the first device holding it, not read
        # Layer slices go to the device as read, stacked there: the host holds one at a time.
        first[bounds] = (jnp.stack([jax.device_put(block(keys[i], bounds[1:]), device)
                                    for i in range(*bounds[0])]) if stacked else
                         jax.device_put(block(keys[0], bounds), device))
      arrays.append(jax.device_put(first[bounds], device))
    var.set_value(jax.make_array_from_single_device_arrays(shape, sharding, arrays))

  def put(var, key, view=_View()):
    fill(var, [key], view, False)

  def layer(var, key, view=_View()):
    fill(var, [key.format(i) for i in range(c.num_layers)], view, True)
  return put, layer

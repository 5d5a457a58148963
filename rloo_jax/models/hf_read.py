"""Reading safetensors checkpoints for the import: `_Tensors` (name -> tensor, whole or as slices),
`_View` (a torch tensor's conversion to our layout, also per device block) and `_putters`, which
fill the abstract model's parameters, whole or straight into their shardings."""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
from typing import Any, Callable

import jax
import ml_dtypes
import numpy as np

from rloo_jax.models.config import TransformerConfig


def _read_json(path: str) -> dict:
  with open(path) as f:
    return json.load(f)


# safetensors dtype names -> numpy (the format is little-endian; ml_dtypes adds bfloat16 and fp8).
_DTYPES = {'F64': '<f8', 'F32': '<f4', 'F16': '<f2', 'BF16': ml_dtypes.bfloat16,
           'F8_E4M3': ml_dtypes.float8_e4m3fn, 'F8_E5M2': ml_dtypes.float8_e5m2,
           'I64': '<i8', 'I32': '<i4', 'I16': '<i2', 'I8': 'i1', 'U64': '<u8', 'U32': '<u4',
           'U16': '<u2', 'U8': 'u1', 'BOOL': '?'}
# A strided slice is read in row bands of about this size, so the host holds one band, not the
# span of the tensor between the slice's first and last byte.
_BAND_BYTES = 16 << 20
# Runs at least this long are read one pread each; shorter ones in bands that are then sliced:
# a syscall per short row costs more than copying the band it lies in.
_RUN_BYTES = 64 << 10


def _header(fname: str) -> tuple[int, dict]:
  """(data offset, {name: {dtype, shape, data_offsets}}) of a safetensors file: 8 bytes of
  little-endian header length, then that much JSON; tensor offsets count from its end."""
  with open(fname, 'rb') as f:
    n, size = int.from_bytes(f.read(8), 'little'), os.fstat(f.fileno()).st_size
    if not 0 < n <= size - 8:
      raise ValueError(f'{fname}: not a safetensors file (header length {n}, file {size} bytes)')
    header = json.loads(f.read(n))
  header.pop('__metadata__', None)
  return 8 + n, header


def _pread_into(fd: int, out: memoryview, offset: int) -> None:
  """Fills `out` from the file at `offset` (os.preadv returns short counts above ~2 GB)."""
  done = 0
  while done < len(out):
    n = os.preadv(fd, [out[done:]], offset + done)
    if n <= 0:
      raise ValueError(f'unexpected end of file at byte {offset + done}')
    done += n


def _bytes(a: np.ndarray) -> memoryview:
  """A contiguous array's bytes, writable (a view: bfloat16 has no buffer-protocol format)."""
  return memoryview(a.reshape(-1).view(np.uint8))


class _Tensors:
  """Lazy name -> numpy array lookup over one safetensors file or a sharded index.

  Reads with pread at the offsets of the file's header, into arrays of their own: no memory map,
  so the process holds only what it read (a mapped checkpoint's touched pages count in its RSS
  and stay mapped until the file is closed, a second copy of every byte loaded)."""

  def __init__(self, path: str, arch: str):
    self.arch, self.path, self._headers = arch, path, {}
    index = os.path.join(path, 'model.safetensors.index.json')
    single = os.path.join(path, 'model.safetensors')
    if os.path.exists(index):
      self.file_of = {k: os.path.join(path, f) for k, f in _read_json(index)['weight_map'].items()}
    elif os.path.exists(single):
      self._headers = {single: _header(single)}
      self.file_of = {k: single for k in self._headers[single][1]}
    else:
      raise ValueError(f'{path}: no model.safetensors or model.safetensors.index.json '
                       '(only safetensors checkpoints are supported)')

  def __contains__(self, key: str) -> bool:
    return key in self.file_of

  def _info(self, key: str) -> tuple[str, int, np.dtype, tuple]:
    """(file, the tensor's first byte in it, dtype, shape), from the header alone."""
    if key not in self.file_of:
      raise ValueError(f'{self.arch}: tensor {key!r} missing from the checkpoint in {self.path}')
    fname = self.file_of[key]
    if fname not in self._headers:
      self._headers[fname] = _header(fname)
    start, header = self._headers[fname]
    if key not in header:
      raise ValueError(f'{self.arch}: tensor {key!r} is not in {fname} (the index says it is)')
    t = header[key]
    if t['dtype'] not in _DTYPES:
      raise ValueError(f'{fname}: tensor {key!r} has dtype {t["dtype"]}; supported: '
                       f'{sorted(_DTYPES)}')
    dtype, shape = np.dtype(_DTYPES[t['dtype']]), tuple(t['shape'])
    (a, b) = t['data_offsets']
    if b - a != math.prod(shape) * dtype.itemsize:
      raise ValueError(f'{fname}: tensor {key!r} has {b - a} bytes for shape {shape}')
    return fname, start + a, dtype, shape

  def __call__(self, key: str) -> np.ndarray:
    return self.read(key, ())

  def shape(self, key: str) -> tuple:  # from the file's header: reads no data
    return self._info(key)[3]

  def read(self, key: str, index: tuple) -> np.ndarray:  # tensor[slices], reading only those
    fname, base, dtype, shape = self._info(key)
    bounds, squeeze = _bounds(index, shape)
    out = np.empty([b - a for a, b in bounds], dtype)
    fd = os.open(fname, os.O_RDONLY)  # per read: nothing to close when the loader is dropped
    try:
      _read_block(fd, base, shape, dtype.itemsize, bounds, out)
    finally:
      os.close(fd)
    return out[tuple(0 if s else slice(None) for s in squeeze)]


def _bounds(index, shape) -> tuple[list, list]:
  """[(start, stop)] per axis and which axes an int index drops, for basic (step 1) indexing."""
  index = index if isinstance(index, tuple) else (index,)
  if len(index) > len(shape):
    raise IndexError(f'{len(index)} indices for a tensor of shape {shape}')
  bounds, squeeze = [], []
  for i, n in zip(index + (slice(None),) * (len(shape) - len(index)), shape):
    if isinstance(i, slice):
      a, b, step = i.indices(n)
      if step != 1:
        raise IndexError(f'only step-1 slices are read from files, got {i}')
      bounds.append((a, max(a, b)))
      squeeze.append(False)
    else:
      i = int(i) + (n if int(i) < 0 else 0)
      if not 0 <= i < n:
        raise IndexError(f'index {i} out of range for an axis of {n}')
      bounds.append((i, i + 1))
      squeeze.append(True)
  return bounds, squeeze


def _read_block(fd, base, shape, itemsize, bounds, out: np.ndarray) -> None:
  """Reads tensor[bounds] (C order at byte `base`) into `out`: each contiguous run of it with one
  pread where runs are long, else row bands of the span sliced in memory."""
  if out.size == 0:
    return
  nd = len(shape)
  # k: the last axis not taken whole; a run is its range times everything after it.
  k = max([i for i in range(nd) if bounds[i] != (0, shape[i])], default=-1)
  if k <= 0:  # one contiguous byte range
    start = (bounds[0][0] * math.prod(shape[1:]) if k == 0 else 0) * itemsize
    return _pread_into(fd, _bytes(out), base + start)
  inner = math.prod(shape[k + 1:])
  run, stride = (bounds[k][1] - bounds[k][0]) * inner, shape[k] * inner  # elements
  first = bounds[k][0] * inner
  # Runs of axis k-1 are `stride` apart; the axes before it (if any) index groups of them.
  rows = bounds[k - 1][1] - bounds[k - 1][0]
  flat = out.reshape(-1, rows, run)
  outer = [range(a, b) for a, b in bounds[:k - 1]]
  strides = [math.prod(shape[j + 1:]) for j in range(k - 1)]
  banded = run * itemsize < _RUN_BYTES
  band = max(1, _BAND_BYTES // (stride * itemsize)) if banded else 0
  buf = np.empty((band - 1) * stride + run, out.dtype) if banded else None
  for g, idx in enumerate(np.ndindex(*[len(r) for r in outer]) if outer else [()]):
    row0 = sum(r[i] * s for r, i, s in zip(outer, idx, strides)) + bounds[k - 1][0] * stride
    if not banded:
      for r in range(rows):
        _pread_into(fd, _bytes(flat[g, r]), base + (row0 + r * stride + first) * itemsize)
      continue
    for r in range(0, rows, band):
      n = min(band, rows - r)
      count = (n - 1) * stride + run  # the band from its first run's start to its last's end
      _pread_into(fd, _bytes(buf[:count]), base + (row0 + r * stride + first) * itemsize)
      flat[g, r:r + n] = np.lib.stride_tricks.as_strided(
          buf, (n, run), (stride * itemsize, itemsize))


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


def _drop_sent() -> None:
  """Frees the host arrays already copied to devices. jax drops its reference to a device_put's
  host array only at the next transfer or gc pass (its gc callback), so the last block sent
  would stay alive beside the next parameter as it is read. A generation-0 pass is cheap: it
  runs that callback."""
  gc.collect(0)


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
    shape = tuple(var.shape)
    if shard_of is None:  # whole tensors, converted one at a time into the stacked array
      host = np.empty(shape, dtype)
      for i, key in enumerate(keys):
        host[i if stacked else ()] = view.fn(get(key))
      var.set_value(jax.device_put(host).block_until_ready())  # uncommitted
      del host
      return _drop_sent()

    def block(key, bounds):  # one tensor's part of this device's block
      return view.block(lambda r: get.read(key, r), len(get.shape(key)), bounds)

    sharding, arrays, first = shard_of(var), [], {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
      bounds = tuple(s.indices(n)[:2] for s, n in zip(index, shape))
      if bounds not in first:  # a replica is copied from the first device holding it, not read
        # The device's block is assembled on the host, layer by layer as read, and sent whole:
        # one buffer on the device, one transfer. (Sending each layer and stacking them there
        # held two, and the freed layer buffers stayed in the host's heap.)
        host = np.empty([b - a for a, b in bounds], dtype)
        for j, i in enumerate(range(*bounds[0]) if stacked else [0]):
          host[j if stacked else ()] = block(keys[i], bounds[1:] if stacked else bounds)
        # Waited for, so the host holds one block at a time rather than one per device in flight.
        first[bounds] = jax.device_put(host, device).block_until_ready()
        del host
        _drop_sent()
      arrays.append(jax.device_put(first[bounds], device))
    var.set_value(jax.make_array_from_single_device_arrays(shape, sharding, arrays))

  def put(var, key, view=_View()):
    fill(var, [key], view, False)

  def layer(var, key, view=_View()):
    fill(var, [key.format(i) for i in range(c.num_layers)], view, True)
  return put, layer

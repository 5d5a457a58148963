"""'splash': Pallas splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`), the TPU
flash kernel, for `attention_ops`' Causal rows and grouped PromptGroup rows.

A splash mask is static (a function of query and key index) plus segment ids compared for
equality. Padding keys go through the segment ids (queries 1; keys 1 if valid, else 0), the rest
through the static mask:
- Causal rows: the causal mask (with a window, the banded one). A window counts index distance,
  so a windowed row is first compacted, its valid tokens moved to the front in order: exact where
  positions count a row's valid tokens, as in every row rloo_jax builds.
- PromptGroup rows are laid out block-aligned, [prompt | completion 0 | ... | completion M-1],
  each part padded to a multiple of the block (the prompt on its left, so it stays left-padded):
  every mask block then lies in one (query part, key part) pair and is full, empty or banded, and
  a completion token's position distance to any key it reads is static.
Packed rows (a completion reads its group's prompt segment besides its own: not one equality)
and the one-query-a-stream decode raise. The kernel runs under `shard_map` over the mesh the
program is traced for (`traced_mesh`: rows over the batch axes, kv heads over 'tensor'), since
XLA cannot partition a Pallas call. Off TPU it runs in Pallas' interpret mode (the tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

from rloo_jax.models import traced_mesh

# Block (queries and keys, forward and backward); a row shorter than it is padded to MIN_BLOCK.
BLOCK = 512
MIN_BLOCK = 128
_INT32_MAX = np.iinfo(np.int32).max


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


class _GroupMask(sm._ComputableMask):  # pylint: disable=protected-access
  """[prompt (pa) | m completions of ta each], all multiples of `block`: causal; a completion
  reads the prompt and its own tokens; with a window, keys less than it away, the distance of a
  completion token at index pa + j*ta + i counted from pa + i."""

  def __init__(self, pa: int, ta: int, m: int, window: int | None, block: int):
    self.key = (pa, ta, m, window, block)

    def part(x):  # 0 for the prompt and completion 0, j for completion j
      return sum((x >= pa + j * ta).astype(np.int32) for j in range(1, m))

    def same_completion(q, kv):
      # Ranges, not part(q) == part(kv): Mosaic folds that into an i1 compare it cannot lower.
      ends = [(pa + j * ta, pa + (j + 1) * ta) for j in range(m)]
      return functools.reduce(lambda a, b: a | b, [
          (q >= lo) & (q < hi) & (kv >= lo) & (kv < hi) for lo, hi in ends])

    def fn(q, kv):
      vq, vk = q - ta * part(q), kv - ta * part(kv)
      ok = (vk <= vq) & ((kv < pa) | same_completion(q, kv))
      return ok if window is None else ok & (vq - vk < window)

    super().__init__((pa + m * ta, pa + m * ta), fn)
    self._block_of = functools.lru_cache(maxsize=None)(self._block)

  def _block(self, rq, rk, d, bq, bk):
    if rk > 0 and rk != rq:  # another completion
      return np.zeros((bq, bk), bool)
    dist = d + np.arange(bq)[:, None] - np.arange(bk)[None, :]
    ok = dist >= 0
    return ok if self.key[3] is None else ok & (dist < self.key[3])

  def __getitem__(self, idx):
    # The mask processing reads every block; aligned, a block is one (part, part) pair, so it
    # is looked up by its parts and offset instead of computed element by element.
    q_slice, kv_slice = idx
    pa, ta, _, _, block = self.key
    q0, k0 = q_slice.start or 0, kv_slice.start or 0
    bq, bk = (q_slice.stop or self.shape[0]) - q0, (kv_slice.stop or self.shape[1]) - k0
    if q0 % block or k0 % block or bq > block or bk > block:
      return super().__getitem__(idx)
    region = lambda x: 0 if x < pa else 1 + (x - pa) // ta  # noqa: E731
    virtual = lambda x: x if x < pa else pa + (x - pa) % ta  # noqa: E731
    return self._block_of(region(q0), region(k0), virtual(q0) - virtual(k0), bq, bk)

  def __eq__(self, other):
    return isinstance(other, _GroupMask) and other.key == self.key

  def __hash__(self):
    return hash(('group', self.key))


@functools.lru_cache(maxsize=32)
def _kernel(mask_key, heads: int, softcap: float, interpret: bool):
  kind, s, *rest = mask_key
  block = rest[-1]
  if kind == 'group':
    mask = _GroupMask(*rest)
  elif rest[0] is None:
    mask = sm.CausalMask((s, s))
  else:
    mask = sm.LocalMask((s, s), window_size=(rest[0] - 1, 0), offset=0)
  sizes = sk.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                        block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                        block_q_dq=block, block_kv_dq=block)
  # Built once per shape: its block tables as constants, not values of the trace that asked.
  with jax.ensure_compile_time_eval():
    return sk.make_splash_mqa(sm.MultiHeadMask([mask] * heads), block_sizes=sizes,
                              head_shards=1, q_seq_shards=1,
                              attn_logits_soft_cap=softcap or None, interpret=interpret)


def _run(q_bshgd, k_bshd, v_bshd, key_ok_bs, mask_key, spec):
  """The kernel over rows already laid out for `mask_key` (length a multiple of its block)."""
  b, s, h, g, d = q_bshgd.shape
  kernel = _kernel(mask_key, g, float(spec.softcap), traced_mesh.platform() != 'tpu')
  q = (q_bshgd * jnp.asarray(spec.scale, q_bshgd.dtype)).transpose(0, 2, 3, 1, 4)  # [B,H,G,S,D]
  k, v = k_bshd.transpose(0, 2, 1, 3), v_bshd.transpose(0, 2, 1, 3)  # [B,H,S,D]
  kv_ids = key_ok_bs.astype(jnp.int32)

  def local(q, k, v, kv_ids):
    ids = jnp.ones(kv_ids.shape, jnp.int32)
    per_head = jax.vmap(lambda q, k, v, i, j: kernel(q, k, v, segment_ids=sk.SegmentIds(i, j)),
                        in_axes=(0, 0, 0, None, None))
    return jax.vmap(per_head)(q, k, v, ids, kv_ids)

  o = traced_mesh.per_shard(local, (q, k, v, kv_ids), (1, 1, 1, None), 1)  # [B,H,G,S,D]
  return o.transpose(0, 3, 1, 2, 4).astype(v_bshd.dtype)


def windowed(run, window, window_size, name='splash'):
  """run(static window or None) under the layer's window: a traced one is the config's
  `window_size` on sliding layers, no limit on the others (both kernels compiled, one runs).
  Shared by the kernels whose windows are static ('splash', 'cudnn')."""
  if window is None:
    return run(None)
  try:
    static = int(window)
  except jax.errors.ConcretizationTypeError:
    if not window_size:
      raise ValueError(f"attention={name!r} needs the layers' static sliding window "
                       "(AttentionSpec.window_size) under a traced window") from None
    return jax.lax.cond(window < _INT32_MAX, lambda: run(int(window_size)), lambda: run(None))
  return run(None if static >= _INT32_MAX else static)


def compaction(mask_bt):
  """(gather, scatter) along rows: a row's valid tokens moved to its front in order, and back.
  In a row whose positions count its valid tokens, index distance is then position distance."""
  order = jnp.argsort(~mask_bt, axis=1, stable=True)
  along = lambda idx: lambda x: jnp.take_along_axis(  # noqa: E731
      x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)
  return along(order), along(jnp.argsort(order, axis=1))


def _pad_rows(x, n):
  return jnp.pad(x, [(0, 0), (0, n - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


def causal(q, k, v, spec, mask_bt, segment_bt=None):
  if segment_bt is not None:
    raise ValueError("attention='splash' has no packed-row form (train.microbatch_tokens: a "
                     "completion reads its prompt's segment and its own); use 'blockwise'")
  s = q.shape[1]
  block = BLOCK if s >= BLOCK else MIN_BLOCK
  n = _round_up(s, block)
  mask_bt = mask_bt.astype(bool)

  def run(window):
    gather, scatter = compaction(mask_bt) if window is not None else (None, None)
    args = (q, k, v, mask_bt) if window is None else tuple(map(gather, (q, k, v, mask_bt)))
    o = _run(*(_pad_rows(x, n) for x in args), ('causal', n, window, block), spec)[:, :s]
    return o if window is None else scatter(o)

  return windowed(run, spec.window, spec.window_size)


def prompt_group(q, k, v, spec):
  layout = spec.layout
  b, p = layout.prompt_mask_bp.shape
  m, t = layout.mask_bmt.shape[1:]
  block = BLOCK if p + t >= BLOCK else MIN_BLOCK
  pa, ta = _round_up(p, block), _round_up(t, block)

  def aligned(x):  # token-major [B, P + T*M, ...] -> block-aligned completion-major
    rest = x.shape[2:]
    comp = x[:, p:].reshape(b, t, m, *rest).swapaxes(1, 2)  # [B, M, T, ...]
    comp = jnp.pad(comp, [(0, 0), (0, 0), (0, ta - t)] + [(0, 0)] * len(rest))
    prompt = jnp.pad(x[:, :p], [(0, 0), (pa - p, 0)] + [(0, 0)] * len(rest))
    return jnp.concatenate([prompt, comp.reshape(b, m * ta, *rest)], axis=1)

  key_ok = jnp.concatenate([layout.prompt_mask_bp,
                            layout.mask_bmt.transpose(0, 2, 1).reshape(b, t * m)], 1)
  args = tuple(aligned(x) for x in (q, k, v, key_ok.astype(bool)))

  def run(window):
    o = _run(*args, ('group', pa + m * ta, pa, ta, m, window, block), spec)
    comp = o[:, pa:].reshape(b, m, ta, *o.shape[2:])[:, :, :t].swapaxes(1, 2)
    return jnp.concatenate([o[:, pa - p:pa], comp.reshape(b, t * m, *o.shape[2:])], axis=1)

  return windowed(run, spec.window, spec.window_size)

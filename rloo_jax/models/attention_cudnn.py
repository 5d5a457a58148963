"""'cudnn': cuDNN's flash attention (`jax.nn.dot_product_attention(implementation='cudnn')`) for
`attention_ops`' Causal rows and grouped PromptGroup rows, on GPUs.

cuDNN masks a row by causality, a left window and the row's valid length (padding at its end
only), so every row is first compacted, its valid tokens moved to the front in order (exact
where positions count a row's valid tokens, as in every row rloo_jax builds). A PromptGroup's
completions are run as rows [prompt | completion j], the prompt's keys copied to each (M * P more
keys than the grouped rows: 4% for 8 x 24,576-token completions of a 1,024-token prompt); the
prompt's own queries are read from completion 0's row. JAX partitions the cuDNN call over the
batch and heads itself. What cuDNN lacks raises naming it: packed rows, soft-capped scores
(Gemma 2), float32 activations, head dims over 128 or not a multiple of 8 (`supported`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rloo_jax.models import attention_splash

# cuDNN's flash attention runs bfloat16 and float16; head dims up to 128 on every GPU generation
# (256 from Hopper, which a deviceless compile cannot check).
_DTYPES = (jnp.bfloat16, jnp.float16)
_MAX_HEAD_DIM, _HEAD_DIM_MULTIPLE = 128, 8
# cuDNN's training kernels take even lengths; rows are padded (at their masked end) to this.
_ROW_MULTIPLE = 64


def supported(q, spec, packed: bool) -> str:
  """'' when cuDNN runs these rows, else what it lacks (for the error and for 'auto')."""
  if packed:
    return "packed rows (a completion reads its prompt's segment and its own)"
  if spec.softcap:
    return 'soft-capped scores (attn_softcap)'
  if q.dtype not in _DTYPES:
    return f'{q.dtype} activations (bfloat16 or float16 only)'
  d = q.shape[-1]
  if d > _MAX_HEAD_DIM or d % _HEAD_DIM_MULTIPLE:
    return f'head_dim {d} (a multiple of {_HEAD_DIM_MULTIPLE} up to {_MAX_HEAD_DIM})'
  return ''


def _rows(q, k, v, key_ok, spec, window):
  """Attention of rows [B, S] laid out causally, keys `key_ok` valid anywhere in a row."""
  gather, scatter = attention_splash.compaction(key_ok)
  b, s, h, g, d = q.shape
  n = -(-s // _ROW_MULTIPLE) * _ROW_MULTIPLE
  pad = lambda x: jnp.pad(gather(x), [(0, 0), (0, n - s)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
  lengths = jnp.sum(key_ok, axis=1, dtype=jnp.int32)
  o = jax.nn.dot_product_attention(
      pad(q).reshape(b, n, h * g, d), pad(k), pad(v), scale=spec.scale, is_causal=True,
      query_seq_lengths=lengths, key_value_seq_lengths=lengths,
      local_window_size=None if window is None else (window - 1, 0), implementation='cudnn')
  # Rows past a row's length read no key: zeros, never whatever cuDNN leaves there.
  o = jnp.where((jnp.arange(n) < lengths[:, None])[:, :, None, None], o, 0)[:, :s]
  return scatter(o.reshape(b, s, h, g, d)).astype(v.dtype)


def causal(q, k, v, spec, mask_bt):
  def run(window):
    return _rows(q, k, v, mask_bt.astype(bool), spec, window)
  return attention_splash.windowed(run, spec.window, spec.window_size, 'cudnn')


def prompt_group(q, k, v, spec):
  layout = spec.layout
  b, p = layout.prompt_mask_bp.shape
  m, t = layout.mask_bmt.shape[1:]

  def tiled(x):  # [B, P + T*M, ...] token-major -> [B*M, P + T] rows [prompt | completion j]
    comp = x[:, p:].reshape(b, t, m, *x.shape[2:]).swapaxes(1, 2)
    prompt = jnp.broadcast_to(x[:, None, :p], (b, m, p) + x.shape[2:])
    return jnp.concatenate([prompt, comp], axis=2).reshape(b * m, p + t, *x.shape[2:])

  key_ok = tiled(jnp.concatenate([layout.prompt_mask_bp,
                                  layout.mask_bmt.transpose(0, 2, 1).reshape(b, t * m)], 1))

  def run(window):
    o = _rows(tiled(q), tiled(k), tiled(v), key_ok.astype(bool), spec, window)
    o = o.reshape(b, m, p + t, *o.shape[2:])
    comp = o[:, :, p:].swapaxes(1, 2).reshape(b, t * m, *o.shape[3:])
    return jnp.concatenate([o[:, 0, :p], comp], axis=1)

  return attention_splash.windowed(run, spec.window, spec.window_size, 'cudnn')

"""Attention: the `Attention` module's projections, and the attention kernels that combine them
(full causal, grouped prompt + completions, and the two cached-decode forms).

Every kernel computes its scores and softmax in float32, whatever the activation dtype.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from rloo_jax.models import lora
from rloo_jax.models.config import TransformerConfig, dtype_of
from rloo_jax.models.layers import _cast, _dense, _param, _project, _rope, apply_norm, dense_left

# Finite rather than -inf: a query whose keys are all masked (e.g. a pad row) then gets a uniform,
# finite distribution instead of NaNs that would leak into gradients through a masked mean.
_MASKED = -1e30


class Scores(NamedTuple):
  """How a layer's q.k products become the softmax's logits: scaled by `scale`, soft-capped to
  softcap * tanh(s / softcap) when softcap > 0 (Gemma 2), and with a `window` (a traced int32
  per layer; None: no layer slides) keys at positions <= query position - window masked, as
  transformers' sliding_window_overlay masks them (a global layer gets a window no distance
  reaches, so every layer runs the same scanned code)."""

  scale: float
  softcap: float = 0.0
  window: jax.Array | None = None

  @classmethod
  def of(cls, config: TransformerConfig, window=None) -> 'Scores':
    return cls(config.attn_scale, config.attn_softcap, window)

  def logits(self, scores):
    scores = scores * self.scale
    if self.softcap:
      scores = self.softcap * jnp.tanh(scores / self.softcap)
    return scores


def _plain(q) -> Scores:
  return Scores(1.0 / math.sqrt(q.shape[-1]))


def _in_window(q_pos, k_pos, window):
  """[..., S, T] whether each key (positions k_pos [..., T]) is within the window of each query
  (q_pos [..., S])."""
  return (q_pos[..., :, None] - k_pos[..., None, :]) < window


class Attention(nnx.Module):
  """Projections only; the attention pattern (full, prefill, cached decode) is chosen by the caller."""

  def __init__(self, config: TransformerConfig, rngs: nnx.Rngs):
    c = config
    pdt = dtype_of(c.param_dtype)
    self.config = c
    init = nnx.initializers.normal(0.02)
    e, hq, hkv, d = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    self.q_kernel = _param(rngs, init, (e, hq, d), ('embed', 'q_heads', 'head_dim'), pdt)
    self.k_kernel = _param(rngs, init, (e, hkv, d), ('embed', 'kv_heads', 'head_dim'), pdt)
    self.v_kernel = _param(rngs, init, (e, hkv, d), ('embed', 'kv_heads', 'head_dim'), pdt)
    self.o_kernel = _param(rngs, init, (hq, d, e), ('q_heads', 'head_dim', 'embed'), pdt)
    for name, heads in (('q', ('q_heads', hq)), ('k', ('kv_heads', hkv)), ('v', ('kv_heads', hkv))):
      lora.add(self, rngs, c, name, (e,), ('embed',), (heads[1], d), (heads[0], 'head_dim'))
    lora.add(self, rngs, c, 'o', (hq, d), ('q_heads', 'head_dim'), (e,), ('embed',))
    if c.qkv_bias:
      zeros = nnx.initializers.zeros
      self.q_bias = _param(rngs, zeros, (hq, d), ('q_heads', 'head_dim'), pdt)
      self.k_bias = _param(rngs, zeros, (hkv, d), ('kv_heads', 'head_dim'), pdt)
      self.v_bias = _param(rngs, zeros, (hkv, d), ('kv_heads', 'head_dim'), pdt)
    if c.out_bias:
      self.o_bias = _param(rngs, nnx.initializers.zeros, (e,), ('embed',), pdt)
    if c.qk_norm:
      # One [D] scale shared by every head (Qwen3's and Gemma 3's q_norm / k_norm); Gemma's
      # (1 + w) form is the identity at w = 0.
      ones = nnx.initializers.zeros if c.is_gemma else nnx.initializers.ones
      self.q_norm_scale = _param(rngs, ones, (d,), ('head_dim',), pdt)
      self.k_norm_scale = _param(rngs, ones, (d,), ('head_dim',), pdt)

  def qkv(self, x_bse: jax.Array, rotary, fused: bool = False, left: dict | None = None):
    """Returns q [B,S,Hkv,G,D] (grouped for GQA) and post-RoPE k, v [B,S,Hkv,D].

    `rotary`: the forward's `Transformer._rotary(positions)` (None for GPT-2); it rotates the
    first `config.rotary_dim` dims of q and k, after their per-head RMSNorm with config.qk_norm.
    fused: one matmul against the three kernels concatenated per kv head (see `_fused_qkv`)
    instead of three. Same values; faster for the few rows of a decode step.
    left: `left_kernels`' matrices (the decode's), the fused product taken by `dense_left`.
    """
    c = self.config
    dt = x_bse.dtype
    if fused or left is not None:
      q, k, v = self._fused_qkv(x_bse, None if left is None else left['qkv'])
    else:
      q = _project(x_bse, _cast(self.q_kernel, dt))
      k = _project(x_bse, _cast(self.k_kernel, dt))
      v = _project(x_bse, _cast(self.v_kernel, dt))
    # After either form, so the fused decode projection carries the adapters too.
    q, k, v = (lora.apply(self, n, x_bse, y) for n, y in (('q', q), ('k', k), ('v', v)))
    if c.qkv_bias:
      q = q + _cast(self.q_bias, dt)
      k = k + _cast(self.k_bias, dt)
      v = v + _cast(self.v_bias, dt)
    if c.qk_norm:
      q = apply_norm(q, self.q_norm_scale, None, c.norm_eps, c.is_gemma)
      k = apply_norm(k, self.k_norm_scale, None, c.norm_eps, c.is_gemma)
    if not c.is_gpt2:
      q = _rope(q, rotary)
      k = _rope(k, rotary)
    # HF's repeat_kv gives kv head h to query heads h*G..h*G+G-1, i.e. a plain reshape.
    b, s = q.shape[:2]
    q_bshgd = q.reshape(b, s, c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim)
    return q_bshgd, k, v

  def _fused_qkv(self, x_bse: jax.Array, left_kernel: jax.Array | None = None):
    """q [B,S,H,D], k and v [B,S,Hkv,D] from one [E, Hkv*(G+2)*D] matmul.

    The kernels are concatenated per kv head, [E, Hkv, G + 2, D] (the G query heads of a group,
    then its key and value head), so a kernel split over heads (tensor parallelism) stays split
    over the merged axis without any exchange. Inside the sampler's decode loop the weights are
    loop-invariant and XLA hoists the concatenation out of the loop: three decode-step matmuls
    of a few rows become one, a faster rollout (measured by experiments/bench_sampler.py with
    experiments/variants/unfused_decode_qkv.py; see docs/PERFORMANCE.md).
    """
    c = self.config
    hkv, d = c.num_kv_heads, c.head_dim
    g = c.num_heads // hkv
    y = (_dense(x_bse, self.fused_qkv_kernel(x_bse.dtype)) if left_kernel is None else
         dense_left(x_bse, left_kernel))
    b, s = y.shape[:2]
    y = y.reshape(b, s, hkv, g + 2, d)
    return y[:, :, :, :g].reshape(b, s, hkv * g, d), y[:, :, :, g], y[:, :, :, g + 1]

  def fused_qkv_kernel(self, dt) -> jax.Array:
    """`_fused_qkv`'s kernel, [E, Hkv * (G + 2) * D] in dtype `dt`."""
    c = self.config
    e, hkv, d = c.hidden_size, c.num_kv_heads, c.head_dim
    g = c.num_heads // hkv
    kernel = jnp.concatenate([_cast(self.q_kernel, dt).reshape(e, hkv, g, d),
                              _cast(self.k_kernel, dt).reshape(e, hkv, 1, d),
                              _cast(self.v_kernel, dt).reshape(e, hkv, 1, d)], axis=2)
    return kernel.reshape(e, hkv * (g + 2) * d)

  def left_kernels(self, dt) -> dict:
    """The fused q/k/v and the output kernels as the [out, in] matrices of `dense_left`."""
    o = _cast(self.o_kernel, dt)
    return {'qkv': self.fused_qkv_kernel(dt).T, 'o': o.reshape(-1, o.shape[-1]).T}

  def out(self, o_bshgd: jax.Array, left: dict | None = None) -> jax.Array:
    c = self.config
    b, s = o_bshgd.shape[:2]
    o_bsf = o_bshgd.reshape(b, s, c.num_heads * c.head_dim)
    if left is None:
      kernel = _cast(self.o_kernel, o_bsf.dtype)
      y = _dense(o_bsf, kernel.reshape(-1, kernel.shape[-1]))
    else:
      y = dense_left(o_bsf, left['o'])
    y = lora.apply(self, 'o', o_bsf, y)
    if c.out_bias:
      y = y + _cast(self.o_bias, y.dtype)
    return y


def _softmax_f32(scores: jax.Array, mask: jax.Array) -> jax.Array:
  return jax.nn.softmax(jnp.where(mask, scores, _MASKED), axis=-1)


def _full_attention(q_bshgd, k_bthd, v_bthd, mask_bt, spec: Scores | None = None,
                    positions_bt=None):
  """Causal in index order, keys masked by mask_bt, so padding may sit anywhere in a row.
  positions_bt (those of q and k alike) is read only by a sliding window (`Scores.window`)."""
  s, t = q_bshgd.shape[1], k_bthd.shape[1]
  spec = spec or _plain(q_bshgd)
  scores = spec.logits(jnp.einsum('bshgd,bthd->bhgst', q_bshgd, k_bthd,
                                  preferred_element_type=jnp.float32))
  causal_st = jnp.arange(s)[:, None] >= jnp.arange(t)[None, :]
  mask = causal_st[None, None, None] & mask_bt.astype(bool)[:, None, None, None, :]
  if spec.window is not None:
    mask = mask & _in_window(positions_bt, positions_bt, spec.window)[:, None, None]
  probs = _softmax_f32(scores, mask).astype(v_bthd.dtype)
  return jnp.einsum('bhgst,bthd->bshgd', probs, v_bthd)


def _decode_mask(prefix_mask_bp, k: int, t: int, index, spec: Scores | None = None,
                 window_pos=None):
  """[B, K, 1, 1, P + T] keys a decode query sees: the prompt's valid columns, then the
  stream's own slots 0..index; with a sliding window (`Scores.window`) only those within it.
  window_pos: (the queries' positions [B, K], the prompt's [B, P]); stream slot j sits
  index - j positions before its query."""
  b, p = prefix_mask_bp.shape
  prefix_mask_bp = prefix_mask_bp.astype(bool)
  mask_p = jnp.broadcast_to(prefix_mask_bp[:, None, :], (b, k, p))
  mask_t = jnp.broadcast_to(jnp.arange(t) <= index, (b, k, t))
  if spec is not None and spec.window is not None:
    q_pos_bk, pos_bp = window_pos
    mask_p = mask_p & _in_window(q_pos_bk[..., None], pos_bp[:, None], spec.window)[:, :, 0]
    mask_t = mask_t & (index - jnp.arange(t) < spec.window)
  return jnp.concatenate([mask_p, mask_t], axis=-1)[:, :, None, None, :]


def _shared_prefix_attention(q_bkhgd, prefix_k_bhdp, prefix_v_bhpd, prefix_mask_bp,
                             k_bkhdt, v_bkhtd, index, spec: Scores | None = None,
                             window_pos=None):
  """K streams per row attend to the row's single prefix cache and to their own keys 0..index.

  The prefix is contracted against all K queries at once instead of being tiled per stream, so
  its memory traffic is paid once per row; both score blocks share one float32 softmax.
  window_pos: positions, read only by a sliding window (see `_decode_mask`).
  """
  spec = spec or _plain(q_bkhgd)
  f32 = jnp.float32
  # With K > 1 streams the prefix products are written as broadcast-multiply-and-sum rather than
  # einsum: as a dot they are batched over (b, h) with only K*G rows each, which XLA:CPU runs far
  # below its GEMM speed, while the reduction streams the prefix once (faster for long prompts,
  # measured by experiments/bench_sampler.py; see docs/PERFORMANCE.md).
  # With K = 1 (the unshared layout) XLA turns that form into a pathological loop: keep the dot.
  # CPU only: on GPU/TPU the dot runs on the matrix units, and the broadcast product would be
  # K*G*D times the prefix if a backend did not fuse it into the sum.
  reduce_form = q_bkhgd.shape[1] > 1 and jax.default_backend() == 'cpu'
  if reduce_form:
    scores_p = jnp.sum(q_bkhgd.astype(f32)[..., None] * prefix_k_bhdp.astype(f32)[:, None, :, None],
                       axis=4)
  else:
    scores_p = jnp.einsum('bkhgd,bhdp->bkhgp', q_bkhgd, prefix_k_bhdp, preferred_element_type=f32)
  scores_t = jnp.einsum('bkhgd,bkhdt->bkhgt', q_bkhgd, k_bkhdt, preferred_element_type=f32)
  p, t = scores_p.shape[-1], scores_t.shape[-1]
  scores = spec.logits(jnp.concatenate([scores_p, scores_t], axis=-1))
  probs = _softmax_f32(scores, _decode_mask(prefix_mask_bp, q_bkhgd.shape[1], t, index, spec,
                                            window_pos))
  probs = probs.astype(v_bkhtd.dtype)
  if reduce_form:
    out = jnp.sum(probs[..., :p, None].astype(f32) * prefix_v_bhpd.astype(f32)[:, None, :, None],
                  axis=4).astype(v_bkhtd.dtype)
  else:
    out = jnp.einsum('bkhgp,bhpd->bkhgd', probs[..., :p], prefix_v_bhpd)
  return out + jnp.einsum('bkhgt,bkhtd->bkhgd', probs[..., p:], v_bkhtd)


def _stream_attention(q_bkhgd, prefix_mask_bp, k_bkhdt, v_bkhtd, index, copied: int,
                      spec: Scores | None = None, window_pos=None):
  """Decode attention over each stream's own buffer, whose first `copied` slots hold the prompt
  (masked by prefix_mask_bp) and whose next slots hold its tokens 0..index."""
  spec = spec or _plain(q_bkhgd)
  scores = spec.logits(jnp.einsum('bkhgd,bkhdt->bkhgt', q_bkhgd, k_bkhdt,
                                  preferred_element_type=jnp.float32))
  mask = _decode_mask(prefix_mask_bp, q_bkhgd.shape[1], k_bkhdt.shape[-1] - copied, index, spec,
                      window_pos)
  probs = _softmax_f32(scores, mask).astype(v_bkhtd.dtype)
  return jnp.einsum('bkhgt,bkhtd->bkhgd', probs, v_bkhtd)


def _grouped_attention(q_bshgd, k_bshd, v_bshd, prompt_mask_bp, mask_bmt, num_prompt: int,
                       spec: Scores | None = None, positions_bs=None):
  """Attention over rows laid out per prompt as [prompt (P) | T tokens x M completions], the
  completions token-major (row P + i*M + j: token i of completion j).

  The prompt's queries attend causally within the prompt; each completion's queries attend to the
  prompt's keys (computed once, never tiled M times) and causally to their own completion. Both
  score blocks of a completion query share one float32 softmax. positions_bs (laid out as the
  rows) is read only by a sliding window (`Scores.window`).
  """
  p = num_prompt
  spec = spec or _plain(q_bshgd)
  b, _, h, g, d = q_bshgd.shape
  m, t = mask_bmt.shape[1:]
  qp, kp, vp = q_bshgd[:, :p], k_bshd[:, :p], v_bshd[:, :p]
  pos_p = None if positions_bs is None else positions_bs[:, :p]
  out_p = _full_attention(qp, kp, vp, prompt_mask_bp, spec, pos_p)
  qc = q_bshgd[:, p:].reshape(b, t, m, h, g, d)
  kc = k_bshd[:, p:].reshape(b, t, m, h, d)
  vc = v_bshd[:, p:].reshape(b, t, m, h, d)
  f32 = jnp.float32
  scores_p = jnp.einsum('btmhgd,bphd->bmhgtp', qc, kp, preferred_element_type=f32)
  scores_c = jnp.einsum('btmhgd,bsmhd->bmhgts', qc, kc, preferred_element_type=f32)
  scores = spec.logits(jnp.concatenate([scores_p, scores_c], axis=-1))
  mask_p = jnp.broadcast_to(prompt_mask_bp.astype(bool)[:, None, None, None, None, :],
                            (b, m, 1, 1, t, p))
  causal_ts = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
  mask_c = causal_ts[None, None, None, None] & mask_bmt.astype(bool)[:, :, None, None, None, :]
  mask = jnp.concatenate([mask_p, mask_c], axis=-1)
  if spec.window is not None:
    pos_bmt = positions_bs[:, p:].reshape(b, t, m).transpose(0, 2, 1)
    near = jnp.concatenate([_in_window(pos_bmt, pos_p[:, None], spec.window),
                            _in_window(pos_bmt, pos_bmt, spec.window)], axis=-1)
    mask = mask & near[:, :, None, None]
  probs = _softmax_f32(scores, mask).astype(v_bshd.dtype)
  out_c = (jnp.einsum('bmhgtp,bphd->btmhgd', probs[..., :p], vp)
           + jnp.einsum('bmhgts,bsmhd->btmhgd', probs[..., p:], vc))
  return jnp.concatenate([out_p, out_c.reshape(b, t * m, h, g, d)], axis=1)

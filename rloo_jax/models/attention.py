"""The `Attention` module: the q/k/v and output projections around `attention_ops.attend`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from rloo_jax.models import lora
from rloo_jax.models.config import TransformerConfig, dtype_of
from rloo_jax.models.layers import _cast, _dense, _param, _project, _rope, apply_norm


class Attention(nnx.Module):
  """Projections only; the attention pattern (full, prefill, cached decode) is chosen by the
  caller."""

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

  def qkv(self, x_bse: jax.Array, rotary, fused: bool = False):
    """Returns q [B,S,Hkv,G,D] (grouped for GQA) and post-RoPE k, v [B,S,Hkv,D].

    `rotary`: the forward's `Transformer._rotary(positions)` (None for GPT-2); it rotates the
    first `config.rotary_dim` dims of q and k, after their per-head RMSNorm with config.qk_norm.
    fused: one matmul against the three kernels concatenated per kv head (see `_fused_qkv`)
    instead of three. Same values; one larger product for the few rows of a decode step.
    """
    c = self.config
    dt = x_bse.dtype
    if fused:
      q, k, v = self._fused_qkv(x_bse)
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

  def _fused_qkv(self, x_bse: jax.Array):
    """q [B,S,H,D], k and v [B,S,Hkv,D] from one [E, Hkv*(G+2)*D] matmul.

    The kernels are concatenated per kv head, [E, Hkv, G + 2, D] (the G query heads of a group,
    then its key and value head), so a kernel split over heads (tensor parallelism) stays split
    over the merged axis without any exchange. Inside the sampler's decode loop the weights are
    loop-invariant and XLA hoists the concatenation out of the loop, so a decode step reads the
    q/k/v weights in one matmul instead of three.
    """
    c = self.config
    hkv, d = c.num_kv_heads, c.head_dim
    g = c.num_heads // hkv
    y = _dense(x_bse, self.fused_qkv_kernel(x_bse.dtype))
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

  def out(self, o_bshgd: jax.Array) -> jax.Array:
    c = self.config
    b, s = o_bshgd.shape[:2]
    o_bsf = o_bshgd.reshape(b, s, c.num_heads * c.head_dim)
    kernel = _cast(self.o_kernel, o_bsf.dtype)
    y = _dense(o_bsf, kernel.reshape(-1, kernel.shape[-1]))
    y = lora.apply(self, 'o', o_bsf, y)
    if c.out_bias:
      y = y + _cast(self.o_bias, y.dtype)
    return y

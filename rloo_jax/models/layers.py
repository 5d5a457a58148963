"""The transformer's building blocks other than attention: parameter creation, norms, rotary
position embedding, the matmul helpers, the MLP and the head."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from rloo_jax.models import lora
from rloo_jax.models.config import TransformerConfig, dtype_of


def _param(rngs: nnx.Rngs, init, shape, axes, dtype) -> nnx.Param:
  # Draw flat, then reshape: the values are just as random, and each seed's initial weights
  # (every from-scratch run's starting point) are those of this flat draw.
  def flat_init(key, shape, dtype):
    return init(key, (math.prod(shape),), dtype).reshape(shape)

  # eager_sharding=False: the logical names are metadata for the sharding module to map onto a
  # mesh; creating a model outside any mesh (tests, HF import) must still work.
  return nnx.Param(nnx.with_partitioning(flat_init, axes, eager_sharding=False)(
      rngs.params(), shape, dtype))


def _cast(param: nnx.Param, dtype) -> jax.Array:
  return jnp.asarray(param[...], dtype)


class Norm(nnx.Module):
  """RMSNorm (llama/qwen2), Gemma's RMSNorm scaling by (1 + w), or LayerNorm with bias (gpt2,
  gpt_neox), statistics in float32 as in HF."""

  def __init__(self, config: TransformerConfig, rngs: nnx.Rngs):
    pdt = dtype_of(config.param_dtype)
    self.eps = config.norm_eps
    self.layer_norm = config.layer_norm
    self.plus_one = config.is_gemma
    # Gemma stores w of (1 + w): zeros are its identity, as ones are the others'.
    ones = nnx.initializers.zeros if self.plus_one else nnx.initializers.ones
    self.scale = _param(rngs, ones, (config.hidden_size,), ('norm',), pdt)
    if self.layer_norm:
      self.bias = _param(rngs, nnx.initializers.zeros, (config.hidden_size,), ('norm',), pdt)

  def __call__(self, x_bse: jax.Array) -> jax.Array:
    return apply_norm(x_bse, self.scale, getattr(self, 'bias', None), self.eps, self.plus_one)


def apply_norm(x_bse: jax.Array, scale, bias, eps: float, plus_one: bool = False) -> jax.Array:
  """RMSNorm (bias None) or LayerNorm of x with a `Norm`'s parameters (Params or arrays): the
  one norm of the layers, and of the head applied to chunks of hidden states. plus_one: Gemma's
  RMSNorm, x_hat * (1 + w) all in float32 before the cast back (as transformers' GemmaRMSNorm)."""
  x = x_bse.astype(jnp.float32)
  if plus_one:
    y = x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + eps)
    return (y * (1.0 + jnp.asarray(scale[...], jnp.float32))).astype(x_bse.dtype)
  if bias is not None:
    x = x - x.mean(-1, keepdims=True)
    y = x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + eps)
    return (y * scale[...] + bias[...]).astype(x_bse.dtype)
  y = x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + eps)
  # HF casts back to the activation dtype before the weight multiply; matching it keeps bf16 parity.
  return scale[...].astype(x_bse.dtype) * y.astype(x_bse.dtype)


def inv_freq(head_dim: int, theta: float, scaling: tuple = ('default',)) -> jax.Array:
  """RoPE's [head_dim / 2] inverse frequencies, rescaled per `TransformerConfig.rope_scaling`
  as transformers' modeling_rope_utils does ('linear': _compute_linear_scaling_rope_parameters,
  'llama3': _compute_llama3_parameters), in float32 as there."""
  freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  rope_type = scaling[0]
  if rope_type == 'default':
    return freq
  factor = scaling[1]
  if rope_type == 'linear':
    return freq / factor
  if rope_type != 'llama3':
    raise ValueError(f'rope_type {rope_type!r} is not implemented')
  low, high, old_len = scaling[2:5]
  wavelen = 2 * math.pi / freq
  # Long wavelengths (beyond the original context / low) are interpolated by the factor, short
  # ones (under original context / high) kept; the band between blends the two linearly in
  # original context / wavelength.
  scaled = jnp.where(wavelen > old_len / low, freq / factor, freq)
  smooth = (old_len / wavelen - low) / (high - low)
  blended = (1 - smooth) * scaled / factor + smooth * scaled
  medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
  return jnp.where(medium, blended, scaled)


def _rotary(positions_bs: jax.Array, head_dim: int, theta: float, max_seq_len: int,
            scaling: tuple = ('default',)):
  """cos / sin [B, S, 1, D/2] of every position's rotary angles (positions clipped to
  0..max_seq_len - 1), computed once per forward. `head_dim`: the rotated dims (all of a head's,
  or GPT-NeoX's first rotary_dim); `scaling`: `TransformerConfig.rope_scaling` (see `inv_freq`).

  At the positions themselves, not read from a [max_seq_len, D/2] table: the TPU compiler keeps
  such a table whole (2 x 32 MiB for a 128K-context preset) in the rollout's decode loop.
  """
  positions_bs = jnp.clip(positions_bs, 0, max_seq_len - 1).astype(jnp.float32)
  angles_bsf = positions_bs[..., None] * inv_freq(head_dim, theta, scaling)
  return jnp.cos(angles_bsf)[:, :, None, :], jnp.sin(angles_bsf)[:, :, None, :]


def _rope(x_bshd: jax.Array, rotary) -> jax.Array:
  """HF-layout rotary embedding: rotate_half over the two halves of the first 2 * cos.shape[-1]
  dims (all of head_dim, or GPT-NeoX's partial rotary); any dims after them pass through."""
  cos, sin = rotary
  r = 2 * cos.shape[-1]
  x = x_bshd.astype(jnp.float32)
  x1, x2 = x[..., : r // 2], x[..., r // 2: r]
  parts = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
  if r < x.shape[-1]:
    parts.append(x[..., r:])
  return jnp.concatenate(parts, axis=-1).astype(x_bshd.dtype)


def _dense(x_bse: jax.Array, kernel_ef: jax.Array, preferred_element_type=None) -> jax.Array:
  """x @ kernel as one 2-D matmul over the flattened rows, [B*S, E] x [E, F] -> [B, S, F].

  Why not einsum('bse,ef->bsf'): its weight gradient then contracts over two axes (b and s),
  which a compiler may not hand to its plain GEMM kernel.
  """
  b, s, e = x_bse.shape
  y = jnp.matmul(x_bse.reshape(b * s, e), kernel_ef, preferred_element_type=preferred_element_type)
  return y.reshape(b, s, kernel_ef.shape[-1])


def _project(x_bse: jax.Array, kernel_ehd: jax.Array) -> jax.Array:
  """x @ kernel, [B, S, E] x [E, H, D] -> [B, S, H, D], as one 2-D matmul (see `_dense`)."""
  _, h, d = kernel_ehd.shape
  y = _dense(x_bse, kernel_ehd.reshape(kernel_ehd.shape[0], h * d))
  return y.reshape(*y.shape[:2], h, d)


class MLP(nnx.Module):
  """SwiGLU (llama/qwen2), GeGLU with tanh GELU (Gemma's gelu_pytorch_tanh), or GELU with
  biases: tanh-approximated for gpt2 ('gelu_new'), exact (erf) for gpt_neox (Pythia's 'gelu')."""

  def __init__(self, config: TransformerConfig, rngs: nnx.Rngs):
    c = config
    pdt = dtype_of(c.param_dtype)
    self.biased = not c.gated_mlp  # a biased GELU MLP (GPT-2, GPT-NeoX), no gate
    self.config = c
    self.approximate = c.is_gpt2
    self.geglu = c.is_gemma
    init = nnx.initializers.normal(0.02)
    e, f = c.hidden_size, c.intermediate_size
    self.up_kernel = _param(rngs, init, (e, f), ('embed', 'mlp'), pdt)
    self.down_kernel = _param(rngs, init, (f, e), ('mlp', 'embed'), pdt)
    if self.biased:
      self.up_bias = _param(rngs, nnx.initializers.zeros, (f,), ('mlp',), pdt)
      self.down_bias = _param(rngs, nnx.initializers.zeros, (e,), ('embed',), pdt)
    else:
      self.gate_kernel = _param(rngs, init, (e, f), ('embed', 'mlp'), pdt)
    for name, (i, o) in (('gate', ('embed', 'mlp')), ('up', ('embed', 'mlp')),
                         ('down', ('mlp', 'embed'))):
      sizes = {'embed': e, 'mlp': f}
      lora.add(self, rngs, c, name, (sizes[i],), (i,), (sizes[o],), (o,))

  def __call__(self, x_bse: jax.Array) -> jax.Array:
    dt = x_bse.dtype

    def matmul(name, x):
      return lora.apply(self, name, x, _dense(x, _cast(getattr(self, f'{name}_kernel'), dt)))

    up = matmul('up', x_bse)
    if self.biased:
      h = jax.nn.gelu(up + _cast(self.up_bias, dt), approximate=self.approximate)
    else:
      gate = matmul('gate', x_bse)
      h = (jax.nn.gelu(gate, approximate=True) if self.geglu else jax.nn.silu(gate)) * up
    y = matmul('down', h)
    if self.biased:
      y = y + _cast(self.down_bias, dt)
    return y


def apply_head(config: TransformerConfig, head_params, x_bse):
  """Final norm and head on hidden states: logits [B, S, V] (values [B, S] for head='scalar').

  A pure function of the `transformer.HEAD_KEYS` parameters (Params or arrays), so the chunked
  log-probs (`loss.chunked_logprobs`) run it one chunk of positions at a time and differentiate
  only these. The contraction accumulates and returns float32 whatever the dtype;
  config.final_softcap caps the logits (Gemma 2) in float32 too."""
  norm = head_params['final_norm']
  x = apply_norm(x_bse, norm['scale'], norm['bias'] if 'bias' in norm else None,
                 config.norm_eps, config.is_gemma)
  f32 = jnp.float32
  if config.head == 'scalar':
    v = jnp.einsum('bse,eo->bso', x, _cast(head_params['score_kernel'], x.dtype),
                   preferred_element_type=f32)
    return v[..., 0] + jnp.asarray(head_params['score_bias'][...], f32)[0]
  kernel = (_cast(head_params['embedding'], x.dtype).T if config.tie_embeddings else
            _cast(head_params['lm_head'], x.dtype))
  logits = _dense(x, kernel, preferred_element_type=f32)
  if config.final_softcap:
    logits = config.final_softcap * jnp.tanh(logits / config.final_softcap)
  return logits

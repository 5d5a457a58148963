"""One decoder-only transformer for the Llama, Qwen2 and GPT-2 families, with an explicit KV cache.

The module is Flax NNX; everything outside this file calls the pure functions of `model_fns(graphdef)`
(forward / prefill / init_cache / decode) on a params `nnx.State`, so jit, grad and donation see plain
pytrees and no hidden mutable state.

Decoding is built for RLOO's access pattern: k completions per prompt. `prefill` runs the prompt once;
`decode` lets the k streams of a prompt attend to that single prefix cache (never copied k times) plus
their own per-stream cache, with both score blocks joined in one float32 softmax.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

FAMILIES = ('llama', 'qwen2', 'gpt2')
HEADS = ('lm', 'scalar')
_DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16, 'float16': jnp.float16}

# Finite rather than -inf: a query whose keys are all masked (e.g. a pad row) then gets a uniform,
# finite distribution instead of NaNs that would leak into gradients through a masked mean.
_MASKED = -1e30


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Hashable (frozen) so it may be a static argument; `family` selects norm/MLP/position flavour."""

  family: str = 'llama'
  vocab_size: int = 32000
  hidden_size: int = 256
  num_layers: int = 4
  num_heads: int = 4
  num_kv_heads: int = 4
  head_dim: int = 64
  intermediate_size: int = 1024
  max_seq_len: int = 2048
  norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  tie_embeddings: bool = False
  qkv_bias: bool = False
  dtype: str = 'float32'
  param_dtype: str = 'float32'
  head: str = 'lm'

  def __post_init__(self):
    if self.family not in FAMILIES:
      raise ValueError(f'family={self.family!r}; supported: {FAMILIES}')
    if self.head not in HEADS:
      raise ValueError(f'head={self.head!r}; supported: {HEADS}')
    for name in ('dtype', 'param_dtype'):
      if getattr(self, name) not in _DTYPES:
        raise ValueError(f'{name}={getattr(self, name)!r}; supported: {tuple(_DTYPES)}')
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f'num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}')

  @classmethod
  def llama(cls, **overrides) -> 'TransformerConfig':
    kw = dict(family='llama', norm_eps=1e-5, rope_theta=10000.0, tie_embeddings=False,
              qkv_bias=False)
    return cls(**{**kw, **overrides})

  @classmethod
  def qwen2(cls, **overrides) -> 'TransformerConfig':
    kw = dict(family='qwen2', norm_eps=1e-6, rope_theta=1000000.0, tie_embeddings=True,
              qkv_bias=True)
    return cls(**{**kw, **overrides})

  @classmethod
  def gpt2(cls, **overrides) -> 'TransformerConfig':
    kw = dict(family='gpt2', vocab_size=50257, hidden_size=768, num_layers=12, num_heads=12,
              num_kv_heads=12, head_dim=64, intermediate_size=3072, max_seq_len=1024,
              norm_eps=1e-5, tie_embeddings=True, qkv_bias=True)
    kw = {**kw, **overrides}
    # GPT-2 has no GQA; keep kv heads equal to heads unless told otherwise.
    if 'num_heads' in overrides and 'num_kv_heads' not in overrides:
      kw['num_kv_heads'] = kw['num_heads']
    return cls(**kw)

  def replace(self, **changes) -> 'TransformerConfig':
    return dataclasses.replace(self, **changes)

  @property
  def is_gpt2(self) -> bool:
    return self.family == 'gpt2'

  @property
  def num_params(self) -> int:
    """Parameter count, computed from shapes (equals the size of `create(config)[1]`)."""
    e, hd, f, v = self.hidden_size, self.head_dim, self.intermediate_size, self.vocab_size
    q, kv = self.num_heads * hd, self.num_kv_heads * hd
    norm = 2 * e if self.is_gpt2 else e
    attn = e * (q + 2 * kv) + q * e
    if self.qkv_bias:
      attn += q + 2 * kv
    if self.is_gpt2:
      attn += e  # output-projection bias
      mlp = 2 * e * f + f + e
    else:
      mlp = 3 * e * f
    total = self.num_layers * (2 * norm + attn + mlp) + norm + v * e
    if self.is_gpt2:
      total += self.max_seq_len * e
    if self.head == 'scalar':
      total += e + 1
    elif not self.tie_embeddings:
      total += e * v
    return total


@flax.struct.dataclass
class PrefixKV:
  """Every layer's post-RoPE keys/values of a prefilled prompt batch."""

  k_lbphd: jax.Array
  v_lbphd: jax.Array


# Prompts up to this many tokens are copied into each stream's cache by `init_cache` (see
# `DecodeCache`); longer ones stay shared. Measured with experiments/bench_sampler.py on 2 CPU
# cores (docs/ARCHITECTURE.md): copying is faster for short prompts, sharing for long ones.
COPY_PREFIX_MAX_LEN = 16


@flax.struct.dataclass
class DecodeCache:
  """The prompt's keys/values (computed once per prompt row) plus each stream's own.

  Two forms, chosen by `init_cache` from the prompt length:
  - shared (copied_prefix == 0): one prefix cache per row that its K streams all read, never
    tiled, next to per-stream buffers of T slots. Each decode step then contracts against two
    blocks, which pays for long prompts: their memory traffic is paid once per row.
  - copied (copied_prefix == P): the prefix is written into the first P slots of every stream's
    buffer (P + T slots; the prefix fields are empty). One score product and one value product
    per layer and step instead of two each plus a concatenation: for short prompts, where the
    per-operation cost dominates, -6% of a hidden-256 rollout on 2 CPU cores.

  One array per layer (tuples of length L), each in the layout the decode-step contractions read
  directly, so no step copies a cache: keys with head_dim before the sequence axis (`_hdp` /
  `_hdt`: the score product q.k contracts D against a row-major [D, T] matrix), values with the
  sequence axis before head_dim (probs.v contracts T against [T, D]). A stacked [L, B, T, H, D]
  buffer cost a transpose plus a slice copy of every layer's K and V at every generated token.
  `index` counts generated tokens in both forms; stream slot `copied_prefix + index` is next.
  """

  prefix_k_bhdp: tuple  # L x [B, Hkv, D, P]; () when copied
  prefix_v_bhpd: tuple  # L x [B, Hkv, P, D]; () when copied
  prefix_mask_bp: jax.Array  # [B, P] bool
  k_bkhdt: tuple  # L x [B, K, Hkv, D, copied_prefix + T]
  v_bkhtd: tuple  # L x [B, K, Hkv, copied_prefix + T, D]
  index: jax.Array
  copied_prefix: int = flax.struct.field(pytree_node=False, default=0)


def _param(rngs: nnx.Rngs, init, shape, axes, dtype) -> nnx.Param:
  # Draw flat, then reshape: XLA's compile time for rank-3 threefry draws is several times that of
  # rank-1 ones (seconds per tensor on a small CPU), and the values are just as random.
  def flat_init(key, shape, dtype):
    return init(key, (math.prod(shape),), dtype).reshape(shape)

  # eager_sharding=False: the logical names are metadata for the sharding module to map onto a
  # mesh; creating a model outside any mesh (tests, HF import) must still work.
  return nnx.Param(nnx.with_partitioning(flat_init, axes, eager_sharding=False)(
      rngs.params(), shape, dtype))


def _cast(param: nnx.Param, dtype) -> jax.Array:
  return jnp.asarray(param[...], dtype)


class Norm(nnx.Module):
  """RMSNorm (llama/qwen2) or LayerNorm with bias (gpt2), statistics in float32 as in HF."""

  def __init__(self, config: TransformerConfig, rngs: nnx.Rngs):
    pdt = _DTYPES[config.param_dtype]
    self.eps = config.norm_eps
    self.layer_norm = config.is_gpt2
    self.scale = _param(rngs, nnx.initializers.ones, (config.hidden_size,), ('norm',), pdt)
    if self.layer_norm:
      self.bias = _param(rngs, nnx.initializers.zeros, (config.hidden_size,), ('norm',), pdt)

  def __call__(self, x_bse: jax.Array) -> jax.Array:
    x = x_bse.astype(jnp.float32)
    if self.layer_norm:
      x = x - x.mean(-1, keepdims=True)
      y = x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + self.eps)
      return (y * self.scale[...] + self.bias[...]).astype(x_bse.dtype)
    y = x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + self.eps)
    # HF casts back to the activation dtype before the weight multiply; matching it keeps bf16 parity.
    return self.scale[...].astype(x_bse.dtype) * y.astype(x_bse.dtype)


def _rotary(positions_bs: jax.Array, head_dim: int, theta: float, max_seq_len: int):
  """cos / sin [B, S, 1, D/2] of every position's rotary angles, computed once per forward.

  Read from a [max_seq_len, D/2] table with a gather, which XLA materialises as one small array.
  Computed from the positions directly, XLA fused cos and sin into every consumer (q and k of
  every layer) and recomputed them per element, i.e. per head: a visible share of a CPU decode
  step and of the update. (XLA evaluates the table only at the gathered rows.)
  """
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  angles_sf = jnp.arange(max_seq_len, dtype=jnp.float32)[:, None] * inv_freq
  take = lambda table: jnp.take(table, positions_bs, axis=0, mode='clip')[:, :, None, :]
  return take(jnp.cos(angles_sf)), take(jnp.sin(angles_sf))


def _rope(x_bshd: jax.Array, rotary) -> jax.Array:
  """HF-layout rotary embedding (rotate_half over the two halves of head_dim)."""
  cos, sin = rotary
  d = x_bshd.shape[-1]
  x = x_bshd.astype(jnp.float32)
  x1, x2 = x[..., : d // 2], x[..., d // 2:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_bshd.dtype)


def _dense(x_bse: jax.Array, kernel_ef: jax.Array, preferred_element_type=None) -> jax.Array:
  """x @ kernel as one 2-D matmul over the flattened rows, [B*S, E] x [E, F] -> [B, S, F].

  Why not einsum('bse,ef->bsf'): its weight gradient contracts over two axes (b and s), which
  XLA:CPU does not hand to its fast GEMM kernel.
  """
  b, s, e = x_bse.shape
  y = jnp.matmul(x_bse.reshape(b * s, e), kernel_ef, preferred_element_type=preferred_element_type)
  return y.reshape(b, s, kernel_ef.shape[-1])


def _project(x_bse: jax.Array, kernel_ehd: jax.Array) -> jax.Array:
  """x @ kernel, [B, S, E] x [E, H, D] -> [B, S, H, D], as one 2-D matmul (see `_dense`)."""
  _, h, d = kernel_ehd.shape
  y = _dense(x_bse, kernel_ehd.reshape(kernel_ehd.shape[0], h * d))
  return y.reshape(*y.shape[:2], h, d)


def _plain_dense(name: str, x_bse, kernel_ef, preferred_element_type=None):
  """The default `dense` of the blocks: an ordinary matmul (`name` is for the tapes below)."""
  del name
  return _dense(x_bse, kernel_ef, preferred_element_type)


def activation_layout(config: 'TransformerConfig') -> tuple[tuple[str, int], ...]:
  """(name, width) of one block's matmul outputs, in the order `record` packs them."""
  c = config
  names = [('qkv', (c.num_heads + 2 * c.num_kv_heads) * c.head_dim), ('out', c.hidden_size),
           ('up', c.intermediate_size)]
  if not c.is_gpt2:
    names.append(('gate', c.intermediate_size))
  return tuple(names + [('down', c.hidden_size)])


def activation_width(config: 'TransformerConfig') -> int:
  """A: the values `record` keeps per token, summed over every layer's `activation_layout`."""
  return config.num_layers * sum(w for _, w in activation_layout(config))


class _Recorder:
  """A `dense` that keeps each matmul output of one layer by name (trace-time bookkeeping).

  The sampler runs prefill and decode with one per layer, so a rollout hands the update every
  trunk matmul output it computed (see `Transformer.grouped(saved=...)`)."""

  def __init__(self):
    self.outputs = {}

  def __call__(self, name, x_bse, kernel_ef, preferred_element_type=None):
    y = _dense(x_bse, kernel_ef, preferred_element_type)
    self.outputs[name] = y
    return y


@jax.custom_vjp
def _replayed_matmul(x_bse, kernel_ef, y_bsf):
  """`x @ kernel` whose value is the recorded y_bsf: the forward runs no matmul, the backward the
  usual two (dx = g @ kernel^T, dkernel = x^T g). Exact when y_bsf was computed from the same
  x and kernel, as a rollout's matmuls are for the update step taken at the rollout's params."""
  del x_bse, kernel_ef
  return y_bsf


def _replayed_matmul_fwd(x_bse, kernel_ef, y_bsf):
  return y_bsf, (x_bse, kernel_ef)


def _replayed_matmul_bwd(res, g_bsf):
  x_bse, kernel_ef = res
  e, f = kernel_ef.shape
  g_nf = g_bsf.reshape(-1, f).astype(x_bse.dtype)
  dx = jnp.matmul(g_nf, kernel_ef.T.astype(x_bse.dtype)).reshape(x_bse.shape)
  dkernel = jnp.matmul(x_bse.reshape(-1, e).T, g_nf, preferred_element_type=jnp.float32)
  # y_bsf is data, not a function of params: its cotangent is dropped (and the zeros with it).
  return dx.astype(x_bse.dtype), dkernel.astype(kernel_ef.dtype), jnp.zeros_like(g_bsf)


_replayed_matmul.defvjp(_replayed_matmul_fwd, _replayed_matmul_bwd)


def _pack(tapes, config) -> tuple:
  """The recorded outputs as one tuple per layer in `activation_layout` order, ((y, ...), ...).

  Separate arrays, not one concatenated [..., A] block: in the sampler's decode loop each output
  is then written into its buffer as soon as its matmul is done, where a concatenation of all of
  them waited for the step's last layer (a slower rollout when tried)."""
  out = []
  for tape in tapes:
    layer = []
    for name, width in activation_layout(config):
      y = tape.outputs[name]
      if y.shape[-1] != width:
        raise ValueError(f'recorded {name!r} has width {y.shape[-1]}, expected {width}')
      layer.append(y)
    out.append(tuple(layer))
  return tuple(out)


class _Replayer:
  """A `dense` that returns a recorded output through `_replayed_matmul` (no forward matmul).

  saved_l: one layer's recorded outputs (y_bsf, ...) in `activation_layout` order (see `_pack`),
  in the rows of the forward that replays them. The grouped forward's last layer feeds only its
  trailing rows to the output projection and MLP (the prompt's leading rows are dropped), so a
  shorter input takes the recording's trailing rows."""

  def __init__(self, saved_l, config):
    self.saved = dict(zip((name for name, _ in activation_layout(config)), saved_l))

  def __call__(self, name, x_bse, kernel_ef, preferred_element_type=None):
    y = self.saved[name]
    rows = x_bse.shape[1]
    if y.shape[:2] != x_bse.shape[:2]:
      if y.shape[0] != x_bse.shape[0] or y.shape[1] < rows:
        raise ValueError(f'replayed {name!r}: recorded rows {y.shape[:2]} do not cover the '
                         f'input rows {x_bse.shape[:2]}')
      y = y[:, y.shape[1] - rows:]
    if preferred_element_type is not None:
      y = y.astype(preferred_element_type)
    return _replayed_matmul(x_bse, kernel_ef, y)


class Attention(nnx.Module):
  """Projections only; the attention pattern (full, prefill, cached decode) is chosen by the caller.

  Every matmul goes through `dense(name, x, kernel)`: `_plain_dense`, or a tape that records
  (`_Recorder`) or replays (`_Replayer`) its outputs."""

  def __init__(self, config: TransformerConfig, rngs: nnx.Rngs):
    c = config
    pdt = _DTYPES[c.param_dtype]
    self.config = c
    init = nnx.initializers.normal(0.02)
    e, hq, hkv, d = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    self.q_kernel = _param(rngs, init, (e, hq, d), ('embed', 'q_heads', 'head_dim'), pdt)
    self.k_kernel = _param(rngs, init, (e, hkv, d), ('embed', 'kv_heads', 'head_dim'), pdt)
    self.v_kernel = _param(rngs, init, (e, hkv, d), ('embed', 'kv_heads', 'head_dim'), pdt)
    self.o_kernel = _param(rngs, init, (hq, d, e), ('q_heads', 'head_dim', 'embed'), pdt)
    if c.qkv_bias:
      zeros = nnx.initializers.zeros
      self.q_bias = _param(rngs, zeros, (hq, d), ('q_heads', 'head_dim'), pdt)
      self.k_bias = _param(rngs, zeros, (hkv, d), ('kv_heads', 'head_dim'), pdt)
      self.v_bias = _param(rngs, zeros, (hkv, d), ('kv_heads', 'head_dim'), pdt)
    if c.is_gpt2:
      self.o_bias = _param(rngs, nnx.initializers.zeros, (e,), ('embed',), pdt)

  def qkv(self, x_bse: jax.Array, rotary, fused: bool = False, dense=_plain_dense):
    """Returns q [B,S,Hkv,G,D] (grouped for GQA) and post-RoPE k, v [B,S,Hkv,D].

    `rotary`: the forward's `Transformer._rotary(positions)` (None for GPT-2).
    fused: one matmul against the three kernels concatenated per kv head (see `_fused_qkv`)
    instead of three. Same values; faster for the few rows of a decode step. A tape (`dense`
    other than `_plain_dense`) always uses the fused form, so its recordings have one name.
    """
    c = self.config
    dt = x_bse.dtype
    if fused or dense is not _plain_dense:
      q, k, v = self._fused_qkv(x_bse, dense)
    else:
      q = _project(x_bse, _cast(self.q_kernel, dt))
      k = _project(x_bse, _cast(self.k_kernel, dt))
      v = _project(x_bse, _cast(self.v_kernel, dt))
    if c.qkv_bias:
      q = q + _cast(self.q_bias, dt)
      k = k + _cast(self.k_bias, dt)
      v = v + _cast(self.v_bias, dt)
    if not c.is_gpt2:
      q = _rope(q, rotary)
      k = _rope(k, rotary)
    # HF's repeat_kv gives kv head h to query heads h*G..h*G+G-1, i.e. a plain reshape.
    b, s = q.shape[:2]
    q_bshgd = q.reshape(b, s, c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim)
    return q_bshgd, k, v

  def _fused_qkv(self, x_bse: jax.Array, dense=_plain_dense):
    """q [B,S,H,D], k and v [B,S,Hkv,D] from one [E, Hkv*(G+2)*D] matmul.

    The kernels are concatenated per kv head, [E, Hkv, G + 2, D] (the G query heads of a group,
    then its key and value head), so a kernel split over heads (tensor parallelism) stays split
    over the merged axis without any exchange. Inside the sampler's decode loop the weights are
    loop-invariant and XLA hoists the concatenation out of the loop: three decode-step matmuls
    of a few rows become one (-7% of a hidden-256 rollout on 2 CPU cores).
    """
    c = self.config
    dt = x_bse.dtype
    e, hkv, d = c.hidden_size, c.num_kv_heads, c.head_dim
    g = c.num_heads // hkv
    kernel = jnp.concatenate([_cast(self.q_kernel, dt).reshape(e, hkv, g, d),
                              _cast(self.k_kernel, dt).reshape(e, hkv, 1, d),
                              _cast(self.v_kernel, dt).reshape(e, hkv, 1, d)], axis=2)
    y = dense('qkv', x_bse, kernel.reshape(e, hkv * (g + 2) * d))
    b, s = y.shape[:2]
    y = y.reshape(b, s, hkv, g + 2, d)
    return y[:, :, :, :g].reshape(b, s, hkv * g, d), y[:, :, :, g], y[:, :, :, g + 1]

  def out(self, o_bshgd: jax.Array, dense=_plain_dense) -> jax.Array:
    c = self.config
    b, s = o_bshgd.shape[:2]
    o_bsf = o_bshgd.reshape(b, s, c.num_heads * c.head_dim)
    kernel = _cast(self.o_kernel, o_bsf.dtype)
    y = dense('out', o_bsf, kernel.reshape(-1, kernel.shape[-1]))
    if c.is_gpt2:
      y = y + _cast(self.o_bias, y.dtype)
    return y


class MLP(nnx.Module):
  """SwiGLU (llama/qwen2) or GELU-tanh with biases (gpt2 'gelu_new')."""

  def __init__(self, config: TransformerConfig, rngs: nnx.Rngs):
    c = config
    pdt = _DTYPES[c.param_dtype]
    self.gpt2 = c.is_gpt2
    init = nnx.initializers.normal(0.02)
    e, f = c.hidden_size, c.intermediate_size
    self.up_kernel = _param(rngs, init, (e, f), ('embed', 'mlp'), pdt)
    self.down_kernel = _param(rngs, init, (f, e), ('mlp', 'embed'), pdt)
    if self.gpt2:
      self.up_bias = _param(rngs, nnx.initializers.zeros, (f,), ('mlp',), pdt)
      self.down_bias = _param(rngs, nnx.initializers.zeros, (e,), ('embed',), pdt)
    else:
      self.gate_kernel = _param(rngs, init, (e, f), ('embed', 'mlp'), pdt)

  def __call__(self, x_bse: jax.Array, dense=_plain_dense) -> jax.Array:
    dt = x_bse.dtype
    up = dense('up', x_bse, _cast(self.up_kernel, dt))
    if self.gpt2:
      h = jax.nn.gelu(up + _cast(self.up_bias, dt), approximate=True)
    else:
      gate = dense('gate', x_bse, _cast(self.gate_kernel, dt))
      h = jax.nn.silu(gate) * up
    y = dense('down', h, _cast(self.down_kernel, dt))
    if self.gpt2:
      y = y + _cast(self.down_bias, dt)
    return y


class Block(nnx.Module):

  def __init__(self, config: TransformerConfig, rngs: nnx.Rngs):
    self.attn_norm = Norm(config, rngs)
    self.attn = Attention(config, rngs)
    self.mlp_norm = Norm(config, rngs)
    self.mlp = MLP(config, rngs)


def _softmax_f32(scores: jax.Array, mask: jax.Array) -> jax.Array:
  return jax.nn.softmax(jnp.where(mask, scores, _MASKED), axis=-1)


def _full_attention(q_bshgd, k_bthd, v_bthd, mask_bt):
  """Causal in index order, keys masked by mask_bt, so padding may sit anywhere in a row."""
  s, t = q_bshgd.shape[1], k_bthd.shape[1]
  scale = 1.0 / math.sqrt(q_bshgd.shape[-1])
  scores = jnp.einsum('bshgd,bthd->bhgst', q_bshgd, k_bthd,
                      preferred_element_type=jnp.float32) * scale
  causal_st = jnp.arange(s)[:, None] >= jnp.arange(t)[None, :]
  mask = causal_st[None, None, None] & mask_bt.astype(bool)[:, None, None, None, :]
  probs = _softmax_f32(scores, mask).astype(v_bthd.dtype)
  return jnp.einsum('bhgst,bthd->bshgd', probs, v_bthd)


def _decode_mask(prefix_mask_bp, k: int, t: int, index):
  """[B, K, 1, 1, P + T] keys a decode query sees: the prompt's valid columns, then the
  stream's own slots 0..index."""
  b, p = prefix_mask_bp.shape
  mask_p = jnp.broadcast_to(prefix_mask_bp.astype(bool)[:, None, :], (b, k, p))
  mask_t = jnp.broadcast_to(jnp.arange(t) <= index, (b, k, t))
  return jnp.concatenate([mask_p, mask_t], axis=-1)[:, :, None, None, :]


def _shared_prefix_attention(q_bkhgd, prefix_k_bhdp, prefix_v_bhpd, prefix_mask_bp,
                             k_bkhdt, v_bkhtd, index):
  """K streams per row attend to the row's single prefix cache and to their own keys 0..index.

  The prefix is contracted against all K queries at once instead of being tiled per stream, so
  its memory traffic is paid once per row; both score blocks share one float32 softmax.
  """
  scale = 1.0 / math.sqrt(q_bkhgd.shape[-1])
  f32 = jnp.float32
  # With K > 1 streams the prefix products are written as broadcast-multiply-and-sum rather than
  # einsum: as a dot they are batched over (b, h) with only K*G rows each, which XLA:CPU runs at
  # ~5 GFLOP/s, while the reduction streams the prefix once (-30% of a 512-token-prompt rollout).
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
  scores = jnp.concatenate([scores_p, scores_t], axis=-1) * scale
  probs = _softmax_f32(scores, _decode_mask(prefix_mask_bp, q_bkhgd.shape[1], t, index))
  probs = probs.astype(v_bkhtd.dtype)
  if reduce_form:
    out = jnp.sum(probs[..., :p, None].astype(f32) * prefix_v_bhpd.astype(f32)[:, None, :, None],
                  axis=4).astype(v_bkhtd.dtype)
  else:
    out = jnp.einsum('bkhgp,bhpd->bkhgd', probs[..., :p], prefix_v_bhpd)
  return out + jnp.einsum('bkhgt,bkhtd->bkhgd', probs[..., p:], v_bkhtd)


def _stream_attention(q_bkhgd, prefix_mask_bp, k_bkhdt, v_bkhtd, index, copied: int):
  """Decode attention over each stream's own buffer, whose first `copied` slots hold the prompt
  (masked by prefix_mask_bp) and whose next slots hold its tokens 0..index."""
  scale = 1.0 / math.sqrt(q_bkhgd.shape[-1])
  scores = jnp.einsum('bkhgd,bkhdt->bkhgt', q_bkhgd, k_bkhdt,
                      preferred_element_type=jnp.float32) * scale
  mask = _decode_mask(prefix_mask_bp, q_bkhgd.shape[1], k_bkhdt.shape[-1] - copied, index)
  probs = _softmax_f32(scores, mask).astype(v_bkhtd.dtype)
  return jnp.einsum('bkhgt,bkhtd->bkhgd', probs, v_bkhtd)


def _grouped_attention(q_bshgd, k_bshd, v_bshd, prompt_mask_bp, mask_bmt, num_prompt: int):
  """Attention over rows laid out per prompt as [prompt (P) | T tokens x M completions], the
  completions token-major (row P + i*M + j: token i of completion j).

  The prompt's queries attend causally within the prompt; each completion's queries attend to the
  prompt's keys (computed once, never tiled M times) and causally to their own completion. Both
  score blocks of a completion query share one float32 softmax.
  """
  p = num_prompt
  b, _, h, g, d = q_bshgd.shape
  m, t = mask_bmt.shape[1:]
  qp, kp, vp = q_bshgd[:, :p], k_bshd[:, :p], v_bshd[:, :p]
  out_p = _full_attention(qp, kp, vp, prompt_mask_bp)
  qc = q_bshgd[:, p:].reshape(b, t, m, h, g, d)
  kc = k_bshd[:, p:].reshape(b, t, m, h, d)
  vc = v_bshd[:, p:].reshape(b, t, m, h, d)
  scale = 1.0 / math.sqrt(d)
  f32 = jnp.float32
  scores_p = jnp.einsum('btmhgd,bphd->bmhgtp', qc, kp, preferred_element_type=f32)
  scores_c = jnp.einsum('btmhgd,bsmhd->bmhgts', qc, kc, preferred_element_type=f32)
  scores = jnp.concatenate([scores_p, scores_c], axis=-1) * scale
  mask_p = jnp.broadcast_to(prompt_mask_bp.astype(bool)[:, None, None, None, None, :],
                            (b, m, 1, 1, t, p))
  causal_ts = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
  mask_c = causal_ts[None, None, None, None] & mask_bmt.astype(bool)[:, :, None, None, None, :]
  mask = jnp.concatenate([mask_p, mask_c], axis=-1)
  probs = _softmax_f32(scores, mask).astype(v_bshd.dtype)
  out_c = (jnp.einsum('bmhgtp,bphd->btmhgd', probs[..., :p], vp)
           + jnp.einsum('bmhgts,bsmhd->btmhgd', probs[..., p:], vc))
  return jnp.concatenate([out_p, out_c.reshape(b, t * m, h, g, d)], axis=1)


class Transformer(nnx.Module):
  """Decoder-only LM (head='lm': logits [B,S,V]) or value/reward model (head='scalar': [B,S])."""

  def __init__(self, config: TransformerConfig, rngs: nnx.Rngs):
    c = config
    pdt = _DTYPES[c.param_dtype]
    self.config = c
    self.embedding = _param(rngs, nnx.initializers.normal(0.02), (c.vocab_size, c.hidden_size),
                            ('vocab', 'embed'), pdt)
    if c.is_gpt2:
      self.pos_embedding = _param(rngs, nnx.initializers.normal(0.01),
                                  (c.max_seq_len, c.hidden_size), (None, 'embed'), pdt)
    self.layers = nnx.List([Block(c, rngs) for _ in range(c.num_layers)])
    self.final_norm = Norm(c, rngs)
    if c.head == 'scalar':
      self.score_kernel = _param(rngs, nnx.initializers.normal(0.02), (c.hidden_size, 1),
                                 ('embed', None), pdt)
      self.score_bias = _param(rngs, nnx.initializers.zeros, (1,), (None,), pdt)
    elif not c.tie_embeddings:
      self.lm_head = _param(rngs, nnx.initializers.normal(0.02), (c.hidden_size, c.vocab_size),
                            ('embed', 'vocab'), pdt)

  def _embed(self, tokens_bs, positions_bs):
    dt = _DTYPES[self.config.dtype]
    # mode='clip': jnp.take's default fills out-of-range ids with NaN, and a NaN value in a pad
    # slot would survive its zero attention weight (0 * NaN) and poison the valid positions.
    x = jnp.take(self.embedding[...], tokens_bs, axis=0, mode='clip').astype(dt)
    if self.config.is_gpt2:
      x = x + jnp.take(self.pos_embedding[...], positions_bs, axis=0, mode='clip').astype(dt)
    return x

  def _rotary(self, positions_bs):
    c = self.config
    return None if c.is_gpt2 else _rotary(positions_bs, c.head_dim, c.rope_theta, c.max_seq_len)

  def _head(self, x_bse):
    """Final norm and head; the contraction accumulates and returns float32 whatever the dtype."""
    x = self.final_norm(x_bse)
    f32 = jnp.float32
    if self.config.head == 'scalar':
      v = jnp.einsum('bse,eo->bso', x, _cast(self.score_kernel, x.dtype), preferred_element_type=f32)
      return v[..., 0] + self.score_bias[...].astype(f32)[0]
    if self.config.tie_embeddings:
      return _dense(x, _cast(self.embedding, x.dtype).T, preferred_element_type=f32)
    return _dense(x, _cast(self.lm_head, x.dtype), preferred_element_type=f32)

  def _trunk(self, tokens_bs, positions_bs, mask_bs, tapes=None):
    """Every layer over the full sequence: final hidden states and each layer's K/V.
    tapes: one `dense` per layer (e.g. `_Recorder`s), or None for plain matmuls."""
    x = self._embed(tokens_bs, positions_bs)
    rotary = self._rotary(positions_bs)
    ks, vs = [], []
    for l, block in enumerate(self.layers):
      dense = _plain_dense if tapes is None else tapes[l]
      q, k, v = block.attn.qkv(block.attn_norm(x), rotary, dense=dense)
      x = x + block.attn.out(_full_attention(q, k, v, mask_bs), dense)
      x = x + block.mlp(block.mlp_norm(x), dense)
      ks.append(k)
      vs.append(v)
    return x, ks, vs

  def prefill(self, tokens_bp, positions_bp, mask_bp, record: bool = False):
    """(logits [B,P,V], PrefixKV); with record=True also every layer's matmul outputs,
    ((y_bpf, ...), ...) per layer in `activation_layout` order (see `_Recorder`, `_pack`)."""
    tapes = [_Recorder() for _ in self.layers] if record else None
    x, ks, vs = self._trunk(tokens_bp, positions_bp, mask_bp, tapes)
    out = self._head(x), PrefixKV(k_lbphd=jnp.stack(ks), v_lbphd=jnp.stack(vs))
    return out + (_pack(tapes, self.config),) if record else out

  def __call__(self, tokens_bs, positions_bs, mask_bs, head_slice=None):
    """Logits [B, S, V]; with head_slice=(start, length) (static ints) only positions
    start..start+length-1 go through the final norm and head: [B, length, V]. A policy loss needs
    only the completion's logits, so the prompt's are never computed (nor differentiated)."""
    x = self._trunk(tokens_bs, positions_bs, mask_bs)[0]
    if head_slice is not None:
      start, length = head_slice
      x = jax.lax.slice_in_dim(x, start, start + length, axis=1)
    return self._head(x)

  def grouped(self, prompt_tokens_bp, prompt_positions_bp, prompt_mask_bp, tokens_nt,
              positions_nt, mask_nt, saved=None):
    """Logits [N, T, V] predicting each row of tokens_nt, where row n continues prompt n // M
    (M = N / B rows per prompt: RLOO's k samples), with every prompt computed once.

    Equal (up to float rounding) to `__call__` on the N rows [prompt | tokens] with
    head_slice=(P - 1, T), at P*B instead of P*N prompt tokens of compute, forward and backward.
    Needs T >= 1 completion columns.
    Prompts must be left-padded (their last token in column P - 1), as `rollout_sequences` does.
    Rows are laid out per prompt, [B, P + (T-1)*M], so a batch sharding over B holds throughout;
    the completions token-major: row P + i*M + j holds token i of sample j, so the M tokens of
    one decode step are adjacent (the sampler records in this layout).

    saved: the trunk's matmul outputs recorded in these rows, [B, P + (T-1)*M, F] each, while
    these tokens were sampled with these params (the sampler's `activations`: one tuple per
    layer in `activation_layout` order). The
    forward then runs no trunk matmul (`_replayed_matmul`): only the elementwise work,
    attention's score and value products and the head; its gradient is the same up to float
    rounding. Valid only at the params that produced the recording.
    """
    b, p = prompt_tokens_bp.shape
    n, t = tokens_nt.shape
    if n % b:
      raise ValueError(f'grouped forward: {n} completion rows do not split over {b} prompts')
    m = n // b
    # A completion's last token is never fed: its hidden state predicts nothing scored here, and
    # under the causal mask no earlier position sees it.
    u = t - 1
    token_major = lambda x_nt: x_nt[:, :u].reshape(b, m, u).transpose(0, 2, 1).reshape(b, u * m)
    tokens = jnp.concatenate([prompt_tokens_bp, token_major(tokens_nt)], axis=1)
    positions = jnp.concatenate([prompt_positions_bp, token_major(positions_nt)], axis=1)
    x = self._embed(tokens, positions)
    mask_bmu = mask_nt[:, :u].reshape(b, m, u)
    rotary = self._rotary(positions)
    last = len(self.layers) - 1
    tapes = None
    if saved is not None:
      layout = activation_layout(self.config)
      want = tuple(tuple((b, p + u * m, w) for _, w in layout) for _ in self.layers)
      got = jax.tree.map(lambda y: tuple(y.shape), saved, is_leaf=lambda y: hasattr(y, 'shape'))
      if got != want:
        raise ValueError(f'saved activations of shapes {got}; these rows need {want} per layer '
                         f'and name {[n for n, _ in layout]} (the sampler\'s record_activations '
                         f'output)')
      tapes = [_Replayer(saved_l, self.config) for saved_l in saved]
    for l, block in enumerate(self.layers):
      dense = _plain_dense if tapes is None else tapes[l]
      q, k, v = block.attn.qkv(block.attn_norm(x), rotary, dense=dense)
      o = _grouped_attention(q, k, v, prompt_mask_bp, mask_bmu, p)
      if l == last:
        # The last layer's prompt rows serve only as keys/values, except column P - 1, which
        # predicts each completion's first token: the rest skip the output projection and MLP.
        x, o = x[:, p - 1:], o[:, p - 1:]
      x = x + block.attn.out(o, dense)
      x = x + block.mlp(block.mlp_norm(x), dense)
    e = x.shape[-1]
    # Token 0 of every completion is predicted from its prompt's last column (now row 0), token
    # i > 0 from completion position i - 1.
    last_b1e = x[:, :1]
    xc = x[:, 1:].reshape(b, u, m, e).transpose(0, 2, 1, 3)
    h = jnp.concatenate([jnp.broadcast_to(last_b1e[:, None], (b, m, 1, e)), xc], axis=2)
    return self._head(h.reshape(n, t, e))

  def decode(self, tokens_bk, positions_bk, cache: DecodeCache, record: bool = False):
    """One token per stream, written at stream slot cache.copied_prefix + cache.index (callers
    keep index < max_new_tokens: dynamic_update_slice clamps, so a step past the end would
    overwrite the last slot). Returns (logits [B,K,V], cache); with record=True also every
    layer's matmul outputs for these tokens, ((y_bkf, ...), ...) (see `_pack`)."""
    tapes = [_Recorder() for _ in self.layers] if record else None
    x = self._embed(tokens_bk, positions_bk)
    k_caches, v_caches = [], []
    idx = cache.index.astype(jnp.int32)
    slot = idx + cache.copied_prefix
    zero = jnp.zeros((), jnp.int32)
    rotary = self._rotary(positions_bk)
    for l, block in enumerate(self.layers):
      # K plays the sequence axis.
      dense = _plain_dense if tapes is None else tapes[l]
      q, k, v = block.attn.qkv(block.attn_norm(x), rotary, fused=True, dense=dense)
      # k, v: [B, K, Hkv, D] into the slot of the T axis (last for keys, second to last for
      # values); the while loop's donated per-layer buffers are updated in place.
      k_cache = jax.lax.dynamic_update_slice(
          cache.k_bkhdt[l], k[..., None].astype(cache.k_bkhdt[l].dtype),
          (zero, zero, zero, zero, slot))
      v_cache = jax.lax.dynamic_update_slice(
          cache.v_bkhtd[l], v[:, :, :, None].astype(cache.v_bkhtd[l].dtype),
          (zero, zero, zero, slot, zero))
      k_caches.append(k_cache)
      v_caches.append(v_cache)
      if cache.copied_prefix:
        o = _stream_attention(q, cache.prefix_mask_bp, k_cache, v_cache, idx,
                              cache.copied_prefix)
      else:
        o = _shared_prefix_attention(q, cache.prefix_k_bhdp[l], cache.prefix_v_bhpd[l],
                                     cache.prefix_mask_bp, k_cache, v_cache, idx)
      x = x + block.attn.out(o, dense)
      x = x + block.mlp(block.mlp_norm(x), dense)
    new_cache = cache.replace(k_bkhdt=tuple(k_caches), v_bkhtd=tuple(v_caches), index=idx + 1)
    if record:
      return self._head(x), new_cache, _pack(tapes, self.config)
    return self._head(x), new_cache


def init_cache(prefix: PrefixKV, mask_bp: jax.Array, num_streams: int,
               max_new_tokens: int, copy_prefix_max_len: int | None = None) -> DecodeCache:
  """The decode cache of `prefix` (transposed once here into the decode layouts) with empty
  stream slots: shared, one prefix per prompt row, or for prompts of at most
  `copy_prefix_max_len` tokens (default COPY_PREFIX_MAX_LEN) copied into the front of each of
  the `num_streams` buffers (see `DecodeCache`). Stream slots are valid up to index."""
  l, b, p, h, d = prefix.k_lbphd.shape
  dt = prefix.k_lbphd.dtype
  limit = COPY_PREFIX_MAX_LEN if copy_prefix_max_len is None else copy_prefix_max_len
  k_bhdp = tuple(jnp.transpose(prefix.k_lbphd[i], (0, 2, 3, 1)) for i in range(l))
  v_bhpd = tuple(jnp.transpose(prefix.v_lbphd[i], (0, 2, 1, 3)) for i in range(l))
  mask_bp = jnp.asarray(mask_bp, bool)
  index = jnp.zeros((), jnp.int32)
  if p <= limit:
    streams = lambda x: jnp.broadcast_to(x[:, None], (b, num_streams, *x.shape[1:]))
    empty_k = jnp.zeros((b, num_streams, h, d, max_new_tokens), dt)
    empty_v = jnp.zeros((b, num_streams, h, max_new_tokens, d), dt)
    return DecodeCache(
        prefix_k_bhdp=(), prefix_v_bhpd=(), prefix_mask_bp=mask_bp,
        k_bkhdt=tuple(jnp.concatenate([streams(x), empty_k], axis=-1) for x in k_bhdp),
        v_bkhtd=tuple(jnp.concatenate([streams(x), empty_v], axis=-2) for x in v_bhpd),
        index=index, copied_prefix=p)
  zeros = lambda *shape: tuple(jnp.zeros(shape, dt) for _ in range(l))
  return DecodeCache(
      prefix_k_bhdp=k_bhdp, prefix_v_bhpd=v_bhpd, prefix_mask_bp=mask_bp,
      k_bkhdt=zeros(b, num_streams, h, d, max_new_tokens),
      v_bkhtd=zeros(b, num_streams, h, max_new_tokens, d),
      index=index)


class ModelFns(NamedTuple):
  """Pure functions over (params, arrays); hashable by identity, so usable as a static jit arg.

  `config` rides along so callers (the sampler's context-length check) need no second argument.
  """

  forward: Callable
  prefill: Callable
  init_cache: Callable
  decode: Callable
  config: TransformerConfig | None = None
  grouped: Callable | None = None


def _config_of(graphdef) -> TransformerConfig | None:
  # The root module's config is a static attribute of the graphdef; read it rather than merging.
  for _, attr in getattr(graphdef, 'attributes', ()):
    if isinstance(getattr(attr, 'value', None), TransformerConfig):
      return attr.value
  return None


@functools.lru_cache(maxsize=None)
def model_fns(graphdef) -> ModelFns:
  """Memoised so one graphdef always yields the same ModelFns (no jit cache misses)."""

  def forward(params, tokens_bs, positions_bs, mask_bs, head_slice=None):
    return nnx.merge(graphdef, params)(tokens_bs, positions_bs, mask_bs, head_slice=head_slice)

  def prefill(params, tokens_bp, positions_bp, mask_bp, record=False):
    return nnx.merge(graphdef, params).prefill(tokens_bp, positions_bp, mask_bp, record=record)

  def decode(params, tokens_bk, positions_bk, cache, record=False):
    return nnx.merge(graphdef, params).decode(tokens_bk, positions_bk, cache, record=record)

  def grouped(params, prompt_tokens_bp, prompt_positions_bp, prompt_mask_bp, tokens_nt,
              positions_nt, mask_nt, saved=None):
    return nnx.merge(graphdef, params).grouped(prompt_tokens_bp, prompt_positions_bp,
                                               prompt_mask_bp, tokens_nt, positions_nt, mask_nt,
                                               saved=saved)

  return ModelFns(forward=forward, prefill=prefill, init_cache=init_cache, decode=decode,
                  config=_config_of(graphdef), grouped=grouped)


def create(config: TransformerConfig, seed: int = 0):
  """(graphdef, params) of a freshly initialised model; params is an nnx.State of Params."""
  graphdef = abstract(config)[0]
  # One compiled init instead of one eager dispatch (and compile) per tensor shape.
  params = jax.jit(lambda: nnx.split(Transformer(config, rngs=nnx.Rngs(seed)))[1])()
  return graphdef, params


def abstract(config: TransformerConfig):
  """(graphdef, params of ShapeDtypeStructs with logical-axis metadata), nothing materialised."""
  return nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))

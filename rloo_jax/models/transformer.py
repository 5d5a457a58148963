"""One decoder-only transformer for the Llama, Qwen2 and GPT-2 families, with an explicit KV cache.

The module is Flax NNX; everything outside this package calls the pure functions of
`model_fns(graphdef)` (forward / prefill / init_cache / decode / grouped) on a params `nnx.State`,
so jit, grad and donation see plain pytrees and no hidden mutable state.

Decoding is built for RLOO's access pattern: k completions per prompt. `prefill` runs the prompt once;
`decode` lets the k streams of a prompt attend to that single prefix cache (never copied k times) plus
their own per-stream cache, with both score blocks joined in one float32 softmax.

The pieces live in their own modules (config, layers, attention, cache); the names other code
reaches through this module are re-exported here.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from rloo_jax.models.attention import (  # noqa: F401  (re-exported)
    _MASKED, Attention, _decode_mask, _full_attention, _grouped_attention,
    _shared_prefix_attention, _softmax_f32, _stream_attention)
from rloo_jax.models.cache import (  # noqa: F401  (re-exported)
    COPY_PREFIX_MAX_LEN, DecodeCache, PrefixKV, init_cache)
from rloo_jax.models.config import (  # noqa: F401  (re-exported)
    _DTYPES, FAMILIES, HEADS, TransformerConfig, dtype_of, from_experiment_config)
from rloo_jax.models.layers import (  # noqa: F401  (re-exported)
    MLP, Norm, _cast, _dense, _param, _project, _rope, _rotary)


class Block(nnx.Module):

  def __init__(self, config: TransformerConfig, rngs: nnx.Rngs):
    self.attn_norm = Norm(config, rngs)
    self.attn = Attention(config, rngs)
    self.mlp_norm = Norm(config, rngs)
    self.mlp = MLP(config, rngs)


class Transformer(nnx.Module):
  """Decoder-only LM (head='lm': logits [B,S,V]) or value/reward model (head='scalar': [B,S])."""

  def __init__(self, config: TransformerConfig, rngs: nnx.Rngs):
    c = config
    pdt = dtype_of(c.param_dtype)
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
    dt = dtype_of(self.config.dtype)
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

  def _trunk(self, tokens_bs, positions_bs, mask_bs):
    """Every layer over the full sequence: final hidden states and each layer's K/V."""
    x = self._embed(tokens_bs, positions_bs)
    rotary = self._rotary(positions_bs)
    ks, vs = [], []
    for block in self.layers:
      q, k, v = block.attn.qkv(block.attn_norm(x), rotary)
      x = x + block.attn.out(_full_attention(q, k, v, mask_bs))
      x = x + block.mlp(block.mlp_norm(x))
      ks.append(k)
      vs.append(v)
    return x, ks, vs

  def prefill(self, tokens_bp, positions_bp, mask_bp):
    """(logits [B,P,V], PrefixKV)."""
    x, ks, vs = self._trunk(tokens_bp, positions_bp, mask_bp)
    return self._head(x), PrefixKV(k_lbphd=jnp.stack(ks), v_lbphd=jnp.stack(vs))

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
              positions_nt, mask_nt):
    """Logits [N, T, V] predicting each row of tokens_nt, where row n continues prompt n // M
    (M = N / B rows per prompt: RLOO's k samples), with every prompt computed once.

    Equal (up to float rounding) to `__call__` on the N rows [prompt | tokens] with
    head_slice=(P - 1, T), at P*B instead of P*N prompt tokens of compute, forward and backward.
    Needs T >= 1 completion columns.
    Prompts must be left-padded (their last token in column P - 1), as `rollout_sequences` does.
    Rows are laid out per prompt, [B, P + (T-1)*M], so a batch sharding over B holds throughout;
    the completions token-major: row P + i*M + j holds token i of sample j, so the M tokens of
    one decode step are adjacent.
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
    for l, block in enumerate(self.layers):
      q, k, v = block.attn.qkv(block.attn_norm(x), rotary)
      o = _grouped_attention(q, k, v, prompt_mask_bp, mask_bmu, p)
      if l == last:
        # The last layer's prompt rows serve only as keys/values, except column P - 1, which
        # predicts each completion's first token: the rest skip the output projection and MLP.
        x, o = x[:, p - 1:], o[:, p - 1:]
      x = x + block.attn.out(o)
      x = x + block.mlp(block.mlp_norm(x))
    e = x.shape[-1]
    # Token 0 of every completion is predicted from its prompt's last column (now row 0), token
    # i > 0 from completion position i - 1.
    last_b1e = x[:, :1]
    xc = x[:, 1:].reshape(b, u, m, e).transpose(0, 2, 1, 3)
    h = jnp.concatenate([jnp.broadcast_to(last_b1e[:, None], (b, m, 1, e)), xc], axis=2)
    return self._head(h.reshape(n, t, e))

  def decode(self, tokens_bk, positions_bk, cache: DecodeCache):
    """One token per stream, written at stream slot cache.copied_prefix + cache.index (callers
    keep index < max_new_tokens: dynamic_update_slice clamps, so a step past the end would
    overwrite the last slot). Returns (logits [B,K,V], cache)."""
    x = self._embed(tokens_bk, positions_bk)
    k_caches, v_caches = [], []
    idx = cache.index.astype(jnp.int32)
    slot = idx + cache.copied_prefix
    zero = jnp.zeros((), jnp.int32)
    rotary = self._rotary(positions_bk)
    for l, block in enumerate(self.layers):
      # K plays the sequence axis.
      q, k, v = block.attn.qkv(block.attn_norm(x), rotary, fused=True)
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
      x = x + block.attn.out(o)
      x = x + block.mlp(block.mlp_norm(x))
    new_cache = cache.replace(k_bkhdt=tuple(k_caches), v_bkhtd=tuple(v_caches), index=idx + 1)
    return self._head(x), new_cache


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

  def prefill(params, tokens_bp, positions_bp, mask_bp):
    return nnx.merge(graphdef, params).prefill(tokens_bp, positions_bp, mask_bp)

  def decode(params, tokens_bk, positions_bk, cache):
    return nnx.merge(graphdef, params).decode(tokens_bk, positions_bk, cache)

  def grouped(params, prompt_tokens_bp, prompt_positions_bp, prompt_mask_bp, tokens_nt,
              positions_nt, mask_nt):
    return nnx.merge(graphdef, params).grouped(prompt_tokens_bp, prompt_positions_bp,
                                               prompt_mask_bp, tokens_nt, positions_nt, mask_nt)

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

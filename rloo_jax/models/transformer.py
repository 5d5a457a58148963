"""One decoder-only transformer for the Llama, Qwen2/3, Gemma 2/3, GPT-2 and GPT-NeoX (Pythia)
families, with an explicit KV cache.

The module is Flax NNX; everything outside this package calls the pure functions of
`model_fns(graphdef)` (forward / prefill / init_cache / decode / grouped) on a params `nnx.State`,
so jit, grad and donation see plain pytrees and no hidden mutable state.

Decoding serves RLOO's k completions per prompt: `prefill` runs a prompt once, and `decode`'s k
streams attend to its one prefix cache (never copied k times) and their own, in one float32 softmax.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rloo_jax.models import attention_ops, traced_mesh
from rloo_jax.models.block import stacked_blocks
from rloo_jax.models.cache import (  # noqa: F401  (re-exported)
    DecodeCache, PrefixKV, init_cache, write_page, write_slot)
from rloo_jax.models.config import _DTYPES, TransformerConfig, dtype_of  # noqa: F401  (re-exported)
from rloo_jax.models import decode_weights as decode_weights_lib
from rloo_jax.models.layers import Norm, _param, _rotary, apply_head
from rloo_jax.models.presets import from_experiment_config  # noqa: F401  (re-exported)


# The parameters `head` reads (every other top-level entry is the embedding input or the layers).
HEAD_KEYS = ('final_norm', 'embedding', 'lm_head', 'score_kernel', 'score_bias')


def _last_valid(x_bse, mask_bs):
  """x at each row's last True mask column: [B, 1, E], one row twice ([2, 1, E]): one row's head
  is a vector-matrix product, for which XLA:GPU converts the whole head to float32."""
  s = mask_bs.shape[1]
  last_b = s - 1 - jnp.argmax(mask_bs[:, ::-1].astype(jnp.int32), axis=1)
  x = jnp.take_along_axis(x_bse, last_b[:, None, None], axis=1)
  return jnp.concatenate([x, x]) if x.shape[0] == 1 else x


class Transformer(nnx.Module):
  """Decoder-only LM (head='lm': logits [B,S,V]) or value/reward model (head='scalar': [B,S]).

  The layers are one stacked `Block` run by `jax.lax.scan` (`_scan`): program size and compile
  time do not grow with depth, the body is rematerialised by `config.remat`, and with a
  `gather` (sharding.ParamGather) each layer's FSDP-sharded weights are gathered only as the
  scan reaches them.
  """

  def __init__(self, config: TransformerConfig, rngs: nnx.Rngs):
    c = config
    pdt = dtype_of(c.param_dtype)
    self.config = c
    self.embedding = _param(rngs, nnx.initializers.normal(0.02), (c.vocab_size, c.hidden_size),
                            ('vocab', 'embed'), pdt)
    if c.is_gpt2:
      self.pos_embedding = _param(rngs, nnx.initializers.normal(0.01),
                                  (c.max_seq_len, c.hidden_size), (None, 'embed'), pdt)
    self.layers = stacked_blocks(c, rngs)
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
    if self.config.is_gemma:
      # Gemma scales by sqrt(hidden) rounded to the activation dtype, as transformers does.
      x = x * jnp.asarray(self.config.hidden_size ** 0.5, dt)
    return x

  def _rotary(self, positions_bs):
    """The layers' rotary tables: (global, local). local is None unless the sliding layers
    have their own RoPE base (config.local_rope_theta, Gemma 3), which rotates unscaled."""
    c = self.config
    if c.is_gpt2:
      return None, None
    rotary = _rotary(positions_bs, c.rotary_dim, c.rope_theta, c.max_seq_len, c.rope_scaling)
    local = None
    if c.local_rope_theta and any(c.sliding_layers):
      local = _rotary(positions_bs, c.rotary_dim, c.local_rope_theta, c.max_seq_len)
    return rotary, local

  def head_params(self) -> dict:
    """This module's `HEAD_KEYS` parameters, laid out as `model_fns(...).head_params` gives them."""
    out = {k: getattr(self, k) for k in HEAD_KEYS[1:] if hasattr(self, k)}
    norm = self.final_norm
    out['final_norm'] = {k: getattr(norm, k) for k in ('scale', 'bias') if hasattr(norm, k)}
    return out

  def _head(self, x_bse):
    return apply_head(self.config, self.head_params(), x_bse)

  def _spec(self, layout, window) -> attention_ops.AttentionSpec:
    c = self.config
    return attention_ops.AttentionSpec(layout, c.attn_scale, c.attn_softcap,
                                       window if any(c.sliding_layers) else None, c.attention,
                                       c.sliding_window)

  def _scan(self, body, x, positions, layout, carry=None, xs=None, gather=None, layers=None):
    """Runs `body(block, x, carry, xs_l, rotary, spec) -> (x, carry, y)` over the layers with
    lax.scan; returns (x, carry, ys stacked on a leading layers axis). `rotary` is the layer's
    table at `positions` (`_rotary`), `spec` its `attention_ops.AttentionSpec` over `layout`
    (with sliding layers, the layer's window), so layers of two kinds share one scanned body.

    `layers`: per-layer weight trees (`decode_weights`, the decode loop's) run unrolled instead
    (ys None): a scanned layer copies its weights out of the stack at every call."""
    c = self.config
    graphdef, stacked = nnx.split(self.layers)
    if layers is not None:
      return self._unrolled(graphdef, layers, body, x, positions, layout, carry, xs, gather)
    global_rot, local_rot = self._rotary(positions)
    # A full layer's window: no distance reaches it.
    windows_l = jnp.where(jnp.asarray(c.sliding_layers), c.sliding_window,
                          jnp.iinfo(jnp.int32).max).astype(jnp.int32)

    def step(state, layer):
      x, carry = state
      weights, window, xs_l = layer
      if gather is not None:
        weights = gather.layer(weights)
      rotary = global_rot
      if local_rot is not None:
        local = window < jnp.iinfo(jnp.int32).max
        rotary = tuple(jnp.where(local, a, b) for a, b in zip(local_rot, global_rot))
      x, carry, y = body(nnx.merge(graphdef, weights), x, carry, xs_l, rotary,
                         self._spec(layout, window))
      return (x, carry), y

    policy = remat_policy(c)
    if c.remat != 'none':
      step = jax.checkpoint(step, policy=policy, prevent_cse=False)
    (x, carry), ys = jax.lax.scan(step, (x, carry), (stacked, windows_l, xs))
    return x, carry, ys

  def _unrolled(self, graphdef, layers, body, x, positions, layout, carry, xs, gather):
    c = self.config
    global_rot, local_rot = self._rotary(positions)
    ys = []
    for l, weights in enumerate(layers):
      weights = weights if gather is None else gather.layer(weights)
      local = bool(c.sliding_layers[l])
      rotary = local_rot if (local and local_rot is not None) else global_rot
      window = jnp.int32(c.sliding_window if local else jnp.iinfo(jnp.int32).max)
      x, carry, y = body(nnx.merge(graphdef, weights), x, carry,
                         jax.tree.map(lambda v, l=l: v[l], xs), rotary, self._spec(layout, window))
      ys.append(y)
    return x, carry, None if ys[0] is None else jax.tree.map(lambda *y: jnp.stack(y), *ys)

  def _trunk(self, tokens_bs, positions_bs, mask_bs, gather=None, keep_kv=False, segments=None,
             layers=None):
    """Every layer over the full sequence: pre-norm final hidden states, and with keep_kv each
    layer's K/V [L, B, S, Hkv, D]. segments: packed rows' (segment, shared) ids; layers: _scan's."""
    def body(block, x, carry, _, rotary, spec):
      x, kv = block(x, rotary, spec)
      return x, carry, kv if keep_kv else None

    x, _, kv = self._scan(body, self._embed(tokens_bs, positions_bs), positions_bs,
                          attention_ops.Causal(mask_bs, positions_bs, *(segments or ())),
                          gather=gather, layers=layers)
    return x, kv

  def prefill(self, tokens_bp, positions_bp, mask_bp, gather=None, layers=None):
    """(logits [B, V] at each row's last valid prompt position, PrefixKV). Only that position
    goes through the head: it predicts the first completion token, the others nothing."""
    x, (k, v) = self._trunk(tokens_bp, positions_bp, mask_bp, gather, keep_kv=True,
                            layers=layers)
    # Positions are kept only where a window reads them, so other caches are unchanged.
    positions = positions_bp if any(self.config.sliding_layers) else None
    return (self._head(_last_valid(x, mask_bp))[:x.shape[0], 0],
            PrefixKV(k_lbphd=k, v_lbphd=v, positions_bp=positions))

  def hidden(self, tokens_bs, positions_bs, mask_bs, head_slice=None, gather=None,
             segments=None):
    """Final hidden states before the final norm, [B, S, E]; with head_slice=(start, length)
    (static ints) positions start..start+length-1 only: [B, length, E]. `segments`: see
    `_trunk`."""
    x = self._trunk(tokens_bs, positions_bs, mask_bs, gather, segments=segments)[0]
    if head_slice is not None:
      start, length = head_slice
      x = jax.lax.slice_in_dim(x, start, start + length, axis=1)
    return x

  def __call__(self, tokens_bs, positions_bs, mask_bs, head_slice=None, gather=None):
    """Logits [B, S, V] (or [B, length, V] with head_slice, see `hidden`). A policy loss needs
    only the completion's positions, so the prompt's never go through the head."""
    return self._head(self.hidden(tokens_bs, positions_bs, mask_bs, head_slice, gather))

  def grouped_hidden(self, prompt_tokens_bp, prompt_positions_bp, prompt_mask_bp, tokens_nt,
                     positions_nt, mask_nt, gather=None):
    """Hidden states [N, T, E] (before the final norm) predicting each row of tokens_nt, where
    row n continues prompt n // M (M = N / B rows per prompt: RLOO's k samples), with every
    prompt computed once.

    Equal (up to float rounding) to `hidden` on the N rows [prompt | tokens] with
    head_slice=(P - 1, T), at P*B instead of P*N prompt tokens of compute, forward and backward.
    Needs T >= 1 completion columns.
    Prompts must be left-padded (their last token in column P - 1), as `rollout_sequences` does.
    Rows are laid out per prompt, [B, P + (T-1)*M], so a batch sharding over B holds throughout
    (with fewer prompts than batch shards, each prompt's rows split over several);
    the completions token-major: row P + i*M + j holds token i of sample j, so the M tokens of
    one decode step are adjacent.
    """
    b, p = prompt_tokens_bp.shape
    n, t = tokens_nt.shape
    if n % b:
      raise ValueError(f'grouped forward: {n} completion rows do not split over {b} prompts')
    m = n // b
    # Fewer groups than batch shards: each group's completions over s rows, its prompt in each,
    # so the rows still split one a shard instead of being resharded (traced_mesh.batch_ways).
    s = traced_mesh.batch_ways() // b if traced_mesh.batch_ways() % b == 0 else 1
    if s > 1 and m % s == 0:
      prompt_tokens_bp, prompt_positions_bp, prompt_mask_bp = (
          jnp.repeat(x, s, axis=0) for x in (prompt_tokens_bp, prompt_positions_bp,
                                             prompt_mask_bp))
      b, m = b * s, m // s
    # A completion's last token is never fed: its hidden state predicts nothing scored here, and
    # under the causal mask no earlier position sees it.
    u = t - 1
    token_major = lambda x_nt: x_nt[:, :u].reshape(b, m, u).transpose(0, 2, 1).reshape(b, u * m)
    tokens = jnp.concatenate([prompt_tokens_bp, token_major(tokens_nt)], axis=1)
    positions = jnp.concatenate([prompt_positions_bp, token_major(positions_nt)], axis=1)
    mask_bmu = mask_nt[:, :u].reshape(b, m, u)
    def body(block, x, carry, _, rotary, spec):
      return block(x, rotary, spec)[0], carry, None

    layout = attention_ops.PromptGroup(prompt_mask_bp, mask_bmu, positions)
    x = self._scan(body, self._embed(tokens, positions), positions, layout,
                   gather=gather)[0][:, p - 1:]
    e = x.shape[-1]
    # Token 0 of every completion is predicted from its prompt's last column (now row 0), token
    # i > 0 from completion position i - 1.
    last_b1e = x[:, :1]
    xc = x[:, 1:].reshape(b, u, m, e).transpose(0, 2, 1, 3)
    h = jnp.concatenate([jnp.broadcast_to(last_b1e[:, None], (b, m, 1, e)), xc], axis=2)
    return h.reshape(n, t, e)

  def grouped(self, *args, gather=None):
    """Logits [N, T, V] (values [N, T] for head='scalar') of `grouped_hidden`."""
    return self._head(self.grouped_hidden(*args, gather=gather))

  def decode(self, tokens_bk, positions_bk, cache: DecodeCache, gather=None, layers=None,
             kv_limit=None, column=None):
    """One token per stream, written at stream slot cache.index (callers keep index <
    max_new_tokens: dynamic_update_slice clamps, so a step past the end would overwrite the
    last slot), or every stream's at `column` of a ring (`SharedPrefixDecode.column`).
    layers: `decode_weights.prepare`'s per-layer weights, run unrolled. kv_limit: attend to
    the first kv_limit stream slots only (a static int above every stream's index or the ring's
    period), so the step's attention cost follows it. Returns (logits [B,K,V], cache)."""
    idx = cache.index.astype(jnp.int32)
    if cache.per_layer and layers is None:  # its buffers are picked by a static layer number
      raise ValueError('a per-layer decode cache is read by unrolled layers only: pass `layers` '
                       '(ModelFns.decode_weights(params, unstacked=True))')
    num_layers = self.config.num_layers
    layer_ids = (np.arange(num_layers) if layers is not None else
                 jnp.arange(num_layers, dtype=jnp.int32))
    layout = attention_ops.SharedPrefixDecode(
        cache.prefix_for_rows(cache.prefix_mask_bp), idx, positions_bk,
        cache.prefix_for_rows(cache.prefix_positions_bp), column)
    xs = (layer_ids, None if cache.per_layer else (cache.prefix_k_lbhdp, cache.prefix_v_lbhpd))

    def body(block, x, kv, xs_l, rotary, spec):
      l, prefix = xs_l
      if cache.per_layer:
        prefix = (cache.prefix_k_lbhdp[l], cache.prefix_v_lbhpd[l])
      if cache.prefix_rows_b is not None:  # the engine's pool rows, gathered in this layer's turn
        prefix, x = jax.lax.optimization_barrier((prefix, x))
        prefix = tuple(cache.prefix_for_rows(p) for p in prefix)

      def store(k, v):  # the stream buffers ride in the carry, written in place
        if cache.pages_bm is None:
          (k_all, v_all), k_l, v_l = write_slot(kv, l, k, v, idx if column is None else column)
          k_l, v_l = k_l[..., :kv_limit], v_l[..., :kv_limit, :]
          return (prefix[0], k_l), (prefix[1], v_l), (k_all, v_all)
        return write_page(prefix, kv, l, k, v, idx, cache.pages_bm, num_layers, kv_limit)

      x, kv = block(x, rotary, spec, store, fused=True)
      return x, kv, None

    x, kv, _ = self._scan(body, self._embed(tokens_bk, positions_bk), positions_bk, layout,
                          carry=cache.streams(), xs=xs, gather=gather, layers=layers)
    return self._head(x), cache.with_streams(kv, idx + 1)


class ModelFns(NamedTuple):
  """Pure functions over (params, arrays); hashable by identity, so usable as a static jit arg.

  `config` rides along so callers (the sampler's context-length check) need no second argument.
  `hidden` / `grouped_hidden` stop before the final norm; `head(head_params(params), h)` turns
  hidden states into logits, which `loss.chunked_logprobs` runs a chunk of positions at a time.
  """

  forward: Callable
  prefill: Callable
  init_cache: Callable
  decode: Callable
  config: TransformerConfig | None = None
  grouped: Callable | None = None
  hidden: Callable | None = None
  grouped_hidden: Callable | None = None
  head: Callable | None = None
  head_params: Callable | None = None
  decode_weights: Callable | None = None


def remat_policy(config: TransformerConfig):
  """The jax.checkpoint policy of `config.remat` for the scanned layer body (None: 'none')."""
  policies = jax.checkpoint_policies
  if config.remat == 'names':
    return policies.save_only_these_names(*config.remat_names)
  return {'none': None, 'full': policies.nothing_saveable,
          'dots': policies.dots_with_no_batch_dims_saveable}[config.remat]


def _config_of(graphdef) -> TransformerConfig | None:
  for _, attr in getattr(graphdef, 'attributes', ()):  # a static attribute: no merge needed
    if isinstance(getattr(attr, 'value', None), TransformerConfig):
      return attr.value
  return None


@functools.lru_cache(maxsize=None)
def model_fns(graphdef, gather=None) -> ModelFns:
  """The model's pure functions. Memoised so one (graphdef, gather) always yields the same
  ModelFns (no jit cache misses).

  gather: None, or a `sharding.ParamGather` (FSDP): the embedding and head are gathered once per
  call and each layer's weights inside the layer scan, so no program holds every layer gathered
  at once, and the gradients are reduce-scattered back layer by layer."""
  config = _config_of(graphdef)

  def model(params):
    return nnx.merge(graphdef, params if gather is None else gather.params(params))

  def forward(params, tokens_bs, positions_bs, mask_bs, head_slice=None):
    return model(params)(tokens_bs, positions_bs, mask_bs, head_slice=head_slice, gather=gather)

  def hidden(params, tokens_bs, positions_bs, mask_bs, head_slice=None, segments=None):
    return model(params).hidden(tokens_bs, positions_bs, mask_bs, head_slice=head_slice,
                                gather=gather, segments=segments)

  def prefill(params, tokens_bp, positions_bp, mask_bp, layers=None):
    if layers is not None:  # decode_weights' per-layer weights: params and layers gathered
      return nnx.merge(graphdef, params).prefill(tokens_bp, positions_bp, mask_bp, layers=layers)
    return model(params).prefill(tokens_bp, positions_bp, mask_bp, gather=gather)

  def decode(params, tokens_bk, positions_bk, cache, layers=None, **kw):  # kv_limit, column
    if layers is not None:
      return nnx.merge(graphdef, params).decode(tokens_bk, positions_bk, cache, layers=layers, **kw)
    return model(params).decode(tokens_bk, positions_bk, cache, gather=gather, **kw)

  decode_weights = functools.partial(decode_weights_lib.prepare, config, gather=gather)

  def grouped(params, *rows):
    return model(params).grouped(*rows, gather=gather)

  def grouped_hidden(params, *rows):
    return model(params).grouped_hidden(*rows, gather=gather)

  def head_params(params) -> dict:
    return {k: params[k] for k in HEAD_KEYS if k in params}

  def head(head_params, h_bse):
    if gather is not None:
      head_params = gather.params(head_params)
    return apply_head(config, head_params, h_bse)

  return ModelFns(forward=forward, prefill=prefill, init_cache=init_cache, decode=decode,
                  config=config, grouped=grouped, hidden=hidden, grouped_hidden=grouped_hidden,
                  head=head, head_params=head_params, decode_weights=decode_weights)


def create(config: TransformerConfig, seed: int = 0):
  """(graphdef, params) of a freshly initialised model; params is an nnx.State of Params."""
  return abstract(config)[0], _init(config, seed)


def init_params(config: TransformerConfig, seed: int = 0):
  """A fresh model's params; jitted with config and seed static, one trace for each (hashable)."""
  return nnx.split(Transformer(config, rngs=nnx.Rngs(seed)))[1]

_init = jax.jit(init_params, static_argnums=(0, 1))  # one program, not one dispatch a tensor


def abstract(config: TransformerConfig):
  """(graphdef, params of ShapeDtypeStructs with logical-axis metadata), nothing materialised."""
  return nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))

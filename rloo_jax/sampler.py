"""Pure, jit-compiled cohort sampler: k completions per prompt with a KV cache shared by the k
streams.

    out = sample(fns, params, prompt_tokens_bp, prompt_lengths_b, rng, k=4, max_new_tokens=64,
                 method=sampling.TopP(0.9), eos_id=eos, pad_id=pad)

`fns` is the model's `ModelFns` (docs/ARCHITECTURE.md): the sampler only calls `fns.prefill`,
`fns.init_cache` and `fns.decode`, so it is tested with a fake deterministic one.

Modes (same tokens for the same rng in both, see `sampling.stream_keys`):
  'shared'    prefill each prompt once; `init_cache(..., num_streams=k)` lets the k streams of a
              prompt attend to that one prefix, kept once per prompt.
  'unshared'  prompts tiled to B*k rows and prefilled k times, one stream per row.

Runs as two jitted programs: `start` (prefill + the first token) and `decode_loop`
(a `lax.while_loop` over `SamplingState`, donated, so the cache is updated in place and never
copied on entry). The loop stops when every stream has emitted EOS or after max_new_tokens.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from rloo_jax import engine, sampler_args, sampling
from rloo_jax.platform import jit_by_platform
from rloo_jax.sharding import leading_ways

MODES = sampler_args.MODES
SampleOutput = sampling.SampleOutput


@struct.dataclass
class SamplingState:
  step: jax.Array                 # int32 []: tokens sampled so far (the next column to write).
  prompt_lengths_bk: jax.Array    # int32 [B, K]: token t of stream (b, j) has position len_b + t.
  last_tokens_bk: jax.Array       # int32 [B, K]: token sampled at step - 1, the next decode input.
  done_bk: jax.Array              # bool [B, K]: EOS emitted.
  tokens_bkt: jax.Array           # int32 [B, K, T]
  logprobs_bkt: jax.Array         # float32 [B, K, T]
  policy_logprobs_bkt: jax.Array  # float32 [B, K, T]
  mask_bkt: jax.Array             # bool [B, K, T]
  lengths_bk: jax.Array           # int32 [B, K]
  cache: Any                      # the model's DecodeCache.
  uniforms_tbk2: jax.Array        # float32 [T, B, K, 2]: every step's uniforms (`sampling.draw`).

  def output(self) -> SampleOutput:
    return SampleOutput(tokens_bkt=self.tokens_bkt, logprobs_bkt=self.logprobs_bkt,
                        policy_logprobs_bkt=self.policy_logprobs_bkt, mask_bkt=self.mask_bkt,
                        lengths_bk=self.lengths_bk)


def _record(state: SamplingState, logits_bkv, *, method, eos_id, pad_id) -> SamplingState:
  """Draws token `state.step` of every stream from logits_bkv and writes it into the state."""
  uniforms_bk2 = jax.lax.dynamic_index_in_dim(state.uniforms_tbk2, state.step, axis=0,
                                              keepdims=False)
  tokens_bk, logprobs_bk, policy_logprobs_bk = sampling.draw(method, uniforms_bk2, logits_bkv)
  tokens_bk, valid_bk, done_bk = sampling.mask_after_eos(tokens_bk, state.done_bk, eos_id=eos_id,
                                                         pad_id=pad_id)
  zero = jnp.float32(0)

  def write(buf_bkt, value_bk):
    return jax.lax.dynamic_update_index_in_dim(buf_bkt, value_bk, state.step, axis=2)

  return state.replace(
      step=state.step + 1,
      last_tokens_bk=tokens_bk,
      done_bk=done_bk,
      tokens_bkt=write(state.tokens_bkt, tokens_bk),
      logprobs_bkt=write(state.logprobs_bkt, jnp.where(valid_bk, logprobs_bk, zero)),
      policy_logprobs_bkt=write(state.policy_logprobs_bkt,
                                jnp.where(valid_bk, policy_logprobs_bk, zero)),
      mask_bkt=write(state.mask_bkt, valid_bk),
      lengths_bk=state.lengths_bk + valid_bk.astype(jnp.int32),
  )


# ----------------------------------------------------------------------------------------------
# Model calls per mode


def left_pad_index(lengths_b, p: int):
  """[B, P] source column of each left-padded column: right-padded rows rolled by P - len."""
  shift_b = p - lengths_b
  return (jnp.arange(p)[None, :] - shift_b[:, None]) % p


def _prefill(fns, params, prompt_tokens_bp, lengths_b, *, k, max_new_tokens, mode,
             per_layer=False):
  """Returns (first-step logits [B, K, V], model state for the decode loop); per_layer: the
  cache as one buffer per layer (`init_cache`), for the unrolled decode."""
  num_prompts = prompt_tokens_bp.shape[0]
  if per_layer:
    fns = fns._replace(init_cache=functools.partial(fns.init_cache, per_layer=True))
  if mode == 'shared':
    positions_bp, mask_bp = sampling.prompt_inputs(prompt_tokens_bp, lengths_b)
    first_bv, prefix = fns.prefill(params, prompt_tokens_bp, positions_bp, mask_bp)
    first_bkv = jnp.broadcast_to(first_bv[:, None], (num_prompts, k, first_bv.shape[-1]))
    return first_bkv, fns.init_cache(prefix, mask_bp, k, max_new_tokens)

  tokens_np = jnp.repeat(prompt_tokens_bp, k, axis=0)  # row n = b * k + j
  lengths_n = jnp.repeat(lengths_b, k, axis=0)
  positions_np, mask_np = sampling.prompt_inputs(tokens_np, lengths_n)
  first_nv, prefix = fns.prefill(params, tokens_np, positions_np, mask_np)
  return (first_nv.reshape(num_prompts, k, -1),
          fns.init_cache(prefix, mask_np, 1, max_new_tokens))


def _decode(fns, params, state: SamplingState, *, mode, layers=None):
  """Feeds each stream's last token; returns (logits [B, K, V], updated model state).
  `params`, `layers`: the weights `ModelFns.decode_weights` prepared once before the loop."""
  num_prompts, k = state.last_tokens_bk.shape
  positions_bk = state.prompt_lengths_bk + state.step - 1
  split = {} if layers is None else {'layers': layers}
  if mode == 'shared':
    return fns.decode(params, state.last_tokens_bk, positions_bk, state.cache, **split)
  logits_n1v, cache = fns.decode(params, state.last_tokens_bk.reshape(-1, 1),
                                 positions_bk.reshape(-1, 1), state.cache, **split)
  return logits_n1v.reshape(num_prompts, k, -1), cache


# ----------------------------------------------------------------------------------------------
# Sharding: with a `batch_sharding` (a NamedSharding splitting dim 0), every per-prompt array is
# pinned to rows split over its mesh axes; other dims are left to the compiler (heads may follow
# a tensor-sharded kernel). None (the default, and the fake-model tests) adds no constraint.

# Cache fields -> the axis of their prompt (or prompt x stream) rows: 1 for the stacked layers.
_CACHE_ROW_AXES = dict(prefix_k_lbhdp=1, prefix_v_lbhpd=1, prefix_mask_bp=0, k_lbkhdt=1,
                       v_lbkhtd=1, prefix_positions_bp=0)


def _shard_rows(x, axis, batch_sharding):
  if batch_sharding is None:
    return x
  spec = [jax.sharding.PartitionSpec.UNCONSTRAINED] * x.ndim
  spec[axis] = batch_sharding.spec[0] if len(batch_sharding.spec) else None
  return jax.lax.with_sharding_constraint(
      x, jax.sharding.NamedSharding(batch_sharding.mesh, jax.sharding.PartitionSpec(*spec)))


def _shard_state(state: SamplingState, batch_sharding) -> SamplingState:
  if batch_sharding is None:
    return state
  cache = state.cache
  rows = lambda x: _shard_rows(x, 0, batch_sharding)

  def field(value, axis):
    # A per-layer cache (a tuple of layers) has lost the leading layer axis.
    axis -= isinstance(value, tuple)
    return jax.tree.map(lambda x: _shard_rows(x, axis, batch_sharding), value)

  fields = {name: field(getattr(cache, name), axis)
            for name, axis in _CACHE_ROW_AXES.items() if hasattr(cache, name)}
  if fields and hasattr(cache, 'replace'):
    cache = cache.replace(**fields)
  return state.replace(
      prompt_lengths_bk=rows(state.prompt_lengths_bk),
      last_tokens_bk=rows(state.last_tokens_bk), done_bk=rows(state.done_bk),
      tokens_bkt=rows(state.tokens_bkt), logprobs_bkt=rows(state.logprobs_bkt),
      policy_logprobs_bkt=rows(state.policy_logprobs_bkt), mask_bkt=rows(state.mask_bkt),
      lengths_bk=rows(state.lengths_bk), cache=cache,
      uniforms_tbk2=_shard_rows(state.uniforms_tbk2, 1, batch_sharding))


# ----------------------------------------------------------------------------------------------
# The two jitted programs


# eos_id (int32 [S] stop ids) and pad_id are traced, not static: new end tokens must not
# recompile the sampler (a different number of them does).
@functools.partial(jit_by_platform, static_argnames=('fns', 'k', 'max_new_tokens', 'method',
                                                     'mode', 'batch_sharding', 'unstack_layers'))
def start(fns, params, prompt_tokens_bp, prompt_lengths_b, rng, eos_id, pad_id, *,
          k, max_new_tokens, method, mode, batch_sharding=None,
          unstack_layers=False) -> SamplingState:
  """Prefill, then draw the first token of every stream from the logits at position len - 1.
  unstack_layers: the KV cache as one buffer per layer, which only `decode_loop`'s unrolled
  layers (its unstack_layers) read."""
  prompt_tokens_bp = _shard_rows(prompt_tokens_bp, 0, batch_sharding)
  prompt_lengths_b = _shard_rows(prompt_lengths_b.astype(jnp.int32), 0, batch_sharding)
  num_prompts = prompt_tokens_bp.shape[0]
  first_bkv, cache = _prefill(
      fns, params, prompt_tokens_bp, prompt_lengths_b, k=k, max_new_tokens=max_new_tokens,
      mode=mode, per_layer=sampler_args.per_layer(fns, unstack_layers))
  shape_bk, shape_bkt = (num_prompts, k), (num_prompts, k, max_new_tokens)
  state = SamplingState(
      step=jnp.zeros((), jnp.int32),
      prompt_lengths_bk=jnp.broadcast_to(prompt_lengths_b[:, None], shape_bk),
      last_tokens_bk=jnp.full(shape_bk, pad_id, jnp.int32),
      done_bk=jnp.zeros(shape_bk, bool),
      tokens_bkt=jnp.full(shape_bkt, pad_id, jnp.int32),
      logprobs_bkt=jnp.zeros(shape_bkt, jnp.float32),
      policy_logprobs_bkt=jnp.zeros(shape_bkt, jnp.float32),
      mask_bkt=jnp.zeros(shape_bkt, bool),
      lengths_bk=jnp.zeros(shape_bk, jnp.int32),
      cache=cache,
      # Stream (b, j)'s keys, one per (prompt, stream), serve only these uniforms.
      uniforms_tbk2=sampling.uniforms_tbk2(sampling.stream_keys(rng, num_prompts, k),
                                           max_new_tokens))
  state = _record(state, first_bkv, method=method, eos_id=eos_id, pad_id=pad_id)
  return _shard_state(state, batch_sharding)


# The state is donated so the while_loop updates the cache in the caller's buffers, not a copy.
@functools.partial(jit_by_platform, static_argnames=('fns', 'method', 'mode', 'batch_sharding',
                                                     'unstack_layers'),
                   donate_argnames=('state',))
def decode_loop(fns, params, state: SamplingState, eos_id, pad_id, *, method,
                mode, batch_sharding=None, unstack_layers=False) -> SamplingState:
  max_new_tokens = state.tokens_bkt.shape[2]
  # What every token would otherwise repeat, done once per rollout: the weights cast to the
  # activation dtype, and with unstack_layers split into per-layer buffers, gathered
  # (`models.decode_weights`).
  layers = None
  if getattr(fns, 'decode_weights', None):
    params, layers = fns.decode_weights(params, sampler_args.per_layer(fns, unstack_layers))

  def cond(state):
    return (state.step < max_new_tokens) & ~jnp.all(state.done_bk)

  def body(state):
    logits_bkv, cache = _decode(fns, params, state, mode=mode, layers=layers)
    return _shard_state(_record(state.replace(cache=cache), logits_bkv, method=method,
                                eos_id=eos_id, pad_id=pad_id), batch_sharding)

  return jax.lax.while_loop(cond, body, state)


# ----------------------------------------------------------------------------------------------
# Public entry point


def sample(fns, params, prompt_tokens_bp, prompt_lengths_b, rng, *, k: int, max_new_tokens: int,
           method: sampling.Method, eos_id: int | Sequence[int], pad_id: int,
           mode: str = 'shared',
           max_seq_len: int | None = None, batch_sharding=None,
           unstack_layers: bool = False, slots: int = 0, prefix_rows: int = 0, pages: int = 0,
           page_size: int = 64) -> SampleOutput:
  """Samples k completions of max_new_tokens tokens for each right-padded prompt.

  Args:
    fns: the model's ModelFns (static: hashable, memoised per graphdef).
    params: the model's parameter pytree.
    prompt_tokens_bp: int [B, P], right-padded prompts.
    prompt_lengths_b: int [B], every length in 1..P (checked here, so it must be concrete unless
      `sample` is itself traced).
    rng: a PRNG key. Stream (b, j) draws step t from fold_in(fold_in(fold_in(rng, b), j), t),
      so equal rng gives equal samples in every mode and the streams are independent.
    k: streams (completions) per prompt.
    max_new_tokens: T, the completion buffer length.
    method: a rloo_jax.sampling method (static).
    eos_id: the end token, or several (a stream stops at the first of any of them).
    pad_id: the token written after the end.
    mode: 'shared' | 'unshared' (see the module docstring).
    max_seq_len: the model context; taken from `fns.max_seq_len` or `fns.config.max_seq_len` when
      not given. The longest prompt plus max_new_tokens must fit in it.
    batch_sharding: optional NamedSharding splitting dim 0 over mesh axes (static): every
      per-prompt array (prompts, KV cache, outputs) is kept split that way. Pass the prompts
      already placed with it; params keep their own (e.g. FSDP/tensor) shardings.
    unstack_layers: the decode loop splits the layer weights into one buffer per layer before
      it starts (gathered from FSDP shards, in the activation dtype: a copy of the model for
      the rollout's duration), keeps one KV buffer per layer, and runs the layers unrolled over
      those, instead of scanning the stacked weights and cache, which copies (under FSDP:
      gathers) every layer's weights and KV at every token. The tokens are the same
      (`sampler_args.decode_unstacked` picks it from config.rloo.decode_layers;
      `models.decode_weights`).
    slots: 0 decodes the B*k streams as one static batch until the last ends; else the
      continuous-batching engine (`rloo_jax.engine`) decodes `slots` streams at once, refilling
      a slot as its stream ends, with `prefix_rows` prompts' KV held (0: its default). Same
      output, token for token; mode must be 'shared'.
    pages, page_size: the engine's stream KV as a pool of `pages` pages of `page_size` slots
      (0: each slot owns max_new_tokens), which a stream takes as its length reaches them.

  Returns:
    SampleOutput with tokens_bkt, logprobs_bkt, policy_logprobs_bkt, mask_bkt, lengths_bk.

  Raises:
    ValueError: bad arguments, an empty prompt, or a prompt that does not fit the context; raised
      before anything is compiled.
  """
  if max_seq_len is None:
    max_seq_len = sampler_args.model_max_seq_len(fns)
  k, max_new_tokens, eos_id, pad_id = sampler_args.validate(
      prompt_tokens_bp, prompt_lengths_b, k=k, max_new_tokens=max_new_tokens, method=method,
      eos_id=eos_id, pad_id=pad_id, mode=mode, max_seq_len=max_seq_len)
  # Host data placed, not staged (jnp.asarray of it compiles a program a shape); a global array
  # (a process's rows of it) stays as it is.
  tokens, lengths, eos_id = (x if isinstance(x, jax.Array) else jax.device_put(x) for x in (
      prompt_tokens_bp, prompt_lengths_b, np.asarray(eos_id, np.int32)))
  pad_id = np.int32(pad_id)
  if slots:
    if mode != 'shared':
      raise ValueError(f"the rollout engine (slots = {slots}) shares each prompt's prefill "
                       f"among its k streams: set mode='shared', not {mode!r}")
    d = leading_ways(batch_sharding)
    slots, prefix_rows = sampler_args.check_slots(slots, k, prefix_rows, ways=d,
                                                  rows=len(prompt_lengths_b))
    sampler_args.check_pages(pages, page_size, max_new_tokens, ways=d)
    return engine.run(fns, params, tokens, lengths, rng, eos_id, pad_id, k=k,
                      max_new_tokens=max_new_tokens, method=method, slots=slots,
                      prefix_rows=prefix_rows, pages=pages, page_size=page_size if pages else 0,
                      batch_sharding=batch_sharding,
                      unstack_layers=bool(unstack_layers)).output()
  state = start(fns, params, tokens, lengths, rng, eos_id, pad_id, k=k,
                max_new_tokens=max_new_tokens, method=method, mode=mode,
                batch_sharding=batch_sharding, unstack_layers=bool(unstack_layers))
  state = decode_loop(fns, params, state, eos_id, pad_id, method=method, mode=mode,
                      batch_sharding=batch_sharding, unstack_layers=bool(unstack_layers))
  return state.output()

"""Continuous-batching rollout engine: a fixed pool of stream slots, refilled as streams end.

    out = engine.generate(fns, params, prompt_tokens_np, prompt_lengths_n, rng, k=4,
                          max_new_tokens=8192, method=sampling.TopP(0.9), eos_id=eos,
                          pad_id=pad, slots=256)

The static sampler (`rloo_jax.sampler`) decodes B*k streams until the last one ends, so a stream
that stopped early keeps its slot, its KV buffer and its share of every step. Here `slots`
streams decode at once; a stream that ends frees its slot, and whenever k slots (and a prefix
row) are free the next group is admitted inside the same jitted loop: its prompt prefilled once
into a pool of prefix rows that its k streams read (`DecodeCache.prefix_rows_b`), its first
tokens drawn, its streams placed in the free slots (with room for every group, unpaged, all in
one prefill at the start, none in the loop, in the static sampler's grouped layout: no pool
rows to look up). A stream's index is its own (`DecodeCache.index` [S, 1]; grouped [Q, k]);
unpaged, its keys and values sit in a ring whose column all slots write at once (`engine_ring`),
so a reused slot reads nothing of its previous stream.

Same `SampleOutput` [N, k, T], token for token, as `sampler.sample(mode='shared')` of the same
prompts and rng: stream (g, j) draws step t from fold_in(stream_keys(rng)[g, j], t) whatever
slot it lands in, so scheduling cannot change what it samples. One policy version a rollout.

On a mesh (`batch_sharding`) each of the D batch shards runs an engine of its own over its own
prompt rows, with slots / D slots and prefix_rows / D prefix rows (every state array carries a
leading [D] axis split over the batch axes, the per-shard work vmapped), so no device holds or
decodes another's slots.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from rloo_jax import engine_paging as paging
from rloo_jax import engine_pool as pool
from rloo_jax import engine_ring as ring
from rloo_jax import sampler_args, sampling
from rloo_jax.models import traced_mesh
from rloo_jax.sharding import leading_ways
from rloo_jax.platform import jit_by_platform


@struct.dataclass
class EngineState:
  """One batch shard's engine; every field has a leading [D] axis over the D shards."""
  cache: Any               # DecodeCache: prefix pool of Q rows, S stream rows of one stream each
  group_s: jax.Array       # int32 [S]: the group (prompt row) a slot decodes; -1: free
  stream_s: jax.Array      # int32 [S]: its stream j in that group
  step_s: jax.Array        # int32 [S]: tokens it has drawn, the next column
  last_s: jax.Array        # int32 [S]: its last token, the next decode input
  refs_q: jax.Array        # int32 [Q]: live streams reading prefix row q (0: free)
  next_group: jax.Array    # int32 []: the first group not yet admitted
  steps: jax.Array         # int32 []: decode steps run
  tokens_nkt: jax.Array    # the SampleOutput fields, [N, k, T] and [N, k]
  logprobs_nkt: jax.Array
  policy_logprobs_nkt: jax.Array
  mask_nkt: jax.Array
  lengths_nk: jax.Array
  # Paged KV (`pages`; None: every slot owns T stream slots): which pages are free [NP], each
  # slot's admission number [S] (older streams get pages first), and preemptions so far [].
  free_p: Any = None
  age_s: Any = None
  preempted: Any = None

  @property
  def grouped(self) -> bool:
    """Every group admitted by `start`, in the static sampler's grouped layout: stream row q
    holds prefix row q's k streams (`engine_pool.empty_cache`), no pool rows to look up."""
    return self.cache.prefix_rows_b is None

  def output(self) -> sampling.SampleOutput:
    """The shards' outputs as one [N, k, T] batch (shard d's rows d*N/D.., as placed)."""
    out = sampling.SampleOutput(self.tokens_nkt, self.logprobs_nkt, self.policy_logprobs_nkt,
                                self.mask_nkt, self.lengths_nk)
    if isinstance(self.tokens_nkt, jax.ShapeDtypeStruct):  # the plan's abstract state
      return jax.tree.map(lambda x: jax.ShapeDtypeStruct(_rows(x), x.dtype,
                                                         sharding=x.sharding), out)
    return _as_rows(out)


_rows = lambda x: (x.shape[0] * x.shape[1],) + tuple(x.shape[2:])


@jax.jit
def _as_rows(out):  # one program: eager, each of the five reshapes would compile on its own
  return jax.tree.map(lambda x: x.reshape(_rows(x)), out)


def _split(x, d: int, batch_sharding):
  """x [N, ...] as [D, N/D, ...], the leading axis over the batch axes."""
  return _on_shards(x.reshape((d, x.shape[0] // d) + x.shape[1:]), batch_sharding)


def _on_shards(tree, batch_sharding):
  if batch_sharding is None:
    return tree
  return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(
      batch_sharding.mesh, jax.sharding.PartitionSpec(batch_sharding.spec[0]))), tree)


# A shard's cache fields -> their kv-heads axis with the layers stacked (a per-layer tuple's
# arrays have no layers axis; the page pools' heads lead either way).
_HEAD_AXES = dict(prefix_k_lbhdp=2, prefix_v_lbhpd=2, k_lbkhdt=3, v_lbkhtd=3, k_pages=0,
                  v_pages=0)


def _state_on_shards(st: EngineState, batch_sharding) -> EngineState:
  """The state over the shards, its KV's heads over 'tensor' where that divides them: `start`'s
  and every phase's alike, so a donated phase updates its input in place (left to the compiler,
  a phase lays its KV out otherwise than `start` did and copies it, then compiles again)."""
  mesh = None if batch_sharding is None else batch_sharding.mesh
  tensor = 1 if mesh is None else dict(mesh.shape).get('tensor', 1)
  if tensor == 1:
    return _on_shards(st, batch_sharding)

  def heads(x, axis):
    # One constraint a leaf: rows and heads at once (not whole heads first, then split).
    if x.shape[axis] % tensor:
      return _on_shards(x, batch_sharding)
    spec = [batch_sharding.spec[0]] + [None] * (x.ndim - 1)
    spec[axis] = 'tensor'
    return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(*spec)))

  fields = {}
  for name, axis in _HEAD_AXES.items():
    value = getattr(st.cache, name)
    if isinstance(value, (tuple, list)):
      fields[name] = tuple(heads(x, axis + (name in ('k_pages', 'v_pages'))) for x in value)
    elif value is not None:
      fields[name] = heads(value, axis + 1)
  rest = _on_shards(st.replace(cache=st.cache.replace(**{n: None for n in fields})),
                    batch_sharding)
  return rest.replace(cache=rest.cache.replace(**fields))


def _uniforms(keys_nk, group_s, stream_s, step_s):
  """[S, 2]: step t of stream (g, j), as the static sampler draws it (`sampling.step_uniforms`)."""
  return jax.vmap(sampling.step_uniforms)(keys_nk[group_s, stream_s], step_s)


def _write(st: EngineState, g_x, j_x, t_x, tokens_x, lp_x, plp_x, valid_x) -> EngineState:
  """Records token t_x of streams (g_x, j_x) where valid_x (others are dropped)."""
  n = st.tokens_nkt.shape[0]
  g = jnp.where(valid_x, g_x, n)  # out of range: dropped
  zero = jnp.float32(0)
  put = lambda buf, v: buf.at[g, j_x, t_x].set(v, mode='drop')  # noqa: E731
  return st.replace(
      tokens_nkt=put(st.tokens_nkt, tokens_x),
      logprobs_nkt=put(st.logprobs_nkt, jnp.where(valid_x, lp_x, zero)),
      policy_logprobs_nkt=put(st.policy_logprobs_nkt, jnp.where(valid_x, plp_x, zero)),
      mask_nkt=put(st.mask_nkt, valid_x),
      lengths_nk=st.lengths_nk.at[g, j_x].add(1, mode='drop'))


# Below this many stream slots a phase of its own saves less than it costs to compile.
SMALLEST_KV_LIMIT = 64


def kv_limits(max_new_tokens: int, buckets: int) -> tuple[int, ...]:
  """The stream-slot counts a phase's decode steps attend to: ..., T/4, T/2, T."""
  return tuple(sorted({max_new_tokens} | {max_new_tokens >> i for i in range(buckets)
                                          if max_new_tokens >> i >= SMALLEST_KV_LIMIT}))


def _progress(st: EngineState):
  """(whether any shard has a group to admit or a live stream, the stream slots the next decode
  step reads: the longest live stream's step, 0 with none live)."""
  left = jnp.any(st.next_group < st.tokens_nkt.shape[-3]) | jnp.any(st.group_s >= 0)
  return left, jnp.max(jnp.where(st.group_s >= 0, st.step_s, 0))


# What `run` reads between phases: one small program (eager, its six ops would each compile).
_progress_jit = jax.jit(_progress)


class _Programs:
  """One shard's two state transitions over its prompt rows: `admit_all` (groups while k slots
  and a prefix row are free) and `decode` (one step of every slot)."""

  def __init__(self, fns, params, prepared, prompt_tokens_np, prompt_lengths_n, keys_nk, eos_id,
               *, k, max_new_tokens, method):
    self.fns, self.params, self.prompts_np, self.k, self.t_cap = (
        fns, params, prompt_tokens_np, k, max_new_tokens)
    self.lengths_n = prompt_lengths_n.astype(jnp.int32)
    self.keys_nk, self.eos_id, self.method = keys_nk, eos_id, method
    self.dparams, layers = prepared
    self.split = {} if layers is None else {'layers': layers}

  def _can_admit(self, st):
    free = jnp.sum(st.group_s < 0)
    pages = True if st.free_p is None else jnp.sum(st.free_p) >= self.k  # a page each to start
    return (st.next_group < self.prompts_np.shape[0]) & (free >= self.k) & jnp.any(
        st.refs_q == 0) & pages

  def _admit(self, st, groups: int = 1):
    """The next `groups` groups (static) admitted: one prefill of their prompts, each in the
    first free prefix row, its k streams in the first free slots (there must be room)."""
    k, g, n = self.k, st.next_group, groups
    tokens_gp = jax.lax.dynamic_slice_in_dim(self.prompts_np, g, n)
    positions_gp, mask_gp = sampling.prompt_inputs(
        tokens_gp, jax.lax.dynamic_slice_in_dim(self.lengths_n, g, n))
    first_gv, prefix = self.fns.prefill(self.dparams, tokens_gp, positions_gp, mask_gp,
                                        **self.split)
    q_g = jnp.nonzero(st.refs_q == 0, size=n, fill_value=0)[0]
    slots_x = jnp.nonzero(st.group_s < 0, size=n * k, fill_value=0)[0]  # x = (group, stream)
    g_x, j_x = jnp.repeat(g + jnp.arange(n), k), jnp.tile(jnp.arange(k), n)
    t_x = jnp.zeros((n * k,), jnp.int32)
    uniforms_gk2 = _uniforms(self.keys_nk, g_x, j_x, t_x).reshape(n, k, 2)
    first_gkv = jnp.broadcast_to(first_gv[:, None], (n, k, first_gv.shape[-1]))
    tokens_gk, lp_gk, plp_gk = sampling.draw(self.method, uniforms_gk2, first_gkv)
    tokens_x = tokens_gk.reshape(-1)
    st = _write(st, g_x, j_x, t_x, tokens_x, lp_gk.reshape(-1), plp_gk.reshape(-1),
                jnp.ones((n * k,), bool))
    live_x = ~sampling.is_stop(tokens_x, self.eos_id) & (self.t_cap > 1)
    cache = pool.write_prefix(st.cache, None if st.grouped else q_g, prefix, mask_gp)
    if not st.grouped:
      cache = cache.replace(prefix_rows_b=cache.prefix_rows_b.at[slots_x].set(jnp.repeat(q_g, k)))
    if st.age_s is not None:
      st = st.replace(age_s=st.age_s.at[slots_x].set(g_x))
    return st.replace(
        cache=cache, group_s=st.group_s.at[slots_x].set(jnp.where(live_x, g_x, -1)),
        stream_s=st.stream_s.at[slots_x].set(j_x), step_s=st.step_s.at[slots_x].set(1),
        last_s=st.last_s.at[slots_x].set(tokens_x),
        refs_q=st.refs_q.at[q_g].set(live_x.reshape(n, k).sum(1)), next_group=g + n)

  def admit_all(self, st, at_once: bool = False):
    """Groups while k slots and a prefix row are free; `at_once`: every group, one prefill (the
    caller knows they all fit)."""
    if at_once:
      return self._admit(st, self.prompts_np.shape[0])
    return jax.lax.while_loop(self._can_admit, self._admit, st)

  def decode(self, st, kv_limit: int, column=None):
    live_s = st.group_s >= 0
    g_s = jnp.maximum(st.group_s, 0)
    # A free slot decodes too (its output is dropped); its index stays inside its buffer.
    index_s = jnp.maximum(st.step_s - 1, 0)
    if st.free_p is not None:  # paged: a page for each stream entering one; stalled if none
      st, live_s = paging.grant(st, live_s, index_s)
    # grouped: slot s reads prefix row s // k, the decode's streams [Q, k]
    rows_s = (jnp.arange(st.group_s.shape[0]) // self.k if st.grouped else
              st.cache.prefix_rows_b)
    shape = st.cache.index.shape
    cache = st.cache.replace(index=index_s.reshape(shape))
    positions_s = self.lengths_n[g_s] + index_s
    logits, cache = self.fns.decode(
        self.dparams, st.last_s.reshape(shape), positions_s.reshape(shape), cache,
        kv_limit=None if kv_limit >= self.t_cap else kv_limit, column=column, **self.split)
    logits_s1v = logits.reshape(-1, 1, logits.shape[-1])
    uniforms_s12 = _uniforms(self.keys_nk, g_s, st.stream_s, st.step_s)[:, None]
    tokens_s1, lp_s1, plp_s1 = sampling.draw(self.method, uniforms_s12, logits_s1v)
    tokens_s = tokens_s1[:, 0]
    st = _write(st, g_s, st.stream_s, st.step_s, tokens_s, lp_s1[:, 0], plp_s1[:, 0], live_s)
    step_s = st.step_s + live_s
    ended_s = live_s & (sampling.is_stop(tokens_s, self.eos_id) | (step_s >= self.t_cap))
    refs_q = st.refs_q.at[rows_s].add(-ended_s.astype(jnp.int32))
    st = st.replace(cache=cache, group_s=jnp.where(ended_s, -1, st.group_s), step_s=step_s,
                    last_s=jnp.where(live_s, tokens_s, st.last_s), refs_q=refs_q,
                    steps=st.steps + 1)
    if st.free_p is None:
      return st
    st = paging.free(st, ended_s)
    # No stream could step (each needs a page, none is free): the youngest holding pages
    # start again from their first token, their pages freed; they draw the same tokens again.
    stuck = jnp.any(st.group_s >= 0) & ~jnp.any(live_s)
    return jax.lax.cond(stuck, paging.preempt, lambda st: st, st)


_STATIC = ('fns', 'k', 'max_new_tokens', 'method', 'unstack_layers', 'batch_sharding')


def _shard_runner(fns, params, prompt_tokens_np, prompt_lengths_n, rng, eos_id, d, *, k,
                  max_new_tokens, method, unstack_layers, batch_sharding):
  """`apply(transition, state)`: `transition(programs, state)` run on every shard's state with
  its own prompt rows. What the shards share (the decode weights, `models.decode_weights`; the
  stream keys; the rows split by shard) is computed here, once, so a caller building it before
  its loop keeps it out of every step."""
  prepared = (params, None)
  if getattr(fns, 'decode_weights', None):
    prepared = fns.decode_weights(params, sampler_args.per_layer(fns, unstack_layers))
  keys = sampling.stream_keys(rng, prompt_tokens_np.shape[0], k)  # the static sampler's streams
  rows = [_split(x, d, batch_sharding) for x in (prompt_tokens_np, prompt_lengths_n, keys)]

  def apply(transition, state):
    def one(st, prompts, lengths, keys_nk):
      return transition(_Programs(fns, params, prepared, prompts, lengths, keys_nk, eos_id, k=k,
                                  max_new_tokens=max_new_tokens, method=method), st)
    # The shard axis over the batch axes: a per-device call inside (a Pallas kernel's
    # `traced_mesh.per_shard`) gets its own shard.
    axes = None if batch_sharding is None else batch_sharding.spec[0]
    with traced_mesh.vmapped_shards(axes):
      return _state_on_shards(jax.vmap(one, spmd_axis_name=axes)(state, *rows), batch_sharding)

  return apply


@functools.partial(jit_by_platform,
                   static_argnames=_STATIC + ('slots', 'prefix_rows', 'pages', 'page_size'))
def start(fns, params, prompt_tokens_np, prompt_lengths_n, rng, eos_id, pad_id, *, k,
          max_new_tokens, method, slots, prefix_rows, pages=0, page_size=0,
          unstack_layers=False, batch_sharding=None) -> EngineState:
  """Every shard's empty slots, prefix rows (and pages), then its first groups admitted."""
  n, p = prompt_tokens_np.shape
  d = leading_ways(batch_sharding)
  slots, prefix_rows = sampler_args.engine_pools(n, slots, prefix_rows, k, d, bool(pages))
  s, q, npages = slots // d, prefix_rows // d, pages // d
  # Every group in one prefill, in the static sampler's grouped layout (`engine_pool.empty_cache`).
  at_once = not pages and (s, q) == ((n // d) * k, n // d)
  zeros_s = jnp.zeros((s,), jnp.int32)
  shape_nkt = (n // d, k, max_new_tokens)
  one = EngineState(
      cache=pool.empty_cache(fns, params, p, q, s, max_new_tokens,
                         sampler_args.per_layer(fns, unstack_layers), npages, page_size,
                         grouped=at_once),
      group_s=jnp.full((s,), -1, jnp.int32), stream_s=zeros_s, step_s=zeros_s,
      last_s=zeros_s + pad_id, refs_q=jnp.zeros((q,), jnp.int32),
      next_group=jnp.zeros((), jnp.int32), steps=jnp.zeros((), jnp.int32),
      tokens_nkt=jnp.full(shape_nkt, pad_id, jnp.int32),
      logprobs_nkt=jnp.zeros(shape_nkt, jnp.float32),
      policy_logprobs_nkt=jnp.zeros(shape_nkt, jnp.float32),
      mask_nkt=jnp.zeros(shape_nkt, bool), lengths_nk=jnp.zeros((n // d, k), jnp.int32),
      free_p=jnp.ones((npages,), bool) if pages else None,
      age_s=zeros_s if pages else None, preempted=jnp.zeros((), jnp.int32) if pages else None)
  state = _state_on_shards(jax.tree.map(lambda x: jnp.broadcast_to(x, (d,) + x.shape), one),
                           batch_sharding)
  run_shards = _shard_runner(fns, params, prompt_tokens_np, prompt_lengths_n, rng, eos_id, d,
                             k=k, max_new_tokens=max_new_tokens, method=method,
                             unstack_layers=unstack_layers, batch_sharding=batch_sharding)
  return run_shards(lambda programs, st: programs.admit_all(st, at_once), state)


# The state is donated: the loop updates the caller's KV buffers in place, never a copy.
@functools.partial(jit_by_platform, static_argnames=_STATIC + ('kv_limit', 'kv_floor'),
                   donate_argnames=('state',))
def phase(fns, params, prompt_tokens_np, prompt_lengths_n, rng, eos_id, state: EngineState, *,
          k, max_new_tokens, method, kv_limit, kv_floor=0, unstack_layers=False,
          batch_sharding=None) -> EngineState:
  """Decode steps reading the first kv_limit stream slots, each followed by admissions, while
  work is left and the longest live stream (over every shard) needs more than kv_floor and at
  most kv_limit. Unpaged, the state's ring must have period kv_limit (`start`'s has none yet;
  `run` re-lays it between phases of two limits, `engine_ring.relayout`)."""
  run_shards = _shard_runner(fns, params, prompt_tokens_np, prompt_lengths_n, rng, eos_id,
                             state.group_s.shape[0], k=k, max_new_tokens=max_new_tokens,
                             method=method, unstack_layers=unstack_layers,
                             batch_sharding=batch_sharding)

  def cond(st):
    left, need = _progress(st)
    return left & (need <= kv_limit) & ((need > kv_floor) | (kv_floor == 0))

  # Unpaged, with every group admitted by `start` (it had slots and prefix rows for all), no
  # step admits: the phase is the decode alone, as the static sampler's loop.
  admits = not state.grouped

  def body(st):
    column = None if state.free_p is not None else ring.column(st, kv_limit)

    def step(programs, st):
      st = programs.decode(st, kv_limit, column)
      return programs.admit_all(st) if admits else st
    return run_shards(step, st)

  return jax.lax.while_loop(cond, body, state)


def run(fns, params, prompt_tokens_np, prompt_lengths_n, rng, eos_id, pad_id, *, k,
        max_new_tokens, method, slots, prefix_rows, pages=0, page_size=0,
        unstack_layers=False, batch_sharding=None, kv_buckets=4) -> EngineState:
  """The rollout: `start`, then `phase`s until every group is admitted and every stream ended.
  A phase's steps attend to the first L stream slots, L the smallest of
  `kv_limits(T, kv_buckets)` holding the longest live stream (one compiled phase per L, kept
  until that stream needs more, or under half the next smaller L), so a step's attention cost
  follows the longest live stream, not the cap. slots, prefix_rows, pages: over all D shards
  (pages: 0, each slot owning T stream slots; else a pool of that many pages of page_size
  slots, which a stream takes as its length reaches them and frees when it ends)."""
  args = (fns, params, prompt_tokens_np, prompt_lengths_n, rng, eos_id)
  static = dict(k=k, max_new_tokens=max_new_tokens, method=method,
                unstack_layers=unstack_layers, batch_sharding=batch_sharding)
  state = start(*args, pad_id, slots=slots, prefix_rows=prefix_rows, pages=pages,
                page_size=page_size, **static)
  limits = kv_limits(max_new_tokens, kv_buckets)
  period = None  # the ring's (`phase`): the last phase's limit
  while True:
    left, need = jax.device_get(_progress_jit(state))
    if not left:
      return state
    i = next(i for i, lim in enumerate(limits) if lim >= need)
    # A phase ends when the longest live stream needs one slot past its limit, or under half the
    # next smaller one: every token a live stream wrote is then under both periods back.
    if not pages and period not in (None, limits[i]):
      state = ring.relayout(state, old=period, new=limits[i])
    period = limits[i]
    state = phase(*args, state, kv_limit=limits[i], kv_floor=limits[i - 1] // 2 if i else 0,
                  **static)

"""The rollout engine's stream KV as a ring (unpaged `engine.run`).

Every slot writes decode step n's keys and values at the same column, n mod L (L: the slots a
phase reads, `engine.kv_limits`), so a step writes all slots with one in-place
`dynamic_update_slice`, as the static sampler does: a per-slot scatter (each stream at its own
length) makes the TPU compiler keep the loop's buffers in another layout than its arguments,
copying the whole KV in and out. A slot reads the columns its stream wrote, those at most its
index steps back (`attention_ops.SharedPrefixDecode.column`); a slot's new stream starts at
index 0, so it reads nothing of the previous one. When a phase of another L follows, the ring
is re-laid to the new period (`relayout`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def column(state, kv_limit: int):
  """This step's column: the same on every shard (unbatched under the shards' vmap, so the
  write stays one slice update)."""
  return state.steps[0] % min(kv_limit, state.tokens_nkt.shape[-1])


def sources(steps, old: int, new: int):
  """[new]: the column of a ring of period `old` that column c of a ring of period `new` takes,
  the last token written at step steps - 1: the token c would hold had the period been `new`
  all along. Where that token is older than `old` steps (overwritten), c gets one a whole
  multiple of `old` steps younger instead, never read: a column is read while it is at most
  the stream's index steps back, and every live index is under `old` and `new` when a phase
  changes (`engine.run`), a gap both then grow alike until the column is written."""
  back = (steps - 1 - jnp.arange(new)) % new
  return (steps - 1 - back) % old


@functools.partial(jax.jit, static_argnames=('old', 'new'), donate_argnames=('state',))
def relayout(state, *, old: int, new: int):
  """`state` (an `engine.EngineState`) with its stream buffers' rings re-laid from period `old`
  to `new`: each buffer's first `new` columns gathered and written back in place (stacked
  layers one at a time; per-layer buffers as the compiler schedules them, on the TPU compiler
  two layers' columns at a time)."""
  src = sources(state.steps[0], old, new)
  cache = state.cache

  def move(buf, axis):
    return jax.lax.dynamic_update_slice_in_dim(buf, jnp.take(buf, src, axis=axis), 0, axis)

  def each(bufs, axis):
    if isinstance(bufs, tuple):  # per-layer buffers [D, S, ...]
      return tuple(move(buf, axis) for buf in bufs)

    def layer(l, b):  # stacked [D, L, S, ...]
      one = jax.lax.dynamic_index_in_dim(b, l, 1)
      return jax.lax.dynamic_update_index_in_dim(b, move(one, axis), l, 1)
    return jax.lax.fori_loop(0, bufs.shape[1], layer, bufs)

  return state.replace(cache=cache.replace(k_lbkhdt=each(cache.k_lbkhdt, -1),
                                           v_lbkhtd=each(cache.v_lbkhtd, -2)))

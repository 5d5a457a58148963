"""The rollout engine's paged stream KV (`engine.run(pages=...)`, config.rloo.rollout_pages).

The streams' KV is a pool of pages of G slots (plus a scratch page nobody owns); a stream's page
table (`DecodeCache.pages_bm`) says which page holds its slots i*G..(i+1)*G-1. Before a decode
step, each live stream whose next slot starts a page it lacks gets a free one, the oldest
streams first; one left without stalls for the step (its write goes to the scratch page, its
output is dropped). A stream that ends gives its pages back. When no stream can step, the
youngest streams holding pages are preempted, as few as let the others step: their pages freed,
they start again after their first token and draw the same tokens again (each stream's draws
depend only on its key and step).
"""

from __future__ import annotations

import jax.numpy as jnp


def grant(st, live_s, index_s):
  """Pages for the live streams whose next slot starts a page they lack, oldest first, while
  free pages last: (state, the streams that step now). A stream left without is stalled this
  step (its write goes to the scratch page, its output is dropped, its step unchanged)."""
  pages_sm = st.cache.pages_bm
  s, scratch, g = pages_sm.shape[0], st.free_p.shape[0], _page_size(st)
  rows = jnp.arange(s)
  held = pages_sm[rows, index_s // g]
  need_s = live_s & (held == scratch)
  order = jnp.argsort(jnp.where(need_s, st.age_s, jnp.iinfo(jnp.int32).max), stable=True)
  rank_s = jnp.zeros((s,), jnp.int32).at[order].set(jnp.arange(s, dtype=jnp.int32))
  free_ids = jnp.nonzero(st.free_p, size=s, fill_value=scratch)[0]
  grant_s = need_s & (rank_s < jnp.sum(st.free_p))
  page_s = jnp.where(grant_s, free_ids[jnp.minimum(rank_s, s - 1)], held)
  pages_sm = pages_sm.at[rows, index_s // g].set(page_s)
  free_p = st.free_p.at[jnp.where(grant_s, page_s, scratch)].set(False, mode='drop')
  return (st.replace(cache=st.cache.replace(pages_bm=pages_sm), free_p=free_p),
          live_s & ~(need_s & ~grant_s))


def _page_size(st) -> int:
  keys = st.cache.k_lbkhdt
  return (keys[0] if isinstance(keys, tuple) else keys).shape[-1]


def free(st, done_s):
  """The pages of streams `done_s` back in the pool, their tables at the scratch page."""
  pages_sm = st.cache.pages_bm
  scratch = st.free_p.shape[0]
  back = jnp.where(done_s[:, None], pages_sm, scratch).reshape(-1)
  return st.replace(free_p=st.free_p.at[back].set(True, mode='drop'),
                    cache=st.cache.replace(pages_bm=jnp.where(done_s[:, None], scratch,
                                                              pages_sm)))


def preempt(st):
  """Stuck (no live stream got the page it needs): the youngest streams holding pages start
  again after their first token, as few as leave a free page for each other holder, so every
  older stream steps on. One victim a time starves a pool of streams in lockstep: its pages
  carry a few streams one page further, and the pool is stuck again. Pages go to the highest
  priority first (`grant`) and the pool holds one whole stream, so the oldest always steps and
  ends: no livelock."""
  scratch, s = st.free_p.shape[0], st.group_s.shape[0]
  held_s = jnp.sum(st.cache.pages_bm != scratch, axis=1)
  holds_s = (st.group_s >= 0) & (held_s > 0)
  order = jnp.argsort(-jnp.where(holds_s, st.age_s * s + jnp.arange(s), -1))  # youngest first
  count = jnp.arange(1, s + 1)
  freed = jnp.cumsum(jnp.where(holds_s, held_s, 0)[order])  # by the first `count` victims
  enough = jnp.sum(st.free_p) + freed >= jnp.sum(holds_s) - count
  victim_s = jnp.zeros((s,), bool).at[order].set(count <= jnp.argmax(enough) + 1) & holds_s
  st = free(st, victim_s)
  g_s, j_s = jnp.maximum(st.group_s, 0), st.stream_s
  restart_g = jnp.where(victim_s, g_s, st.lengths_nk.shape[0])  # out of range: dropped
  return st.replace(step_s=jnp.where(victim_s, 1, st.step_s),
                    last_s=jnp.where(victim_s, st.tokens_nkt[g_s, j_s, 0], st.last_s),
                    lengths_nk=st.lengths_nk.at[restart_g, j_s].set(1, mode='drop'),
                    preempted=st.preempted + jnp.sum(victim_s, dtype=jnp.int32))

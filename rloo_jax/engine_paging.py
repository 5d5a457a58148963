"""The rollout engine's paged stream KV (`engine.run(pages=...)`, config.rloo.rollout_pages).

The streams' KV is a pool of pages of G slots (plus a scratch page nobody owns); a stream's page
table (`DecodeCache.pages_bm`) says which page holds its slots i*G..(i+1)*G-1. Before a decode
step, each live stream whose next slot starts a page it lacks gets a free one, the oldest
streams first; one left without stalls for the step (its write goes to the scratch page, its
output is dropped). A stream that ends gives its pages back. When no stream can step, the
youngest holding pages is preempted: its pages freed, it starts again after its first token,
and draws the same tokens again (each stream's draws depend only on its key and step).
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


def preempt_youngest(st):
  """The live stream of lowest priority (admitted last; last slot among its group) holding a
  page starts again after its first token. Pages go to the highest priority first
  (`grant`), so the oldest stream always steps and ends (the pool holds one whole
  stream): no livelock."""
  scratch, s = st.free_p.shape[0], st.group_s.shape[0]
  holds_s = (st.group_s >= 0) & jnp.any(st.cache.pages_bm != scratch, axis=1)
  victim = jnp.argmax(jnp.where(holds_s, st.age_s * s + jnp.arange(s), -1))
  done_s = jnp.arange(holds_s.shape[0]) == victim
  st = free(st, done_s)
  g, j = st.group_s[victim], st.stream_s[victim]
  return st.replace(step_s=st.step_s.at[victim].set(1),
                    last_s=st.last_s.at[victim].set(st.tokens_nkt[g, j, 0]),
                    lengths_nk=st.lengths_nk.at[g, j].set(1), preempted=st.preempted + 1)

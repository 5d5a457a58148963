"""Blockwise (flash) attention in pure JAX: O(S * block) memory in S, forward and backward.

`attend` runs the online softmax of flash attention over query blocks and, inside each, only the
key blocks it can see: none after it (causal), and of the blocks before it those holding the
query block's shared segments or its own ones. Its own `jax.custom_vjp` saves only the output and
each query's log-sum-exp; the backward recomputes the scores block by block, visiting the same
(query block, key block) pairs, so no [S, S] array exists in either direction.

The layout is described per row token, never per (query, key) pair: query i may read key j when
j <= i, key j is valid, j's segment is i's own segment or i's shared one, and (with a window)
their positions are less than `window` apart. Segment ids must not decrease along a row (each
segment one contiguous run). `attention_ops` maps its layouts onto that (`Causal`: one segment,
or packed groups, each [prompt | completions] with the prompt the completions' shared segment;
`PromptGroup`, reordered completion-major: the prompt segment 0, completion j segment j + 1,
every token sharing segment 0).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# As attention_ops: finite, so a query with no visible key (a pad row) gets a finite average
# (over the keys of the blocks it visited, unlike 'xla'), never NaN.
_MASKED = -1e30
_F32 = jnp.float32
# The default block (queries and keys alike): [B, Hkv, G, 512, 512] float32 scores per step.
BLOCK = 512
# The segment of the rows padding S to a multiple of the block: above any real one, so the ids
# still never decrease along a row, and no query's own or shared segment.
_PAD_SEGMENT = 2**30


def attend(q_bshgd, k_bshd, v_bshd, key_ok_bs, segment_bs=None, positions_bs=None, window=None,
           shared_bs=None, *, scale: float, softcap: float = 0.0, block: int | None = None):
  """Attention output [B, S, Hkv, G, D] in v's dtype, scores and softmax in float32.

  key_ok_bs [B, S] marks valid keys; segment_bs and shared_bs [B, S] int (None: all 0) as the
  module docstring says; positions_bs [B, S] is read only with a `window` (a traced int or None).
  S need not be a multiple of `block` (default BLOCK): the rows are padded with invalid keys."""
  b, s = key_ok_bs.shape
  blk = min(block or BLOCK, s)
  nb = -(-s // blk)

  def blocks(x, fill=0):  # [B, S, ...] -> [nb, B, blk, ...]
    x = jnp.pad(x, [(0, 0), (0, nb * blk - s)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
    return jnp.moveaxis(x.reshape(b, nb, blk, *x.shape[2:]), 1, 0)

  zeros = jnp.zeros((b, s), jnp.int32)
  segment_bs = zeros if segment_bs is None else segment_bs.astype(jnp.int32)
  shared_bs = zeros if shared_bs is None else shared_bs.astype(jnp.int32)
  meta = (blocks(key_ok_bs.astype(bool), False), blocks(segment_bs, _PAD_SEGMENT),
          blocks(shared_bs, _PAD_SEGMENT),
          None if window is None else (blocks(positions_bs.astype(jnp.int32)), window),
          _block_ranges(segment_bs, shared_bs, blk, nb))
  o_n = _flash(scale, softcap, blocks(q_bshgd), blocks(k_bshd), blocks(v_bshd), meta)
  return jnp.moveaxis(o_n, 0, 1).reshape(b, nb * blk, *q_bshgd.shape[2:])[:, :s]


def _block_ranges(segment_bs, shared_bs, blk: int, nb: int):
  """The key blocks each query block reads, as two runs: [s0, s1), the blocks of its first row's
  shared segment, and [max(lo, s1), i], from its first row's own segment's first block up to
  itself; each [nb] int32 (over the batch: the union). A cover: every other row of the block has
  the first row's shared segment, or its own and shared segments start inside the block (ids
  never decrease, and a shared segment precedes the segments sharing it)."""
  b, s = segment_bs.shape
  rows = jnp.arange(s)
  own_start = jax.lax.cummax(
      jnp.where(jnp.concatenate([jnp.ones((b, 1), bool),
                                 segment_bs[:, 1:] != segment_bs[:, :-1]], 1), rows, 0), axis=1)
  first_rows = shared_bs[:, ::blk]  # [B, nb]
  find = lambda side: jax.vmap(functools.partial(jnp.searchsorted, side=side))(segment_bs,
                                                                              first_rows)
  first, past = find('left'), find('right')
  present = past > first
  s0_n = jnp.min(jnp.where(present, first, nb * blk), axis=0) // blk
  s1_n = jnp.max(jnp.where(present, past - 1, -blk), axis=0) // blk + 1
  lo_n = jnp.min(own_start[:, ::blk], axis=0) // blk
  idx = jnp.arange(nb)
  # A block whose first rows share no segment reads only from its own segments.
  s1_n = jnp.where(s0_n < nb, jnp.minimum(s1_n, idx + 1), 0)
  s0_n = jnp.minimum(s0_n, s1_n)
  return s0_n, s1_n, jnp.minimum(jnp.maximum(lo_n, s1_n), idx + 1)


def _visits(ranges):
  """[nb query blocks, nb key blocks] bool: the pairs the forward visits (`_block_ranges`)."""
  s0_n, s1_n, own_n = ranges
  i, j = jnp.arange(s0_n.shape[0])[:, None], jnp.arange(s0_n.shape[0])[None, :]
  return ((s0_n[:, None] <= j) & (j < s1_n[:, None])) | ((own_n[:, None] <= j) & (j <= i))


def _mask(meta, i, j):
  """[B, 1, 1, blk, blk]: which keys of key block j the queries of query block i may read."""
  key_ok_nbt, segment_nbt, shared_nbt, window_meta, _ = meta
  blk = key_ok_nbt.shape[-1]
  causal_qk = (i * blk + jnp.arange(blk))[:, None] >= (j * blk + jnp.arange(blk))[None, :]
  seg_k = segment_nbt[j][:, None, :]
  ok_bqk = causal_qk[None] & key_ok_nbt[j][:, None, :] & (
      (seg_k == segment_nbt[i][:, :, None]) | (seg_k == shared_nbt[i][:, :, None]))
  if window_meta is not None:
    positions_nbt, window = window_meta
    ok_bqk &= (positions_nbt[i][:, :, None] - positions_nbt[j][:, None, :]) < window
  return ok_bqk[:, None, None]


def _logits(q_bqhgd, k_bkhd, scale, softcap):
  """Scores [B, Hkv, G, blk, blk] as attention_ops' AttentionSpec.logits gives them, and their
  derivative with respect to the raw q.k products."""
  s = jnp.einsum('bqhgd,bkhd->bhgqk', q_bqhgd, k_bkhd, preferred_element_type=_F32) * scale
  if not softcap:
    return s, scale
  capped = jnp.tanh(s / softcap)
  return softcap * capped, scale * (1.0 - capped * capped)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _flash(scale, softcap, q_n, k_n, v_n, meta):
  return _forward(scale, softcap, q_n, k_n, v_n, meta)[0]


def _forward(scale, softcap, q_n, k_n, v_n, meta):
  """(o [nb, B, blk, Hkv, G, D], log-sum-exp [nb, B, Hkv, G, blk]) from block-major q, k, v."""
  _, b, blk, h, g, d = q_n.shape

  def query_block(args):
    i, q_bqhgd = args

    s0_n, s1_n, own_n = meta[4]
    shared = s1_n[i] - s0_n[i]
    own = own_n[i]

    def key_block(step, carry):
      j = jnp.where(step < shared, s0_n[i] + step, own + step - shared)
      m_bhgq, l_bhgq, acc_bhgqd = carry
      s = jnp.where(_mask(meta, i, j), _logits(q_bqhgd, k_n[j], scale, softcap)[0], _MASKED)
      m_new = jnp.maximum(m_bhgq, s.max(-1))
      p = jnp.exp(s - m_new[..., None])
      alpha = jnp.exp(m_bhgq - m_new)
      pv = jnp.einsum('bhgqk,bkhd->bhgqd', p.astype(v_n.dtype), v_n[j],
                      preferred_element_type=_F32)
      return m_new, alpha * l_bhgq + p.sum(-1), alpha[..., None] * acc_bhgqd + pv

    init = (jnp.full((b, h, g, blk), _MASKED, _F32), jnp.zeros((b, h, g, blk), _F32),
            jnp.zeros((b, h, g, blk, d), _F32))
    steps = shared + (i + 1 - own)
    m_bhgq, l_bhgq, acc_bhgqd = jax.lax.fori_loop(0, steps, key_block, init)
    o_bqhgd = jnp.einsum('bhgqd->bqhgd', acc_bhgqd / l_bhgq[..., None]).astype(v_n.dtype)
    return o_bqhgd, m_bhgq + jnp.log(l_bhgq)

  o_n, lse_n = jax.lax.map(query_block, (jnp.arange(q_n.shape[0]), q_n))
  return o_n, (q_n, k_n, v_n, meta, o_n, lse_n)


def _backward(scale, softcap, residuals, do_n):
  """Per key block j, the query blocks j..hi_j, of which those whose forward visited it (the same
  pairs; the others are masked): dK_j and dV_j accumulate in the loop, dQ in one float32
  [S]-sized carry."""
  q_n, k_n, v_n, meta, o_n, lse_n = residuals
  nb = q_n.shape[0]
  visits = _visits(meta[4])
  hi_n = jnp.max(jnp.where(visits, jnp.arange(nb)[:, None], -1), axis=0)
  # rowsum(dO * O): the softmax's backward term, one float32 per query.
  delta_n = jnp.einsum('nbqhgd,nbqhgd->nbhgq', do_n.astype(_F32), o_n.astype(_F32))

  def key_block(dq_n, args):
    j, k_bkhd, v_bkhd = args

    def query_block(i, carry):
      dq_n, dk_bkhd, dv_bkhd = carry
      q_bqhgd, do_bqhgd = q_n[i], do_n[i]
      s, ds_draw = _logits(q_bqhgd, k_bkhd, scale, softcap)
      mask = _mask(meta, i, j) & visits[i, j]
      p = jnp.exp(jnp.where(mask, s, _MASKED) - lse_n[i][..., None])
      dv_bkhd += jnp.einsum('bhgqk,bqhgd->bkhd', p.astype(do_n.dtype), do_bqhgd,
                            preferred_element_type=_F32)
      dp = jnp.einsum('bqhgd,bkhd->bhgqk', do_bqhgd, v_bkhd, preferred_element_type=_F32)
      # Masked scores get no gradient, as through attention_ops' jnp.where.
      ds = (jnp.where(mask, p * (dp - delta_n[i][..., None]), 0.0) * ds_draw).astype(q_n.dtype)
      dk_bkhd += jnp.einsum('bhgqk,bqhgd->bkhd', ds, q_bqhgd, preferred_element_type=_F32)
      dq = jnp.einsum('bhgqk,bkhd->bqhgd', ds, k_bkhd, preferred_element_type=_F32)
      return dq_n.at[i].add(dq), dk_bkhd, dv_bkhd

    zeros_kv = jnp.zeros(k_bkhd.shape, _F32)
    dq_n, dk_bkhd, dv_bkhd = jax.lax.fori_loop(j, jnp.maximum(hi_n[j] + 1, j), query_block,
                                               (dq_n, zeros_kv, zeros_kv))
    return dq_n, (dk_bkhd.astype(k_n.dtype), dv_bkhd.astype(v_n.dtype))

  dq_n, (dk_n, dv_n) = jax.lax.scan(key_block, jnp.zeros(q_n.shape, _F32),
                                    (jnp.arange(nb), k_n, v_n))
  return dq_n.astype(q_n.dtype), dk_n, dv_n, None


_flash.defvjp(_forward, _backward)

"""The KV cache of cohort decoding: a prompt's prefilled keys/values (`PrefixKV`) and the decode
cache built from them (`DecodeCache`, by `init_cache`), where the k streams of a prompt read that
prompt's keys/values computed once."""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class PrefixKV:
  """Every layer's post-RoPE keys/values of a prefilled prompt batch, and the prompt's
  positions (what a sliding window measures decode distances from; None: not recorded)."""

  k_lbphd: jax.Array
  v_lbphd: jax.Array
  positions_bp: jax.Array | None = None


@flax.struct.dataclass
class DecodeCache:
  """The prompt's keys/values, computed once per prompt row and read by all its K streams (never
  tiled), next to each stream's own buffer of T slots.

  Every layer's cache is one stacked array (leading axis L), read and written by the scanned layer
  body (`Transformer.decode`): the stream buffers ride in the scan's carry, so each step writes
  one slot per layer in place. Or, for the decode unrolled over per-layer weights
  (`init_cache(per_layer=True)`), each of the four arrays is a tuple of L buffers without that
  axis, which a layer reads without copying it out of a stack. Keys keep head_dim before the
  sequence axis (`_hdp` / `_hdt`: the score product q.k contracts D against a row-major [D, T]
  matrix), values the sequence axis before head_dim (probs.v contracts T against [T, D]), so no
  step transposes a cache. `index` counts generated tokens: stream slot `index` is next; one
  int for every stream (the static sampler), or [B, K], each stream its own (`rloo_jax.engine`).
  `prefix_rows_b` [B] (the engine's): the prefix rows are a pool and stream row b reads pool row
  prefix_rows_b[b], so a group's k streams share one prefill wherever their slots are.
  `pages_bm` [B, M] (the engine's paged KV, `rollout_pages`): stream row b's slots i*G..i*G+G-1
  belong to page pages_bm[b, i], so a stream holds only the pages its length has reached. The
  stream buffers are then each row's tail, its current page (T = G), and the pages live in
  `k_pages` / `v_pages`, [Hkv, L * (N + 1), G, D] (layer l's page p at l * (N + 1) + p; page N a
  scratch page that nothing owns), or L x [Hkv, N + 1, G, D]: the layout the Pallas paged kernel
  reads in place, written only a whole page at a time (a token into a tiled page makes the TPU
  compiler copy the pool at every step). `write_page` puts a token in the tail and the tail
  into its page; `read_pages` gathers the pages.
  """

  prefix_k_lbhdp: Any  # [L, B, Hkv, D, P] (or L x [B, Hkv, D, P])
  prefix_v_lbhpd: Any  # [L, B, Hkv, P, D] (or L x [B, Hkv, P, D])
  prefix_mask_bp: jax.Array  # [B, P] bool
  k_lbkhdt: Any  # [L, B, K, Hkv, D, T] (or L x [B, K, Hkv, D, T])
  v_lbkhtd: Any  # [L, B, K, Hkv, T, D] (or L x [B, K, Hkv, T, D])
  index: jax.Array
  # The prompt's positions, which a sliding window reads (None: the prefill recorded none).
  prefix_positions_bp: jax.Array | None = None
  prefix_rows_b: jax.Array | None = None
  pages_bm: jax.Array | None = None
  k_pages: Any = None
  v_pages: Any = None

  def prefix_for_rows(self, x):
    """Pool rows `x` [Npool, ...] as the stream rows read them (x itself without a pool)."""
    return x if x is None or self.prefix_rows_b is None else jnp.take(x, self.prefix_rows_b, 0)

  @property
  def per_layer(self) -> bool:
    return isinstance(self.k_lbkhdt, tuple)

  def streams(self):
    """What a decode step writes, (keys, values): the stream buffers, or paged ((tail keys, key
    pages), (tail values, value pages))."""
    if self.pages_bm is None:
      return self.k_lbkhdt, self.v_lbkhtd
    return (self.k_lbkhdt, self.k_pages), (self.v_lbkhtd, self.v_pages)

  def with_streams(self, kv, index):
    """The cache with a step's `streams()` written and its new index."""
    if self.pages_bm is None:
      return self.replace(k_lbkhdt=kv[0], v_lbkhtd=kv[1], index=index)
    (k, k_pages), (v, v_pages) = kv
    return self.replace(k_lbkhdt=k, k_pages=k_pages, v_lbkhtd=v, v_pages=v_pages, index=index)


@dataclasses.dataclass(frozen=True)
class PagedStreams:
  """The rollout engine's paged stream KV as the decode's attention reads it
  (`attention_ops.SharedPrefixDecode`, one stream a row): k = (prefix keys, key pages
  [Hkv, pages, G, D], this), v alike. `pages_bm` [B, M]: each row's pages in that pool (its
  layer's offset added); `slots`: the stream slots a step reads."""

  pages_bm: jax.Array
  slots: int


def write_slot(kv, l, k_bkhd, v_bkhd, slot):
  """Writes layer l's keys and values of one token (k, v: [B, K, Hkv, D]) into stream slot
  `slot` (an int, or [B, K]: each stream's own) of the stream buffers `kv` = (keys, values),
  stacked (l traced) or per layer (l a static int); returns (kv, layer l's keys, its values)."""
  keys, values = kv
  if jnp.ndim(slot):
    return _scatter_slots(keys, values, l, k_bkhd, v_bkhd, slot)
  if isinstance(keys, tuple):
    k_l = _update(keys[l], k_bkhd[..., None].astype(keys[l].dtype), slot, 1)
    v_l = _update(values[l], v_bkhd[:, :, :, None].astype(values[l].dtype), slot, 2)
    return (keys[:l] + (k_l,) + keys[l + 1:], values[:l] + (v_l,) + values[l + 1:]), k_l, v_l
  keys = _update(keys, k_bkhd[None, ..., None].astype(keys.dtype), slot, 1, l)
  values = _update(values, v_bkhd[None, :, :, :, None].astype(values.dtype), slot, 2, l)
  return ((keys, values), jax.lax.dynamic_index_in_dim(keys, l, keepdims=False),
          jax.lax.dynamic_index_in_dim(values, l, keepdims=False))


@jax.custom_batching.custom_vmap
def _dus(buf, update, starts):
  return jax.lax.dynamic_update_slice(buf, update, tuple(starts))


@_dus.def_vmap
def _dus_vmap(axis_size, in_batched, buf, update, starts):
  # Batched buffers at unbatched offsets (the engine's shards, one ring column): one slice
  # update over the batch too, where vmap's own rule scatters (which the TPU compiler answers
  # by keeping the loop's buffers in another layout, copying the whole cache in and out).
  buf_b, update_b, starts_b = in_batched
  if starts_b:
    return jax.vmap(lambda b, u, s: jax.lax.dynamic_update_slice(b, u, tuple(s)), in_axes=(
        0 if buf_b else None, 0 if update_b else None, 0))(buf, update, starts), True
  buf = buf if buf_b else jnp.broadcast_to(buf, (axis_size,) + buf.shape)
  update = update if update_b else jnp.broadcast_to(update, (axis_size,) + update.shape)
  return _dus(buf, update, jnp.concatenate([jnp.zeros((1,), starts.dtype), starts])), True


def _update(buf, update, slot, from_end: int, layer=None):
  """buf with `update` written at `slot` on axis -from_end (and at `layer` on axis 0)."""
  starts = [jnp.zeros((), jnp.int32)] * buf.ndim
  starts[-from_end] = jnp.asarray(slot, jnp.int32)
  if layer is not None:
    starts[0] = jnp.asarray(layer, jnp.int32)
  return _dus(buf, update, jnp.stack(starts))


def layer_pages(pool, l, num_layers: int):
  """(the page pool that holds layer l's pages, their offset in it): the stacked pool whole (its
  page axis spans the layers: a layer's slice handed to a Pallas call would be copied) or the
  layer's own."""
  if isinstance(pool, tuple):
    return pool[l], 0
  return pool, l * (pool.shape[1] // num_layers)


def write_page(prefix, kv, l, k_bkhd, v_bkhd, slot_bk, pages_bm, num_layers: int,
               kv_limit=None):
  """Writes layer l's token (k, v: [B, 1, Hkv, D]) of each stream row at its slot (`slot_bk`
  [B, 1]) of the paged stream KV, kv = ((tail keys, key pages), (tail values, value pages)):
  into the row's tail at slot % G, and the tail whole into its page pages_bm[b, slot // G] (a
  page written whole: one token into a tiled page makes the TPU compiler copy the pool at
  every step). Returns (keys, values, kv): what the layer's attention reads, the `prefix`
  (keys, values) and the streams' pages (`PagedStreams`: read in place or gathered), and the
  written kv."""
  (tails_k, pool_k), (tails_v, pool_v) = kv
  g = (tails_k[0] if isinstance(tails_k, tuple) else tails_k).shape[-1]
  (tails_k, tails_v), tk, tv = write_slot((tails_k, tails_v), l, k_bkhd, v_bkhd, slot_bk % g)
  slot_b = slot_bk[:, 0]
  page_b = jnp.take_along_axis(pages_bm, (slot_b // g)[:, None], axis=1)[:, 0]

  def flush(pool, tail_bhgd):  # (the pools, layer l's, its pages' offset there)
    one, offset = layer_pages(pool, l, num_layers)
    one = one.at[:, offset + page_b].set(jnp.swapaxes(tail_bhgd, 0, 1).astype(one.dtype))
    return (pool[:l] + (one,) + pool[l + 1:] if isinstance(pool, tuple) else one), one, offset

  # Keys [B, Hkv, D, G] -> [B, Hkv, G, D], the pages' layout.
  pool_k, one_k, offset = flush(pool_k, jnp.swapaxes(tk[:, 0], -1, -2))
  pool_v, one_v, _ = flush(pool_v, tv[:, 0])
  paged = PagedStreams(pages_bm + offset, kv_limit or pages_bm.shape[1] * g)
  return ((prefix[0], one_k, paged), (prefix[1], one_v, paged),
          ((tails_k, pool_k), (tails_v, pool_v)))


def read_pages(pool_k, pool_v, pages_bm, slots: int):
  """Each stream row's first `slots` slots gathered from its pages, in the unpaged layouts:
  keys [B, 1, Hkv, D, slots], values [B, 1, Hkv, slots, D]. Slots past a stream's index read
  what its pages held before (or the scratch page, or a page another stream now holds): the
  decode mask hides them."""
  g = pool_k.shape[2]
  m = -(-slots // g)
  k = pool_k[:, pages_bm[:, :m]]  # [Hkv, B, m, G, D]
  v = pool_v[:, pages_bm[:, :m]]
  hkv, b, _, _, d = k.shape
  k = jnp.transpose(k, (1, 0, 4, 2, 3)).reshape(b, 1, hkv, d, m * g)[..., :slots]
  v = jnp.transpose(v, (1, 0, 2, 3, 4)).reshape(b, 1, hkv, m * g, d)[..., :slots, :]
  return k, v


def _scatter_slots(keys, values, l, k_bkhd, v_bkhd, slot_bk):
  # One scatter per buffer writing each stream's [Hkv, D] at its own slot, in place in the loop.
  b, k = slot_bk.shape
  rows = jnp.arange(b)[:, None]
  cols = jnp.arange(k)[None, :]
  if isinstance(keys, tuple):
    k_l = keys[l].at[rows, cols, :, :, slot_bk].set(k_bkhd.astype(keys[l].dtype))
    v_l = values[l].at[rows, cols, :, slot_bk, :].set(v_bkhd.astype(values[l].dtype))
    return (keys[:l] + (k_l,) + keys[l + 1:], values[:l] + (v_l,) + values[l + 1:]), k_l, v_l
  keys = keys.at[l, rows, cols, :, :, slot_bk].set(k_bkhd.astype(keys.dtype))
  values = values.at[l, rows, cols, :, slot_bk, :].set(v_bkhd.astype(values.dtype))
  return ((keys, values), jax.lax.dynamic_index_in_dim(keys, l, keepdims=False),
          jax.lax.dynamic_index_in_dim(values, l, keepdims=False))


def init_cache(prefix: PrefixKV, mask_bp: jax.Array, num_streams: int,
               max_new_tokens: int, per_layer: bool = False) -> DecodeCache:
  """The decode cache of `prefix` (transposed once here into the decode layouts), one prefix
  per prompt row, with `num_streams` empty stream buffers; stream slots are valid up to index.
  per_layer: every array split into a tuple of per-layer buffers (see `DecodeCache`)."""
  l, b, _, h, d = prefix.k_lbphd.shape
  dt, k = prefix.k_lbphd.dtype, num_streams
  cache = DecodeCache(
      prefix_k_lbhdp=jnp.transpose(prefix.k_lbphd, (0, 1, 3, 4, 2)),
      prefix_v_lbhpd=jnp.transpose(prefix.v_lbphd, (0, 1, 3, 2, 4)),
      prefix_mask_bp=jnp.asarray(mask_bp, bool),
      k_lbkhdt=jnp.zeros((l, b, k, h, d, max_new_tokens), dt),
      v_lbkhtd=jnp.zeros((l, b, k, h, max_new_tokens, d), dt),
      index=jnp.zeros((), jnp.int32), prefix_positions_bp=prefix.positions_bp)
  if not per_layer:
    return cache
  split = lambda x: tuple(x[l] for l in range(x.shape[0]))  # noqa: E731
  return cache.replace(prefix_k_lbhdp=split(cache.prefix_k_lbhdp),
                       prefix_v_lbhpd=split(cache.prefix_v_lbhpd),
                       k_lbkhdt=split(cache.k_lbkhdt), v_lbkhtd=split(cache.v_lbkhtd))

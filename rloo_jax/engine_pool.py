"""The rollout engine's KV pools (`rloo_jax.engine`): the prefix pool of prompt rows and the
stream rows, built empty, and prompts' prefilled keys and values written into prefix rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from rloo_jax.models import traced_mesh
from rloo_jax.models.cache import PrefixKV


def empty_cache(fns, params, p: int, q: int, s: int, t: int, per_layer: bool, pages: int = 0,
                 page_size: int = 0, grouped: bool = False):
  """The engine's DecodeCache: Q prefix rows of P columns and S one-stream rows of T slots; or,
  paged, S rows of `page_size` slots (each stream's tail, its current page) and a pool of
  `pages` pages (and the scratch page) that the S rows' page tables, all pointing at the scratch
  page, index (`DecodeCache.pages_bm`). grouped (S = Q*k, every group
  admitted at once): the static sampler's layout, prefix row q's k streams in stream row q,
  so a decode reads each prefix row in place, never gathering a copy for each of its streams."""
  tokens = jnp.zeros((1, p), jnp.int32)
  _, prefix = jax.eval_shape(fns.prefill, params, tokens, tokens, tokens > 0)

  def rows(x, n, cols):  # [L, 1, P, H, D] -> zeros [L, n, cols, H, D]
    return jnp.zeros(x.shape[:1] + (n, cols) + x.shape[3:], x.dtype)

  init = functools.partial(fns.init_cache, per_layer=per_layer) if per_layer else fns.init_cache
  pool = init(PrefixKV(rows(prefix.k_lbphd, q, p), rows(prefix.v_lbphd, q, p),
                       None if prefix.positions_bp is None else jnp.zeros((q, p), jnp.int32)),
              jnp.zeros((q, p), bool), 1, 1)
  n, k = (q, s // q) if grouped else (s, 1)
  one = PrefixKV(rows(prefix.k_lbphd, n, 1), rows(prefix.v_lbphd, n, 1))
  # Paged, a stream row's buffer is its tail, the page it is writing (`DecodeCache.pages_bm`).
  streams = init(one, jnp.zeros((n, 1), bool), k, page_size if pages else t)
  pool = pool.replace(k_lbkhdt=streams.k_lbkhdt, v_lbkhtd=streams.v_lbkhtd,
                      index=jnp.zeros((n, k) if grouped else (s, 1), jnp.int32),
                      prefix_rows_b=None if grouped else jnp.zeros((s,), jnp.int32))
  if not pages:
    return pool
  layers, _, _, h, d = prefix.k_lbphd.shape
  per = (h, pages + 1, page_size, d)  # + the scratch page
  zeros = (tuple(jnp.zeros(per, prefix.k_lbphd.dtype) for _ in range(layers)) if per_layer else
           jnp.zeros((h, layers * (pages + 1), page_size, d), prefix.k_lbphd.dtype))
  return pool.replace(k_pages=zeros, v_pages=zeros,
                      pages_bm=jnp.full((s, -(-t // page_size)), pages, jnp.int32))


def write_prefix(cache, q_g, prefix: PrefixKV, mask_gp):
  """Writes G prefilled prompts into prefix rows q_g [G], in the decode layouts (`init_cache`);
  q_g None: they are every row, in order, so the pool is the prefill's (no zeros scattered into)."""
  k_lghdp = jnp.transpose(prefix.k_lbphd, (0, 1, 3, 4, 2))
  v_lghpd = jnp.transpose(prefix.v_lbphd, (0, 1, 3, 2, 4))

  def write(x, new, axis=0):
    new = new.astype(x.dtype)
    return new if q_g is None else x.at[(slice(None),) * axis + (q_g,)].set(new)

  def put(pool, new_lg):
    if q_g is not None and traced_mesh.platform() == 'gpu':  # rows written into a pool
      new_lg = _row_major(new_lg)
    if isinstance(pool, tuple):
      return tuple(write(x, new_lg[l]) for l, x in enumerate(pool))
    return write(pool, new_lg, 1)

  positions = cache.prefix_positions_bp
  return cache.replace(prefix_k_lbhdp=put(cache.prefix_k_lbhdp, k_lghdp),
                       prefix_v_lbhpd=put(cache.prefix_v_lbhpd, v_lghpd),
                       prefix_mask_bp=write(cache.prefix_mask_bp, mask_gp),
                       prefix_positions_bp=None if positions is None else write(
                           positions, prefix.positions_bp))


def _row_major(x):
  """x materialized in row-major order, flat through an optimization barrier. Written as they
  come, rows in the layout the prefill's matmuls gave them pull the whole pool into that layout
  in an admitting loop, and the GPU compiler copies the pool in and out of it at every decode
  step. The TPU compiler keeps its tiled pool without this, and would copy it each step with."""
  return jax.lax.optimization_barrier(x.reshape(-1)).reshape(x.shape)

"""The KV cache of cohort decoding: a prompt's prefilled keys/values (`PrefixKV`) and the decode
cache built from them (`DecodeCache`, by `init_cache`), where the k streams of a prompt read that
prompt's keys/values computed once."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class PrefixKV:
  """Every layer's post-RoPE keys/values of a prefilled prompt batch."""

  k_lbphd: jax.Array
  v_lbphd: jax.Array


# Prompts up to this many tokens are copied into each stream's cache by `init_cache` (see
# `DecodeCache`); longer ones stay shared. Measured with experiments/bench_sampler.py
# (docs/ARCHITECTURE.md): copying is faster for short prompts, sharing for long ones.
COPY_PREFIX_MAX_LEN = 16


@flax.struct.dataclass
class DecodeCache:
  """The prompt's keys/values (computed once per prompt row) plus each stream's own.

  Two forms, chosen by `init_cache` from the prompt length:
  - shared (copied_prefix == 0): one prefix cache per row that its K streams all read, never
    tiled, next to per-stream buffers of T slots. Each decode step then contracts against two
    blocks, which pays for long prompts: their memory traffic is paid once per row.
  - copied (copied_prefix == P): the prefix is written into the first P slots of every stream's
    buffer (P + T slots; the prefix fields are empty). One score product and one value product
    per layer and step instead of two each plus a concatenation: faster for short prompts, where
    the per-operation cost dominates (measured by experiments/bench_sampler.py; see
    docs/PERFORMANCE.md).

  One array per layer (tuples of length L), each in the layout the decode-step contractions read
  directly, so no step copies a cache: keys with head_dim before the sequence axis (`_hdp` /
  `_hdt`: the score product q.k contracts D against a row-major [D, T] matrix), values with the
  sequence axis before head_dim (probs.v contracts T against [T, D]). A stacked [L, B, T, H, D]
  buffer cost a transpose plus a slice copy of every layer's K and V at every generated token.
  `index` counts generated tokens in both forms; stream slot `copied_prefix + index` is next.
  """

  prefix_k_bhdp: tuple  # L x [B, Hkv, D, P]; () when copied
  prefix_v_bhpd: tuple  # L x [B, Hkv, P, D]; () when copied
  prefix_mask_bp: jax.Array  # [B, P] bool
  k_bkhdt: tuple  # L x [B, K, Hkv, D, copied_prefix + T]
  v_bkhtd: tuple  # L x [B, K, Hkv, copied_prefix + T, D]
  index: jax.Array
  copied_prefix: int = flax.struct.field(pytree_node=False, default=0)


def init_cache(prefix: PrefixKV, mask_bp: jax.Array, num_streams: int,
               max_new_tokens: int, copy_prefix_max_len: int | None = None) -> DecodeCache:
  """The decode cache of `prefix` (transposed once here into the decode layouts) with empty
  stream slots: shared, one prefix per prompt row, or for prompts of at most
  `copy_prefix_max_len` tokens (default COPY_PREFIX_MAX_LEN) copied into the front of each of
  the `num_streams` buffers (see `DecodeCache`). Stream slots are valid up to index."""
  l, b, p, h, d = prefix.k_lbphd.shape
  dt = prefix.k_lbphd.dtype
  limit = COPY_PREFIX_MAX_LEN if copy_prefix_max_len is None else copy_prefix_max_len
  k_bhdp = tuple(jnp.transpose(prefix.k_lbphd[i], (0, 2, 3, 1)) for i in range(l))
  v_bhpd = tuple(jnp.transpose(prefix.v_lbphd[i], (0, 2, 1, 3)) for i in range(l))
  mask_bp = jnp.asarray(mask_bp, bool)
  index = jnp.zeros((), jnp.int32)
  if p <= limit:
    streams = lambda x: jnp.broadcast_to(x[:, None], (b, num_streams, *x.shape[1:]))
    empty_k = jnp.zeros((b, num_streams, h, d, max_new_tokens), dt)
    empty_v = jnp.zeros((b, num_streams, h, max_new_tokens, d), dt)
    return DecodeCache(
        prefix_k_bhdp=(), prefix_v_bhpd=(), prefix_mask_bp=mask_bp,
        k_bkhdt=tuple(jnp.concatenate([streams(x), empty_k], axis=-1) for x in k_bhdp),
        v_bkhtd=tuple(jnp.concatenate([streams(x), empty_v], axis=-2) for x in v_bhpd),
        index=index, copied_prefix=p)
  zeros = lambda *shape: tuple(jnp.zeros(shape, dt) for _ in range(l))
  return DecodeCache(
      prefix_k_bhdp=k_bhdp, prefix_v_bhpd=v_bhpd, prefix_mask_bp=mask_bp,
      k_bkhdt=zeros(b, num_streams, h, d, max_new_tokens),
      v_bkhtd=zeros(b, num_streams, h, max_new_tokens, d),
      index=index)

"""The Pallas TPU paged-attention kernel (`jax.experimental.pallas.ops.tpu.paged_attention`) with
the log-sum-exp of its scores, for the rollout engine's paged decode (`attention_ops`): a stream
reads its pages where they lie, and its output joins the shared prompt's by that log-sum-exp.

The shipped kernel body keeps the running max and sum of each query's scores as outputs; its
wrapper drops them. This one keeps them (and nothing else differs: no quantized pages, no
megacore split). Off TPU it runs in Pallas' TPU interpreter (the tests), which rounds the
products' float32 operands to bfloat16, as the chip's default precision does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention_kernel as shipped

from rloo_jax.models import traced_mesh

_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)  # the shipped kernel's


def applies(spec) -> bool:
  """Whether the kernel reads a paged decode's pages (`attention_ops.AttentionSpec`): on TPU,
  without a sliding window (the kernel has none), on one chip or inside the rollout engine's
  vmap over its shards (`traced_mesh.vmapped_shards`), where each device calls it on its own
  shard: XLA cannot partition a Pallas call."""
  mesh = traced_mesh.get()
  return (traced_mesh.platform() == 'tpu' and spec.window is None
          and (mesh is None or mesh.size == 1 or traced_mesh.shards_vmapped()))


def decode(q_bkhgd, k, v, spec, score_prefix, interpret: bool = False):
  """A paged decode step's attention (`cache.PagedStreams`): each stream's slots 0..index
  through the kernel, where its pages lie; the prompt by `score_prefix(q, k, v, spec) -> (o,
  lse)`, given no stream slot; both joined by their log-sum-exps."""
  (prefix_k, pool_k, paged), (prefix_v, pool_v, _) = k, v
  b, _, h, g, d = q_bkhgd.shape
  none_k, none_v = jnp.zeros((b, 1, h, d, 0), pool_k.dtype), jnp.zeros((b, 1, h, 0, d),
                                                                        pool_v.dtype)
  o_t, lse_t = score_prefix(q_bkhgd, (prefix_k, none_k), (prefix_v, none_v), spec)
  q = (q_bkhgd[:, 0] * spec.scale).astype(q_bkhgd.dtype).reshape(b, h * g, d)
  # A call a device: its shard's streams, its share of the heads over 'tensor'.
  kernel = functools.partial(attend, softcap=spec.softcap, interpret=interpret)
  o_p, lse_p = traced_mesh.per_shard(
      kernel, (q, pool_k, pool_v, spec.layout.index[:, 0] + 1, paged.pages_bm),
      (1, 0, 0, None, None), (1, 1))
  lse_p = lse_p.reshape(lse_t.shape)
  top = jnp.maximum(lse_t, lse_p)
  w_t, w_p = jnp.exp(lse_t - top), jnp.exp(lse_p - top)
  o = (o_t * w_t[..., None] + o_p.reshape(o_t.shape) * w_p[..., None]) / (w_t + w_p)[..., None]
  return o.astype(pool_v.dtype)


def pages_per_block(pages_per_sequence: int) -> int:
  """Pages a kernel step loads: the most of 8, 4, 2, 1 that divides a stream's page table."""
  return next(b for b in (8, 4, 2, 1) if pages_per_sequence % b == 0)


def attend(q_bhd, k_pages, v_pages, lengths_b, pages_bm, *, softcap: float = 0.0,
           interpret: bool = False):
  """(o [B, Hq, D] float32, lse [B, Hq] float32) of one query a stream (`q_bhd`, already
  scaled) over its first lengths_b[b] keys, which sit in pages pages_bm[b] of k_pages / v_pages
  [Hkv, pages, G, D]. A stream with no keys gets o = 0 and lse = -inf."""
  b, hq, d = q_bhd.shape
  hkv, _, g, _ = k_pages.shape
  groups, m = hq // hkv, pages_bm.shape[1]
  block = pages_per_block(m)
  if groups % 8:  # the shipped wrapper's layout hint for a [1, D] query block
    q = q_bhd.astype(jnp.float32).reshape(b, hq, 1, d)
    spec = pl.BlockSpec((None, groups, None, d), lambda c, i, h, *_: (i, h, 0, 0))
  else:
    q = q_bhd
    spec = pl.BlockSpec((None, groups, d), lambda c, i, h, *_: (i, h, 0))
  kernel = functools.partial(
      shipped.paged_flash_attention_kernel_inline_seq_dim, batch_size=b,
      pages_per_compute_block=block, pages_per_sequence=m, mask_value=_MASK_VALUE,
      attn_logits_soft_cap=softcap or None, megacore_mode=None)
  buffer = lambda x: pltpu.VMEM((2, block, g, d), x.dtype)  # noqa: E731  (double-buffered)
  stat = jax.ShapeDtypeStruct(q.shape[:-1] + (1,), jnp.float32)
  o, m_, l_ = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=4, grid=(1, b, hkv),
          in_specs=[spec, pl.BlockSpec(memory_space=pl.ANY), None,
                    pl.BlockSpec(memory_space=pl.ANY), None],
          out_specs=[spec, spec, spec],
          scratch_shapes=(buffer(k_pages), None, buffer(v_pages), None,
                          pltpu.SemaphoreType.DMA((2,)), pltpu.SemaphoreType.DMA((2,)))),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=('parallel', 'arbitrary', 'arbitrary')),
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), stat, stat],
      interpret=pltpu.InterpretParams() if interpret else False,
  )(lengths_b.astype(jnp.int32), pages_bm.reshape(-1).astype(jnp.int32),
    jnp.zeros((1,), jnp.int32), jnp.ones((1,), jnp.int32), q, k_pages, None, v_pages, None)
  lse = (m_ + jnp.log(l_)).reshape(b, hq)
  return o.reshape(b, hq, d).astype(jnp.float32), lse

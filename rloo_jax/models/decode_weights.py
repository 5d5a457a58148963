"""The weights a decode loop reads, prepared once per rollout, before its first token.

A decode step feeds a few rows per stream through every layer, so its cost is reading the
weights; three things multiply that read at every token unless they are paid once up front:

- The layer scan slices each layer out of the stacked arrays into a new buffer (read, write,
  then the matmuls read the copy). `unstacked`: one buffer per layer, split once.
- FSDP gathers each layer's shards at every token. `unstacked` gathers every layer once, so
  the rollout holds the whole model gathered (the memory plan's decode program counts it);
  scanned, the per-token gather stays (at most one layer held gathered).
- Float32 master weights under bfloat16 activations are converted at every use. They are cast
  to the activation dtype once: the decode's reads, and any gather, then move half the bytes.
  Scanned on one device the cast is left to each use: the copy would cost half the float32
  weights, a saving the default scanned decode keeps.

Every weight the model casts to the activation dtype before using it is cast here, so the
decode computes with the values it did (a backend that rounds at each cast gives the same bits;
XLA:CPU, which keeps float32 where it may, rounds the weights here instead); norm parameters,
which the norms apply in float32 (Gemma's 1 + w, LayerNorm), are left as stored.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rloo_jax.models.config import TransformerConfig, dtype_of


def _kept(path) -> bool:
  """Whether a parameter stays in its stored dtype: the norms' scales and biases."""
  return any('norm' in str(getattr(k, 'key', k)) for k in path)


def cast(config: TransformerConfig, tree):
  """`tree`'s floating parameters wider than the activation dtype cast to it, norms kept."""
  dt = jnp.dtype(dtype_of(config.dtype))

  def one(path, x):
    wider = jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize > dt.itemsize
    return x.astype(dt) if wider and not _kept(path) else x

  return jax.tree_util.tree_map_with_path(one, tree)


def prepare(config: TransformerConfig, params, unstacked: bool, *, gather=None):
  """(params, layers) for the decode loop from the stored `params` (gather: the model's
  `sharding.ParamGather`, or None).

  unstacked: `layers` is a tuple of per-layer weight trees, gathered and cast, and `params` has
  its non-layer weights gathered and cast too; `ModelFns.decode(..., layers=layers)` then
  gathers nothing more. Otherwise `layers` is None and `params` is the stored tree, cast
  (shards included) when it is FSDP-sharded, for `ModelFns.decode`'s per-token gather."""
  if not unstacked:
    return (params if gather is None else cast(config, params)), None
  top = cast(config, {k: v for k, v in params.items() if k != 'layers'})
  if gather is not None:
    top = gather.params(top)
  prepared = dict(params.items())
  prepared.update(top)
  layers = []
  for l in range(config.num_layers):
    weights = cast(config, jax.tree.map(lambda w, l=l: w[l], params['layers']))
    layers.append(weights if gather is None else gather.layer(weights))
  return type(params)(prepared), tuple(layers)

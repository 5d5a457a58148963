"""The weights a decode loop reads, prepared once per rollout, before its first token.

A decode step's cost is reading the weights, so what would repeat at every token is paid once:
`unstacked` splits the stacked layers into one buffer per layer (no per-token slice copy) and
gathers FSDP shards once (the rollout then holds the whole model gathered; the memory plan
counts it); float32 master weights are cast to the activation dtype once (scanned on one device
the cast is left to each use, which saves the copy). The weights the model casts before use
are cast here, so the decode computes with the same values; norm parameters stay as stored.
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

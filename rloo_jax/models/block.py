"""One decoder layer (`Block`) and the stack of them the layer scan runs (`stacked_blocks`)."""

from __future__ import annotations

from jax.ad_checkpoint import checkpoint_name
from flax import nnx

from rloo_jax.models import attention_ops
from rloo_jax.models.attention import Attention
from rloo_jax.models.config import TransformerConfig
from rloo_jax.models.layers import MLP, Norm


class Block(nnx.Module):
  """One decoder layer. Its one body (`__call__`) serves every forward variant; only the
  attention spec (its layout) and where the new keys/values go differ."""

  def __init__(self, config: TransformerConfig, rngs: nnx.Rngs):
    self.parallel_residual = config.parallel_residual
    self.sandwich_norm = config.sandwich_norm
    self.attn_norm = Norm(config, rngs)
    self.attn = Attention(config, rngs)
    self.mlp_norm = Norm(config, rngs)
    self.mlp = MLP(config, rngs)
    if self.sandwich_norm:
      self.post_attn_norm = Norm(config, rngs)
      self.post_mlp_norm = Norm(config, rngs)

  def _mlp(self, x_bse):
    # Named (`config.CHECKPOINT_NAMES`) so that remat='names' can keep them for the backward.
    m_bse = self.mlp(checkpoint_name(self.mlp_norm(x_bse), 'mlp_in'))
    return checkpoint_name(m_bse, 'mlp_out')

  def __call__(self, x_bse, rotary, spec: attention_ops.AttentionSpec, store=None,
               fused: bool = False):
    """x + attention + MLP (pre-norm); returns (x, aux). `store(k, v) -> (keys, values, aux)`
    puts this layer's new keys/values where they belong (the decode's cache slot) and gives
    what `attend` reads; None: attend reads k, v, and aux is (k, v). fused: q/k/v in one matmul.

    Sequential (the MLP reads x + attention), or with config.parallel_residual both branches
    read x: x + attn(norm1(x)) + mlp(norm2(x)). With config.sandwich_norm (Gemma) each branch's
    output is normed again before it joins the residual."""
    q, k, v = self.attn.qkv(self.attn_norm(x_bse), rotary, fused=fused)
    q, k, v = (checkpoint_name(y, n) for y, n in ((q, 'query'), (k, 'key'), (v, 'value')))
    keys, values, aux = (k, v, (k, v)) if store is None else store(k, v)
    o = checkpoint_name(attention_ops.attend(q, keys, values, spec), 'attention')
    a_bse = self.attn.out(o)
    if self.sandwich_norm:
      a_bse = self.post_attn_norm(a_bse)
    if self.parallel_residual:
      # Summed in transformers' order (mlp + attn + x), for float parity.
      return self._mlp(x_bse) + a_bse + x_bse, aux
    x_bse = x_bse + a_bse
    m_bse = self._mlp(x_bse)
    if self.sandwich_norm:
      m_bse = self.post_mlp_norm(m_bse)
    return x_bse + m_bse, aux


def stacked_blocks(config: TransformerConfig, rngs: nnx.Rngs) -> Block:
  """num_layers Blocks as one, every parameter stacked on a leading 'layers' axis."""
  @nnx.split_rngs(splits=config.num_layers)
  @nnx.vmap(in_axes=(0,), out_axes=0, axis_size=config.num_layers,
            transform_metadata={nnx.PARTITION_NAME: 'layers'})
  def make(rngs):
    return Block(config, rngs)
  return make(rngs)

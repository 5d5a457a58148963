"""One decoder layer (`Block`) and the stack of them the layer scan runs (`stacked_blocks`)."""

from __future__ import annotations

from flax import nnx

from rloo_jax.models.attention import Attention
from rloo_jax.models.config import TransformerConfig
from rloo_jax.models.layers import MLP, Norm


class Block(nnx.Module):
  """One decoder layer. Its one body (`__call__`) serves every forward variant; only the
  attention pattern differs, passed in as `attend`."""

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

  def left_kernels(self, dt) -> dict:
    """Every matmul kernel of the layer as the [out, in] matrix `layers.dense_left` multiplies
    by (the decode's form; `models.decode_weights`), in dtype `dt`."""
    return {**self.attn.left_kernels(dt), **self.mlp.left_kernels(dt)}

  def __call__(self, x_bse, rotary, attend, fused: bool = False, left: dict | None = None):
    """x + attention + MLP (pre-norm). `attend(q, k, v) -> (o, aux)` applies the variant's
    attention to this layer's projections; aux (its K/V, an updated cache) is returned.

    Sequential (the MLP reads x + attention), or with config.parallel_residual both branches
    read x: x + attn(norm1(x)) + mlp(norm2(x)). With config.sandwich_norm (Gemma) each branch's
    output is normed again before it joins the residual. `left`: `left_kernels`' matrices,
    which the matmuls then multiply by instead of the kernels (fused q/k/v)."""
    q, k, v = self.attn.qkv(self.attn_norm(x_bse), rotary, fused=fused, left=left)
    o, aux = attend(q, k, v)
    a_bse = self.attn.out(o, left=left)
    if self.sandwich_norm:
      a_bse = self.post_attn_norm(a_bse)
    if self.parallel_residual:
      # Summed in transformers' order (mlp + attn + x), for float parity.
      return self.mlp(self.mlp_norm(x_bse), left=left) + a_bse + x_bse, aux
    x_bse = x_bse + a_bse
    m_bse = self.mlp(self.mlp_norm(x_bse), left=left)
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

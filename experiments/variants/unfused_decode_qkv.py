"""B: the decode step's q/k/v as three matmuls (before d8b857d) instead of one fused matmul."""
from rloo_jax.models import transformer


def apply():
  qkv = transformer.Attention.qkv

  def unfused(self, x_bse, rotary, fused=False, dense=transformer._plain_dense):
    # A recording or replaying tape (`dense`) still takes the fused form: its names must match.
    return qkv(self, x_bse, rotary, fused=False, dense=dense)

  transformer.Attention.qkv = unfused

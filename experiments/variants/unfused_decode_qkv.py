"""B: the decode step's q/k/v as three matmuls (before d8b857d) instead of one fused matmul."""
from rloo_jax.models import attention


def apply():
  qkv = attention.Attention.qkv

  def unfused(self, x_bse, rotary, fused=False):
    return qkv(self, x_bse, rotary, fused=False)

  attention.Attention.qkv = unfused

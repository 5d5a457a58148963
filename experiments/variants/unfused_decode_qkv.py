"""B: the decode step's q/k/v as three matmuls (before d8b857d) instead of one fused matmul; with
the decode's weights on the left (`layers.dense_left`, CPU's default) three such products, each
against its rows of the fused [out, in] matrix."""
from rloo_jax.models import attention
from rloo_jax.models.layers import _cast, _project, dense_left


def apply():
  def unfused(self, x_bse, left_kernel=None):
    dt = x_bse.dtype
    if left_kernel is None:
      return tuple(_project(x_bse, _cast(k, dt))
                   for k in (self.q_kernel, self.k_kernel, self.v_kernel))
    c = self.config
    hkv, d = c.num_kv_heads, c.head_dim
    g = c.num_heads // hkv
    b, s = x_bse.shape[:2]
    w = left_kernel.reshape(hkv, g + 2, d, -1)
    q = dense_left(x_bse, w[:, :g].reshape(hkv * g * d, -1)).reshape(b, s, hkv * g, d)
    k = dense_left(x_bse, w[:, g].reshape(hkv * d, -1)).reshape(b, s, hkv, d)
    v = dense_left(x_bse, w[:, g + 1].reshape(hkv * d, -1)).reshape(b, s, hkv, d)
    return q, k, v

  attention.Attention._fused_qkv = unfused  # pylint: disable=protected-access

"""B: SwiGLU (Llama/Qwen2 MLP; the bench model) as one op with a hand-written VJP (residuals gate and up; the backward recomputes
the sigmoid), so the forward is one elementwise pass instead of three."""
import jax
import jax.numpy as jnp

from rloo_jax.models import layers


@jax.custom_vjp
def swiglu(gate, up):
  return jax.nn.silu(gate) * up


def _fwd(gate, up):
  return swiglu(gate, up), (gate, up)


def _bwd(res, dh):
  gate, up = res
  g = gate.astype(jnp.float32)
  sig = jax.nn.sigmoid(g)
  d = dh.astype(jnp.float32)
  return ((d * up.astype(jnp.float32) * sig * (1 + g * (1 - sig))).astype(gate.dtype),
          (d * g * sig).astype(up.dtype))


swiglu.defvjp(_fwd, _bwd)


def apply():
  plain = layers.MLP.__call__

  def mlp(self, x_bse, left=None):
    if self.gpt2 or left is not None:  # GELU with biases: not a SwiGLU; the decode's form
      return plain(self, x_bse, left)
    dt = x_bse.dtype
    up = layers._dense(x_bse, layers._cast(self.up_kernel, dt))
    gate = layers._dense(x_bse, layers._cast(self.gate_kernel, dt))
    return layers._dense(swiglu(gate, up), layers._cast(self.down_kernel, dt))

  layers.MLP.__call__ = mlp

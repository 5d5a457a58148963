"""B: SwiGLU (Llama/Qwen2 MLP; the bench model) as one op with a hand-written VJP (residuals gate and up; the backward recomputes
the sigmoid), so the forward is one elementwise pass instead of three."""
import jax
import jax.numpy as jnp

from rloo_jax.models import transformer


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
  def mlp(self, x_bse, dense=transformer._plain_dense):
    dt = x_bse.dtype
    up = dense('up', x_bse, transformer._cast(self.up_kernel, dt))
    gate = dense('gate', x_bse, transformer._cast(self.gate_kernel, dt))
    return dense('down', swiglu(gate, up), transformer._cast(self.down_kernel, dt))

  transformer.MLP.__call__ = mlp

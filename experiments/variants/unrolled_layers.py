"""B: the layer stack run by a Python loop over static slices of the stacked weights (the same
layer body, unrolled) instead of `lax.scan`: what the scan costs or saves per program."""
import jax
from flax import nnx

from rloo_jax.models import transformer


def apply():
  def unrolled(self, body, x, carry=None, xs=None, gather=None):
    graphdef, stacked = nnx.split(self.layers)
    ys = []
    for l in range(self.config.num_layers):
      weights = jax.tree.map(lambda w, l=l: w[l], stacked)
      if gather is not None:
        weights = gather.layer(weights)
      xs_l = jax.tree.map(lambda v, l=l: v[l], xs)
      step = lambda w, x, carry, xs_l: body(nnx.merge(graphdef, w), x, carry, xs_l)
      if self.config.remat != 'none':  # the same rematerialisation as the scan's body
        step = jax.checkpoint(step, policy=transformer.REMAT_POLICIES[self.config.remat])
      x, carry, y = step(weights, x, carry, xs_l)
      ys.append(y)
    return x, carry, jax.tree.map(lambda *a: jax.numpy.stack(a), *ys) if ys[0] is not None else None

  transformer.Transformer._scan = unrolled

"""B: the layer stack run by a Python loop over static slices of the stacked weights (the same
layer body, unrolled) instead of `lax.scan`: what the scan costs or saves per program. Against
the rollout's default (`sampler.sample(unstack_layers=True)`, already unrolled over per-layer
buffers) the decode changes only where that is off; ab_compiled's rollout scans."""
import jax
import jax.numpy as jnp
from flax import nnx

from rloo_jax.models import transformer
from rloo_jax.models.attention import Scores


def apply():
  def unrolled(self, body, x, positions, carry=None, xs=None, gather=None, layers=None):
    c = self.config
    graphdef, stacked = nnx.split(self.layers)
    if layers is not None:  # the decode loop's per-layer weights: unrolled already
      return self._unrolled(graphdef, layers, body, x, positions, carry, xs, gather)
    global_rot, local_rot = self._rotary(positions)
    sliding = any(c.sliding_layers)
    ys = []
    for l in range(c.num_layers):
      weights = jax.tree.map(lambda w, l=l: w[l], stacked)
      if gather is not None:
        weights = gather.layer(weights)
      xs_l = jax.tree.map(lambda v, l=l: v[l], xs)
      window = c.sliding_window if c.sliding_layers[l] else jnp.iinfo(jnp.int32).max
      rotary = local_rot if (local_rot is not None and c.sliding_layers[l]) else global_rot
      scores = Scores.of(c, jnp.int32(window) if sliding else None)

      def step(w, x, carry, xs_l, rotary=rotary, scores=scores):
        return body(nnx.merge(graphdef, w), x, carry, xs_l, rotary, scores)
      if c.remat != 'none':  # the same rematerialisation as the scan's body
        step = jax.checkpoint(step, policy=transformer.REMAT_POLICIES[c.remat],
                              prevent_cse=False)
      x, carry, y = step(weights, x, carry, xs_l)
      ys.append(y)
    stack = (jax.tree.map(lambda *a: jnp.stack(a), *ys) if ys[0] is not None else None)
    return x, carry, stack

  transformer.Transformer._scan = unrolled

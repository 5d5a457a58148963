"""A loss linear in the token log-probs, sum_bt c[b, t] * log p(y[b, t] | ...), whose head
gradient is computed in the same pass as the log-probs.

Under `jax.grad`, `loss.chunked_logprobs` runs the head twice per chunk of positions. The forward
scan computes each chunk's logits for the log-probs, then the backward scan recomputes them
(nothing [N, T, V] is kept) before its two gradient products. When the loss is linear in the
log-probs, d loss / d logp is a per-token coefficient c known before the forward. That holds for
`loss.type='reinforce'`, the paper's RLOO, in every aggregation (`loss.linear_coefficients`).
Then one scan suffices: each chunk's logits, then at once d logits = c * (onehot(y) - softmax),
and from it the hidden states' and the head weights' gradients. Per chunk that is three
[rows, E] x [E, V] products instead of four, and one pass over the [rows, V] logits instead of
two, with the same peak. The same trick as Liger-Kernel's fused linear cross-entropy: a scalar
output's VJP is its gradient times the output cotangent, so computing the gradient ahead
composes with any caller. It holds at every scale and matters most where the vocabulary is large
beside the hidden size (150k-256k vocabularies on 0.5-2B models).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.custom_derivatives import CustomVJPPrimal

from rloo_jax import loss

Array = jax.Array


def linear_logprob_loss(logits_fn: Callable[..., Array], params, hidden_bte: Array,
                        targets_bt: Array, coef_bt: Array, *, chunk_size: int,
                        with_entropy: bool = False):
  """(value, logp_bt, entropy_bt): value = sum_bt coef_bt * logp_bt, differentiable in `params`
  and `hidden_bte` (and `coef_bt`); logp_bt ([B, T] float32, as `loss.chunked_logprobs` gives
  it without a mask) and entropy_bt (None unless `with_entropy`) carry no gradient: they are
  for metrics.

  `logits_fn(params, h_bce) -> [B, c, V]` is the model's head. The gradient is computed in the
  forward scan over chunks of `chunk_size` positions and kept as the residual, so `jax.grad`
  runs no second pass over the head. Inputs not being differentiated get no gradient
  computed: with a frozen head (LoRA) the weights' product is skipped.
  """
  if coef_bt.shape != targets_bt.shape:
    raise ValueError(f"coef shape {tuple(coef_bt.shape)} does not match targets shape "
                     f"{tuple(targets_bt.shape)} (expected [B, T])")
  h_nbce, y_nbc, unchunk = loss.position_chunks(hidden_bte, targets_bt, chunk_size)
  coef_nbc = loss.position_chunks(hidden_bte, coef_bt.astype(jnp.float32), chunk_size)[1]

  weighted_sum = lambda c, logp: jnp.sum(jnp.where(c == 0, 0.0, c * logp))

  def run(params, h_nbce, coef_nbc, want_params: bool, want_hidden: bool):
    """One scan: log-probs, entropies, and the gradients asked for (None otherwise)."""
    def body(grad_acc, xs):
      h, y, c = xs
      f32_logits = lambda p, x: logits_fn(p, x).astype(jnp.float32)
      # Differentiated in what is asked for only, so no product computes an unwanted gradient.
      vjp = None
      if not (want_params or want_hidden):
        logits = f32_logits(params, h)
      elif want_params and want_hidden:
        logits, vjp = jax.vjp(f32_logits, params, h)
      elif want_params:
        logits, vjp_p = jax.vjp(lambda p: f32_logits(p, h), params)
        vjp = lambda ct: (*vjp_p(ct), None)
      else:
        logits, vjp_h = jax.vjp(lambda x: f32_logits(params, x), h)
        vjp = lambda ct: (None, *vjp_h(ct))
      lse = jax.nn.logsumexp(logits, axis=-1)
      logp = jnp.take_along_axis(logits, y[..., None], -1)[..., 0] - lse
      probs = jnp.exp(logits - lse[..., None])
      ent = lse - jnp.sum(probs * logits, axis=-1) if with_entropy else None
      if vjp is None:
        return grad_acc, (logp, ent, None)
      onehot = jnp.arange(logits.shape[-1]) == y[..., None]
      # Where c is 0 (masked positions) the gradient is 0 even if those logits are not finite,
      # as the two-pass path's masked log-probs give.
      dp, dh = vjp(jnp.where(c[..., None] == 0, 0.0, c[..., None] * (onehot - probs)))
      if want_params:
        grad_acc = jax.tree.map(jnp.add, grad_acc, dp)
      return grad_acc, (logp, ent, dh if want_hidden else None)

    zeros = jax.tree.map(jnp.zeros_like, params) if want_params else None
    return jax.lax.scan(body, zeros, (h_nbce, y_nbc, coef_nbc))

  @jax.custom_vjp
  def value_of(params, h_nbce, coef_nbc):
    _, (logp, ent, _) = run(params, h_nbce, coef_nbc, False, False)
    return weighted_sum(coef_nbc, logp), logp, ent

  static = {}  # what fwd learns at trace time that bwd needs: not arrays, so not residuals
  # By type: a Variable in the tree forwards attribute lookups to its value, so a hasattr test
  # would stop at the Variable.
  primal = lambda x: isinstance(x, CustomVJPPrimal)

  def fwd(params, h_nbce, coef_nbc):
    leaves, static["treedef"] = jax.tree.flatten(params, is_leaf=primal)
    want_params = any(leaf.perturbed for leaf in leaves)
    dp, (logp, ent, dh) = run(static["treedef"].unflatten([leaf.value for leaf in leaves]),
                              h_nbce.value, coef_nbc.value, want_params, h_nbce.perturbed)
    out = (weighted_sum(coef_nbc.value, logp), logp, ent)
    # d value / d coef: the log-probs, 0 where the coefficient is (as weighted_sum's where).
    d_coef = jnp.where(coef_nbc.value == 0, 0.0, logp) if coef_nbc.perturbed else None
    return out, (dp, dh, d_coef)

  def bwd(res, cotangents):
    dp, dh, d_coef = res
    g = cotangents[0]  # the logp and entropy outputs carry no gradient: their cotangents drop
    scale = lambda x: None if x is None else g.astype(x.dtype) * x  # in each input's dtype
    d_params = (static["treedef"].unflatten([None] * static["treedef"].num_leaves)
                if dp is None else jax.tree.map(scale, dp))
    return d_params, scale(dh), scale(d_coef)

  value_of.defvjp(fwd, bwd, symbolic_zeros=True)
  value, logp_nbc, ent_nbc = value_of(params, h_nbce, coef_nbc)
  logp_bt = jax.lax.stop_gradient(unchunk(logp_nbc))
  ent_bt = None if ent_nbc is None else jax.lax.stop_gradient(unchunk(ent_nbc))
  return value, logp_bt, ent_bt


class DenseHead:
  """The log-prob methods of rows whose hidden states come out [N, T, E], one per completion
  token (`packing.PackedMicrobatch` has the same two for packed rows)."""

  def logprobs(self, fns, params, *, chunk_size: int, with_entropy: bool = False):
    """(log-probs [N, T], entropies [N, T] or None) of the completions, float32, from the final
    hidden states in chunks of `chunk_size` positions (`loss.chunked_logprobs`): no [N, T, V]
    logits exist, forward or backward."""
    return loss.chunked_logprobs(fns.head, fns.head_params(params), self.hidden(fns, params),
                                 self.completions_nt, self.cmask_nt, chunk_size=chunk_size,
                                 with_entropy=with_entropy)

  def linear_loss(self, fns, params, coef_nt, *, chunk_size: int):
    """(sum of coef_nt * log-probs, log-probs [N, T], entropies [N, T]): the head's gradient
    taken in the log-prob pass (`linear_logprob_loss`)."""
    return linear_logprob_loss(fns.head, fns.head_params(params), self.hidden(fns, params),
                               self.completions_nt, coef_nt, chunk_size=chunk_size,
                               with_entropy=True)

"""Loss reductions: masked sums and means, the aggregation modes and the normaliser that makes a
microbatch's loss its share of the minibatch's.

Loss aggregation (`aggregation=`) differs between peers, so it is named explicitly. Given per-token
loss terms l[b, t] and the completion mask m[b, t]:

- 'sequence_sum'  (default, the "Back to Basics" form): mean_b sum_t l*m. The whole completion is
  one action: its log-probability is the sum of its token log-probs, so long and short
  completions are weighted by their full log-likelihood, as REINFORCE prescribes.
- 'sequence_mean' (original GRPO): mean_b (sum_t l*m / sum_t m). Each sequence counts equally and
  its tokens are averaged, which biases towards short completions for positive advantages.
- 'token_mean'    (DAPO, TRL's default for GRPO): sum_bt l*m / sum_bt m. Every token counts
  equally across the batch; the normaliser depends on the batch's lengths.
- 'fixed_length'  (Dr. GRPO): sum_bt l*m / (B * max_len) with `max_len` fixed by config, so the
  normaliser is constant and the gradient is unbiased for any length mix.

Gradient accumulation: every reduction divides by a count of the batch it sees, so a microbatch's
loss is not a share of its minibatch's. `normalizer(spec, minibatch_mask)` computes those counts
once over the whole minibatch (`loss.normalizer`); passing it as `normalizer=` to each
microbatch's loss makes the loss and every metric that microbatch's contribution, so their
sums over microbatches (and the sums of the gradients) are exactly the minibatch's, up to float
rounding.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

Array = jax.Array

AGGREGATIONS = ("sequence_sum", "sequence_mean", "token_mean", "fixed_length")


def masked_sum(x: Array, mask: Array, axis=None) -> Array:
  return jnp.sum(jnp.where(mask, x.astype(jnp.float32), 0.0), axis=axis)


def masked_mean(x: Array, mask: Array, axis=None) -> Array:
  """Mean over True entries; 0 (never NaN) where there are none."""
  count = jnp.sum(mask, axis=axis).astype(jnp.float32)
  return masked_sum(x, mask, axis) / jnp.maximum(count, 1.0)


class Normalizer(NamedTuple):
  """The counts a loss divides by, float32 scalars, from `normalizer` (a pytree, so jit-able)."""
  sequences: Array  # rows, fully masked ones included (the 'mean over b' of the modes)
  tokens: Array     # completion tokens, at least 1 (as `masked_mean` clamps)
  length: Array     # fixed_length's max_len


def counts(mask_bt: Array, length: int) -> Normalizer:
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  return Normalizer(f32(mask_bt.shape[0]), jnp.maximum(f32(jnp.sum(mask_bt)), 1.0), f32(length))


def aggregate(loss_bt: Array, mask_bt: Array, aggregation: str = "sequence_sum",
              max_len: Optional[int] = None, normalizer: Optional[Normalizer] = None) -> Array:
  """Reduce per-token loss terms to a scalar (see the module docstring for the modes).

  Without `normalizer` the counts are this batch's own (fixed_length's length is `max_len`, else
  the mask's T). With one (from `normalizer(...)` on the whole minibatch; its length replaces
  `max_len`) the result is this microbatch's share, and the shares sum to the minibatch's value.
  """
  norm = counts(mask_bt, max_len or mask_bt.shape[-1]) if normalizer is None else normalizer
  if aggregation == "sequence_sum":
    return jnp.sum(masked_sum(loss_bt, mask_bt, axis=-1)) / norm.sequences
  if aggregation == "sequence_mean":
    return jnp.sum(masked_mean(loss_bt, mask_bt, axis=-1)) / norm.sequences
  if aggregation == "token_mean":
    return masked_sum(loss_bt, mask_bt) / norm.tokens
  if aggregation == "fixed_length":
    return masked_sum(loss_bt, mask_bt) / (norm.sequences * norm.length)
  raise ValueError(f"unknown loss aggregation {aggregation!r}; choose one of {AGGREGATIONS} "
                   f"(config.loss.aggregation)")


def entropy_metric(entropy_bt, mask_bt, norm: Normalizer):
  if entropy_bt is None:
    return {}
  if entropy_bt.shape != mask_bt.shape:
    raise ValueError(f"entropy_bt shape {tuple(entropy_bt.shape)} does not match mask shape "
                     f"{tuple(mask_bt.shape)}; pass token_entropy(logits) [B, T], not logits")
  return {"entropy": masked_sum(entropy_bt, mask_bt) / norm.tokens}

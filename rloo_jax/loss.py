"""Pure loss functions: token log-probs, KL estimators, penalised rewards and policy losses.

Everything is computed in float32 whatever the dtype of the logits. Per-token arrays are
[batch, time] (`_bt`) with a boolean completion mask; per-sequence arrays are [batch] (`_b`).

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
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

Array = jax.Array

AGGREGATIONS = ("sequence_sum", "sequence_mean", "token_mean", "fixed_length")
KL_ESTIMATORS = ("k1", "k2", "k3")
LOSS_TYPES = ("reinforce", "ppo_clip")
RATIO_LEVELS = ("sequence", "token")


def token_logprobs(logits_btv: Array, targets_bt: Array, mask_bt: Optional[Array] = None) -> Array:
  """log pi(target_t | ...) in float32; zero where mask is False."""
  if logits_btv.shape[:-1] != targets_bt.shape:
    raise ValueError(f"logits shape {tuple(logits_btv.shape)} does not match targets shape "
                     f"{tuple(targets_bt.shape)} (expected logits [B, T, V] and targets [B, T])")
  logits = logits_btv.astype(jnp.float32)
  # logsumexp-then-gather avoids materialising a [B, T, V] log-softmax for the backward pass.
  target_logits = jnp.take_along_axis(logits, targets_bt[..., None].astype(jnp.int32), -1)[..., 0]
  logp = target_logits - jax.nn.logsumexp(logits, axis=-1)
  if mask_bt is not None:
    logp = jnp.where(mask_bt, logp, 0.0)
  return logp


def token_entropy(logits_btv: Array) -> Array:
  """Entropy of each token's distribution, float32 [B, T]."""
  logits = logits_btv.astype(jnp.float32)
  logp = jax.nn.log_softmax(logits, axis=-1)
  return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def masked_sum(x: Array, mask: Array, axis=None) -> Array:
  return jnp.sum(jnp.where(mask, x.astype(jnp.float32), 0.0), axis=axis)


def masked_mean(x: Array, mask: Array, axis=None) -> Array:
  """Mean over True entries; 0 (never NaN) where there are none."""
  count = jnp.sum(mask, axis=axis).astype(jnp.float32)
  return masked_sum(x, mask, axis) / jnp.maximum(count, 1.0)


def kl_per_token(logp_bt: Array, ref_logp_bt: Array, estimator: str = "k1") -> Array:
  """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's k1, k2, k3).

  k1 = log pi - log pi_ref (unbiased, can be negative); k2 = (log-ratio)^2 / 2 (biased, low
  variance); k3 = r - 1 - log r with r = pi_ref / pi (unbiased and non-negative).
  """
  log_ratio = logp_bt.astype(jnp.float32) - ref_logp_bt.astype(jnp.float32)
  if estimator == "k1":
    return log_ratio
  if estimator == "k2":
    return 0.5 * log_ratio**2
  if estimator == "k3":
    # Clamp before exp: a token the reference finds far likelier must not overflow to inf.
    neg = jnp.clip(-log_ratio, -20.0, 20.0)
    return jnp.exp(neg) - 1.0 - neg
  raise ValueError(f"unknown KL estimator {estimator!r}; choose one of {KL_ESTIMATORS} "
                   f"(config.kl.estimator)")


def sequence_kl(logp_bt: Array, ref_logp_bt: Array, mask_bt: Array, estimator: str = "k1",
                reduction: str = "sum") -> Array:
  """Per-sequence KL [B]: the sum (the paper) or the mean over completion tokens."""
  per_token = kl_per_token(logp_bt, ref_logp_bt, estimator)
  if reduction == "sum":
    return masked_sum(per_token, mask_bt, axis=-1)
  if reduction == "mean":
    return masked_mean(per_token, mask_bt, axis=-1)
  raise ValueError(f"unknown KL reduction {reduction!r}; choose 'sum' or 'mean' "
                   f"(config.kl.reduction)")


def penalized_reward(rewards: Array, logp_bt: Array, ref_logp_bt: Array, mask_bt: Array, *,
                     beta: float, estimator: str = "k1", reduction: str = "sum"):
  """R = r - beta * KL(sequence). Returns (penalised rewards, sequence KL), both float32.

  `reduction='sum'` is the paper's sequence KL; 'mean' is the length-normalised variant that
  keeps the penalty's scale independent of completion length. `rewards` may be [B] or [B, k]
  with log-probs [..., T] matching.
  """
  kl = sequence_kl(logp_bt, ref_logp_bt, mask_bt, estimator, reduction)
  return rewards.astype(jnp.float32) - beta * kl, kl


def aggregate(loss_bt: Array, mask_bt: Array, aggregation: str = "sequence_sum",
              max_len: Optional[int] = None) -> Array:
  """Reduce per-token loss terms to a scalar (see the module docstring for the modes)."""
  if aggregation == "sequence_sum":
    return jnp.mean(masked_sum(loss_bt, mask_bt, axis=-1))
  if aggregation == "sequence_mean":
    return jnp.mean(masked_mean(loss_bt, mask_bt, axis=-1))
  if aggregation == "token_mean":
    return masked_mean(loss_bt, mask_bt)
  if aggregation == "fixed_length":
    length = max_len if max_len is not None else loss_bt.shape[-1]
    return masked_sum(loss_bt, mask_bt) / (loss_bt.shape[0] * length)
  raise ValueError(f"unknown loss aggregation {aggregation!r}; choose one of {AGGREGATIONS} "
                   f"(config.loss.aggregation)")


def _entropy_metric(logits_btv, mask_bt):
  return {} if logits_btv is None else {"entropy": masked_mean(token_entropy(logits_btv), mask_bt)}


def reinforce_loss(logp_bt: Array, mask_bt: Array, advantages_b: Array, *,
                   aggregation: str = "sequence_sum", max_len: Optional[int] = None,
                   logits_btv: Optional[Array] = None):
  """REINFORCE with the whole completion as one action: -A * log pi(y | x).

  Advantages are constants (stop_gradient). Returns (loss, metrics).
  """
  adv = jax.lax.stop_gradient(advantages_b.astype(jnp.float32))
  loss_bt = -adv[:, None] * logp_bt.astype(jnp.float32)
  metrics = {"policy_loss": aggregate(loss_bt, mask_bt, aggregation, max_len),
             "clip_fraction": jnp.zeros((), jnp.float32)}
  metrics.update(_entropy_metric(logits_btv, mask_bt))
  return metrics["policy_loss"], metrics


def ppo_clip_loss(logp_bt: Array, old_logp_bt: Array, mask_bt: Array, advantages_b: Array, *,
                  clip_eps: float = 0.2, clip_eps_high: Optional[float] = None,
                  ratio_level: str = "sequence", aggregation: str = "sequence_sum",
                  max_len: Optional[int] = None, logits_btv: Optional[Array] = None):
  """PPO's clipped surrogate, -min(r A, clip(r, 1 - eps, 1 + eps_high) A).

  ratio_level='sequence' (default, the paper's RLOO with the completion as one action): one ratio
  per sequence, r = exp(sum_t log pi - log pi_old), and the loss is averaged over sequences
  (`aggregation` is ignored). At r = 1 its gradient equals `reinforce_loss`'s. 'token': PPO's
  per-token ratio, reduced with `aggregation`; `advantages` may then be per token [B, T] (GAE). Returns (loss, metrics) with the fraction of
  clipped units and the approximate KL (k3) to the sampling policy.
  """
  eps_low = clip_eps
  eps_high = clip_eps if clip_eps_high is None else clip_eps_high
  adv = jax.lax.stop_gradient(advantages_b.astype(jnp.float32))
  if ratio_level == "sequence" and adv.ndim != 1:
    raise ValueError(f"a sequence-level ratio needs one advantage per sequence, got advantages of "
                     f"shape {tuple(adv.shape)}; use ratio_level='token' for per-token advantages")
  log_ratio_bt = jnp.where(mask_bt, logp_bt.astype(jnp.float32) - old_logp_bt.astype(jnp.float32),
                           0.0)
  approx_kl = masked_mean(jnp.exp(log_ratio_bt) - 1.0 - log_ratio_bt, mask_bt)
  if ratio_level == "sequence":
    # Clamp the log-ratio: a sequence ratio is a product over tokens and overflows easily.
    ratio = jnp.exp(jnp.clip(log_ratio_bt.sum(-1), -20.0, 20.0))
    unclipped = ratio * adv
    clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    loss = -jnp.mean(jnp.minimum(unclipped, clipped))
    clip_fraction = jnp.mean((clipped < unclipped).astype(jnp.float32))
  elif ratio_level == "token":
    # Per-sequence advantages [B] broadcast over tokens; PPO's GAE passes per-token ones [B, T].
    adv_bt = adv[:, None] if adv.ndim == 1 else adv
    ratio = jnp.exp(log_ratio_bt)
    unclipped = ratio * adv_bt
    clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv_bt
    loss = aggregate(-jnp.minimum(unclipped, clipped), mask_bt, aggregation, max_len)
    clip_fraction = masked_mean((clipped < unclipped).astype(jnp.float32), mask_bt)
  else:
    raise ValueError(f"unknown ratio_level {ratio_level!r}; choose 'sequence' or 'token' "
                     f"(config.loss.ratio_level)")
  metrics = {"policy_loss": loss, "clip_fraction": clip_fraction, "approx_kl": approx_kl}
  metrics.update(_entropy_metric(logits_btv, mask_bt))
  return loss, metrics


@dataclasses.dataclass(frozen=True)
class LossSpec:
  """The static (hashable) part of the policy loss, resolved from config.loss once."""
  type: str = "reinforce"
  clip_eps: float = 0.2
  clip_eps_high: Optional[float] = None
  ratio_level: str = "sequence"
  aggregation: str = "sequence_sum"

  @classmethod
  def from_config(cls, c) -> "LossSpec":
    return cls(c.type, float(c.clip_eps), float(c.clip_eps_high) or None, c.ratio_level,
               c.aggregation)


def policy_loss(spec: LossSpec, logp_bt: Array, old_logp_bt: Array, mask_bt: Array,
                advantages_b: Array, logits_btv: Optional[Array] = None):
  """The configured policy loss of one minibatch: (loss, metrics)."""
  t = mask_bt.shape[1]
  if spec.type == "reinforce":
    return reinforce_loss(logp_bt, mask_bt, advantages_b, aggregation=spec.aggregation,
                          max_len=t, logits_btv=logits_btv)
  if spec.type == "ppo_clip":
    return ppo_clip_loss(logp_bt, old_logp_bt, mask_bt, advantages_b, clip_eps=spec.clip_eps,
                         clip_eps_high=spec.clip_eps_high, ratio_level=spec.ratio_level,
                         aggregation=spec.aggregation, max_len=t, logits_btv=logits_btv)
  raise ValueError(f"unknown config.loss.type {spec.type!r}; choose one of {LOSS_TYPES}")

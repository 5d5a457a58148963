"""Pure loss functions: token log-probs, KL estimators, penalised rewards and policy losses.

Everything is computed in float32 whatever the dtype of the logits. Per-token arrays are
[batch, time] (`_bt`) with a boolean completion mask; per-sequence arrays are [batch] (`_b`).

Loss aggregation and its microbatch normaliser: `rloo_jax.reductions`. Off-policy weights, the
sampler-trainer gap's metrics and the GSPO / CISPO losses: `rloo_jax.offpolicy`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Union

import jax
import jax.numpy as jnp

from rloo_jax import offpolicy
# Re-exported: callers name them loss.X.
from rloo_jax.offpolicy import (IS_CORRECTIONS, is_weights, mismatch_metrics,  # noqa: F401
                               sequence_weights)
from rloo_jax.reductions import (AGGREGATIONS, Normalizer, aggregate,  # noqa: F401
                                 entropy_metric, masked_mean, masked_sum)
from rloo_jax.reductions import counts as _counts

Array = jax.Array

KL_ESTIMATORS = ("k1", "k2", "k3")
LOSS_TYPES = ("reinforce", "ppo_clip", "gspo", "cispo")
# The loss types linear in the log-probs: d loss / d logp does not depend on logp, so the head's
# gradient can be computed in the log-prob pass (`linear_coefficients`, `rloo_jax.head_loss`).
LINEAR_LOSS_TYPES = ("reinforce",)
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


def chunked_logprobs(logits_fn: Callable[..., Array], params, hidden_bte: Array, targets_bt: Array,
                     mask_bt: Optional[Array] = None, *, chunk_size: int,
                     with_entropy: bool = False):
  """`token_logprobs(logits_fn(params, hidden))` without a [B, T, V] array, forward or backward.

  `logits_fn(params, h_bce) -> [B, c, V]` (any dtype) is the model's head, e.g. its final norm
  and unembedding. T is cut into chunks of `chunk_size` (padded up to a multiple; the padding is
  dropped) and a scan computes one chunk's float32 logits at a time; `jax.checkpoint` makes the
  backward recompute them too instead of keeping every chunk's, so the peak is one chunk's
  [B, c, V]. Returns (logp_bt, entropy_bt), both float32 [B, T]: logp is zero where `mask_bt` is
  False; entropy (None unless `with_entropy`) is unmasked like `token_entropy`, and carries no
  gradient, being a metric.
  """
  if mask_bt is not None and mask_bt.shape != targets_bt.shape:
    raise ValueError(f"mask shape {tuple(mask_bt.shape)} does not match targets shape "
                     f"{tuple(targets_bt.shape)}")
  h_nbce, y_nbc, unchunk = position_chunks(hidden_bte, targets_bt.astype(jnp.int32), chunk_size)

  @jax.checkpoint
  def chunk(p, h_bce, y_bc):
    logits = logits_fn(p, h_bce).astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    logp = jnp.take_along_axis(logits, y_bc[..., None], -1)[..., 0] - lse
    if not with_entropy:
      return logp, None
    sg_logits, sg_lse = jax.lax.stop_gradient(logits), jax.lax.stop_gradient(lse)
    probs = jnp.exp(sg_logits - sg_lse[..., None])
    return logp, sg_lse - jnp.sum(probs * sg_logits, axis=-1)

  _, (logp_nbc, ent_nbc) = jax.lax.scan(lambda carry, xs: (carry, chunk(params, *xs)), None,
                                        (h_nbce, y_nbc))
  logp = unchunk(logp_nbc)
  if mask_bt is not None:
    logp = jnp.where(mask_bt, logp, 0.0)
  return logp, None if ent_nbc is None else unchunk(ent_nbc)


def position_chunks(hidden_bte: Array, x_bt: Array, chunk_size: int):
  """(hidden [n, B, c, E], x [n, B, c], unchunk): T cut into n chunks of c = min(chunk_size, T)
  positions, padded up to a multiple (zeros); `unchunk(v_nbc) -> [B, T]` drops the padding."""
  if hidden_bte.ndim != 3 or hidden_bte.shape[:2] != x_bt.shape:
    raise ValueError(f"hidden shape {tuple(hidden_bte.shape)} does not match targets shape "
                     f"{tuple(x_bt.shape)} (expected hidden [B, T, E] and targets [B, T])")
  if chunk_size < 1:
    raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
  b, t, e = hidden_bte.shape
  c = min(chunk_size, t)
  n = -(-t // c)
  pad = n * c - t
  h = jnp.pad(hidden_bte, ((0, 0), (0, pad), (0, 0)))
  x = jnp.pad(x_bt, ((0, 0), (0, pad)))
  # The chunk axis leads for the scan, and B stays first within each chunk: B is the axis a
  # mesh shards, so every chunk keeps the batch sharding and needs no resharding.
  unchunk = lambda v_nbc: v_nbc.swapaxes(0, 1).reshape(b, n * c)[:, :t]
  return h.reshape(b, n, c, e).swapaxes(0, 1), x.reshape(b, n, c).swapaxes(0, 1), unchunk


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


def reinforce_loss(logp_bt: Array, mask_bt: Array, advantages_b: Array, *,
                   aggregation: str = "sequence_sum", max_len: Optional[int] = None,
                   entropy_bt: Optional[Array] = None, normalizer: Optional[Normalizer] = None,
                   weights_bt: Optional[Array] = None):
  """REINFORCE with the whole completion as one action: -A * log pi(y | x).

  Advantages are constants (stop_gradient), as are the importance weights `weights_bt`
  (`is_weights`; None: 1) on each token's term. Returns (loss, metrics); `entropy_bt` (per-token
  entropies, e.g. from `token_entropy`) adds their masked mean as metrics['entropy']. With
  `normalizer`, the loss and metrics are shares to sum over microbatches (see `policy_loss`).
  """
  norm = _counts(mask_bt, max_len or mask_bt.shape[-1]) if normalizer is None else normalizer
  adv = jax.lax.stop_gradient(advantages_b.astype(jnp.float32))
  loss_bt = -adv[:, None] * logp_bt.astype(jnp.float32)
  if weights_bt is not None:
    loss_bt = jax.lax.stop_gradient(weights_bt) * loss_bt
  metrics = {"policy_loss": aggregate(loss_bt, mask_bt, aggregation, normalizer=norm),
             "clip_fraction": jnp.zeros((), jnp.float32)}
  metrics.update(entropy_metric(entropy_bt, mask_bt, norm))
  return metrics["policy_loss"], metrics


def ppo_clip_loss(logp_bt: Array, old_logp_bt: Array, mask_bt: Array, advantages_b: Array, *,
                  clip_eps: float = 0.2, clip_eps_high: Optional[float] = None,
                  ratio_level: str = "sequence", aggregation: str = "sequence_sum",
                  max_len: Optional[int] = None, entropy_bt: Optional[Array] = None,
                  normalizer: Optional[Normalizer] = None, weights_bt: Optional[Array] = None):
  """PPO's clipped surrogate, -min(r A, clip(r, 1 - eps, 1 + eps_high) A).

  ratio_level='sequence' (default, the paper's RLOO with the completion as one action): one ratio
  per sequence, r = exp(sum_t log pi - log pi_old), and the loss is averaged over sequences
  (`aggregation` is ignored). At r = 1 its gradient equals `reinforce_loss`'s. 'token': PPO's
  per-token ratio, reduced with `aggregation`; `advantages` may then be per token [B, T] (GAE).
  Returns (loss, metrics) with the fraction of clipped units (sequences, or tokens), the
  approximate KL (k3) to the sampling policy per token and, given `entropy_bt`, the mean entropy.
  With `normalizer`, the loss and metrics are shares to sum over microbatches (see `policy_loss`).
  `weights_bt`: importance weights (`is_weights`) on each unit's term, a sequence's the mean of
  its tokens'.
  """
  norm = _counts(mask_bt, max_len or mask_bt.shape[-1]) if normalizer is None else normalizer
  w_bt = 1.0 if weights_bt is None else jax.lax.stop_gradient(weights_bt)
  eps_low = clip_eps
  eps_high = clip_eps if clip_eps_high is None else clip_eps_high
  adv = jax.lax.stop_gradient(advantages_b.astype(jnp.float32))
  if ratio_level == "sequence" and adv.ndim != 1:
    raise ValueError(f"a sequence-level ratio needs one advantage per sequence, got advantages of "
                     f"shape {tuple(adv.shape)}; use ratio_level='token' for per-token advantages")
  log_ratio_bt = jnp.where(mask_bt, logp_bt.astype(jnp.float32) - old_logp_bt.astype(jnp.float32),
                           0.0)
  approx_kl = masked_sum(jnp.exp(log_ratio_bt) - 1.0 - log_ratio_bt, mask_bt) / norm.tokens
  if ratio_level == "sequence":
    # Clamp the log-ratio: a sequence ratio is a product over tokens and overflows easily.
    ratio = jnp.exp(jnp.clip(log_ratio_bt.sum(-1), -20.0, 20.0))
    unclipped = ratio * adv
    clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    w_b = 1.0 if weights_bt is None else sequence_weights(w_bt, mask_bt)
    loss = -jnp.sum(w_b * jnp.minimum(unclipped, clipped)) / norm.sequences
    clip_fraction = jnp.sum((clipped < unclipped).astype(jnp.float32)) / norm.sequences
  elif ratio_level == "token":
    # Per-sequence advantages [B] broadcast over tokens; PPO's GAE passes per-token ones [B, T].
    adv_bt = adv[:, None] if adv.ndim == 1 else adv
    ratio = jnp.exp(log_ratio_bt)
    unclipped = ratio * adv_bt
    clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv_bt
    loss = aggregate(-w_bt * jnp.minimum(unclipped, clipped), mask_bt, aggregation,
                     normalizer=norm)
    clip_fraction = masked_sum((clipped < unclipped).astype(jnp.float32), mask_bt) / norm.tokens
  else:
    raise ValueError(f"unknown ratio_level {ratio_level!r}; choose 'sequence' or 'token' "
                     f"(config.loss.ratio_level)")
  metrics = {"policy_loss": loss, "clip_fraction": clip_fraction, "approx_kl": approx_kl}
  metrics.update(entropy_metric(entropy_bt, mask_bt, norm))
  return loss, metrics


@dataclasses.dataclass(frozen=True)
class LossSpec:
  """The static (hashable) part of the policy loss, resolved from config.loss once.

  `max_len` is fixed_length's normaliser, the completion budget (config.rloo.max_new_tokens):
  set it when the completions' T varies between iterations (trimmed to the batch's longest), or
  Dr. GRPO's normaliser would vary with it. None: the mask's T.
  """
  type: str = "reinforce"
  clip_eps: float = 0.2
  clip_eps_high: Optional[float] = None
  ratio_level: str = "sequence"
  aggregation: str = "sequence_sum"
  max_len: Optional[int] = None
  # `is_weights`: the correction of the sampler-trainer gap, its cap and (icepop) lower bound.
  is_correction: str = "none"
  is_cap: float = 2.0
  is_low: float = 0.5

  def __post_init__(self):
    if self.max_len is not None and self.max_len < 1:
      raise ValueError(f"LossSpec.max_len must be >= 1 (or None), got {self.max_len}")

  @classmethod
  def from_config(cls, c, max_len: Optional[int] = None) -> "LossSpec":
    return cls(c.type, float(c.clip_eps), float(c.clip_eps_high) or None, c.ratio_level,
               c.aggregation, None if max_len is None else int(max_len),
               getattr(c, "is_correction", "none"), float(getattr(c, "is_cap", 2.0)),
               float(getattr(c, "is_low", 0.5)))


def normalizer(spec_or_aggregation: Union[LossSpec, str], mask_bt: Array,
               max_len: Optional[int] = None) -> Normalizer:
  """The counts of a whole minibatch, to pass as `normalizer=` to each of its microbatches.

  `mask_bt` is the minibatch's loss mask [B, T]. fixed_length's length is `max_len`, else the
  spec's max_len, else the mask's T: the same choice `policy_loss` makes without a normaliser.
  """
  spec = spec_or_aggregation
  aggregation = spec.aggregation if isinstance(spec, LossSpec) else spec
  if aggregation not in AGGREGATIONS:
    raise ValueError(f"unknown loss aggregation {aggregation!r}; choose one of {AGGREGATIONS} "
                     f"(config.loss.aggregation)")
  if max_len is None and isinstance(spec, LossSpec):
    max_len = spec.max_len
  return _counts(mask_bt, mask_bt.shape[-1] if max_len is None else max_len)


def policy_loss(spec: LossSpec, logp_bt: Array, old_logp_bt: Array, mask_bt: Array,
                advantages_b: Array, entropy_bt: Optional[Array] = None, *,
                normalizer: Optional[Normalizer] = None, sampler_logp_bt: Optional[Array] = None):
  """The configured policy loss of one minibatch, or microbatch: (loss, metrics).

  `entropy_bt`: per-token entropies [B, T] (`token_entropy`, or `chunked_logprobs(...,
  with_entropy=True)`) for metrics['entropy']; None leaves it out.

  Gradient accumulation over microbatches of a minibatch: compute `norm = normalizer(spec,
  minibatch_mask)` once and call this on each microbatch with `normalizer=norm`. The loss and
  every metric (policy_loss, clip_fraction, approx_kl, entropy) then come back as that
  microbatch's contribution: sum losses, gradients and metrics over the microbatches and they
  equal the whole minibatch's (to float rounding) in every aggregation, loss type and ratio
  level; don't average them. Without `normalizer`, each is the batch's own (today's) value.

  The sampler's log-probs are the correction's behaviour policy and one side of the gap the
  mismatch metrics measure: `old_logp_bt`, the trainer's current `logp_bt` the other side; or,
  given `sampler_logp_bt` (config.loss.old_logprobs='recompute'), those, and `old_logp_bt` the
  trainer's own log-probs of the policy that sampled, which the ratio losses divide by.
  """
  t = spec.max_len if spec.max_len is not None else mask_bt.shape[1]
  norm = _counts(mask_bt, t) if normalizer is None else normalizer
  trainer_bt, behaviour_bt = ((logp_bt, old_logp_bt) if sampler_logp_bt is None
                              else (old_logp_bt, sampler_logp_bt))
  weights, cut = is_weights(trainer_bt, behaviour_bt, mask_bt, spec.is_correction, spec.is_cap,
                            spec.is_low)
  mismatch = mismatch_metrics(trainer_bt, behaviour_bt, mask_bt, cut, norm)
  weights_bt = None if spec.is_correction == "none" else weights
  if spec.type == "reinforce":
    value, metrics = reinforce_loss(
        logp_bt, mask_bt, advantages_b, aggregation=spec.aggregation, max_len=t,
        entropy_bt=entropy_bt, normalizer=norm, weights_bt=weights_bt)
  elif spec.type == "ppo_clip":
    value, metrics = ppo_clip_loss(
        logp_bt, old_logp_bt, mask_bt, advantages_b, clip_eps=spec.clip_eps,
        clip_eps_high=spec.clip_eps_high, ratio_level=spec.ratio_level,
        aggregation=spec.aggregation, max_len=t, entropy_bt=entropy_bt, normalizer=norm,
        weights_bt=weights_bt)
  elif spec.type == "gspo":
    value, metrics = offpolicy.gspo_loss(
        logp_bt, old_logp_bt, mask_bt, advantages_b, clip_eps=spec.clip_eps,
        clip_eps_high=spec.clip_eps_high, entropy_bt=entropy_bt, normalizer=norm,
        weights_bt=weights_bt)
  elif spec.type == "cispo":
    value, metrics = offpolicy.cispo_loss(
        logp_bt, old_logp_bt, mask_bt, advantages_b, clip_eps=spec.clip_eps,
        clip_eps_high=spec.clip_eps_high, aggregation=spec.aggregation, max_len=t,
        entropy_bt=entropy_bt, normalizer=norm, weights_bt=weights_bt)
  else:
    raise ValueError(f"unknown config.loss.type {spec.type!r}; choose one of {LOSS_TYPES}")
  return value, {**metrics, **mismatch}


def linear_coefficients(spec: LossSpec, mask_bt: Array, advantages_b: Array, *,
                        normalizer: Optional[Normalizer] = None) -> Array:
  """c [B, T] float32 with policy_loss(spec, logp, ...) == sum(c * logp) for every logp, for a
  loss type in LINEAR_LOSS_TYPES: the loss's gradient in logp, taken at zero (it is constant)."""
  if spec.type not in LINEAR_LOSS_TYPES:
    raise ValueError(f"config.loss.type {spec.type!r} is not linear in the log-probs (linear: "
                     f"{LINEAR_LOSS_TYPES}); its gradient needs the two-pass "
                     "loss.chunked_logprobs")
  if spec.is_correction != "none":
    raise ValueError(f"config.loss.is_correction={spec.is_correction!r} weighs each term by "
                     "the trainer's log-probs, so the loss is not linear in them; its gradient "
                     "needs the two-pass loss.chunked_logprobs")
  zeros = jnp.zeros(mask_bt.shape, jnp.float32)
  return jax.grad(lambda lp: policy_loss(spec, lp, zeros, mask_bt, advantages_b,
                                         normalizer=normalizer)[0])(zeros)

"""Off-policy corrections and the 2025-26 losses: importance weights for the gap between the
sampler's log-probs and the trainer's (`is_weights`, config.loss.is_correction), that gap's
metrics (`mismatch_metrics`), and GSPO and CISPO (`loss.policy_loss` dispatches to them).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from rloo_jax.reductions import Normalizer, aggregate, counts, entropy_metric, masked_sum

Array = jax.Array

# Corrections of the gap between the sampler's log-probs and the trainer's (`is_weights`).
IS_CORRECTIONS = ("none", "tis", "seq_tis", "seq_mask", "icepop")
# What the ratio losses divide by (config.loss.old_logprobs): the sampler's log-probs, or the
# trainer's recomputation of them before the update (the sampler's then the correction's).
OLD_LOGPROBS = ("sampler", "recompute")


def check_config(config) -> None:
  """config.loss.is_correction's settings, before anything compiles."""
  correction = config.loss.get("is_correction", "none")
  if correction not in IS_CORRECTIONS:
    raise ValueError(f"unknown config.loss.is_correction {correction!r}; choose one of "
                     f"{IS_CORRECTIONS}")
  old = config.loss.get("old_logprobs", "sampler")
  if old not in OLD_LOGPROBS:
    raise ValueError(f"unknown config.loss.old_logprobs {old!r}; choose one of {OLD_LOGPROBS}")
  if old == "recompute" and config.get("algorithm", "rloo") != "rloo":
    raise ValueError(f"config.loss.old_logprobs='recompute' applies to RLOO's losses; "
                     f"config.algorithm={config.algorithm!r}: set old_logprobs='sampler'")
  if old == "recompute" and config.loss.type == "reinforce":
    raise ValueError("config.loss.old_logprobs='recompute' gives a ratio loss its old policy; "
                     "loss.type='reinforce' has no ratio (its correction weighs the current "
                     "policy against the sampler): set old_logprobs='sampler'")
  if correction == "none":
    return
  cap, low = float(config.loss.get("is_cap", 2.0)), float(config.loss.get("is_low", 0.5))
  if config.loss.type != "reinforce" and old != "recompute":
    raise ValueError(f"config.loss.is_correction with loss.type={config.loss.type!r} needs "
                     "config.loss.old_logprobs='recompute': its ratio divides by the sampler's "
                     "probabilities already, so the correction needs the trainer's own as the "
                     "old policy (or set is_correction='none')")
  if not 0.0 <= low < 1.0 < cap:
    raise ValueError(f"config.loss.is_cap={cap} and is_low={low}: the band must hold 1 "
                     "(0 <= is_low < 1 < is_cap)")


def is_weights(logp_bt: Array, sampler_logp_bt: Array, mask_bt: Array, correction: str,
               cap: float = 2.0, low: float = 0.5):
  """Importance weights [B, T] (no gradient) correcting for samples drawn by the sampler, whose
  log-probs (`sampler_logp_bt`, recorded at sampling) differ from the trainer's (`logp_bt`: other
  numerics, kernels or a staler policy), and whether each unit was truncated or masked:

  - 'none': 1.
  - 'tis': token-level truncated IS, min(rho_t, cap), rho_t = pi_trainer / pi_sampler.
  - 'seq_tis': the sequence's ratio prod_t rho_t, truncated at cap, on every token.
  - 'seq_mask': the sequence's ratio, or 0 for a sequence whose ratio exceeds cap.
  - 'icepop': rho_t on tokens with low <= rho_t <= cap, 0 on the others.
  Masked-out positions get weight 0 and count as neither."""
  f32 = jnp.float32
  log_rho = jnp.where(mask_bt, jax.lax.stop_gradient(logp_bt.astype(f32))
                      - sampler_logp_bt.astype(f32), 0.0)
  if correction == "none":
    return mask_bt.astype(f32), jnp.zeros(mask_bt.shape, bool)
  if correction in ("tis", "icepop"):
    rho = jnp.exp(log_rho)
    cut = (rho > cap) | ((rho < low) if correction == "icepop" else False)
    w = jnp.where(cut, cap if correction == "tis" else 0.0, rho)
    return jnp.where(mask_bt, w, 0.0), cut & mask_bt
  if correction in ("seq_tis", "seq_mask"):
    # Clamped in log space: a product over thousands of tokens overflows float32.
    rho_b = jnp.exp(jnp.minimum(log_rho.sum(-1), 30.0))
    cut_b = rho_b > cap
    w_b = jnp.where(cut_b, cap if correction == "seq_tis" else 0.0, rho_b)
    return jnp.where(mask_bt, w_b[:, None], 0.0), cut_b[:, None] & mask_bt
  raise ValueError(f"unknown config.loss.is_correction {correction!r}; choose one of "
                   f"{IS_CORRECTIONS}")


def sequence_weights(weights_bt: Array, mask_bt: Array) -> Array:
  """[B]: the mean of each sequence's token weights (no gradient), the weight of a loss term
  taken per sequence; equal to them for the sequence-level corrections."""
  w = jax.lax.stop_gradient(jnp.asarray(weights_bt, jnp.float32))
  return (jnp.sum(jnp.where(mask_bt, w, 0.0), -1)
          / jnp.maximum(jnp.sum(mask_bt, -1), 1).astype(jnp.float32))


def mismatch_metrics(logp_bt: Array, sampler_logp_bt: Array, mask_bt: Array, cut_bt: Array,
                     norm: Normalizer) -> dict:
  """The sampler-trainer gap of this batch's tokens (shares over microbatches, as the losses;
  '_max' metrics combine by maximum): mean and max |log p_sampler - log p_trainer| a token, the
  sequence-level KL(sampler || trainer) estimate (mean over sequences of sum_t log p_s - log p_t),
  and the fractions of tokens and sequences a correction truncated or masked."""
  f32 = jnp.float32
  diff = jnp.where(mask_bt, sampler_logp_bt.astype(f32)
                   - jax.lax.stop_gradient(logp_bt.astype(f32)), 0.0)
  return {"mismatch/logp_abs_diff": jnp.sum(jnp.abs(diff)) / norm.tokens,
          "mismatch/logp_abs_diff_max": jnp.max(jnp.abs(diff), initial=0.0),
          "mismatch/kl_sampler_trainer": jnp.sum(diff) / norm.sequences,
          "mismatch/corrected_tokens": masked_sum(cut_bt.astype(f32), mask_bt) / norm.tokens,
          "mismatch/corrected_sequences": jnp.sum(jnp.any(cut_bt, -1).astype(f32))
                                          / norm.sequences}


def gspo_loss(logp_bt: Array, old_logp_bt: Array, mask_bt: Array, advantages_b: Array, *,
              clip_eps: float, clip_eps_high: Optional[float] = None,
              entropy_bt: Optional[Array] = None, normalizer: Optional[Normalizer] = None,
              weights_bt: Optional[Array] = None):
  """GSPO (Zheng et al., 2025): PPO's clipped surrogate on the length-normalised sequence ratio
  s = (pi(y) / pi_old(y)) ** (1 / |y|), -mean_b min(s A, clip(s, 1 - eps, 1 + eps_high) A); the
  gradient flows through s. Its clip range is small (the paper's eps: 3e-4 / 4e-4).
  Returns (loss, metrics) as `ppo_clip_loss`; `weights_bt` as its sequence level."""
  norm = counts(mask_bt, mask_bt.shape[-1]) if normalizer is None else normalizer
  eps_high = clip_eps if clip_eps_high is None else clip_eps_high
  adv = jax.lax.stop_gradient(advantages_b.astype(jnp.float32))
  log_ratio_bt = jnp.where(mask_bt, logp_bt.astype(jnp.float32) - old_logp_bt.astype(jnp.float32),
                           0.0)
  length_b = jnp.maximum(jnp.sum(mask_bt, -1), 1).astype(jnp.float32)
  s_b = jnp.exp(jnp.clip(log_ratio_bt.sum(-1) / length_b, -20.0, 20.0))
  unclipped, clipped = s_b * adv, jnp.clip(s_b, 1.0 - clip_eps, 1.0 + eps_high) * adv
  w_b = 1.0 if weights_bt is None else sequence_weights(weights_bt, mask_bt)
  loss = -jnp.sum(w_b * jnp.minimum(unclipped, clipped)) / norm.sequences
  metrics = {"policy_loss": loss,
             "clip_fraction": jnp.sum((clipped < unclipped).astype(jnp.float32)) / norm.sequences,
             "approx_kl": masked_sum(jnp.exp(log_ratio_bt) - 1.0 - log_ratio_bt, mask_bt)
                          / norm.tokens}
  metrics.update(entropy_metric(entropy_bt, mask_bt, norm))
  return loss, metrics


def cispo_loss(logp_bt: Array, old_logp_bt: Array, mask_bt: Array, advantages_b: Array, *,
               clip_eps: float, clip_eps_high: Optional[float] = None,
               aggregation: str = "token_mean", max_len: Optional[int] = None,
               entropy_bt: Optional[Array] = None, normalizer: Optional[Normalizer] = None,
               weights_bt: Optional[Array] = None):
  """CISPO (MiniMax-M1, 2025): REINFORCE with each token's importance weight clipped and held
  constant, -sg(clip(r_t, 1 - eps, 1 + eps_high)) A log pi(y_t), reduced with `aggregation`: no
  token loses its gradient, as PPO's clip drops it. Returns (loss, metrics), clip_fraction the
  fraction of tokens whose weight was clipped; `weights_bt` (`is_weights`) multiply it."""
  norm = counts(mask_bt, max_len or mask_bt.shape[-1]) if normalizer is None else normalizer
  eps_high = clip_eps if clip_eps_high is None else clip_eps_high
  adv = jax.lax.stop_gradient(advantages_b.astype(jnp.float32))
  logp = logp_bt.astype(jnp.float32)
  log_ratio_bt = jnp.where(mask_bt, jax.lax.stop_gradient(logp) - old_logp_bt.astype(jnp.float32),
                           0.0)
  ratio = jnp.exp(log_ratio_bt)
  weight = jnp.clip(ratio, 1.0 - clip_eps, 1.0 + eps_high)
  held = weight if weights_bt is None else weight * jax.lax.stop_gradient(weights_bt)
  loss = aggregate(-held * adv[:, None] * logp, mask_bt, aggregation, normalizer=norm)
  metrics = {"policy_loss": loss,
             "clip_fraction": masked_sum((weight != ratio).astype(jnp.float32), mask_bt)
                              / norm.tokens,
             "approx_kl": masked_sum(ratio - 1.0 - log_ratio_bt, mask_bt) / norm.tokens}
  metrics.update(entropy_metric(entropy_bt, mask_bt, norm))
  return loss, metrics

"""PPO's pure math: per-token rewards, GAE, whitening and the clipped value loss (float32)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rloo_jax import loss


def token_rewards(rewards_n, kl_nt, mask_nt, *, beta: float):
  """PPO's per-token reward [N, T]: -beta * KL_t everywhere, plus the sequence reward at the last
  completion token (the eos, or the last token of a completion cut at max_new_tokens)."""
  mask = mask_nt.astype(bool)
  length_n = mask.sum(-1)
  last_nt = jax.nn.one_hot(jnp.maximum(length_n - 1, 0), mask.shape[1], dtype=jnp.float32)
  last_nt = last_nt * (length_n > 0)[:, None]
  r = -beta * kl_nt.astype(jnp.float32) + rewards_n.astype(jnp.float32)[:, None] * last_nt
  return jnp.where(mask, r, 0.0)


def gae(rewards_nt, values_nt, mask_nt, *, gamma: float, lam: float):
  """Generalised advantage estimation over each completion; (advantages, returns), both [N, T].

  The value after the last completion token is 0 (the episode ends); the mask is a prefix.
  """
  mask = mask_nt.astype(jnp.float32)
  values = values_nt.astype(jnp.float32) * mask
  next_values = jnp.concatenate([values[:, 1:], jnp.zeros_like(values[:, :1])], axis=1)
  deltas = (rewards_nt.astype(jnp.float32) + gamma * next_values - values) * mask

  def step(carry_n, x):
    delta_n, m_n = x
    a = (delta_n + gamma * lam * carry_n) * m_n
    return a, a

  _, adv_tn = jax.lax.scan(step, jnp.zeros(values.shape[0], jnp.float32),
                           (deltas.T, mask.T), reverse=True)
  adv = adv_tn.T
  return adv, (adv + values) * mask


def whiten(x_nt, mask_nt):
  mean = loss.masked_mean(x_nt, mask_nt)
  var = loss.masked_mean((x_nt - mean) ** 2, mask_nt)
  return jnp.where(mask_nt, (x_nt - mean) * jax.lax.rsqrt(var + 1e-8), 0.0)


def value_loss(values_nt, old_values_nt, returns_nt, mask_nt, *, clip: float):
  """0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2), masked token mean.

  Returns (loss, metrics with the fraction of tokens where the clipped term was the larger)."""
  v = values_nt.astype(jnp.float32)
  err = (v - returns_nt) ** 2
  if clip > 0:
    v_clipped = old_values_nt + jnp.clip(v - old_values_nt, -clip, clip)
    err_clipped = (v_clipped - returns_nt) ** 2
    per_token = 0.5 * jnp.maximum(err, err_clipped)
    frac = loss.masked_mean((err_clipped > err).astype(jnp.float32), mask_nt)
  else:
    per_token = 0.5 * err
    frac = jnp.zeros((), jnp.float32)
  value = loss.masked_mean(per_token, mask_nt)
  return value, {"value_loss": value, "value_clip_fraction": frac}

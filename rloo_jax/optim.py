"""The optimizer recipe shared by every stage that trains (RL, SFT, reward models, DPO, critic).

AdamW after global-norm clipping, with a linear warm-up into a constant or cosine schedule. One
recipe in one place, so the stages cannot drift apart and no stage imports another to reach it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_collections
import optax

SCHEDULES = ("constant", "cosine")


class NonFiniteError(FloatingPointError):
  """Training produced non-finite losses, gradients or parameters, past the configured limit."""


def make_optimizer(c: ml_collections.ConfigDict, total_steps: int) -> optax.GradientTransformation:
  """`c` holds learning_rate, warmup_steps, schedule, weight_decay, b1, b2 and max_grad_norm
  (config.optim, or a stage's own section); `total_steps` sizes the cosine decay. Equal settings
  give the same object, so the programs that take it are shared (`platform.jit`)."""
  if c.schedule not in SCHEDULES:
    raise ValueError(f"unknown schedule {c.schedule!r}; choose one of {SCHEDULES} "
                     "(config.optim.schedule)")
  return _optimizer(c.schedule, float(c.learning_rate), max(int(c.warmup_steps), 0),
                    int(total_steps), float(c.weight_decay), float(c.b1), float(c.b2),
                    float(c.max_grad_norm))


@functools.lru_cache(maxsize=64)
def _optimizer(schedule: str, learning_rate: float, warmup: int, total_steps: int,
               weight_decay: float, b1: float, b2: float, max_grad_norm: float):
  if schedule == "constant":
    after = optax.constant_schedule(learning_rate)
  else:
    after = optax.cosine_decay_schedule(learning_rate, max(total_steps - warmup, 1))
  lr = optax.join_schedules(
      [optax.linear_schedule(0.0, learning_rate, max(warmup, 1)), after], [warmup]) \
      if warmup else after
  return optax.chain(
      clip_by_global_norm(max_grad_norm) if max_grad_norm > 0 else optax.identity(),
      optax.adamw(lr, b1=b1, b2=b2, weight_decay=weight_decay))


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
  """optax.clip_by_global_norm's function (and its EmptyState, so checkpoints are unchanged),
  written as one multiply by a scalar, which XLA fuses into each consumer (Adam's moment
  updates). optax's `where(norm < max, g, g / norm * max)` form left a gradient-sized
  temporary, a whole extra copy of the gradients at the update's peak."""
  def update(updates, state, params=None):
    del params
    norm = optax.tree.norm(updates)
    scale = jnp.minimum(1.0, max_norm / jnp.maximum(norm, jnp.finfo(jnp.float32).tiny))
    return jax.tree.map(lambda g: g * scale.astype(g.dtype), updates), state
  return optax.GradientTransformation(optax.init_empty_state, update)


def with_learning_rate(c: ml_collections.ConfigDict, learning_rate: float
                       ) -> ml_collections.ConfigDict:
  """A copy of the optimizer section with another learning rate (0 keeps the original)."""
  out = ml_collections.ConfigDict(c.to_dict())
  if learning_rate:
    out.learning_rate = float(learning_rate)
  return out


def apply_if_finite(tx: optax.GradientTransformation, grads, opt_state, params, loss):
  """One optimizer update, skipped when the loss or the gradient is not finite.

  Returns (params, opt_state, metrics): on a non-finite step the params and the optimizer state
  come back unchanged (Adam's moments are not poisoned) and `nonfinite_steps` is 1. Every train
  step (RL, PPO, DPO, SFT, reward model) goes through here, so the loop's guard sees one count.
  Checked on the loss too, not only the gradient as `optax.apply_if_finite` does: a NaN reward
  reaches the loss through the advantages even where a masked gradient stays finite.
  """
  grad_norm = optax.tree.norm(grads)
  ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

  updates, new_opt_state = tx.update(grads, opt_state, params)
  new_params = optax.apply_updates(params, updates)
  # A select per leaf, not a cond: each select fuses into its leaf's update, so the donated state
  # is rewritten in place. The TPU and GPU compilers copy the whole state into a cond's branches
  # (docs/SCALE.md: the optimizer program's temporaries).
  keep = lambda new, old: jnp.where(ok, new, old)
  params, opt_state = jax.tree.map(keep, (new_params, new_opt_state), (params, opt_state))
  metrics = dict(grad_norm=grad_norm, nonfinite_steps=(~ok).astype(jnp.float32))
  return params, opt_state, metrics

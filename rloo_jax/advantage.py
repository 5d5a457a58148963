"""Advantage estimators: pure functions over a [num_prompts, k] grid of rewards.

Every estimator takes `rewards_bk` (one row per prompt, one column per sampled completion) and an
optional boolean `mask_bk` marking usable samples (False for completions a reward function could not
score). Masked samples get advantage 0 and never enter another sample's baseline; a group with fewer
usable samples than the estimator needs gets all zeros, so no NaN ever leaves a degenerate group.

Estimators are registered by name; configs are validated against `names()`, never a copied list:

    >>> import jax.numpy as jnp
    >>> from rloo_jax import advantage
    >>> advantage.get("rloo")(jnp.array([[0.8, 0.5, 0.6, 0.7]]))[0, 0]  # 0.8 - mean(0.5, 0.6, 0.7)
    Array(0.2, dtype=float32)

Non-finite rewards cannot raise inside a compiled function, so `prepare_rewards` validates concrete
rewards on the host first (raise, or mask and count) and the estimators treat any non-finite value
that still reaches them as masked.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import chex
import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class EstimatorSpec:
  """A registered estimator and what the trainer needs to know to drive it."""

  name: str
  fn: Callable[..., Any]
  min_k: int  # smallest group size the estimator is defined for
  stateful: bool = False  # True: fn(..., state=s) returns (advantages, new_state)
  init_state: Optional[Callable[[], Any]] = None
  doc: str = ""
  # Compares the k samples of a prompt: identical samples (greedy decoding) give zero advantage,
  # or for RAFT a best-of-k among copies, so validation refuses temperature 0 with k >= 2.
  compares_samples: bool = False


_REGISTRY: dict[str, EstimatorSpec] = {}


def register(name: str, *, min_k: int = 1, stateful: bool = False,
             init_state: Optional[Callable[[], Any]] = None, compares_samples: bool = False):
  """Decorator registering an estimator under `name`."""

  def wrap(fn):
    if name in _REGISTRY:
      raise ValueError(f"advantage estimator {name!r} is already registered")
    _REGISTRY[name] = EstimatorSpec(name, fn, min_k, stateful, init_state,
                                    (fn.__doc__ or "").strip().split("\n")[0], compares_samples)
    return fn

  return wrap


def names() -> tuple[str, ...]:
  return tuple(sorted(_REGISTRY))


def spec(name: str) -> EstimatorSpec:
  if name not in _REGISTRY:
    raise ValueError(f"unknown advantage estimator {name!r}; registered estimators are "
                     f"{list(names())} (set config.advantage.estimator to one of them)")
  return _REGISTRY[name]


def get(name: str) -> Callable[..., Any]:
  """The estimator `f(rewards, mask=None, **options)` registered under `name`."""
  return spec(name).fn


# ----------------------------------------------------------------------------------------------
# Input checks. Shapes are static, so they raise at trace time; values only when concrete.


def _check_shapes(name: str, rewards_bk: Array, mask_bk: Optional[Array], min_k: int):
  if rewards_bk.ndim != 2:
    raise ValueError(f"{name}: rewards must have shape [num_prompts, k], got shape "
                     f"{tuple(rewards_bk.shape)}; reshape flat rewards with .reshape(-1, k)")
  k = rewards_bk.shape[1]
  if k < min_k:
    raise ValueError(f"{name}: k = {k} samples per prompt, but {name} needs k >= {min_k} "
                     f"(a leave-one-out or group baseline is undefined for a single sample); "
                     f"set config.rloo.k >= {min_k}")
  if mask_bk is not None and tuple(mask_bk.shape) != tuple(rewards_bk.shape):
    raise ValueError(f"{name}: mask shape {tuple(mask_bk.shape)} does not match rewards shape "
                     f"{tuple(rewards_bk.shape)}")


def _is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def _usable(name: str, rewards_bk: Array, mask_bk: Optional[Array], check_finite: bool):
  """float32 rewards with non-finite and masked entries zeroed, and the usable mask."""
  rewards_bk = jnp.asarray(rewards_bk)
  if mask_bk is not None:
    mask_bk = jnp.asarray(mask_bk, dtype=bool)
  if check_finite and _is_concrete(rewards_bk):
    considered = np.ones(rewards_bk.shape, bool) if mask_bk is None else np.asarray(mask_bk)
    bad = int(np.sum(~np.isfinite(np.asarray(rewards_bk, np.float64)) & considered))
    if bad:
      raise ValueError(f"{name}: {bad} reward(s) are NaN or inf. Fix the reward function, or "
                       f"pass them through advantage.prepare_rewards(..., nan_policy='mask') "
                       f"(config.rewards.nan_policy='mask') to mask and count them")
  rewards_bk = rewards_bk.astype(jnp.float32)
  finite = jnp.isfinite(rewards_bk)
  usable = finite if mask_bk is None else finite & mask_bk
  return jnp.where(usable, rewards_bk, 0.0), usable


def prepare_rewards(rewards_bk, mask_bk=None, nan_policy: str = "raise"):
  """Host-side validation of concrete rewards before they enter compiled code.

  Returns (rewards float32 with non-finite entries zeroed, usable mask, number masked for being
  non-finite). `nan_policy='raise'` raises a ValueError naming the count; 'mask' masks them.
  """
  if nan_policy not in ("raise", "mask"):
    raise ValueError(f"nan_policy must be 'raise' or 'mask', got {nan_policy!r}")
  rewards = np.asarray(rewards_bk, dtype=np.float64)
  if rewards.ndim != 2:
    raise ValueError(f"rewards must have shape [num_prompts, k], got {rewards.shape}")
  mask = np.ones(rewards.shape, bool) if mask_bk is None else np.asarray(mask_bk, bool)
  if mask.shape != rewards.shape:
    raise ValueError(f"mask shape {mask.shape} does not match rewards shape {rewards.shape}")
  bad = ~np.isfinite(rewards) & mask
  num_bad = int(bad.sum())
  if num_bad and nan_policy == "raise":
    raise ValueError(f"{num_bad} reward(s) are NaN or inf; set config.rewards.nan_policy='mask' "
                     f"to mask them out of the baselines instead")
  usable = mask & np.isfinite(rewards)
  return (np.where(usable, rewards, 0.0).astype(np.float32), usable, num_bad)


# ----------------------------------------------------------------------------------------------
# Estimators.


@register("rloo", min_k=2, compares_samples=True)
def rloo(rewards_bk, mask_bk=None, *, check_finite: bool = True) -> Array:
  """REINFORCE Leave-One-Out: A_i = R_i - mean of the other usable rewards of the same prompt."""
  _check_shapes("rloo", rewards_bk, mask_bk, 2)
  r, usable = _usable("rloo", rewards_bk, mask_bk, check_finite)
  n = usable.sum(axis=1, keepdims=True).astype(jnp.float32)
  total = r.sum(axis=1, keepdims=True)
  # The where() guards the division itself: a 0/0 would poison gradients even if masked later.
  ok = usable & (n >= 2)
  baseline = jnp.where(ok, (total - r) / jnp.where(n >= 2, n - 1.0, 1.0), 0.0)
  return jnp.where(ok, r - baseline, 0.0)


@register("grpo", min_k=2, compares_samples=True)
def grpo(rewards_bk, mask_bk=None, *, eps: float = 1e-4, scale: bool = True, ddof: int = 0,
         check_finite: bool = True) -> Array:
  """GRPO: (R - group mean) / (group std + eps); `scale=False` is Dr. GRPO's unscaled variant."""
  _check_shapes("grpo", rewards_bk, mask_bk, 2)
  r, usable = _usable("grpo", rewards_bk, mask_bk, check_finite)
  n = usable.sum(axis=1, keepdims=True).astype(jnp.float32)
  ok = usable & (n >= 2)
  mean = r.sum(axis=1, keepdims=True) / jnp.maximum(n, 1.0)
  centred = jnp.where(usable, r - mean, 0.0)
  if scale:
    var = (centred**2).sum(axis=1, keepdims=True) / jnp.maximum(n - ddof, 1.0)
    centred = centred / (jnp.sqrt(var) + eps)
  return jnp.where(ok, centred, 0.0)


@register("vanilla", min_k=1)
def vanilla(rewards_bk, mask_bk=None, *, check_finite: bool = True) -> Array:
  """Vanilla policy gradient: the reward itself, no baseline."""
  _check_shapes("vanilla", rewards_bk, mask_bk, 1)
  r, _ = _usable("vanilla", rewards_bk, mask_bk, check_finite)
  return r


@chex.dataclass(frozen=True)
class EmaState:
  ema: Array  # float32 scalar, bias-uncorrected running mean of rewards
  count: Array  # int32 scalar, number of updates so far


def ema_init() -> EmaState:
  return EmaState(ema=jnp.zeros((), jnp.float32), count=jnp.zeros((), jnp.int32))


@register("reinforce_ema", min_k=1, stateful=True, init_state=ema_init)
def reinforce_ema(rewards_bk, mask_bk=None, *, state: EmaState, decay: float = 0.9,
                  check_finite: bool = True) -> tuple[Array, EmaState]:
  """REINFORCE with a moving-average baseline; returns (advantages, new_state).

  The baseline is the bias-corrected EMA of past batches' mean reward (0 before the first
  update), so a batch never enters its own baseline.
  """
  _check_shapes("reinforce_ema", rewards_bk, mask_bk, 1)
  if not 0.0 <= decay < 1.0:
    raise ValueError(f"reinforce_ema: decay must be in [0, 1), got {decay}")
  r, usable = _usable("reinforce_ema", rewards_bk, mask_bk, check_finite)
  correction = 1.0 - decay**state.count.astype(jnp.float32)
  baseline = jnp.where(state.count > 0, state.ema / jnp.where(correction > 0, correction, 1.0),
                       0.0)
  advantages = jnp.where(usable, r - baseline, 0.0)
  n = usable.sum()
  batch_mean = r.sum() / jnp.maximum(n, 1).astype(jnp.float32)
  # An all-masked batch carries no information about the reward level: keep the state.
  new_state = EmaState(
      ema=jnp.where(n > 0, decay * state.ema + (1.0 - decay) * batch_mean, state.ema),
      count=state.count + (n > 0).astype(jnp.int32))
  return advantages, new_state


@register("raft", min_k=1, compares_samples=True)
def raft(rewards_bk, mask_bk=None, *, check_finite: bool = True) -> Array:
  """RAFT best-of-k: weight 1 on the highest-reward usable sample of each prompt, 0 elsewhere.

  The weights make the policy loss a supervised (SFT) loss on the selected completions.
  """
  _check_shapes("raft", rewards_bk, mask_bk, 1)
  r, usable = _usable("raft", rewards_bk, mask_bk, check_finite)
  k = r.shape[1]
  best = jnp.argmax(jnp.where(usable, r, -jnp.inf), axis=1)  # first index wins ties
  onehot = jax.nn.one_hot(best, k, dtype=jnp.float32)
  return jnp.where(usable.any(axis=1, keepdims=True), onehot, 0.0)


def call(name: str, rewards_bk, mask_bk=None, *, state=None, **options):
  """Uniform entry point for trainers: returns (advantages_bk, new_state or None)."""
  s = spec(name)
  if s.stateful:
    if state is None:
      state = s.init_state()
    return s.fn(rewards_bk, mask_bk, state=state, **options)
  return s.fn(rewards_bk, mask_bk, **options), state

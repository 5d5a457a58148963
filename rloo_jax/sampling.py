"""Sampling methods: greedy, temperature, top-k, top-p.

Each method is a frozen dataclass, so it is hashable and can be a static argument of `jax.jit`;
changing its fields recompiles, which is what we want since they change the traced program.

`method.process(logits_bv) -> logits_bv` returns float32 logits of the distribution the sampler
draws from: scaled by the temperature, with tokens outside the support set to -inf. The sampler
draws with `jax.random.categorical` on them (argmax for greedy) and scores the drawn token with
`log_softmax` of the same array, so the sampling log-probs are exactly those of the distribution
the token came from.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Union

import jax
import jax.numpy as jnp

_NEG_INF = -jnp.inf


def _check_temperature(name: str, temperature) -> None:
  if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
    raise ValueError(f'{name}: temperature must be a number, got {temperature!r}')
  if not math.isfinite(temperature) or temperature <= 0:
    raise ValueError(
        f'{name}: temperature must be finite and > 0, got {temperature!r} '
        '(use Greedy() for temperature 0)')


def _scale(logits: jax.Array, temperature: float) -> jax.Array:
  logits = logits.astype(jnp.float32)
  if temperature != 1.0:  # A Python float: no op traced for the common case.
    logits = logits / jnp.float32(temperature)
  return logits


@dataclasses.dataclass(frozen=True)
class Greedy:
  """Always the most likely token (the first one on ties); its log-prob under itself is 0."""

  is_greedy = True  # Class attribute, not a field: the sampler takes argmax, no rng.

  def process(self, logits: jax.Array) -> jax.Array:
    logits = logits.astype(jnp.float32)
    top = jnp.argmax(logits, axis=-1)
    keep = jax.nn.one_hot(top, logits.shape[-1], dtype=jnp.bool_)
    return jnp.where(keep, logits, _NEG_INF)


@dataclasses.dataclass(frozen=True)
class Temperature:
  """Sample from softmax(logits / temperature)."""

  temperature: float = 1.0
  is_greedy = False

  def __post_init__(self):
    _check_temperature('Temperature', self.temperature)

  def process(self, logits: jax.Array) -> jax.Array:
    return _scale(logits, self.temperature)


@dataclasses.dataclass(frozen=True)
class TopK:
  """Sample among the k most likely tokens (ties at the k-th value are all kept)."""

  k: int
  temperature: float = 1.0
  is_greedy = False

  def __post_init__(self):
    if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
      raise ValueError(f'TopK: k must be an integer >= 1, got {self.k!r}')
    _check_temperature('TopK', self.temperature)

  def process(self, logits: jax.Array) -> jax.Array:
    logits = _scale(logits, self.temperature)
    k = min(self.k, logits.shape[-1])
    kth = jax.lax.top_k(logits, k)[0][..., -1:]
    return jnp.where(logits >= kth, logits, _NEG_INF)


@dataclasses.dataclass(frozen=True)
class TopP:
  """Nucleus sampling: the smallest set of most likely tokens whose probability reaches p."""

  p: float
  temperature: float = 1.0
  is_greedy = False

  def __post_init__(self):
    if (isinstance(self.p, bool) or not isinstance(self.p, (int, float))
        or not 0.0 < self.p <= 1.0):
      raise ValueError(f'TopP: p must be in (0, 1], got {self.p!r}')
    _check_temperature('TopP', self.temperature)

  def process(self, logits: jax.Array) -> jax.Array:
    logits = _scale(logits, self.temperature)
    if self.p >= 1.0:
      return logits  # Keep all: float round-off in the cumsum must not drop the tail.
    sorted_desc = -jnp.sort(-logits, axis=-1)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    # A token is kept when the mass of strictly more likely tokens is below p; the top one always is.
    kept = mass_before < self.p
    threshold = jnp.min(jnp.where(kept, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits >= threshold, logits, _NEG_INF)


Method = Union[Greedy, Temperature, TopK, TopP]
METHODS = (Greedy, Temperature, TopK, TopP)

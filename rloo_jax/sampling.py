"""Sampling methods (greedy, temperature, top-k, top-p) and the sampler's per-step token draw.

Each method is a frozen dataclass, so it is hashable and can be a static argument of `jax.jit`;
changing its fields recompiles, which is what we want since they change the traced program.

`method.process(logits_bv) -> logits_bv` returns float32 logits of the distribution the sampler
draws from: scaled by the temperature, with tokens outside the support set to -inf. The sampler
draws with `jax.random.categorical` on them (argmax for greedy) and scores the drawn token with
`log_softmax` of the same array, so the sampling log-probs are exactly those of the distribution
the token came from.

`draw` is that step for a [B, K] block of streams, `mask_after_eos` the EOS bookkeeping after it,
and `stream_keys` / `gumbel_bkv` the per-stream randomness, the same in every sampler mode.
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


# ----------------------------------------------------------------------------------------------
# Drawing tokens (the sampler's per-step draw, EOS masking included)


def mask_after_eos(tokens_bk: jax.Array, done_bk: jax.Array, *, eos_id, pad_id: int):
  """One step of EOS masking: streams already done emit pad_id and are masked out.

  eos_id: one end token or an int array [S] of stop ids; a stream ends at any of them.
  Returns (tokens_bk, valid_bk, done_bk): the EOS token itself is valid; done after it.
  """
  valid_bk = ~done_bk
  tokens_bk = jnp.where(valid_bk, tokens_bk, jnp.asarray(pad_id).astype(tokens_bk.dtype))
  stops_s = jnp.atleast_1d(jnp.asarray(eos_id)).astype(tokens_bk.dtype)
  is_stop_bk = jnp.any(tokens_bk[..., None] == stops_s, axis=-1)
  return tokens_bk, valid_bk, done_bk | (valid_bk & is_stop_bk)


def stream_keys(rng: jax.Array, num_prompts: int, k: int) -> jax.Array:
  """Keys [B, K] from (prompt, stream) indices, so every mode draws the same randomness."""
  def prompt_keys(b):
    rng_b = jax.random.fold_in(rng, b)
    return jax.vmap(lambda j: jax.random.fold_in(rng_b, j))(jnp.arange(k))
  return jax.vmap(prompt_keys)(jnp.arange(num_prompts))


# The Gumbel noise of a whole rollout is drawn up front (in the sampler's `start`, outside the
# decode loop) when it fits in this many bytes. On CPU, jax's threefry runs as a rolled while
# loop, so drawing the noise inside the loop body cost a nested loop at every token, a large share
# of a small model's decode step (measured by experiments/bench_sampler.py; see
# docs/PERFORMANCE.md). Both ways draw the same bits, hence the same tokens.
NOISE_BUDGET_BYTES = 64 << 20


def gumbel_bkv(keys_bk, step, vocab: int):
  """The noise `jax.random.categorical(fold_in(key, step), logits)` adds to logits, per stream."""
  return jax.vmap(jax.vmap(
      lambda key: jax.random.gumbel(jax.random.fold_in(key, step), (vocab,))))(keys_bk)


def draw(method, keys_bk, step, logits_bkv, noise_bkv=None):
  """Sampled tokens and their log-probs under the sampling distribution and the raw policy.

  A sampled token is argmax(processed logits + Gumbel noise), exactly `jax.random.categorical`;
  `noise_bkv` is the pre-drawn noise of this step, or None to draw it here from the keys.
  """
  logits_bkv = logits_bkv.astype(jnp.float32)
  processed_bkv = method.process(logits_bkv)
  if method.is_greedy:
    tokens_bk = jnp.argmax(processed_bkv, axis=-1)
  else:
    if noise_bkv is None:
      noise_bkv = gumbel_bkv(keys_bk, step, logits_bkv.shape[-1])
    tokens_bk = jnp.argmax(noise_bkv + processed_bkv, axis=-1)
  tokens_bk = tokens_bk.astype(jnp.int32)

  def logprob_of(logits):
    logp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(logp, tokens_bk[..., None], axis=-1)[..., 0]

  return tokens_bk, logprob_of(processed_bkv), logprob_of(logits_bkv)


def from_config(r) -> Method:
  """The rollout's method from config.rloo (temperature, top_k, top_p); temperature 0 = greedy."""
  if r.top_k and r.top_p < 1.0:
    raise ValueError("set at most one of config.rloo.top_k and config.rloo.top_p")
  if r.top_k:
    return TopK(int(r.top_k), float(r.temperature))
  if r.top_p < 1.0:
    return TopP(float(r.top_p), float(r.temperature))
  if r.temperature == 0:
    return Greedy()
  return Temperature(float(r.temperature))

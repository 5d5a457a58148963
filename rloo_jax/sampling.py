"""Sampling methods (greedy, temperature, top-k, top-p) and the sampler's per-step token draw.

Each method is a frozen dataclass, so it is hashable and can be a static argument of `jax.jit`;
changing its fields recompiles, which is what we want since they change the traced program.

`method.process(logits_bv) -> logits_bv` returns float32 logits of the distribution the sampler
draws from: scaled by the temperature, with tokens outside the support set to -inf. The sampler
draws from them by the inverse CDF (`inverse_cdf`; argmax for greedy) and scores the drawn token
under the same array, so the sampling log-probs are those of the distribution the token came
from.

`draw` is that step for a [B, K] block of streams, `mask_after_eos` the EOS bookkeeping after it,
and `stream_keys` / `uniforms_tbk2` the per-stream randomness, the same in every sampler mode.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Union

import jax
import jax.numpy as jnp
from flax import struct

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
    # A token is kept when the mass of strictly more likely tokens is below p; the top one
    # always is.
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
  return tokens_bk, valid_bk, done_bk | (valid_bk & is_stop(tokens_bk, eos_id))


def is_stop(tokens, eos_id):
  """Whether each token is one of the stop ids `eos_id` (an int or an int array [S])."""
  stops_s = jnp.atleast_1d(jnp.asarray(eos_id)).astype(tokens.dtype)
  return jnp.any(tokens[..., None] == stops_s, axis=-1)


def stream_keys(rng: jax.Array, num_prompts: int, k: int) -> jax.Array:
  """Keys [B, K] from (prompt, stream) indices, so every mode draws the same randomness."""
  def prompt_keys(b):
    rng_b = jax.random.fold_in(rng, b)
    return jax.vmap(lambda j: jax.random.fold_in(rng_b, j))(jnp.arange(k))
  return jax.vmap(prompt_keys)(jnp.arange(num_prompts))


# A token is drawn by the inverse CDF in two levels over the vocabulary laid out as a grid
# [rows, columns] (token = row * columns + column): a column with probability its mass, then a
# row within that column with probability its share of the column. It needs two uniforms per
# stream and step, not the V Gumbel variates of `jax.random.categorical`, and no argmax over V.
# Columns, not rows, are the first level so that a vocabulary sharded over the mesh's `tensor`
# axis stays sharded: its contiguous shards are row ranges, a column's mass is a sum over rows
# (partial sums, then an all-reduce of [B, K, columns]) and only the chosen column, [B, K, rows],
# is ever gathered. Both levels' prefix sums are about sqrt(V) long, not V (jax lowers a cumsum
# to a reduce-window over its whole length), and the second level resolves float32 relative to
# its column's mass, not to the whole distribution's.
_MAX_COLUMNS = 2048


def _grid(vocab: int) -> tuple[int, int]:
  """(rows, columns) of the draw's grid; rows * columns >= vocab, the excess padded with -inf.

  Rows are the largest power of two dividing the vocabulary, at most about sqrt(V), so that the
  grid needs no padding (a padded vocabulary would be resharded) and its rows split evenly
  over a tensor axis of any power-of-two size up to them; a vocabulary with too few factors of
  two for that (an odd one cannot be sharded evenly anyway) is padded to sqrt(V)-sized rows."""
  cap = 1
  while cap * cap < vocab:
    cap *= 2
  rows = math.gcd(vocab, cap)
  if vocab // rows <= _MAX_COLUMNS:
    return rows, vocab // rows
  return cap, -(-vocab // cap)


def uniforms_tbk2(keys_bk, num_steps: int):
  """The rollout's uniforms [T, B, K, 2]: step t of stream (b, j) from fold_in(key_bj, t).

  Drawn before the decode loop (T * B * K * 8 bytes), in one batched draw, so the loop body,
  which runs once per token in sequence, does no hashing."""
  def at(t):
    return jax.vmap(jax.vmap(lambda key: step_uniforms(key, t)))(keys_bk)
  return jax.vmap(at)(jnp.arange(num_steps))


def step_uniforms(key, t):
  """A stream's two uniforms of step t, from fold_in(key, t): every sampler draws with these."""
  return jax.random.uniform(jax.random.fold_in(key, t), (2,))


def _first_above(weights, u):
  """The first index whose inclusive prefix sum of `weights` (>= 0) exceeds u * their total.

  Never a zero-weight index: its prefix sum equals its predecessor's. When rounding puts
  u * total at or above the last prefix sum, the last index of positive weight."""
  cumulative = jnp.cumsum(weights, axis=-1)
  below = jnp.sum(cumulative <= u[..., None] * cumulative[..., -1:], axis=-1)
  index = jnp.arange(weights.shape[-1], dtype=jnp.int32)
  last_positive = jnp.max(jnp.where(weights > 0, index, 0), axis=-1)
  return jnp.minimum(below.astype(jnp.int32), last_positive)


def inverse_cdf(logits_bkv, uniforms_bk2):
  """Tokens [B, K] drawn from softmax(logits) (float32, -inf outside the support) by the two-level
  inverse CDF, uniforms_bk2[..., 0] choosing the column of `_grid` and [..., 1] the row in it.
  Also returns the max logit and the total of exp(logits - max), which score the token."""
  vocab = logits_bkv.shape[-1]
  rows, columns = _grid(vocab)
  top = jnp.max(logits_bkv, axis=-1, keepdims=True)
  if rows * columns > vocab:
    logits_bkv = jnp.pad(logits_bkv, [(0, 0)] * (logits_bkv.ndim - 1)
                         + [(0, rows * columns - vocab)], constant_values=_NEG_INF)
  weights = jnp.exp(logits_bkv.reshape(logits_bkv.shape[:-1] + (rows, columns)) - top[..., None])
  mass = jnp.sum(weights, axis=-2)
  column = _first_above(mass, uniforms_bk2[..., 0])
  in_column = jnp.take_along_axis(weights, column[..., None, None], axis=-1)[..., 0]
  row = _first_above(in_column, uniforms_bk2[..., 1])
  return row * columns + column, top[..., 0], jnp.sum(mass, axis=-1)


def draw(method, uniforms_bk2, logits_bkv):
  """Sampled tokens and their log-probs under the sampling distribution and the raw policy.

  A sampled token is `inverse_cdf` of the processed logits (argmax for greedy) with this step's
  uniforms; its sampling log-prob is that of the same processed distribution.
  """
  logits_bkv = logits_bkv.astype(jnp.float32)

  def logprob_of(logits, tokens_bk):
    logp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(logp, tokens_bk[..., None], axis=-1)[..., 0]

  if method.is_greedy:
    # Greedy.process's support is the first argmax alone: that token, with log-prob 0 under it.
    tokens_bk = jnp.argmax(logits_bkv, axis=-1).astype(jnp.int32)
    return tokens_bk, jnp.zeros(tokens_bk.shape, jnp.float32), logprob_of(logits_bkv, tokens_bk)
  processed_bkv = method.process(logits_bkv)
  tokens_bk, top, total = inverse_cdf(processed_bkv, uniforms_bk2)
  # The normaliser the draw already summed, not a second pass over the vocabulary.
  sampled_bk = (jnp.take_along_axis(processed_bkv, tokens_bk[..., None], axis=-1)[..., 0]
                - top - jnp.log(total))
  # Temperature 1 without truncation processes nothing: the policy's log-probs are the same.
  policy_bk = sampled_bk if processed_bkv is logits_bkv else logprob_of(logits_bkv, tokens_bk)
  return tokens_bk, sampled_bk, policy_bk


def from_config(r, key: str = 'config.rloo') -> Method:
  """The rollout's method from config.rloo (temperature, top_k, top_p); temperature 0 = greedy.
  Each setting is checked here, naming `key`.<setting>, so a value that would sample something
  else than it says (top_p=1.5, top_k with greedy) never reaches the sampler."""
  t, k, p = r.temperature, r.top_k, r.top_p
  if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
    raise ValueError(f'{key}.temperature = {t!r} must be a finite number >= 0 (0: greedy); set '
                     f'--{key}.temperature=1.0')
  if isinstance(k, bool) or not isinstance(k, int) or k < 0:
    raise ValueError(f'{key}.top_k = {k!r} must be an integer >= 0 (0: off); set '
                     f'--{key}.top_k=0')
  if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
    raise ValueError(f'{key}.top_p = {p!r} must be in (0, 1] (1: off); set --{key}.top_p=1.0')
  if k and p < 1.0:
    raise ValueError(f'set at most one of {key}.top_k and {key}.top_p')
  if t == 0 and (k or p < 1.0):
    raise ValueError(f'{key}.temperature = 0 is greedy decoding, which {key}.top_k / top_p do '
                     'not change; set a temperature > 0 or leave top_k=0 and top_p=1.0')
  if k:
    return TopK(int(k), float(t))
  if p < 1.0:
    return TopP(float(p), float(t))
  if t == 0:
    return Greedy()
  return Temperature(float(t))


# ----------------------------------------------------------------------------------------------
# What both samplers (`sampler`, `engine`) read and return


@struct.dataclass
class SampleOutput:
  tokens_bkt: jax.Array           # int32 [B, K, T]: completion tokens, pad_id after EOS.
  logprobs_bkt: jax.Array         # float32 [B, K, T]: log p of each token under the sampling dist.
  policy_logprobs_bkt: jax.Array  # float32 [B, K, T]: log p under the untempered policy.
  mask_bkt: jax.Array             # bool [B, K, T]: True up to and including EOS.
  lengths_bk: jax.Array           # int32 [B, K]: number of True entries of mask_bkt.


def prompt_inputs(prompt_tokens_xp, lengths_x):
  """(positions, mask) [X, P] of right-padded prompt rows."""
  num_cols = prompt_tokens_xp.shape[1]
  cols_p = jnp.arange(num_cols, dtype=jnp.int32)
  mask_xp = cols_p[None, :] < lengths_x[:, None]
  # Padding columns are masked keys; position 0 keeps learned-position lookups in range.
  positions_xp = jnp.where(mask_xp, cols_p[None, :], 0)
  return positions_xp, mask_xp

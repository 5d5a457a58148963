"""Tests of the token draw (`sampling.inverse_cdf`, `sampling.draw`): its distribution, its
support and its edge cases. The sampler's use of it is tested in test_sampler.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import assert_f32_close

from rloo_jax import sampling

# Float comparisons of two computations: rerun by .ci/run under other CPU flags.
pytestmark = pytest.mark.numerics

_draw_many = jax.jit(jax.vmap(sampling.inverse_cdf, in_axes=(None, 0)))


def _frequencies(logits_v, n, seed=0):
  u = jax.random.uniform(jax.random.key(seed), (n, 2))
  tokens, _, _ = _draw_many(jnp.asarray(logits_v, jnp.float32), u)
  return np.bincount(np.asarray(tokens), minlength=len(logits_v)) / n


@pytest.mark.parametrize('vocab', [5, 300, 4099, 20_000])
def test_draws_follow_the_softmax(vocab):
  """On grids of 1 x 5, 4 x 75, 128 x 33 (padded) and 32 x 625 tokens: the frequencies of 200,000 draws match softmax within 5 standard
  errors everywhere, and the tokens kept at -inf are never drawn."""
  rng = np.random.default_rng(vocab)
  logits = rng.normal(0, 2.0, vocab).astype(np.float32)
  logits[rng.random(vocab) < 0.3] = -np.inf
  logits[0] = 1.0
  p = np.asarray(jax.nn.softmax(jnp.asarray(logits)))
  n = 200_000
  freq = _frequencies(logits, n)
  assert freq[~np.isfinite(logits)].sum() == 0
  se = np.sqrt(p * (1 - p) / n) + 1 / n
  assert np.all(np.abs(freq - p) <= 5 * se), np.max(np.abs(freq - p) / se)
  # The total variation a two-level draw could lose to rounding is far below sampling noise.
  assert 0.5 * np.abs(freq - p).sum() < 0.5 * np.sqrt(vocab / n)


def test_the_row_level_resolves_float32_relative_to_its_column():
  """A token of 1e-8 of the whole mass (below float32's 6e-8 step at 1, so one inverse CDF over
  the vocabulary could not resolve it) is 1e-5 of its column's: the second level draws it."""
  rows, columns = sampling._grid(256)
  assert (rows, columns) == (16, 16)  # token = row * 16 + column
  logits = np.full(256, -np.inf, np.float32)
  logits[0::16] = np.log(8.0)                  # column 0: mass 128
  logits[1] = np.log(1.28e-6)                  # column 1: 1.28e-6 + 0.128
  logits[17] = np.log(0.128 - 1.28e-6)
  p = np.asarray(jax.nn.softmax(jnp.asarray(logits)))
  assert p[1] == pytest.approx(1e-8, rel=1e-2)
  column_0 = p[0::16].sum()
  in_column_1 = column_0 + 0.5 * (p[1] + p[17])
  draws = {(0.5, 0.5): range(0, 256, 16), (in_column_1, 0.5e-5): [1], (in_column_1, 0.5): [17]}
  for u, want in draws.items():
    token, _, _ = sampling.inverse_cdf(jnp.asarray(logits), jnp.asarray(u, jnp.float32))
    assert int(token) in want, (u, int(token))


@pytest.mark.parametrize('vocab, grid', [(151_936, (128, 1187)), (128_256, (256, 501)),
                                         (50_304, (128, 393)), (262_144, (512, 512)),
                                         (50_257, (256, 197)), (16, (4, 4))])
def test_the_grid_pads_only_a_vocabulary_short_of_factors_of_two(vocab, grid):
  """Qwen's, Llama 3's, Pythia's, Gemma 3's vocabularies need no padding (their rows split over
  a tensor axis of 2 .. 128 devices); GPT-2's odd one is padded to 256 rows."""
  assert sampling._grid(vocab) == grid


# 1.0: what u * total is when it rounds up to the total, which a uniform below 1 can do.
@pytest.mark.parametrize('u', [0.0, 1 - 2 ** -24, 1.0, 0.5])
@pytest.mark.parametrize('vocab', [1000, 4099])
def test_extreme_uniforms_never_leave_the_support(u, vocab):
  """u = 0 draws the support's token of the first column, u at 1 that of the last column and
  row, not the -inf tokens or the padding after it; never a -inf token. 1000 tokens: 8 rows of
  125; 4099 (prime): 128 rows of 33, the last 125 cells padding."""
  support = [130, 131, 132, 133, vocab - 1 if vocab == 4099 else 700]
  logits = np.full(vocab, -np.inf, np.float32)
  logits[support] = [0.0, 1.0, 2.0, 3.0, 0.5]
  token, top, total = sampling.inverse_cdf(jnp.asarray(logits), jnp.asarray([u, u], jnp.float32))
  token = int(token)
  assert np.isfinite(logits[token]), token
  columns = sampling._grid(vocab)[1]
  by_cell = sorted(support, key=lambda t: (t % columns, t // columns))
  if u == 0.0:
    assert token == by_cell[0]
  if u > 0.99:
    assert token == by_cell[-1]
  np.testing.assert_allclose(float(top) + np.log(float(total)),
                             float(jax.nn.logsumexp(jnp.asarray(logits))), rtol=1e-6)


def test_one_token_of_support():
  logits = np.full((2, 3, 700), -np.inf, np.float32)
  logits[..., 513] = -4.0
  u = jax.random.uniform(jax.random.key(1), (2, 3, 2))
  tokens, logp, policy = sampling.draw(sampling.Temperature(1.0), u, jnp.asarray(logits))
  assert (np.asarray(tokens) == 513).all()
  np.testing.assert_array_equal(np.asarray(logp), 0.0)
  np.testing.assert_array_equal(np.asarray(policy), 0.0)


@pytest.mark.parametrize('method', [sampling.Temperature(1.0), sampling.Temperature(0.7),
                                    sampling.TopK(5, 1.2), sampling.TopP(0.8),
                                    sampling.Greedy()])
def test_draw_scores_the_token_under_both_distributions(method):
  """The sampling log-prob is log_softmax(processed)[token], the policy's log_softmax(raw)
  [token], to float32 round-off, whatever the method."""
  logits = jax.random.normal(jax.random.key(3), (4, 2, 333)) * 3
  u = jax.random.uniform(jax.random.key(4), (4, 2, 2))
  tokens, logp, policy = jax.jit(sampling.draw, static_argnums=0)(method, u, logits)
  at = lambda x: np.take_along_axis(np.asarray(jax.nn.log_softmax(x, -1)),  # noqa: E731
                                    np.asarray(tokens)[..., None], -1)[..., 0]
  assert_f32_close(np.asarray(logp), at(method.process(logits)), logits.shape[-1])
  assert_f32_close(np.asarray(policy), at(logits), logits.shape[-1])
  if method.is_greedy:
    np.testing.assert_array_equal(np.asarray(tokens), np.argmax(np.asarray(logits), -1))
  assert np.isfinite(np.asarray(method.process(logits))[
      np.arange(4)[:, None], np.arange(2)[None], np.asarray(tokens)]).all()


_SHARDED_DRAW = r'''
import os, re, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from rloo_jax import sampling
mesh = Mesh(jax.devices(), ("tensor",))
for vocab in map(int, sys.argv[1:]):
  logits = jax.ShapeDtypeStruct((2, 4, vocab), jnp.float32,
                                sharding=NamedSharding(mesh, P(None, None, "tensor")))
  u = jax.ShapeDtypeStruct((2, 4, 2), jnp.float32, sharding=NamedSharding(mesh, P()))
  hlo = jax.jit(lambda u, l: sampling.draw(sampling.Temperature(1.0), u, l)).lower(
      u, logits).compile().as_text()
  collectives = "all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter"
  for shape in re.findall(r"= \w+\[([\d,]*)\][^ ]* (?:%s)" % collectives, hlo):
    print(vocab, shape)
'''


def test_logits_sharded_over_tensor_never_move():
  """Logits split over 4 devices along the vocabulary: the draw's collectives move column
  masses ([B, K, columns]) and the chosen column ([B, K, rows]), never the logits (blocks of
  contiguous tokens, sliced out of the sharded axis, gathered them at every token)."""
  import subprocess
  import sys
  vocabs = (151_936, 50_304)  # one process (4 simulated devices) for both: one jax start
  out = subprocess.run([sys.executable, '-c', _SHARDED_DRAW, *map(str, vocabs)], check=True,
                       capture_output=True, text=True).stdout
  lines = [line.split() for line in out.splitlines()]
  for vocab in vocabs:
    # A scalar's shape is empty: its line has no second field, and it moves no logits.
    shapes = [line[1] for line in lines if len(line) == 2 and int(line[0]) == vocab]
    assert shapes, f'no collective: the logits of vocab {vocab} were not sharded'
    for shape in shapes:
      size = np.prod([int(d) for d in shape.split(',') if d])
      assert size <= 2 * 4 * max(sampling._grid(vocab)), (shape, vocab)

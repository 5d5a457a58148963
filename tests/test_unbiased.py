"""RLOO is an unbiased policy-gradient estimator; including a sample in its own baseline is not.

The toy policy (vocab 3, length 3: 27 sequences) is small enough to compute the exact gradient of the
expected reward by enumeration.
"""
import numpy as np
import pytest

from rloo_jax.toy import ToyPolicy, estimator_statistics

NUM_GROUPS = 60_000
K = 4


def z_scores(stats):
  # Logits of (position 0, previous token != BOS) are never used: their gradient is exactly 0.
  used = stats["stderr"] > 0
  np.testing.assert_array_equal(stats["exact"][~used], 0.0)
  return np.abs(stats["mean"] - stats["exact"])[used] / stats["stderr"][used]


@pytest.fixture(scope="module")
def policy():
  return ToyPolicy(vocab=3, length=3, seed=0)


def test_rloo_gradient_is_unbiased(policy):
  stats = estimator_statistics(policy, K, NUM_GROUPS, seed=1)
  z = z_scores(stats)
  # 30 used components; a 4.5 sigma bound per component keeps the family-wise false alarm < 1e-3.
  assert z.max() < 4.5, z.max()
  assert abs(stats["scale"] - 1.0) < 0.02, stats["scale"]


def test_mean_baseline_is_shrunk_by_k_minus_1_over_k(policy):
  stats = estimator_statistics(policy, K, NUM_GROUPS, seed=1, estimator="mean_baseline")
  assert abs(stats["scale"] - (K - 1) / K) < 0.02, stats["scale"]
  # Measurably biased: the shrinkage is many standard errors away from the exact gradient.
  z = z_scores(stats)
  assert z.max() > 6.0, z.max()


def test_variance_falls_with_k(policy):
  variances = [estimator_statistics(policy, k, 20_000, seed=2)["variance"] for k in (2, 4, 8)]
  assert variances[0] > variances[1] > variances[2], variances

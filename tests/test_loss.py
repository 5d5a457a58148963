"""Loss functions: float32 numerics, KL estimators, penalised rewards and policy losses."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rloo_jax import loss


def _logits(seed=0, shape=(3, 5, 7), dtype=jnp.float32):
  return (2.0 * jax.random.normal(jax.random.PRNGKey(seed), shape)).astype(dtype)


class TokenLogprobsTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_matches_log_softmax_and_masks(self):
    logits = _logits()
    targets = jax.random.randint(jax.random.PRNGKey(1), (3, 5), 0, 7)
    mask = jnp.arange(5)[None, :] < jnp.array([[5], [2], [0]])
    logp = self.variant(loss.token_logprobs)(logits, targets, mask)
    ref = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(logp, jnp.where(mask, ref, 0.0), atol=1e-5)

  @chex.variants(with_jit=True, without_jit=True)
  def test_bfloat16_logits_give_float32_logprobs(self):
    logits = _logits(dtype=jnp.bfloat16)
    targets = jnp.zeros((3, 5), jnp.int32)
    logp = self.variant(loss.token_logprobs)(logits, targets)
    assert logp.dtype == jnp.float32
    ref = jax.nn.log_softmax(logits.astype(jnp.float32))[..., 0]
    np.testing.assert_allclose(logp, ref, atol=1e-5)

  def test_shape_mismatch(self):
    with pytest.raises(ValueError, match=r"logits shape \(3, 5, 7\) does not match targets shape"):
      loss.token_logprobs(_logits(), jnp.zeros((3, 4), jnp.int32))


def test_kl_estimators_by_hand():
  logp = jnp.array([[-1.0, -2.0]])
  ref = jnp.array([[-1.5, -1.0]])
  np.testing.assert_allclose(loss.kl_per_token(logp, ref, "k1"), [[0.5, -1.0]])
  np.testing.assert_allclose(loss.kl_per_token(logp, ref, "k2"), [[0.125, 0.5]])
  k3 = [np.exp(-0.5) - 1 + 0.5, np.exp(1.0) - 1 - 1.0]
  np.testing.assert_allclose(loss.kl_per_token(logp, ref, "k3"), [k3], rtol=1e-6)
  with pytest.raises(ValueError, match=r"unknown KL estimator 'k4'.*config\.kl\.estimator"):
    loss.kl_per_token(logp, ref, "k4")


def test_kl_estimators_are_unbiased_for_true_kl():
  p = jnp.array([0.5, 0.3, 0.2])
  q = jnp.array([0.2, 0.5, 0.3])
  true_kl = float(jnp.sum(p * jnp.log(p / q)))
  samples = jax.random.categorical(jax.random.PRNGKey(0), jnp.log(p), shape=(200_000,))
  lp, lq = jnp.log(p)[samples], jnp.log(q)[samples]
  for est in ("k1", "k3"):
    np.testing.assert_allclose(float(loss.kl_per_token(lp, lq, est).mean()), true_kl, rtol=0.03)
  assert float(loss.kl_per_token(lp, lq, "k3").min()) >= 0.0


def test_sequence_kl_and_penalised_reward():
  logp = jnp.array([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
  ref = jnp.array([[-1.5, -1.0, -9.0], [-2.0, -2.0, -2.0]])
  mask = jnp.array([[True, True, False], [True, True, True]])
  np.testing.assert_allclose(loss.sequence_kl(logp, ref, mask), [-0.5, 3.0])
  np.testing.assert_allclose(loss.sequence_kl(logp, ref, mask, reduction="mean"), [-0.25, 1.0])
  r, kl = loss.penalized_reward(jnp.array([1.0, 2.0]), logp, ref, mask, beta=0.1)
  np.testing.assert_allclose(r, [1.05, 1.7], rtol=1e-6)
  r, _ = loss.penalized_reward(jnp.array([1.0, 2.0]), logp, ref, mask, beta=0.1,
                               reduction="mean")
  np.testing.assert_allclose(r, [1.025, 1.9], rtol=1e-6)


def test_aggregations_by_hand():
  l = jnp.array([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
  m = jnp.array([[True, True, True], [True, False, False]])
  assert float(loss.aggregate(l, m, "sequence_sum")) == pytest.approx((6 + 4) / 2)
  assert float(loss.aggregate(l, m, "sequence_mean")) == pytest.approx((2 + 4) / 2)
  assert float(loss.aggregate(l, m, "token_mean")) == pytest.approx(10 / 4)
  assert float(loss.aggregate(l, m, "fixed_length", max_len=5)) == pytest.approx(10 / 10)
  with pytest.raises(ValueError, match=r"unknown loss aggregation 'mean'.*config\.loss\.aggregation"):
    loss.aggregate(l, m, "mean")


def _seq_logp(theta, tokens, mask):
  return loss.token_logprobs(theta[None].repeat(tokens.shape[0], 0), tokens, mask)


def test_reinforce_gradient_is_advantage_times_sequence_score():
  theta = jax.random.normal(jax.random.PRNGKey(0), (4, 5))
  tokens = jnp.array([[1, 2, 3, 0], [4, 4, 0, 0]])
  mask = jnp.array([[True, True, True, False], [True, True, False, False]])
  adv = jnp.array([0.7, -1.3])
  grad = jax.grad(lambda th: loss.reinforce_loss(_seq_logp(th, tokens, mask), mask, adv)[0])(theta)
  scores = jax.vmap(lambda t, m: jax.grad(lambda th: _seq_logp(th, t[None], m[None]).sum())(theta))(
      tokens, mask)
  np.testing.assert_allclose(grad, -(adv[:, None, None] * scores).mean(0), atol=1e-6)


def test_ppo_sequence_ratio_equals_reinforce_on_policy_and_clips_off_policy():
  theta = jax.random.normal(jax.random.PRNGKey(0), (4, 5))
  tokens = jnp.array([[1, 2, 3, 0], [4, 4, 0, 0]])
  mask = jnp.array([[True, True, True, False], [True, True, False, False]])
  adv = jnp.array([0.7, -1.3])
  old = jax.lax.stop_gradient(_seq_logp(theta, tokens, mask))
  g_ppo = jax.grad(lambda th: loss.ppo_clip_loss(_seq_logp(th, tokens, mask), old, mask, adv)[0])(
      theta)
  g_pg = jax.grad(lambda th: loss.reinforce_loss(_seq_logp(th, tokens, mask), mask, adv)[0])(theta)
  np.testing.assert_allclose(g_ppo, g_pg, atol=1e-6)
  # Sequence 0 has A > 0 and ratio e^1 > 1.2: clipped (no gradient); sequence 1 (A < 0) is not.
  logp = old + jnp.array([[1.0, 0.0, 0.0, 0.0], [0.5, 0.0, 0.0, 0.0]])
  value, metrics = loss.ppo_clip_loss(logp, old, mask, adv, clip_eps=0.2)
  assert float(metrics["clip_fraction"]) == pytest.approx(0.5)
  expected = -(1.2 * 0.7 + np.exp(0.5) * -1.3) / 2
  assert float(value) == pytest.approx(expected, rel=1e-5)
  # Token level with an asymmetric upper epsilon.
  _, metrics = loss.ppo_clip_loss(logp, old, mask, adv, clip_eps=0.2, clip_eps_high=2.0,
                                  ratio_level="token", aggregation="token_mean")
  assert float(metrics["clip_fraction"]) == pytest.approx(0.0)
  assert float(metrics["approx_kl"]) == pytest.approx(
      (np.exp(1.0) - 2.0 + np.exp(0.5) - 1.5) / 5, rel=1e-5)


def test_entropy_metric_when_logits_given():
  logits = jnp.zeros((2, 3, 4))
  mask = jnp.ones((2, 3), bool)
  _, metrics = loss.reinforce_loss(jnp.zeros((2, 3)), mask, jnp.ones(2), logits_btv=logits)
  assert float(metrics["entropy"]) == pytest.approx(np.log(4.0), rel=1e-6)

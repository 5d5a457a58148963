"""Advantage estimators against hand-computed numbers and their defining identities."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rloo_jax import advantage


class RlooTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_paper_example(self):
    adv = self.variant(advantage.get("rloo"))(jnp.array([[0.8, 0.5, 0.6, 0.7]]))
    # 0.8 - (0.5 + 0.6 + 0.7) / 3 = 0.2, and so on for the others.
    np.testing.assert_allclose(adv[0], [0.2, -0.2, -1 / 15, 1 / 15], atol=1e-6)

  @chex.variants(with_jit=True, without_jit=True)
  def test_seed_cohort(self):
    r = np.array([1.2, 0.4, 2.1, 0.8])
    adv = self.variant(advantage.get("rloo"))(jnp.asarray(r[None]))
    expected = [1.2 - (0.4 + 2.1 + 0.8) / 3, 0.4 - (1.2 + 2.1 + 0.8) / 3,
                2.1 - (1.2 + 0.4 + 0.8) / 3, 0.8 - (1.2 + 0.4 + 2.1) / 3]
    np.testing.assert_allclose(adv[0], expected, atol=1e-6)
    np.testing.assert_allclose(adv[0], [0.1, -0.966667, 1.3, -0.433333], atol=1e-5)

  @chex.variants(with_jit=True, without_jit=True)
  def test_identities(self):
    for k in (2, 3, 4, 8):
      r = jax.random.normal(jax.random.PRNGKey(k), (16, k))
      adv = self.variant(advantage.get("rloo"))(r)
      np.testing.assert_allclose(adv, k / (k - 1) * (r - r.mean(1, keepdims=True)), atol=1e-5)
      np.testing.assert_allclose(adv.sum(1), 0.0, atol=1e-5)
      np.testing.assert_allclose(self.variant(advantage.get("rloo"))(r + 3.7), adv, atol=1e-5)

  @chex.variants(with_jit=True, without_jit=True)
  def test_masked_samples_leave_the_baseline(self):
    r = jnp.array([[1.0, 2.0, 100.0, 4.0], [1.0, 5.0, 7.0, 9.0], [3.0, 1.0, 2.0, 0.0]])
    mask = jnp.array([[True, True, False, True], [True, False, False, False],
                      [False, False, False, False]])
    adv = self.variant(advantage.get("rloo"))(r, mask)
    np.testing.assert_allclose(adv[0], [1 - 3.0, 2 - 2.5, 0.0, 4 - 1.5], atol=1e-6)
    # One or zero usable samples: no baseline exists; zeros, never NaN.
    np.testing.assert_array_equal(adv[1:], 0.0)

  def test_nan_reward_masked_inside_jit_never_leaks(self):
    r = jnp.array([[jnp.nan, 1.0, 2.0], [jnp.inf, jnp.nan, 1.0]])
    adv = jax.jit(advantage.get("rloo"))(r)
    assert np.isfinite(np.asarray(adv)).all()
    np.testing.assert_allclose(adv[0], [0.0, -1.0, 1.0])
    np.testing.assert_array_equal(adv[1], 0.0)


def test_grpo_numbers():
  r = jnp.array([[1.0, 2.0, 3.0, 6.0]])
  adv = advantage.get("grpo")(r, eps=0.0)
  expected = (np.array([1, 2, 3, 6]) - 3.0) / np.std([1, 2, 3, 6])
  np.testing.assert_allclose(adv[0], expected, rtol=1e-5)
  # Equal rewards: zero advantage (std + eps never divides 0 by 0).
  np.testing.assert_array_equal(advantage.get("grpo")(jnp.ones((2, 4))), 0.0)
  np.testing.assert_allclose(advantage.get("grpo")(r, scale=False)[0], [-2, -1, 0, 3])


def test_vanilla_and_raft():
  r = jnp.array([[0.1, 0.9, 0.5], [0.3, 0.3, 0.2]])
  np.testing.assert_allclose(advantage.get("vanilla")(r), r)
  np.testing.assert_array_equal(advantage.get("raft")(r), [[0, 1, 0], [1, 0, 0]])
  mask = jnp.array([[True, False, True], [False, False, False]])
  np.testing.assert_array_equal(advantage.get("raft")(r, mask), [[0, 0, 1], [0, 0, 0]])


def test_reinforce_ema_state_is_threaded():
  fn = advantage.get("reinforce_ema")
  state = advantage.spec("reinforce_ema").init_state()
  adv, state = fn(jnp.array([[1.0, 3.0]]), state=state, decay=0.5)
  np.testing.assert_allclose(adv, [[1.0, 3.0]])  # no history: baseline 0
  adv, state = fn(jnp.array([[0.0, 4.0]]), state=state, decay=0.5)
  # Bias-corrected EMA after one batch of mean 2 is exactly 2.
  np.testing.assert_allclose(adv, [[-2.0, 2.0]], atol=1e-6)
  np.testing.assert_allclose(state.ema, 0.5 * 1.0 + 0.5 * 2.0)
  assert int(state.count) == 2
  jitted = jax.jit(lambda r, s: fn(r, state=s, decay=0.5))
  adv_j, _ = jitted(jnp.array([[0.0, 4.0]]), fn(jnp.array([[1.0, 3.0]]),
                                                 state=advantage.ema_init(), decay=0.5)[1])
  np.testing.assert_allclose(adv_j, [[-2.0, 2.0]], atol=1e-6)


@pytest.mark.parametrize("name", ["rloo", "grpo"])
def test_k1_is_a_clear_error(name):
  with pytest.raises(ValueError, match=r"k = 1 .*needs k >= 2.*config\.rloo\.k"):
    advantage.get(name)(jnp.ones((4, 1)))
  with pytest.raises(ValueError, match="k = 1"):
    jax.jit(advantage.get(name))(jnp.ones((4, 1)))  # at trace time, too


def test_bad_shapes():
  with pytest.raises(ValueError, match=r"shape \[num_prompts, k\], got shape \(8,\)"):
    advantage.get("rloo")(jnp.ones(8))
  with pytest.raises(ValueError, match=r"mask shape \(2, 3\) does not match rewards shape \(2, 4\)"):
    advantage.get("rloo")(jnp.ones((2, 4)), jnp.ones((2, 3), bool))


def test_nan_rewards_raise_by_default_and_mask_on_request():
  r = np.array([[1.0, np.nan, 2.0], [np.inf, 0.0, 1.0]])
  with pytest.raises(ValueError, match=r"2 reward\(s\) are NaN or inf.*nan_policy='mask'"):
    advantage.get("rloo")(jnp.asarray(r))
  with pytest.raises(ValueError, match=r"2 reward\(s\) are NaN or inf"):
    advantage.prepare_rewards(r)
  clean, mask, count = advantage.prepare_rewards(r, nan_policy="mask")
  assert count == 2
  np.testing.assert_array_equal(mask, [[True, False, True], [False, True, True]])
  adv = advantage.get("rloo")(clean, mask)
  np.testing.assert_allclose(adv, [[-1.0, 0.0, 1.0], [0.0, -1.0, 1.0]])


def test_unknown_estimator_names_registry():
  with pytest.raises(ValueError, match=r"unknown advantage estimator 'rlo'.*'rloo'"):
    advantage.get("rlo")
  assert {"rloo", "grpo", "reinforce_ema", "vanilla", "raft"} <= set(advantage.names())

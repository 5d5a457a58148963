"""Loss functions: float32 numerics, KL estimators, penalised rewards and policy losses."""
import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import assert_f32_close

from rloo_jax import loss

# Float comparisons of two computations: rerun by .ci/run under other CPU flags.
pytestmark = pytest.mark.numerics


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


def test_entropy_metric_when_entropy_given():
  entropy = loss.token_entropy(jnp.zeros((2, 3, 4)))
  mask = jnp.array([[True, True, False], [True, False, False]])
  entropy = entropy.at[0, 2].set(100.0)  # masked: must not count
  _, metrics = loss.reinforce_loss(jnp.zeros((2, 3)), mask, jnp.ones(2), entropy_bt=entropy)
  assert float(metrics["entropy"]) == pytest.approx(np.log(4.0), rel=1e-6)
  _, metrics = loss.reinforce_loss(jnp.zeros((2, 3)), mask, jnp.ones(2))
  assert "entropy" not in metrics
  with pytest.raises(ValueError, match=r"entropy_bt shape \(2, 3, 4\).*not logits"):
    loss.policy_loss(loss.LossSpec(), jnp.zeros((2, 3)), jnp.zeros((2, 3)), mask, jnp.ones(2),
                     jnp.zeros((2, 3, 4)))


# ----------------------------------------------------------------------------------------------
# chunked_logprobs: the head applied one chunk of T at a time


def _head(params, h_bce):
  """A linear head standing in for the final norm + unembedding."""
  return jnp.einsum("bce,ev->bcv", h_bce, params["w"]) + params["b"]


def _head_problem(b=3, t=10, e=6, v=11, dtype=jnp.float32, seed=0):
  k = jax.random.split(jax.random.PRNGKey(seed), 4)
  params = {"w": jax.random.normal(k[0], (e, v)), "b": jax.random.normal(k[1], (v,))}
  hidden = jax.random.normal(k[2], (b, t, e)).astype(dtype)
  targets = jax.random.randint(k[3], (b, t), 0, v)
  lengths = jnp.array([t, t // 2, 0] + [t] * (b - 3))
  mask = jnp.arange(t)[None, :] < lengths[:, None]
  return params, hidden, targets, mask


@pytest.mark.parametrize("chunk_size", [1, 3, 5, 10, 64])  # T = 10: ragged, exact, one chunk
def test_chunked_logprobs_match_unchunked_values_and_gradients(chunk_size):
  params, hidden, targets, mask = _head_problem()
  weights = jax.random.normal(jax.random.PRNGKey(7), targets.shape)  # a generic cotangent

  def chunked(p, h):
    logp, _ = loss.chunked_logprobs(_head, p, h, targets, mask, chunk_size=chunk_size)
    return jnp.sum(weights * logp), logp

  def full(p, h):
    logp = loss.token_logprobs(_head(p, h), targets, mask)
    return jnp.sum(weights * logp), logp

  (_, logp), grads = jax.value_and_grad(chunked, (0, 1), has_aux=True)(params, hidden)
  (_, ref), ref_grads = jax.value_and_grad(full, (0, 1), has_aux=True)(params, hidden)
  assert logp.shape == targets.shape and logp.dtype == jnp.float32
  assert_f32_close(logp, ref, hidden.shape[-1] * params["w"].shape[-1])
  assert float(jnp.abs(jnp.where(mask, 0.0, logp)).max()) == 0.0
  chex.assert_trees_all_close(grads, ref_grads, atol=1e-5)
  assert float(jnp.abs(grads[1][2]).max()) == 0.0  # a fully masked row gets no gradient
  assert float(jnp.abs(grads[0]["w"]).max()) > 0.0


def test_chunked_logprobs_entropy_and_bfloat16_hidden():
  params, hidden, targets, mask = _head_problem(dtype=jnp.bfloat16)
  f = jax.jit(lambda p, h: loss.chunked_logprobs(_head, p, h, targets, mask, chunk_size=4,
                                                 with_entropy=True))
  logp, entropy = f(params, hidden)
  assert logp.dtype == jnp.float32 and entropy.dtype == jnp.float32
  logits = _head(params, hidden)
  # bf16 hidden: both sides round the same bf16 products; float32 sums over e and v remain.
  terms = hidden.shape[-1] * params["w"].shape[-1]
  assert_f32_close(logp, loss.token_logprobs(logits, targets, mask), terms)
  assert_f32_close(entropy, loss.token_entropy(logits), terms)
  assert loss.chunked_logprobs(_head, params, hidden, targets, chunk_size=4)[1] is None
  # The entropy is a metric: it must not pull on the parameters.
  g = jax.grad(lambda p: jnp.sum(loss.chunked_logprobs(
      _head, p, hidden, targets, mask, chunk_size=4, with_entropy=True)[1]))(params)
  assert float(jnp.abs(g["w"]).max()) == 0.0


def test_chunked_logprobs_shape_errors():
  params, hidden, targets, mask = _head_problem()
  with pytest.raises(ValueError, match=r"hidden shape \(3, 10, 6\) does not match targets shape"):
    loss.chunked_logprobs(_head, params, hidden, targets[:, :9], chunk_size=4)
  with pytest.raises(ValueError, match=r"mask shape \(3, 9\) does not match targets shape"):
    loss.chunked_logprobs(_head, params, hidden, targets, mask[:, :9], chunk_size=4)
  with pytest.raises(ValueError, match=r"chunk_size must be >= 1"):
    loss.chunked_logprobs(_head, params, hidden, targets, chunk_size=0)


def test_chunked_logprobs_never_hold_the_full_logits_in_the_backward():
  b, t, e, v = 4, 256, 64, 8192
  params, hidden, targets, mask = _head_problem(b, t, e, v)
  full_logits_bytes = b * t * v * 4

  def temp_bytes(f):
    grad = jax.jit(jax.grad(lambda p, h: jnp.sum(f(p, h)), (0, 1)))
    return grad.lower(params, hidden).compile().memory_analysis().temp_size_in_bytes

  chunked = temp_bytes(lambda p, h: loss.chunked_logprobs(_head, p, h, targets, mask,
                                                          chunk_size=32)[0])
  full = temp_bytes(lambda p, h: loss.token_logprobs(_head(p, h), targets, mask))
  assert full >= full_logits_bytes, (full, full_logits_bytes)
  # One chunk's [B, 32, V] float32 logits (and their gradient) is 1/8 of the whole.
  assert chunked <= full_logits_bytes // 2, (chunked, full_logits_bytes)


# ----------------------------------------------------------------------------------------------
# Microbatch normalisers: summed microbatch losses and gradients equal the minibatch's


def _ragged_batch(b=8, t=6, seed=0):
  k = jax.random.split(jax.random.PRNGKey(seed), 4)
  # Fully masked rows, one microbatch of 4 entirely masked, and every length mix in between.
  lengths = jnp.array([6, 3, 0, 0, 6, 1, 4, 2])[:b]
  mask = jnp.arange(t)[None, :] < lengths[:, None]
  logp = -jnp.abs(jax.random.normal(k[0], (b, t)))
  old = logp + 0.3 * jax.random.normal(k[1], (b, t))  # off policy: some ratios get clipped
  adv = jax.random.normal(k[2], (b,))
  entropy = jnp.abs(jax.random.normal(k[3], (b, t)))
  return logp, old, mask, adv, entropy


SPECS = ([loss.LossSpec("reinforce", aggregation=a) for a in loss.AGGREGATIONS]
         + [loss.LossSpec("reinforce", aggregation="fixed_length", max_len=9)]
         + [loss.LossSpec("ppo_clip", ratio_level="sequence")]
         + [loss.LossSpec("ppo_clip", ratio_level="token", aggregation=a)
            for a in loss.AGGREGATIONS]
         + [loss.LossSpec("gspo", clip_eps=0.05)]
         + [loss.LossSpec("cispo", clip_eps=0.1, clip_eps_high=0.2, aggregation=a)
            for a in ("token_mean", "sequence_sum")])


@pytest.mark.parametrize("num_micro", [2, 4])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.type}-{s.ratio_level}-{s.aggregation}"
                         f"-{s.max_len}")
def test_microbatch_losses_and_gradients_sum_to_the_minibatch(spec, num_micro):
  logp, old, mask, adv, entropy = _ragged_batch()
  norm = loss.normalizer(spec, mask)

  def value_and_grad(lp, o, m, a, ent, **kw):
    f = lambda x: loss.policy_loss(spec, x, o, m, a, ent, **kw)
    return jax.value_and_grad(f, has_aux=True)(lp)

  (full, full_metrics), full_grad = value_and_grad(logp, old, mask, adv, entropy)
  split = lambda x: jnp.split(x, num_micro)
  parts = [value_and_grad(*xs, normalizer=norm)
           for xs in zip(*map(split, (logp, old, mask, adv, entropy)))]
  total = sum(float(v) for (v, _), _ in parts)
  np.testing.assert_allclose(total, float(full), atol=1e-6)
  np.testing.assert_allclose(jnp.concatenate([g for _, g in parts]), full_grad, atol=1e-6)
  for name, value in full_metrics.items():  # metrics are contributions too ('_max': maxima)
    reduce = max if name.endswith("_max") else sum
    np.testing.assert_allclose(reduce(float(m[name]) for (_, m), _ in parts), float(value),
                               atol=1e-6, err_msg=name)
  assert float(jnp.abs(full_grad).max()) > 0.0
  if spec.type == "ppo_clip":
    assert 0.0 < float(full_metrics["clip_fraction"]) < 1.0  # both branches exercised


def test_microbatch_normalizer_differs_from_each_microbatch_own_for_token_mean():
  # The point of the normaliser: the microbatches' own token means do not sum to the minibatch's.
  logp, old, mask, adv, _ = _ragged_batch()
  spec = loss.LossSpec("reinforce", aggregation="token_mean")
  full = float(loss.policy_loss(spec, logp, old, mask, adv)[0])
  halves = [(x[:4], x[4:]) for x in (logp, old, mask, adv)]
  own = [float(loss.policy_loss(spec, *xs)[0]) for xs in zip(*halves)]
  assert abs(sum(own) / 2 - full) > 1e-3


def test_fixed_length_with_max_len_ignores_trailing_masked_columns():
  logp, old, mask, adv, _ = _ragged_batch()
  pad = lambda x, v: jnp.pad(x, ((0, 0), (0, 5)), constant_values=v)
  spec = loss.LossSpec("reinforce", aggregation="fixed_length", max_len=16)
  short = loss.policy_loss(spec, logp, old, mask, adv)[0]
  long = loss.policy_loss(spec, pad(logp, -1.0), pad(old, -1.0), pad(mask, False), adv)[0]
  np.testing.assert_allclose(long, short, rtol=1e-6)
  np.testing.assert_allclose(short, float(jnp.sum(jnp.where(mask, -adv[:, None] * logp, 0.0)))
                             / (8 * 16), rtol=1e-6)
  # Without max_len the normaliser is the mask's T, so the trailing columns change it.
  trimmed = loss.LossSpec("reinforce", aggregation="fixed_length")
  assert float(loss.policy_loss(trimmed, logp, old, mask, adv)[0]) != pytest.approx(
      float(loss.policy_loss(trimmed, pad(logp, -1.0), pad(old, -1.0), pad(mask, False), adv)[0]))
  # The minibatch normaliser takes the spec's max_len too.
  assert float(loss.normalizer(spec, mask).length) == 16.0
  assert float(loss.normalizer("fixed_length", mask).length) == 6.0


def test_loss_spec_max_len_from_config_and_validation():
  c = types.SimpleNamespace(type="ppo_clip", clip_eps=0.2, clip_eps_high=0.0, ratio_level="token",
                            aggregation="fixed_length")
  assert loss.LossSpec.from_config(c).max_len is None
  spec = loss.LossSpec.from_config(c, max_len=128)
  assert spec.max_len == 128 and spec.aggregation == "fixed_length" and hash(spec)
  with pytest.raises(ValueError, match=r"max_len must be >= 1"):
    loss.LossSpec(max_len=0)
  with pytest.raises(ValueError, match=r"unknown loss aggregation 'mean'"):
    loss.normalizer("mean", jnp.ones((2, 3), bool))

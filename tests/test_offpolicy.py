"""Off-policy corrections and the 2025-26 losses. The sampler-trainer gap (`loss.is_weights`,
`loss.mismatch_metrics`, config.loss.is_correction): weights exactly 1 where the sampler is the
trainer, the truncated and masked variants within their bounds, and on the enumerable toy policy a
batch drawn from another policy corrected by its full sequence ratio has the exact on-policy
gradient. GSPO and CISPO against values and gradients computed by hand."""

import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rloo_jax import advantage, experiment, loss, models, rollout, update
from rloo_jax.algorithms.rloo import RLOO, rollout_rows
from rloo_jax.toy import ToyPolicy
from test_trim import first_batch, tiny_config

pytestmark = pytest.mark.numerics
CORRECTIONS = [c for c in loss.IS_CORRECTIONS if c != "none"]


def _batch(seed=0, gap=0.0):
  rng = np.random.default_rng(seed)
  logp = -rng.random((6, 9)).astype(np.float32) * 3
  mask = np.arange(9)[None, :] < rng.integers(1, 10, 6)[:, None]
  old = logp + gap * rng.standard_normal(logp.shape).astype(np.float32)
  adv = rng.standard_normal(6).astype(np.float32)
  return jnp.asarray(logp), jnp.asarray(old), jnp.asarray(mask), jnp.asarray(adv)


@pytest.mark.parametrize("correction", CORRECTIONS)
def test_with_the_sampler_as_the_trainer_every_weight_is_exactly_one(correction):
  logp, _, mask, adv = _batch()
  w, cut = loss.is_weights(logp, logp, mask, correction)
  np.testing.assert_array_equal(np.asarray(w), np.asarray(mask, np.float32))
  assert not np.asarray(cut).any()
  spec = loss.LossSpec("reinforce", is_correction=correction)
  plain = loss.LossSpec("reinforce")
  value, metrics = loss.policy_loss(spec, logp, logp, mask, adv)
  assert float(value) == float(loss.policy_loss(plain, logp, logp, mask, adv)[0])
  for name in ("logp_abs_diff", "logp_abs_diff_max", "kl_sampler_trainer", "corrected_tokens",
               "corrected_sequences"):
    assert float(metrics[f"mismatch/{name}"]) == 0.0, name


def test_truncated_and_masked_weights_stay_within_their_bounds():
  logp, old, mask, _ = _batch(gap=1.5)
  rho = np.exp(np.asarray(logp) - np.asarray(old))
  m = np.asarray(mask)
  cap, low = 2.0, 0.5
  w, cut = (np.asarray(x) for x in loss.is_weights(logp, old, mask, "tis", cap, low))
  np.testing.assert_allclose(w[m], np.minimum(rho, cap)[m], rtol=1e-6)
  np.testing.assert_array_equal(cut[m], (rho > cap)[m])
  w, cut = (np.asarray(x) for x in loss.is_weights(logp, old, mask, "icepop", cap, low))
  inside = (rho >= low) & (rho <= cap)
  np.testing.assert_allclose(w[m], np.where(inside, rho, 0.0)[m], rtol=1e-6)
  assert 0 < cut[m].sum() < m.sum()
  seq = np.exp(np.where(m, np.asarray(logp) - np.asarray(old), 0.0).sum(-1))
  w, _ = (np.asarray(x) for x in loss.is_weights(logp, old, mask, "seq_tis", cap, low))
  np.testing.assert_allclose(w.max(-1), np.minimum(seq, cap), rtol=1e-5)
  w, cut = (np.asarray(x) for x in loss.is_weights(logp, old, mask, "seq_mask", cap, low))
  np.testing.assert_allclose(w.max(-1), np.where(seq > cap, 0.0, seq), rtol=1e-5)
  assert (w <= cap).all() and (w[~m] == 0).all()
  diff = np.where(m, np.asarray(old) - np.asarray(logp), 0.0)
  metrics = loss.policy_loss(loss.LossSpec("reinforce", is_correction="seq_mask"), logp, old,
                             mask, _batch()[3])[1]
  np.testing.assert_allclose(metrics["mismatch/logp_abs_diff_max"], np.abs(diff).max(), rtol=1e-6)
  np.testing.assert_allclose(metrics["mismatch/kl_sampler_trainer"], diff.sum() / 6, rtol=1e-5)
  np.testing.assert_allclose(metrics["mismatch/corrected_sequences"],
                             (cut.any(-1)).mean(), rtol=1e-6)


def _token_logp(policy, theta, seqs_nl):
  logits = theta[jnp.arange(policy.length), policy._prev(seqs_nl)]  # pylint: disable=protected-access
  return jnp.take_along_axis(jax.nn.log_softmax(logits), seqs_nl[..., None], -1)[..., 0]


def test_full_sequence_importance_sampling_gives_the_exact_on_policy_gradient():
  """Every group of k = 2 sequences drawn by a sampler policy that differs from the trainer's,
  weighted by its probability: the expected RLOO loss gradient with the sequence ratio
  uncapped is minus the exact policy gradient; without the correction it is not."""
  policy = ToyPolicy(vocab=3, length=3, seed=1)
  sampler_theta = policy.theta + 0.4 * jax.random.normal(jax.random.PRNGKey(7),
                                                         policy.theta.shape)
  seqs = policy.sequences
  pairs = jnp.asarray(list(itertools.product(range(len(seqs)), repeat=2)))
  groups = seqs[pairs]  # [G, 2, L]
  p_group = jnp.exp(policy.logp(sampler_theta, groups).sum(-1))
  adv, _ = advantage.call("rloo", policy.reward(groups))
  old = _token_logp(policy, sampler_theta, groups)
  mask = jnp.ones(groups.shape, bool)

  def expected_loss(theta, spec):
    per_group = jax.vmap(lambda g, o, a: loss.policy_loss(
        spec, _token_logp(policy, theta, g), o, mask[0], a)[0])(groups, old, adv)
    return jnp.sum(p_group * per_group)

  exact = np.asarray(policy.exact_gradient())
  full = loss.LossSpec("reinforce", is_correction="seq_tis", is_cap=1e30)
  got = np.asarray(jax.grad(expected_loss)(policy.theta, full))
  np.testing.assert_allclose(-got, exact, atol=1e-5 * np.abs(exact).max())
  biased = np.asarray(jax.grad(expected_loss)(policy.theta, loss.LossSpec("reinforce")))
  assert np.abs(-biased - exact).max() > 0.05 * np.abs(exact).max()


def test_a_corrected_update_runs_unfused_and_reports_the_gap(tmp_path):
  """On the tiny model the sampler's float32 log-probs are the trainer's up to rounding: 'tis'
  gives the uncorrected gradient, and the mismatch metrics measure a gap of rounding size."""
  config = tiny_config()
  algo = RLOO(experiment.build(config, str(tmp_path)))
  state = algo.init_state(models.create(algo.exp.model_config)[1])
  batch = first_batch(algo.exp)
  out, _ = rollout.sample_batch(algo.exp, state.policy_params, batch, jax.random.PRNGKey(0),
                                k=algo.k)
  rows = rollout_rows(algo, batch, out)
  rows = rows.replace(advantages_n=jnp.asarray(
      np.random.default_rng(4).standard_normal(rows.advantages_n.shape), jnp.float32))
  run = lambda spec: update.gradients(state.params, rows, fns=algo.exp.fns, spec=spec,  # noqa
                                      k=algo.k, chunk_size=5)
  tis = loss.LossSpec("reinforce", is_correction="tis")
  assert not update.fuses_head(tis, True)
  (g0, v0, _), (g1, v1, m1) = run(algo.exp.loss_spec), run(tis)
  np.testing.assert_allclose(v1, v0, rtol=1e-4)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5 * float(jnp.abs(b).max()))
  assert 0.0 <= float(m1["mismatch/logp_abs_diff"]) < 1e-5
  assert float(m1["mismatch/logp_abs_diff_max"]) >= float(m1["mismatch/logp_abs_diff"])
  with pytest.raises(ValueError, match=r"config.loss.is_correction with loss.type='ppo_clip' "
                                       r"needs config.loss.old_logprobs='recompute'"):
    config.loss.update(type="ppo_clip", is_correction="tis")
    experiment.validate_config(config)
  with pytest.raises(ValueError, match=r"loss.type='reinforce' has no ratio"):
    config.loss.update(type="reinforce", old_logprobs="recompute")
    experiment.validate_config(config)


# The ratio losses at their first step (theta = the recomputed old policy), each with its
# gradient's factor against REINFORCE's: GSPO's ratio is length-normalised (1 / L).
RATIO_SPECS = [
    (dict(type="ppo_clip", ratio_level="sequence"), 1.0),
    (dict(type="ppo_clip", ratio_level="token"), 1.0),
    (dict(type="cispo", clip_eps=1.0, clip_eps_high=0.28, aggregation="sequence_sum"), 1.0),
    (dict(type="gspo", clip_eps=3e-4, clip_eps_high=4e-4), 1.0 / 3),
]


@pytest.mark.parametrize("kind, factor", RATIO_SPECS, ids=[s["type"] + "_" + s.get(
    "ratio_level", "") for s, _ in RATIO_SPECS])
def test_ratio_losses_corrected_against_the_sampler_give_the_exact_on_policy_gradient(kind,
                                                                                     factor):
  """config.loss.old_logprobs='recompute': the ratio divides by the trainer's log-probs of the
  policy that sampled, and the sequence ratio pi_old / pi_sampler (uncapped) corrects for the
  sampler's: over every group of 2 the sampler could draw, the expected gradient at theta = old
  is minus the exact policy gradient (times the loss's own factor); uncorrected it is not."""
  policy = ToyPolicy(vocab=3, length=3, seed=1)
  sampler_theta = policy.theta + 0.4 * jax.random.normal(jax.random.PRNGKey(7),
                                                         policy.theta.shape)
  seqs = policy.sequences
  groups = seqs[jnp.asarray(list(itertools.product(range(len(seqs)), repeat=2)))]
  p_group = jnp.exp(policy.logp(sampler_theta, groups).sum(-1))
  adv, _ = advantage.call("rloo", policy.reward(groups))
  sampler_logp = _token_logp(policy, sampler_theta, groups)
  mask = jnp.ones(groups.shape[1:], bool)

  def expected_loss(theta, spec):
    def one(g, s, a):
      logp = _token_logp(policy, theta, g)
      return loss.policy_loss(spec, logp, jax.lax.stop_gradient(logp), mask, a,
                              sampler_logp_bt=s)[0]
    return jnp.sum(p_group * jax.vmap(one)(groups, sampler_logp, adv))

  exact = np.asarray(policy.exact_gradient()) * factor
  full = loss.LossSpec(**kind, is_correction="seq_tis", is_cap=1e30)
  got = np.asarray(jax.grad(expected_loss)(policy.theta, full))
  np.testing.assert_allclose(-got, exact, atol=1e-5 * np.abs(exact).max())
  biased = np.asarray(jax.grad(expected_loss)(policy.theta, loss.LossSpec(**kind)))
  assert np.abs(-biased - exact).max() > 0.05 * np.abs(exact).max()


def test_dapo_clip_higher_clips_each_side_at_its_own_epsilon():
  """DAPO's token-level surrogate with clip-higher (eps 0.2 below, 0.28 above), token-mean, by
  hand: a token whose ratio is past 1.28 with A > 0 and one under 0.8 with A < 0 are clipped."""
  old = jnp.zeros((2, 3))
  logp = jnp.array([[0.3, 0.1, 0.0], [-0.3, 0.2, 0.0]])
  mask = jnp.array([[True, True, False], [True, True, True]])
  adv = jnp.array([1.5, -0.5])
  value, m = loss.ppo_clip_loss(logp, old, mask, adv, clip_eps=0.2, clip_eps_high=0.28,
                                ratio_level="token", aggregation="token_mean")
  r = np.exp(np.asarray(logp))
  terms = [min(r[0, 0], 1.28) * 1.5, r[0, 1] * 1.5,  # e^0.3 = 1.35 clipped at 1.28
           max(r[1, 0], 0.8) * -0.5, r[1, 1] * -0.5, 1.0 * -0.5]  # e^-0.3 = 0.74 at 0.8
  assert float(value) == pytest.approx(-np.sum(terms) / 5, rel=1e-6)
  assert float(m["clip_fraction"]) == pytest.approx(2 / 5)


def test_a_recomputed_old_policy_weighs_each_ratio_term_by_the_truncated_gap():
  """With the sampler's log-probs beside the trainer's recomputed ones: token-level PPO's terms
  are each multiplied by min(pi_old / pi_sampler, cap), GSPO's sequence term by the mean of its
  tokens' weights; the metrics measure the sampler against the recomputed policy."""
  logp, sampler, mask, adv = _batch(gap=0.5)
  old = logp - 0.05  # the policy moved a little since the recomputation
  m, a = np.asarray(mask), np.asarray(adv)[:, None]
  w = np.where(m, np.minimum(np.exp(np.asarray(old) - np.asarray(sampler)), 2.0), 0.0)
  r = np.exp(np.asarray(logp) - np.asarray(old))
  term = np.minimum(r * a, np.clip(r, 0.8, 1.2) * a)
  spec = loss.LossSpec("ppo_clip", ratio_level="token", aggregation="token_mean",
                       is_correction="tis")
  value, metrics = loss.policy_loss(spec, logp, old, mask, adv, sampler_logp_bt=sampler)
  np.testing.assert_allclose(float(value), -(w * term)[m].sum() / m.sum(), rtol=1e-5)
  diff = np.where(m, np.asarray(sampler) - np.asarray(old), 0.0)
  np.testing.assert_allclose(metrics["mismatch/logp_abs_diff_max"], np.abs(diff).max(),
                             rtol=1e-6)
  spec = loss.LossSpec("gspo", clip_eps=0.1, is_correction="tis")
  value, _ = loss.policy_loss(spec, logp, old, mask, adv, sampler_logp_bt=sampler)
  s = np.exp((np.log(r) * m).sum(-1) / m.sum(-1))
  seq = np.minimum(s * a[:, 0], np.clip(s, 0.9, 1.1) * a[:, 0])
  w_b = w.sum(-1) / m.sum(-1)
  np.testing.assert_allclose(float(value), -(w_b * seq).sum() / 6, rtol=1e-5)


def test_a_recomputed_old_policy_trains_a_corrected_ratio_loss(tmp_path):
  """old_logprobs='recompute' with ppo_clip and TIS: the update divides by the trainer's own
  log-probs, which on the float32 tiny model are the sampler's up to rounding, so the
  iteration matches the uncorrected one and the gap it logs is of rounding size."""
  from rloo_jax import algorithms  # pylint: disable=import-outside-toplevel
  results = []
  recompute = {"old_logprobs": "recompute", "is_correction": "tis"}
  for extra, packed in (({}, False), (recompute, False), (recompute, True)):
    config = tiny_config()
    if packed:  # both scoring passes read the rows packed once
      config.train.microbatch_tokens = 2 * (config.data.max_prompt_len
                                            + config.rloo.max_new_tokens)
    config.train.num_iterations = 1
    config.train.num_epochs = 2
    # Reward j for sample j of each group (deterministic): every advantage is nonzero.
    config.rewards.fns = [os.path.join(os.path.dirname(__file__),
                                       "test_dynamic_sampling.py:by_position")]
    config.loss.update(type="ppo_clip", **extra)
    results.append(algorithms.run(config, str(tmp_path / str(len(results))))["last_metrics"])
  plain, corrected, packed = results
  for run in (corrected, packed):
    assert run["loss"] == pytest.approx(plain["loss"], rel=1e-3, abs=1e-6)
    assert run["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-3)
    assert 0.0 <= run["mismatch/logp_abs_diff"] < 1e-5
    assert run["mismatch/corrected_tokens"] == 0.0
  assert plain["grad_norm"] > 1e-3
  assert packed["loss"] == pytest.approx(corrected["loss"], rel=1e-4, abs=1e-6)


def test_gspo_clips_the_length_normalised_sequence_ratio():
  logp, old, mask, adv = _batch(seed=2, gap=0.3)
  eps = 0.05
  value, metrics = loss.policy_loss(loss.LossSpec("gspo", clip_eps=eps), logp, old, mask, adv)
  m, a = np.asarray(mask), np.asarray(adv, np.float64)
  d = np.where(m, np.asarray(logp, np.float64) - np.asarray(old, np.float64), 0.0)
  s = np.exp(d.sum(-1) / m.sum(-1))
  terms = np.minimum(s * a, np.clip(s, 1 - eps, 1 + eps) * a)
  np.testing.assert_allclose(value, -terms.mean(), rtol=1e-5)
  clipped = np.clip(s, 1 - eps, 1 + eps) * a < s * a
  np.testing.assert_allclose(metrics["clip_fraction"], clipped.mean(), rtol=1e-6)
  assert 0 < clipped.sum() < len(s)
  # d loss / d logp_t = -A s / |y| / B where the sequence is not clipped, 0 where it is.
  grad = np.asarray(jax.grad(lambda lp: loss.policy_loss(
      loss.LossSpec("gspo", clip_eps=eps), lp, old, mask, adv)[0])(logp))
  want = np.where(m & ~clipped[:, None], (-a * s / m.sum(-1))[:, None] / len(s), 0.0)
  np.testing.assert_allclose(grad, want, rtol=1e-4, atol=1e-7)


def test_cispo_holds_its_clipped_weight_constant_and_keeps_every_tokens_gradient():
  logp, old, mask, adv = _batch(seed=3, gap=0.3)
  lo, hi = 0.1, 0.2
  spec = loss.LossSpec("cispo", clip_eps=lo, clip_eps_high=hi, aggregation="token_mean")
  value, metrics = loss.policy_loss(spec, logp, old, mask, adv)
  m, a = np.asarray(mask), np.asarray(adv, np.float64)
  r = np.exp(np.asarray(logp, np.float64) - np.asarray(old, np.float64))
  w = np.clip(r, 1 - lo, 1 + hi)
  np.testing.assert_allclose(value, np.sum(np.where(m, -w * a[:, None] * np.asarray(logp), 0))
                             / m.sum(), rtol=1e-5)
  np.testing.assert_allclose(metrics["clip_fraction"], ((w != r) & m).sum() / m.sum(),
                             rtol=1e-6)
  assert 0 < ((w != r) & m).sum() < m.sum()
  grad = np.asarray(jax.grad(lambda lp: loss.policy_loss(spec, lp, old, mask, adv)[0])(logp))
  np.testing.assert_allclose(grad, np.where(m, -w * a[:, None] / m.sum(), 0.0), rtol=1e-4,
                             atol=1e-8)
  assert (np.abs(grad[m]) > 0).all()  # clipped tokens too


def test_overlong_shaping_ramps_to_minus_one_at_the_cap_and_shapes_a_run(tmp_path):
  from rloo_jax import algorithms  # pylint: disable=import-outside-toplevel
  from rloo_jax.rewards import overlong  # pylint: disable=import-outside-toplevel
  np.testing.assert_allclose(overlong.penalty([1, 12, 13, 14, 16], 16, 4),
                             [0.0, 0.0, -0.25, -0.5, -1.0])
  assert not overlong.penalty([16], 16, 0).any()
  config = tiny_config()
  config.train.num_iterations = 1
  config.rewards.overlong_buffer = 4
  m = algorithms.run(config, str(tmp_path))["last_metrics"]
  # The untrained policy's completions: some run into the buffer or to the cap.
  assert -1.0 <= m["reward/overlong"] < 0.0
  assert m["reward_mean"] == pytest.approx(m["reward/arithmetic_exact_match"]
                                           + m["reward/overlong"], abs=1e-6)
  with pytest.raises(ValueError, match=r"config.rewards.overlong_buffer=99 is longer than the "
                                       r"cap it counts back from"):
    config.rewards.overlong_buffer = 99
    experiment.validate_config(config)

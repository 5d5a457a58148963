"""Trimming a rollout's completion columns past its longest sample (config.rloo.trim_bucket), and
sampling the rollout batch in chunks of prompts (config.rloo.rollout_chunk_prompts)."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import count_traces, load_config
from numerics import FIXTURE_TERMS, assert_f32_close
from rloo_jax import engine as engine_lib
from rloo_jax import experiment, models, rollout, sampler, update
from rloo_jax.algorithms.rloo import RLOO, rollout_rows, trim_rollout
from rloo_jax.data import pipeline

MAX_NEW_TOKENS = 12
BUCKET = 4


def tiny_config(trim_bucket=0, chunk=0):
  config = load_config()
  config.rloo.max_new_tokens = MAX_NEW_TOKENS
  config.train.num_epochs = 1
  with config.unlocked():
    config.rloo.trim_bucket = trim_bucket
    config.rloo.rollout_chunk_prompts = chunk
  return config


def first_batch(exp, n=4):
  return next(pipeline.prompt_batches(exp.task.train, exp.tokenizer, global_batch_size=n,
                                      max_prompt_len=exp.config.data.max_prompt_len))


def stopped_early(out, lengths_bk, pad_id):
  """The sample output as if sample (b, j) had stopped after lengths_bk[b, j] tokens: everything
  past that end masked, padded and zeroed the way the sampler writes it."""
  keep = np.arange(out.tokens_bkt.shape[2]) < np.asarray(lengths_bk)[..., None]
  return sampler.SampleOutput(
      tokens_bkt=jnp.where(keep, out.tokens_bkt, pad_id),
      logprobs_bkt=jnp.where(keep, out.logprobs_bkt, 0.0),
      policy_logprobs_bkt=jnp.where(keep, out.policy_logprobs_bkt, 0.0),
      mask_bkt=jnp.asarray(keep), lengths_bk=jnp.asarray(lengths_bk, jnp.int32))


# ----------------------------------------------------------------------------------------------
# The arithmetic


def test_trimmed_length_rounds_up_to_the_bucket_and_caps_at_t():
  assert rollout.trimmed_length(5, 4, 16) == 8
  assert rollout.trimmed_length(8, 4, 16) == 8  # a multiple stays
  assert rollout.trimmed_length(1, 32, 256) == 32
  assert rollout.trimmed_length(9, 4, 10) == 10  # 12 capped at T
  assert rollout.trimmed_length(10, 4, 10) == 10
  assert rollout.trimmed_length(0, 4, 10) == 4  # never zero columns...
  assert rollout.trimmed_length(0, 1, 10) == 1
  assert rollout.trimmed_length(3, 0, 10) == 10  # bucket 0: off
  # Every possible longest length lands on one of ceil(T / bucket) lengths.
  for t, bucket in ((12, 4), (10, 4), (7, 32), (64, 5)):
    shapes = {rollout.trimmed_length(n, bucket, t) for n in range(1, t + 1)}
    assert len(shapes) == math.ceil(t / bucket) and max(shapes) == t, (t, bucket)
    assert all(rollout.trimmed_length(n, bucket, t) >= n for n in range(1, t + 1))


def test_trim_output_keeps_the_prefix_and_the_lengths():
  rng = np.random.default_rng(0)
  b, k, t = 3, 2, 10
  lengths = rng.integers(1, 6, (b, k))
  full = sampler.SampleOutput(
      tokens_bkt=jnp.asarray(rng.integers(1, 50, (b, k, t)), jnp.int32),
      logprobs_bkt=jnp.asarray(rng.standard_normal((b, k, t)), jnp.float32),
      policy_logprobs_bkt=jnp.asarray(rng.standard_normal((b, k, t)), jnp.float32),
      mask_bkt=jnp.ones((b, k, t), bool), lengths_bk=jnp.ones((b, k), jnp.int32))
  out = stopped_early(full, lengths, pad_id=0)
  cut = rollout.trim_output(out, 6)
  for name in ("tokens_bkt", "logprobs_bkt", "policy_logprobs_bkt", "mask_bkt"):
    assert getattr(cut, name).shape == (b, k, 6), name
    np.testing.assert_array_equal(getattr(cut, name), np.asarray(getattr(out, name))[:, :, :6])
  np.testing.assert_array_equal(cut.lengths_bk, lengths)
  np.testing.assert_array_equal(np.asarray(cut.mask_bkt).sum(-1), lengths)
  assert rollout.trim_output(out, t) is out
  layout = experiment.sharding_lib.make_layout({"data": -1})
  assert rollout.trim_to_bucket(layout, out, 0) is out
  assert rollout.trim_to_bucket(layout, out, 4).tokens_bkt.shape[2] == 8  # longest 5 -> 8
  assert rollout.trim_to_bucket(layout, out, 3).tokens_bkt.shape[2] == 6
  assert rollout.trim_to_bucket(layout, out, 16).tokens_bkt.shape[2] == t


# ----------------------------------------------------------------------------------------------
# Scoring and update on trimmed rows


@pytest.mark.parametrize("shared_prefix", [True, False])
def test_trimmed_rows_score_and_train_the_same(tmp_path, shared_prefix):
  config = tiny_config(trim_bucket=BUCKET)
  config.train.shared_prefix = shared_prefix
  config.kl.beta = 0.5  # a KL term large enough to show in the advantages
  config.optim.warmup_steps = 0  # a first step that moves the params
  exp = experiment.build(config, str(tmp_path))
  algo = RLOO(exp)
  state = algo.init_state(models.create(exp.model_config)[1])
  # A reference that differs from the policy, so the KL is not zero.
  state = state.replace(ref_params=jax.tree.map(lambda p: p * 0.9, state.ref_params))
  batch = first_batch(exp)
  out, _ = rollout.sample_batch(exp, state.params, batch, jax.random.PRNGKey(0), k=algo.k)
  b, k = out.lengths_bk.shape
  # Samples that stopped after 1..6 of the 12 columns: the trim keeps ceil(6 / 4) * 4 = 8.
  lengths = np.random.default_rng(1).integers(1, 7, (b, k))
  lengths[0, 0] = 6
  out = stopped_early(out, lengths, exp.tokenizer.pad_id)
  cut = trim_rollout(exp, out, exp.loss_spec.aggregation)
  assert cut.tokens_bkt.shape[2] == 8 and out.tokens_bkt.shape[2] == MAX_NEW_TOKENS
  # fixed_length normalises by the column count: trimming would rescale its loss, so it is off,
  # unless that normaliser is fixed (to max_new_tokens).
  assert trim_rollout(exp, out, "fixed_length") is out
  assert trim_rollout(exp, out, "fixed_length", MAX_NEW_TOKENS).tokens_bkt.shape[2] == 8

  rewards = exp.layout.put_global_batch(
      np.random.default_rng(2).standard_normal((b, k)).astype(np.float32))
  usable = exp.layout.put_global_batch(np.ones((b, k), bool))
  results = {}
  for name, o in (("full", out), ("trimmed", cut)):
    rows = rollout_rows(algo, batch, o)
    assert rows.completions_nt.shape == (b * k, o.tokens_bkt.shape[2])
    scored, _ = algo.score_fn(state.ref_params, state.adv_state, rows, rewards, usable)
    rows = rows.replace(advantages_n=scored["advantages_bk"].reshape(-1))
    new_state, m = algo.step_fn(jax.tree.map(jnp.copy, state), rows)
    results[name] = scored, new_state, m
  (s_full, st_full, m_full), (s_cut, st_cut, m_cut) = results["full"], results["trimmed"]
  assert float(jnp.abs(s_full["kl_bk"]).max()) > 1e-3
  assert float(jnp.abs(s_full["advantages_bk"]).max()) > 1e-3
  for key in ("kl_bk", "penalised_bk", "advantages_bk"):
    np.testing.assert_allclose(s_cut[key], s_full[key], rtol=1e-5, atol=1e-6, err_msg=key)
  np.testing.assert_allclose(s_cut["ref_logp_nt"], np.asarray(s_full["ref_logp_nt"])[:, :8],
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(s_full["ref_logp_nt"])[:, 8:], 0.0)
  for key in ("loss", "grad_norm", "entropy"):
    np.testing.assert_allclose(m_cut[key], m_full[key], rtol=1e-5, atol=1e-6, err_msg=key)
  assert float(m_full["grad_norm"]) > 0
  moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), st_full.params, state.params)
  assert max(jax.tree.leaves(moved)) > 0
  for a, c in zip(jax.tree.leaves(st_full.params), jax.tree.leaves(st_cut.params)):
    np.testing.assert_allclose(c, a, rtol=1e-5, atol=1e-6)


def test_iterations_compile_the_train_step_once_per_bucket(tmp_path, monkeypatch):
  """Rollouts whose longest samples end at 2, 7, 12, 3 and 6 of the 12 columns are trained on
  4, 8, 12, 4 and 8 columns: three train-step shapes, ceil(12 / 4), however many iterations."""
  # Counted from a function of their own: programs shared with other tests (`platform.jit`)
  # would hide traces.
  traced = {name: count_traces(monkeypatch, update, name)
            for name in ("gradients", "reference_logprobs", "advantages_of")}
  exp = experiment.build(tiny_config(trim_bucket=BUCKET), str(tmp_path))
  algo = RLOO(exp)
  state = algo.init_state(models.create(exp.model_config)[1])
  longest = iter([2, 7, 12, 3, 6])
  real = rollout.sample_output

  def ending_early(exp_, params, batch, rng, *, k, method=None, slots=0):
    out = real(exp_, params, batch, rng, k=k, method=method, slots=slots)
    lengths = np.minimum(np.asarray(out.lengths_bk), next(longest))
    return stopped_early(out, lengths, exp_.tokenizer.pad_id)

  monkeypatch.setattr(rollout, "sample_output", ending_early)
  columns, p = [], first_batch(exp)["prompt_tokens"].shape[1]
  data = pipeline.prompt_batches(exp.task.train, exp.tokenizer,
                                 global_batch_size=exp.config.rloo.num_prompts,
                                 max_prompt_len=exp.config.data.max_prompt_len)
  for _ in range(5):
    state, m = algo.iteration(state, next(data))
    columns.append(m["update_columns"])
    assert np.isfinite(m["loss"])
    # Tokens per second count the columns computed: update_s recovered from the metric.
    n = exp.config.rloo.num_prompts * algo.k
    np.testing.assert_allclose(n * (p + m["update_columns"]) / m["update_tokens_per_s"],
                               m["update_s"], rtol=1e-6)
  assert columns == [4, 8, 12, 4, 8]
  assert len(traced["gradients"]) == 3 == math.ceil(MAX_NEW_TOKENS / BUCKET)
  assert algo.step_fn._cache_size() == 3
  assert len(traced["reference_logprobs"]) <= 3 and len(traced["advantages_of"]) <= 3


# ----------------------------------------------------------------------------------------------
# Chunked rollouts


@pytest.fixture(scope="module")
def chunk_setup(tmp_path_factory):
  exp = experiment.build(tiny_config(), str(tmp_path_factory.mktemp("chunks")))
  params = models.create(exp.model_config)[1]
  return exp, params, first_batch(exp)


def sample_with_chunks(exp, params, batch, rng, chunk, engine=False):
  """The rollout in chunks of `chunk` prompts: the static sampler chunk by chunk (the default),
  or with `engine` (config.rloo.rollout_engine) the engine in a chunk's slots."""
  exp.config.rloo.update(rollout_chunk_prompts=chunk, rollout_engine=engine)
  try:
    return rollout.sample_batch(exp, params, batch, rng, k=int(exp.config.rloo.k))
  finally:
    exp.config.rloo.update(rollout_chunk_prompts=0, rollout_engine=False)


def assert_same_output(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_chunk_of_the_whole_batch_is_the_unchunked_rollout(chunk_setup):
  exp, params, batch = chunk_setup
  rng = jax.random.PRNGKey(3)
  out, texts = sample_with_chunks(exp, params, batch, rng, 0)
  for chunk in (4, 8):  # the batch, or more
    out_c, texts_c = sample_with_chunks(exp, params, batch, rng, chunk)
    assert_same_output(out_c, out)
    assert texts_c == texts


@pytest.mark.parametrize("chunk", [1, 2])
def test_the_engine_in_a_chunks_slots_draws_the_unchunked_rollout(chunk_setup, chunk,
                                                                  monkeypatch):
  """config.rloo.rollout_engine: a rollout chunked to `chunk` prompts streams the
  whole batch through the engine's chunk * k slots, and draws the unchunked rollout's tokens."""
  exp, params, batch = chunk_setup
  rng = jax.random.PRNGKey(4)
  calls = []
  run = engine_lib.run
  monkeypatch.setattr(engine_lib, "run", lambda *a, **kw: calls.append(kw) or run(*a, **kw))
  out, texts = sample_with_chunks(exp, params, batch, rng, chunk, engine=True)
  assert [kw["slots"] for kw in calls] == [chunk * int(exp.config.rloo.k)]
  whole, whole_texts = sample_with_chunks(exp, params, batch, rng, 0)
  assert len(calls) == 1  # the unchunked rollout: the static sampler
  for name in ("tokens_bkt", "mask_bkt", "lengths_bk"):
    np.testing.assert_array_equal(getattr(out, name), getattr(whole, name))
  # Log-probs as float sums: the engine's ring holds a stream's keys rotated, summed in
  # another order.
  for name in ("logprobs_bkt", "policy_logprobs_bkt"):
    assert_f32_close(getattr(out, name), getattr(whole, name), FIXTURE_TERMS, err_msg=name)
  assert texts == whole_texts


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_chunks_are_sampled_alone_and_concatenated(chunk_setup, chunk):
  exp, params, batch = chunk_setup
  k, t = int(exp.config.rloo.k), MAX_NEW_TOKENS
  rng = jax.random.PRNGKey(4)
  out, texts = sample_with_chunks(exp, params, batch, rng, chunk)
  again, texts_again = sample_with_chunks(exp, params, batch, rng, chunk)
  assert_same_output(again, out)  # deterministic for a fixed rng
  assert texts_again == texts
  assert out.tokens_bkt.shape == (4, k, t) and out.lengths_bk.shape == (4, k)
  assert out.tokens_bkt.sharding.is_equivalent_to(exp.layout.batch_sharding, 3)
  mask, lengths = np.asarray(out.mask_bkt), np.asarray(out.lengths_bk)
  np.testing.assert_array_equal(mask.sum(-1), lengths)
  np.testing.assert_array_equal(mask, np.arange(t) < lengths[..., None])  # a prefix
  assert len(texts) == 4 * k
  assert texts == rollout.decode_completions(exp.tokenizer,
                                             np.asarray(out.tokens_bkt).reshape(4 * k, t),
                                             lengths.reshape(-1))
  # Chunk i is the rollout of its prompts alone with fold_in(rng, i).
  for i, start in enumerate(range(0, 4, chunk)):
    part = {name: v[start:start + chunk] for name, v in batch.items()}
    alone, alone_texts = sample_with_chunks(exp, params, part, jax.random.fold_in(rng, i), 0)
    for x, y in zip(jax.tree.leaves(out), jax.tree.leaves(alone)):
      np.testing.assert_array_equal(np.asarray(x)[start:start + chunk], np.asarray(y))
    assert texts[start * k:(start + chunk) * k] == alone_texts
  # The chunks draw other samples than the unchunked rollout (with rng), not the same ones.
  unchunked, _ = sample_with_chunks(exp, params, batch, rng, 0)
  assert not np.array_equal(np.asarray(unchunked.tokens_bkt), np.asarray(out.tokens_bkt))


@pytest.mark.parametrize("shared_prefix", [True, False], ids=["grouped", "sequence"])
@pytest.mark.parametrize("aggregation", ["sequence_sum", "token_mean"])
def test_microbatched_reference_pass_and_gradient_equal_one_pass(tmp_path, shared_prefix,
                                                                 aggregation):
  """train.microbatch_size changes memory, not the algorithm: the reference log-probs, the
  gradient, the loss and the metrics of 2 and 4 microbatches equal one pass over the rows."""
  config = tiny_config()
  config.train.shared_prefix = shared_prefix
  config.loss.aggregation = aggregation
  exp = experiment.build(config, str(tmp_path))
  algo = RLOO(exp)
  state = algo.init_state(models.create(exp.model_config)[1])
  batch = first_batch(exp)
  out, _ = rollout.sample_batch(exp, state.params, batch, jax.random.PRNGKey(0), k=algo.k)
  b, k = out.lengths_bk.shape
  # Ragged lengths, so token_mean's whole-minibatch normaliser differs from each microbatch's.
  out = stopped_early(out, np.random.default_rng(3).integers(1, MAX_NEW_TOKENS + 1, (b, k)),
                      exp.tokenizer.pad_id)
  rows = rollout_rows(algo, batch, out)
  rows = rows.replace(advantages_n=jnp.asarray(
      np.random.default_rng(4).standard_normal(b * k), jnp.float32))
  units = rows.num_units
  results = {}
  for m in (1, 2, 4):
    ref = update.reference_logprobs(state.ref_params, rows, fns=exp.fns, k=k, chunk_size=5,
                                    microbatches=m)
    grads, value, metrics = update.gradients(state.params, rows, fns=exp.fns,
                                             spec=exp.loss_spec, k=k, chunk_size=5,
                                             microbatches=m)
    results[m] = ref, grads, value, metrics
    assert units % m == 0
  ref1, grads1, value1, metrics1 = results[1]
  assert float(jnp.abs(value1)) > 0
  # The same rows with the head's gradient in a second pass (config.train.fused_head_grad off)
  # at 1 and 2 microbatches: test_head_loss's update property for these four cases, here so
  # that the fused gradients above are not computed a second time there.
  assert update.fuses_head(exp.loss_spec, True)  # reinforce: linear, so the head is fused
  for m in (1, 2):
    assert_fused_equals_two_pass(
        update.gradients(state.params, rows, fns=exp.fns, spec=exp.loss_spec, k=k, chunk_size=5,
                         microbatches=m, fused_head=False), results[m][1:])
  for m in (2, 4):
    ref, grads, value, metrics = results[m]
    np.testing.assert_allclose(ref, ref1, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(value, value1, rtol=1e-5, atol=1e-7)
    for name in metrics1:
      np.testing.assert_allclose(metrics[name], metrics1[name], rtol=1e-4, atol=1e-6,
                                 err_msg=name)
    for g, g1 in zip(jax.tree.leaves(grads), jax.tree.leaves(grads1)):
      np.testing.assert_allclose(g, g1, rtol=1e-4, atol=1e-6)


def assert_fused_equals_two_pass(two_pass, fused):
  """`update.gradients`' (grads, loss, metrics) with the head's gradient fused into the
  log-prob pass equal the two-pass ones (test_head_loss)."""
  (grads0, value0, metrics0), (grads1, value1, metrics1) = two_pass, fused
  assert float(jnp.abs(value0)) > 0
  np.testing.assert_allclose(value1, value0, rtol=1e-5, atol=1e-7)
  assert set(metrics1) == set(metrics0)
  for name in metrics0:
    np.testing.assert_allclose(metrics1[name], metrics0[name], rtol=1e-5, atol=1e-6,
                               err_msg=name)
  leaves0, leaves1 = jax.tree.leaves(grads0), jax.tree.leaves(grads1)
  assert jax.tree.structure(grads1) == jax.tree.structure(grads0)
  scale = max(float(jnp.abs(g).max()) for g in leaves0)
  assert scale > 0
  for g1, g0 in zip(leaves1, leaves0):
    np.testing.assert_allclose(g1, g0, rtol=1e-4, atol=1e-5 * scale)


def test_the_reference_pass_is_dispatched_before_the_rewards_are_scored(tmp_path):
  """The reference's log-probs need only the completions: RLOO dispatches them before it
  scores the rewards on the host, so the devices run the pass while a slow verifier or judge
  works: the rewards see a reference pass already in flight."""
  exp = experiment.build(tiny_config(trim_bucket=BUCKET), str(tmp_path))
  algo = RLOO(exp)
  state = algo.init_state(models.create(exp.model_config)[1])
  events = []
  reference_fn = algo.reference_fn

  def reference(*a):
    events.append("reference")
    return reference_fn(*a)

  reference.pack = reference_fn.pack
  algo.reference_fn = reference
  rewards = exp.rewards

  def recording(*args, **kwargs):
    events.append("rewards")
    return rewards(*args, **kwargs)

  exp.rewards = recording
  batch = first_batch(exp)
  _, m = algo.iteration(state, batch)
  assert events == ["reference", "rewards"]
  assert {"rollout_s", "reward_s", "reference_s"} <= set(m) and np.isfinite(m["kl"])

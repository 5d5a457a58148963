"""The head's gradient computed in the log-prob pass (rloo_jax/head_loss.py): the same value and
gradients as autodiff through loss.chunked_logprobs, with one head pass fewer; and the update's
gradient with config.train.fused_head_grad on equal to the two-pass one."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import assert_f32_close

from rloo_jax import experiment, head_loss, loss, models, policy_init, rollout, update
from rloo_jax.algorithms.rloo import RLOO, rollout_rows
from test_lora_train import lora_smoke
from test_trim import (MAX_NEW_TOKENS, assert_fused_equals_two_pass, first_batch, stopped_early,
                       tiny_config)

B, T, E, V = 3, 7, 5, 11


def _head(p, h):
  """A final RMS norm and an unembedding, as the models' heads are."""
  hn = h * jax.lax.rsqrt(jnp.mean(jnp.square(h.astype(jnp.float32)), -1, keepdims=True) + 1e-6)
  return (hn * p["scale"]).astype(h.dtype) @ p["w"].astype(h.dtype)


def _inputs(dtype=jnp.float32):
  k = jax.random.split(jax.random.PRNGKey(0), 5)
  params = {"w": jax.random.normal(k[0], (E, V)),
            "scale": 1.0 + 0.1 * jax.random.normal(k[1], (E,))}
  hidden = jax.random.normal(k[2], (B, T, E)).astype(dtype)
  targets = jax.random.randint(k[3], (B, T), 0, V)
  coef = jax.random.normal(k[4], (B, T))
  return params, hidden, targets, coef


def _two_pass(params, hidden, targets, coef, chunk_size):
  logp, _ = loss.chunked_logprobs(_head, params, hidden, targets, chunk_size=chunk_size)
  return jnp.sum(coef * logp)


def _fused(params, hidden, targets, coef, chunk_size):
  return head_loss.linear_logprob_loss(_head, params, hidden, targets, coef,
                                       chunk_size=chunk_size)[0]


@pytest.mark.numerics
@pytest.mark.parametrize("chunk_size", [1, 3, T, 10])
def test_value_and_gradients_equal_autodiff_through_chunked_logprobs(chunk_size):
  params, hidden, targets, coef = _inputs()
  args = (params, hidden, targets, coef, chunk_size)
  # A sum of B*T products: its rounding is relative to the sum of their magnitudes.
  logp, _ = loss.chunked_logprobs(_head, params, hidden, targets, chunk_size=chunk_size)
  assert_f32_close(jax.jit(_fused, static_argnums=4)(*args), _two_pass(*args), B * T * V,
                   scale=float(jnp.sum(jnp.abs(coef * logp))))
  for argnums in [(0, 1, 3), (0,), (1,), (3,)]:
    want = jax.grad(_two_pass, argnums)(*args)
    got = jax.jit(jax.grad(_fused, argnums), static_argnums=4)(*args)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      assert float(jnp.abs(w).max()) > 0
      np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6)


def test_logprobs_and_entropies_equal_chunked_logprobs_and_carry_no_gradient():
  params, hidden, targets, coef = _inputs()
  _, logp, ent = head_loss.linear_logprob_loss(_head, params, hidden, targets, coef,
                                               chunk_size=3, with_entropy=True)
  want_logp, want_ent = loss.chunked_logprobs(_head, params, hidden, targets, chunk_size=3,
                                              with_entropy=True)
  np.testing.assert_allclose(logp, want_logp, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(ent, want_ent, rtol=1e-6, atol=1e-6)
  aux = lambda h: jnp.sum(head_loss.linear_logprob_loss(
      _head, params, h, targets, coef, chunk_size=3, with_entropy=True)[1])
  assert float(jnp.abs(jax.grad(aux)(hidden)).max()) == 0.0


def test_bfloat16_hidden_states_get_a_bfloat16_gradient_close_to_float32s():
  params, hidden, targets, coef = _inputs(jnp.bfloat16)
  grad = jax.grad(_fused, 1)(params, hidden, targets, coef, 3)
  assert grad.dtype == jnp.bfloat16
  want = jax.grad(_two_pass, 1)(params, hidden, targets, coef, 3)
  np.testing.assert_allclose(grad.astype(jnp.float32), want.astype(jnp.float32), atol=2e-2)


def _dots(fn, *args) -> int:
  return str(jax.make_jaxpr(fn)(*args)).count("dot_general")


def test_one_head_pass_fewer_and_no_product_for_what_is_not_differentiated():
  """Per chunk: autodiff's two passes run four head products (the forward's logits; the
  backward's recomputed logits, d hidden and d weights); the fused pass three, two when the
  head is frozen (LoRA: the hidden states' gradient only), one without a gradient."""
  args = _inputs()
  two_pass, fused = (functools.partial(f, chunk_size=3) for f in (_two_pass, _fused))
  assert _dots(jax.grad(two_pass, (0, 1)), *args) == 4
  assert _dots(jax.grad(fused, (0, 1)), *args) == 3
  assert _dots(jax.grad(fused, 1), *args) == 2
  # The head's own parameters alone still take three: the final norm's scale needs the
  # normalised hidden states' gradient, a product through the unembedding.
  assert _dots(jax.grad(fused, 0), *args) == 3
  assert _dots(fused, *args) == 1


def test_a_coefficient_shape_that_does_not_match_the_targets_is_refused():
  params, hidden, targets, coef = _inputs()
  with pytest.raises(ValueError, match=r"coef shape \(3, 6\) does not match targets shape"):
    head_loss.linear_logprob_loss(_head, params, hidden, targets, coef[:, :6], chunk_size=3)


@pytest.mark.parametrize("aggregation", loss.AGGREGATIONS)
def test_linear_coefficients_reproduce_the_reinforce_loss(aggregation):
  rng = np.random.default_rng(0)
  mask = jnp.asarray(rng.random((4, 6)) < 0.7)
  adv = jnp.asarray(rng.standard_normal(4), jnp.float32)
  spec = loss.LossSpec(aggregation=aggregation, max_len=8)
  coef = loss.linear_coefficients(spec, mask, adv)
  for seed in range(3):
    logp = jnp.asarray(np.random.default_rng(seed).standard_normal((4, 6)), jnp.float32)
    want = loss.policy_loss(spec, logp, logp, mask, adv)[0]
    np.testing.assert_allclose(jnp.sum(coef * logp), want, rtol=1e-6, atol=1e-7)
  assert float(jnp.abs(jnp.where(mask, 0.0, coef)).max()) == 0.0


def test_linear_coefficients_refuse_a_loss_that_is_not_linear():
  with pytest.raises(ValueError, match=r"'ppo_clip' is not linear in the log-probs"):
    loss.linear_coefficients(loss.LossSpec(type="ppo_clip"), jnp.ones((2, 3), bool),
                             jnp.ones(2))


def _rows(algo, state, seed=0):
  exp = algo.exp
  batch = first_batch(exp)
  out, _ = rollout.sample_batch(exp, state.policy_params, batch, jax.random.PRNGKey(seed),
                                k=algo.k)
  b, k = out.lengths_bk.shape
  # Ragged lengths, so the aggregations' normalisers differ between microbatches.
  lengths = np.random.default_rng(3).integers(1, MAX_NEW_TOKENS + 1, (b, k))
  rows = rollout_rows(algo, batch, stopped_early(out, lengths, exp.tokenizer.pad_id))
  return rows.replace(advantages_n=jnp.asarray(
      np.random.default_rng(4).standard_normal(b * k), jnp.float32))


def _assert_fused_equals_two_pass(algo, state, rows, microbatches):
  exp = algo.exp
  args = algo.step_fn._grad_args(state, rows)  # pylint: disable=protected-access
  assert_fused_equals_two_pass(
      *[update.gradients(*args, fns=exp.fns, spec=exp.loss_spec, k=algo.k, chunk_size=5,
                         microbatches=microbatches, fused_head=fused) for fused in (False, True)])


# sequence_sum and token_mean: test_trim's test_microbatched_reference_pass_and_gradient_equal_
# one_pass compares the two-pass gradient with the fused one it computes anyway, on these rows.
@pytest.mark.parametrize("shared_prefix", [True, False], ids=["grouped", "sequence"])
@pytest.mark.parametrize("aggregation", ["fixed_length"])
def test_the_update_gradient_is_the_two_pass_one(tmp_path, shared_prefix, aggregation):
  config = tiny_config()
  config.train.shared_prefix = shared_prefix
  config.loss.aggregation = aggregation
  algo = RLOO(experiment.build(config, str(tmp_path)))
  assert algo.exp.loss_spec.type == "reinforce"
  state = algo.init_state(models.create(algo.exp.model_config)[1])
  rows = _rows(algo, state)
  for microbatches in (1, 2):
    _assert_fused_equals_two_pass(algo, state, rows, microbatches)


def test_with_lora_the_frozen_head_gets_no_gradient_and_the_adapters_the_same(tmp_path):
  algo = RLOO(experiment.build(lora_smoke(), str(tmp_path)))
  state = algo.init_state(policy_init.create_params(algo.exp, seed=3))
  assert state.lora
  _assert_fused_equals_two_pass(algo, state, _rows(algo, state), 1)


@pytest.mark.parametrize("fused_head_grad, loss_type, used", [
    (True, "reinforce", True), (False, "reinforce", False), (True, "ppo_clip", False)])
def test_the_trainer_fuses_the_head_pass_only_where_asked_and_the_loss_allows(
    tmp_path, fused_head_grad, loss_type, used):
  config = tiny_config()
  config.train.fused_head_grad = fused_head_grad
  config.loss.type = loss_type
  algo = RLOO(experiment.build(config, str(tmp_path)))
  assert algo.step_fn.fused_head is used
  state = algo.init_state(models.create(algo.exp.model_config)[1])
  rows = _rows(algo, state)
  # The compiled program is the fused one exactly when the trainer says so.
  args = algo.step_fn._grad_args(state, rows)  # pylint: disable=protected-access
  dots = lambda fn: fn.lower(*args).as_text().count("dot_general")  # noqa: E731
  by_choice = {fused: dots(jax.jit(functools.partial(
      update.gradients, fns=algo.exp.fns, spec=algo.exp.loss_spec, k=algo.k,
      chunk_size=int(config.train.logprob_chunk_size), fused_head=fused)))
      for fused in (False, True)}
  if loss_type == "reinforce":
    assert by_choice[True] != by_choice[False]
  assert dots(algo.step_fn.grad_fn) == by_choice[used]


def test_positions_with_a_zero_coefficient_cannot_poison_the_value():
  """A masked position (coefficient 0) whose hidden state is not finite: the value stays the
  clean one, as the two-pass path's masked log-probs keep it, and so do the other positions'
  hidden-state gradients. (The head weights' gradient multiplies that hidden state by zero and
  is NaN in both paths.)"""
  params, hidden, targets, coef = _inputs()
  coef = coef.at[1, 4:].set(0.0)
  poisoned = hidden.at[1, 5].set(jnp.nan)
  value, grad = jax.value_and_grad(_fused, 1)(params, poisoned, targets, coef, 3)
  np.testing.assert_allclose(value, _fused(params, hidden, targets, coef, 3), rtol=1e-6)
  want = jax.grad(_fused, 1)(params, hidden, targets, coef, 3)
  keep = np.ones((B, T), bool)
  keep[1, 5] = False
  np.testing.assert_allclose(np.asarray(grad)[keep], np.asarray(want)[keep], rtol=1e-6)

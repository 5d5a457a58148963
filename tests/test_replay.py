"""The update step that replays the rollout's matmul outputs (config.train.reuse_rollout_activations).

The sampler records every trunk matmul output of the prefill and the decode steps; the grouped
forward of the first update step returns them through `_replayed_matmul` instead of recomputing
them. Its logits and gradients must equal the recomputed forward's up to float rounding, for every
model family, both decode-cache forms, prompts of different lengths and completions that end early.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rloo_jax import sampler, sampling, trainer
from rloo_jax.models import TransformerConfig, abstract, model_fns, transformer

TINY = dict(vocab_size=61, hidden_size=32, num_layers=2, num_heads=4, head_dim=8,
            intermediate_size=48, max_seq_len=64)
CONFIGS = {
    'llama': TransformerConfig.llama(num_kv_heads=2, **TINY),   # GQA
    'qwen2': TransformerConfig.qwen2(num_kv_heads=1, **TINY),   # MQA, tied head, qkv bias
    'gpt2': TransformerConfig.gpt2(**TINY),                     # learned positions, LayerNorm
}
B, K, T = 3, 3, 6


def random_params(config, seed=0, scale=0.3):
  graphdef, abstract_params = abstract(config)
  rng = np.random.default_rng(seed)
  return graphdef, jax.tree.map(
      lambda s: jnp.asarray(scale * rng.standard_normal(s.shape), s.dtype), abstract_params)


def rollout(fns, params, p, *, eos_id, method=sampling.Temperature(1.0), record=True, rng=0,
            lengths=(0, 2, 3), activations_buffer=None):
  """Right-padded prompts of p columns (lengths p - lengths) and their sampled completions."""
  lengths = p - np.array(lengths, np.int32)
  tokens = np.random.default_rng(7).integers(3, fns.config.vocab_size,
                                             (len(lengths), p)).astype(np.int32)
  tokens = np.where(np.arange(p)[None] < lengths[:, None], tokens, 0)
  out = sampler.sample(fns, params, tokens, lengths, jax.random.key(rng), k=K, max_new_tokens=T,
                       method=method, eos_id=eos_id, pad_id=0, record_activations=record,
                       activations_buffer=activations_buffer)
  return tokens, lengths, out


def grouped_pair(fns, params, tokens, lengths, out):
  """(recomputed, replayed) grouped logits as functions of params, and the completion mask."""
  b = tokens.shape[0]
  comp = out.tokens_bkt.reshape(b * K, T)
  cmask = out.mask_bkt.reshape(b * K, T)
  inputs = trainer.model_inputs(tokens, lengths, comp, cmask, K, True)
  args = (inputs['prompt_tokens'], inputs['prompt_positions'], inputs['prompt_mask'], comp,
          inputs['completion_positions'], cmask)
  return (lambda prm: fns.grouped(prm, *args),
          lambda prm: fns.grouped(prm, *args, saved=out.activations), np.asarray(cmask))


def assert_same_logits_and_grads(fns, params, tokens, lengths, out):
  recomputed, replayed, cmask = grouped_pair(fns, params, tokens, lengths, out)
  a, b = jax.jit(recomputed)(params), jax.jit(replayed)(params)
  # Scored positions only: a slot the decode loop never reached (every stream done) holds zeros.
  np.testing.assert_allclose(np.asarray(b)[cmask], np.asarray(a)[cmask], atol=2e-5, rtol=1e-5)
  w = jnp.asarray(np.random.default_rng(3).standard_normal(a.shape) * cmask[..., None],
                  jnp.float32)
  ga = jax.jit(jax.grad(lambda prm: jnp.sum(recomputed(prm) * w)))(params)
  gb = jax.jit(jax.grad(lambda prm: jnp.sum(replayed(prm) * w)))(params)
  scale = max(float(jnp.abs(x).max()) for x in jax.tree.leaves(ga))
  assert scale > 1e-3
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(ga), jax.tree.leaves(gb)):
    np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-5 * scale, err_msg=str(path))


@pytest.mark.parametrize('family', list(CONFIGS))
@pytest.mark.parametrize('p', [6, 20], ids=['copied_prefix', 'shared_prefix'])
def test_replayed_forward_equals_recomputed(family, p):
  """Logits and every parameter's gradient, with one stream ended by EOS after its 2nd token."""
  config = CONFIGS[family]
  assert (p <= transformer.COPY_PREFIX_MAX_LEN) == (p == 6)  # both cache forms are covered
  graphdef, params = random_params(config, seed=1)
  fns = model_fns(graphdef)
  _, _, probe = rollout(fns, params, p, eos_id=config.vocab_size + 1, record=False)
  # The same rng draws the same tokens: making stream (0, 1)'s 2nd token the end token ends it.
  eos = int(probe.tokens_bkt[0, 1, 1])
  tokens, lengths, out = rollout(fns, params, p, eos_id=eos)
  assert int(out.lengths_bk[0, 1]) == 2 and int(out.lengths_bk.max()) == T
  widths = dict(transformer.activation_layout(config))
  assert widths['qkv'] == (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
  shapes = [[y.shape for y in layer] for layer in out.activations]
  assert shapes == [[(B, p + (T - 1) * K, w) for w in widths.values()]] * config.num_layers
  assert sum(widths.values()) * config.num_layers == transformer.activation_width(config)
  assert_same_logits_and_grads(fns, params, tokens, lengths, out)


def test_replay_after_the_decode_loop_stopped_early():
  """The greedy streams of one prompt are identical, so an end token they all emit early stops
  the loop: later slots are never written; the scored positions and the gradient still match."""
  config = CONFIGS['llama']
  graphdef, params = random_params(config, seed=2)
  fns = model_fns(graphdef)
  greedy = functools.partial(rollout, fns, params, 6, method=sampling.Greedy(), lengths=(1,))
  probe = greedy(eos_id=config.vocab_size + 1, record=False)[2]
  first = np.asarray(probe.tokens_bkt[0, 0])
  # The first token that did not occur before it: the streams end there, after >= 2 tokens.
  stop = next(t for t in range(1, T - 1) if first[t] not in first[:t])
  tokens, lengths, out = greedy(eos_id=int(first[stop]))
  assert np.all(np.asarray(out.lengths_bk) == stop + 1)
  for y in jax.tree.leaves(out.activations):
    assert not np.any(np.asarray(y)[:, 6 + stop * K:])  # rows never written
  assert_same_logits_and_grads(fns, params, tokens, lengths, out)
  # Written over a full-length rollout's buffers (donated), the rows this loop never reaches
  # keep that rollout's values: still finite, still masked, the same logits and gradients.
  full = greedy(eos_id=config.vocab_size + 1)[2]
  tokens, lengths, reused = greedy(eos_id=int(first[stop]), activations_buffer=full.activations)
  stale = [np.asarray(y)[:, 6 + stop * K:] for y in jax.tree.leaves(reused.activations)]
  assert all(np.all(np.isfinite(y)) for y in stale) and any(np.any(y) for y in stale)
  for a, b in zip(jax.tree.leaves(out.activations), jax.tree.leaves(reused.activations)):
    np.testing.assert_array_equal(np.asarray(b)[:, :6 + stop * K], np.asarray(a)[:, :6 + stop * K])
  assert_same_logits_and_grads(fns, params, tokens, lengths, reused)
  with pytest.raises(ValueError, match=r'activations_buffer has shapes .* pass the activations '
                                       r'of a rollout with the same batch'):
    rollout(fns, params, 6, eos_id=5, activations_buffer=reused.activations)  # 3 prompts, not 1


def test_recording_leaves_the_samples_unchanged():
  graphdef, params = random_params(CONFIGS['qwen2'], seed=3)
  fns = model_fns(graphdef)
  plain = rollout(fns, params, 6, eos_id=5, record=False)[2]
  recorded = rollout(fns, params, 6, eos_id=5)[2]
  assert plain.activations is None
  np.testing.assert_array_equal(recorded.tokens_bkt, plain.tokens_bkt)
  # The prefill's q/k/v become one fused matmul when recorded: float rounding only.
  np.testing.assert_allclose(recorded.policy_logprobs_bkt, plain.policy_logprobs_bkt, atol=1e-5)
  with pytest.raises(ValueError, match="record_activations needs mode='shared'"):
    sampler.sample(fns, params, np.ones((1, 4), np.int32), np.array([4]), jax.random.key(0),
                   k=2, max_new_tokens=3, method=sampling.Greedy(), eos_id=2, pad_id=0,
                   mode='unshared', record_activations=True)


def test_replayed_matmul_gradients_are_the_matmuls():
  """The custom VJP alone: dx = g W^T and dW = x^T g, whatever value was recorded."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((2, 3, 4)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((4, 5)), jnp.float32)
  g = jnp.asarray(rng.standard_normal((2, 3, 5)), jnp.float32)
  y = x.reshape(6, 4) @ w
  value, vjp = jax.vjp(lambda x, w: transformer._replayed_matmul(x, w, y.reshape(2, 3, 5)), x, w)
  np.testing.assert_array_equal(value, y.reshape(2, 3, 5))
  dx, dw = vjp(g)
  np.testing.assert_allclose(dx, g @ w.T, rtol=1e-6)
  np.testing.assert_allclose(dw, x.reshape(6, 4).T @ g.reshape(6, 5), rtol=1e-5)


# ----------------------------------------------------------------------------------------------
# The trainer


def parity_reward(prompts, completions, **fields):
  """Fraction of even characters: varies within a group, so the advantages are not zero."""
  return [sum(ord(ch) % 2 == 0 for ch in s) / max(len(s), 1) for s in completions]


@pytest.mark.parametrize('minibatches', [1, 2])
def test_trainer_iteration_with_replay_equals_recomputed(tmp_path, minibatches):
  """One iteration of the smoke config from the same (perturbed) state with the flag on and off:
  the same loss and gradient norm, and the replayed step did run (once, first); the recording
  is kept for the next rollout to write over."""
  from test_trainer import load_config
  from rloo_jax.data import pipeline
  config = load_config()
  config.train.update(num_epochs=2, num_minibatches=minibatches)
  with config.unlocked():
    config.rewards.fns = [parity_reward]
    config.rewards.weights = [1.0]
  results, params_after = {}, {}
  for reuse in (True, False):
    config.train.reuse_rollout_activations = reuse
    exp = trainer.build(config, str(tmp_path))
    params = trainer.transformer.create(exp.model_config)[1]
    # Away from the near-uniform initialisation, so the gradient is not float noise.
    leaves = jax.tree.leaves(params)
    noise = np.random.default_rng(0)
    params = jax.tree.unflatten(jax.tree.structure(params), [
        x + 0.05 * jnp.asarray(noise.standard_normal(x.shape), x.dtype) for x in leaves])
    state = trainer.init_state(exp, params)
    calls = []
    if reuse:
      replay = exp.replay_step_fn
      exp.replay_step_fn = lambda *a: calls.append(1) or replay(*a)
    batch = next(pipeline.prompt_batches(exp.task.train, exp.tokenizer, global_batch_size=4,
                                         max_prompt_len=config.data.max_prompt_len))
    state, results[reuse] = trainer.rl_iteration(exp, state, batch)
    params_after[reuse] = state.params
    assert len(calls) == int(reuse)
    assert ("activations" in exp.workspace) == reuse
  assert results[True]["reward_std"] > 0 and results[True]["grad_norm"] > 1e-3
  for key in ("kl", "advantage_abs_max", "loss", "grad_norm", "entropy"):
    np.testing.assert_allclose(results[True][key], results[False][key], rtol=2e-4, atol=1e-6,
                               err_msg=key)
  diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in
             zip(jax.tree.leaves(params_after[True]), jax.tree.leaves(params_after[False])))
  assert diff < 0.1 * config.optim.learning_rate  # Adam's steps agree to a fraction of one


def test_flag_needs_the_shared_prefix_rows(tmp_path):
  from test_trainer import load_config
  config = load_config()
  config.train.shared_prefix = False
  with pytest.raises(ValueError, match=r"reuse_rollout_activations .* needs "
                                       r"config\.train\.shared_prefix=True and "
                                       r"config\.rloo\.sampler_mode='shared' \(got False and "
                                       r"'shared'\)"):
    trainer.validate_config(config)
  config.train.reuse_rollout_activations = False
  trainer.validate_config(config)

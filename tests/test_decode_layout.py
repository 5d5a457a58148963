"""The decode's matmuls with the weights on the left (`sampler.sample(weights_left=True)`,
config.rloo.decode_matmul): the same tokens as the kernels as stored, in every family's layer
shape, with the program keeping the weights-left form; and how the config resolves it."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rloo_jax import experiment, models, sampler, sampler_args, sampling
from rloo_jax.config_utils import base_config
from rloo_jax.models import decode_weights
from test_sampler import _tiny  # the 3-layer model of every family that its decode tests use

PAD = 0


def _prompts(width, lengths=(7, 2, 5)):
  rng = np.random.default_rng(4)
  tokens = rng.integers(1, 47, (len(lengths), width)).astype(np.int32)
  for i, n in enumerate(lengths):
    tokens[i, n:] = PAD
  return jnp.asarray(tokens), jnp.asarray(lengths, jnp.int32)


def _sample(fns, params, tokens, lengths, weights_left, mode='shared'):
  out = sampler.sample(fns, params, tokens, lengths, jax.random.key(3), k=3, max_new_tokens=10,
                       method=sampling.Temperature(1.0), eos_id=47, pad_id=PAD, mode=mode,
                       unstack_layers=True, weights_left=weights_left)
  return jax.tree.map(np.asarray, out)


# Llama (untied head, GQA), Gemma 3 (sliding layers, (1 + w) and q/k norms, tied head), GPT-2
# (LayerNorm, biased GELU MLP, tied head), Qwen2 (q/k/v biases), Pythia (parallel residual).
# Width 12: the prompt copied into the streams; 20: kept once per prompt.
@pytest.mark.parametrize('family, overrides, width', [
    ('llama', dict(tie_embeddings=False), 12), ('llama', dict(tie_embeddings=False), 20),
    ('gemma3', {}, 20), ('gpt2', {}, 12), ('qwen2', {}, 20),
    ('gpt_neox', dict(tie_embeddings=False), 12)])
def test_weights_left_decode_draws_what_the_stored_kernels_draw(family, overrides, width):
  graphdef, params = models.create(_tiny(family, **overrides))
  fns = models.model_fns(graphdef)
  tokens, lengths = _prompts(width)
  plain, left = (_sample(fns, params, tokens, lengths, w) for w in (False, True))
  np.testing.assert_array_equal(plain.tokens_bkt, left.tokens_bkt)
  np.testing.assert_allclose(plain.policy_logprobs_bkt, left.policy_logprobs_bkt,
                             rtol=1e-5, atol=1e-5)
  assert left.mask_bkt.sum() > 3 * 3  # the streams decoded past their first tokens


@pytest.mark.parametrize('tie', [True, False])
def test_left_kernels_are_the_stored_kernels_as_out_by_in_matrices(tie):
  """Each layer's matrices are its kernels transposed (q/k/v fused per kv head, as the decode's
  fused projection lays them out); the head is the embedding itself when tied."""
  config = _tiny('llama', tie_embeddings=tie)
  graphdef, params = models.create(config)
  fns = models.model_fns(graphdef)
  _, layers = fns.decode_weights(params, True, weights_left=True)
  e, f, hq, hkv, d = 32, 64, 4, 2, 8
  g = hq // hkv
  layer = params['layers']
  left = layers.left[1]
  assert {k: v.shape for k, v in left.items()} == {
      'qkv': (hkv * (g + 2) * d, e), 'o': (e, hq * d), 'gate': (f, e), 'up': (f, e),
      'down': (e, f)}
  np.testing.assert_array_equal(left['up'], np.asarray(layer['mlp']['up_kernel'][...][1]).T)
  np.testing.assert_array_equal(left['o'],
                                np.asarray(layer['attn']['o_kernel'][...][1]).reshape(-1, e).T)
  q = np.asarray(layer['attn']['q_kernel'][...][1]).reshape(e, hkv, g, d)
  k = np.asarray(layer['attn']['k_kernel'][...][1]).reshape(e, hkv, 1, d)
  v = np.asarray(layer['attn']['v_kernel'][...][1]).reshape(e, hkv, 1, d)
  np.testing.assert_array_equal(left['qkv'],
                                np.concatenate([q, k, v], axis=2).reshape(e, -1).T)
  head = params['embedding'][...] if tie else params['lm_head'][...].T
  np.testing.assert_array_equal(layers.head, np.asarray(head))
  # Without weights_left the prepared layers carry no matrices.
  plain = fns.decode_weights(params, True)[1]
  assert plain.left is None and plain.head is None


def test_weights_left_needs_the_unrolled_decode():
  graphdef, params = models.create(_tiny('llama'))
  with pytest.raises(ValueError, match='needs unstacked=True'):
    models.model_fns(graphdef).decode_weights(params, False, weights_left=True)


def _decode_hlo(weights_left):
  graphdef, params = models.create(_tiny('llama', tie_embeddings=False))
  fns = models.model_fns(graphdef)
  tokens, lengths = _prompts(12)
  eos, pad = jnp.asarray([47], jnp.int32), jnp.int32(PAD)
  static = dict(method=sampling.Temperature(1.0), mode='shared', unstack_layers=True)
  state = sampler.start(fns, params, tokens, lengths, jax.random.key(0), eos, pad, k=3,
                        max_new_tokens=10, **static)
  return sampler.decode_loop.lower(fns, params, state, eos, pad, **static,
                                   weights_left=weights_left).compile().as_text()


def test_the_compiled_decode_keeps_the_weights_on_the_left():
  """What makes it fast: XLA would fold the transposes back (transpose(dot) -> a dot of swapped
  operands); the barriers keep the head's product as [vocab, streams], weights first."""
  head_products = lambda hlo: {m.group(1) for m in re.finditer(  # noqa: E731
      r'= f32\[(48,9|9,48)\]\{[0-9,]*\} (?:dot|fusion)\(', hlo)}
  assert head_products(_decode_hlo(True)) == {'48,9'}
  assert head_products(_decode_hlo(False)) == {'9,48'}


def _exp(**rloo):
  c = base_config()
  c.model.update(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                 intermediate_size=64, max_seq_len=64)
  c.rloo.update(**rloo)
  return experiment.build_abstract(c)


def test_auto_lays_the_weights_left_on_cpu_when_the_decode_is_unrolled():
  assert jax.default_backend() == 'cpu'
  assert sampler_args.decode_options(_exp()) == dict(unstack_layers=True,
                                                               weights_left=True)
  assert sampler_args.decode_options(_exp(decode_matmul='plain')) == dict(
      unstack_layers=True, weights_left=False)
  # Scanned (as 'auto' decodes under FSDP or LoRA), the weights stay as stored.
  assert sampler_args.decode_options(_exp(decode_layers='scanned')) == dict(
      unstack_layers=False, weights_left=False)
  assert not sampler_args.weights_left_on('gpu') and not sampler_args.weights_left_on('tpu')


def test_bad_decode_matmul_settings_fail_before_any_compile():
  with pytest.raises(ValueError, match="unknown config.rloo.decode_matmul 'left'; choose one of"):
    _exp(decode_matmul='left')
  with pytest.raises(ValueError, match="unknown config.rloo.decode_layers 'flat'; choose one of"):
    _exp(decode_layers='flat')
  with pytest.raises(ValueError, match="decode_layers='scanned'"):
    _exp(decode_matmul='weights_left', decode_layers='scanned')


def test_an_explicit_weights_left_under_a_scanned_auto_decode_names_the_fix():
  exp = _exp(decode_matmul='weights_left')
  exp.config.rloo.decode_layers = 'scanned'  # as 'auto' resolves under FSDP or LoRA
  with pytest.raises(ValueError, match="set config.rloo.decode_layers='unstacked'"):
    sampler_args.decode_weights_left(exp)


def test_prepared_weights_keep_the_cast_of_decode_weights():
  """The matrices are built from the cast layers: bfloat16 activations get bfloat16 matrices."""
  config = _tiny('qwen2', dtype='bfloat16', param_dtype='float32')
  graphdef, params = models.create(config)
  _, layers = models.model_fns(graphdef).decode_weights(params, True, weights_left=True)
  assert {x.dtype for x in jax.tree.leaves(layers.left)} == {jnp.dtype(jnp.bfloat16)}
  assert layers.head.dtype == jnp.bfloat16
  assert decode_weights.DecodeLayers._fields == ('weights', 'left', 'head')

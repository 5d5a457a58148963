"""Tests of rloo_jax.sampler and rloo_jax.sampling.

Most tests run against a fake deterministic ModelFns: one attention layer with a real KV cache that
follows the DecodeCache contract of docs/ARCHITECTURE.md (prefix shared by the k streams), so
cached decoding, prefix sharing and full recomputation can be compared exactly. With
`scale=0` its logits are the constant `bias`, which makes the support of top-k / top-p known.
The last tests use a tiny real Transformer.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import FIXTURE_TERMS, assert_f32_close

from rloo_jax import models, sampler, sampling
# The fake model returns the real cache structures, so a change to the contract breaks it too.
from rloo_jax.models import decode_weights
from rloo_jax.models.cache import PrefixKV, init_cache

EOS, PAD = 1, 0


# ----------------------------------------------------------------------------------------------
# A fake deterministic model with the ModelFns interface.


def _embed(params, tokens, positions):
  return params['emb'][tokens] + params['pos'][positions]


def _head(params, x, h):
  return params['scale'] * jnp.tanh(x + h) @ params['out'] + params['bias']


def fake_forward(params, tokens_bs, positions_bs, mask_bs):
  x_bsd = _embed(params, tokens_bs, positions_bs)
  q_bsd = x_bsd @ params['wq']
  scores_bss = jnp.einsum('bqd,bkd->bqk', q_bsd, x_bsd) / np.sqrt(x_bsd.shape[-1])
  seq = tokens_bs.shape[1]
  allowed = jnp.tril(jnp.ones((seq, seq), bool))[None] & mask_bs[:, None, :]
  weights = jax.nn.softmax(jnp.where(allowed, scores_bss, -1e30), axis=-1)
  return _head(params, x_bsd, jnp.einsum('bqk,bkd->bqd', weights, x_bsd))


def fake_prefill(params, tokens_bp, positions_bp, mask_bp):
  x_bpd = _embed(params, tokens_bp, positions_bp)
  kv = x_bpd[None, :, :, None, :]  # [L=1, B, P, H=1, D]
  # The prefill contract: logits at each row's last valid (right-padded) position only.
  logits_bpv = fake_forward(params, tokens_bp, positions_bp, mask_bp)
  last_b = mask_bp.sum(axis=1) - 1
  return logits_bpv[jnp.arange(tokens_bp.shape[0]), last_b], PrefixKV(kv, kv)


def fake_decode(params, tokens_bk, positions_bk, cache):
  x_bkd = _embed(params, tokens_bk, positions_bk)
  new = x_bkd[:, :, None, None, :]  # [B, K, H=1, T=1, D]: the value layout of layer 0
  v_cache = jax.lax.dynamic_update_slice_in_dim(cache.v_lbkhtd[0], new, cache.index, axis=3)
  q_bkd = x_bkd @ params['wq']
  prefix_kd = cache.prefix_v_lbhpd[0][:, 0]  # [B, P, D]
  own_bktd = v_cache[:, :, 0]
  scale = np.sqrt(x_bkd.shape[-1])
  s_prefix = jnp.einsum('bkd,bpd->bkp', q_bkd, prefix_kd) / scale
  s_prefix = jnp.where(cache.prefix_mask_bp[:, None, :], s_prefix, -1e30)
  s_own = jnp.einsum('bkd,bktd->bkt', q_bkd, own_bktd) / scale
  s_own = jnp.where(jnp.arange(own_bktd.shape[2]) <= cache.index, s_own, -1e30)
  weights = jax.nn.softmax(jnp.concatenate([s_prefix, s_own], axis=-1), axis=-1)
  values = jnp.concatenate([jnp.broadcast_to(prefix_kd[:, None], s_prefix.shape + (x_bkd.shape[-1],)),
                            own_bktd], axis=2)
  h_bkd = jnp.einsum('bkn,bknd->bkd', weights, values)
  return _head(params, x_bkd, h_bkd), cache.replace(v_lbkhtd=v_cache[None],
                                                      index=cache.index + 1)


class FakeFns(NamedTuple):
  forward: Callable[..., Any]
  prefill: Callable[..., Any]
  init_cache: Callable[..., Any]
  decode: Callable[..., Any]
  max_seq_len: int


FNS = FakeFns(fake_forward, fake_prefill, init_cache, fake_decode, max_seq_len=48)


def fake_params(vocab=16, dim=8, seed=0, scale=3.0, bias=None):
  keys = jax.random.split(jax.random.key(seed), 4)
  return {
      'emb': jax.random.normal(keys[0], (vocab, dim)),
      'pos': 0.5 * jax.random.normal(keys[1], (FNS.max_seq_len, dim)),
      'wq': jax.random.normal(keys[2], (dim, dim)) / np.sqrt(dim),
      'out': jax.random.normal(keys[3], (dim, vocab)),
      'scale': jnp.float32(scale),
      'bias': jnp.zeros(vocab) if bias is None else jnp.asarray(bias, jnp.float32),
  }


def prompts(lengths=(5, 1, 8), width=8, vocab=16, seed=1):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(2, vocab, size=(len(lengths), width)).astype(np.int32)
  for i, n in enumerate(lengths):
    tokens[i, n:] = PAD
  return tokens, np.asarray(lengths, np.int32)


# Test configurations reuse a few (method, k, T) so the file compiles few programs.
TOP_P = sampling.TopP(0.8, 0.7)


def run(params, tokens, lengths, rng=0, *, fns=FNS, k=3, t=6, method=TOP_P,
        mode='shared', eos_id=EOS):
  return sampler.sample(fns, params, tokens, lengths, jax.random.key(rng), k=k, max_new_tokens=t,
                        method=method, eos_id=eos_id, pad_id=PAD, mode=mode)


def np_out(out):
  return jax.tree.map(np.asarray, out)


def full_logits(fns, params, tokens, lengths, out):
  """Recomputes the policy logits of every completion token by one forward over prompt+completion."""
  b, k, t = out.tokens_bkt.shape
  width = tokens.shape[1]
  rows = np.repeat(tokens, k, axis=0)
  lens = np.repeat(lengths, k)
  seq = np.concatenate([rows, np.asarray(out.tokens_bkt).reshape(b * k, t)], axis=1)
  cols = np.arange(width + t)
  positions = np.where(cols < width, cols, lens[:, None] + cols - width)
  positions = np.where((cols < width) & (cols >= lens[:, None]), 0, positions)
  mask = (cols < lens[:, None]) | (cols >= width)
  logits = np.asarray(jax.jit(fns.forward)(params, seq, positions, mask))
  # Token t of the completion is predicted at column width + t - 1, token 0 at column len - 1.
  pred_cols = np.concatenate([lens[:, None] - 1, width + np.arange(t - 1)[None].repeat(b * k, 0)],
                             axis=1)
  return np.take_along_axis(logits, pred_cols[..., None], axis=1).reshape(b, k, t, -1)


def log_softmax_at(logits, tokens):
  logp = np.asarray(jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1))
  return np.take_along_axis(logp, np.asarray(tokens)[..., None], axis=-1)[..., 0]


# ----------------------------------------------------------------------------------------------
# Sampler tests


def test_same_rng_same_output_other_rng_differs():
  params = fake_params()
  tokens, lengths = prompts()
  a, b, c = (np_out(run(params, tokens, lengths, rng=r)) for r in (0, 0, 1))
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)
  assert not np.array_equal(a.tokens_bkt, c.tokens_bkt)



@pytest.mark.parametrize('method', [TOP_P, sampling.Temperature(1.3)])
def test_a_token_is_the_inverse_cdf_draw_from_its_streams_uniforms(method):
  """Token t of stream (b, j) is `sampling.inverse_cdf` of the processed logits with the two
  uniforms of fold_in(key_bj, t), drawn before the decode loop."""
  params = fake_params()
  tokens, lengths = prompts()
  state = sampler.start(FNS, params, tokens, lengths, jax.random.key(5), EOS, PAD, k=3,
                        max_new_tokens=6, method=method, mode='shared')
  assert state.uniforms_tbk2.shape == (6, len(lengths), 3, 2)
  out = np_out(sampler.sample(FNS, params, tokens, lengths, jax.random.key(5), k=3,
                              max_new_tokens=6, method=method, eos_id=EOS, pad_id=PAD))
  logits = full_logits(FNS, params, tokens, lengths, out)
  for b in range(len(lengths)):
    for j in range(3):
      key = jax.random.fold_in(jax.random.fold_in(jax.random.key(5), b), j)
      for t in range(int(out.lengths_bk[b, j])):
        u = jax.random.uniform(jax.random.fold_in(key, t), (2,))
        want, _, _ = sampling.inverse_cdf(method.process(jnp.asarray(logits[b, j, t])), u)
        assert int(want) == int(out.tokens_bkt[b, j, t]), (b, j, t)


def test_shared_and_unshared_agree():
  params = fake_params()
  tokens, lengths = prompts()
  outs = {m: np_out(run(params, tokens, lengths, rng=3, mode=m))
          for m in sampler.MODES}
  ref = outs['shared']
  for mode in ('unshared',):
    np.testing.assert_array_equal(outs[mode].tokens_bkt, ref.tokens_bkt, err_msg=mode)
    np.testing.assert_array_equal(outs[mode].mask_bkt, ref.mask_bkt, err_msg=mode)
    np.testing.assert_array_equal(outs[mode].lengths_bk, ref.lengths_bk, err_msg=mode)
    np.testing.assert_allclose(outs[mode].logprobs_bkt, ref.logprobs_bkt, atol=1e-4, err_msg=mode)
    np.testing.assert_allclose(outs[mode].policy_logprobs_bkt, ref.policy_logprobs_bkt, atol=1e-4,
                               err_msg=mode)


@pytest.mark.parametrize('method', [TOP_P, sampling.Greedy()])
def test_logprobs_match_forward_recomputation(method):
  params = fake_params()
  tokens, lengths = prompts()
  out = np_out(run(params, tokens, lengths, rng=5, method=method))
  logits = full_logits(FNS, params, tokens, lengths, out)
  m = out.mask_bkt
  assert m[..., 0].all()
  np.testing.assert_allclose(out.policy_logprobs_bkt[m], log_softmax_at(logits, out.tokens_bkt)[m],
                             atol=1e-4)
  processed = np.asarray(method.process(jnp.asarray(logits)))
  np.testing.assert_allclose(out.logprobs_bkt[m], log_softmax_at(processed, out.tokens_bkt)[m],
                             atol=1e-4)
  assert np.all(out.logprobs_bkt[~m] == 0) and np.all(out.policy_logprobs_bkt[~m] == 0)
  if method.is_greedy:
    np.testing.assert_array_equal(out.tokens_bkt[m], logits.argmax(-1)[m])
    np.testing.assert_array_equal(out.logprobs_bkt, 0)
    # Greedy streams of one prompt are identical.
    assert (out.tokens_bkt == out.tokens_bkt[:, :1]).all()


def _support_params(bias):
  return fake_params(vocab=len(bias), scale=0.0, bias=bias)


def test_top_k_never_leaves_support():
  bias = np.array([0., -1., 3., 0.5, 2.9, -2., 2.8, 1., 0.2, 2.7, 0., 0., 0., 0., 0., 0.])
  params = _support_params(bias)
  tokens, lengths = prompts()
  out = np_out(run(params, tokens, lengths, method=sampling.TopK(3, 2.0), eos_id=99))
  support = set(np.argsort(-bias)[:3].tolist())  # {2, 4, 6}
  emitted = set(np.unique(out.tokens_bkt).tolist())
  assert emitted == support, emitted


def test_top_p_never_leaves_support():
  probs = np.zeros(16)
  probs[:7] = [0.05, 0.35, 0.05, 0.3, 0.05, 0.15, 0.05]
  with np.errstate(divide='ignore'):
    params = _support_params(np.log(probs))  # Tokens 7.. have probability 0: logit -inf.
  tokens, lengths = prompts()
  # At temperature 0.7 the sorted probabilities are 0.43, 0.34, 0.13, 0.03, ... : the mass before
  # the third is 0.77 < 0.8, before the fourth 0.89, so the nucleus is {1, 3, 5}.
  tempered = probs ** (1 / 0.7) / (probs ** (1 / 0.7)).sum()
  np.testing.assert_allclose(np.cumsum(np.sort(tempered)[::-1])[1:3], [0.77, 0.89], atol=0.01)
  out = np_out(run(params, tokens, lengths, method=TOP_P, eos_id=99))
  emitted = set(np.unique(out.tokens_bkt).tolist())
  assert emitted == {1, 3, 5}, emitted
  # The sampling log-probs are those of the renormalised nucleus, the policy ones untempered.
  nucleus = tempered[1] / tempered[[1, 3, 5]].sum()
  np.testing.assert_allclose(out.logprobs_bkt[out.tokens_bkt == 1], np.log(nucleus), rtol=1e-5)
  np.testing.assert_allclose(out.policy_logprobs_bkt[out.tokens_bkt == 1], np.log(0.35), rtol=1e-5)


def test_tokens_after_eos_are_pad_and_masked():
  bias = np.zeros(16)
  bias[EOS] = 1.5  # EOS is likely but not certain: streams end at different steps.
  params = fake_params(scale=0.5, bias=bias)
  tokens, lengths = prompts()
  out = np_out(run(params, tokens, lengths))
  ended = 0
  for b, j in np.ndindex(out.lengths_bk.shape):
    row, mask = out.tokens_bkt[b, j], out.mask_bkt[b, j]
    eos_at = np.flatnonzero(row == EOS)
    n = eos_at[0] + 1 if eos_at.size else row.size
    ended += bool(eos_at.size)
    assert out.lengths_bk[b, j] == n == mask.sum()
    assert mask[:n].all() and not mask[n:].any()
    assert (row[n:] == PAD).all()
    assert (out.logprobs_bkt[b, j, n:] == 0).all()
  assert 0 < ended < out.lengths_bk.size
  assert len(np.unique(out.lengths_bk)) > 1
  is_eos = out.tokens_bkt == EOS  # True up to and including each row's first EOS:
  np.testing.assert_array_equal(np.cumsum(is_eos, -1) - is_eos == 0, out.mask_bkt)


def _cut_at_first(raw_bkt, stops):
  """(tokens, mask, lengths) expected when raw_bkt (sampled with no stop) stops at `stops`."""
  is_stop = np.isin(raw_bkt, stops)
  first = np.where(is_stop.any(-1), is_stop.argmax(-1) + 1, raw_bkt.shape[-1])
  mask = np.arange(raw_bkt.shape[-1]) < first[..., None]
  return np.where(mask, raw_bkt, PAD), mask, first


def test_stream_stops_at_a_second_stop_id():
  params = fake_params(scale=0.5)
  tokens, lengths = prompts()
  raw = np_out(run(params, tokens, lengths, eos_id=99)).tokens_bkt  # 99: never sampled
  # A stop id that some streams emit mid-completion and others never do.
  second = next(int(v) for v in raw[:, :, 1:].reshape(-1)
                if 0 < np.isin(raw, [v]).any(-1).sum() < raw.shape[0] * raw.shape[1])
  out = np_out(run(params, tokens, lengths, eos_id=(99, second)))
  want_tokens, want_mask, want_lengths = _cut_at_first(raw, [99, second])
  assert (want_lengths < raw.shape[-1]).any() and (want_lengths == raw.shape[-1]).any()
  np.testing.assert_array_equal(out.tokens_bkt, want_tokens)
  np.testing.assert_array_equal(out.mask_bkt, want_mask)
  np.testing.assert_array_equal(out.lengths_bk, want_lengths)
  assert (out.logprobs_bkt[~want_mask] == 0).all()


def test_one_stop_id_as_int_or_sequence_is_the_same():
  bias = np.zeros(16)
  bias[EOS] = 1.5
  params = fake_params(scale=0.5, bias=bias)
  tokens, lengths = prompts()
  single = np_out(run(params, tokens, lengths, eos_id=EOS))
  assert (single.lengths_bk < 6).any()  # some streams did stop
  for eos_id in ((EOS,), [EOS], np.array([EOS]), (EOS, EOS)):
    out = np_out(run(params, tokens, lengths, eos_id=eos_id))
    for field in ('tokens_bkt', 'mask_bkt', 'lengths_bk', 'logprobs_bkt'):
      np.testing.assert_array_equal(getattr(out, field), getattr(single, field))


def test_new_stop_ids_do_not_recompile():
  params = fake_params()
  tokens, lengths = prompts()
  run(params, tokens, lengths, eos_id=(5, 7))
  before = sampler.start._cache_size(), sampler.decode_loop._cache_size()
  run(params, tokens, lengths, eos_id=(3, 11))
  assert (sampler.start._cache_size(), sampler.decode_loop._cache_size()) == before


@pytest.mark.parametrize('eos_id, match', [
    ((), 'empty sequence'), ((1, 'a'), 'eos_id must be an integer'), (1.5, 'eos_id must be'),
    ((1, True), 'eos_id must be an integer'),
])
def test_bad_stop_ids(eos_id, match):
  tokens, lengths = prompts()
  with pytest.raises(ValueError, match=match):
    sampler.sample(FNS, None, tokens, lengths, jax.random.key(0), k=2, max_new_tokens=4,
                   method=sampling.Greedy(), eos_id=eos_id, pad_id=PAD)


def test_loop_stops_when_all_streams_end():
  bias = np.zeros(16)
  bias[EOS] = 50.0  # Every stream ends at its first token.
  params = fake_params(bias=bias)
  tokens, lengths = prompts()
  out = np_out(run(params, tokens, lengths, method=sampling.Greedy()))
  assert out.tokens_bkt.shape == (3, 3, 6)
  assert (out.tokens_bkt[..., 0] == EOS).all() and (out.tokens_bkt[..., 1:] == PAD).all()
  assert (out.lengths_bk == 1).all()


def test_streams_are_independent():
  params = fake_params(scale=0.0)  # Uniform over 16 tokens; the nucleus keeps 13 of them.
  tokens, lengths = prompts(lengths=(3, 3, 3))
  tokens[1:] = tokens[0]  # Even identical prompts get different samples.
  out = np_out(run(params, tokens, lengths, eos_id=99))
  rows = out.tokens_bkt.reshape(9, 6)
  assert len({tuple(r) for r in rows}) == 9
  # Per-step draws are not shared across streams either.
  for t in range(6):
    assert len(np.unique(rows[:, t])) >= 4


def test_ties_go_to_argmax_first():
  logits = jnp.array([[1.0, 3.0, 3.0, -1.0]])
  np.testing.assert_array_equal(np.isfinite(sampling.Greedy().process(logits)),
                                [[False, True, False, False]])


def test_method_processing():
  logits = jnp.log(jnp.array([[0.1, 0.5, 0.15, 0.25]]))
  np.testing.assert_array_equal(np.isfinite(sampling.TopK(2).process(logits)),
                                [[False, True, False, True]])
  np.testing.assert_array_equal(np.isfinite(sampling.TopP(0.5).process(logits)),
                                [[False, True, False, False]])
  np.testing.assert_array_equal(np.isfinite(sampling.TopP(0.51).process(logits)),
                                [[False, True, False, True]])
  np.testing.assert_array_equal(np.isfinite(sampling.TopP(1.0).process(logits)), True)
  np.testing.assert_allclose(sampling.Temperature(2.0).process(logits), logits / 2)
  assert sampling.TopK(99).process(logits).shape == (1, 4)
  assert sampling.TopK(2).process(logits.astype(jnp.bfloat16)).dtype == jnp.float32
  assert hash(sampling.TopP(0.9)) == hash(sampling.TopP(0.9))


@pytest.mark.parametrize('make, match', [
    (lambda: sampling.Temperature(0.0), 'Greedy'),
    (lambda: sampling.Temperature(-1.0), 'temperature must be finite and > 0'),
    (lambda: sampling.Temperature(float('nan')), 'temperature'),
    (lambda: sampling.TopK(0), 'k must be an integer >= 1'),
    (lambda: sampling.TopK(2.5), 'k must be an integer'),
    (lambda: sampling.TopK(3, temperature=0), 'temperature'),
    (lambda: sampling.TopP(0.0), r'p must be in \(0, 1\]'),
    (lambda: sampling.TopP(1.5), r'p must be in \(0, 1\]'),
])
def test_sampling_method_validation(make, match):
  with pytest.raises(ValueError, match=match):
    make()


@pytest.mark.parametrize('change, match', [
    (dict(lengths=np.array([5, 0, 8], np.int32)), 'empty prompt .* at batch index 1'),
    (dict(lengths=np.array([5, 9, 8], np.int32)), 'prompt 1 has length 9 > the 8 columns'),
    (dict(lengths=np.array([5, 1], np.int32)), r'prompt_lengths_b must have shape \(3,\)'),
    (dict(tokens=np.zeros((3,), np.int32)), 'must be 2-D'),
    (dict(tokens=np.zeros((3, 8), np.float32)), 'prompt_tokens_bp must be integers'),
    (dict(k=0), 'k must be >= 1'),
    (dict(max_new_tokens=0), 'max_new_tokens must be >= 1'),
    (dict(max_new_tokens=41), r'8 \+ max_new_tokens 41 = 49 exceeds the model context '
                              'max_seq_len=48'),
    (dict(max_seq_len=6), 'prompt 2 has 8 tokens, longer than the model context max_seq_len=6'),
    (dict(mode='paged'), 'mode must be one of'),
    (dict(method='greedy'), 'method must be a rloo_jax.sampling method'),
])
def test_errors_before_compiling(change, match):
  tokens, lengths = prompts()
  args = dict(tokens=tokens, lengths=lengths, k=2, max_new_tokens=4, mode='shared',
              method=sampling.Greedy(), max_seq_len=None)
  args.update(change)
  with pytest.raises(ValueError, match=match):
    sampler.sample(FNS, None, args['tokens'], args['lengths'], jax.random.key(0), k=args['k'],
                   max_new_tokens=args['max_new_tokens'], method=args['method'], eos_id=EOS,
                   pad_id=PAD, mode=args['mode'], max_seq_len=args['max_seq_len'])


# ----------------------------------------------------------------------------------------------
# With the real transformer.


def _tiny_transformer(family):
  overrides = dict(vocab_size=48, hidden_size=32, num_layers=1, num_heads=4, head_dim=8,
                   intermediate_size=64, max_seq_len=64)
  if family == 'llama':
    overrides['num_kv_heads'] = 2  # grouped-query attention
  config = getattr(models.TransformerConfig, family)(**overrides)
  graphdef, params = models.create(config, seed=0)
  return models.model_fns(graphdef), params


# GPT-2's learned absolute positions catch any off-by-one in the sampler's position bookkeeping
# (RoPE would hide a constant shift); tests/test_models.py covers the cache of every family.
@pytest.mark.parametrize('family, other', [('gpt2', 'unshared')])
def test_real_transformer_cached_equals_uncached(family, other):
  """The prefix kept once per prompt and read by its streams draws what tiled prompts draw, and
  its log-probs are one forward's over prompt + completion."""
  fns, params = _tiny_transformer(family)
  tokens, lengths = prompts(lengths=(7, 2, 12), width=12, vocab=48, seed=4)
  outs = {m: np_out(run(params, tokens, lengths, rng=2, fns=fns, k=3, t=8, mode=m, eos_id=47,
                        method=sampling.Temperature(1.0)))
          for m in ('shared', other)}
  out = outs['shared']
  np.testing.assert_array_equal(outs[other].tokens_bkt, out.tokens_bkt)
  np.testing.assert_allclose(outs[other].policy_logprobs_bkt, out.policy_logprobs_bkt, atol=1e-4)
  # Cached logits equal one forward over prompt + completion.
  logits = full_logits(fns, params, tokens, lengths, out)
  m = out.mask_bkt
  np.testing.assert_allclose(out.policy_logprobs_bkt[m], log_softmax_at(logits, out.tokens_bkt)[m],
                             atol=1e-4)
  np.testing.assert_allclose(out.logprobs_bkt[m], log_softmax_at(logits, out.tokens_bkt)[m],
                             atol=1e-4)  # Temperature(1.0): the sampling dist is the policy.


# Gemma 3 has sliding and global layers with their own RoPE bases, so the unrolled layers must
# pick each layer's window and table as the scan does.
@pytest.mark.parametrize('family', ['llama', 'gemma3'])
@pytest.mark.parametrize('mode, width', [('shared', 12), ('shared', 20), ('unshared', 12)])
def test_decode_on_unstacked_layers_equals_the_layer_scan(family, mode, width):
  """`sample(unstack_layers=True)` (per-layer weight buffers, layers unrolled) draws the same
  tokens with the same log-probs as the scanned stack."""
  graphdef, params = models.create(_tiny(family))
  fns = models.model_fns(graphdef)
  tokens, lengths = prompts(lengths=(7, 2, width), width=width, vocab=48, seed=4)
  outs = [_sample_unstacked(fns, params, tokens, lengths, mode, unstack)
          for unstack in (False, True)]
  # The unrolled layers read KV buffers of their own, the same bytes as the stacked cache.
  caches = [sampler.start(fns, params, tokens, lengths, jax.random.key(3), jnp.asarray([47]),
                          jnp.int32(PAD), k=3, max_new_tokens=10, method=sampling.Temperature(1.0),
                          mode=mode, unstack_layers=unstack).cache for unstack in (False, True)]
  assert not caches[0].per_layer and caches[1].per_layer
  assert len(caches[1].k_lbkhdt) == 2  # one KV buffer per layer
  assert caches[1].k_lbkhdt[0].shape == caches[0].k_lbkhdt.shape[1:]
  nbytes = lambda c: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(c))  # noqa: E731
  assert nbytes(caches[0]) == nbytes(caches[1])
  np.testing.assert_array_equal(outs[0].tokens_bkt, outs[1].tokens_bkt)
  assert_f32_close(outs[0].policy_logprobs_bkt, outs[1].policy_logprobs_bkt, FIXTURE_TERMS)
  assert outs[1].mask_bkt.sum() > 3 * 3  # the streams decoded past their first tokens


def _tiny(family, **overrides):
  # Two layers: the unrolled decode compiles once per layer, and one sliding and one full
  # Gemma 3 layer still catch a layer given the other's window or RoPE table.
  overrides = dict(vocab_size=48, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=8, intermediate_size=64, max_seq_len=64, **overrides)
  if family == 'gemma3':
    overrides.update(sliding_window=4, layer_types=('sliding_attention', 'full_attention'))
  return getattr(models.TransformerConfig, family)(**overrides)


def _sample_unstacked(fns, params, tokens, lengths, mode, unstack):
  return np_out(sampler.sample(fns, params, tokens, lengths, jax.random.key(3), k=3,
                               max_new_tokens=10, method=sampling.Temperature(1.0), eos_id=47,
                               pad_id=PAD, mode=mode, unstack_layers=unstack))


# Gemma's float32 (1 + w) norms and q/k norms, GPT-2's LayerNorm, biases and position table,
# Qwen2's q/k/v biases: every weight but the norms' is cast.
@pytest.mark.parametrize('family', ['gemma3', 'gpt2', 'qwen2'])
def test_the_unstacked_decode_reads_its_weights_cast_once_to_the_activation_dtype(
    family, monkeypatch):
  """Under bfloat16 activations the per-layer weights are cast once before the loop, norms
  kept in float32, and the decode draws what it draws casting each weight at its use."""
  config = _tiny(family, dtype='bfloat16', param_dtype='float32')
  graphdef, params = models.create(config)
  # XLA:CPU computes bfloat16 in float32 and drops a per-use weight cast as excess precision,
  # where an accelerator rounds there: weights exactly representable in bfloat16 make the two
  # agree. The norms get float32 noise, which a cast of theirs would round away.
  rounded = jax.tree.map(lambda x, r: r.astype(x.dtype), params,
                         decode_weights.cast(config, params))
  noisy = lambda path, x: (x + 1e-3 * jax.random.normal(jax.random.key(7), x.shape)  # noqa: E731
                           if decode_weights._kept(path) else x)  # pylint: disable=protected-access
  params = jax.tree_util.tree_map_with_path(noisy, rounded)
  fns = models.model_fns(graphdef)
  top, layers = fns.decode_weights(params, True)
  dtypes = {jax.tree_util.keystr(p): x.dtype for p, x in
            jax.tree_util.tree_flatten_with_path(
                ({k: v for k, v in top.items() if k != 'layers'}, layers[0]))[0]}
  assert {d for k, d in dtypes.items() if 'norm' in k} == {jnp.dtype(jnp.float32)}
  assert {d for k, d in dtypes.items() if 'norm' not in k} == {jnp.dtype(jnp.bfloat16)}
  # On one device the scanned decode makes no copy: its weights are the stored ones.
  assert fns.decode_weights(params, False) == (params, None)
  tokens, lengths = prompts(lengths=(7, 2, 12), width=12, vocab=48, seed=4)
  cast = _sample_unstacked(fns, params, tokens, lengths, 'shared', True)
  # The sampler's two programs traced again, each weight now cast where it is used (clearing
  # every cache, jax.clear_caches, made the rest of the worker's tests compile again).
  for program in (sampler.start, sampler.decode_loop):
    for jitted in program._jits.values():  # pylint: disable=protected-access
      jitted.clear_cache()
  uncast = []
  monkeypatch.setattr(decode_weights, 'cast', lambda config, tree: uncast.append(1) or tree)
  at_use = _sample_unstacked(fns, params, tokens, lengths, 'shared', True)
  assert uncast  # the retrace reached the cast
  np.testing.assert_array_equal(cast.tokens_bkt, at_use.tokens_bkt)
  np.testing.assert_array_equal(cast.policy_logprobs_bkt, at_use.policy_logprobs_bkt)
  assert cast.mask_bkt.sum() > 3 * 3

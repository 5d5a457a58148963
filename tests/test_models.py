"""Transformer properties that need no checkpoint: cache consistency, prefix sharing, dtypes, heads.

Compilation dominates on a small CPU, so every test reuses one prompt shape and the jitted
functions of a module-scoped fixture: each family compiles prefill, forward and decode once.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import FIXTURE_TERMS, assert_f32_close
from flax import nnx

from rloo_jax.models import (DecodeCache, PrefixKV, TransformerConfig, abstract, create,
                             model_fns, traced_mesh)

# Float comparisons of two computations: rerun by .ci/run under other CPU flags.
pytestmark = pytest.mark.numerics

TINY = dict(vocab_size=61, hidden_size=32, num_layers=2, num_heads=4, head_dim=8,
            intermediate_size=48, max_seq_len=64)
CONFIGS = {
    'llama': TransformerConfig.llama(num_kv_heads=2, **TINY),   # GQA, 2 q heads per kv head
    'qwen2': TransformerConfig.qwen2(num_kv_heads=1, **TINY),   # MQA, tied, qkv bias
    'gpt2': TransformerConfig.gpt2(**TINY),                     # learned positions, LayerNorm
    # Pythia: parallel residual, RoPE on 2 of each head's 8 dims, exact GELU, untied head.
    'gpt_neox': TransformerConfig.gpt_neox(**TINY),
    # The sequential-residual GPT-NeoX flavour, RoPE on half of each head.
    'gpt_neox_seq': TransformerConfig.gpt_neox(rotary_pct=0.5, parallel_residual=False, **TINY),
    # Llama 3.1+ RoPE scaling, its band (original context 4 / {1, 4}) inside the test positions.
    'llama3': TransformerConfig.llama(num_kv_heads=2, rope_type='llama3', rope_factor=8.0,
                                      rope_original_max_len=4, **TINY),
    # Qwen3: q/k RMSNorm per head, no qkv bias, heads wider than hidden / heads; GQA.
    'qwen3': TransformerConfig.qwen3(num_kv_heads=2, **{**TINY, 'head_dim': 16}),
    # Mistral's shape (a Llama): MQA, heads narrower than hidden / heads.
    'mistral': TransformerConfig.llama(num_kv_heads=1, **{**TINY, 'head_dim': 6}),
    # Mistral's sliding window (every layer), narrower than the test rows.
    'mistral_window': TransformerConfig.llama(num_kv_heads=1, sliding_window=3, **TINY),
    # Gemma 2: soft-capped scores and logits (caps the random logits reach), windows of 3 on
    # alternate layers, a query scalar other than head_dim, sandwich norms, GeGLU.
    'gemma2': TransformerConfig.gemma2(num_kv_heads=2, sliding_window=3, attn_softcap=1.5,
                                       final_softcap=2.0, query_pre_attn_scalar=12.0,
                                       **{**TINY, 'num_layers': 3}),
    # Gemma 3: q/k (1 + w) norms, sliding layers with their own RoPE base, linear scaling on the
    # global one.
    'gemma3': TransformerConfig.gemma3(num_kv_heads=2, sliding_window=4, rope_type='linear',
                                       rope_factor=4.0, local_rope_theta=100.0,
                                       layer_types=('sliding_attention', 'full_attention',
                                                    'sliding_attention'),
                                       **{**TINY, 'num_layers': 3}),
}
AXES = {'layers', 'vocab', 'embed', 'q_heads', 'kv_heads', 'head_dim', 'mlp', 'norm', None}
B, P, K, T = 2, 6, 3, 4


def random_params(config, seed=0, scale=0.3):
  """Every param (biases and norms included) random, so a mis-wired one cannot hide.

  Filled from numpy on the abstract model: no init compile.
  """
  graphdef, abstract_params = abstract(config)
  rng = np.random.default_rng(seed)
  params = jax.tree.map(lambda s: jnp.asarray(scale * rng.standard_normal(s.shape), s.dtype),
                        abstract_params)
  return graphdef, params


def prompts(rng, vocab):
  """Right-padded prompts of lengths P and P-2, plus a pad hole inside row 0."""
  tokens = rng.integers(3, vocab, size=(B, P)).astype(np.int32)
  lengths = np.array([P, P - 2], np.int32)
  mask = np.arange(P)[None] < lengths[:, None]
  mask[0, 1] = False  # keys masked mid-prompt: padding may sit anywhere
  positions = np.broadcast_to(np.arange(P, dtype=np.int32), (B, P)).copy()
  return np.where(mask, tokens, 0), mask, positions, lengths


@pytest.fixture(scope='module', params=list(CONFIGS))
def model(request):
  config = CONFIGS[request.param]
  graphdef, params = random_params(config, seed=1)
  fns = model_fns(graphdef)
  init_cache = jax.jit(fns.init_cache, static_argnums=(2, 3))
  jitted = dict(forward=jax.jit(fns.forward), prefill=jax.jit(fns.prefill),
                decode=jax.jit(fns.decode), init_cache=init_cache)
  return config, params, jitted


def test_create_num_params_and_memoised_fns():
  graphdef, params = create(CONFIGS['llama'], seed=0)
  assert isinstance(params, nnx.State)
  assert model_fns(graphdef) is model_fns(graphdef)
  assert model_fns(abstract(CONFIGS['llama'])[0]) is model_fns(graphdef)
  assert model_fns(graphdef).config == CONFIGS['llama']
  for config in [*CONFIGS.values(), CONFIGS['llama'].replace(head='scalar')]:
    assert sum(x.size for x in jax.tree.leaves(abstract(config)[1])) == config.num_params


def test_every_param_has_logical_axes():
  for config in [*CONFIGS.values(), CONFIGS['qwen2'].replace(head='scalar')]:
    _, params = abstract(config)
    for path, var in nnx.to_flat_state(params):
      assert isinstance(var, nnx.Param)
      axes = var.get_metadata().get('out_sharding')
      assert axes is not None and len(axes) == len(var.shape), (path, axes, var.shape)
      assert set(axes) <= AXES, (path, axes)
      assert any(a is not None for a in axes) or path == ('score_bias',), path


def test_padding_anywhere(model):
  config, params, jitted = model
  tokens, mask, positions, _ = prompts(np.random.default_rng(0), config.vocab_size)
  logits = jitted['forward'](params, tokens, positions, mask)
  assert logits.shape == (B, P, config.vocab_size) and logits.dtype == jnp.float32
  # Row 0 with its hole moved to the end (positions travel with their tokens): same logits.
  order = np.argsort(~mask[0], kind='stable')
  moved = jitted['forward'](params, tokens[:, order], positions[:, order], mask[:, order])
  n = mask[0].sum()
  assert_f32_close(logits[0, mask[0]], moved[0, :n], FIXTURE_TERMS)
  # The prefill's head runs at each row's last valid column only, with the same logits there.
  first, _ = jitted['prefill'](params, tokens, positions, mask)
  last = P - 1 - np.argmax(mask[:, ::-1], axis=1)
  assert first.shape == (B, config.vocab_size) and first.dtype == jnp.float32
  assert_f32_close(first, logits[np.arange(B), last], FIXTURE_TERMS)


def test_head_slice_equals_slicing_the_full_logits(model):
  """forward(..., head_slice=(start, n)) runs the head on n positions only; same numbers."""
  config, params, jitted = model
  tokens, mask, positions, _ = prompts(np.random.default_rng(5), config.vocab_size)
  full = jitted['forward'](params, tokens, positions, mask)
  part = jax.jit(model_fns(abstract(config)[0]).forward, static_argnames='head_slice')(
      params, tokens, positions, mask, head_slice=(2, 3))
  assert part.shape == (B, 3, config.vocab_size) and part.dtype == jnp.float32
  np.testing.assert_allclose(part, full[:, 2:5], atol=1e-6, rtol=1e-6)



def test_grouped_forward_equals_tiled_rows(model, monkeypatch):
  """fns.grouped computes each prompt once for its K completions; the same logits, and the same
  gradients, as the K tiled [prompt | completion] rows through forward(head_slice=(P - 1, T)),
  also with fewer prompts than batch shards (each prompt's completions split over rows)."""
  config, params, _ = model
  rng = np.random.default_rng(4)
  # Left-padded prompts (last token in column P - 1) with a hole inside row 0.
  lengths = np.array([P, P - 2], np.int32)
  ptok = rng.integers(3, config.vocab_size, size=(B, P)).astype(np.int32)
  pmask = np.arange(P)[None] >= (P - lengths)[:, None]
  pmask[0, 1] = False
  ppos = np.maximum(np.arange(P)[None] - (P - lengths)[:, None], 0).astype(np.int32)
  ptok = np.where(pmask, ptok, 0)
  ctok = rng.integers(3, config.vocab_size, size=(B * K, T)).astype(np.int32)
  cpos = (np.repeat(lengths, K)[:, None] + np.arange(T)).astype(np.int32)
  cmask = np.ones((B * K, T), bool)
  cmask[1, 2:] = False  # a completion that ended early
  fns = model_fns(abstract(config)[0])
  tile = lambda x: np.repeat(x, K, axis=0)
  flat = lambda prm: fns.forward(prm, np.concatenate([tile(ptok), ctok], 1),
                                 np.concatenate([tile(ppos), cpos], 1),
                                 np.concatenate([tile(pmask), cmask], 1), head_slice=(P - 1, T))
  grouped = lambda prm: fns.grouped(prm, ptok, ppos, pmask, ctok, cpos, cmask)
  w = jnp.asarray(rng.standard_normal((B * K, T, config.vocab_size)), jnp.float32)

  def with_grad(f):
    """f's logits and the gradient of their sum weighted by w: one program, as a train step."""
    def weighted(prm):
      y = f(prm)
      return jnp.sum(y * w), y
    (_, y), g = jax.jit(jax.value_and_grad(weighted, has_aux=True))(params)
    return y, g

  (a, ga), (b, gb) = with_grad(flat), with_grad(grouped)
  assert b.shape == (B * K, T, config.vocab_size) and b.dtype == jnp.float32
  assert_f32_close(b, a, FIXTURE_TERMS)
  scale = max(float(jnp.abs(x).max()) for x in jax.tree.leaves(ga))
  for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
    np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-5 * scale)
  with pytest.raises(ValueError, match='5 completion rows do not split over 2 prompts'):
    fns.grouped(params, ptok, ppos, pmask, ctok[:5], cpos[:5], cmask[:5])
  # Traced for 6 batch shards: each prompt's 3 completions over 3 rows of one, the prompt in
  # each ([6, P] prompt rows), with the same logits and gradients.
  monkeypatch.setattr(traced_mesh, 'batch_ways', lambda: 6)
  split = lambda prm: fns.grouped(prm, ptok, ppos, pmask, ctok, cpos, cmask)
  assert f'i32[6,{P}]' in str(jax.make_jaxpr(split)(params))
  c, gc = with_grad(split)
  assert_f32_close(c, a, FIXTURE_TERMS)
  for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gc)):
    np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-5 * scale)


def test_shared_cached_decode_matches_full_recomputation(model):
  """K streams decoded on one prefix, stored once per prompt, equal a full forward over each
  tiled prompt + completion."""
  config, params, jitted = model
  rng = np.random.default_rng(1)
  tokens, mask, positions, lengths = prompts(rng, config.vocab_size)
  new_bkt = rng.integers(3, config.vocab_size, size=(B, K, T)).astype(np.int32)
  pos_bkt = np.broadcast_to((lengths[:, None] + np.arange(T))[:, None], (B, K, T)).astype(np.int32)

  _, prefix = jitted['prefill'](params, tokens, positions, mask)
  assert isinstance(prefix, PrefixKV)
  assert prefix.k_lbphd.shape == (config.num_layers, B, P, config.num_kv_heads, config.head_dim)
  cache = jitted['init_cache'](prefix, mask, K, T)
  assert isinstance(cache, DecodeCache)
  L = config.num_layers
  assert cache.k_lbkhdt.shape == (L, B, K, config.num_kv_heads, config.head_dim, T)
  assert cache.v_lbkhtd.shape == (L, B, K, config.num_kv_heads, T, config.head_dim)
  # The prefix is stored once per prompt row, never per stream.
  assert cache.prefix_k_lbhdp.shape == (L, B, config.num_kv_heads, config.head_dim, P)
  assert cache.prefix_v_lbhpd.shape == (L, B, config.num_kv_heads, P, config.head_dim)
  decoded = []
  for i in range(T):
    logits_bkv, cache = jitted['decode'](params, new_bkt[..., i], pos_bkt[..., i], cache)
    decoded.append(logits_bkv)
  assert int(cache.index) == T

  # One row per stream: the padded prompt followed by its completion, as the trainer scores it.
  tile = lambda x: np.repeat(x, K, axis=0)
  full = jitted['forward'](
      params, np.concatenate([tile(tokens), new_bkt.reshape(B * K, T)], 1),
      np.concatenate([tile(positions), pos_bkt.reshape(B * K, T)], 1),
      np.concatenate([tile(mask), np.ones((B * K, T), bool)], 1))
  assert_f32_close(np.stack(decoded, 2).reshape(B * K, T, -1), full[:, P:], FIXTURE_TERMS)


def test_shared_prefix_decode_matches_unshared():
  """Prompt tiled to B*K rows with K=1 (the unshared layout) gives the same logits."""
  config = CONFIGS['llama']
  graphdef, params = random_params(config, seed=2)
  fns = model_fns(graphdef)
  prefill, decode = jax.jit(fns.prefill), jax.jit(fns.decode)
  rng = np.random.default_rng(2)
  tokens, mask, positions, lengths = prompts(rng, config.vocab_size)
  new_bkt = rng.integers(3, config.vocab_size, size=(B, K, T)).astype(np.int32)
  pos_bkt = np.broadcast_to((lengths[:, None] + np.arange(T))[:, None], (B, K, T)).astype(np.int32)

  shared = fns.init_cache(prefill(params, tokens, positions, mask)[1], mask, K, T)
  tile = lambda x: np.repeat(x, K, axis=0)
  unshared = fns.init_cache(prefill(params, tile(tokens), tile(positions), tile(mask))[1],
                            tile(mask), 1, T)
  for i in range(T):
    logits_s, shared = decode(params, new_bkt[..., i], pos_bkt[..., i], shared)
    logits_u, unshared = decode(params, new_bkt[..., i].reshape(B * K, 1),
                                pos_bkt[..., i].reshape(B * K, 1), unshared)
    assert_f32_close(logits_s.reshape(B * K, -1), logits_u[:, 0], FIXTURE_TERMS)


def test_bfloat16_activations_give_float32_logits():
  config = CONFIGS['llama']
  graphdef, params = random_params(config, seed=3, scale=0.1)
  bf_fns = model_fns(abstract(config.replace(dtype='bfloat16'))[0])
  tokens, mask, positions, _ = prompts(np.random.default_rng(3), config.vocab_size)
  ref, _ = jax.jit(model_fns(graphdef).prefill)(params, tokens, positions, mask)
  logits, prefix = jax.jit(bf_fns.prefill)(params, tokens, positions, mask)
  assert logits.dtype == jnp.float32 and prefix.k_lbphd.dtype == jnp.bfloat16
  np.testing.assert_allclose(logits, ref, atol=0.03)
  _, bf_params = abstract(config.replace(param_dtype='bfloat16'))
  assert {x.dtype for x in jax.tree.leaves(bf_params)} == {jnp.dtype(jnp.bfloat16)}


def test_scalar_head():
  config = CONFIGS['qwen2'].replace(head='scalar')
  graphdef, params = random_params(config)
  fns = model_fns(graphdef)
  tokens, mask, positions, _ = prompts(np.random.default_rng(4), config.vocab_size)
  last_b, prefix = jax.jit(fns.prefill)(params, tokens, positions, mask)
  values_bp = jax.jit(fns.forward)(params, tokens, positions, mask)
  assert values_bp.shape == (B, P) and values_bp.dtype == jnp.float32
  last = P - 1 - np.argmax(mask[:, ::-1], axis=1)
  np.testing.assert_allclose(last_b, values_bp[np.arange(B), last], atol=1e-6, rtol=1e-6)
  assert prefix.k_lbphd.shape[:3] == (config.num_layers, B, P)
  sliced = jax.jit(fns.forward, static_argnames='head_slice')(params, tokens, positions, mask,
                                                               head_slice=(1, 2))
  np.testing.assert_allclose(sliced, values_bp[:, 1:3], atol=1e-6, rtol=1e-6)


def test_partial_rotary_rotates_only_the_leading_dims():
  """GPT-NeoX's rotary_pct: RoPE over the first rotary_dim dims of a head (as a full RoPE of
  that width), the rest of the head passed through unchanged."""
  from rloo_jax.models import layers
  rng = np.random.default_rng(8)
  x = jnp.asarray(rng.standard_normal((B, P, 2, 8)), jnp.float32)
  positions = jnp.asarray(rng.integers(0, 64, size=(B, P)), jnp.int32)
  rotary = layers._rotary(positions, 2, 10000.0, 64)
  out = layers._rope(x, rotary)
  np.testing.assert_array_equal(out[..., 2:], x[..., 2:])
  np.testing.assert_allclose(out[..., :2], layers._rope(x[..., :2], rotary), atol=1e-6)
  assert not np.allclose(out[..., :2], x[..., :2])  # the leading dims did rotate
  assert CONFIGS['gpt_neox'].rotary_dim == 2 and CONFIGS['gpt_neox_seq'].rotary_dim == 4
  assert CONFIGS['llama'].rotary_dim == CONFIGS['llama'].head_dim


def test_rotary_angles_are_computed_at_the_positions_without_a_table():
  """cos / sin of position x inverse frequency at each position (clipped to the model's range),
  equal to a [max_seq_len, D/2] table's rows; the program holds no such table (the TPU
  compiler kept one whole in the decode loop: 2 x 32 MiB at 131,072 positions)."""
  from rloo_jax.models import layers
  max_len = 131072
  positions = jnp.asarray([[0, 5, 4095, 131071], [-3, 131072, 200000, 77]], jnp.int32)
  cos, sin = jax.jit(lambda p: layers._rotary(p, 64, 1e6, max_len))(positions)

  @jax.jit
  def rows(p):  # the table's, compiled alike (XLA folds inv_freq's constants its own way)
    table = jnp.arange(max_len, dtype=jnp.float32)[:, None] * layers.inv_freq(64, 1e6)
    return tuple(jnp.take(f(table), p, axis=0, mode='clip') for f in (jnp.cos, jnp.sin))

  np.testing.assert_array_equal(cos[:, :, 0], rows(positions)[0])
  np.testing.assert_array_equal(sin[:, :, 0], rows(positions)[1])
  text = jax.jit(lambda p: layers._rotary(p, 64, 1e6, max_len)).lower(positions).as_text()
  assert f"tensor<{max_len}x" not in text and f"x{max_len}x" not in text, text


def test_gpt_neox_config():
  c = CONFIGS['gpt_neox']
  assert (c.family, c.parallel_residual, c.rotary_pct, c.tie_embeddings, c.qkv_bias,
          c.out_bias, c.layer_norm, c.gated_mlp) == ('gpt_neox', True, 0.25, False, True, True,
                                                     True, False)
  # No GQA, as in GPT-2: kv heads follow the heads unless told otherwise.
  assert TransformerConfig.gpt_neox(num_heads=8).num_kv_heads == 8
  # Only the gpt_neox flavour changes: the other families keep sequential full-width RoPE.
  assert all(not CONFIGS[f].parallel_residual and CONFIGS[f].rotary_pct == 1.0
             for f in ('llama', 'qwen2', 'gpt2'))
  # Biased attention output only with the qkv bias (transformers' attention_bias).
  no_bias = c.replace(qkv_bias=False)
  assert not no_bias.out_bias
  assert sum(x.size for x in jax.tree.leaves(abstract(no_bias)[1])) == no_bias.num_params
  # rotate_half pairs the two halves of the rotated dims: an odd count, or none, has no pairing.
  for pct, dims in ((0.375, 3), (0.1, 0), (1.5, 12)):
    with pytest.raises(ValueError, match=f'rotary_pct={pct} gives {dims} rotary dims'):
      c.replace(rotary_pct=pct)


def test_qk_norm_makes_the_scores_scale_free():
  """Qwen3 RMS-normalises each q and k head before RoPE: scaling the q and k kernels leaves the
  logits unchanged, where without qk_norm (Llama) it sharpens every softmax."""
  c = CONFIGS['qwen3']
  assert c.qk_norm and not c.qkv_bias and c.num_heads * c.head_dim != c.hidden_size
  tokens, mask, positions, _ = prompts(np.random.default_rng(9), c.vocab_size)
  for config, invariant in ((c, True), (CONFIGS['llama'], False)):
    graphdef, params = random_params(config, seed=4)
    forward = jax.jit(model_fns(graphdef).forward)
    ref = np.asarray(forward(params, tokens, positions, mask))
    attn = params['layers']['attn']
    for name in ('q_kernel', 'k_kernel'):
      attn[name].set_value(attn[name][...] * 3.0)
    got = np.asarray(forward(params, tokens, positions, mask))
    assert np.allclose(got[mask], ref[mask], atol=1e-4) == invariant, config.family
  assert params['layers']['attn'].get('q_norm_scale') is None  # Llama has none
  _, qwen3_params = abstract(c)
  assert qwen3_params['layers']['attn']['q_norm_scale'].shape == (c.num_layers, c.head_dim)


def test_rope_scaling_config():
  """rope_type is validated; defaults leave every existing family on plain RoPE."""
  assert all(CONFIGS[f].rope_type == 'default' for f in ('llama', 'qwen2', 'gpt_neox', 'qwen3'))
  with pytest.raises(ValueError, match="rope_type='yarn'"):
    TransformerConfig.llama(rope_type='yarn')
  with pytest.raises(ValueError, match='rope_high_freq_factor'):
    TransformerConfig.llama(rope_type='llama3', rope_low_freq_factor=4.0)
  c = CONFIGS['llama3']
  assert c.rope_scaling == ('llama3', 8.0, 1.0, 4.0, 4) and hash(c) == hash(c.replace())
  # The scaling changes the logits of the same weights.
  graphdef, params = random_params(c, seed=5)
  plain = c.replace(rope_type='default')
  tokens, mask, positions, _ = prompts(np.random.default_rng(5), c.vocab_size)
  a = jax.jit(model_fns(graphdef).forward)(params, tokens, positions, mask)
  b = jax.jit(model_fns(abstract(plain)[0]).forward)(params, tokens, positions, mask)
  assert np.abs(np.asarray(a) - np.asarray(b))[mask].max() > 1e-3


def test_qwen3_and_llama3_presets():
  """The Qwen3 presets' sizes: exactly KerasHub's 596,049,920 for 0.6B, the model cards'
  1.7B / 4.0B / 8.2B totals and 0.44B / 1.4B / 3.6B / 6.95B without the embeddings; the
  Llama 3.2 presets carry their config.json's rope scaling."""
  from rloo_jax.models import presets
  assert presets.get('qwen3-0.6b').num_params == 596_049_920
  published = {'qwen3-0.6b': (0.6e9, 0.44e9), 'qwen3-1.7b': (1.72e9, 1.4e9),
               'qwen3-4b': (4.02e9, 3.6e9), 'qwen3-8b': (8.19e9, 6.95e9)}
  for name, (total, body) in published.items():
    c = presets.get(name)
    assert (c.family, c.qk_norm, c.qkv_bias, c.head_dim) == ('qwen3', True, False, 128)
    embeddings = c.vocab_size * c.hidden_size * (1 if c.tie_embeddings else 2)
    assert abs(c.num_params / total - 1) < 0.01, name
    assert abs((c.num_params - embeddings) / body - 1) < 0.01, name
    assert c.tie_embeddings == (name != 'qwen3-8b')
  assert presets.get('qwen3-4b').num_heads * 128 != presets.get('qwen3-4b').hidden_size
  for name in ('llama-3.2-1b', 'llama-3.2-3b'):
    assert presets.get(name).rope_scaling == ('llama3', 32.0, 1.0, 4.0, 8192)
  assert presets.get('llama-3-8b').rope_type == 'default'


def test_config_validation():
  with pytest.raises(ValueError, match='family'):
    TransformerConfig(family='mistral')
  with pytest.raises(ValueError, match='num_kv_heads'):
    TransformerConfig.llama(num_heads=4, num_kv_heads=3)
  with pytest.raises(ValueError, match='head'):
    TransformerConfig.llama(head='classifier')
  assert hash(CONFIGS['llama']) == hash(CONFIGS['llama'].replace())
  gpt2 = TransformerConfig.gpt2(num_heads=4)
  assert gpt2.num_kv_heads == 4 and gpt2.tie_embeddings and gpt2.family == 'gpt2'


@pytest.mark.parametrize('name', ['mistral_window', 'gemma2'])
def test_sliding_window_hides_only_keys_beyond_it(name):
  """Positions within the window of every key see what an unwindowed model sees; later ones
  differ (the window really masks), and only in the layers it applies to: a model whose every
  layer is full is the unwindowed one."""
  config = CONFIGS[name]
  graphdef, params = random_params(config, seed=2)
  wide = config.replace(sliding_window=0)
  fwd = lambda c, *a: np.asarray(model_fns(abstract(c)[0]).forward(params, *a))
  s = 10
  tokens = np.random.default_rng(0).integers(3, config.vocab_size, (1, s)).astype(np.int32)
  args = (tokens, np.arange(s, dtype=np.int32)[None], np.ones((1, s), bool))
  got, want = fwd(config, *args), fwd(wide, *args)
  w = config.sliding_window
  np.testing.assert_allclose(got[:, :w], want[:, :w], rtol=1e-5, atol=1e-6)
  assert np.abs(got[:, w:] - want[:, w:]).min(axis=-1).max() > 1e-4
  if config.layer_types:
    full = config.replace(layer_types=('full_attention',) * config.num_layers)
    np.testing.assert_array_equal(fwd(full, *args), want)

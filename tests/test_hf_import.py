"""Hugging Face import: parity with transformers through committed fixtures (no torch needed).

Fixtures come from tests/make_hf_fixtures.py; the live test at the bottom reruns that script's
model builder with transformers + torch (the "hf" extra) and is skipped without them.
"""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import FIXTURE_TERMS, assert_f32_close

from rloo_jax import sampler, sampling
from rloo_jax.models import hf, model_fns

# Float comparisons of two computations: rerun by .ci/run under other CPU flags.
pytestmark = pytest.mark.numerics

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'fixtures', 'hf')
# Fixture directories (make_hf_fixtures.FAMILIES); llama3 and mistral load as family 'llama'.
FAMILIES = ('llama', 'qwen2', 'gpt2', 'gpt_neox', 'llama3', 'qwen3', 'mistral', 'gemma2', 'gemma3')
ARCH = {'llama': 'LlamaForCausalLM', 'qwen2': 'Qwen2ForCausalLM', 'gpt2': 'GPT2LMHeadModel',
        'gpt_neox': 'GPTNeoXForCausalLM', 'llama3': 'LlamaForCausalLM',
        'qwen3': 'Qwen3ForCausalLM', 'mistral': 'MistralForCausalLM',
        'gemma2': 'Gemma2ForCausalLM', 'gemma3': 'Gemma3ForCausalLM'}
MODEL_FAMILY = {'llama3': 'llama', 'mistral': 'llama'}
TIED = {'qwen2', 'gpt2', 'llama3', 'qwen3', 'gemma2', 'gemma3'}


@pytest.fixture(scope='module', params=FAMILIES)
def loaded(request):
  path = os.path.join(FIXTURES, request.param)
  config, graphdef, params = hf.load_model(path)
  fns = model_fns(graphdef)
  jitted = dict(forward=jax.jit(fns.forward), prefill=jax.jit(fns.prefill),
                decode=jax.jit(fns.decode))
  ref = dict(np.load(os.path.join(path, 'reference.npz')))
  return request.param, path, config, params, jitted, fns, ref


def check_logits(jitted, params, ref):
  for side in ('right', 'left'):
    mask = ref[f'{side}_mask']
    logits = jitted['forward'](params, ref[f'{side}_tokens'], ref[f'{side}_positions'], mask)
    assert logits.dtype == jnp.float32
    assert_f32_close(logits[mask], ref[f'{side}_logits'][mask], FIXTURE_TERMS,
                     err_msg=f'{side}-padded batch')
    # The prefill's head runs at each row's last valid position only: the same logits there.
    first, _ = jitted['prefill'](params, ref[f'{side}_tokens'], ref[f'{side}_positions'], mask)
    last = mask.shape[1] - 1 - np.argmax(mask[:, ::-1], axis=1)
    assert_f32_close(first, ref[f'{side}_logits'][np.arange(len(last)), last], FIXTURE_TERMS,
                     err_msg=f'{side}-padded prefill')


def greedy(jitted, fns, params, prompt_tokens_bp, lengths_b, *, k, new_tokens):
  """Test-local greedy loop: prefill once, then k streams per prompt on the shared prefix."""
  b, p = prompt_tokens_bp.shape
  mask_bp = np.arange(p)[None] < lengths_b[:, None]
  positions_bp = np.broadcast_to(np.arange(p, dtype=np.int32), (b, p))
  last_bv, prefix = jitted['prefill'](params, prompt_tokens_bp, positions_bp, mask_bp)
  # argmax on the host: eager jnp ops would each cost a compile on a small CPU.
  last_bv = np.asarray(last_bv)
  tok_bk = np.repeat(last_bv.argmax(-1)[:, None], k, axis=1).astype(np.int32)
  cache = fns.init_cache(prefix, mask_bp, k, new_tokens)
  out = [tok_bk]
  for i in range(new_tokens - 1):
    pos_bk = np.broadcast_to(lengths_b[:, None] + i, (b, k)).astype(np.int32)
    logits_bkv, cache = jitted['decode'](params, tok_bk, pos_bk, cache)
    tok_bk = np.asarray(logits_bkv).argmax(-1).astype(np.int32)
    out.append(tok_bk)
  return np.stack(out, -1)  # [B, k, T]


def check_greedy(jitted, fns, params, ref):
  want = ref['greedy_tokens']
  # Extra right padding up to the logits batch's width: same prefill shape, no new compile.
  prompts = ref['prompt_tokens']
  width = max(prompts.shape[1], ref['right_tokens'].shape[1])
  prompts = np.pad(prompts, ((0, 0), (0, width - prompts.shape[1])))
  got = greedy(jitted, fns, params, prompts, ref['prompt_lengths'], k=2, new_tokens=want.shape[1])
  for j in range(got.shape[1]):
    np.testing.assert_array_equal(got[:, j], want, err_msg=f'stream {j}')


def test_logits_match_transformers(loaded):
  _, _, _, params, jitted, _, ref = loaded
  check_logits(jitted, params, ref)


def test_greedy_matches_transformers_generate(loaded):
  _, _, _, params, jitted, fns, ref = loaded
  # Reference paths keep a top1-top2 gap far above float32 noise, so equality is meaningful.
  assert float(ref['greedy_min_margin']) > 1e-3
  check_greedy(jitted, fns, params, ref)


def test_config_mapping(loaded):
  family, path, config, params, _, _, _ = loaded
  with open(os.path.join(path, 'config.json')) as f:
    raw = json.load(f)
  assert raw['architectures'] == [ARCH[family]]
  assert config.family == MODEL_FAMILY.get(family, family)
  assert config.vocab_size == raw['vocab_size']
  assert config.tie_embeddings == (family in TIED)
  assert config.qkv_bias == (family in ('qwen2', 'gpt2', 'gpt_neox'))
  assert config.qk_norm == (family in ('qwen3', 'gemma3'))
  if family != 'gpt2':
    if 'head_dim' in raw:
      assert config.head_dim == raw['head_dim']
    rope = raw['rope_parameters']
    if family == 'gemma3':  # per layer type; the sliding layers' plain RoPE is local_rope_theta
      rope, local = rope['full_attention'], rope['sliding_attention']
      assert config.local_rope_theta == local['rope_theta'] == 1000.0 and config.rope_factor == 4
    assert config.rope_theta == rope['rope_theta'] and config.rope_type == rope['rope_type']
    # transformers < 5 wrote a top-level rope_theta (+ rope_scaling) instead of rope_parameters,
    # and GPT-NeoX (Pythia's config.json) rotary_emb_base and rotary_pct.
    old = {k: v for k, v in raw.items() if k != 'rope_parameters'}
    if family == 'gpt_neox':
      old.update(rotary_emb_base=rope['rope_theta'], rotary_pct=rope['partial_rotary_factor'])
    elif family == 'gemma3':  # transformers 4: rope_scaling on the global layers only
      old.update(rope_theta=rope['rope_theta'], rope_local_base_freq=local['rope_theta'],
                 rope_scaling={k: v for k, v in rope.items() if k != 'rope_theta'})
    else:
      old['rope_theta'] = rope['rope_theta']
      if rope['rope_type'] != 'default':
        old['rope_scaling'] = {k: v for k, v in rope.items() if k != 'rope_theta'}
    assert hf.config_from_hf(old) == config
    for rope_type in ('yarn', 'dynamic', 'longrope'):
      with pytest.raises(ValueError, match=f"{ARCH[family]}: rope_type '{rope_type}' is not"):
        hf.config_from_hf({**old, 'rope_scaling': {'rope_type': rope_type, 'factor': 4.0}})
  assert sum(x.size for x in jax.tree.leaves(params)) == config.num_params
  if family == 'gpt_neox':
    # head_dim 8 with rotary_pct 0.25: RoPE on 2 of each head, the other 6 passed through.
    assert (config.rotary_dim, config.parallel_residual, config.out_bias) == (2, True, True)
    assert config.norm_eps == raw['layer_norm_eps']
  if family == 'llama3':
    assert (config.rope_factor, config.rope_low_freq_factor, config.rope_high_freq_factor,
            config.rope_original_max_len) == (8.0, 1.0, 4.0, 32)
  if family in ('qwen3', 'mistral', 'gemma2', 'gemma3'):
    # These fixtures' heads are wider or narrower than hidden / heads.
    assert config.head_dim != config.hidden_size // config.num_heads
  if family.startswith('gemma'):
    assert config.sliding_window == raw['sliding_window'] and config.is_gemma
    assert config.layer_types == tuple(raw['layer_types']) and len(set(raw['layer_types'])) == 2
    assert (config.attn_softcap, config.final_softcap) == (
        raw['attn_logit_softcapping'] or 0, raw['final_logit_softcapping'] or 0)
    assert config.query_pre_attn_scalar == raw['query_pre_attn_scalar'] != config.head_dim


# What each Gemma fixture exercises: switched off, parity with transformers is lost.
BITES = {'gemma2': dict(sliding_window=0, attn_softcap=0.0, final_softcap=0.0,
                        query_pre_attn_scalar=0.0),
         'gemma3': dict(sliding_window=0, local_rope_theta=0.0, rope_type='default',
                        query_pre_attn_scalar=0.0)}


@pytest.mark.parametrize('family,field', [(f, k) for f, kw in BITES.items() for k in kw])
def test_gemma_features_bite(family, field):
  path = os.path.join(FIXTURES, family)
  ref = dict(np.load(os.path.join(path, 'reference.npz')))
  _, graphdef, params = hf.load_model(path, **{field: BITES[family][field]})
  mask = ref['left_mask']
  logits = jax.jit(model_fns(graphdef).forward)(params, ref['left_tokens'],
                                                ref['left_positions'], mask)
  assert np.abs(np.asarray(logits)[mask] - ref['left_logits'][mask]).max() > 1e-2


def test_llama3_rope_scaling_bites(tmp_path):
  """The llama3 fixture's scaling changes its logits at the fixture's positions: loaded as
  default RoPE, the parity with transformers is lost by far; as 'linear' too (another rule)."""
  path = os.path.join(FIXTURES, 'llama3')
  ref = dict(np.load(os.path.join(path, 'reference.npz')))
  mask = ref['right_mask']
  for rope_type in ('default', 'linear'):
    _, graphdef, params = hf.load_model(path, rope_type=rope_type)
    logits = jax.jit(model_fns(graphdef).forward)(params, ref['right_tokens'],
                                                  ref['right_positions'], mask)
    assert np.abs(np.asarray(logits)[mask] - ref['right_logits'][mask]).max() > 0.1, rope_type


def test_inv_freq_scaling_rules():
  """layers.inv_freq against transformers' rules written out by hand: 'linear' divides every
  frequency by the factor; 'llama3' keeps those whose wavelength is under original/high,
  divides those over original/low, and blends between."""
  from rloo_jax.models import layers
  base = np.asarray(layers.inv_freq(16, 10000.0))
  np.testing.assert_allclose(base, 1.0 / 10000.0 ** (np.arange(0, 16, 2) / 16), rtol=1e-6)
  np.testing.assert_allclose(layers.inv_freq(16, 10000.0, ('linear', 4.0)), base / 4, rtol=1e-6)
  got = np.asarray(layers.inv_freq(16, 10000.0, ('llama3', 8.0, 1.0, 4.0, 32)))
  wavelen = 2 * np.pi / base
  kept, divided = wavelen < 32 / 4, wavelen > 32 / 1
  medium = ~kept & ~divided
  assert kept.sum() == 1 and medium.sum() == 1 and divided.sum() == 6
  np.testing.assert_allclose(got[kept], base[kept], rtol=1e-6)
  np.testing.assert_allclose(got[divided], base[divided] / 8, rtol=1e-6)
  smooth = (32 / wavelen[medium] - 1) / (4 - 1)
  np.testing.assert_allclose(got[medium], (1 - smooth) * base[medium] / 8
                             + smooth * base[medium], rtol=1e-6)
  assert base[medium] / 8 < got[medium] < base[medium]


def test_sliding_windows_and_gemma_configs_are_mapped():
  """Mistral slides in every layer when sliding_window is set (layer_types ()); Qwen only with
  use_sliding_window, from max_window_layers on or as its layer_types say. Gemma's unsupported
  switches are refused naming the config.json field."""
  raw = json.load(open(os.path.join(FIXTURES, 'mistral', 'config.json')))
  want = hf.config_from_hf(raw)
  assert (want.family, want.sliding_window, want.layer_types) == ('llama', 64, ())
  assert hf.config_from_hf({**raw, 'sliding_window': 16}) == want.replace(sliding_window=16)
  assert hf.config_from_hf({**raw, 'sliding_window': None}).sliding_layers == (False, False)
  with pytest.raises(ValueError, match='MistralForCausalLM: layer_types with sliding_attention'):
    hf.config_from_hf({**raw, 'layer_types': ['full_attention', 'sliding_attention']})
  qwen3 = json.load(open(os.path.join(FIXTURES, 'qwen3', 'config.json')))
  assert hf.config_from_hf({**qwen3, 'sliding_window': 8}).sliding_window == 0
  on = {**qwen3, 'sliding_window': 8, 'use_sliding_window': True}
  del on['layer_types']
  assert hf.config_from_hf({**on, 'max_window_layers': 1}).layer_types == (
      'full_attention', 'sliding_attention')
  assert hf.config_from_hf({**on, 'max_window_layers': 0}).layer_types == ()  # all slide
  with pytest.raises(ValueError, match="Qwen3ForCausalLM: layer_types \\['bad'\\] needs one"):
    hf.config_from_hf({**on, 'layer_types': ['bad']})
  # No architectures list: the model_type names it.
  bare = {k: v for k, v in raw.items() if k != 'architectures'}
  assert hf.architecture(bare) == 'MistralForCausalLM' and hf.config_from_hf(bare) == want
  gemma3 = json.load(open(os.path.join(FIXTURES, 'gemma3', 'config.json')))
  for key, value in (('hidden_activation', 'gelu'), ('attention_bias', True),
                     ('use_bidirectional_attention', True)):
    with pytest.raises(ValueError, match=f'Gemma3ForCausalLM: {key}'):
      hf.config_from_hf({**gemma3, key: value})
  with pytest.raises(ValueError, match='rope_parameters.sliding_attention.rope_type'):
    hf.config_from_hf({**gemma3, 'rope_parameters': {**gemma3['rope_parameters'], 'sliding_atten'
                                                     'tion': {'rope_type': 'linear', 'factor': 2}}})
  # transformers 4's spelling: the pattern instead of layer_types (a global layer every 2nd).
  old = {k: v for k, v in gemma3.items() if k != 'layer_types'}
  assert hf.config_from_hf({**old, 'sliding_window_pattern': 2}).layer_types == (
      'sliding_attention', 'full_attention') * 2


def test_gemma3_multimodal_text_weights(tmp_path):
  """Gemma3ForConditionalGeneration: the text_config and the language model's tensors (under
  transformers 5's model.language_model. or the hub's language_model.model.), vision ignored."""
  from safetensors.numpy import load_file, save_file

  src = os.path.join(FIXTURES, 'gemma3')
  want_config, want = hf.load_checkpoint(src)
  text = json.load(open(os.path.join(src, 'config.json')))
  tensors = load_file(os.path.join(src, 'model.safetensors'))
  for pre in ('model.language_model.', 'language_model.model.'):
    path = tmp_path / pre.replace('.', '_')
    path.mkdir()
    renamed = {pre + k[len('model.'):]: v for k, v in tensors.items()}
    renamed['model.vision_tower.vision_model.post_layernorm.weight'] = np.ones(4, np.float32)
    save_file(renamed, str(path / 'model.safetensors'))
    cfg = {'model_type': 'gemma3', 'tie_word_embeddings': True, 'vision_config': {},
           'text_config': {k: v for k, v in text.items() if k != 'tie_word_embeddings'}}
    (path / 'config.json').write_text(json.dumps(cfg))
    config, params = hf.load_checkpoint(str(path))
    assert config == want_config
    jax.tree.map(np.testing.assert_array_equal, params, want)


def test_tokenizer():
  tok = hf.load_tokenizer(os.path.join(FIXTURES, 'llama'))
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 0)
  assert tok.vocab_size <= 128
  ids = tok.encode('the quick brown fox')
  with_bos = tok.encode('the quick brown fox', add_special_tokens=True)
  assert with_bos == [tok.bos_id] + ids
  assert tok.decode(with_bos) == 'the quick brown fox'
  # Decoding stops at EOS, as in rloo_jax.data.tokenizer: what follows is padding or junk.
  assert tok.decode(np.array(ids + [tok.eos_id] + ids)) == 'the quick brown fox'
  assert tok.decode_batch(tok.encode_batch(['two plus two', 'the reward'])) == [
      'two plus two', 'the reward']
  ref = np.load(os.path.join(FIXTURES, 'llama', 'reference.npz'))
  n = ref['prompt_lengths'][0]
  assert ref['prompt_tokens'][0, :n].tolist() == tok.encode('the quick brown fox jumps over', True)


def _copy(family, tmp_path):
  dst = tmp_path / family
  shutil.copytree(os.path.join(FIXTURES, family), dst)
  return str(dst)


def test_sharded_checkpoint_and_load_options(tmp_path):
  from safetensors.numpy import load_file, save_file

  path = _copy('llama', tmp_path)
  tensors = load_file(os.path.join(path, 'model.safetensors'))
  os.remove(os.path.join(path, 'model.safetensors'))
  names = sorted(tensors)
  shards = {'model-00001-of-00002.safetensors': names[::2],
            'model-00002-of-00002.safetensors': names[1::2]}
  for fname, keys in shards.items():
    save_file({k: tensors[k] for k in keys}, os.path.join(path, fname))
  with open(os.path.join(path, 'model.safetensors.index.json'), 'w') as f:
    json.dump({'metadata': {}, 'weight_map': {k: fn for fn, ks in shards.items() for k in ks}}, f)
  _, params = hf.load_checkpoint(path)
  _, want = hf.load_checkpoint(os.path.join(FIXTURES, 'llama'))
  jax.tree.map(np.testing.assert_array_equal, params, want)

  config, bf16 = hf.load_checkpoint(path, param_dtype='bfloat16', dtype='bfloat16')
  assert config.dtype == 'bfloat16'
  assert {x.dtype for x in jax.tree.leaves(bf16)} == {jnp.dtype(jnp.bfloat16)}
  # A value model on the policy's backbone: same trunk, fresh scalar head.
  config, value = hf.load_checkpoint(path, head='scalar')
  assert config.head == 'scalar' and value['score_kernel'].shape == (config.hidden_size, 1)
  np.testing.assert_array_equal(value['embedding'][...], want['embedding'][...])


def test_missing_tensor_names_the_key(tmp_path):
  from safetensors.numpy import load_file, save_file

  path = _copy('qwen2', tmp_path)
  f = os.path.join(path, 'model.safetensors')
  tensors = load_file(f)
  key = 'model.layers.1.self_attn.k_proj.bias'
  del tensors[key]
  save_file(tensors, f)
  with pytest.raises(ValueError, match=f'Qwen2ForCausalLM.*{key}'):
    hf.load_checkpoint(path)


def test_unsupported_architecture_is_named(tmp_path):
  path = _copy('gpt2', tmp_path)
  cfg_file = os.path.join(path, 'config.json')
  with open(cfg_file) as f:
    cfg = json.load(f)
  cfg['architectures'] = ['GemmaForCausalLM']
  with open(cfg_file, 'w') as f:
    json.dump(cfg, f)
  with pytest.raises(ValueError, match='GemmaForCausalLM.*supported: LlamaForCausalLM'):
    hf.load_checkpoint(path)
  with pytest.raises(ValueError, match='no model.safetensors'):
    os.remove(os.path.join(path, 'model.safetensors'))
    cfg['architectures'] = ['GPT2LMHeadModel']
    with open(cfg_file, 'w') as f:
      json.dump(cfg, f)
    hf.load_checkpoint(path)


# Plus sliding windows that bite at the reference lengths (the fixtures' Mistral and Qwen have
# none): every Mistral layer, Qwen's from max_window_layers on.
LIVE = [(f, {}) for f in FAMILIES] + [
    ('mistral', dict(sliding_window=4)),
    ('qwen2', dict(use_sliding_window=True, sliding_window=3, max_window_layers=1,
                   layer_types=['full_attention', 'sliding_attention']))]


@pytest.mark.parametrize('family,overrides', LIVE)
def test_live_parity_with_transformers(family, overrides, tmp_path, monkeypatch):
  """Fresh random checkpoints straight from transformers (not the committed fixtures)."""
  pytest.importorskip('torch', reason='live transformers parity needs the "hf" extra (torch CPU)')
  pytest.importorskip('transformers', reason='live transformers parity needs the "hf" extra')
  monkeypatch.setenv('HF_HUB_OFFLINE', '1')
  import make_hf_fixtures  # tests/ is on sys.path under pytest's rootdir conftest

  ref = make_hf_fixtures.write_family(family, str(tmp_path), seed=11, **overrides)
  _, graphdef, params = hf.load_model(str(tmp_path))
  fns = model_fns(graphdef)
  jitted = dict(forward=jax.jit(fns.forward), prefill=jax.jit(fns.prefill),
                decode=jax.jit(fns.decode))
  check_logits(jitted, params, ref)
  if float(ref['greedy_min_margin']) > 1e-3:
    check_greedy(jitted, fns, params, ref)


def test_sampler_greedy_matches_transformers_generate():
  """End to end through rloo_jax.sampler (shared prefix, k streams) on the imported weights."""
  path = os.path.join(FIXTURES, 'qwen2')
  _, graphdef, params = hf.load_model(path)
  ref = np.load(os.path.join(path, 'reference.npz'))
  want = ref['greedy_tokens']
  assert 2 not in want  # eos_id below: the reference paths never stop early
  out = sampler.sample(model_fns(graphdef), params, ref['prompt_tokens'], ref['prompt_lengths'],
                       jax.random.key(0), k=2, max_new_tokens=want.shape[1],
                       method=sampling.Greedy(), eos_id=2, pad_id=0, mode='shared')
  for j in range(2):
    np.testing.assert_array_equal(np.asarray(out.tokens_bkt)[:, j], want, err_msg=f'stream {j}')


def test_gpt_neox_head_name_and_activation(tmp_path):
  """Pythia's checkpoints name the untied head embed_out; one saved as lm_head loads the same.
  A GELU flavour other than the exact one is refused rather than silently run as exact."""
  from safetensors.numpy import load_file, save_file

  path = _copy('gpt_neox', tmp_path)
  f = os.path.join(path, 'model.safetensors')
  tensors = load_file(f)
  tensors['lm_head.weight'] = tensors.pop('embed_out.weight')
  save_file(tensors, f)
  _, params = hf.load_checkpoint(path)
  _, want = hf.load_checkpoint(os.path.join(FIXTURES, 'gpt_neox'))
  jax.tree.map(np.testing.assert_array_equal, params, want)
  with open(os.path.join(path, 'config.json')) as fh:
    raw = json.load(fh)
  with pytest.raises(ValueError, match="GPTNeoXForCausalLM: hidden_act 'gelu_fast'"):
    hf.config_from_hf({**raw, 'hidden_act': 'gelu_fast'})

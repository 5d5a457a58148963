"""Hugging Face export (rloo_jax.models.hf_export, `python -m rloo_jax.export`): every committed
fixture round-trips bit for bit through save_pretrained and the importer, in transformers' own
tensor names and shapes; sharded and bfloat16 exports; a trained run exported from the command
line. The transformers check at the bottom needs torch (skipped without it)."""

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_tensors import iter_tensors
from numerics import FIXTURE_TERMS, assert_f32_close

from conftest import REPO
import rloo_jax
from rloo_jax import algorithms, config_utils, export
from rloo_jax.models import hf, hf_export, transformer

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'fixtures', 'hf')
# Every committed fixture; Mistral (family llama with a sliding window) exports as Mistral.
FAMILIES = ('llama', 'qwen2', 'gpt2', 'gpt_neox', 'qwen3', 'llama3', 'mistral', 'gemma2',
            'gemma3')
LLAMA = os.path.join(FIXTURES, 'llama')
# The config.json keys config_from_hf reads, per family (the rest are transformers' defaults).
ARCH_KEYS = {
    'gpt2': ('architectures', 'model_type', 'vocab_size', 'n_embd', 'n_head', 'n_layer',
             'n_positions', 'layer_norm_epsilon', 'activation_function', 'tie_word_embeddings'),
    'rope': ('architectures', 'model_type', 'vocab_size', 'hidden_size', 'num_hidden_layers',
             'num_attention_heads', 'num_key_value_heads', 'head_dim', 'intermediate_size',
             'max_position_embeddings', 'rms_norm_eps', 'layer_norm_eps', 'rope_parameters',
             'rope_theta',
             'tie_word_embeddings', 'hidden_act', 'attention_bias', 'use_parallel_residual',
             'use_sliding_window', 'layer_types', 'sliding_window', 'hidden_activation',
             'query_pre_attn_scalar', 'attn_logit_softcapping', 'final_logit_softcapping',
             'use_bidirectional_attention'),
}


def _header(path):
  """(name -> (dtype, shape)) of one safetensors file, and its tensor-data bytes."""
  with open(path, 'rb') as f:
    n = int.from_bytes(f.read(8), 'little')
    head = json.loads(f.read(n))
  head.pop('__metadata__', None)
  return ({k: (v['dtype'], tuple(v['shape'])) for k, v in head.items()},
          sum(v['data_offsets'][1] - v['data_offsets'][0] for v in head.values()))


def _layout(path):
  """name -> shape over every safetensors file of a checkpoint directory."""
  out = {}
  for f in sorted(os.listdir(path)):
    if f.endswith('.safetensors'):
      out.update({k: shape for k, (_, shape) in _header(os.path.join(path, f))[0].items()})
  return out


def _read(path, name):
  return json.load(open(os.path.join(path, name)))


@pytest.fixture(scope='module', params=FAMILIES)
def exported(request, tmp_path_factory):
  src = os.path.join(FIXTURES, request.param)
  config, params = hf.load_checkpoint(src)
  out = str(tmp_path_factory.mktemp(request.param) / 'hf')
  paths = hf_export.save_pretrained(params, config, out, dtype='float32', tokenizer_dir=src)
  return request.param, src, config, params, out, paths


def test_round_trip_is_exact(exported):
  _, src, config, params, out, _ = exported
  config2, params2 = hf.load_checkpoint(out)
  assert config2 == config
  jax.tree.map(np.testing.assert_array_equal, params2, params)
  # The files themselves, not just our reading of them: each tensor equals the original's.
  want = dict(iter_tensors(src))
  got = dict(iter_tensors(out))
  assert got.keys() == want.keys()
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_the_export_tokenizer_is_the_sources_and_encodes_as_transformers_did(exported):
  # tests/fixtures/export_tokenizers.json: transformers' class and ids of each fixture's source
  # tokenizer, which the torch-enabled parity run found equal on the export
  # (python experiments/export_parity.py --write_reference).
  family, src, _, _, out, _ = exported
  ref = _read(os.path.join(os.path.dirname(FIXTURES)), 'export_tokenizers.json')
  # tokenizer_config.json carried whole (tokenizer_class, chat_template, special tokens), and the
  # config's model_type, by which AutoTokenizer picks the class when the source names none.
  for name in ('tokenizer.json', 'tokenizer_config.json'):
    assert _read(out, name) == _read(src, name), name
  assert _read(out, 'config.json')['model_type'] == _read(src, 'config.json')['model_type']
  want = ref['families'][family]
  if want['tokenizer_class'] == 'TokenizersBackend':
    # transformers runs tokenizer.json as written: rloo_jax's encoding must be the same. (The
    # family classes rebuild their own pipeline, which these synthetic fixtures do not follow.)
    assert hf.load_tokenizer(out).encode(ref['prompt']) == want['ids']


def test_names_shapes_and_configs_match_the_original(exported):
  family, src, _, _, out, paths = exported
  # Same names and shapes: transformers reports no missing or unexpected keys.
  assert _layout(out) == _layout(src)
  assert all(dtype == 'F32' for dtype, _ in _header(os.path.join(out, 'model.safetensors'))[0]
             .values())
  want, got = _read(src, 'config.json'), _read(out, 'config.json')
  keys = [k for k in ARCH_KEYS['gpt2' if family == 'gpt2' else 'rope'] if k in want]
  assert len(keys) >= 9
  assert {k: got.get(k) for k in keys} == {k: want[k] for k in keys}
  gen_want, gen_got = _read(src, 'generation_config.json'), _read(out, 'generation_config.json')
  for k in ('bos_token_id', 'eos_token_id', 'pad_token_id'):
    assert gen_got[k] == gen_want[k] == got[k] == want[k]
  for name in ('tokenizer.json', 'tokenizer_config.json'):
    with open(os.path.join(src, name), 'rb') as a, open(os.path.join(out, name), 'rb') as b:
      assert a.read() == b.read()
  assert sorted(paths) == sorted(os.path.join(out, f) for f in os.listdir(out))


@pytest.mark.parametrize('family', ('qwen2', 'gpt_neox'))
def test_sharded_export_reloads_the_same_params(family, tmp_path):
  src = os.path.join(FIXTURES, family)
  config, params = hf.load_checkpoint(src)
  limit = 20_000
  out = str(tmp_path / 'hf')
  hf_export.save_pretrained(params, config, out, dtype='float32', max_shard_bytes=limit)
  index = _read(out, 'model.safetensors.index.json')
  files = sorted(f for f in os.listdir(out) if f.endswith('.safetensors'))
  n = len(files)
  assert n >= 3 and files == [f'model-{i:05d}-of-{n:05d}.safetensors' for i in range(1, n + 1)]
  assert not os.path.exists(os.path.join(out, 'model.safetensors'))
  sizes = {}
  for f in files:
    head, nbytes = _header(os.path.join(out, f))
    sizes[f] = nbytes
    assert {k for k, v in index['weight_map'].items() if v == f} == set(head)
    # Over the limit only when a single tensor is itself larger.
    assert nbytes <= limit or len(head) == 1
  assert index['metadata']['total_size'] == sum(sizes.values())
  assert _layout(out) == _layout(src)
  config2, params2 = hf.load_checkpoint(out)
  assert config2 == config
  jax.tree.map(np.testing.assert_array_equal, params2, params)


def test_bfloat16_export_halves_the_bytes(tmp_path):
  src = os.path.join(FIXTURES, 'gpt2')
  config, params = hf.load_checkpoint(src)
  sizes = {}
  for dt in ('float32', 'bfloat16'):
    hf_export.save_pretrained(params, config, str(tmp_path / dt), dtype=dt)
    head, sizes[dt] = _header(str(tmp_path / dt / 'model.safetensors'))
    assert {d for d, _ in head.values()} == {'F32' if dt == 'float32' else 'BF16'}
    assert _read(str(tmp_path / dt), 'config.json')['torch_dtype'] == dt
  assert sizes['bfloat16'] * 2 == sizes['float32'] == 4 * config.num_params
  _, params_bf16 = hf.load_checkpoint(str(tmp_path / 'bfloat16'))
  rounded = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), params)
  jax.tree.map(np.testing.assert_array_equal, params_bf16, rounded)
  assert not all(jax.tree.leaves(jax.tree.map(lambda a, b: bool((a == b).all()), params_bf16,
                                              params)))  # bfloat16 did round something


def test_refusals_name_the_problem(tmp_path):
  config, params = hf.load_checkpoint(LLAMA)
  (tmp_path / 'full').mkdir()
  (tmp_path / 'full' / 'model.safetensors').write_text('stale')
  with pytest.raises(FileExistsError, match='is not empty'):
    hf_export.save_pretrained(params, config, str(tmp_path / 'full'))
  with pytest.raises(ValueError, match="dtype='int8'"):
    hf_export.save_pretrained(params, config, str(tmp_path / 'a'), dtype='int8')
  # A reward model is exported (tests/test_hf_reward_source.py), but transformers pools by the
  # pad id: without one it cannot be scored in batches.
  with pytest.raises(ValueError, match="head='scalar'.*needs a pad_token_id"):
    hf_export.hf_config(config.replace(head='scalar'))
  with pytest.raises(ValueError, match='export it as family qwen2'):
    hf_export.hf_config(config.replace(qkv_bias=True))
  for field, value in (('attn_softcap', 30.0), ('final_softcap', 30.0),
                       ('query_pre_attn_scalar', 16.0), ('local_rope_theta', 1e4)):
    with pytest.raises(ValueError, match=f'{field}=.*only exported for gemma2 / gemma3'):
      hf_export.hf_config(config.replace(**{field: value}))
  with pytest.raises(ValueError, match='no MistralForCausalLM equivalent'):
    hf_export.hf_config(config.replace(sliding_window=4, layer_types=(
        'full_attention', 'sliding_attention')))
  gemma2, _ = hf.load_checkpoint(os.path.join(FIXTURES, 'gemma2'))
  with pytest.raises(ValueError, match='local_rope_theta=.*no Gemma2ForCausalLM.*family gemma3'):
    hf_export.hf_config(gemma2.replace(local_rope_theta=1e4))
  assert not os.path.exists(tmp_path / 'a')  # nothing written before the refusal


# (fixture, changes): windows and RoPE the fixtures do not have, each written in its class's keys.
VARIANTS = [('qwen2', dict(sliding_window=3, layer_types=('full_attention', 'sliding_attention'))),
            ('qwen3', dict(sliding_window=3)), ('mistral', dict(sliding_window=5)),
            ('mistral', dict(sliding_window=0)), ('gemma2', dict(sliding_window=0, layer_types=())),
            ('gemma2', dict(layer_types=(), rope_type='linear', rope_factor=2.0)),
            ('gemma3', dict(local_rope_theta=0.0)), ('gemma3', dict(final_softcap=5.0))]


@pytest.mark.parametrize('family,changes', VARIANTS)
def test_config_json_round_trips_the_variants(family, changes):
  config = hf.config_from_hf(_read(os.path.join(FIXTURES, family), 'config.json')).replace(
      **changes)
  written = hf_export.hf_config(config)
  assert hf.config_from_hf(written) == config
  assert written['architectures'] == [
      'LlamaForCausalLM' if family == 'mistral' and not config.sliding_window else
      _read(os.path.join(FIXTURES, family), 'config.json')['architectures'][0]]


# A trained run started from the llama fixture (its tokenizer is the one exported): the keyword
# example task, shrunk to two RLOO iterations with a checkpoint after each.
@pytest.fixture(scope='module')
def trained_workdir(tmp_path_factory):
  root = tmp_path_factory.mktemp('export_run')
  rows = [{'prompt': f'the fox {i}', 'answer': 'ab', 'keyword': 'o', 'target_length': 4}
          for i in range(8)]
  data = root / 'data.jsonl'
  data.write_text(''.join(json.dumps(r) + '\n' for r in rows))
  c = config_utils.load_config_file(os.path.join(REPO, 'configs', 'examples', 'jsonl_task.py'),
                                    'smoke')
  c.model.init_from = LLAMA
  c.data.jsonl_train = c.data.jsonl_test = str(data)
  reward = os.path.join(REPO, 'configs', 'examples', 'my_reward.py')
  c.rewards.fns, c.rewards.weights = [f'{reward}:near_target_length'], [1.0]
  workdir = str(root / 'run')
  algorithms.run(c, workdir, log=lambda *a, **k: None)
  return workdir


def _cli(*args):
  return subprocess.run([sys.executable, '-m', 'rloo_jax.export', *args], cwd=REPO,
                        capture_output=True, text=True, timeout=300)


def test_cli_exports_a_trained_run(trained_workdir, tmp_path):
  out = str(tmp_path / 'hf')
  r = _cli(f'--workdir={trained_workdir}', f'--out={out}', '--dtype=float32')
  assert r.returncode == 0, r.stderr[-2000:]
  printed = r.stdout.split()
  assert sorted(printed) == sorted(os.path.join(out, f) for f in os.listdir(out))
  assert {'model.safetensors', 'config.json', 'generation_config.json',
          'tokenizer.json'} <= set(os.listdir(out))
  policy = rloo_jax.load_policy(trained_workdir)
  assert policy.step == 2
  config, params = hf.load_checkpoint(out)
  # remat and compute dtypes are run choices, not checkpoint ones: the rest is the same model.
  runtime = dict(remat='none', dtype='float32', param_dtype='float32')
  assert config.replace(**runtime) == policy.model_config.replace(**runtime)
  jax.tree.map(np.testing.assert_array_equal, params, policy.params)
  _, start = hf.load_checkpoint(LLAMA)  # and training moved the weights it exported
  assert not all(jax.tree.leaves(jax.tree.map(lambda a, b: bool((a == b).all()), params, start)))
  assert hf.load_tokenizer(out).encode('the fox') == hf.load_tokenizer(LLAMA).encode('the fox')
  # The same directory again: refused, with the fix, and nothing overwritten.
  again = _cli(f'--workdir={trained_workdir}', f'--out={out}')
  assert again.returncode != 0 and 'is not empty; pass an empty or new directory' in again.stderr


def test_export_step_and_missing_checkpoints(trained_workdir, tmp_path):
  paths = export.export(trained_workdir, str(tmp_path / 'one'), step=1, log=lambda *a, **k: None)
  _, params = hf.load_checkpoint(str(tmp_path / 'one'))
  step1 = rloo_jax.load_policy(trained_workdir, step=1).params
  # The default dtype, bfloat16: the step's weights rounded once.
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(
      a, b.astype(jnp.bfloat16).astype(jnp.float32)), params, step1)
  assert not all(jax.tree.leaves(jax.tree.map(
      lambda a, b: bool((a == b).all()), step1, rloo_jax.load_policy(trained_workdir).params)))
  assert _read(str(tmp_path / 'one'), 'config.json')['torch_dtype'] == 'bfloat16'
  assert len(paths) == 5
  empty = tmp_path / 'no_ckpt'
  empty.mkdir()
  shutil.copy(os.path.join(trained_workdir, 'run_config.json'), empty)
  with pytest.raises(FileNotFoundError, match='has no checkpoints/.*checkpoint_every'):
    export.export(str(empty), str(tmp_path / 'x'))
  with pytest.raises(FileNotFoundError, match='has no run_config.json'):
    export.export(str(tmp_path), str(tmp_path / 'x'))


@pytest.mark.parametrize('family', FAMILIES)
def test_transformers_loads_the_export_with_the_same_logits(family, tmp_path):
  """Live: transformers itself reads the export (perturbed weights, as after training)."""
  torch = pytest.importorskip('torch', reason='needs torch + transformers (the "hf" extra)')
  transformers = pytest.importorskip('transformers')
  src = os.path.join(FIXTURES, family)
  config, graphdef, params = hf.load_model(src)
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(7), len(leaves))
  params = jax.tree.unflatten(tree, [x + 0.05 * jax.random.normal(k, x.shape)
                                     for x, k in zip(leaves, keys)])
  hf_export.save_pretrained(params, config, str(tmp_path), dtype='float32', tokenizer_dir=src)
  # Eager: transformers' reference attention. Its SDPA path drops Gemma 2's attention soft-cap
  # before 5.21 (docs/EXPORT.md), which would test transformers, not the export.
  model, info = transformers.AutoModelForCausalLM.from_pretrained(
      str(tmp_path), dtype=torch.float32, output_loading_info=True, attn_implementation='eager')
  assert not any(info.values()), info
  ref = np.load(os.path.join(src, 'reference.npz'))
  tokens, positions, mask = (ref[f'right_{k}'] for k in ('tokens', 'positions', 'mask'))
  ours = np.asarray(transformer.model_fns(graphdef).forward(params, tokens, positions, mask))
  with torch.no_grad():
    theirs = model(input_ids=torch.tensor(tokens).long(),
                   attention_mask=torch.tensor(mask.astype(np.int64)),
                   position_ids=torch.tensor(positions).long()).logits.numpy()
  assert_f32_close(theirs[mask], ours[mask], FIXTURE_TERMS)


SHARDED = '''
import jax, numpy as np, sys
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from rloo_jax.models import hf, hf_export
config, params = hf.load_checkpoint(sys.argv[1])
mesh = Mesh(np.array(jax.devices()), ('fsdp',))
def shard(x):  # the first axis of a size that splits four ways
  axis = next((i for i, n in enumerate(x.shape) if n % 4 == 0), None)
  spec = [None] * x.ndim
  if axis is not None:
    spec[axis] = 'fsdp'
  return jax.device_put(x, NamedSharding(mesh, P(*spec)))
sharded = jax.tree.map(shard, params)
assert sum(len(x.sharding.device_set) == 4 for x in jax.tree.leaves(sharded)) >= 10
hf_export.save_pretrained(sharded, config, sys.argv[2], dtype='float32')
jax.tree.map(np.testing.assert_array_equal, hf.load_checkpoint(sys.argv[2])[1], params)
'''


def test_export_of_a_device_sharded_state(tmp_path):
  """Leaves split over 4 (CPU) devices are gathered tensor by tensor into the same files."""
  env = {**os.environ, 'XLA_FLAGS': '--xla_force_host_platform_device_count=4',
         'JAX_PLATFORMS': 'cpu'}
  r = subprocess.run([sys.executable, '-c', SHARDED, os.path.join(FIXTURES, 'qwen2'),
                      str(tmp_path / 'hf')], env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-2000:]
  assert _layout(str(tmp_path / 'hf')) == _layout(os.path.join(FIXTURES, 'qwen2'))

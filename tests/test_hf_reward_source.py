"""'hf_reward_model:<dir>' as a reward source: the committed tiny *ForSequenceClassification
fixtures (tests/make_hf_rm_fixtures.py) scored from text, sharded, in fixed-shape device batches,
and the export of a head='scalar' model (a fixture, or a `reward_model:` directory) that the spec
loads back with the same scores.

The fixtures hold no tokenizer: `?tokenizer=` points at the causal fixtures' (one tokenizer for
all, the one make_hf_rm_fixtures encoded its reference batches with). Run as a script, this file
is the 4-device worker of `test_weights_are_sharded_and_scores_match_one_device`.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import count_traces
from hf_tensors import iter_tensors
from numerics import FIXTURE_TERMS as RM_TERMS, assert_f32_close

# Float comparisons of two computations: rerun by .ci/run under other CPU flags.
pytestmark = pytest.mark.numerics

TESTS = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(TESTS, 'fixtures')
# make_hf_rm_fixtures.TEXTS (importing it would import transformers' fixture helpers).
TEXTS = ['leave one out baselines reduce the variance', 'the reward model',
         'two plus two is four']
# Each text cut into a prompt and a completion: the spec scores prompt + completion.
PROMPTS = [t[:7] for t in TEXTS]
COMPLETIONS = [t[7:] for t in TEXTS]
PARITY_FAMILIES = ('llama', 'qwen2', 'gpt_neox', 'gemma2')
ALL_FAMILIES = ('llama', 'llama3', 'mistral', 'qwen2', 'qwen3', 'gpt2', 'gpt_neox', 'gemma2',
                'gemma3')


def spec(family, **options):
  options.setdefault('tokenizer', os.path.join(FIXTURES, 'hf', family))
  query = '&'.join(f'{k}={v}' for k, v in options.items())
  return f'hf_reward_model:{os.path.join(FIXTURES, "hf_rm", family)}?{query}'


def last_valid(mask):
  return mask.shape[1] - 1 - np.argmax(mask[:, ::-1], axis=1)


@pytest.mark.parametrize('family', PARITY_FAMILIES)
def test_spec_scores_equal_the_parity_path(family):
  """float32: the spec's scores of prompt + completion equal hf.load_model's forward at each
  row's last token on transformers' own ids (1e-5) and transformers' scores (1e-4, the parity
  test's tolerance); bfloat16 (the default) within a loose bound."""
  import jax
  from rloo_jax.models import hf, model_fns
  from rloo_jax.rewards import hf_reward, registry

  ref = dict(np.load(os.path.join(FIXTURES, 'hf_rm', family, 'reference.npz')))
  fn = registry.resolve(spec(family, dtype='float32'))
  assert isinstance(fn, hf_reward.HFRewardModel) and fn.format == 'hf'
  # The tokenisation is transformers': the fixture's batch was `tokenizer(text)`, bos included.
  tokens, mask, last, ok = fn.encode(PROMPTS, COMPLETIONS)
  s, want = ref['right_tokens'].shape[1], ref['right_tokens'] * ref['right_mask']
  np.testing.assert_array_equal(tokens[:, :s] * mask[:, :s], want)
  np.testing.assert_array_equal(last, last_valid(ref['right_mask']))
  assert ok.all() and not mask[:, s:].any()

  _, graphdef, params = hf.load_model(os.path.join(FIXTURES, 'hf_rm', family))
  values = jax.jit(model_fns(graphdef).forward)(params, ref['right_tokens'],
                                                ref['right_positions'], ref['right_mask'])
  parity = np.asarray(values)[np.arange(len(TEXTS)), last_valid(ref['right_mask'])]
  scores = fn(PROMPTS, COMPLETIONS)
  assert scores.dtype == np.float32 and scores.shape == (len(TEXTS),)
  # A 64-row batch (the scorer's) rounds float32 sums differently from a 3-row one, and torch
  # differently again: float32 rounding of the scores' scale either way.
  assert_f32_close(scores, parity, RM_TERMS)
  assert_f32_close(scores, ref['right_scores'], RM_TERMS)

  bf16 = registry.resolve(spec(family))
  assert bf16.params['embedding'][...].dtype == jax.numpy.bfloat16
  got = bf16(PROMPTS, COMPLETIONS)
  assert got.dtype == np.float32
  # bf16 rounding through two layers of these large-init models: a few % of the score scale.
  np.testing.assert_allclose(got, scores, atol=0.05 * np.abs(scores).max(), rtol=0)
  print(f'{family}: |f32 - parity| {np.abs(scores - parity).max():.1e}, '
        f'|bf16 - f32| {np.abs(got - scores).max():.3f} of {np.abs(scores).max():.2f}')


def test_unscorable_rows_are_nan_and_batches_reuse_one_compile(monkeypatch):
  """Too long (> max_len tokens) and empty rows are NaN and counted; the others score as they do
  alone. Calls of 1, 3 and 7 rows (2 device batches of 4) reuse one program; a row in the next
  length bucket compiles one more."""
  from rloo_jax.rewards import hf_reward, scorer
  # Counted from a function of its own: a program another test shared (`platform.jit`) would
  # hide traces.
  traced = count_traces(monkeypatch, scorer, 'sequence_scores')

  fn = hf_reward.load(os.path.join(FIXTURES, 'hf_rm', 'llama'), dtype='float32', batch_size=4,
                      max_len=40, tokenizer=os.path.join(FIXTURES, 'hf', 'llama'))
  assert fn.buckets == (32, 40)
  alone = fn(PROMPTS, COMPLETIONS)
  long = ' the reward model' * 20  # ~60 tokens > max_len=40
  got = fn(['', PROMPTS[0], 'x', PROMPTS[1]], ['', COMPLETIONS[0], long, COMPLETIONS[1]])
  assert np.isnan(got[[0, 2]]).all() and fn.num_unscorable == 2
  assert_f32_close(got[[1, 3]], alone[:2], RM_TERMS, scale=np.abs(alone).max())
  for n in (1, 3, 7):
    out = fn((PROMPTS * 3)[:n], (COMPLETIONS * 3)[:n])
    assert_f32_close(out, np.tile(alone, 3)[:n], RM_TERMS, scale=np.abs(alone).max())
  assert len(traced) == 1
  mid = ' plus two' * 15  # 36 tokens: the second bucket
  assert 32 < fn.encode([PROMPTS[2]], [COMPLETIONS[2] + mid])[1].sum() <= 40
  assert np.isfinite(fn([PROMPTS[2]], [COMPLETIONS[2] + mid])).all()
  assert len(traced) == 2


@pytest.mark.parametrize('query, message', [
    ('dtype=float32&colour=red', "unknown or valueless option 'colour=red'"),
    ('dtype=float8', "option dtype='float8'"),
    ('batch_size=0', 'option batch_size=0: must be a positive multiple'),
    ('batch_size=two', "option batch_size='two' is not a int"),
    ('max_len=100', 'option max_len=100: must be in \\[1, 64\\]'),
    ('max_len=0', 'option max_len=0: must be in'),
    ('format=chat', "option format='chat'"),
    ('whiten=maybe', "option whiten='maybe' is not a bool"),
    ('whiten=true', 'option whiten=True: whitening needs statistics: pass \\?mean'),
    ('whiten=true&mean=0&std=0', 'option std=0.0: whitening needs a finite mean and a positive'),
    ('clip=-1', 'option clip=-1.0'),
])
def test_bad_options_name_themselves(query, message):
  from rloo_jax.rewards import registry

  path = os.path.join(FIXTURES, 'hf_rm', 'llama')
  tok = os.path.join(FIXTURES, 'hf', 'llama')
  with pytest.raises(ValueError, match=message):
    registry.resolve(f'hf_reward_model:{path}?tokenizer={tok}&{query}')


def test_wrong_checkpoints_say_what_to_pass(tmp_path):
  from tokenizers import Tokenizer, models
  from rloo_jax.rewards import registry

  big = Tokenizer(models.WordLevel({f'w{i}': i for i in range(200)}, unk_token='w0'))
  big.save(str(tmp_path / 'tokenizer.json'))
  with pytest.raises(ValueError, match="its 200 tokens exceed the model's vocab_size=128"):
    registry.resolve(spec('llama', tokenizer=tmp_path))

  with pytest.raises(ValueError, match='pass \\?tokenizer=<directory or hub id>'):
    registry.resolve(f'hf_reward_model:{os.path.join(FIXTURES, "hf_rm", "qwen2")}')
  with pytest.raises(ValueError, match='is a LlamaForCausalLM, not a reward model'):
    registry.resolve(f'hf_reward_model:{os.path.join(FIXTURES, "hf", "llama")}')
  with pytest.raises(FileNotFoundError, match='hf_reward_model=.*is not a directory'):
    registry.resolve('hf_reward_model:/no/such/dir')
  with pytest.raises(FileNotFoundError, match="hf_reward_model option tokenizer='/no/tok'"):
    registry.resolve(spec('qwen2', tokenizer='/no/tok'))
  with pytest.raises(ValueError, match="expected 'hf_reward_model:<directory or hub id>'"):
    registry.resolve('hf_reward_model:?dtype=float32')


def test_reward_set_names_it_and_puts_it_on_the_layout():
  import ml_collections
  from rloo_jax import sharding
  from rloo_jax.rewards import RewardSet, reward_name

  assert reward_name('hf_reward_model:org/rm?dtype=float32') == 'hf_reward_model'
  layout = sharding.make_layout(dict(data=-1, fsdp=1, tensor=1))
  c = ml_collections.ConfigDict(dict(fns=[spec('llama', dtype='float32')], weights=[1.0]))
  rs = RewardSet.from_config(c, layout)
  assert rs.names == ['hf_reward_model'] and rs.fns[0].layout is layout
  total, parts = rs(PROMPTS, COMPLETIONS, {})
  np.testing.assert_allclose(total, parts['hf_reward_model'])


def test_the_experiment_loads_it_on_its_mesh():
  """algorithms.validate (and experiment.build, with the same layout) resolve config.rewards on
  config.mesh's layout: the model validate loads is the one build gets from the cache."""
  from conftest import load_config
  from rloo_jax import algorithms, sharding
  from rloo_jax.rewards import registry

  config = load_config()
  config.rewards.fns = (spec('qwen2', dtype='float32', batch_size=8),)  # in no other test
  config.rewards.weights = (1.0,)
  before = set(registry._scorers)
  algorithms.validate(config)
  (key,) = set(registry._scorers) - before
  layout = sharding.make_layout(config.mesh)
  assert key[-1] == layout and registry.resolve(config.rewards.fns[0], layout) is (
      registry._scorers[key])


@pytest.mark.parametrize('family', ALL_FAMILIES)
def test_export_writes_the_sequence_classification_checkpoint(family, tmp_path):
  """A fixture loaded as head='scalar' and saved again is transformers' checkpoint: the same
  architecture, num_labels=1, pad_token_id and every tensor, score.weight included."""
  from rloo_jax.models import hf

  src = os.path.join(FIXTURES, 'hf_rm', family)
  config, _, params = hf.load_model(src)
  out = str(tmp_path / 'rm')
  hf.save_model(out, config, params, dtype='float32',
                tokenizer_dir=os.path.join(FIXTURES, 'hf', family))
  with open(os.path.join(src, 'config.json')) as f:
    want = json.load(f)
  with open(os.path.join(out, 'config.json')) as f:
    got = json.load(f)
  for key in ('architectures', 'model_type', 'num_labels', 'pad_token_id'):
    assert got.get(key) == want.get(key, 1 if key == 'num_labels' else None), key
  assert hf.config_from_hf(got) == hf.config_from_hf(want)
  mine, theirs = dict(iter_tensors(out)), dict(iter_tensors(src))
  assert sorted(mine) == sorted(theirs) and 'score.weight' in mine
  for name, w in theirs.items():
    np.testing.assert_array_equal(mine[name], w, err_msg=name)


def test_export_refuses_what_transformers_cannot_pool(tmp_path):
  from rloo_jax.models import hf

  config, _, params = hf.load_model(os.path.join(FIXTURES, 'hf_rm', 'llama'))
  with pytest.raises(ValueError, match='needs a pad_token_id.*pass tokenizer_dir= .*or pad_id='):
    hf.save_model(str(tmp_path / 'x'), config, params)
  assert not os.path.exists(tmp_path / 'x')  # refused before anything was written


def test_a_nonzero_score_bias_is_written_and_read_back(tmp_path):
  """transformers' score has no bias (it would drop one); our loader reads score.bias back."""
  import jax.numpy as jnp
  from rloo_jax.models import hf

  config, _, params = hf.load_model(os.path.join(FIXTURES, 'hf_rm', 'qwen2'))
  params['score_bias'].set_value(jnp.full((1,), 0.5, jnp.float32))
  out = str(tmp_path / 'rm')
  hf.save_model(out, config, params, dtype='float32', pad_id=0)
  np.testing.assert_array_equal(dict(iter_tensors(out))['score.bias'], [0.5])
  _, again = hf.load_checkpoint(out)
  np.testing.assert_array_equal(again['score_bias'][...], [0.5])


def test_exported_fixture_scores_the_same(tmp_path):
  from rloo_jax.models import hf
  from rloo_jax.rewards import registry

  config, _, params = hf.load_model(os.path.join(FIXTURES, 'hf_rm', 'gpt_neox'))
  out = str(tmp_path / 'rm')
  hf.save_model(out, config, params, dtype='float32',
                tokenizer_dir=os.path.join(FIXTURES, 'hf', 'gpt_neox'))
  again = registry.resolve(f'hf_reward_model:{out}?dtype=float32')  # its own tokenizer now
  want = registry.resolve(spec('gpt_neox', dtype='float32'))(PROMPTS, COMPLETIONS)
  assert_f32_close(again(PROMPTS, COMPLETIONS), want, RM_TERMS)


def test_reward_model_directory_exports_to_the_same_scores(tmp_path):
  """A `reward_model:` directory (RewardModelScorer.save, whitened and clipped) exported with
  the CLI's function scores the same through `hf_reward_model:` as through `reward_model:`:
  its `[bos] prompt completion eos` layout, length and statistics travel in config.json."""
  from rloo_jax.data import tokenizer as tok_lib
  from rloo_jax.models import hf
  from rloo_jax.rewards import hf_reward, registry
  from rloo_jax.rewards.scorer import RewardModelScorer

  config, _, params = hf.load_model(os.path.join(FIXTURES, 'hf_rm', 'llama'))
  tok = hf.load_tokenizer(os.path.join(FIXTURES, 'hf', 'llama'))
  rm = RewardModelScorer(config, params, tok, seq_len=32, batch_size=8, whiten=True, mean=0.5,
                         std=2.0, clip=3.0, stats_samples=10)
  rm_dir, out = str(tmp_path / 'rm'), str(tmp_path / 'rm_hf')
  rm.save(rm_dir)
  cli = [sys.executable, '-m', 'rloo_jax.export', f'--out={out}']
  proc = subprocess.run(cli + [f'--reward_model={rm_dir}', '--dtype=float32'], env=_env(),
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert os.path.join(out, 'tokenizer.json') in proc.stdout.split()
  both = subprocess.run(cli + [f'--reward_model={rm_dir}', f'--workdir={rm_dir}'], env=_env(),
                        capture_output=True, text=True, timeout=300)
  assert both.returncode != 0 and 'exactly one of --workdir' in both.stderr
  with open(os.path.join(out, 'config.json')) as f:
    saved = json.load(f)[hf_reward.EXTRA_KEY]
  assert saved['format'] == 'sft' and saved['seq_len'] == 32 and saved['whiten']
  prompts = PROMPTS + ['x']
  completions = COMPLETIONS + [' the reward model' * 5]  # longer than seq_len: NaN in both
  want = registry.resolve(f'reward_model:{rm_dir}')(prompts, completions)
  got = registry.resolve(f'hf_reward_model:{out}?dtype=float32')(prompts, completions)
  assert np.isnan(want[3]) and np.isnan(got[3]) and np.isfinite(want[:3]).all()
  # clip(whiten(raw)) by hand: the statistics and the clip reached the exported scorer.
  np.testing.assert_allclose(want, np.clip((rm.raw(prompts, completions) - 0.5) / 2.0, -3, 3),
                             atol=1e-6, rtol=0)
  assert_f32_close(got, want, RM_TERMS)
  # Statistics overridden in the spec, as for reward_model:.
  raw = registry.resolve(f'hf_reward_model:{out}?dtype=float32&whiten=false&clip=0')
  assert_f32_close(raw(prompts, completions), rm.raw(prompts, completions), RM_TERMS)
  # A task tokenizer has no tokenizer.json: refused, before the restore.
  byte_dir = str(tmp_path / 'byte_rm')
  RewardModelScorer(config, params, tok_lib.ByteTokenizer(), seq_len=32).save(byte_dir)
  with pytest.raises(ValueError, match="'byte' tokenizer, which has no Hugging Face form"):
    hf_reward.export_reward_model(byte_dir, str(tmp_path / 'none'))


# ----------------------------------------------------------------------------------------------
# 4 simulated devices, in a subprocess (XLA_FLAGS must be set before jax starts)


def _env(**extra):
  return dict(os.environ, JAX_PLATFORMS='cpu', **extra)


def test_weights_are_sharded_and_scores_match_one_device(tmp_path):
  result = str(tmp_path / 'result.json')
  env = _env(XLA_FLAGS=(os.environ.get('XLA_FLAGS', '') +
                        ' --xla_force_host_platform_device_count=4').strip())
  proc = subprocess.run([sys.executable, os.path.abspath(__file__), result], env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-5000:]
  with open(result) as f:
    r = json.load(f)
  assert r['devices'] == 4
  for name in ('fsdp4', 'data2_fsdp2'):
    # Split over fsdp: each device holds about a quarter (a half) of the weights, not all.
    assert r[name]['per_device_bytes'] < 0.6 * r[name]['total_bytes'], r[name]
    assert r[name]['out_devices'] == 4  # every device scored a slice of the batch
    assert_f32_close(r[name]['scores'], r['one_device']['scores'], RM_TERMS, err_msg=name)
  # The tolerance tells a wrong shard apart: one device's quarter of one matrix scaled by 1e-3.
  with pytest.raises(AssertionError):
    assert_f32_close(r['fsdp4_one_shard_perturbed'], r['one_device']['scores'], RM_TERMS)
  assert r['fsdp4']['per_device_bytes'] < 0.35 * r['fsdp4']['total_bytes']
  assert r['one_device']['per_device_bytes'] == r['one_device']['total_bytes']
  assert np.isnan(r['one_device']['scores'][-1])


def _worker(result: str) -> None:
  import jax
  from rloo_jax import config_utils, sharding
  from rloo_jax.rewards import registry

  assert jax.device_count() == 4, jax.devices()
  rules = config_utils.base_config().mesh.rules
  layouts = {'one_device': sharding.make_layout(dict(data=1, fsdp=1, tensor=1),
                                                jax.devices()[:1]),
             'fsdp4': None,  # the fallback: FSDP over all devices
             'data2_fsdp2': sharding.make_layout(dict(data=2, fsdp=2, tensor=1, rules=rules))}
  prompts = (PROMPTS * 3)[:7] + ['x']
  completions = (COMPLETIONS * 3)[:7] + [' the reward model' * 30]  # too long: NaN
  out, fns = {'devices': jax.device_count()}, {}
  for name, layout in layouts.items():
    fn = registry.resolve(spec('llama', dtype='float32', batch_size=4), layout)
    s = fn._score(fn.params, *(fn.layout.shard_batch(a) for a in (
        np.zeros((4, 32), np.int32), np.ones((4, 32), bool), np.zeros((4,), np.int32))))
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(fn.params))
    out[name] = dict(per_device_bytes=sharding.per_device_bytes(jax.tree.leaves(fn.params)),
                     total_bytes=int(total), out_devices=len(s.sharding.device_set),
                     scores=[float(x) for x in fn(prompts, completions)])
    fns[name] = fn
  fns['fsdp4'].params = _perturb_one_shard(fns['fsdp4'].params, 1e-3)
  out['fsdp4_one_shard_perturbed'] = [float(x) for x in fns['fsdp4'](prompts, completions)]
  with open(result, 'w') as f:
    json.dump(out, f)


def _perturb_one_shard(params, relative: float):
  """`params` with the first device's shard of the largest split matrix scaled by 1 + relative."""
  import jax
  leaves, treedef = jax.tree.flatten(params)
  split = [i for i, x in enumerate(leaves) if x.ndim == 2 and len(x.addressable_shards) > 1
           and x.addressable_shards[0].data.shape != x.shape]
  i = max(split, key=lambda j: leaves[j].size)
  x = leaves[i]
  shards = [s.data * (1 + relative) if n == 0 else s.data
            for n, s in enumerate(x.addressable_shards)]
  leaves[i] = jax.make_array_from_single_device_arrays(x.shape, x.sharding, shards)
  return jax.tree.unflatten(treedef, leaves)


# Two processes x 2 CPU devices (jax.distributed), one FSDP mesh over all 4: each process scores
# its own rows, a different number in each length bucket, so the device batches they run together
# must be agreed on (a mismatch would hang the collectives or mix rows up).
MP_ROWS = [(PROMPTS * 2, COMPLETIONS * 2),  # process 0: 6 rows, 3 device batches of its 2 rows
           ([PROMPTS[1], PROMPTS[2], 'x'],  # process 1: 1 row at 32, 1 at 64, 1 too long
            [COMPLETIONS[1], COMPLETIONS[2] + ' plus two' * 15, ' the reward model' * 30])]


def test_two_processes_score_their_own_rows(tmp_path):
  from conftest import free_port, run_processes
  from rloo_jax.rewards import registry

  port = free_port()
  runs = run_processes([[sys.executable, os.path.abspath(__file__), 'mp', str(i), str(port),
                         str(tmp_path / f'{i}.json')] for i in range(2)], env=_env(), timeout=300)
  for returncode, log in runs:
    assert returncode == 0, log[-5000:]
  one = registry.resolve(spec('llama', dtype='float32', batch_size=4))  # this process: 1 device
  for i, (prompts, completions) in enumerate(MP_ROWS):
    r = json.loads((tmp_path / f'{i}.json').read_text())
    assert r['devices'] == 4 and r['local_devices'] == 2
    assert r['per_device_bytes'] < 0.35 * r['total_bytes']
    assert_f32_close(r['scores'], one(prompts, completions), RM_TERMS)
  assert np.isnan(r['scores'][-1]) and np.isfinite(r['scores'][:-1]).all()


def _mp_worker(process_id: int, port: int, out_path: str) -> None:
  import jax
  from rloo_jax import processes, sharding
  processes.initialize_distributed(f'127.0.0.1:{port}', 2, process_id, 2)  # before any jax work
  from rloo_jax.rewards import registry

  fn = registry.resolve(spec('llama', dtype='float32', batch_size=4))  # FSDP over all 4
  scores = fn(*MP_ROWS[process_id])
  leaves = jax.tree.leaves(fn.params)
  with open(out_path, 'w') as f:
    json.dump(dict(devices=jax.device_count(), local_devices=len(jax.local_devices()),
                   per_device_bytes=sharding.per_device_bytes(leaves),
                   total_bytes=int(sum(x.size * x.dtype.itemsize for x in leaves)),
                   scores=[float(x) for x in scores]), f)
  jax.distributed.shutdown()


if __name__ == '__main__':
  if sys.argv[1] == 'mp':
    _mp_worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
  else:
    _worker(sys.argv[1])

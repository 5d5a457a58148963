"""LoRA export: hf_export.save_pretrained merges the adapters into the base; peft_export writes
a PEFT directory that peft loads. The transformers / peft checks need torch (skipped without)."""

import json
import os

import jax
import numpy as np
import pytest
from hf_tensors import iter_tensors
from numerics import FIXTURE_TERMS, assert_f32_close
from flax import nnx

from rloo_jax import adapters
from rloo_jax.models import hf, hf_export, lora, peft_export, transformer

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'fixtures', 'hf')


def _lora_model(family, targets=lora.TARGETS):
  """(LoRA config, its model functions, params: the fixture's base + adapters with B != 0, as
  after training), and the fixture's reference rows."""
  src = os.path.join(FIXTURES, family)
  base_cfg, _, base = hf.load_model(src)
  cfg = base_cfg.replace(lora_rank=4, lora_alpha=8.0, lora_targets=tuple(targets))
  ad = adapters.init_adapters(cfg, seed=1)
  keys = iter(jax.random.split(jax.random.PRNGKey(2), 64))
  ad = nnx.from_flat_state({p: v.replace(0.2 * jax.random.normal(next(keys), v.shape))
                            if p[-1].endswith('_lora_b') else v
                            for p, v in nnx.to_flat_state(ad)})
  ref = np.load(os.path.join(src, 'reference.npz'))
  rows = tuple(ref[f'right_{k}'] for k in ('tokens', 'positions', 'mask'))
  fns = transformer.model_fns(transformer.abstract(cfg)[0])
  return src, cfg, fns, lora.join(base, ad), rows


@pytest.mark.parametrize('family', ['llama', 'qwen2'])
def test_merged_export_reloads_as_the_lora_policy(family, tmp_path):
  src, cfg, fns, params, rows = _lora_model(family)
  ours = np.asarray(fns.forward(params, *rows))
  base_only = np.asarray(fns.forward(adapters.reference_as_policy(
      _state(params)), *rows))
  assert np.abs(ours - base_only).max() > 1e-2  # the adapters matter
  hf_export.save_pretrained(params, cfg, str(tmp_path), dtype='float32', tokenizer_dir=src)
  mcfg, graphdef, merged = hf.load_model(str(tmp_path))
  assert mcfg.lora_rank == 0
  again = np.asarray(transformer.model_fns(graphdef).forward(merged, *rows))
  mask = rows[2].astype(bool)
  assert_f32_close(again[mask], ours[mask], FIXTURE_TERMS)


def _assert_same_logits(torch, model, fns, params, rows):
  """A torch model's logits on the fixture's rows equal ours, where the mask is set."""
  tokens, positions, mask = rows
  ours = np.asarray(fns.forward(params, tokens, positions, mask))
  with torch.no_grad():
    theirs = model(input_ids=torch.tensor(tokens).long(),
                   attention_mask=torch.tensor(mask.astype(np.int64)),
                   position_ids=torch.tensor(positions).long()).logits.numpy()
  m = mask.astype(bool)
  assert_f32_close(theirs[m], ours[m], FIXTURE_TERMS)


def _state(params):
  """A minimal train-state stand-in for `adapters.reference_as_policy`."""
  ad, base = lora.split(params)
  return type('S', (), dict(ref_params=base, params=ad))()


def test_transformers_loads_the_merged_export_within_1e4(tmp_path):
  torch = pytest.importorskip('torch', reason='needs torch + transformers (the "hf" extra)')
  transformers = pytest.importorskip('transformers')
  src, cfg, fns, params, rows = _lora_model('llama')
  hf_export.save_pretrained(params, cfg, str(tmp_path), dtype='float32', tokenizer_dir=src)
  model, info = transformers.AutoModelForCausalLM.from_pretrained(
      str(tmp_path), dtype=torch.float32, output_loading_info=True, attn_implementation='eager')
  assert not any(info.values()), info
  _assert_same_logits(torch, model, fns, params, rows)


def test_peft_directory_layout(tmp_path):
  _, cfg, _, params, _ = _lora_model('llama', targets=('q', 'v', 'down'))
  paths = peft_export.save_adapter(params, cfg, str(tmp_path), base_model='some/base')
  assert sorted(os.path.basename(p) for p in paths) == ['adapter_config.json',
                                                         'adapter_model.safetensors']
  conf = json.load(open(tmp_path / 'adapter_config.json'))
  assert conf['r'] == 4 and conf['lora_alpha'] == 8.0 and conf['peft_type'] == 'LORA'
  assert conf['target_modules'] == ['down_proj', 'q_proj', 'v_proj']
  tensors = dict(iter_tensors(str(tmp_path)))
  assert len(tensors) == 2 * 3 * cfg.num_layers
  hd = cfg.num_heads * cfg.head_dim
  pre = 'base_model.model.model.layers.0.'
  assert tensors[pre + 'self_attn.q_proj.lora_A.weight'].shape == (4, cfg.hidden_size)
  assert tensors[pre + 'self_attn.q_proj.lora_B.weight'].shape == (hd, 4)
  assert tensors[pre + 'mlp.down_proj.lora_A.weight'].shape == (4, cfg.intermediate_size)
  with pytest.raises(ValueError, match='rank is 0'):
    peft_export.save_adapter(lora.split(params)[1], lora.base_config(cfg), str(tmp_path / 'x'))


@pytest.mark.parametrize('family', ['llama', 'qwen2'])
def test_peft_loads_the_adapter_onto_the_base_with_the_same_logits(family, tmp_path):
  torch = pytest.importorskip('torch', reason='needs torch + transformers + peft')
  transformers = pytest.importorskip('transformers')
  peft = pytest.importorskip('peft')
  src, cfg, fns, params, rows = _lora_model(family)
  peft_export.save_adapter(params, cfg, str(tmp_path / 'adapter'), base_model=src)
  base = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32,
                                                           attn_implementation='eager')
  model = peft.PeftModel.from_pretrained(base, str(tmp_path / 'adapter'))
  _assert_same_logits(torch, model, fns, params, rows)


def test_export_cli_of_a_lora_run_merges_or_writes_the_adapters(tmp_path):
  import rloo_jax  # pylint: disable=import-outside-toplevel
  from conftest import load_config  # pylint: disable=import-outside-toplevel
  from rloo_jax import algorithms, export  # pylint: disable=import-outside-toplevel
  c = load_config('smoke')
  c.model.lora.update(rank=4, targets='q,v,up')
  c.train.update(num_iterations=2, eval_every=0)
  wd = str(tmp_path / 'run')
  algorithms.run(c, wd, log=lambda *a, **k: None)
  quiet = lambda *a, **k: None
  merged = export.export(wd, str(tmp_path / 'hf'), dtype='float32', log=quiet)
  assert 'model.safetensors' in {os.path.basename(p) for p in merged}
  paths = export.export(wd, str(tmp_path / 'peft'), adapter=True, log=quiet)
  assert {os.path.basename(p) for p in paths} == {'adapter_config.json',
                                                  'adapter_model.safetensors'}
  policy = rloo_jax.load_policy(wd)
  cfg = policy.model_config
  assert cfg.lora_rank == 4
  _, params = hf.load_checkpoint(str(tmp_path / 'hf'))
  want = lora.merged(cfg, policy.params)
  jax.tree.map(np.testing.assert_array_equal, params, want)
  # Training moved the adapters, so the merged weights are not the base's.
  base = lora.split(policy.params)[1]
  assert not np.array_equal(np.asarray(params['layers']['attn']['q_kernel'][...]),
                            np.asarray(base['layers']['attn']['q_kernel'][...]))
  tensors = dict(iter_tensors(str(tmp_path / 'peft')))
  a = np.asarray(policy.params['layers']['attn']['q_lora_a'][...])[0]
  np.testing.assert_array_equal(
      tensors['base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight'], a.T)

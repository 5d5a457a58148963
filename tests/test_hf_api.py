"""The small public API of the Hugging Face bridge: `hf.save_model` (the inverse of load_model)
and config.data.chat_template=True (the tokenizer's own template, as 'auto')."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from hf_tensors import iter_tensors

from rloo_jax.data import chat
from rloo_jax.models import hf, hf_export

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'fixtures', 'hf')
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_save_model_writes_what_save_pretrained_writes_and_loads_back(tmp_path):
  src = os.path.join(FIXTURES, 'llama')
  config, graphdef, params = hf.load_model(src)
  paths = hf.save_model(str(tmp_path / 'api'), config, params, dtype='float32',
                        tokenizer_dir=src)
  hf_export.save_pretrained(params, config, str(tmp_path / 'direct'), dtype='float32',
                            tokenizer_dir=src)
  assert sorted(os.path.basename(p) for p in paths) == sorted(os.listdir(tmp_path / 'direct'))
  got, want = (dict(iter_tensors(str(tmp_path / d))) for d in ('api', 'direct'))
  assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want)
  config2, graphdef2, params2 = hf.load_model(str(tmp_path / 'api'))
  assert config2 == config and graphdef2 == graphdef
  import jax
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
    assert np.array_equal(np.asarray(a), np.asarray(b))


def test_save_model_refuses_a_non_empty_directory(tmp_path):
  config, _, params = hf.load_model(os.path.join(FIXTURES, 'gpt2'))
  (tmp_path / 'stale.safetensors').write_text('x')
  with pytest.raises(FileExistsError, match='not empty'):
    hf.save_model(str(tmp_path), config, params)


@pytest.mark.parametrize('value, want', [
    (True, 'auto'), ('True', 'auto'), ('true', 'auto'), ('1', 'auto'), (' auto ', 'auto'),
    (False, ''), ('False', ''), ('false', ''), ('0', ''), ('', ''), (None, ''),
    ('/t/chat.jinja', '/t/chat.jinja')])
def test_chat_template_true_means_auto(value, want):
  assert chat.normalize(value) == want


class _Tok:
  bos_id = eos_id = None
  chat_template = TEMPLATE


@pytest.mark.parametrize('value', [True, 'True', 'true', '1'])
def test_chat_template_true_renders_the_tokenizers_template(value):
  tok = chat.attach(_Tok(), value)
  assert tok.chat.render('hi') == '<user>hi<assistant>'
  assert chat.attach(_Tok(), 'False').chat is None


def _config(value):
  import ml_collections
  return ml_collections.ConfigDict({'data': {'chat_template': value}})


def test_chat_template_true_is_checked_like_auto(tmp_path):
  with_template, without = tmp_path / 'with', tmp_path / 'without'
  for d, cfg in ((with_template, {'chat_template': TEMPLATE}), (without, {})):
    shutil.copytree(os.path.join(FIXTURES, 'llama'), d)
    (d / 'tokenizer_config.json').write_text(json.dumps(cfg))
  chat.check(_config('True'), str(with_template))
  with pytest.raises(ValueError, match=r"'auto', but .* has no chat template"):
    chat.check(_config('True'), str(without))
  chat.check(_config('false'), str(without))  # off: nothing to check


def test_chat_template_true_from_the_command_line(tmp_path):
  """`--config.data.chat_template=True` on the str field arrives as the string 'True'."""
  from absl import flags
  from ml_collections import config_flags
  path = tmp_path / 'cfg.py'
  path.write_text('import ml_collections\n'
                  'def get_config():\n'
                  "  return ml_collections.ConfigDict({'data': {'chat_template': ''}})\n")
  argv = ['prog', f'--config={path}', '--config.data.chat_template=True']
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file('config', None, 'config', flag_values=fv, sys_argv=argv)
  fv(argv)
  value = fv.config.data.chat_template
  assert value == 'True' and chat.normalize(value) == 'auto'

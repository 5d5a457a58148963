"""Chat templates (rloo_jax.data.chat) and stop ids of the tokenizers.

The expected strings were produced once by transformers 5.24's `apply_chat_template(...,
tokenize=False, add_generation_prompt=True)` on the tests/fixtures/hf/llama tokenizer (bos '<s>',
eos '</s>') with the templates below, so equality here is equality with transformers.
"""

from __future__ import annotations

import json
import os
import shutil

import ml_collections
import numpy as np
import pytest

from rloo_jax import rollout
from rloo_jax.data import ByteTokenizer, CharTokenizer, chat, pipeline
from rloo_jax.models.hf_tokenizer import HFTokenizer

LLAMA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'fixtures', 'hf', 'llama')

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}")
QWEN2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# tojson (transformers' version: no HTML escaping), a loop control, raise_exception.
TOOLS = (
    "{%- for m in messages %}{%- if m['role'] not in ['user', 'system'] %}"
    "{{ raise_exception('bad role ' + m['role']) }}{%- endif %}"
    "{{- m['role'] }}: {{ m['content'] | tojson }}\n{%- if loop.index > 5 %}{% break %}{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}assistant:{% endif %}")
# DeepSeek-R1-Distill-Qwen's (configs/math.py), its tool-call branch left out: a namespace, str
# methods, `is none`, and the reply opened inside the thoughts.
R1_DISTILL = (
    "{% if not add_generation_prompt is defined %}"
    "{% set add_generation_prompt = false %}{% endif %}"
    "{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, "
    "system_prompt='') %}"
    "{%- for message in messages %}{%- if message['role'] == 'system' %}"
    "{% set ns.system_prompt = message['content'] %}{%- endif %}{%- endfor %}"
    "{{bos_token}}{{ns.system_prompt}}{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}"
    "{{'<｜User｜>' + message['content']}}{%- endif %}"
    "{%- if message['role'] == 'assistant' and message['content'] is not none %}"
    "{%- if ns.is_tool %}{{'<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}"
    "{%- set ns.is_tool = false -%}{%- else %}{% set content = message['content'] %}"
    "{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endif %}"
    "{%- endfor -%}{% if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}{% endif %}"
    "{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜><think>\n'}}{% endif %}")
PROMPT = '  Say "hi" & <b>bye</b>\nplease  '

# transformers 5.24 apply_chat_template output for PROMPT as one user message.
WANT = {
    'llama3': ('<s><|start_header_id|>user<|end_header_id|>\n\nSay "hi" & <b>bye</b>\nplease'
               '<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n'),
    'qwen2': ('<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n'
              '  Say "hi" & <b>bye</b>\nplease  <|im_end|>\n<|im_start|>assistant\n'),
    'tools': 'user: "  Say \\"hi\\" & <b>bye</b>\\nplease  "assistant:',
    # transformers 5.25's
    'r1_distill': '<s><｜User｜>  Say "hi" & <b>bye</b>\nplease  <｜Assistant｜><think>\n',
}
# transformers' apply_chat_template(tokenize=True) of 'Hi there' with LLAMA3 on the fixture.
WANT_LLAMA3_IDS = [1, 30, 3, 3, 22, 23, 51, 23, 3, 11, 8, 4, 46, 21, 3, 12, 7, 3, 3, 24, 22, 8, 21,
                   3, 3, 89, 7, 3, 11, 8, 4, 46, 21, 3, 12, 7, 3, 3, 3, 3, 3, 12, 35, 36, 3, 3, 8,
                   18, 23, 3, 12, 7, 3, 3, 3, 3, 22, 23, 51, 23, 3, 11, 8, 4, 46, 21, 3, 12, 7, 3,
                   3, 82, 22, 56, 23, 44, 23, 3, 3, 89, 7, 3, 11, 8, 4, 46, 21, 3, 12, 7, 3, 3, 3,
                   3]


def _checkpoint(tmp_path, *, template=None, eos_token_id=None, extra_tokens=()):
  """A copy of the llama fixture's tokenizer files with edited json."""
  d = tmp_path / 'ckpt'
  d.mkdir()
  for name in ('tokenizer.json', 'tokenizer_config.json', 'generation_config.json',
               'config.json'):
    shutil.copy(os.path.join(LLAMA_DIR, name), d / name)

  def edit(name, fn):
    cfg = json.loads((d / name).read_text())
    fn(cfg)
    (d / name).write_text(json.dumps(cfg))

  if template is not None:
    edit('tokenizer_config.json', lambda c: c.update(chat_template=template))
  if eos_token_id is not None:
    edit('generation_config.json', lambda c: c.update(eos_token_id=eos_token_id))
  if extra_tokens:
    def add(c):
      n = c['model']['vocab'].__len__() if isinstance(c['model'].get('vocab'), dict) else 128
      for i, t in enumerate(extra_tokens):
        c['added_tokens'].append(dict(id=n + i, content=t, single_word=False, lstrip=False,
                                      rstrip=False, normalized=False, special=True))
    edit('tokenizer.json', add)
  return str(d)


@pytest.mark.parametrize('name, source', [('llama3', LLAMA3), ('qwen2', QWEN2), ('tools', TOOLS),
                                          ('r1_distill', R1_DISTILL)])
def test_render_equals_transformers(name, source):
  assert chat.ChatTemplate(source, '<s>', '</s>').render(PROMPT) == WANT[name]


def test_a_reasoning_template_renders_a_conversation_as_transformers_does():
  # A system prompt, and an earlier reply whose thoughts the template drops (transformers 5.25).
  messages = [dict(role='system', content='Be brief.'), dict(role='user', content='1+1?'),
              dict(role='assistant', content='<think>easy</think> 2'),
              dict(role='user', content=PROMPT)]
  assert chat.ChatTemplate(R1_DISTILL, '<s>', '</s>').rendered(messages) == (
      '<s>Be brief.<｜User｜>1+1?<｜Assistant｜> 2<｜end▁of▁sentence｜><｜User｜>  Say "hi" & '
      '<b>bye</b>\nplease  <｜Assistant｜><think>\n')


def test_template_helpers():
  with pytest.raises(Exception, match='bad role assistant'):
    chat.ChatTemplate(TOOLS).render_messages([{'role': 'assistant', 'content': 'x'}])
  import datetime
  src = "{{ strftime_now('%Y-%m-%d') }}"
  assert chat.ChatTemplate(src).render('x') == datetime.date.today().isoformat()
  # The sandbox refuses attribute access to Python internals.
  with pytest.raises(Exception):
    chat.ChatTemplate("{{ messages.__class__.__mro__ }}").render('x')
  with pytest.raises(ValueError, match='does not parse'):
    chat.ChatTemplate('{% for %}')


def test_pipeline_does_not_double_bos(tmp_path):
  tok = HFTokenizer.from_dir(_checkpoint(tmp_path, template=LLAMA3))
  assert tok.chat_template == LLAMA3
  chat.attach(tok, 'auto')
  assert tok.chat.bos_token == '<s>' and tok.chat.eos_token == '</s>'
  tokens, lengths = pipeline.encode_prompts(['Hi there'], tok, 128)
  ids = tokens[0, :lengths[0]].tolist()
  assert ids == WANT_LLAMA3_IDS  # transformers' own ids: one bos, from the template
  assert ids.count(tok.bos_id) == 1
  # A template without bos_token still gets the pipeline's bos.
  chat.attach(tok, str(_write(tmp_path / 'qwen.jinja', QWEN2)))
  tokens, lengths = pipeline.encode_prompts(['Hi there'], tok, 128)
  ids = tokens[0, :lengths[0]].tolist()
  assert ids[0] == tok.bos_id and ids[1:] == tok.encode(tok.chat.render('Hi there'))
  # Length filtering counts the rendered prompt, exactly what encode_prompts writes.
  batches = pipeline.prompt_batches([{'prompt': 'Hi there'}], tok, global_batch_size=1,
                                    max_prompt_len=int(lengths[0]), shuffle=False, num_epochs=1,
                                    drop_remainder=False, overlong='error')
  assert next(iter(batches))['prompt_lengths'].tolist() == [lengths[0]]


def _write(path, text):
  path.write_text(text)
  return path


def test_off_leaves_prompts_unchanged():
  tok = CharTokenizer()
  before = pipeline.encode_prompts(['1+2='], tok, 8)
  chat.attach(tok, '')
  assert tok.chat is None
  after = pipeline.encode_prompts(['1+2='], tok, 8)
  np.testing.assert_array_equal(before[0], after[0])


def test_auto_without_template_errors(tmp_path):
  with pytest.raises(ValueError, match=r"config\.data\.chat_template='auto'.*no chat template"):
    chat.attach(HFTokenizer.from_dir(_checkpoint(tmp_path)), 'auto')
  with pytest.raises(ValueError, match=r"config\.data\.chat_template='auto'"):
    chat.attach(ByteTokenizer(), 'auto')
  config = ml_collections.ConfigDict(dict(data=dict(chat_template='auto')))
  with pytest.raises(ValueError, match=r"config\.data\.chat_template='auto'.*no chat template"):
    chat.check(config, LLAMA_DIR)
  config.data.chat_template = str(tmp_path / 'missing.jinja')
  with pytest.raises(FileNotFoundError, match=r'config\.data\.chat_template=.*no such file'):
    chat.check(config, LLAMA_DIR)


def test_validate_config_checks_the_key(tmp_path):
  from rloo_jax import config_utils, experiment
  config = config_utils.base_config()
  assert config.data.chat_template == ''
  config.model.init_from = LLAMA_DIR
  config.data.chat_template = 'auto'
  with pytest.raises(ValueError, match=r'config\.data\.chat_template'):
    experiment.validate_config(config)


# ----------------------------------------------------------------------------------------------
# Stop ids


def test_hf_tokenizer_reads_a_list_of_eos_ids(tmp_path):
  tok = HFTokenizer.from_dir(_checkpoint(tmp_path, eos_token_id=[2, 7]))
  assert tok.eos_id == 2 and tok.stop_ids == (2, 7)
  assert HFTokenizer.from_dir(LLAMA_DIR).stop_ids == (2,)
  text = 'Hi there'
  ids = tok.encode(text)
  assert tok.decode(ids + [7] + ids) == tok.decode(ids) == tok.decode(ids + [2, 7])


def test_hf_tokenizer_stops_only_where_transformers_does(tmp_path):
  """An end-of-turn token in the vocabulary is no stop id unless the config lists it, as in
  transformers' generate (a base model with <|im_end|> in its vocabulary does not stop there)."""
  tok = HFTokenizer.from_dir(_checkpoint(tmp_path, extra_tokens=('<|eot_id|>',)))
  eot = tok.tokenizer.token_to_id('<|eot_id|>')
  assert eot is not None and tok.stop_ids == (2,)


def test_fixed_tokenizers_stop_on_eos():
  assert CharTokenizer().stop_ids == (CharTokenizer().eos_id,)


def test_decode_completions_cuts_at_the_first_stop_id(tmp_path):
  tok = HFTokenizer.from_dir(_checkpoint(tmp_path, eos_token_id=[2, 7]))
  ids = tok.encode('Hi there')
  rows = np.array([ids + [7] + ids, ids + [2] + ids, ids + ids + [0]])
  texts = rollout.decode_completions(tok, rows, [len(ids) * 2 + 1] * 3)
  assert texts == [tok.decode(ids)] * 2 + [tok.decode(ids + ids)]
  assert rollout.stop_ids(tok) == (2, 7)
  assert rollout.stop_ids(CharTokenizer()) == (2,)


def test_a_template_the_sandbox_refuses_stops_at_start_up_in_one_line(tmp_path):
  # Reaching for Python internals: the sandbox refuses it when rendered, so it is rendered once
  # on a probe conversation when the key is resolved, not at the first prompt batch.
  path = tmp_path / "evil.jinja"
  path.write_text("{{ messages.__class__.__mro__[1].__subclasses__() }}")
  config = ml_collections.ConfigDict({"data": {"chat_template": str(path)}})
  with pytest.raises(ValueError, match=r"^config.data.chat_template: the template fails on a "
                                       r"one-message probe conversation: SecurityError: .*; fix "
                                       r"the template or set config.data.chat_template=''$"):
    chat.check(config)


def test_jsonl_messages_are_rendered_once_by_the_chat_template(tmp_path):
  from rloo_jax import config_utils, tasks  # pylint: disable=import-outside-toplevel
  template = tmp_path / "t.jinja"
  template.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                      "{% if add_generation_prompt %}<assistant>{% endif %}")
  convo = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
  data = tmp_path / "train.jsonl"
  data.write_text(json.dumps({"messages": convo, "answer": "4"}) + "\n"
                  + json.dumps({"question": "3+3?", "answer": "6"}) + "\n")
  config = config_utils.base_config()
  config.task = "jsonl"
  config.data.jsonl_train = config.data.jsonl_test = str(data)
  config.data.chat_template = str(template)
  with pytest.raises(ValueError, match=r"train.jsonl:2: missing field 'prompt' or 'messages'.*"
                                       r"config.data.prompt_field"):
    tasks.make(config, str(tmp_path))
  config.data.prompt_field = "question"
  task = tasks.make(config, str(tmp_path))
  first, second = task.train[0]["prompt"], task.train[1]["prompt"]
  assert first == "<system>Be brief.\n<user>2+2?\n<assistant>"
  tok = task.tokenizer
  # The conversation is tokenised as rendered; a plain prompt becomes one user turn.
  assert chat.prompt_ids(tok, first, add_bos=False) == tok.encode(first)
  assert chat.prompt_ids(tok, second, add_bos=False) == tok.encode("<user>3+3?\n<assistant>")
  config.data.chat_template = ""
  with pytest.raises(ValueError, match=r"train.jsonl:1: 'messages' needs a chat template .*set "
                                       r"config.data.chat_template"):
    tasks.make(config, str(tmp_path))


def test_the_default_prompt_field_keeps_the_sft_cache_key():
  from rloo_jax import config_utils, sft  # pylint: disable=import-outside-toplevel
  config = config_utils.base_config()
  before = config.copy_and_resolve_references()
  del before.data["prompt_field"]  # a config from before the key existed
  assert sft._settings(config) == sft._settings(before)  # pylint: disable=protected-access
  config.data.prompt_field = "question"  # another field: another SFT policy
  assert sft._settings(config) != sft._settings(before)  # pylint: disable=protected-access

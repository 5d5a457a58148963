"""Chat templates: each prompt rendered as one user message before it is tokenised.

config.data.chat_template: '' (off: prompts are tokenised as they are), 'auto' (the tokenizer's
own template, tokenizer_config.json's `chat_template`), or the path of a .jinja file; True (also
'True' / 'true' / '1', as `--config.data.chat_template=True` arrives) means 'auto', False (also
'False' / 'false' / '0') off. Rendering follows transformers' `apply_chat_template` (a sandboxed
Jinja environment with `raise_exception`, `strftime_now`, a `tojson` filter, `bos_token` /
`eos_token`, `add_generation_prompt=True`), so an instruct model sees the same text here as under
`generate`.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
from typing import Any, Mapping, Sequence

KEY = 'config.data.chat_template'


_ON, _OFF = ('true', '1'), ('false', '0')


def normalize(value) -> str:
  """config.data.chat_template as '' (off), 'auto' or a path. The field is a string, so a
  command-line True reaches it as the string 'True'; a bool can also be set from Python."""
  if value is None or value is False:
    return ''
  if value is True:
    return 'auto'
  spec = str(value).strip()
  return 'auto' if spec.lower() in _ON else '' if spec.lower() in _OFF else spec


def _raise_exception(message):
  import jinja2
  raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  # transformers' override: Jinja's own tojson HTML-escapes quotes, which a prompt must not see.
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _strftime_now(fmt):
  return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile(source: str):
  import jinja2
  from jinja2 import sandbox
  from jinja2.ext import loopcontrols
  env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                              extensions=[loopcontrols])
  env.filters['tojson'] = _tojson
  env.globals['raise_exception'] = _raise_exception
  env.globals['strftime_now'] = _strftime_now
  try:
    return env.from_string(source)
  except jinja2.exceptions.TemplateSyntaxError as e:
    raise ValueError(f'{KEY}: the template does not parse: {e}') from None


def probe(source: str, bos_token: str = '', eos_token: str = '') -> None:
  """Renders `source` on a one-turn probe conversation; ValueError naming the key if it fails."""
  import jinja2
  template = _compile(source)  # a syntax error: its own message
  try:
    template.render(messages=[{'role': 'user', 'content': 'probe'}],
                            add_generation_prompt=True, bos_token=bos_token, eos_token=eos_token)
  except (jinja2.exceptions.TemplateError, TypeError, ValueError) as e:
    # SecurityError (the sandbox refused an attribute or call) is a TemplateError.
    raise ValueError(f'{KEY}: the template fails on a one-message probe conversation: '
                     f'{type(e).__name__}: {e}; fix the template or set {KEY}=\'\'') from None


class Rendered(str):
  """A prompt the chat template has rendered already (a JSONL `messages` conversation): the
  pipeline tokenises it as it is, not as one more user turn."""


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
  """A Jinja chat template with the tokenizer's special-token strings."""

  source: str
  bos_token: str = ''
  eos_token: str = ''

  def __post_init__(self):
    # A syntax error, or a template the sandbox refuses, surfaces when the key is resolved (at
    # start-up, before any compile), not at the first prompt batch.
    probe(self.source, self.bos_token, self.eos_token)

  def render_messages(self, messages: Sequence[Mapping[str, Any]],
                      add_generation_prompt: bool = True) -> str:
    return _compile(self.source).render(
        messages=list(messages), add_generation_prompt=add_generation_prompt,
        bos_token=self.bos_token, eos_token=self.eos_token)

  def render(self, prompt: str) -> str:
    """The prompt as a single user turn, ending where the assistant's reply starts."""
    return self.render_messages([{'role': 'user', 'content': prompt}])

  def rendered(self, messages: Sequence[Mapping[str, Any]]) -> Rendered:
    """A whole conversation as the prompt, ending where the assistant's reply starts."""
    return Rendered(self.render_messages(messages))


def _token(tokenizer, i) -> str:
  if i is None:
    return ''
  token = getattr(tokenizer, 'token', None)
  return token(i) if callable(token) else ''


def resolve(spec: str, tokenizer) -> ChatTemplate | None:
  """The ChatTemplate config.data.chat_template names, or None when it is off."""
  spec = normalize(spec)
  if not spec:
    return None
  if spec == 'auto':
    source = getattr(tokenizer, 'chat_template', None)
    if not source:
      raise ValueError(f"{KEY}='auto', but the tokenizer ({type(tokenizer).__name__}) has no "
                       "chat template (no 'chat_template' in its tokenizer_config.json); set "
                       f"{KEY} to the path of a .jinja file, or '' to tokenise prompts as they are")
  else:
    source = read(spec)
  return ChatTemplate(source, bos_token=_token(tokenizer, getattr(tokenizer, 'bos_id', None)),
                      eos_token=_token(tokenizer, getattr(tokenizer, 'eos_id', None)))


def read(path: str) -> str:
  path = os.path.expanduser(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{KEY}={path!r}: no such file; give '' (off), 'auto' or True (the "
                            "tokenizer's own template) or the path of a .jinja file")
  with open(path, encoding='utf-8') as f:
    return f.read()


def check(config, checkpoint_dir: str = '') -> None:
  """Validates config.data.chat_template before anything is built: a given path must exist and
  parse, and 'auto' with a checkpoint needs its tokenizer_config.json to have a template (without
  one, the task's tokenizer is checked when the task is made: `attach`)."""
  spec = normalize(config.data.get('chat_template', ''))
  if not spec:
    return
  if spec != 'auto':
    probe(read(spec))
    return
  if not checkpoint_dir:
    return
  cfg_path = os.path.join(checkpoint_dir, 'tokenizer_config.json')
  has = os.path.isfile(os.path.join(checkpoint_dir, 'chat_template.jinja'))
  if os.path.isfile(cfg_path) and not has:
    with open(cfg_path, encoding='utf-8') as f:
      has = bool(json.load(f).get('chat_template'))
  if not has:
    raise ValueError(f"{KEY}='auto', but {checkpoint_dir} has no chat template (no "
                     f"'chat_template' in its tokenizer_config.json); set {KEY} to the path of a "
                     ".jinja file, or '' to tokenise prompts as they are")


def attach(tokenizer, spec: str):
  """Sets `tokenizer.chat` to the template `spec` names (the pipeline renders prompts with it)."""
  tokenizer.chat = resolve(spec, tokenizer)
  return tokenizer


def prompt_ids(tokenizer, text: str, add_bos: bool) -> list[int]:
  """The ids of a prompt as the pipeline feeds it: rendered by `tokenizer.chat` when one is
  attached, with bos first unless the rendered text already starts with it."""
  chat = getattr(tokenizer, 'chat', None)
  bos = getattr(tokenizer, 'bos_id', None)
  if chat is not None and not isinstance(text, Rendered):
    text = chat.render(text)
  ids = list(tokenizer.encode(text))
  if not add_bos or bos is None or (chat is not None and ids[:1] == [bos]):
    return ids  # a template that writes {{ bos_token }} itself must not get a second one
  return [bos] + ids

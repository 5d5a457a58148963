"""`HFTokenizer`: a Hugging Face tokenizer.json (fast tokenizer) with the special-token ids of its
config files, read through the `tokenizers` library. `rloo_jax.models.hf.load_tokenizer` loads one
from a checkpoint directory or hub id."""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

import numpy as np


def _read_json(path: str) -> dict:
  with open(path) as f:
    return json.load(f)


def _token_str(tok: Any) -> str | None:
  return tok.get('content') if isinstance(tok, dict) else tok


def _id_list(value) -> list[int]:
  if value is None:
    return []
  return [int(i) for i in (value if isinstance(value, list) else [value])]


class HFTokenizer:
  """tokenizer.json via the `tokenizers` library, with special-token ids from the config files."""

  chat = None  # the ChatTemplate prompts are rendered with (rloo_jax.data.chat.attach)

  def __init__(self, tokenizer, *, bos_id: int | None, eos_id: int | None, pad_id: int | None,
               stop_ids: Sequence[int] = (), chat_template: str | None = None):
    self.tokenizer = tokenizer
    self.bos_id = bos_id
    self.eos_id = eos_id
    # Pad falls back to EOS (GPT-2/Llama ship none); padding is masked everywhere anyway.
    self.pad_id = pad_id if pad_id is not None else eos_id
    # eos_id first, so a single-id consumer and the sampler agree on the primary end token.
    self.stop_ids = tuple(dict.fromkeys(_id_list(eos_id) + [int(i) for i in stop_ids]))
    self.chat_template = chat_template  # tokenizer_config.json's Jinja source, or None

  def token(self, i: int | None) -> str:
    """The text of special token i ('' for None): a chat template's bos_token / eos_token."""
    return '' if i is None else (self.tokenizer.id_to_token(int(i)) or '')

  @classmethod
  def from_dir(cls, path: str) -> 'HFTokenizer':
    import tokenizers

    tok_file = os.path.join(path, 'tokenizer.json')
    if not os.path.exists(tok_file):
      raise ValueError(f'{path}: no tokenizer.json (only fast-tokenizer files are supported)')
    tok = tokenizers.Tokenizer.from_file(tok_file)
    sources = [os.path.join(path, n)
               for n in ('tokenizer_config.json', 'generation_config.json', 'config.json')]
    cfgs = [_read_json(p) for p in sources if os.path.exists(p)]

    def special(name: str) -> int | None:
      for cfg in cfgs:
        s = _token_str(cfg.get(f'{name}_token'))
        if s is not None and tok.token_to_id(s) is not None:
          return tok.token_to_id(s)
        i = cfg.get(f'{name}_token_id')
        if isinstance(i, list):
          i = i[0] if i else None
        if i is not None:
          return int(i)
      return None

    # generation_config.json's eos_token_id is a list for instruct models (Llama 3: [eot, eos];
    # Qwen2.5-Instruct: [im_end, endoftext]): exactly the ids `generate` stops on. No token is
    # guessed from the vocabulary, so a base model stops where transformers stops it.
    stops = [i for cfg in cfgs for i in _id_list(cfg.get('eos_token_id'))]
    template = (_read_json(sources[0]).get('chat_template')
                if os.path.exists(sources[0]) else None)
    if isinstance(template, list):  # [{'name': 'default', 'template': ...}, ...]
      named = {t.get('name'): t.get('template') for t in template if isinstance(t, dict)}
      template = named.get('default')
    if template is None and os.path.exists(os.path.join(path, 'chat_template.jinja')):
      with open(os.path.join(path, 'chat_template.jinja')) as f:
        template = f.read()
    return cls(tok, bos_id=special('bos'), eos_id=special('eos'), pad_id=special('pad'),
               stop_ids=stops, chat_template=template)

  @property
  def vocab_size(self) -> int:
    return self.tokenizer.get_vocab_size(with_added_tokens=True)

  # Same conventions as rloo_jax.data.tokenizer, so either can serve the pipeline: encode adds no
  # special tokens (the pipeline prepends bos_id itself), decode stops at the first stop id.
  def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
    return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

  def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
    encoded = self.tokenizer.encode_batch(list(texts), add_special_tokens=add_special_tokens)
    return [e.ids for e in encoded]

  def decode(self, ids, skip_special_tokens: bool = True) -> str:
    ids = [int(i) for i in np.asarray(ids).reshape(-1)]
    stops = set(self.stop_ids)
    cut = next((n for n, i in enumerate(ids) if i in stops), len(ids))
    ids = ids[:cut]
    return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

  def decode_batch(self, ids_nt, skip_special_tokens: bool = True) -> list[str]:
    return [self.decode(row, skip_special_tokens) for row in ids_nt]

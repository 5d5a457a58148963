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


class HFTokenizer:
  """tokenizer.json via the `tokenizers` library, with special-token ids from the config files."""

  def __init__(self, tokenizer, *, bos_id: int | None, eos_id: int | None, pad_id: int | None):
    self.tokenizer = tokenizer
    self.bos_id = bos_id
    self.eos_id = eos_id
    # Pad falls back to EOS (GPT-2/Llama ship none); padding is masked everywhere anyway.
    self.pad_id = pad_id if pad_id is not None else eos_id

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

    return cls(tok, bos_id=special('bos'), eos_id=special('eos'), pad_id=special('pad'))

  @property
  def vocab_size(self) -> int:
    return self.tokenizer.get_vocab_size(with_added_tokens=True)

  # Same conventions as rloo_jax.data.tokenizer, so either can serve the pipeline: encode adds no
  # special tokens (the pipeline prepends bos_id itself), decode stops at the first EOS.
  def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
    return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

  def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
    encoded = self.tokenizer.encode_batch(list(texts), add_special_tokens=add_special_tokens)
    return [e.ids for e in encoded]

  def decode(self, ids, skip_special_tokens: bool = True) -> str:
    ids = [int(i) for i in np.asarray(ids).reshape(-1)]
    if self.eos_id is not None and self.eos_id in ids:
      ids = ids[:ids.index(self.eos_id)]
    return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

  def decode_batch(self, ids_nt, skip_special_tokens: bool = True) -> list[str]:
    return [self.decode(row, skip_special_tokens) for row in ids_nt]

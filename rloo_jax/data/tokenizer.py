"""Fixed-vocabulary tokenizers for the embedded tasks (no downloads, no files).

All three share one id layout: 0 = pad, 1 = bos, 2 = eos, then the vocabulary. Pad is 0 so that a
zero-initialised buffer is already padding, and the special ids are the same across tokenizers so
a config can name `pad_id`/`eos_id` without knowing which tokenizer a task uses.

Any object with `encode(str) -> list[int]`, `decode(ids) -> str`, `vocab_size`, `pad_id`, `eos_id`,
`bos_id` (may be None), optionally `stop_ids` (every id that ends a completion), works with
`rloo_jax.data.pipeline`, so a Hugging Face tokenizer wrapper from `rloo_jax.models` can stand in
for these.
"""

from __future__ import annotations

import hashlib
import string
from typing import Iterable, Sequence

import numpy as np

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
NUM_SPECIAL = 3

# Printable ASCII without the vertical whitespace variants (\r, \x0b, \x0c): those only ever appear
# as noise and would give one character several ids' worth of meaning.
PRINTABLE_CHARS = string.digits + string.ascii_letters + string.punctuation + " \n\t"


def _as_id_list(ids) -> list[int]:
  if isinstance(ids, np.ndarray):
    if ids.ndim != 1:
      raise ValueError(f"decode expects a 1-D sequence of ids, got shape {ids.shape}")
    return [int(i) for i in ids]
  return [int(i) for i in ids]


class _FixedVocab:
  """Shared id bookkeeping: specials first, then `symbols` in the given order."""

  kind = "fixed"

  def __init__(self, symbols: Sequence[str]):
    symbols = list(symbols)
    seen = set()
    for s in symbols:
      if s in seen:
        raise ValueError(f"{type(self).__name__}: symbol {s!r} appears twice in the vocabulary")
      seen.add(s)
    self.symbols: tuple[str, ...] = tuple(symbols)
    self._to_id = {s: i + NUM_SPECIAL for i, s in enumerate(symbols)}

  @property
  def vocab_size(self) -> int:
    return NUM_SPECIAL + len(self.symbols)

  @property
  def pad_id(self) -> int:
    return PAD_ID

  @property
  def bos_id(self) -> int:
    return BOS_ID

  @property
  def eos_id(self) -> int:
    return EOS_ID

  @property
  def stop_ids(self) -> tuple[int, ...]:
    return (EOS_ID,)

  # No template of their own (config.data.chat_template='auto' or True is an error); `chat` is the
  # template a task attaches (rloo_jax.data.chat.attach), which the pipeline renders prompts with.
  chat_template = None
  chat = None

  @property
  def name(self) -> str:
    # A short stable identifier: prepared datasets that filter by token count key their cache
    # directory on it, so two different vocabularies never share a filtered dataset.
    digest = hashlib.sha1("\x00".join(self.symbols).encode("utf-8")).hexdigest()[:8]
    return f"{self.kind}{self.vocab_size}_{digest}"

  def _symbols_of(self, text: str) -> Iterable[str]:
    raise NotImplementedError

  def _join(self, symbols: list[str]) -> str:
    raise NotImplementedError

  def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
    ids = [BOS_ID] if add_bos else []
    for s in self._symbols_of(text):
      i = self._to_id.get(s)
      if i is None:
        raise ValueError(
            f"{type(self).__name__}: {self._unit} {s!r} is not in the vocabulary "
            f"(in text {text[:80]!r}); use a tokenizer whose vocabulary covers the task")
      ids.append(i)
    if add_eos:
      ids.append(EOS_ID)
    return ids

  def decode(self, ids) -> str:
    """Text up to (not including) the first eos; pad and bos are skipped."""
    out = []
    for i in _as_id_list(ids):
      if i == EOS_ID:
        break
      if i in (PAD_ID, BOS_ID):
        continue
      j = i - NUM_SPECIAL
      if not 0 <= j < len(self.symbols):
        raise ValueError(f"{type(self).__name__}: id {i} is outside the vocabulary "
                         f"(size {self.vocab_size})")
      out.append(self.symbols[j])
    return self._join(out)

  def decode_batch(self, ids_nt) -> list[str]:
    return [self.decode(row) for row in np.asarray(ids_nt)]

  def __eq__(self, other):
    return type(self) is type(other) and self.symbols == other.symbols

  def __hash__(self):
    return hash((type(self).__name__, self.symbols))

  def __repr__(self):
    return f"{type(self).__name__}(vocab_size={self.vocab_size})"


class CharTokenizer(_FixedVocab):
  """One id per character of a fixed character set."""

  kind = "char"
  _unit = "character"

  def __init__(self, chars: str = PRINTABLE_CHARS):
    super().__init__(list(chars))

  @property
  def chars(self) -> str:
    return "".join(self.symbols)

  def _symbols_of(self, text):
    return text

  def _join(self, symbols):
    return "".join(symbols)


class WordTokenizer(_FixedVocab):
  """One id per whitespace-separated word of a fixed word list; decode joins with single spaces.

  Word-level sequences are several times shorter than character-level ones, which is what lets the
  embedded summarisation task train in minutes on a CPU.
  """

  kind = "word"
  _unit = "word"

  def __init__(self, words: Sequence[str]):
    for w in words:
      if not w or any(c.isspace() for c in w):
        raise ValueError(f"WordTokenizer: vocabulary entry {w!r} must be non-empty without spaces")
    super().__init__(words)

  def _symbols_of(self, text):
    return text.split()

  def _join(self, symbols):
    return " ".join(symbols)


class ByteTokenizer(_FixedVocab):
  """UTF-8 bytes (259 ids): covers any text, for real datasets with models trained from scratch."""

  kind = "byte"
  _unit = "byte"

  def __init__(self):
    super().__init__([bytes([b]).decode("latin-1") for b in range(256)])

  @property
  def name(self) -> str:
    return "byte259"

  def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
    ids = [BOS_ID] if add_bos else []
    ids.extend(b + NUM_SPECIAL for b in text.encode("utf-8"))
    if add_eos:
      ids.append(EOS_ID)
    return ids

  def decode(self, ids) -> str:
    out = bytearray()
    for i in _as_id_list(ids):
      if i == EOS_ID:
        break
      if i in (PAD_ID, BOS_ID):
        continue
      if not NUM_SPECIAL <= i < self.vocab_size:
        raise ValueError(f"ByteTokenizer: id {i} is outside the vocabulary "
                         f"(size {self.vocab_size})")
      out.append(i - NUM_SPECIAL)
    # Sampled byte sequences can cut a multi-byte character; show it rather than fail a rollout.
    return out.decode("utf-8", errors="replace")

"""TL;DR in miniature: an embedded summarisation-like preference task with a hidden gold reward.

A document is a shuffled bag of words: a few *topic* words (nouns, the key words, some repeated)
among *filler* words (function words, sampled with replacement). The prompt is
`doc: w1 w2 ... tl;dr:`; a good completion lists each key word once, in order of first
appearance, and nothing else:

  doc: the storm was over a river and storm then the very market tl;dr:  ->  storm river market

The hidden gold reward that scores this (recall of key words, a per-word cost for anything beyond
them, a bonus for document order) is not data: it lives in `rloo_jax.rewards.summarize_gold`
(`gold_reward`), the labeller's noise and win rates in `rloo_jax.rewards.preferences`. This module
only generates the task and parses its prompts (`parse_prompt`, `key_words`) for them.

The dataset's `answer` is an *imperfect* reference summary, so a policy fine-tuned on it starts
below the gold optimum and RL has room to improve; `reference` is the ideal summary. Its flaws are
a systematic habit (most summaries open with the same filler word, `lead_word`, so the SFT
policy's greedy mode is imperfect too -- like the arithmetic demonstrator that drops carries) plus
random slips (key words dropped, fillers inserted, order shuffled, words repeated), each with a
configurable probability.
Word-level tokens (`make_tokenizer`) keep prompts ~20 tokens and summaries ~5, which is what makes
the whole SFT -> reward model -> RLOO pipeline fit in minutes on a CPU.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Sequence

import numpy as np
import tensorflow_datasets as tfds

from rloo_jax.data import builder as builder_lib
from rloo_jax.data.tokenizer import WordTokenizer

TOPIC_WORDS = (
    "storm", "river", "market", "doctor", "garden", "engine", "castle", "island", "festival",
    "pilot", "harvest", "museum", "forest", "library", "planet", "bridge", "concert", "vaccine",
    "election", "tunnel", "glacier", "orchard", "volcano", "satellite")
FILLER_WORDS = (
    "the", "a", "an", "and", "of", "to", "in", "on", "was", "is", "it", "with", "for", "at", "by",
    "from", "as", "that", "this", "then", "very", "also", "just", "some", "more", "most", "other",
    "into", "over", "after", "before", "while", "when", "where", "which", "who", "there", "here")
DOC_MARK = "doc:"
TLDR_MARK = "tl;dr:"
VOCAB = (DOC_MARK, TLDR_MARK) + TOPIC_WORDS + FILLER_WORDS
_TOPIC_SET = frozenset(TOPIC_WORDS)


def make_tokenizer() -> WordTokenizer:
  return WordTokenizer(VOCAB)


def format_prompt(doc_words: Sequence[str]) -> str:
  return f"{DOC_MARK} {' '.join(doc_words)} {TLDR_MARK}"


def parse_prompt(prompt: str) -> list[str] | None:
  """The document's words, or None if `prompt` is not `doc: ... tl;dr:`."""
  words = prompt.split()
  if len(words) < 2 or words[0] != DOC_MARK or words[-1] != TLDR_MARK:
    return None
  return words[1:-1]


def key_words(doc_words: Sequence[str]) -> list[str]:
  """Distinct topic words in order of first appearance: the ideal summary."""
  return list(dict.fromkeys(w for w in doc_words if w in _TOPIC_SET))


@dataclasses.dataclass(eq=False)
class SummarizeConfig(tfds.core.BuilderConfig):
  num_train: int = 4000
  num_test: int = 256
  min_keys: int = 1
  max_keys: int = 3
  max_repeats: int = 2          # each key word occurs 1..max_repeats times
  min_doc_words: int = 10
  max_doc_words: int = 16
  # The demonstrator's *systematic* habit: it opens most summaries with the same filler word
  # ("the storm river"). The SFT policy's mode inherits it, so even its greedy summaries pay the
  # extra-word cost (0.2, or 0.3 when the word is not in the document) and RL has headroom there.
  lead_word: str = "the"
  p_lead: float = 0.7           # summaries that open with lead_word
  # Random slips on top of the habit (they shape the samples, rarely the mode).
  p_drop: float = 0.2           # per key word, left out of the reference summary
  p_filler: float = 0.3         # 1-2 document fillers inserted
  p_shuffle: float = 0.2        # reference words in random order
  p_repeat: float = 0.1         # one reference word said twice
  seed: int = 0


def make_document(rng: np.random.Generator, c: SummarizeConfig) -> list[str]:
  n_keys = int(rng.integers(c.min_keys, c.max_keys + 1))
  keys = [TOPIC_WORDS[i] for i in rng.choice(len(TOPIC_WORDS), n_keys, replace=False)]
  words = [k for k in keys for _ in range(int(rng.integers(1, c.max_repeats + 1)))]
  length = max(len(words), int(rng.integers(c.min_doc_words, c.max_doc_words + 1)))
  words += [FILLER_WORDS[i] for i in rng.integers(0, len(FILLER_WORDS), length - len(words))]
  return [words[i] for i in rng.permutation(len(words))]


def imperfect_summary(doc_words: Sequence[str], rng: np.random.Generator,
                      c: SummarizeConfig) -> str:
  """A plausible but flawed human-style summary (the SFT target)."""
  words = [k for k in key_words(doc_words) if rng.random() >= c.p_drop]
  fillers = [w for w in doc_words if w not in _TOPIC_SET]
  if fillers and (rng.random() < c.p_filler or not words):
    for _ in range(int(rng.integers(1, 3))):
      words.insert(int(rng.integers(0, len(words) + 1)), fillers[int(rng.integers(len(fillers)))])
  if rng.random() < c.p_shuffle:
    words = [words[i] for i in rng.permutation(len(words))]
  if words and rng.random() < c.p_repeat:
    i = int(rng.integers(len(words)))
    words.insert(i + 1, words[i])
  if c.lead_word and rng.random() < c.p_lead:  # the habit: one consistent opening word
    words.insert(0, c.lead_word)
  return " ".join(words)


class Summarize(builder_lib.TextBuilder):
  """`train` / `test` prompts with `answer` (imperfect summary) and `reference` (ideal one).
  No document appears in both splits."""

  TEXT_FIELDS = ("prompt", "answer", "reference")
  DESCRIPTION = "Synthetic key-word summarisation with a hidden gold reward (rloo_jax)."

  @classmethod
  def make_config(cls, **options):
    return builder_lib.builder_config(SummarizeConfig, **options)

  def _split_examples(self, dl_manager):
    c = self.builder_config
    if not 1 <= c.min_keys <= c.max_keys <= len(TOPIC_WORDS):
      raise ValueError(f"need 1 <= min_keys <= max_keys <= {len(TOPIC_WORDS)}")
    rng = np.random.default_rng(c.seed)
    seen: set[str] = set()
    rows = []
    attempts = 0
    while len(rows) < c.num_test + c.num_train:
      attempts += 1
      if attempts > 20 * (c.num_test + c.num_train) + 1000:
        raise ValueError(f"could not draw {c.num_test + c.num_train} distinct documents; "
                         "lengthen the documents or ask for fewer")
      doc = make_document(rng, c)
      prompt = format_prompt(doc)
      if prompt in seen:
        continue
      seen.add(prompt)
      rows.append({"prompt": prompt, "answer": imperfect_summary(doc, rng, c),
                   "reference": " ".join(key_words(doc))})
    return {"train": iter(rows[c.num_test:]), "test": iter(rows[:c.num_test])}


def prepare(data_dir: str | os.PathLike, **options) -> Summarize:
  """Prepares (or reuses) the dataset under `data_dir`; options are SummarizeConfig's."""
  return builder_lib.prepare(Summarize, data_dir, **options)

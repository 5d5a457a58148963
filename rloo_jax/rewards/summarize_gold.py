"""The summarize task's hidden labeller: the gold reward of a summary of a bag-of-words document.

It plays the human of the embedded preference task (`rloo_jax.data.summarize`): the policy never
sees it, preference pairs are drawn from it with Bradley-Terry noise
(`rloo_jax.rewards.preferences.bradley_terry_prefer`), a reward model learns from the pairs, and
evaluation judges with it. As a reward function (`rloo_jax.rewards.summarize_gold:gold_reward`)
it is also the oracle RLOO can optimise directly.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from rloo_jax.data.summarize import key_words
from rloo_jax.data.summarize import parse_prompt

# Gold reward weights (see gold_score).
EXTRA_WORD_COST = 0.2
NOT_IN_DOC_COST = 0.1
ORDER_BONUS = 0.1


def gold_score(doc_words: Sequence[str], summary: str) -> float:
  """recall(key words) - 0.2 * (words beyond one mention of each key word: fillers, repeats,
  topic words absent from the document) - 0.1 * (words not in the document at all)
  + 0.1 if every key word is present and in document order.

  Range [-inf, 1.1]: the ideal summary scores 1.1, an empty one 0, and length beyond the key
  words always costs, so padding a summary with guesses never pays. NaN for a document without
  key words (nothing to summarise).
  """
  keys = key_words(doc_words)
  if not keys:
    return float("nan")
  words = summary.split()
  doc = set(doc_words)
  mentioned = [w for w in dict.fromkeys(words) if w in keys]
  recall = len(mentioned) / len(keys)
  extra = len(words) - len(mentioned)
  not_in_doc = sum(w not in doc for w in words)
  in_order = len(mentioned) == len(keys) and mentioned == keys
  return recall - EXTRA_WORD_COST * extra - NOT_IN_DOC_COST * not_in_doc + ORDER_BONUS * in_order


def gold_reward(prompts: Sequence[str], completions: Sequence[str], **fields: Any) -> np.ndarray:
  """The hidden labeller as a reward function: float32 [N]; NaN for prompts it cannot parse."""
  del fields
  if len(prompts) != len(completions):
    raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
  out = np.empty((len(prompts),), np.float32)
  for i, (p, c) in enumerate(zip(prompts, completions)):
    doc = parse_prompt(p)
    out[i] = np.nan if doc is None else gold_score(doc, c)
  return out

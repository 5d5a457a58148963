"""The protocol shared by rewards that check a completion against a reference answer: the
length checks, the cut at an eos `stop` string, and NaN for a sample whose answer is missing
(the trainer masks it out of the baselines instead of counting it as a failure)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np


def cut(text: str, stop: str | None) -> str:
  """text up to the first `stop` (an eos string, for tokenizers that decode it)."""
  if stop:
    i = text.find(stop)
    if i >= 0:
      text = text[:i]
  return text


def last_boxed(text: str) -> str | None:
  """The content of the last `\\boxed{...}` in `text` (its braces matched), or None."""
  start = text.rfind("\\boxed")
  while start >= 0:
    i = start + len("\\boxed")
    while i < len(text) and text[i].isspace():
      i += 1
    depth, j = 0, i
    for j in range(i, len(text)):
      depth += {"{": 1, "}": -1}.get(text[j], 0)
      if depth == 0:
        break
    if i < len(text) and text[i] == "{" and depth == 0:
      return text[i + 1:j]
    start = text.rfind("\\boxed", 0, start)  # unclosed (cut off): the one before
  return None


def num_rows(prompts: Sequence[str], completions: Sequence[str]) -> int:
  n = len(completions)
  if len(prompts) != n:
    raise ValueError(f"{len(prompts)} prompts but {n} completions")
  return n


def missing(a: Any) -> bool:
  return a is None or (isinstance(a, float) and np.isnan(a)) or str(a).strip() == ""


def against_answers(prompts: Sequence[str], completions: Sequence[str],
                    answer: Sequence[Any] | None, stop: str | None,
                    score: Callable[[str, str], float]) -> np.ndarray:
  """float32 [N]: score(completion cut at `stop`, answer) per sample, NaN where the answer is
  missing or '' (all NaN without answers); `score` may return NaN for an answer it cannot
  read."""
  n = num_rows(prompts, completions)
  if answer is None:
    return np.full((n,), np.nan, np.float32)
  if len(answer) != n:
    raise ValueError(f"{len(answer)} answers but {n} completions")
  return np.array([np.nan if missing(a) else score(cut(str(c), stop), str(a))
                   for c, a in zip(completions, answer)], np.float32).reshape(n)

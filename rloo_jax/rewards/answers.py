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
    if i < len(text) and text[i] == "{":
      depth = 0
      for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
          return text[i + 1:j]
    start = text.rfind("\\boxed", 0, start)  # unclosed (cut off): the one before
  return None


def boxed_answer(text: str) -> str | None:
  """The last `\\boxed{...}`'s content without whitespace (how a majority vote compares boxed
  answers: `\\frac{3}{4}` and `\\frac {3}{4}` agree), or None."""
  boxed = last_boxed(text)
  return None if boxed is None else "".join(boxed.split())


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
  return against_answers_batch(prompts, completions, answer, stop,
                               lambda pairs: [score(c, a) for c, a in pairs])


def against_answers_batch(prompts: Sequence[str], completions: Sequence[str],
                          answer: Sequence[Any] | None, stop: str | None,
                          score_all: Callable[[list], Sequence[float]]) -> np.ndarray:
  """`against_answers` with one call for the batch: score_all([(completion cut at `stop`,
  answer), ...]) over the samples whose answer is present, a score each."""
  n = num_rows(prompts, completions)
  out = np.full((n,), np.nan, np.float32)
  if answer is None:
    return out
  if len(answer) != n:
    raise ValueError(f"{len(answer)} answers but {n} completions")
  rows = [i for i in range(n) if not missing(answer[i])]
  if rows:
    out[rows] = score_all([(cut(str(completions[i]), stop), str(answer[i])) for i in rows])
  return out

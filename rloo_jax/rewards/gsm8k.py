"""GSM8K (Cobbe et al. 2021) rewards: final-answer exact match and an optional format reward.

  gsm8k(prompts, completions, *, answer, stop=None)   1.0 / 0.0 / NaN per completion
  gsm8k_format(prompts, completions, *, stop=None)    1.0 when it ends with a '#### <number>' line

The final number is extracted the way GSM8K graders do: the number right after the last '####'
when there is one (the dataset's own answer format), else the last number in the text (models
prompted without the format tend to end with "... so the answer is 72."). Numbers are compared
as exact decimals after normalisation: commas grouping thousands, currency signs, a leading '+',
a trailing '.' and trailing zeros after the point are ignored, so '$1,200.00' == '1200' and
'72.0' == '72', but '72.5' != '72'. Float tolerance is deliberately not used: GSM8K answers are
exact, and a tolerance would pass near misses such as 0.3333 for 1/3 inconsistently.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

# The format's parsing lives with the data (the builder normalises references with it).
from rloo_jax.data.gsm8k_answer import (  # noqa: F401  (re-exported)
    _FORMAT_LINE, _NUMBER, MARKER, extract_answer, normalize, parse_number, reference_answer)


def _cut(text: str, stop: str | None) -> str:
  if stop:
    i = text.find(stop)
    if i >= 0:
      text = text[:i]
  return text


def _missing(a: Any) -> bool:
  return a is None or (isinstance(a, float) and np.isnan(a)) or str(a).strip() == ""


def gsm8k(prompts: Sequence[str], completions: Sequence[str], *,
          answer: Sequence[str | None] | None = None, stop: str | None = None,
          **fields: Any) -> np.ndarray:
  """1.0 where the completion's final number (cut at `stop`, an eos string for tokenizers that
  decode it) equals the reference answer's exactly; 0.0 otherwise, including completions with no
  number at all.

  `answer` is the reference: the bare number (the GSM8K builder's `answer` field) or a full
  solution ending '#### <number>'. Samples whose reference is missing, '' or holds no number get
  NaN: the trainer masks them out of the baselines instead of counting them as failures.
  """
  del fields
  n = len(completions)
  if len(prompts) != n:
    raise ValueError(f"{len(prompts)} prompts but {n} completions")
  if answer is None:
    return np.full((n,), np.nan, np.float32)
  if len(answer) != n:
    raise ValueError(f"{len(answer)} answers but {n} completions")
  out = np.empty((n,), np.float32)
  for i, (c, a) in enumerate(zip(completions, answer)):
    reference = None if _missing(a) else extract_answer(str(a))
    if reference is None:
      out[i] = np.nan
      continue
    predicted = extract_answer(_cut(str(c), stop))
    out[i] = float(predicted is not None and predicted == reference)
  return out


def gsm8k_format(prompts: Sequence[str], completions: Sequence[str], *, stop: str | None = None,
                 **fields: Any) -> np.ndarray:
  """1.0 where the completion (cut at `stop`) ends with a line '#### <number>', the dataset's own
  answer format, so a grader that reads only that line would find the answer; 0.0 otherwise.
  Correctness is not checked: pair it with `gsm8k` at a small weight."""
  del fields
  n = len(completions)
  if len(prompts) != n:
    raise ValueError(f"{len(prompts)} prompts but {n} completions")
  out = np.zeros((n,), np.float32)
  for i, c in enumerate(completions):
    lines = _cut(str(c), stop).rstrip().splitlines()
    if not lines:
      continue
    m = _FORMAT_LINE.fullmatch(lines[-1].strip())
    out[i] = float(m is not None and parse_number(m.group("number")) is not None)
  return out

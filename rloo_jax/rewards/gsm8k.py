"""GSM8K (Cobbe et al. 2021) rewards: final-answer exact match and an optional format reward.

  gsm8k(prompts, completions, *, answer, stop=None)   1.0 / 0.0 / NaN per completion
  gsm8k_format(prompts, completions, *, stop=None)    1.0 when it ends with a '#### <number>' line
  gsm8k.answer_ids(completions, k)                     maj@n's votes: the number the score reads

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

from rloo_jax import passk
from rloo_jax.rewards import answers
# The format's parsing lives with the data (the builder normalises references with it).
from rloo_jax.data.gsm8k_answer import (  # noqa: F401  (re-exported)
    _FORMAT_LINE, extract_answer, normalize, parse_number)


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

  def score(completion: str, reference_text: str) -> float:
    reference = extract_answer(reference_text)
    if reference is None:
      return np.nan
    predicted = extract_answer(completion)
    return float(predicted is not None and predicted == reference)
  return answers.against_answers(prompts, completions, answer, stop, score)


def answer_ids(completions: Sequence[str], k: int) -> np.ndarray:
  """int32 [N / k, k], maj@n's votes (rloo_jax.evaluation): the final number `gsm8k` scores,
  as an exact decimal (72.0 and $72 vote together), -1 where there is none. Without it the vote
  would read a \\boxed{} before the '####' line the score reads."""
  return passk.group_ids([extract_answer(str(c)) for c in completions], k)


gsm8k.answer_ids = answer_ids


def gsm8k_format(prompts: Sequence[str], completions: Sequence[str], *, stop: str | None = None,
                 **fields: Any) -> np.ndarray:
  """1.0 where the completion (cut at `stop`) ends with a line '#### <number>', the dataset's own
  answer format, so a grader that reads only that line would find the answer; 0.0 otherwise.
  Correctness is not checked: pair it with `gsm8k` at a small weight."""
  del fields
  out = np.zeros((answers.num_rows(prompts, completions),), np.float32)
  for i, c in enumerate(completions):
    lines = answers.cut(str(c), stop).rstrip().splitlines()
    if not lines:
      continue
    m = _FORMAT_LINE.fullmatch(lines[-1].strip())
    out[i] = float(m is not None and parse_number(m.group("number")) is not None)
  return out

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

import decimal
import re
from typing import Any, Sequence

import numpy as np

MARKER = "####"
# U+2212 (the typographic minus) appears in model output copied from rendered maths.
_SIGNS = "-+\u2212"
_CURRENCY = "$\u20ac\u00a3\u00a5\u20b9"  # $ € £ ¥ ₹
# A sign only counts when it does not follow a word character or a closing bracket and touches
# the number (or its currency sign), so the '-' of '10-15', 'x-3' or '10 - 3' is an operator and
# '15' / '3' stay positive. Commas are accepted only in whole thousands groups ('1,200'), so '3,4'
# reads as two numbers, not 34. A bare fraction ('.5') must not continue a number ('1.2.3').
_NUMBER = re.compile(
    rf"(?:(?<![\w)\]])(?P<sign>[{_SIGNS}]))?"
    rf"(?:(?P<currency>[{re.escape(_CURRENCY)}])\s?(?P<sign2>[{_SIGNS}])?)?"
    r"(?:(?P<digits>\d{1,3}(?:,\d{3})+(?!\d|,\d)|\d+)(?P<fraction>\.\d+)?"
    r"|(?<!\d)(?P<bare_fraction>\.\d+))")
_FORMAT_LINE = re.compile(rf"{MARKER}[ \t]*(?P<number>.+?)[ \t]*\.?")
# Enough digits that no GSM8K-like number is ever rounded by normalize().
_EXACT = decimal.Context(prec=200)


def _numbers(text: str) -> list[tuple[int, decimal.Decimal]]:
  """Every number in `text` as `(start offset, exact value)`, in order."""
  out = []
  for m in _NUMBER.finditer(text):
    literal = (m.group("digits") or "0").replace(",", "") + (
        m.group("fraction") or m.group("bare_fraction") or "")
    value = decimal.Decimal(literal)  # exact: construction never rounds
    signs = (m.group("sign") or "") + (m.group("sign2") or "")
    negative = "-" in signs or "\u2212" in signs
    out.append((m.start(), value.copy_negate() if negative else value))
  return out


def normalize(value: decimal.Decimal) -> str:
  """The canonical string of a number: no exponent, no trailing zeros after the point, and no
  '-0' ('1,200.00' -> '1200', '-0.50' -> '-0.5')."""
  if value == 0:
    return "0"
  text = format(value.normalize(_EXACT), "f")
  if "." in text:
    text = text.rstrip("0").rstrip(".")
  return text


def parse_number(text: str) -> decimal.Decimal | None:
  """The one number `text` holds ('$1,200.', '-5', '72.0'), or None when it holds none or more
  than one."""
  found = _numbers(text)
  if len(found) != 1:
    return None
  rest = _NUMBER.sub("", text, count=1).strip()
  return found[0][1] if rest in ("", ".") else None


def extract_answer(text: str) -> decimal.Decimal | None:
  """The final answer of a solution: the first number after the last '####' when the text has
  one (None when nothing numeric follows it: '####' alone is a malformed answer, not a cue to
  look elsewhere), else the text's last number; None when there is none."""
  cut = text.rfind(MARKER)
  if cut >= 0:
    found = _numbers(text[cut + len(MARKER):])
    return found[0][1] if found else None
  found = _numbers(text)
  return found[-1][1] if found else None


def reference_answer(text: str) -> str | None:
  """A GSM8K reference (the full solution ending '#### 72', or the bare number) as its
  normalised number string, or None when it has none."""
  value = extract_answer(text)
  return None if value is None else normalize(value)


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

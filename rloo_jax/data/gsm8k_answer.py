"""GSM8K's answer format: the numbers of a solution and its final answer (after the last '####',
else the last number), normalised and compared as exact decimals. Shared by the builder (the
reference's answer field) and the verifier (rloo_jax.rewards.gsm8k), which says why exact."""

from __future__ import annotations

import decimal
import re

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

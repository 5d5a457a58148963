"""The worker process of rloo_jax.rewards.math_answer, run as a script: requests in on stdin,
their results out on stdout (pickled), until stdin closes: ("score", [(completion, reference),
...]) gets a score each, ("group", [[answer part, ...] a prompt, ...]) each sample's answer id.

It imports math-verify and nothing of rloo_jax (no JAX in every worker), and checks in its main
thread, where math-verify's SIGALRM timeouts work.
"""

import functools
import math
import pickle
import sys

import math_verify

# TRL's / open-r1's accuracy reward: a boxed answer first, no bare-expression fallback.
_COMPLETION = (math_verify.LatexExtractionConfig(
    normalization_config=math_verify.LatexNormalizationConfig(
        nits=False, malformed_operators=False, basic_latex=True, boxed="all", units=True),
    boxed_match_priority=0, try_extract_without_anchor=False),)


@functools.lru_cache(maxsize=4096)
def _reference(text: str, timeout_s: int) -> tuple:
  text = text if "\\boxed" in text else "\\boxed{" + text + "}"
  return tuple(math_verify.parse(text, extraction_mode="first_match", parsing_timeout=timeout_s))


def _parse(completion: str, timeout_s: int) -> list:
  return math_verify.parse(completion, extraction_config=_COMPLETION,
                           extraction_mode="first_match", parsing_timeout=timeout_s)


def score(pairs, timeout_s: int) -> list:
  """1.0 / 0.0 per (completion, reference); NaN where the reference holds no readable answer."""
  out = []
  for completion, reference in pairs:
    gold = _reference(reference, timeout_s)
    if not gold:
      out.append(math.nan)
      continue
    pred = _parse(completion, timeout_s)
    out.append(float(bool(pred) and math_verify.verify(list(gold), pred,
                                                         timeout_seconds=timeout_s)))
  return out


def group(groups, timeout_s: int) -> list:
  """For each group of texts, each one's id: the index of the first text in the group whose
  answer math-verify finds equal to its own (itself if none), -1 where it reads no answer."""
  out = []
  for texts in groups:
    firsts, ids = [], []  # (index, parsed answer) of each distinct answer so far
    for i, text in enumerate(texts):
      pred = _parse(text, timeout_s)
      same = (j for j, p in firsts if math_verify.verify(p, pred, timeout_seconds=timeout_s))
      ids.append(-1 if not pred else next(same, i))
      if ids[-1] == i:
        firsts.append((i, pred))
    out.append(ids)
  return out


def main() -> None:
  stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
  sys.stdout = sys.stderr  # nothing a library prints may reach the pipe
  while True:
    try:
      op, items, timeout_s = pickle.load(stdin)
    except EOFError:
      return
    pickle.dump({"score": score, "group": group}[op](items, timeout_s), stdout)
    stdout.flush()


if __name__ == "__main__":
  main()

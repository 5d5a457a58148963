"""pass@k and maj@k of n samples per prompt, with bootstrap intervals over prompts.

pass@k is the unbiased estimator of Chen et al. (2021): of n samples with c correct, the chance
that k drawn without replacement hold a correct one, 1 - C(n - c, k) / C(n, k), averaged over
prompts. maj@n: the prompt counts as solved when the answer most of its n samples give (ties:
the one given first) is a correct one. The correct samples vote as one answer: each equals the
reference under the reward (0.5 and \\frac{1}{2} alike), however their texts differ; a wrong
one that gives no answer (None) does not vote.
"""

from __future__ import annotations

from collections import Counter
from typing import Hashable, Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
  """1 - C(n - c, k) / C(n, k), as a product (no large binomials)."""
  if not 1 <= k <= n:
    raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
  if n - c < k:
    return 1.0
  return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def majority_correct(answers: Sequence[Hashable], correct: Sequence[bool]) -> bool:
  """Whether the most common answer (ties: the first given) is one of a correct sample; the
  correct samples count as one answer, wrong ones without an answer (None) not at all."""
  votes = [True if ok else ("wrong", a) for a, ok in zip(answers, correct) if ok or a is not None]
  if not votes:
    return False
  counts = Counter(votes)
  top = max(counts.values())
  return next(v for v in votes if counts[v] == top) is True  # True: the correct ones


def group_ids(answers: Sequence[Hashable], k: int) -> np.ndarray:
  """int32 [len(answers) / k, k]: for each group of k answers, the index of the first in the
  group equal to each, so equal ids mean equal answers; -1 for None (no answer, no vote)."""
  groups = [list(answers[i:i + k]) for i in range(0, len(answers), k)]
  return np.asarray([[-1 if a is None else g.index(a) for a in g] for g in groups],
                    np.int32).reshape(-1, k)


def bootstrap_interval(values: np.ndarray, *, reps: int = 1000, alpha: float = 0.05,
                       seed: int = 0) -> tuple[float, float]:
  """The (alpha/2, 1 - alpha/2) percentile interval of the mean over resampled prompts."""
  values = np.asarray(values, np.float64)
  idx = np.random.default_rng(seed).integers(0, len(values), (reps, len(values)))
  means = values[idx].mean(1)
  return float(np.quantile(means, alpha / 2)), float(np.quantile(means, 1 - alpha / 2))


def ks_of(n: int) -> list[int]:
  """The k reported for n samples: powers of two below n, and n."""
  return sorted({2 ** i for i in range(n.bit_length()) if 2 ** i < n} | {n})


def summarize(correct_pn: np.ndarray, answers_pn: Sequence[Sequence[Hashable]]) -> dict:
  """{'pass@k', 'pass@k_lo', 'pass@k_hi' for each k of `ks_of(n)`, 'maj@n' (and its interval)}
  from correct [prompts, n] and the answers each sample gave."""
  correct_pn = np.asarray(correct_pn, bool)
  n = correct_pn.shape[1]
  c_p = correct_pn.sum(1)
  out = {}
  for k in ks_of(n):
    per_prompt = np.array([pass_at_k(n, int(c), k) for c in c_p])
    out[f"pass@{k}"] = float(per_prompt.mean())
    out[f"pass@{k}_lo"], out[f"pass@{k}_hi"] = bootstrap_interval(per_prompt)
  maj = np.array([majority_correct(a, ok) for a, ok in zip(answers_pn, correct_pn)], float)
  out[f"maj@{n}"] = float(maj.mean())
  out[f"maj@{n}_lo"], out[f"maj@{n}_hi"] = bootstrap_interval(maj)
  return out

"""Pairwise preferences: a noisy Bradley-Terry labeller of gold scores, and the win rate of one
policy over another (the one statistic every evaluation and the RLHF report use)."""

from __future__ import annotations

import numpy as np


def bradley_terry_prefer(gold_a: np.ndarray, gold_b: np.ndarray, rng: np.random.Generator,
                         temperature: float = 0.1) -> np.ndarray:
  """Noisy labels: True where a labeller prefers a, with P = sigmoid((gold_a - gold_b) / T).

  T = 0 gives noiseless labels (ties broken by a coin flip).
  """
  gold_a, gold_b = np.asarray(gold_a, np.float64), np.asarray(gold_b, np.float64)
  diff = gold_a - gold_b
  if temperature <= 0:
    return np.where(diff == 0, rng.random(diff.shape) < 0.5, diff > 0)
  p = 1.0 / (1.0 + np.exp(-np.clip(diff / temperature, -60, 60)))
  return rng.random(diff.shape) < p


def win_rate_stats(scores_policy, scores_baseline) -> dict:
  """Win rate of the policy over the baseline on the same prompts, ties counted half; prompts
  where either is unscorable (NaN) are left out. Also wins / ties / losses / n."""
  a, b = np.asarray(scores_policy, np.float64), np.asarray(scores_baseline, np.float64)
  if a.shape != b.shape:
    raise ValueError(f"win rate needs one score per prompt for both policies, got {a.shape} and "
                     f"{b.shape}")
  ok = np.isfinite(a) & np.isfinite(b)
  a, b = a[ok], b[ok]
  wins, ties = int((a > b).sum()), int((a == b).sum())
  n = int(ok.sum())
  return dict(win_rate=(wins + 0.5 * ties) / n if n else float("nan"), wins=wins, ties=ties,
              losses=n - wins - ties, n=n)

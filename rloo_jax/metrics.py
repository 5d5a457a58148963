"""Metric logging: one JSON object per line in `<workdir>/metrics.jsonl` and TensorBoard event
files in `<workdir>/tensorboard`. Only process 0 writes, so multi-host runs log once. Also the
win-rate statistic shared by the trainer's held-out evaluation and the RLHF pipeline."""

from __future__ import annotations

import json
import math
import os
from typing import Mapping

import jax
import numpy as np


def _scalar(value):
  value = np.asarray(value)
  return float(value) if value.size == 1 else None


class MetricWriter:

  def __init__(self, workdir: str, *, tensorboard: bool = True):
    self.enabled = jax.process_index() == 0
    self._tb = None
    if not self.enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    # Append: a resumed run continues the same log (entries carry their step).
    self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a", encoding="utf-8")
    if tensorboard:
      from tensorboardX import SummaryWriter  # pure-Python event writer, no TensorFlow
      self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

  def write(self, step: int, metrics: Mapping[str, object], prefix: str = ""):
    if not self.enabled:
      return
    row = {"step": int(step)}
    for name, value in metrics.items():
      v = _scalar(value)
      if v is None:
        continue
      row[prefix + name] = v if math.isfinite(v) else None
      if self._tb is not None and math.isfinite(v):
        self._tb.add_scalar(prefix + name, v, int(step))
    self._jsonl.write(json.dumps(row) + "\n")
    self._jsonl.flush()

  def close(self):
    if self.enabled:
      self._jsonl.close()
      if self._tb is not None:
        self._tb.close()


def read_jsonl(path: str) -> list[dict]:
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


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

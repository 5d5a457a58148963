"""Metric logging: one JSON object per line in `<workdir>/metrics.jsonl`, TensorBoard event
files in `<workdir>/tensorboard`, and optionally Weights & Biases (`config.train.wandb_project`;
`pip install wandb`), every writer given the same rows. Only process 0 writes, so multi-host runs
log once. `tensorboard --logdir <workdir>/tensorboard` (`pip install -e ".[tensorboard]"`)
shows the event files."""

from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Mapping, Optional

import jax
import numpy as np


def _scalar(value):
  value = np.asarray(value)
  return float(value) if value.size == 1 else None


class MetricWriter:

  def __init__(self, workdir: str, *, tensorboard: bool = True,
               resume_step: Optional[int] = None, final_step: Optional[int] = None,
               wandb_project: str = "", wandb_config: Optional[Mapping[str, object]] = None):
    """resume_step: the iteration a run resumes from. Rows of later iterations (and the final
    evaluation when it resumes at `final_step`) are dropped from metrics.jsonl and purged from
    TensorBoard, since the resumed run writes them again: each step is logged once. None: a
    fresh run, whose metrics.jsonl starts empty. wandb_project: also log to this W&B project,
    one run per workdir (resumed with it); WANDB_MODE=offline keeps it on disk."""
    self.enabled = jax.process_index() == 0
    self._tb = self._wandb = None
    if not self.enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "metrics.jsonl")
    keep = []
    if resume_step is not None and os.path.exists(path):
      for row in read_jsonl(path):
        rerun_final = resume_step == final_step and row["step"] == resume_step and any(
            k.startswith("eval/") for k in row)
        if row["step"] <= resume_step and not rerun_final:
          keep.append(row)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      f.writelines(json.dumps(row) + "\n" for row in keep)
    os.replace(tmp, path)
    self._jsonl = open(path, "a", encoding="utf-8")
    if tensorboard:
      from tensorboardX import SummaryWriter  # pure-Python event writer, no TensorFlow
      # purge_step: events of the re-run steps in earlier files are hidden by TensorBoard.
      purge = None if resume_step is None else resume_step + 1
      self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"), purge_step=purge)
    if wandb_project:
      self._wandb = _wandb_run(workdir, wandb_project, wandb_config)

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
    if self._wandb is not None:
      self._wandb.log({k: v for k, v in row.items() if k != "step" and v is not None},
                      step=int(step))

  def close(self):
    if self.enabled:
      self._jsonl.close()
      if self._tb is not None:
        self._tb.close()
      if self._wandb is not None:
        self._wandb.finish()


def read_jsonl(path: str) -> list[dict]:
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def _wandb_run(workdir: str, project: str, config):
  """A W&B run whose id is derived from the workdir, so a resumed run continues the same one."""
  try:
    import wandb  # optional: only a run that names a project needs it
  except ImportError:
    raise ImportError("config.train.wandb_project is set but wandb is not installed: "
                      "pip install wandb (or set --config.train.wandb_project='')") from None
  run_id = "rloo-" + hashlib.sha1(os.path.abspath(workdir).encode()).hexdigest()[:16]
  return wandb.init(project=project, id=run_id, resume="allow", dir=workdir,
                    name=os.path.basename(os.path.abspath(workdir)),
                    config=dict(config or {}))

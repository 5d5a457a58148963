"""Example reward functions that read extra JSONL fields (copy this file and edit it).

The protocol: `fn(prompts, completions, **fields) -> one float per completion`, NaN (or None)
where a sample cannot be scored (it is masked out of the baselines rather than counted as a
failure). `fields` holds every field of the JSONL records besides `prompt` (`answer`, and here
`keyword` and `target_length`), one entry per completion: each prompt's values repeated for its
k samples. Take the fields you use as keyword arguments and let `**fields` absorb the rest, so
the same function works on files with more fields.

Name a function in a config by file path: `c.rewards.fns = ["path/to/my_reward.py:contains_keyword"]`.
It runs on the host, in Python, on every rollout: keep it cheap, or vectorise it with numpy.
"""

import math

import numpy as np


def contains_keyword(prompts, completions, *, keyword=None, **fields):
  """1.0 where the completion contains the record's `keyword` (case-insensitive), else 0.0;
  NaN where the record has no keyword (a missing string field reads as '')."""
  del prompts, fields
  if keyword is None:  # the file has no `keyword` field at all: nothing can be scored
    return [None] * len(completions)
  out = []
  for completion, word in zip(completions, keyword):
    out.append(math.nan if not word else float(str(word).lower() in completion.lower()))
  return np.asarray(out, np.float32)


def near_target_length(prompts, completions, *, target_length=None, **fields):
  """1 - |len(completion) - target_length| / target_length, floored at 0: 1.0 for a completion
  of exactly `target_length` characters. NaN where the record has none (a missing number reads
  as NaN) or it is not positive."""
  del prompts, fields
  if target_length is None:
    return [None] * len(completions)
  target = np.asarray(target_length, np.float64)
  lengths = np.asarray([len(c) for c in completions], np.float64)
  with np.errstate(invalid="ignore", divide="ignore"):
    score = np.maximum(0.0, 1.0 - np.abs(lengths - target) / target)
  return np.where(target > 0, score, np.nan).astype(np.float32)

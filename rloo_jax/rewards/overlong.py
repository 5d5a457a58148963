"""DAPO's overlong reward shaping (Yu et al., 2025): completions near the length cap lose reward,
so a truncated answer is not rewarded like a finished one.

With the cap L (config.rloo.max_new_tokens) and a buffer B (config.rewards.overlong_buffer), a
completion of |y| tokens gets 0 below L - B, then (L - B - |y|) / B, down to -1 at the cap (where
every truncated completion stands), times config.rewards.overlong_penalty.
"""

from __future__ import annotations

import numpy as np


def check_config(config) -> None:
  """The buffer counts back from the cap, so it cannot be longer."""
  buffer, cap = config.rewards.get("overlong_buffer", 0), config.rloo.max_new_tokens
  if buffer > cap:
    raise ValueError(f"config.rewards.overlong_buffer={buffer} is longer than the cap it counts "
                     f"back from (rloo.max_new_tokens={cap})")


def penalty(lengths, max_len: int, buffer: int) -> np.ndarray:
  """float32 shaping term of each completion length (0 where buffer is 0)."""
  lengths = np.asarray(lengths, np.float32)
  if not buffer:
    return np.zeros(lengths.shape, np.float32)
  return np.clip((max_len - buffer - lengths) / buffer, -1.0, 0.0).astype(np.float32)

"""Reward noise for robustness ablations: add `sigma * N(0, 1)` to any reward by listing
`rloo_jax.rewards.noise:standard_normal` in `config.rewards.fns` with weight `sigma`.

The noise is a deterministic function of (prompt, completion, call count), so a rerun of the same
seed sees the same noise, and two samples of the same text in one batch see independent noise.
"""
from __future__ import annotations

import hashlib
from typing import Any, Sequence

import numpy as np

_calls = [0]


def standard_normal(prompts: Sequence[str], completions: Sequence[str],
                    **fields: Any) -> np.ndarray:
  del fields
  _calls[0] += 1
  digest = hashlib.sha256(f"{_calls[0]}|{len(completions)}|{prompts[:1]}".encode()).digest()
  rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
  return rng.standard_normal(len(completions)).astype(np.float32)

"""The weighted sum of reward functions a run optimises, scored on the host.

Each function follows the reward protocol `fn(prompts, completions, **fields) -> float [N]`, NaN
(or None) meaning unscorable. A function with weight 0 is monitored only: its scores are reported
per function (`reward/<name>` in the metrics, `greedy_reward/<name>` in evaluations) but take no
part in the total, so an unscorable sample there masks nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from rloo_jax.rewards import registry


def reward_name(spec) -> str:
  """A short metric name: 'pkg.mod:fn' -> 'fn', 'a/b.py:fn' -> 'fn',
  'reward_model:/runs/rm' -> 'reward_model', 'hf_reward_model:org/rm' -> 'hf_reward_model',
  a callable -> its __name__."""
  if not isinstance(spec, str):
    return getattr(spec, "__name__", "fn")
  if spec.startswith(registry.HF_REWARD_MODEL_PREFIX):
    return "hf_reward_model"
  if spec.startswith(registry.REWARD_MODEL_PREFIX):
    return "reward_model"
  return spec.rsplit(":", 1)[-1]


@dataclasses.dataclass
class RewardSet:
  fns: Sequence[Callable[..., Any]]
  weights: Sequence[float]
  names: Sequence[str]

  def __post_init__(self):
    if not self.fns:
      raise ValueError("config.rewards.fns is empty: name at least one reward function "
                       "('package.module:function' or 'path/to/file.py:function')")
    if len(self.fns) != len(self.weights) or len(self.fns) != len(self.names):
      raise ValueError(f"config.rewards.fns has {len(self.fns)} entries but "
                       f"config.rewards.weights has {len(self.weights)}; give one weight per "
                       "reward function")
    if len(set(self.names)) != len(self.names):
      raise ValueError(f"reward functions {list(self.names)} share a name; the per-function "
                       "metrics need distinct names")

  @classmethod
  def from_config(cls, c, layout=None) -> "RewardSet":
    """From config.rewards: `fns` (import paths, file paths or callables) and `weights`;
    `layout` (the experiment's sharding.Layout) is where Hugging Face reward models are put."""
    if len(c.fns) != len(c.weights):
      raise ValueError(f"config.rewards.fns has {len(c.fns)} entries but config.rewards.weights "
                       f"has {len(c.weights)}; give one weight per reward function")
    return cls([registry.resolve(f, layout) for f in c.fns], [float(w) for w in c.weights],
               [reward_name(f) for f in c.fns])

  @property
  def first(self) -> str:
    """The name of the first function: the task's own reward, which judges win rates."""
    return self.names[0]

  def __call__(self, prompts: Sequence[str], completions: Sequence[str],
               fields: Mapping[str, Any]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The weighted sum [N] (float64) and each function's own scores {name: [N]}; NaN in any
    function of nonzero weight makes the sum NaN (unscorable)."""
    total = np.zeros(len(completions), np.float64)
    parts = {}
    for fn, w, name in zip(self.fns, self.weights, self.names):
      raw = fn(list(prompts), list(completions), **fields)
      # None reads as NaN; a scalar (or None) return keeps its shape () for the error below.
      r = np.array([np.nan if x is None else x for x in raw], np.float64) \
          if np.ndim(raw) == 1 else np.asarray(np.nan if raw is None else raw, np.float64)
      if r.shape != (len(completions),):
        raise ValueError(f"reward function {name} returned shape {r.shape}; expected "
                         f"({len(completions)},): one score per completion")
      parts[name] = r
      if w:
        total = total + w * r
    return total, parts

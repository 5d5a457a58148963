"""The weighted sum of reward functions a run optimises, scored on the host.

Each function follows the reward protocol `fn(prompts, completions, **fields) -> float [N]`, NaN
(or None) meaning unscorable. A function with weight 0 is monitored only: its scores are reported
per function (`reward/<name>` in the metrics, `greedy_reward/<name>` in evaluations) but take no
part in the total, so an unscorable sample there masks nothing.

Each call runs under `timeout_s` (config.rewards.timeout_s; 0 = none), and what comes back must be
numbers: a string, an object or +-inf is an error naming the function, never a silent score.
"""

from __future__ import annotations

import dataclasses
import numbers
import threading
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from rloo_jax.rewards import registry


def reward_name(spec) -> str:
  """A short metric name: 'pkg.mod:fn' -> 'fn', 'a/b.py:fn?x=1' -> 'fn',
  'reward_model:/runs/rm' -> 'reward_model', 'hf_reward_model:org/rm' -> 'hf_reward_model',
  a callable -> its __name__."""
  if not isinstance(spec, str):
    return getattr(spec, "__name__", "fn")
  if spec.startswith(registry.HF_REWARD_MODEL_PREFIX):
    return "hf_reward_model"
  if spec.startswith(registry.REWARD_MODEL_PREFIX):
    return "reward_model"
  return spec.partition("?")[0].rsplit(":", 1)[-1]


DEFAULT_TIMEOUT_S = 600.0


class RewardTimeoutError(TimeoutError):
  """A reward function did not return within config.rewards.timeout_s."""


class RewardFunctionError(RuntimeError):
  """A reward function raised: the user's code, named, with its error on one line."""


class RewardReturnError(TypeError):
  """A reward function returned something that is not one finite score (or NaN) a completion."""


def call_with_deadline(fn, args, kw, timeout_s: float, name: str, what: str):
  """fn(*args, **kw), raising RewardTimeoutError after `timeout_s` seconds (0: no deadline).
  The call runs on a daemon thread: a Python thread cannot be killed, so a hung function is left
  behind and the run stops (the loop saves nothing after it)."""
  if not timeout_s:
    return fn(*args, **kw)
  out = {}

  def target():
    try:
      out["value"] = fn(*args, **kw)
    except BaseException as e:  # pylint: disable=broad-except
      out["error"] = e
  thread = threading.Thread(target=target, name=f"reward:{name}", daemon=True)
  thread.start()
  thread.join(timeout_s)
  if thread.is_alive():
    raise RewardTimeoutError(
        f"reward function {name} did not return within config.rewards.timeout_s={timeout_s:g} s "
        f"({what}); make it faster, raise --config.rewards.timeout_s, or set it to 0 for no "
        "deadline")
  if "error" in out:
    raise out["error"]
  return out["value"]


def as_scores(raw, name: str, n: int) -> np.ndarray:
  """`raw` (a reward function's return) as float64 [n]: None and NaN are NaN (cannot score);
  anything else not a real number, a wrong length or +-inf is an error naming the function."""
  if not isinstance(raw, (list, tuple, str, bytes)) and hasattr(raw, "__array__"):
    raw = np.asarray(raw)  # a jax array: numpy scalars, not device arrays, per completion
  items = list(raw) if np.ndim(raw) == 1 and not isinstance(raw, (str, bytes)) else None
  if items is None or len(items) != n:
    shape = np.shape(raw) if not isinstance(raw, (str, bytes)) else "a string"
    raise ValueError(f"reward function {name} returned shape {shape}; expected ({n},): one "
                     "score per completion")
  for i, x in enumerate(items):
    numeric = isinstance(x, numbers.Real) or (isinstance(x, np.generic)
                                               and np.dtype(type(x)).kind not in "OSUV")
    # bfloat16 (ml_dtypes) scalars are numbers too: a reward model's scores may be bf16.
    numeric = numeric or type(x).__module__.startswith("ml_dtypes")
    if x is not None and not numeric:
      raise RewardReturnError(f"reward function {name} returned {x!r} ({type(x).__name__}) for "
                              f"completion {i}; return a float per completion (NaN or None: "
                              "cannot score)")
  r = np.array([np.nan if x is None else x for x in items], np.float64)
  if np.isinf(r).any():
    i = int(np.flatnonzero(np.isinf(r))[0])
    raise RewardReturnError(f"reward function {name} returned {r[i]} for completion {i}; "
                            "return a finite score, or NaN for one it cannot score")
  return r


@dataclasses.dataclass
class RewardSet:
  fns: Sequence[Callable[..., Any]]
  weights: Sequence[float]
  names: Sequence[str]
  timeout_s: float = DEFAULT_TIMEOUT_S  # config.rewards.timeout_s; 0 = no deadline

  def __post_init__(self):
    if not self.fns:
      raise ValueError("config.rewards.fns is empty: name at least one reward function "
                       "('package.module:function' or 'path/to/file.py:function')")
    if len(self.fns) != len(self.weights) or len(self.fns) != len(self.names):
      raise ValueError(f"config.rewards.fns has {len(self.fns)} entries but "
                       f"config.rewards.weights has {len(self.weights)}; give one weight per "
                       "reward function")
    if not self.timeout_s >= 0:
      raise ValueError(f"config.rewards.timeout_s = {self.timeout_s} must be >= 0 (0: no "
                       "deadline); set --config.rewards.timeout_s=600")
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
               [reward_name(f) for f in c.fns], float(c.get("timeout_s", DEFAULT_TIMEOUT_S)))

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
    n = len(completions)
    for fn, w, name in zip(self.fns, self.weights, self.names):
      try:
        raw = call_with_deadline(fn, (list(prompts), list(completions)), dict(fields),
                                 self.timeout_s, name, f"scoring a batch of {n} completions")
      except RewardTimeoutError:
        raise
      except Exception as e:  # pylint: disable=broad-except
        raise RewardFunctionError(f"reward function {name} raised {type(e).__name__}: {e} "
                                  f"(scoring a batch of {n} completions)") from e
      r = parts[name] = as_scores(raw, name, n)
      if w:
        total = total + w * r
    return total, parts

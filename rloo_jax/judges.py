"""Pairwise judges: `judge(prompts, a, b, **fields) -> float [N]`, P(a is better than b).

The protocol (what the RLOO paper's GPT-4 judge computes, and what `rloo_jax.winrate` calls):

    def judge(prompts: list[str], a: list[str], b: list[str], **fields) -> array-like [N]
        # P(completion a[i] is better than b[i] as a reply to prompts[i]), in [0, 1];
        # NaN (or None) where the pair cannot be judged (left out of win rates and counted).

`fields` are the records' other fields (`answer`, `chosen`, ...), one entry per pair, as reward
functions get them. `resolve_judge(spec)` builds one (the `--judge` flag of `rloo_jax.winrate`):

    reward:<reward spec>         Bradley-Terry on a reward function (any `rewards.resolve` spec):
                                 P = sigmoid(r(prompt, a) - r(prompt, b)), NaN if either is NaN.
    package.module:function      a judge callable itself (e.g. an LLM judge you write), imported;
    path/to/file.py:function     or loaded from that file.
    a Python callable            used as the judge as it is.

    resolve_judge("reward:reward_model:/tmp/rlhf/reward_model")
    resolve_judge("reward:rloo_jax.rewards.summarize_gold:gold_reward")
    resolve_judge("my_judges.py:gpt4_judge")

The Bradley-Terry probability depends on the reward's scale (a reward model's `whiten` option
changes it); wins, ties and losses depend only on the sign of the difference.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

from rloo_jax.rewards import registry
from rloo_jax.rewards.preferences import win_rate_stats
from rloo_jax.rewards.reward_set import RewardSet, reward_name
from rloo_jax.rewards.verifiers import load_reward_fn

REWARD_PREFIX = "reward:"
SYNTAX = ("a judge is 'reward:<reward spec>' (the Bradley-Terry judge of a reward function, e.g. "
          "'reward:reward_model:/path/to/rm' or 'reward:package.module:function'), or "
          "'package.module:function' / 'path/to/file.py:function' naming a "
          "judge(prompts, a, b, **fields) -> P(a better than b)")


def sigmoid(x) -> np.ndarray:
  """float64 logistic; clipped so that no exp overflows (sigmoid(+-60) is 1 or ~1e-26)."""
  x = np.clip(np.asarray(x, np.float64), -60.0, 60.0)
  return 1.0 / (1.0 + np.exp(-x))


class RewardJudge:
  """P(a > b) = sigmoid(r(prompt, a) - r(prompt, b)) for a reward function r (Bradley-Terry).

  Both sides are scored in one call of r, so a reward model fills its batches; NaN where either
  score is NaN. Identical completions score exactly 0.5 (sigmoid(0))."""

  def __init__(self, reward_fn: Callable[..., Any], name: str = "reward"):
    self.reward_fn = reward_fn
    self.name = name
    self.__name__ = f"bradley_terry({name})"

  def __repr__(self) -> str:
    return f"RewardJudge({self.name})"

  def __call__(self, prompts: Sequence[str], a: Sequence[str], b: Sequence[str],
               **fields: Any) -> np.ndarray:
    n = len(a)
    both = {k: np.concatenate([np.asarray(v), np.asarray(v)]) for k, v in fields.items()}
    # RewardSet reads None as NaN and checks one score per completion, as a rollout's scoring does.
    scores = RewardSet([self.reward_fn], [1.0], [self.name])(
        list(prompts) * 2, list(a) + list(b), both)[1][self.name]
    ra, rb = scores[:n], scores[n:]
    ok = np.isfinite(ra) & np.isfinite(rb)
    return np.where(ok, sigmoid(np.where(ok, ra - rb, 0.0)), np.nan)


def _reason(e: Exception, spec: str) -> str:
  """The loader's message without its 'reward function <spec>: ' lead (the spec is a judge's)."""
  lead = f"reward function {spec!r}: "
  msg = str(e)
  return msg[len(lead):] if msg.startswith(lead) else msg


def _check_signature(fn, spec) -> None:
  """A judge must take **fields: refuse one that does not before any text is generated."""
  try:
    params = inspect.signature(fn).parameters.values()
  except (TypeError, ValueError):  # a builtin or C callable: nothing to check
    return
  if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
    raise ValueError(f"judge {spec!r} does not take **fields: define it as "
                     "judge(prompts, a, b, **fields) (the records' data fields arrive as keyword "
                     "arguments, as for reward functions)")


def resolve_judge(spec) -> Callable[..., Any]:
  """A judge callable from a spec (see the module docstring). Errors name the accepted syntax."""
  if callable(spec):
    _check_signature(spec, getattr(spec, "__name__", spec))
    return spec
  if not isinstance(spec, str) or not spec.strip():
    raise ValueError(f"judge {spec!r}: expected a string or a callable; {SYNTAX}")
  if spec.startswith(REWARD_PREFIX):
    reward_spec = spec[len(REWARD_PREFIX):]
    if not reward_spec:
      raise ValueError(f"judge {spec!r}: no reward function after 'reward:'; {SYNTAX}")
    try:
      fn = registry.resolve(reward_spec)
    except (ValueError, TypeError) as e:
      raise ValueError(f"judge {spec!r}: reward function {reward_spec!r}: "
                       f"{_reason(e, reward_spec)}") from None
    return RewardJudge(fn, reward_name(reward_spec))
  if spec.startswith(registry.REWARD_MODEL_PREFIX):
    raise ValueError(f"judge {spec!r} names a reward model, which scores one completion, not a "
                     f"pair: use 'reward:{spec}' for its Bradley-Terry judge")
  try:
    fn = load_reward_fn(spec)
  except (ValueError, TypeError) as e:
    raise ValueError(f"judge {spec!r}: {_reason(e, spec)}; {SYNTAX}") from None
  _check_signature(fn, spec)
  return fn


def judge_name(spec) -> str:
  if isinstance(spec, str):
    return spec
  return getattr(spec, "__name__", type(spec).__name__)


def judge_pairs(judge: Callable[..., Any], prompts: Sequence[str], a: Sequence[str],
                b: Sequence[str], fields: Optional[Mapping[str, Any]] = None) -> np.ndarray:
  """float64 [N] P(a[i] better than b[i]) from `judge`, None read as NaN, checked: one value per
  pair, finite values in [0, 1] (a judge returning raw scores is refused, not averaged)."""
  n = len(prompts)
  if len(a) != n or len(b) != n:
    raise ValueError(f"judge_pairs needs one a and one b per prompt: {n} prompts, {len(a)} a, "
                     f"{len(b)} b")
  if not n:
    return np.zeros((0,), np.float64)
  raw = judge(list(prompts), list(a), list(b), **dict(fields or {}))
  p = np.array([np.nan if x is None else x for x in raw], np.float64) \
      if np.ndim(raw) == 1 else np.asarray(np.nan if raw is None else raw, np.float64)
  name = judge_name(judge)
  if p.shape != (n,):
    raise ValueError(f"judge {name} returned shape {p.shape}; expected ({n},): one P(a better "
                     "than b) per pair")
  finite = p[np.isfinite(p)]
  if finite.size and (finite.min() < 0.0 or finite.max() > 1.0):
    raise ValueError(f"judge {name} returned values outside [0, 1] (min {finite.min():.4g}, max "
                     f"{finite.max():.4g}): a judge returns P(a better than b); to judge by a "
                     "reward function's scores, use 'reward:<reward spec>'")
  # +-inf is no probability either: read as 'cannot judge' along with NaN.
  return np.where(np.isfinite(p), p, np.nan)


def preference_stats(p) -> dict:
  """Win rate of side a from per-pair P(a better than b): P > 0.5 a win, P == 0.5 a tie (half),
  NaN left out and counted (`n_unjudged`); `mean_p` is the mean P over judged pairs."""
  p = np.asarray(p, np.float64)
  # Against a constant 0.5, win_rate_stats counts exactly these wins, ties and losses.
  stats = win_rate_stats(p, np.full(p.shape, 0.5))
  judged = p[np.isfinite(p)]
  stats.update(n_unjudged=int(p.size - judged.size),
               mean_p=float(judged.mean()) if judged.size else float("nan"))
  return stats

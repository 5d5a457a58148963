"""Reward functions `fn(prompts, completions, **fields) -> float array [N]` (NaN = unscorable).

`resolve(spec)` turns a config entry into such a callable: a callable passes through, a
'package.module:function' string is imported, 'path/to/file.py:function' is loaded from that
file (once per path), and 'reward_model:<dir>' loads a trained reward model
(`rloo_jax.rewards.scorer`) as a jit-compiled scorer. Options follow the directory as a query
string, overriding what was saved with it:

    reward_model:/tmp/rlhf/reward_model
    reward_model:/tmp/rlhf/reward_model?whiten=false&clip=3&batch_size=128
"""

from __future__ import annotations

import os

from rloo_jax.rewards import scorer
from rloo_jax.rewards.verifiers import load_reward_fn

REWARD_MODEL_PREFIX = "reward_model:"
_RM_OPTIONS = {"whiten": bool, "clip": float, "batch_size": int}
_scorers: dict = {}


def _parse_reward_model_spec(spec: str):
  path, _, query = spec[len(REWARD_MODEL_PREFIX):].partition("?")
  if not path:
    raise ValueError(f"reward function {spec!r}: expected 'reward_model:<directory>'")
  options = {}
  for item in filter(None, query.split("&")):
    name, eq, value = item.partition("=")
    if name not in _RM_OPTIONS or not eq:
      raise ValueError(f"reward function {spec!r}: unknown or valueless option {item!r}; "
                       f"options are {sorted(_RM_OPTIONS)} as '?name=value&...'")
    kind = _RM_OPTIONS[name]
    try:
      options[name] = value.lower() in ("1", "true", "yes") if kind is bool else kind(value)
    except ValueError:
      raise ValueError(f"reward function {spec!r}: option {name}={value!r} is not a "
                       f"{kind.__name__}") from None
  return os.path.abspath(os.path.expanduser(path)), options


def load_reward_model(spec: str):
  """The scorer of a 'reward_model:<dir>[?options]' spec, loaded once per directory state.

  Cached because `trainer.build` resolves rewards on every (re)build; the key includes the newest
  checkpoint's modification time, so a retrained model in the same directory is picked up.
  """
  path, options = _parse_reward_model_spec(spec)
  scorer.read_meta(path)  # clear FileNotFound / format errors before any restore
  ckdir = os.path.join(path, "checkpoints")
  newest = max((int(s) for s in os.listdir(ckdir) if s.isdigit()))
  key = (path, tuple(sorted(options.items())), newest,
         os.stat(os.path.join(ckdir, str(newest))).st_mtime_ns)
  if key not in _scorers:
    _scorers[key] = scorer.RewardModelScorer.load(path, **options)
  return _scorers[key]


def resolve(spec):
  """A reward callable from a config entry: a callable, 'package.module:function', or
  'reward_model:<dir>[?whiten=..&clip=..&batch_size=..]'."""
  if callable(spec):
    return spec
  if isinstance(spec, str) and spec.startswith(REWARD_MODEL_PREFIX):
    return load_reward_model(spec)
  return load_reward_fn(spec)

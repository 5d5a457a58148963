"""Reward functions `fn(prompts, completions, **fields) -> float array [N]` (NaN = unscorable).

`resolve(spec)` turns a config entry into such a callable: a callable passes through, a
'package.module:function' string is imported, 'path/to/file.py:function' is loaded from that
file (once per path), 'reward_model:<dir>' loads a trained reward model
(`rloo_jax.rewards.scorer`) as a jit-compiled scorer, and 'hf_reward_model:<dir or hub id>' a
Hugging Face *ForSequenceClassification checkpoint sharded over the mesh
(`rloo_jax.rewards.hf_reward`). Options follow as a query string, overriding what was saved; a
function's are its parameters that have a bool, int, float or str default, typed by it:

    reward_model:/tmp/rlhf/reward_model
    reward_model:/tmp/rlhf/reward_model?whiten=false&clip=3&batch_size=128
    hf_reward_model:/ckpt/rm_hf?dtype=bfloat16&batch_size=64&max_len=1024
    rloo_jax.rewards.math_answer:math_answer?timeout_s=10&workers=16
"""

from __future__ import annotations

import difflib
import functools
import inspect
import os

from rloo_jax.rewards import hf_reward
from rloo_jax.rewards import scorer
from rloo_jax.rewards.verifiers import load_reward_fn

REWARD_MODEL_PREFIX = "reward_model:"
HF_REWARD_MODEL_PREFIX = "hf_reward_model:"
_RM_OPTIONS = {"whiten": bool, "clip": float, "batch_size": int}
_scorers: dict = {}


def _parse_spec(spec: str, prefix: str, kinds: dict, what: str, require_path: bool = True):
  """(path, {option: typed value}) of '<prefix><path>?name=value&...'; errors name the option.
  require_path=False: a spec naming no checkpoint yet gives path ''."""
  path, _, query = spec[len(prefix):].partition("?")
  if not path and require_path:
    hint = (" (configs/tldr.py and configs/hh.py take the reward model as their rm= argument: "
            "--config=configs/tldr.py:model=<sft>,rm=<reward model>)"
            if prefix == HF_REWARD_MODEL_PREFIX else "")
    raise ValueError(f"reward function {spec!r}: expected '{prefix}<{what}>'{hint}")
  options = {}
  for item in filter(None, query.split("&")):
    name, eq, value = item.partition("=")
    if name not in kinds or not eq:
      near = difflib.get_close_matches(name, kinds, n=1)
      raise ValueError(f"reward function {spec!r}: unknown or valueless option {item!r}; "
                       f"options are {sorted(kinds)} as '?name=value&...'"
                       + (f"; did you mean {near[0]}?" if near and name != near[0] else ""))
    kind = kinds[name]
    if kind is bool and value.lower() not in ("1", "true", "yes", "0", "false", "no"):
      raise ValueError(f"reward function {spec!r}: option {name}={value!r} is not a bool "
                       "(true / false)")
    try:
      options[name] = value.lower() in ("1", "true", "yes") if kind is bool else kind(value)
    except ValueError:
      raise ValueError(f"reward function {spec!r}: option {name}={value!r} is not a "
                       f"{kind.__name__}") from None
  return os.path.expanduser(path), options


def _parse_reward_model_spec(spec: str):
  path, options = _parse_spec(spec, REWARD_MODEL_PREFIX, _RM_OPTIONS, "directory")
  return os.path.abspath(path), options


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


def parse_hf_reward_model_spec(spec: str, require_path: bool = True):
  """(path, typed options) of a 'hf_reward_model:<dir or hub id>[?options]' spec; with
  require_path=False a spec with no checkpoint yet (a plan at a preset) gives path ''."""
  return _parse_spec(spec, HF_REWARD_MODEL_PREFIX, hf_reward.OPTIONS, "directory or hub id",
                     require_path)


def load_hf_reward_model(spec: str, layout=None):
  """The scorer of a 'hf_reward_model:<dir or hub id>[?options]' spec on `layout` (the
  experiment's; None: `hf_reward.default_layout()`), loaded once per (checkpoint state, options,
  layout): a config is validated and then built, and an 8B model should be read once."""
  path, options = parse_hf_reward_model_spec(spec)
  layout = layout or hf_reward.default_layout()
  config_json = os.path.join(path, "config.json")
  stamp = os.stat(config_json).st_mtime_ns if os.path.isfile(config_json) else None
  key = (os.path.abspath(path) if os.path.isdir(path) else path,
         tuple(sorted(options.items())), stamp, layout)
  if key not in _scorers:
    _scorers[key] = hf_reward.load(path, layout=layout, **options)
  return _scorers[key]


def resolve(spec, layout=None):
  """A reward callable from a config entry: a callable, 'package.module:function',
  'reward_model:<dir>[?whiten=..&clip=..&batch_size=..]' or 'hf_reward_model:<dir or hub
  id>[?options]' (sharded over `layout`, a `sharding.Layout`, when given)."""
  if callable(spec):
    return spec
  if isinstance(spec, str) and spec.startswith(HF_REWARD_MODEL_PREFIX):
    return load_hf_reward_model(spec, layout)
  if isinstance(spec, str) and spec.startswith(REWARD_MODEL_PREFIX):
    return load_reward_model(spec)
  if isinstance(spec, str) and "?" in spec:
    return _with_options(spec)
  return load_reward_fn(spec)


def _with_options(spec: str):
  """'pkg.module:fn?name=value&...' as fn with those keyword arguments (and its `answer_ids`,
  maj@n's votes, with those it takes)."""
  fn = load_reward_fn(spec.partition("?")[0])
  kinds = {p.name: type(p.default) for p in inspect.signature(fn).parameters.values()
           if type(p.default) in (bool, int, float, str)}
  options = _parse_spec(spec, "", kinds, "function")[1]

  @functools.wraps(fn)
  def bound(prompts, completions, **fields):
    clash = sorted(set(fields) & set(options))
    if clash:  # a partial would let the field win, silently, on every call
      raise ValueError(f"reward {spec}: the records' field(s) {clash} have the name of an "
                       f"option the spec sets; rename the field(s) or drop the option")
    return fn(prompts, completions, **options, **fields)

  votes = getattr(fn, "answer_ids", None)
  if votes is not None:
    takes = inspect.signature(votes).parameters
    bound.answer_ids = functools.partial(votes, **{k: v for k, v in options.items() if k in takes})
  return bound

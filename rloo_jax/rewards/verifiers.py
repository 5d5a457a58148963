"""Programmatic rewards: `fn(prompts, completions, **fields) -> float32 [N]`, NaN = unscorable.

  arithmetic_exact_match   the arithmetic task's exact answer
  gsm8k, gsm8k_format      GSM8K final-number match and answer format (rloo_jax.rewards.gsm8k)

Competition math (a \\boxed{} answer equal to the reference as mathematics) is
`rloo_jax.rewards.math_answer:math_answer`, in a module of its own: it needs the [math] extra.

Fields arrive aligned with the completions (one entry per sample); a function ignores the ones it
does not use, which is why every reward takes `**fields`.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from typing import Any, Callable, Sequence

import numpy as np

from rloo_jax.rewards import answers
# Re-exported so that a reward spec names every verifier by one module:
# 'rloo_jax.rewards.verifiers:gsm8k'. (gsm8k.py imports nothing from here: no cycle.)
from rloo_jax.rewards.gsm8k import gsm8k  # pylint: disable=unused-import
from rloo_jax.rewards.gsm8k import gsm8k_format  # pylint: disable=unused-import


def arithmetic_exact_match(prompts: Sequence[str], completions: Sequence[str], *,
                           answer: Sequence[str | None] | None = None, stop: str | None = None,
                           **fields: Any) -> np.ndarray:
  """1.0 where the completion, cut at `stop` (an eos string, for tokenizers that decode it) and
  stripped of surrounding whitespace, equals the answer exactly; 0.0 otherwise.

  Samples whose answer is missing or '' get NaN: the trainer masks them out of the baselines
  instead of counting them as failures.
  """
  del fields
  return answers.against_answers(prompts, completions, answer, stop,
                                 lambda c, a: float(c.strip() == a.strip()))


def _load_file(spec: str, path: str):
  """The module of a reward file, loaded once per absolute path (its state is shared by every
  resolve of it, as an imported module's is)."""
  path = os.path.abspath(os.path.expanduser(path))
  if not os.path.isfile(path):
    raise ValueError(f"reward function {spec!r}: no file {path}")
  name = "rloo_jax_reward_file_" + hashlib.sha1(path.encode()).hexdigest()[:12]
  if name not in sys.modules:
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
      module_spec.loader.exec_module(module)
    except BaseException:
      del sys.modules[name]
      raise
  return sys.modules[name]


def load_reward_fn(spec: str) -> Callable[..., Any]:
  """Resolves `'package.module:function'` or `'path/to/file.py:function'` (the attribute may be
  dotted: `module:Class.method`)."""
  if not isinstance(spec, str) or spec.count(":") != 1:
    raise ValueError(f"reward function {spec!r}: expected 'package.module:function' or "
                     "'path/to/file.py:function'")
  module_name, attr_path = spec.split(":")
  if not module_name or not attr_path or any(not p for p in attr_path.split(".")):
    raise ValueError(f"reward function {spec!r}: expected 'package.module:function' with both "
                     "parts non-empty")
  try:
    if module_name.endswith(".py") or os.sep in module_name:
      obj = _load_file(spec, module_name)
    else:
      obj = importlib.import_module(module_name)
  except ModuleNotFoundError as e:
    # Distinguish "the named module does not exist" from "it exists but imports something missing".
    if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
      raise ValueError(f"reward function {spec!r}: module {module_name!r} not found "
                       "(is it installed or on PYTHONPATH?)") from None
    raise ImportError(f"reward function {spec!r}: importing {module_name!r} failed: {e}") from e
  for part in attr_path.split("."):
    if not hasattr(obj, part):
      public = sorted(a for a in dir(obj) if not a.startswith("_"))[:20]
      raise ValueError(f"reward function {spec!r}: {getattr(obj, '__name__', obj)!r} has no "
                       f"attribute {part!r} (public names: {', '.join(public)})")
    obj = getattr(obj, part)
  if not callable(obj):
    raise TypeError(f"reward function {spec!r} resolves to a {type(obj).__name__}, not a callable")
  return obj

"""The embedded default task: multi-digit addition, `{'prompt': '23+458=', 'answer': '481'}`.

Usage (the trainer prepares it under its workdir; later runs reuse the cache):

  builder = arithmetic.prepare(workdir / 'data', min_digits=1, max_digits=3, num_train=20000)
  train = rloo_jax.data.load_split(builder, 'train')       # random access, str fields
  tok = arithmetic.make_tokenizer()
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import tensorflow_datasets as tfds

from rloo_jax.data import builder as builder_lib
from rloo_jax.data.tokenizer import CharTokenizer

# The smallest alphabet that covers prompts and answers: a small softmax is learnt faster by the
# from-scratch SFT policy, and anything outside it is a visible error rather than a silent <unk>.
ARITHMETIC_CHARS = "0123456789+="


def make_tokenizer() -> CharTokenizer:
  return CharTokenizer(ARITHMETIC_CHARS)


def format_prompt(a: int, b: int) -> str:
  return f"{a}+{b}="


def _numbers_with_digits(d: int) -> tuple[int, int]:
  """[lo, hi) of the non-negative integers written with exactly d digits."""
  return (0, 10) if d == 1 else (10 ** (d - 1), 10 ** d)


def num_distinct_problems(min_digits: int, max_digits: int) -> int:
  """Unordered pairs {a, b} with both operands in the digit range (a+b and b+a are one problem)."""
  n = sum(hi - lo for lo, hi in map(_numbers_with_digits, range(min_digits, max_digits + 1)))
  return n * (n + 1) // 2


def _check_space(min_digits: int, max_digits: int, count: int) -> int:
  if not 1 <= min_digits <= max_digits:
    raise ValueError(f"need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
  space = num_distinct_problems(min_digits, max_digits)
  if count > space:
    raise ValueError(f"asked for {count} distinct problems but only {space} exist with "
                     f"{min_digits}..{max_digits} digits; lower num_train/num_test or widen "
                     "the range")
  return space


def generate_problems(min_digits: int, max_digits: int, count: int,
                      seed: int) -> list[tuple[int, int]]:
  """`count` distinct problems, deterministic in `seed`.

  The number of digits of each operand is uniform over the range and the value uniform within it,
  so short and long problems are equally represented (uniform values would be ~all max-length).
  Problems are unique up to commutation, so a held-out split cut from this list never contains a
  training problem, not even with the operands swapped.
  """
  space = _check_space(min_digits, max_digits, count)
  rng = np.random.default_rng(seed)
  ranges = [_numbers_with_digits(d) for d in range(min_digits, max_digits + 1)]
  if count > space // 2:
    # Rejection sampling would crawl near saturation; the space is small here, so enumerate it.
    values = np.concatenate([np.arange(lo, hi) for lo, hi in ranges])
    pairs = [(int(values[i]), int(values[j]))
             for i in range(len(values)) for j in range(i, len(values))]
    order = rng.permutation(len(pairs))[:count]
    return [pairs[i] if rng.random() < 0.5 else pairs[i][::-1] for i in order]
  seen: set[tuple[int, int]] = set()
  out: list[tuple[int, int]] = []
  while len(out) < count:
    n = max(64, 2 * (count - len(out)))
    da = rng.integers(0, len(ranges), n)
    db = rng.integers(0, len(ranges), n)
    lo_a = np.array([ranges[i][0] for i in da]); hi_a = np.array([ranges[i][1] for i in da])
    lo_b = np.array([ranges[i][0] for i in db]); hi_b = np.array([ranges[i][1] for i in db])
    a = rng.integers(lo_a, hi_a)
    b = rng.integers(lo_b, hi_b)
    for x, y in zip(a.tolist(), b.tolist()):
      key = (min(x, y), max(x, y))
      if key in seen:
        continue
      seen.add(key)
      out.append((x, y))
      if len(out) == count:
        break
  return out


@dataclasses.dataclass(eq=False)
class ArithmeticConfig(tfds.core.BuilderConfig):
  min_digits: int = 1
  max_digits: int = 3
  num_train: int = 10000
  num_test: int = 500
  seed: int = 0


class Arithmetic(builder_lib.TextBuilder):
  """Addition problems; `test` holds the first `num_test` distinct problems, `train` the rest."""

  TEXT_FIELDS = ("prompt", "answer")
  DESCRIPTION = "Multi-digit addition with exact answers (rloo_jax embedded task)."

  @classmethod
  def make_config(cls, **options):
    c = builder_lib.builder_config(ArithmeticConfig, **options)
    _check_space(c.min_digits, c.max_digits, c.num_train + c.num_test)  # fail before tfds writes
    return c

  def _split_examples(self, dl_manager):
    c = self.builder_config
    problems = generate_problems(c.min_digits, c.max_digits, c.num_test + c.num_train, c.seed)

    def examples(pairs):
      for a, b in pairs:
        yield {"prompt": format_prompt(a, b), "answer": str(a + b)}

    return {"train": examples(problems[c.num_test:]), "test": examples(problems[:c.num_test])}


def prepare(data_dir: str | os.PathLike, **options) -> Arithmetic:
  """Prepares (or reuses) the arithmetic dataset under `data_dir`; options are
  ArithmeticConfig's."""
  return builder_lib.prepare(Arithmetic, data_dir, **options)

"""Tasks: where prompts come from, how they are tokenised, and what the SFT stage imitates.

A task bundles the train/test prompt sources, the tokenizer and the demonstrations of the SFT stage.
Rewards are not part of a task: they are named in `config.rewards` by import path, so any task
can be trained against any weighted set of reward functions.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Optional, Sequence

import numpy as np

from rloo_jax.data import arithmetic, chat, jsonl, summarize
from rloo_jax.data.builder import load_split
from rloo_jax.data.tokenizer import ByteTokenizer


@dataclasses.dataclass
class Task:
  name: str
  tokenizer: Any
  train: Any  # random-access source of {'prompt', 'answer', ...} records
  test: Any
  # Demonstrations for the SFT stage: a random-access source with 'prompt' and 'answer' fields.
  demonstrations: Optional[Any] = None
  stop: Optional[str] = None  # text after which a completion is cut before scoring


def drop_carries(a: int, b: int) -> str:
  """The answer of a demonstrator that forgets every carry: digit-wise sums mod 10."""
  digits, place = 0, 1
  while a or b:
    digits += ((a % 10 + b % 10) % 10) * place
    a, b, place = a // 10, b // 10, place * 10
  return str(digits)


def noisy_arithmetic_demonstrations(source, error_rate: float, seed: int) -> list[dict]:
  """Demonstrations where a fraction `error_rate` of the carry problems drop their carries."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(len(source)):
    record = dict(source[i])
    a, b = (int(x) for x in record["prompt"].rstrip("=").split("+"))
    wrong = drop_carries(a, b)
    if wrong != record["answer"] and rng.random() < error_rate:
      record["answer"] = wrong
    out.append(record)
  return out


def _arithmetic(config, data_dir: str) -> Task:
  d = config.data
  builder = arithmetic.prepare(data_dir, min_digits=d.min_digits, max_digits=d.max_digits,
                               num_train=d.num_train, num_test=d.num_test, seed=d.data_seed)
  train, test = load_split(builder, "train"), load_split(builder, "test")
  demos = noisy_arithmetic_demonstrations(train, config.sft.demo_error_rate, config.seed)
  return Task("arithmetic", arithmetic.make_tokenizer(), train, test, demonstrations=demos)


def _jsonl(config, data_dir: str) -> Task:
  """Your own prompts (docs/YOUR_TASK.md). With config.model.init_from, the checkpoint's
  tokenizer; without, a byte-level tokenizer (any UTF-8 text, no vocabulary to build or ship)
  and the same pipeline as arithmetic: SFT from scratch on the training records' answers, then RL."""
  del data_dir
  d = config.data
  for key in ("jsonl_train", "jsonl_test"):
    if not d[key]:
      raise ValueError(f"task=jsonl needs config.data.{key}: a JSONL file of "
                       "{\"prompt\": ..., \"answer\": ...} lines")
    if not os.path.exists(d[key]):
      raise FileNotFoundError(f"config.data.{key}={d[key]!r} does not exist")
  train = jsonl.JsonlSource(d.jsonl_train)
  test = jsonl.JsonlSource(d.jsonl_test)
  # Only records with an answer can be imitated; the rest are still RL prompts (their rewards
  # need no answer), so a file may mix both.
  demos = [r for r in (train[i] for i in range(len(train))) if r["answer"]]
  if config.model.init_from:
    from rloo_jax.models import hf  # the HF tokenizer is only needed with a checkpoint
    return Task("jsonl", hf.load_tokenizer(config.model.init_from), train, test,
                demonstrations=demos or None)
  if not demos:
    raise ValueError(f"task=jsonl without config.model.init_from trains its policy from scratch "
                     f"by SFT on the training records' answers, but no record of "
                     f"{d.jsonl_train} has a non-empty 'answer'; add answers to some records "
                     "or set config.model.init_from to a local Hugging Face checkpoint directory")
  return Task("jsonl", ByteTokenizer(), train, test, demonstrations=demos)


def _summarize(config, data_dir: str) -> Task:
  """TL;DR in miniature: the SFT stage imitates the dataset's imperfect summaries (`answer`), so
  the starting policy sits well below the gold optimum and a learned reward has room to help."""
  d = config.data
  builder = summarize.prepare(data_dir, num_train=d.num_train, num_test=d.num_test,
                              min_keys=d.get("min_keys", 1), max_keys=d.get("max_keys", 3),
                              seed=d.data_seed)
  train, test = load_split(builder, "train"), load_split(builder, "test")
  return Task("summarize", summarize.make_tokenizer(), train, test, demonstrations=train)


_TASKS: dict[str, Callable[[Any, str], Task]] = {
    "arithmetic": _arithmetic,
    "jsonl": _jsonl,
    "summarize": _summarize,
}


# The tokenizer of each task without its data (the memory planner's vocabulary size).
_TOKENIZERS: dict[str, Callable[[Any], Any]] = {
    "arithmetic": lambda config: arithmetic.make_tokenizer(),
    "summarize": lambda config: summarize.make_tokenizer(),
    # With init_from the checkpoint's config.json sizes the model; its tokenizer is not needed.
    "jsonl": lambda config: None if config.model.init_from else ByteTokenizer(),
}


def register(name: str, factory: Callable[[Any, str], Task],
             tokenizer: Optional[Callable[[Any], Any]] = None):
  """Adds task `name`; `tokenizer(config)`, when given, returns its tokenizer without preparing
  any data, so the memory planner can size a model from the task's vocabulary."""
  _TASKS[name] = factory
  if tokenizer is not None:
    _TOKENIZERS[name] = tokenizer


def vocab_size(config) -> Optional[int]:
  """The task tokenizer's vocabulary size, read without preparing data; None when the task
  registered no such tokenizer."""
  make_tokenizer = _TOKENIZERS.get(config.task)
  tokenizer = make_tokenizer(config) if make_tokenizer is not None else None
  return None if tokenizer is None else int(tokenizer.vocab_size)


def names() -> Sequence[str]:
  return tuple(sorted(_TASKS))


def make(config, data_dir: str) -> Task:
  if config.task not in _TASKS:
    raise ValueError(f"unknown task {config.task!r}; choose one of {list(names())} (config.task)")
  task = _TASKS[config.task](config, data_dir)
  # Every prompt (rollouts, evaluation, SFT) is then rendered by it in the data pipeline.
  if task.tokenizer is not None:
    chat.attach(task.tokenizer, config.data.get("chat_template", ""))
  return task

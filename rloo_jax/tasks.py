"""Tasks: where prompts come from, how they are tokenised, and what the SFT stage imitates.

A task bundles the train/test prompt sources, the tokenizer and the demonstrations of the SFT stage.
Rewards are not part of a task: they are named in `config.rewards` by import path, so any task
can be trained against any weighted set of reward functions.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Callable, Optional, Sequence

import numpy as np

from rloo_jax.data import arithmetic, chat, gsm8k, hh, jsonl, summarize, tldr
from rloo_jax.data.builder import load_split, stats
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
  # The task's own preference data (records with prompt, chosen, rejected), built on first call:
  # what DPO trains on with config.dpo.pairs='dataset' (the paper's DPO row). None: no such data.
  preferences: Optional[Callable[[], Any]] = None


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
  and the same pipeline as arithmetic: SFT from scratch on the training records' answers, then
  RL."""
  del data_dir
  d = config.data
  for key in ("jsonl_train", "jsonl_test"):
    if not d[key]:
      raise ValueError(f"task=jsonl needs config.data.{key}: a JSONL file of "
                       "{\"prompt\": ..., \"answer\": ...} lines")
    if not os.path.exists(d[key]):
      raise FileNotFoundError(f"config.data.{key}={d[key]!r} does not exist")
  if config.model.init_from:
    from rloo_jax.models import hf  # the HF tokenizer is only needed with a checkpoint
    tokenizer = hf.load_tokenizer(config.model.init_from)
  else:
    tokenizer = ByteTokenizer()
  # `messages` lines are rendered with the run's chat template when the file is read.
  template = chat.resolve(d.get("chat_template", ""), tokenizer)
  source = functools.partial(jsonl.JsonlSource, prompt_field=d.get("prompt_field", "prompt"),
                             render=template.rendered if template else None)
  train, test = source(d.jsonl_train), source(d.jsonl_test)
  # Only records with an answer can be imitated; the rest are still RL prompts (their rewards
  # need no answer), so a file may mix both.
  demos = [r for r in (train[i] for i in range(len(train))) if r["answer"]]
  if config.model.init_from:
    return Task("jsonl", tokenizer, train, test, demonstrations=demos or None)
  if not demos:
    raise ValueError(f"task=jsonl without config.model.init_from trains its policy from scratch "
                     f"by SFT on the training records' answers, but no record of "
                     f"{d.jsonl_train} has a non-empty 'answer'; add answers to some records "
                     "or set config.model.init_from to a local Hugging Face checkpoint directory")
  return Task("jsonl", tokenizer, train, test, demonstrations=demos)


def _summarize(config, data_dir: str) -> Task:
  """TL;DR in miniature: the SFT stage imitates the dataset's imperfect summaries (`answer`), so
  the starting policy sits well below the gold optimum and a learned reward has room to help."""
  d = config.data
  builder = summarize.prepare(data_dir, num_train=d.num_train, num_test=d.num_test,
                              min_keys=d.get("min_keys", 1), max_keys=d.get("max_keys", 3),
                              seed=d.data_seed)
  train, test = load_split(builder, "train"), load_split(builder, "test")
  return Task("summarize", summarize.make_tokenizer(), train, test, demonstrations=train)


def _checkpoint_tokenizer(config, task: str):
  """The tokenizer of config.model.init_from, which the paper's tasks need: their policies are
  Hugging Face checkpoints (an SFT model), and their prompt filters count its tokens."""
  if not config.model.init_from:
    raise ValueError(f"task={task} runs a Hugging Face policy: set config.model.init_from to its "
                     "local checkpoint directory or hub id (the SFT model to start from)")
  from rloo_jax.models import hf  # pylint: disable=import-outside-toplevel
  return hf.load_tokenizer(config.model.init_from)


def _log_drops(name: str, builder) -> dict:
  """Prints (and returns) how many rows each split lost to the prompt-length filter and the
  format checks, as the paper reports its 448 / 348-token cuts."""
  counts = stats(builder)
  for split, c in sorted(counts.items()):
    dropped = ", ".join(f"{k[len('dropped_'):]} {v}" for k, v in sorted(c.items())
                        if k.startswith("dropped_") and v)
    print(f"[data] {name} {split}: kept {c.get('kept', '?')}"
          + (f"; dropped: {dropped}" if dropped else ""), flush=True)
  return counts


def _source_dir(config) -> Optional[str]:
  # '' downloads the public files (on a machine with network); a directory reads them offline.
  return config.data.get("source_dir", "") or None


def _builder_options(config, tokenizer, **lists) -> dict:
  """A paper builder's options: the checkpoint's tokenizer and config.data.max_prompt_len for
  the length filter, `_source_dir`, and each `option=<config.data field>` of `lists` as its
  comma list when set."""
  d = config.data
  options = dict(tokenizer=tokenizer, max_prompt_tokens=int(d.max_prompt_len),
                 source_dir=_source_dir(config))
  for option, field in lists.items():
    if d.get(field, ""):
      options[option] = [x.strip() for x in d[field].split(",") if x.strip()]
  return options


def _tldr(config, data_dir: str) -> Task:
  """Reddit TL;DR prompts in the paper's format; the references (`answer`) are the dataset's
  summaries, which SFT imitates and the win rate is judged against. Prompts over
  config.data.max_prompt_len tokens (paper: 448) are dropped and counted."""
  tokenizer = _checkpoint_tokenizer(config, "tldr")
  d = config.data
  builder = tldr.prepare_prompts(data_dir, **_builder_options(config, tokenizer))
  _log_drops("tldr", builder)
  train = load_split(builder, "train")

  def comparisons():
    # The human comparisons (Stiennon et al.), prepared only when DPO asks for them.
    pairs = tldr.prepare_comparisons(
        data_dir, **_builder_options(config, tokenizer, batches="comparison_batches"))
    _log_drops("tldr_comparisons", pairs)
    return load_split(pairs, "train")

  return Task("tldr", tokenizer, train, load_split(builder, d.get("eval_split", "test") or "test"),
              demonstrations=train, preferences=comparisons)


def _hh(config, data_dir: str) -> Task:
  """Anthropic HH: the conversation up to its last Assistant turn is the prompt; the chosen
  response is the demonstration and the win-rate reference (`answer`). Prompts over
  config.data.max_prompt_len tokens (paper: 348) are dropped and counted."""
  tokenizer = _checkpoint_tokenizer(config, "hh")
  builder = hh.prepare(data_dir, **_builder_options(config, tokenizer, subsets="hh_subsets"))
  _log_drops("hh", builder)
  with_answer = lambda source: _Renamed(source, answer="chosen")
  train = with_answer(load_split(builder, "train"))
  return Task("hh", tokenizer, train, with_answer(load_split(builder, "test")),
              demonstrations=train, preferences=lambda: train)


def _gsm8k(config, data_dir: str) -> Task:
  """GSM8K: questions in `data.gsm8k_template` (default: the builder's plain frame), the final
  number as `answer` (what `rewards.verifiers:gsm8k` checks); SFT imitates the worked solutions."""
  tokenizer = _checkpoint_tokenizer(config, "gsm8k")
  options = dict(source_dir=_source_dir(config))
  if config.data.get("gsm8k_template", ""):
    options["prompt_template"] = config.data.gsm8k_template
  builder = gsm8k.prepare(data_dir, **options)
  train = load_split(builder, "train")
  demos = _Renamed(train, answer="solution")
  return Task("gsm8k", tokenizer, train, load_split(builder, "test"), demonstrations=demos,
              stop=config.data.get("stop", "") or None)


class _Renamed:
  """A random-access source whose records gain fields copied from others (`answer='chosen'`):
  HH's chosen response as the reference answer, GSM8K's solution as the SFT target."""

  def __init__(self, source, **copies):
    self.source, self.copies = source, copies

  def __len__(self):
    return len(self.source)

  def __getitem__(self, i):
    record = dict(self.source[i])
    for new, old in self.copies.items():
      record[new] = record[old]
    return record

  def __getitems__(self, indices):
    return [self[i] for i in indices]


_TASKS: dict[str, Callable[[Any, str], Task]] = {
    "arithmetic": _arithmetic,
    "jsonl": _jsonl,
    "summarize": _summarize,
    "tldr": _tldr,
    "hh": _hh,
    "gsm8k": _gsm8k,
}


# The tokenizer of each task without its data (the memory planner's vocabulary size).
_TOKENIZERS: dict[str, Callable[[Any], Any]] = {
    "arithmetic": lambda config: arithmetic.make_tokenizer(),
    "summarize": lambda config: summarize.make_tokenizer(),
    # With init_from the checkpoint's config.json sizes the model; its tokenizer is not needed.
    "jsonl": lambda config: None if config.model.init_from else ByteTokenizer(),
    # The paper's tasks run checkpoints: config.json (or the preset) sizes the model.
    "tldr": lambda config: None, "hh": lambda config: None, "gsm8k": lambda config: None,
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

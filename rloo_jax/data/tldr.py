"""Reddit TL;DR (Stiennon et al. 2020, as used by the RLOO paper): SFT prompts and preferences.

Two builders, both array_record:
  TldrPrompts      the filtered posts with reference summaries,
                   `tldr_3_filtered/{train,valid,test}.jsonl`
                   (fields id, subreddit, title, post, summary) -> splits train / validation / test,
                   features prompt, answer (the reference summary), id.
  TldrComparisons  the human comparisons, `dataset/comparisons/batch*.json` (one JSON object per
                   line: info.{id,post,title,subreddit}, summaries[0..1].text, choice, split) ->
                   splits train / validation (valid1) / test (valid2), features prompt, chosen,
                   rejected, id.

Prompts use the paper's format, `SUBREDDIT: r/<s>\\nTITLE: <t>\\nPOST: <p>\\nTL;DR:`, and responses
start with one space. Prompts over `max_prompt_tokens` (paper: 448) are dropped and counted
(`rloo_jax.data.builder.stats`), in the given tokenizer's tokens (default: UTF-8 bytes, an upper
bound on any BPE count).

Offline, pass `source_dir` holding the files under their source names (`train.jsonl`,
`batch3.json`, ...); otherwise they are downloaded from the public blob store.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import tensorflow_datasets as tfds

from rloo_jax.data import builder as builder_lib

PROMPTS_URL = "https://openaipublic.blob.core.windows.net/summarize-from-feedback/datasets/tldr_3_filtered/"
COMPARISONS_URL = "https://openaipublic.blob.core.windows.net/summarize-from-feedback/dataset/comparisons/"
PROMPT_FILES = {"train": "train.jsonl", "validation": "valid.jsonl", "test": "test.jsonl"}
# TL;DR comparison batches (the cnndm* and edit* files hold CNN/DM articles, not Reddit posts).
COMPARISON_BATCHES = tuple(f"batch{i}" for i in range(3, 21)) + ("batch22",)
COMPARISON_SPLITS = {"train": "train", "valid1": "validation", "valid2": "test"}
MAX_PROMPT_TOKENS = 448


def format_prompt(subreddit: str, title: str, post: str) -> str:
  return f"SUBREDDIT: r/{subreddit}\nTITLE: {title}\nPOST: {post.strip()}\nTL;DR:"


def format_response(text: str) -> str:
  return " " + text.strip()


@dataclasses.dataclass(eq=False)
class TldrConfig(tfds.core.BuilderConfig):
  NAME_EXCLUDES = ("source_dir", "tokenizer")
  max_prompt_tokens: int = MAX_PROMPT_TOKENS
  tokenizer: Any = None
  tokenizer_name: str = ""
  source_dir: str | None = None


@dataclasses.dataclass(eq=False)
class TldrComparisonsConfig(TldrConfig):
  batches: tuple[str, ...] = COMPARISON_BATCHES


def _make_config(config_cls, **options):
  _, name = builder_lib.token_counter(options.get("tokenizer"))
  options.setdefault("tokenizer_name", name)
  if options.get("source_dir") is not None:
    options["source_dir"] = os.fspath(options["source_dir"])
  if "batches" in options:
    options["batches"] = tuple(options["batches"])
  return builder_lib.builder_config(config_cls, **options)


class _TldrBase(builder_lib.TextBuilder, skip_registration=True):

  def _keep(self, split: str, prompt: str) -> bool:
    count, _ = builder_lib.token_counter(self.builder_config.tokenizer)
    if count(prompt) > self.builder_config.max_prompt_tokens:
      self.count(split, "dropped_too_long")
      return False
    return True


class TldrPrompts(_TldrBase):
  TEXT_FIELDS = ("prompt", "answer", "id")
  DESCRIPTION = "Reddit TL;DR posts (tldr_3_filtered) with reference summaries."

  @classmethod
  def make_config(cls, **options):
    return _make_config(TldrConfig, **options)

  def _split_examples(self, dl_manager):
    files = builder_lib.resolve_files(dl_manager, self.builder_config.source_dir, PROMPT_FILES,
                                      PROMPTS_URL)
    return {split: self._examples(split, files[split], PROMPT_FILES[split]) for split in files}

  def _examples(self, split, path, label):
    for where, row in builder_lib.read_json_lines(path, label):
      prompt = format_prompt(builder_lib.field(row, "subreddit", where),
                             builder_lib.field(row, "title", where),
                             builder_lib.field(row, "post", where))
      summary = builder_lib.field(row, "summary", where)
      if self._keep(split, prompt):
        yield {"prompt": prompt, "answer": format_response(summary),
               "id": str(builder_lib.field(row, "id", where, (str, int)))}


class TldrComparisons(_TldrBase):
  TEXT_FIELDS = ("prompt", "chosen", "rejected", "id")
  DESCRIPTION = "Human preference comparisons between TL;DR summaries (Stiennon et al. 2020)."

  @classmethod
  def make_config(cls, **options):
    return _make_config(TldrComparisonsConfig, **options)

  def _split_examples(self, dl_manager):
    c = self.builder_config
    files = builder_lib.resolve_files(dl_manager, c.source_dir,
                                      {b: f"{b}.json" for b in c.batches}, COMPARISONS_URL)
    # Every file mixes splits (each row has its own), so all are read once and routed per row.
    rows: dict[str, list[dict[str, str]]] = {s: [] for s in COMPARISON_SPLITS.values()}
    for batch, path in files.items():
      for where, row in builder_lib.read_json_lines(path, f"{batch}.json"):
        raw_split = builder_lib.field(row, "split", where)
        if raw_split not in COMPARISON_SPLITS:
          raise ValueError(f"{where}: field 'split' is {raw_split!r}; expected one of "
                           f"{sorted(COMPARISON_SPLITS)}")
        split = COMPARISON_SPLITS[raw_split]
        prompt = format_prompt(builder_lib.field(row, "info.subreddit", where),
                               builder_lib.field(row, "info.title", where),
                               builder_lib.field(row, "info.post", where))
        summaries = builder_lib.field(row, "summaries", where, list)
        if len(summaries) != 2:
          raise ValueError(f"{where}: field 'summaries' has {len(summaries)} entries, expected 2")
        texts = [builder_lib.field(row, f"summaries.{i}.text", where) for i in range(2)]
        choice = builder_lib.field(row, "choice", where, int)
        if choice not in (0, 1):
          raise ValueError(f"{where}: field 'choice' is {choice}, expected 0 or 1")
        if not self._keep(split, prompt):
          continue
        rows[split].append({"prompt": prompt, "chosen": format_response(texts[choice]),
                            "rejected": format_response(texts[1 - choice]),
                            "id": str(builder_lib.field(row, "info.id", where, (str, int)))})
    return {split: iter(r) for split, r in rows.items()}


def prepare_prompts(data_dir: str | os.PathLike, **options) -> TldrPrompts:
  """Options: max_prompt_tokens, tokenizer, source_dir."""
  return builder_lib.prepare(TldrPrompts, data_dir, **options)


def prepare_comparisons(data_dir: str | os.PathLike, **options) -> TldrComparisons:
  """Options: max_prompt_tokens, tokenizer, source_dir, batches."""
  return builder_lib.prepare(TldrComparisons, data_dir, **options)

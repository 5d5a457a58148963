"""Anthropic HH-RLHF (Bai et al. 2022) as preference triples (prompt, chosen, rejected).

Source layout: `<subset>/{train,test}.jsonl.gz`, one object per line with `chosen` and
`rejected`, each a full dialogue `\\n\\nHuman: ... \\n\\nAssistant: ...`. The two dialogues share
every turn but the last Assistant reply, so the prompt is the chosen dialogue up to and including
its last `\\n\\nAssistant:` and the responses are what follows it in each dialogue.

Rows that do not fit that shape are dropped and counted per reason in the dataset's metadata
(`rloo_jax.data.builder.stats`): no Assistant turn, a rejected dialogue whose context differs from
the chosen one, identical responses, and prompts over `max_prompt_tokens` (paper: 348). A missing
or non-string `chosen`/`rejected` field, or a line that is not JSON, is an error naming the file
and line. Offline, pass `source_dir` holding the subset folders (`.jsonl.gz` or unzipped `.jsonl`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import tensorflow_datasets as tfds

from rloo_jax.data import builder as builder_lib

BASE_URL = "https://huggingface.co/datasets/Anthropic/hh-rlhf/resolve/main/"
SUBSETS = ("helpful-base", "harmless-base", "helpful-online", "helpful-rejection-sampled")
SPLITS = ("train", "test")
ASSISTANT = "\n\nAssistant:"
MAX_PROMPT_TOKENS = 348


def split_dialogues(chosen: str, rejected: str) -> tuple[str, str, str] | str:
  """`(prompt, chosen_response, rejected_response)`, or the reason (a 'dropped_*' key) it fails."""
  cut = chosen.rfind(ASSISTANT)
  if cut < 0:
    return "dropped_no_assistant_turn"
  prompt = chosen[:cut + len(ASSISTANT)]
  if not rejected.startswith(prompt) or ASSISTANT in rejected[len(prompt):]:
    return "dropped_context_mismatch"
  chosen_response, rejected_response = chosen[len(prompt):], rejected[len(prompt):]
  if chosen_response.strip() == rejected_response.strip():
    return "dropped_identical_responses"
  return prompt, chosen_response, rejected_response


@dataclasses.dataclass(eq=False)
class HhConfig(tfds.core.BuilderConfig):
  NAME_EXCLUDES = ("source_dir", "tokenizer")
  subsets: tuple[str, ...] = SUBSETS
  max_prompt_tokens: int = MAX_PROMPT_TOKENS
  tokenizer: Any = None
  tokenizer_name: str = ""
  source_dir: str | None = None


class HhPreferences(builder_lib.TextBuilder):
  TEXT_FIELDS = ("prompt", "chosen", "rejected", "subset")
  DESCRIPTION = "Anthropic HH-RLHF helpful/harmless preference dialogues."

  @classmethod
  def make_config(cls, **options):
    _, name = builder_lib.token_counter(options.get("tokenizer"))
    options.setdefault("tokenizer_name", name)
    if "subsets" in options:
      options["subsets"] = tuple(options["subsets"])
      unknown = set(options["subsets"]) - set(SUBSETS)
      if unknown:
        raise ValueError(f"unknown HH subset(s) {sorted(unknown)}; known: {SUBSETS}")
    if options.get("source_dir") is not None:
      options["source_dir"] = os.fspath(options["source_dir"])
    return builder_lib.builder_config(HhConfig, **options)

  def _split_examples(self, dl_manager):
    c = self.builder_config
    relative = {(s, sp): f"{s}/{sp}.jsonl.gz" for s in c.subsets for sp in SPLITS}
    files = builder_lib.resolve_files(dl_manager, c.source_dir, relative, BASE_URL)
    return {sp: self._examples(sp, [(s, files[(s, sp)], relative[(s, sp)]) for s in c.subsets])
            for sp in SPLITS}

  def _examples(self, split, files):
    count_tokens, _ = builder_lib.token_counter(self.builder_config.tokenizer)
    for subset, path, label in files:
      for where, row in builder_lib.read_json_lines(path, label):
        parts = split_dialogues(builder_lib.field(row, "chosen", where),
                                builder_lib.field(row, "rejected", where))
        if isinstance(parts, str):
          self.count(split, parts)
          continue
        prompt, chosen, rejected = parts
        if count_tokens(prompt) > self.builder_config.max_prompt_tokens:
          self.count(split, "dropped_too_long")
          continue
        yield {"prompt": prompt, "chosen": chosen, "rejected": rejected, "subset": subset}


def prepare(data_dir: str | os.PathLike, **options) -> HhPreferences:
  """Options: subsets, max_prompt_tokens, tokenizer, source_dir."""
  return builder_lib.prepare(HhPreferences, data_dir, **options)

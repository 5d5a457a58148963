"""GSM8K (Cobbe et al. 2021, openai/grade-school-math): grade-school maths word problems.

Source layout: `train.jsonl` (7,473 problems) and `test.jsonl` (1,319), one object per line with
`question` and `answer`, the worked solution with calculator annotations (`<<48/2=24>>`) ending
in a line `#### <final number>`. The builder writes array_record splits train / test with
features
  prompt    the question in `prompt_template` (its one placeholder is `{question}`)
  answer    the final number, normalised ('1,200' -> '1200'): what the verifier compares against
  solution  the full reference solution, for an SFT stage that imitates worked solutions

Score completions with `rloo_jax.rewards.verifiers:gsm8k` (and optionally `:gsm8k_format`).

A malformed line is an error naming the file and line. Offline, pass `source_dir` holding
`train.jsonl` and `test.jsonl` (a checkout's `grade_school_math/data`, or the JSONL export of
the Hugging Face copy `openai/gsm8k`); otherwise they are downloaded from GitHub.
"""

from __future__ import annotations

import dataclasses
import os

import tensorflow_datasets as tfds

from rloo_jax.data import builder as builder_lib
from rloo_jax.data import gsm8k_answer

BASE_URL = ("https://raw.githubusercontent.com/openai/grade-school-math/master/"
            "grade_school_math/data/")
FILES = {"train": "train.jsonl", "test": "test.jsonl"}
# A plain question/answer frame: it suits base models, and an instruction-tuned policy gets its
# chat template from config.data.chat_template in the pipeline rather than from here.
PROMPT_TEMPLATE = "Question: {question}\nAnswer:"


def format_prompt(question: str, template: str = PROMPT_TEMPLATE) -> str:
  return template.format(question=question.strip())


def check_template(template: str) -> None:
  """Fails at configuration time, not mid-build, on a template that cannot hold a question."""
  if not isinstance(template, str) or "{question}" not in template:
    raise ValueError(f"prompt_template must be a string containing '{{question}}', got "
                     f"{template!r}")
  try:
    template.format(question="")
  except (KeyError, IndexError, ValueError) as e:
    raise ValueError(f"prompt_template {template!r} has placeholders other than {{question}} "
                     f"(write literal braces as '{{{{' and '}}}}'): {e!r}") from None


@dataclasses.dataclass(eq=False)
class Gsm8kConfig(tfds.core.BuilderConfig):
  NAME_EXCLUDES = ("source_dir",)
  prompt_template: str = PROMPT_TEMPLATE
  source_dir: str | None = None


class Gsm8k(builder_lib.TextBuilder):
  TEXT_FIELDS = ("prompt", "answer", "solution")
  DESCRIPTION = "GSM8K grade-school maths word problems with worked solutions."

  @classmethod
  def make_config(cls, **options):
    if "prompt_template" in options:
      check_template(options["prompt_template"])
    if options.get("source_dir") is not None:
      options["source_dir"] = os.fspath(options["source_dir"])
    return builder_lib.builder_config(Gsm8kConfig, **options)

  def _split_examples(self, dl_manager):
    files = builder_lib.resolve_files(dl_manager, self.builder_config.source_dir, FILES, BASE_URL)
    return {split: self._examples(files[split], FILES[split]) for split in FILES}

  def _examples(self, path, label):
    for where, row in builder_lib.read_json_lines(path, label):
      question = builder_lib.field(row, "question", where)
      solution = builder_lib.field(row, "answer", where)
      if gsm8k_answer.MARKER not in solution:
        raise ValueError(f"{where}: field 'answer' has no '{gsm8k_answer.MARKER} <number>' line "
                         f"(ends {solution[-40:]!r})")
      answer = gsm8k_answer.reference_answer(solution)
      if answer is None:
        raise ValueError(f"{where}: field 'answer' has no number after its last "
                         f"'{gsm8k_answer.MARKER}' (ends {solution[-40:]!r})")
      yield {"prompt": format_prompt(question, self.builder_config.prompt_template),
             "answer": answer, "solution": solution}


def prepare(data_dir: str | os.PathLike, **options) -> Gsm8k:
  """Options: prompt_template, source_dir."""
  return builder_lib.prepare(Gsm8k, data_dir, **options)

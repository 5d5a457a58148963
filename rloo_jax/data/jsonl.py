"""A JSONL file of prompts as a random-access source: one object per line, `prompt` (or the
field config.data.prompt_field names) or `messages` required, `answer` optional (a reference
answer for verifiers and the SFT stage; '' when absent), and any other fields, which every
reward function receives as keyword arguments.

`messages` is a conversation as TRL's conversational datasets hold it, a list of
`{"role": ..., "content": ...}` objects; it is rendered by the chat template
(config.data.chat_template) into the prompt text, ending where the assistant's reply starts, and
that text is what the policy sees and the rewards receive as the prompt.

The whole file is parsed and validated when the source is built, so a typo on line 9,000 fails
at start-up with the file and line named, not hours into a run.

The rule for the other fields, chosen so that every field reaches the rewards in every batch
(`pipeline.record_fields` stacks a field only when its values in a batch are all strings or all
numbers, and silently leaves out anything else):

- A value is a string or a number; booleans become the numbers 1 / 0.
- A nested value (a list or an object) is an error naming the file, line and field: a reward
  would otherwise never see it, and flattening it would invent field names. Encode it as a JSON
  string and parse it in the reward function, or split it into flat fields.
- A field is a string on every line or a number on every line; mixing is an error naming both
  lines (a batch holding both kinds would drop the field).
- Where a line lacks a field (or has null), it is filled with '' (string fields) or NaN (number
  fields, which are then floats on every line): the unscorable value of the reward protocol,
  so a reward returns NaN there rather than crashing on a missing key. A field that is null on
  every line has no kind and is left out.
- Names the batch layout uses (`RESERVED`) are an error naming the file, line and field.
"""

from __future__ import annotations

import math
import os
from typing import Any

from rloo_jax.data.builder import read_json_lines

# Keys the rollout and SFT batches set themselves (data.pipeline): a JSONL field of the same name
# would collide with them (or be overwritten), and `prompt` / `answer` are the task's own fields.
RESERVED = ("prompt", "answer", "messages", "prompt_tokens", "prompt_lengths", "index", "valid",
            "tokens", "token_mask", "loss_mask", "lengths")


def _kind(value) -> str:
  return "string" if isinstance(value, str) else "number"


class JsonlSource:
  """Records `{'prompt': str, 'answer': str, **other fields}` in file order; blank lines are
  ignored. `fields` maps each other field's name to 'string' or 'number'."""

  def __init__(self, path: str | os.PathLike, *, prompt_field: str = "prompt",
               answer_field: str = "answer", render=None):
    """render: `messages` (a list of role / content dicts) -> the prompt text, with the chat
    template (`chat.ChatTemplate.rendered`); None: a line with `messages` is an error."""
    self.path = os.fspath(path)
    self.name = self.path
    if not os.path.isfile(self.path):
      raise FileNotFoundError(f"JSONL prompts file not found: {self.path}")
    self._records: list[dict[str, Any]] = []
    first_seen: dict[str, tuple[str, str]] = {}  # field -> (kind, 'file:line' of its first value)
    missing: set[str] = set()  # fields absent (or null) on some line, filled below
    for where, row in read_json_lines(self.path):
      if prompt_field not in row and "messages" in row:
        prompt = self._render(where, row["messages"], render)
      elif prompt_field not in row:
        raise ValueError(f"{where}: missing field {prompt_field!r} or 'messages' (fields: "
                         f"{sorted(row)}; config.data.prompt_field names the prompt's field)")
      else:
        prompt = row[prompt_field]
      if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"{where}: field {prompt_field!r} must be a non-empty string, "
                         f"got {prompt!r}")
      answer = row.get(answer_field)
      if answer is None:
        answer = ""
      elif isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise ValueError(f"{where}: field {answer_field!r} must be a string or number, "
                         f"got {type(answer).__name__}")
      record: dict[str, Any] = {"prompt": prompt, "answer": str(answer)}
      for key, value in row.items():
        if key in (prompt_field, answer_field, "messages"):
          continue
        if key in RESERVED:
          raise ValueError(f"{where}: field {key!r} is a name the batches use themselves "
                           f"(reserved: {', '.join(RESERVED)}); rename it in the file")
        value = self._check_value(where, key, value)
        if value is None:
          missing.add(key)
          continue
        kind = _kind(value)
        seen = first_seen.setdefault(key, (kind, where))
        if seen[0] != kind:
          raise ValueError(f"{where}: field {key!r} is a {kind} here but a {seen[0]} at "
                           f"{seen[1]}; a field must be a string on every line or a number on "
                           "every line")
        record[key] = value
      self._records.append(record)
    if not self._records:
      raise ValueError(f"{self.path}: no records (the file is empty)")
    self.fields = {key: kind for key, (kind, _) in first_seen.items()}
    self._fill_missing(missing)

  @staticmethod
  def _render(where: str, messages, render) -> str:
    """A line's `messages` as the prompt text, or an error naming the file and line."""
    if (not isinstance(messages, list) or not messages
        or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                   and isinstance(m.get("content"), str) for m in messages)):
      raise ValueError(f"{where}: field 'messages' must be a non-empty list of "
                       '{"role": str, "content": str} objects')
    if render is None:
      raise ValueError(f"{where}: 'messages' needs a chat template to render the conversation; "
                       "set config.data.chat_template ('auto': the checkpoint's own, or a .jinja "
                       "path)")
    return render(messages)

  @staticmethod
  def _check_value(where: str, key: str, value):
    """The stored value of one field (None: absent), or an error naming the file, line and field."""
    if isinstance(value, bool):
      return int(value)
    if value is None or isinstance(value, (str, int)):
      return value
    if isinstance(value, float):
      if not math.isfinite(value):  # Python's json reads NaN / Infinity, which JSON does not have
        raise ValueError(f"{where}: field {key!r} is {value!r}; use a finite number or leave the "
                         "field out (a missing number reads as NaN)")
      return value
    kind = {list: "a list", dict: "an object"}.get(type(value), type(value).__name__)
    raise ValueError(f"{where}: field {key!r} is {kind}; fields must be strings or numbers (a "
                     "reward function receives each as one value per sample): flatten it into "
                     "separate fields or store it as a JSON string")

  def _fill_missing(self, missing: set[str]) -> None:
    """'' / NaN where a line lacks a field, so every batch stacks every field (module docstring)."""
    for key, kind in self.fields.items():
      incomplete = key in missing or any(key not in r for r in self._records)
      if kind == "number" and incomplete:
        for r in self._records:  # floats on every line: one dtype whichever lines a batch holds
          r[key] = float(r[key]) if key in r else math.nan
      elif incomplete:
        for r in self._records:
          r.setdefault(key, "")

  def __len__(self) -> int:
    return len(self._records)

  def __getitem__(self, index: int) -> dict[str, Any]:
    return dict(self._records[index])

  def __getitems__(self, indices) -> list[dict[str, Any]]:
    return [dict(self._records[int(i)]) for i in indices]

  def __repr__(self):
    return f"JsonlSource({self.path!r}, {len(self)} records, fields {sorted(self.fields)})"

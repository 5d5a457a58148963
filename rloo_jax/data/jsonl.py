"""A JSONL file of prompts as a random-access source: one object per line, `prompt` required,
`answer` optional (a reference answer for verifiers; '' when absent).

The whole file is parsed and validated when the source is built, so a typo on line 9,000 fails
at start-up with the file and line named, not hours into a run.
"""

from __future__ import annotations

import os

from rloo_jax.data.builder import read_json_lines


class JsonlSource:
  """Records `{'prompt': str, 'answer': str}` in file order; blank lines are ignored."""

  def __init__(self, path: str | os.PathLike, *, prompt_field: str = "prompt",
               answer_field: str = "answer"):
    self.path = os.fspath(path)
    self.name = self.path
    if not os.path.isfile(self.path):
      raise FileNotFoundError(f"JSONL prompts file not found: {self.path}")
    self._records: list[dict[str, str]] = []
    for where, row in read_json_lines(self.path):
      if prompt_field not in row:
        raise ValueError(f"{where}: missing field {prompt_field!r} (fields: {sorted(row)})")
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
      self._records.append({"prompt": prompt, "answer": str(answer)})
    if not self._records:
      raise ValueError(f"{self.path}: no records (the file is empty)")

  def __len__(self) -> int:
    return len(self._records)

  def __getitem__(self, index: int) -> dict[str, str]:
    return dict(self._records[index])

  def __getitems__(self, indices) -> list[dict[str, str]]:
    return [dict(self._records[int(i)]) for i in indices]

  def __repr__(self):
    return f"JsonlSource({self.path!r}, {len(self)} records)"

"""Batches of tokenised prompts (for rollouts) and of prompt+answer sequences (for SFT) from any
random-access source (`rloo_jax.data.load_split(...)`, `JsonlSource`, a list of dicts).

Why the order is an index plan rather than a stream: grain's `MapDataset.range(n).shuffle(seed)
.repeat().batch(B)` maps a batch number to the record indices of that batch with no hidden state,
so the iterator's whole position is one integer. Checkpointing it is exact (a resumed run sees
the same batches, bit for bit), every process computes the same global batch without
communicating, and each keeps only its own rows.

Prompts that do not fit (`max_prompt_len`, or `max_seq_len` for SFT) are found in one pass over
the source when the iterator is built, then dropped and counted (`overlong='drop'`) or reported
with their record index (`overlong='error'`); filtering up front keeps batches full and the
index plan independent of the tokenizer's behaviour mid-run.

Batch layout (numpy, global batch B, this process's rows B / process_count):
  prompt_tokens  [b, P] int32, right-padded with the tokenizer's pad id (bos first if add_bos)
  prompt_lengths [b]    int32, tokens before the padding
  prompt, answer [b]    object arrays of str ('' where the source has no answer); other source
                        fields pass through (str -> object array, numbers -> numpy arrays)
  index          [b]    int64 record index in the source
  valid          [b]    bool; False only on rows that pad the final batch of a finite pass
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from absl import logging
import grain
import numpy as np

from rloo_jax.data import chat

OVERLONG_MODES = ("drop", "error")
_STATE_VERSION = 1


def _encode(tokenizer, text: str, what: str) -> list[int]:
  try:
    return list(tokenizer.encode(text))
  except ValueError as e:
    raise ValueError(f"cannot tokenize {what}: {e}") from None


def _prompt_ids(tokenizer, text: str, what: str, add_bos: bool) -> list[int]:
  """A prompt's ids, bos first; rendered first by the tokenizer's chat template if it has one."""
  try:
    return chat.prompt_ids(tokenizer, text, add_bos)
  except ValueError as e:
    raise ValueError(f"cannot tokenize {what}: {e}") from None


def encode_prompts(prompts: Sequence[str], tokenizer, max_prompt_len: int,
                   add_bos: bool = True) -> tuple[np.ndarray, np.ndarray]:
  """Right-padded `(prompt_tokens_bp int32, prompt_lengths_b int32)`; a prompt longer than
  `max_prompt_len` tokens is an error (callers that want drop-and-count use `prompt_batches`)."""
  tokens = np.full((len(prompts), max_prompt_len), tokenizer.pad_id, np.int32)
  lengths = np.zeros((len(prompts),), np.int32)
  for i, p in enumerate(prompts):
    ids = _prompt_ids(tokenizer, p, f"prompt {i}", add_bos)
    if len(ids) > max_prompt_len:
      raise ValueError(f"prompt {i} has {len(ids)} tokens > max_prompt_len={max_prompt_len}: "
                       f"{p[:80]!r}")
    tokens[i, :len(ids)] = ids
    lengths[i] = len(ids)
  return tokens, lengths


def make_sft_batch(prompts: Sequence[str], answers: Sequence[str], tokenizer, max_seq_len: int,
                   add_bos: bool = True) -> dict[str, np.ndarray]:
  """Sequences `[bos] prompt answer eos`, right-padded to `max_seq_len`.

  Returns `tokens` [B,S] int32, `token_mask` [B,S] bool (real tokens), `loss_mask` [B,S] bool,
  `prompt_lengths` [B] and `lengths` [B] int32. `loss_mask[b, t]` is True where `tokens[b, t]` is
  an answer token or the eos, i.e. it marks *targets*: with logits[:, t] predicting tokens[:, t+1],
  weight the next-token loss by `loss_mask[:, 1:]`. Prompt and answer are tokenised separately
  (as at sampling time, where the completion starts after the prompt's last token), so the SFT
  policy learns exactly the boundary it will sample from. Also the builder for each side of a
  preference pair (prompt + chosen / prompt + rejected).
  """
  if len(prompts) != len(answers):
    raise ValueError(f"{len(prompts)} prompts but {len(answers)} answers")
  b = len(prompts)
  tokens = np.full((b, max_seq_len), tokenizer.pad_id, np.int32)
  loss_mask = np.zeros((b, max_seq_len), bool)
  prompt_lengths = np.zeros((b,), np.int32)
  lengths = np.zeros((b,), np.int32)
  for i, (p, a) in enumerate(zip(prompts, answers)):
    prompt_ids = _prompt_ids(tokenizer, p, f"prompt {i}", add_bos)
    answer_ids = _encode(tokenizer, a, f"answer {i}") + [tokenizer.eos_id]
    ids = prompt_ids + answer_ids
    if len(ids) > max_seq_len:
      raise ValueError(f"sequence {i} has {len(ids)} tokens > max_seq_len={max_seq_len}: "
                       f"{p[:60]!r} + {a[:40]!r}")
    tokens[i, :len(ids)] = ids
    loss_mask[i, len(prompt_ids):len(ids)] = True
    prompt_lengths[i] = len(prompt_ids)
    lengths[i] = len(ids)
  token_mask = np.arange(max_seq_len)[None, :] < lengths[:, None]
  return dict(tokens=tokens, token_mask=token_mask, loss_mask=loss_mask,
              prompt_lengths=prompt_lengths, lengths=lengths)


def _read(source, indices: np.ndarray) -> list[Mapping[str, Any]]:
  if hasattr(source, "__getitems__"):
    return list(source.__getitems__([int(i) for i in indices]))
  return [source[int(i)] for i in indices]


def record_fields(records: Sequence[Mapping[str, Any]]) -> dict[str, np.ndarray]:
  """Stacks the records' own fields; `answer` defaults to '' so verifiers can mark it unscorable."""
  keys = dict.fromkeys(k for r in records for k in r)
  keys.setdefault("answer", None)
  out = {}
  for k in keys:
    values = [r.get(k, "" if k == "answer" else None) for r in records]
    if all(isinstance(v, str) for v in values):
      arr = np.empty((len(values),), object)
      arr[:] = values
      out[k] = arr
    elif all(isinstance(v, (int, float, np.number)) and not isinstance(v, bool) for v in values):
      out[k] = np.asarray(values)
    # Fields of mixed or nested types are left out: batches must stack.
  return out


class BatchIterator:
  """Shuffled, sharded, checkpointable batches; build with `prompt_batches` or `sft_batches`."""

  def __init__(self, source, make_batch: Callable[[list[Mapping[str, Any]]], dict[str, np.ndarray]],
               lengths: np.ndarray, *, limit: int, limit_name: str, global_batch_size: int,
               seed: int = 0, shuffle: bool = True, num_epochs: int | None = None,
               drop_remainder: bool = True, overlong: str = "drop", process_index: int = 0,
               process_count: int = 1):
    if overlong not in OVERLONG_MODES:
      raise ValueError(f"overlong={overlong!r}; expected one of {OVERLONG_MODES}")
    if global_batch_size <= 0 or process_count <= 0:
      raise ValueError(f"global_batch_size={global_batch_size} and process_count={process_count} "
                       "must be positive")
    if global_batch_size % process_count:
      raise ValueError(f"global_batch_size={global_batch_size} is not divisible by "
                       f"process_count={process_count}")
    if not 0 <= process_index < process_count:
      raise ValueError(f"process_index={process_index} not in [0, {process_count})")
    if not 0 <= seed < 2**32:
      raise ValueError(f"seed={seed} must be in [0, 2**32)")
    if num_epochs is not None and num_epochs < 1:
      raise ValueError(f"num_epochs={num_epochs} must be >= 1 or None (forever)")
    self._source = source
    self._make_batch = make_batch
    self.num_records = len(lengths)
    too_long = np.flatnonzero(lengths > limit)
    if len(too_long) and overlong == "error":
      first = ", ".join(f"record {i} ({lengths[i]} tokens)" for i in too_long[:5])
      raise ValueError(f"{len(too_long)} of {self.num_records} records of "
                       f"{_name(source)} exceed {limit_name}={limit}: "
                       f"{first}; raise {limit_name} or use overlong='drop'")
    self._kept = np.flatnonzero(lengths <= limit)
    self.num_dropped = int(len(too_long))
    if self.num_dropped:
      logging.info("dropped %d of %d records longer than %s=%d", self.num_dropped,
                   self.num_records, limit_name, limit)
    if not len(self._kept):
      raise ValueError(f"no record of {_name(source)} fits {limit_name} = {limit} tokens (the "
                       f"shortest of its {self.num_records} records needs {int(lengths.min())}); "
                       f"raise {limit_name.split(' + ')[0]}")
    self.global_batch_size = global_batch_size
    self.local_batch_size = global_batch_size // process_count
    self.process_index = process_index
    self.process_count = process_count
    self._seed, self._shuffle, self._num_epochs = seed, shuffle, num_epochs
    plan = grain.MapDataset.range(len(self._kept))
    if shuffle:
      plan = plan.shuffle(seed=seed)  # a fresh permutation each epoch (seed + epoch)
    if num_epochs != 1:
      plan = plan.repeat(num_epochs)
    # After repeat, so in an endless stream no batch is cut short at an epoch boundary.
    self._plan = plan.batch(global_batch_size, drop_remainder=drop_remainder)
    self.num_batches = None if num_epochs is None else len(self._plan)
    self._step = 0

  @property
  def num_kept(self) -> int:
    return len(self._kept)

  @property
  def step(self) -> int:
    return self._step

  @property
  def epoch(self) -> float:
    """Passes over the kept records so far (fractional)."""
    return self._step * self.global_batch_size / self.num_kept

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    if self.num_batches is not None and self._step >= self.num_batches:
      raise StopIteration
    positions = np.asarray(self._plan[self._step])
    indices = self._kept[positions]
    valid = np.ones((self.global_batch_size,), bool)
    if len(indices) < self.global_batch_size:
      # Fixed shapes for jit: repeat a real row and flag the copies.
      valid[len(indices):] = False
      indices = np.concatenate(
          [indices, np.full((self.global_batch_size - len(indices),), indices[0])])
    lo = self.process_index * self.local_batch_size
    indices = indices[lo:lo + self.local_batch_size]
    records = _read(self._source, indices)
    batch = self._make_batch(records)
    batch["index"] = indices.astype(np.int64)
    batch["valid"] = valid[lo:lo + self.local_batch_size]
    self._step += 1
    return batch

  def _fingerprint(self) -> dict[str, Any]:
    return dict(version=_STATE_VERSION, seed=self._seed, shuffle=self._shuffle,
                num_epochs=self._num_epochs, global_batch_size=self.global_batch_size,
                num_records=self.num_records, num_kept=self.num_kept)

  def get_state(self) -> dict[str, Any]:
    """JSON-serialisable position; independent of process_index/count, so it restores onto a
    different number of hosts as long as the global batch is the same."""
    return dict(self._fingerprint(), step=self._step)

  def set_state(self, state: Mapping[str, Any]) -> None:
    expected = self._fingerprint()
    mismatched = {k: (state.get(k), v) for k, v in expected.items() if state.get(k) != v}
    if mismatched:
      detail = ", ".join(f"{k}: saved {a!r} vs now {b!r}" for k, (a, b) in mismatched.items())
      raise ValueError("data iterator state does not match this pipeline (the dataset or the "
                       f"batching settings changed since the checkpoint): {detail}")
    step = state.get("step")
    if not isinstance(step, int) or step < 0:
      raise ValueError(f"data iterator state has an invalid step {step!r}")
    self._step = step


def _name(source) -> str:
  return getattr(source, "name", "") or "the source"


def _lengths(source, length_fn: Callable[[Mapping[str, Any]], int]) -> np.ndarray:
  n = len(source)
  out = np.zeros((n,), np.int64)
  chunk = 4096
  for start in range(0, n, chunk):
    idx = np.arange(start, min(n, start + chunk))
    for i, r in zip(idx, _read(source, idx)):
      try:
        out[i] = length_fn(r)
      except KeyError as e:
        raise ValueError(f"record {i} of {_name(source)}: missing field {e.args[0]!r}") from None
      except ValueError as e:
        raise ValueError(f"record {i} of {_name(source)}: {e}") from None
  return out


def prompt_batches(source, tokenizer, *, global_batch_size: int, max_prompt_len: int,
                   seed: int = 0, shuffle: bool = True, num_epochs: int | None = None,
                   drop_remainder: bool = True, overlong: str = "drop", add_bos: bool = True,
                   process_index: int = 0, process_count: int = 1) -> BatchIterator:
  """Rollout batches (see the module docstring for the layout).

  Training: the defaults (shuffled, endless). Evaluation on a held-out split: `shuffle=False,
  num_epochs=1, drop_remainder=False`, where the last batch is padded with `valid=False` rows.
  """
  def length(record):
    return len(_prompt_ids(tokenizer, record["prompt"], "prompt", add_bos))

  def make(records):
    prompts = [r["prompt"] for r in records]
    tokens, lengths = encode_prompts(prompts, tokenizer, max_prompt_len, add_bos)
    return dict(prompt_tokens=tokens, prompt_lengths=lengths, **record_fields(records))

  return BatchIterator(source, make, _lengths(source, length), limit=max_prompt_len,
                       limit_name="config.data.max_prompt_len",
                       global_batch_size=global_batch_size, seed=seed,
                       shuffle=shuffle, num_epochs=num_epochs, drop_remainder=drop_remainder,
                       overlong=overlong, process_index=process_index, process_count=process_count)


def sft_batches(source, tokenizer, *, global_batch_size: int, max_seq_len: int, seed: int = 0,
                shuffle: bool = True, num_epochs: int | None = None, drop_remainder: bool = True,
                overlong: str = "drop", add_bos: bool = True, process_index: int = 0,
                process_count: int = 1, answer_field: str = "answer") -> BatchIterator:
  """Supervised batches: `make_sft_batch`'s arrays plus the record fields, `index` and `valid`.

  A record without an answer cannot teach anything and is an error naming the record.
  """
  def answer_of(record):
    a = record.get(answer_field, "")
    if not a:
      raise ValueError(f"no {answer_field!r} to fine-tune on "
                       f"(prompt {record.get('prompt', '')[:60]!r})")
    return a

  def length(record):
    return (len(_prompt_ids(tokenizer, record["prompt"], "prompt", add_bos))
            + len(_encode(tokenizer, answer_of(record), "answer")) + 1)

  def make(records):
    batch = make_sft_batch([r["prompt"] for r in records], [answer_of(r) for r in records],
                           tokenizer, max_seq_len, add_bos)
    batch.update(record_fields(records))
    return batch

  return BatchIterator(source, make, _lengths(source, length), limit=max_seq_len,
                       limit_name="config.data.max_prompt_len + config.rloo.max_new_tokens",
                       global_batch_size=global_batch_size, seed=seed,
                       shuffle=shuffle, num_epochs=num_epochs, drop_remainder=drop_remainder,
                       overlong=overlong, process_index=process_index, process_count=process_count)

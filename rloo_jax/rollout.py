"""One rollout: sample k completions per prompt, decode them to text, score them on the host,
and lay the result out as the typed rows the reference pass and the update read.

Two row layouts, chosen once by `config.train.shared_prefix`:
- `GroupedRows`: each prompt once ([B, P], left-padded) beside its k completions ([B*k, T]); the
  forwards compute the prompt once per group (`Transformer.grouped`).
- `SequenceRows`: B*k rows of [left-padded prompt | completion] ([B*k, P + T]).
Row n of the completion arrays is sample j of prompt b, n = b * k + j, in both.
"""

from __future__ import annotations

import time
from typing import Any, Callable, ClassVar, Mapping, Optional

from flax import struct
import jax
import jax.numpy as jnp
import numpy as np

from rloo_jax import advantage, head_loss, sampler, sampler_args
from rloo_jax.data import pipeline
from rloo_jax.rewards import overlong

# Fields of a data batch that are not reward-function fields.
_BATCH_KEYS = ("prompt_tokens", "prompt_lengths", "prompt", "index", "valid")


def left_padded_prompts(prompt_tokens_bp, prompt_lengths_b):
  """Prompts moved to the right end of their P columns: (tokens, positions, mask), all [B, P].

  Left-padding puts every completion at the same offset P, so the logits predicting completion
  token t are always at P - 1 + t; RoPE sees the true positions."""
  p = prompt_tokens_bp.shape[1]
  shift_b = p - prompt_lengths_b
  idx_bp = sampler.left_pad_index(prompt_lengths_b, p)
  left_bp = jnp.take_along_axis(prompt_tokens_bp, idx_bp, axis=1)
  pmask_bp = jnp.arange(p)[None, :] >= shift_b[:, None]
  ppos_bp = jnp.maximum(jnp.arange(p)[None, :] - shift_b[:, None], 0)
  return left_bp.astype(jnp.int32), ppos_bp.astype(jnp.int32), pmask_bp


def completion_positions(prompt_lengths_b, k: int, t: int):
  """Positions [B*k, T] of the completions' tokens: each continues its prompt's true length."""
  return (jnp.repeat(prompt_lengths_b, k, axis=0)[:, None] + jnp.arange(t)[None, :]).astype(
      jnp.int32)


def completion_logits(fns, params, tokens_ns, positions_ns, mask_ns, t: int):
  """Logits [N, T, V] predicting the last T tokens of [prompt | completion] rows.

  The last column is not fed: its hidden state predicts nothing scored, and under the causal
  mask no earlier position sees it."""
  s = tokens_ns.shape[1] - 1
  return fns.forward(params, tokens_ns[:, :s], positions_ns[:, :s], mask_ns[:, :s],
                     head_slice=(s - t, t))


@struct.dataclass
class SequenceRows(head_loss.DenseHead):
  """B*k rows of [left-padded prompt | completion]; S = P + T."""
  tokens_ns: jax.Array            # int32 [N, S]
  positions_ns: jax.Array         # int32 [N, S]
  mask_ns: jax.Array              # bool [N, S]
  completions_nt: jax.Array       # int32 [N, T]
  cmask_nt: jax.Array             # bool [N, T]: completion tokens up to and including EOS
  old_logp_nt: jax.Array          # float32 [N, T]: log-probs under the policy that sampled
  advantages_n: jax.Array         # float32 [N] (zeros until the advantages are computed)
  # config.loss.old_logprobs='recompute': the sampler's log-probs, old_logp_nt then holding the
  # trainer's recomputation of them (the ratio's old policy); None otherwise.
  sampler_logp_nt: Optional[jax.Array] = None
  grouped: ClassVar[bool] = False

  @property
  def num_units(self) -> int:
    """What a minibatch shuffle permutes: single samples."""
    return self.completions_nt.shape[0]

  def logits(self, fns, params):
    """Logits [N, T, V] predicting `completions_nt` (values [N, T] of a scalar head)."""
    return completion_logits(fns, params, self.tokens_ns, self.positions_ns, self.mask_ns,
                             self.completions_nt.shape[1])

  def hidden(self, fns, params):
    """Hidden states [N, T, E] (before the final norm) predicting `completions_nt`."""
    s = self.tokens_ns.shape[1] - 1
    t = self.completions_nt.shape[1]
    return fns.hidden(params, self.tokens_ns[:, :s], self.positions_ns[:, :s],
                      self.mask_ns[:, :s], head_slice=(s - t, t))

  def take(self, idx, k: int) -> "SequenceRows":
    del k
    return jax.tree.map(lambda x: x[idx], self)

  def microbatches(self, m: int, k: int) -> "SequenceRows":
    del k
    return _split_units(self, m, lambda x: 1)


@struct.dataclass
class GroupedRows(head_loss.DenseHead):
  """Each prompt once beside its k completions (`Transformer.grouped`)."""
  prompt_tokens_bp: jax.Array         # int32 [B, P], left-padded
  prompt_positions_bp: jax.Array      # int32 [B, P]
  prompt_mask_bp: jax.Array           # bool [B, P]
  completion_positions_nt: jax.Array  # int32 [N, T]
  completions_nt: jax.Array           # int32 [N, T]
  cmask_nt: jax.Array                 # bool [N, T]
  old_logp_nt: jax.Array              # float32 [N, T]
  advantages_n: jax.Array             # float32 [N]
  sampler_logp_nt: Optional[jax.Array] = None  # as SequenceRows'
  grouped: ClassVar[bool] = True

  @property
  def num_units(self) -> int:
    """What a minibatch shuffle permutes: whole groups (a prompt and its k samples)."""
    return self.prompt_tokens_bp.shape[0]

  def _prompt_and_rows(self):
    return (self.prompt_tokens_bp, self.prompt_positions_bp, self.prompt_mask_bp,
            self.completions_nt, self.completion_positions_nt, self.cmask_nt)

  def logits(self, fns, params):
    """Logits [N, T, V] predicting `completions_nt` (values [N, T] of a scalar head)."""
    return fns.grouped(params, *self._prompt_and_rows())

  def hidden(self, fns, params):
    """Hidden states [N, T, E] (before the final norm) predicting `completions_nt`."""
    return fns.grouped_hidden(params, *self._prompt_and_rows())

  def microbatches(self, m: int, k: int) -> "GroupedRows":
    return _split_units(self, m, lambda x: 1 if x.shape[0] == self.num_units else k)

  def take(self, group_idx, k: int) -> "GroupedRows":
    """Whole groups: prompt arrays at group_idx, sample rows at group_idx * k + 0..k-1."""
    sample_idx = (group_idx[:, None] * k + jnp.arange(k)[None, :]).reshape(-1)
    prompt = lambda x: x[group_idx]
    sample = lambda x: x[sample_idx]
    return GroupedRows(
        prompt(self.prompt_tokens_bp), prompt(self.prompt_positions_bp),
        prompt(self.prompt_mask_bp), sample(self.completion_positions_nt),
        sample(self.completions_nt), sample(self.cmask_nt), sample(self.old_logp_nt),
        sample(self.advantages_n),
        None if self.sampler_logp_nt is None else sample(self.sampler_logp_nt))


def logprobs(rows, fns, params, *, chunk_size: int, with_entropy: bool = False):
  """(log-probs [N, T], entropies [N, T] or None) of the rows' completions, float32: the rows'
  own `logprobs`."""
  return rows.logprobs(fns, params, chunk_size=chunk_size, with_entropy=with_entropy)


def _split_units(rows, m: int, rows_per_unit):
  """Every field [U * r, ...] -> [m, U / m * r, ...] (r = rows_per_unit(field): 1 for per-unit
  fields, k for a group's samples). Microbatch i holds units i, i + m, i + 2m, ...: with the
  units split over devices in contiguous blocks, each microbatch is then split over every
  device with no data moved."""
  units = rows.num_units
  if units % m:
    raise ValueError(f"{units} rollout units do not split into {m} microbatches")

  def split(x):
    r = rows_per_unit(x)
    y = x.reshape(units // m, m, r, *x.shape[1:]).swapaxes(0, 1)
    return y.reshape(m, units // m * r, *x.shape[1:])
  return jax.tree.map(split, rows)


def make_rows(prompt_tokens_bp, prompt_lengths_b, completions_nt, cmask_nt, old_logp_nt, *,
              k: int, shared_prefix: bool):
  """The rollout's rows in the configured layout, advantages zero (filled by the scoring pass).
  Pure; jitted by the caller with k and shared_prefix static."""
  left_bp, ppos_bp, pmask_bp = left_padded_prompts(prompt_tokens_bp, prompt_lengths_b)
  cpos_nt = completion_positions(prompt_lengths_b, k, completions_nt.shape[1])
  adv_n = jnp.zeros(completions_nt.shape[:1], jnp.float32)
  old_logp_nt = old_logp_nt.astype(jnp.float32)
  if shared_prefix:
    return GroupedRows(left_bp, ppos_bp, pmask_bp, cpos_nt, completions_nt.astype(jnp.int32),
                       cmask_nt, old_logp_nt, adv_n)
  rep = lambda x: jnp.repeat(x, k, axis=0)
  return SequenceRows(
      tokens_ns=jnp.concatenate([rep(left_bp), completions_nt], axis=1).astype(jnp.int32),
      positions_ns=jnp.concatenate([rep(ppos_bp), cpos_nt], axis=1).astype(jnp.int32),
      mask_ns=jnp.concatenate([rep(pmask_bp), cmask_nt], axis=1),
      completions_nt=completions_nt.astype(jnp.int32), cmask_nt=cmask_nt,
      old_logp_nt=old_logp_nt, advantages_n=adv_n)


# ----------------------------------------------------------------------------------------------
# Host side: sampling, decoding, rewards


def stop_ids(tokenizer) -> tuple[int, ...]:
  """Every id that ends a completion: the tokenizer's `stop_ids`, else (eos_id,); (-1,), which
  matches no token, for a tokenizer without EOS (its completions run to max_new_tokens)."""
  ids = getattr(tokenizer, "stop_ids", None)
  if not ids:
    ids = () if tokenizer.eos_id is None else (tokenizer.eos_id,)
  return tuple(int(i) for i in ids) or (-1,)


def decode_completions(tokenizer, tokens_nt, lengths_n) -> list[str]:
  """Each completion's text, cut at its first stop id (the end token is not part of the text)."""
  stops = set(stop_ids(tokenizer))
  out = []
  for row, n in zip(np.asarray(tokens_nt), np.asarray(lengths_n)):
    ids = [int(t) for t in row[:n]]
    cut = next((i for i, t in enumerate(ids) if t in stops), len(ids))
    out.append(tokenizer.decode(ids[:cut]))
  return out


def reward_fields(batch: Mapping[str, Any], k: int) -> dict[str, np.ndarray]:
  """Every data field besides the prompt itself, repeated for the k samples of each prompt."""
  return {name: np.repeat(np.asarray(v), k, axis=0) for name, v in batch.items()
          if name not in _BATCH_KEYS}


def sample_output(exp, params, batch: Mapping[str, Any], rng, *, k: int, method=None, slots=0
                  ) -> sampler.SampleOutput:
  """k completions per prompt of a data batch (this process's rows), sampled on the mesh: the
  SampleOutput of the global batch, its tokens left on the devices.

  With `config.rloo.rollout_chunk_prompts` = C below the global batch, the batch is sampled in
  consecutive chunks of C prompts (`sample_chunked`), so the KV cache holds only C prompts at
  once; the output has the same shapes, layout and row order as an unchunked one. With
  config.rloo.rollout_engine the batch streams through the engine's C * k slots (or `slots`)."""
  b = batch["prompt_tokens"].shape[0] * jax.process_count()
  chunk = sampler_args.chunk_prompts(exp.config.rloo, b)
  if chunk < b and not slots:
    return sample_chunked(exp, params, batch, rng, k=k, method=method, chunk_prompts=chunk)
  slots = slots or sampler_args.chunk_engine_slots(exp.config.rloo, b)  # a chunk's KV
  return _sample_rows(exp, params, batch["prompt_tokens"], batch["prompt_lengths"], rng, k=k,
                      method=method, slots=slots)


def completion_texts(exp, out: sampler.SampleOutput) -> list[str]:
  """This process's completions of `out` as text (fetched from the devices, then decoded)."""
  layout = exp.layout
  lengths_n = layout.local_rows(out.lengths_bk).reshape(-1)
  tokens_nt = layout.local_rows(out.tokens_bkt).reshape(lengths_n.shape[0], -1)
  return decode_completions(exp.tokenizer, tokens_nt, lengths_n)


def sample_batch(exp, params, batch: Mapping[str, Any], rng, *, k: int, method=None):
  """`sample_output` and its `completion_texts`: (SampleOutput of the global batch, this
  process's completions as text)."""
  out = sample_output(exp, params, batch, rng, k=k, method=method)
  return out, completion_texts(exp, out)


def rollout(exp, params, batch: Mapping[str, Any], rng, *, k: int, method=None, rewards=None,
            on_sampled: Optional[Callable] = None, slots: int = 0):
  """Samples k completions per prompt (`slots`: `sample_output`'s) and scores them with a reward
  set (host side). Each process scores its own rows. `on_sampled(out)`, when given, runs
  between the sampling and the rewards: device work it dispatches, such as the reference pass,
  runs while the host scores. Returns (SampleOutput, rewards [B, k] of the global batch, this
  process's completions, {function name: global scores [B*k]})."""
  rewards = rewards or exp.rewards
  out = sample_output(exp, params, batch, rng, k=k, method=method, slots=slots)
  if on_sampled is not None:
    on_sampled(out)
  # Fetched and detokenised after on_sampled, so that the device work it dispatched overlaps
  # this host work too, not only the reward functions.
  completions = completion_texts(exp, out)
  b = batch["prompt_tokens"].shape[0]
  prompts = list(np.repeat(np.asarray(batch["prompt"], object), k))
  rewards_n, parts = rewards(prompts, completions, reward_fields(batch, k))
  layout = exp.layout
  parts = {name: layout.gather_rows(v) for name, v in parts.items()}
  return out, layout.gather_rows(rewards_n.reshape(b, k)), completions, parts


def timed_rollout(exp, params, batch: Mapping[str, Any], rng, *, k: int,
                  on_sampled: Optional[Callable] = None):
  """The rollout and its validated rewards, timed: the first half of every on-policy iteration.

  `on_sampled(out)` runs once the completions are sampled, before the rewards (`rollout`).
  Returns (sample output, rewards [B, k] float32, usable mask, number masked as non-finite,
  per-function scores, {'rollout_s': sampling, 'reward_s': the host's work after it (fetching
  and detokenising the completions, the reward functions), which on_sampled's device work
  overlaps}, on_sampled's result or None)."""
  t0 = time.perf_counter()
  timings, dispatched = {}, []

  def sampled(out):
    jax.block_until_ready(out.tokens_bkt)
    timings["rollout_s"] = time.perf_counter() - t0
    dispatched.append(on_sampled(out) if on_sampled is not None else None)

  out, raw_rewards_bk, _, parts = rollout(exp, params, batch, jax.random.fold_in(rng, 0), k=k,
                                          on_sampled=sampled)
  rewards_bk, usable_bk, num_nonfinite = advantage.prepare_rewards(
      raw_rewards_bk, nan_policy=exp.config.rewards.nan_policy)
  r = exp.config.rewards
  if r.get("overlong_buffer", 0):
    shaped = r.get("overlong_penalty", 1.0) * overlong.penalty(
        exp.layout.gather(out.lengths_bk), exp.config.rloo.max_new_tokens, r.overlong_buffer)
    rewards_bk = np.where(usable_bk, rewards_bk + shaped, rewards_bk).astype(np.float32)
    parts = dict(parts, overlong=shaped.reshape(-1))
  timings["reward_s"] = time.perf_counter() - t0 - timings["rollout_s"]
  return out, rewards_bk, usable_bk, num_nonfinite, parts, timings, dispatched[0]


def sample_records(exp, params, records, rng, *, k: int, method, batch_size: int
                   ) -> list[list[str]]:
  """k completions (decoded text) per record, in record order, with one compiled batch shape;
  records whose prompt exceeds config.data.max_prompt_len get an empty list. One process (the
  RLHF pipeline's and DPO's pair building)."""
  c = exp.config
  out: list[list[str]] = [[] for _ in records]
  batches = pipeline.prompt_batches(list(records), exp.tokenizer, global_batch_size=batch_size,
                                    max_prompt_len=c.data.max_prompt_len, shuffle=False,
                                    num_epochs=1, drop_remainder=False, overlong="drop")
  for i, batch in enumerate(batches):
    _, texts = sample_batch(exp, params, batch, jax.random.fold_in(rng, i), k=k, method=method)
    for row, (index, valid) in enumerate(zip(batch["index"], batch["valid"])):
      if valid:
        out[int(index)] = texts[row * k:(row + 1) * k]
  return out


def _sample_rows(exp, params, prompt_tokens, prompt_lengths, rng, *, k: int, method=None,
                 slots: int = 0):
  """`sampler.sample` of this process's prompt rows (host numpy), placed over the batch axes
  (`slots`: the engine's, in place of config.rloo.rollout_slots)."""
  c, layout = exp.config, exp.layout
  options = sampler_args.decode_options(exp)
  options["slots"] = slots or options["slots"]
  return sampler.sample(exp.fns, params, layout.shard_batch(prompt_tokens),
                        layout.shard_batch(prompt_lengths), rng,
                        k=k, max_new_tokens=c.rloo.max_new_tokens,
                        method=method or exp.method, eos_id=stop_ids(exp.tokenizer),
                        pad_id=exp.tokenizer.pad_id, mode=c.rloo.sampler_mode,
                        max_seq_len=exp.model_config.max_seq_len,
                        batch_sharding=layout.batch_sharding, **options)


def sample_chunked(exp, params, batch: Mapping[str, Any], rng, *, k: int, method=None,
                   chunk_prompts: int) -> sampler.SampleOutput:
  """The batch sampled in consecutive chunks of `chunk_prompts` global prompts (each process
  contributes chunk_prompts / process_count of its own rows to every chunk), concatenated into
  one SampleOutput of the global batch with the batch sharding (params already gathered).

  Chunk i draws with fold_in(rng, i): the samples differ from an unchunked draw with `rng`, but
  not their distribution (every stream still has its own independent key). A last chunk of
  fewer prompts compiles the sampler for one more batch shape."""
  layout = exp.layout
  procs = jax.process_count()
  if chunk_prompts % layout.batch_parallelism or chunk_prompts % procs:
    raise ValueError(
        f"config.rloo.rollout_chunk_prompts = {chunk_prompts} must be a multiple of the batch "
        f"parallelism {layout.batch_parallelism} (mesh axes {layout.batch_axes}) and of the "
        f"{procs} processes")
  local = chunk_prompts // procs
  tokens, lengths = np.asarray(batch["prompt_tokens"]), np.asarray(batch["prompt_lengths"])
  local_outs = []
  for i, start in enumerate(range(0, tokens.shape[0], local)):
    out = _sample_rows(exp, params, tokens[start:start + local], lengths[start:start + local],
                       jax.random.fold_in(rng, i), k=k, method=method)
    # Concatenated on each process's host rows: the rows of chunk i of process p are global
    # rows of chunk i, so a device-side concatenation of the chunks would interleave processes.
    local_outs.append(jax.tree.map(layout.local_rows, out))
  return jax.tree.map(lambda *xs: layout.shard_batch(np.concatenate(xs, axis=0)), *local_outs)


# ----------------------------------------------------------------------------------------------
# Trimming the completion columns past the longest sample (scoring and update only)


def trimmed_length(max_len: int, bucket: int, t: int) -> int:
  """The columns to keep of a T-column rollout whose longest completion has max_len tokens:
  max(max_len, 1) rounded up to a multiple of `bucket` and capped at T; T when bucket is 0
  (off). Rounding to buckets bounds the shapes the scoring and update programs compile for to
  ceil(T / bucket) (a 0 rounds up too, rather than adding a shape of one column)."""
  if bucket <= 0:
    return t
  return min(t, -(-max(int(max_len), 1) // bucket) * bucket)


def trim_output(out: sampler.SampleOutput, t_new: int) -> sampler.SampleOutput:
  """The sample output cut to its first t_new completion columns (lengths unchanged). Only
  columns past every sample's end may go: there the mask is False, so any masked loss, KL or
  gradient is the same on the trimmed output."""
  if t_new == out.tokens_bkt.shape[2]:
    return out
  cut = lambda x: x[:, :, :t_new]
  return out.replace(tokens_bkt=cut(out.tokens_bkt), logprobs_bkt=cut(out.logprobs_bkt),
                     policy_logprobs_bkt=cut(out.policy_logprobs_bkt),
                     mask_bkt=cut(out.mask_bkt))


def trim_to_bucket(layout, out: sampler.SampleOutput, bucket: int) -> sampler.SampleOutput:
  """`trim_output` to `trimmed_length` of the longest completion of the global batch; every
  process computes the same length from the gathered lengths, so all compile the same shape."""
  if bucket <= 0:
    return out
  longest = int(layout.gather(out.lengths_bk).max())
  return trim_output(out, trimmed_length(longest, bucket, out.tokens_bkt.shape[2]))

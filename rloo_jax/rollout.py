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
from typing import Any, ClassVar, Mapping

from flax import struct
import jax
import jax.numpy as jnp
import numpy as np

from rloo_jax import advantage, sampler
from rloo_jax.data import pipeline

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
class SequenceRows:
  """B*k rows of [left-padded prompt | completion]; S = P + T."""
  tokens_ns: jax.Array            # int32 [N, S]
  positions_ns: jax.Array         # int32 [N, S]
  mask_ns: jax.Array              # bool [N, S]
  completions_nt: jax.Array       # int32 [N, T]
  cmask_nt: jax.Array             # bool [N, T]: completion tokens up to and including EOS
  old_logp_nt: jax.Array          # float32 [N, T]: log-probs under the policy that sampled
  advantages_n: jax.Array         # float32 [N] (zeros until the advantages are computed)
  grouped: ClassVar[bool] = False

  @property
  def num_units(self) -> int:
    """What a minibatch shuffle permutes: single samples."""
    return self.completions_nt.shape[0]

  def logits(self, fns, params):
    """Logits [N, T, V] predicting `completions_nt`."""
    return completion_logits(fns, params, self.tokens_ns, self.positions_ns, self.mask_ns,
                             self.completions_nt.shape[1])

  def take(self, idx, k: int) -> "SequenceRows":
    del k
    return jax.tree.map(lambda x: x[idx], self)


@struct.dataclass
class GroupedRows:
  """Each prompt once beside its k completions (`Transformer.grouped`)."""
  prompt_tokens_bp: jax.Array         # int32 [B, P], left-padded
  prompt_positions_bp: jax.Array      # int32 [B, P]
  prompt_mask_bp: jax.Array           # bool [B, P]
  completion_positions_nt: jax.Array  # int32 [N, T]
  completions_nt: jax.Array           # int32 [N, T]
  cmask_nt: jax.Array                 # bool [N, T]
  old_logp_nt: jax.Array              # float32 [N, T]
  advantages_n: jax.Array             # float32 [N]
  grouped: ClassVar[bool] = True

  @property
  def num_units(self) -> int:
    """What a minibatch shuffle permutes: whole groups (a prompt and its k samples)."""
    return self.prompt_tokens_bp.shape[0]

  def logits(self, fns, params):
    return fns.grouped(params, self.prompt_tokens_bp, self.prompt_positions_bp,
                       self.prompt_mask_bp, self.completions_nt, self.completion_positions_nt,
                       self.cmask_nt)

  def take(self, group_idx, k: int) -> "GroupedRows":
    """Whole groups: prompt arrays at group_idx, sample rows at group_idx * k + 0..k-1."""
    sample_idx = (group_idx[:, None] * k + jnp.arange(k)[None, :]).reshape(-1)
    prompt = lambda x: x[group_idx]
    sample = lambda x: x[sample_idx]
    return GroupedRows(
        prompt(self.prompt_tokens_bp), prompt(self.prompt_positions_bp),
        prompt(self.prompt_mask_bp), sample(self.completion_positions_nt),
        sample(self.completions_nt), sample(self.cmask_nt), sample(self.old_logp_nt),
        sample(self.advantages_n))


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


def decode_completions(tokenizer, tokens_nt, lengths_n) -> list[str]:
  eos = tokenizer.eos_id
  out = []
  for row, n in zip(np.asarray(tokens_nt), np.asarray(lengths_n)):
    out.append(tokenizer.decode([int(t) for t in row[:n] if int(t) != eos]))
  return out


def reward_fields(batch: Mapping[str, Any], k: int) -> dict[str, np.ndarray]:
  """Every data field besides the prompt itself, repeated for the k samples of each prompt."""
  return {name: np.repeat(np.asarray(v), k, axis=0) for name, v in batch.items()
          if name not in _BATCH_KEYS}


def sample_batch(exp, params, batch: Mapping[str, Any], rng, *, k: int, method=None):
  """k completions per prompt of a data batch (this process's rows), sampled on the mesh.

  Returns (SampleOutput of the global batch, this process's completions as text)."""
  c, layout = exp.config, exp.layout
  if exp.compute_shardings is not None:
    # FSDP: gather the policy over fsdp once for the whole decode loop (freed after sampling),
    # rather than once per generated token.
    params = jax.device_put(params, exp.compute_shardings)
  out = sampler.sample(exp.fns, params, layout.shard_batch(batch["prompt_tokens"]),
                       layout.shard_batch(batch["prompt_lengths"]), rng,
                       k=k, max_new_tokens=c.rloo.max_new_tokens,
                       method=method or exp.method, eos_id=exp.tokenizer.eos_id,
                       pad_id=exp.tokenizer.pad_id, mode=c.rloo.sampler_mode,
                       max_seq_len=exp.model_config.max_seq_len,
                       batch_sharding=layout.batch_sharding)
  b = batch["prompt_tokens"].shape[0]
  tokens_nt = layout.local_rows(out.tokens_bkt).reshape(b * k, -1)
  lengths_n = layout.local_rows(out.lengths_bk).reshape(-1)
  return out, decode_completions(exp.tokenizer, tokens_nt, lengths_n)


def rollout(exp, params, batch: Mapping[str, Any], rng, *, k: int, method=None, rewards=None):
  """Samples k completions per prompt and scores them with a reward set (host side).

  Each process scores its own rows. Returns (SampleOutput, rewards [B, k] of the global batch,
  this process's completions, {function name: global scores [B*k]})."""
  rewards = rewards or exp.rewards
  out, completions = sample_batch(exp, params, batch, rng, k=k, method=method)
  b = batch["prompt_tokens"].shape[0]
  prompts = list(np.repeat(np.asarray(batch["prompt"], object), k))
  rewards_n, parts = rewards(prompts, completions, reward_fields(batch, k))
  layout = exp.layout
  parts = {name: layout.gather_rows(v) for name, v in parts.items()}
  return out, layout.gather_rows(rewards_n.reshape(b, k)), completions, parts


def timed_rollout(exp, params, batch: Mapping[str, Any], rng, *, k: int):
  """The rollout and its validated rewards, timed: the first half of every on-policy iteration.

  Returns (sample output, rewards [B, k] float32, usable mask, number masked as non-finite,
  per-function scores, {'rollout_s', 'reward_s'})."""
  t0 = time.perf_counter()
  out, raw_rewards_bk, _, parts = rollout(exp, params, batch, jax.random.fold_in(rng, 0), k=k)
  jax.block_until_ready(out.tokens_bkt)
  timings = {"rollout_s": time.perf_counter() - t0}
  t0 = time.perf_counter()
  rewards_bk, usable_bk, num_nonfinite = advantage.prepare_rewards(
      raw_rewards_bk, nan_policy=exp.config.rewards.nan_policy)
  timings["reward_s"] = time.perf_counter() - t0
  return out, rewards_bk, usable_bk, num_nonfinite, parts, timings


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

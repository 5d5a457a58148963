"""Packed updates (`config.train.microbatch_tokens`): a minibatch's groups packed into rows of a
token budget, so the update computes no column past a completion's end.

A group sits in a row as [its prompt but the last token | for each of its k completions: the
prompt's last token, then the completion's tokens but the last], with segment ids: completion j's
tokens read the group's prompt (their shared segment) and their own earlier tokens, nothing else.
Each position then predicts exactly one completion token, so the log-probs come from the packed
hidden states in one pass of the head; the prompt's last token runs once per completion (k tokens
a group), the rest of the prompt once.

Groups go to rows first-fit-decreasing (`plan`, on the host from the completion lengths). A
microbatch is one row per batch shard; the gradient program loops over the microbatches in use
(`PackedRows.accumulate`, a `lax.fori_loop` whose count is data), so a new packing never
recompiles. Each microbatch's loss reads the minibatch's [N, T] arrays with the other
microbatches' samples masked out and the whole minibatch's normaliser: summed over the
microbatches, the loss and gradient are the unpacked ones.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from flax import struct
import jax
import jax.numpy as jnp
import numpy as np

from rloo_jax import head_loss, loss

# The segment of a row's unused tail: above any group's, so ids never decrease along a row.
PAD_SEGMENT = 2**30


def min_tokens(max_prompt_len: int, k: int, max_new_tokens: int) -> int:
  """The smallest budget every group fits: its prompt and k completions at full length."""
  return max_prompt_len - 1 + k * max_new_tokens


def group_tokens(prompt_lengths_b, lengths_n, k: int) -> np.ndarray:
  """Tokens each group takes in a packed row (prompt lengths [B], completion lengths [B*k])."""
  lengths_bk = np.asarray(lengths_n).reshape(-1, k)
  return np.asarray(prompt_lengths_b) - 1 + lengths_bk.sum(1)


class Plan(NamedTuple):
  """Where each group goes: row `shard_b` (0..rows-1) of microbatch `microbatch_b`, from column
  `offset_b`, the `slot_b`-th group of its row; `count` microbatches in use."""
  shard_b: np.ndarray
  microbatch_b: np.ndarray
  offset_b: np.ndarray
  slot_b: np.ndarray
  count: int


def plan(prompt_lengths_b, lengths_n, *, k: int, budget: int, rows: int) -> Plan:
  """First-fit-decreasing of the groups into rows of `budget` tokens, `rows` rows a microbatch."""
  sizes = group_tokens(prompt_lengths_b, lengths_n, k)
  if sizes.max() > budget:
    raise ValueError(f"a group of {int(sizes.max())} tokens does not fit "
                     f"config.train.microbatch_tokens={budget}; set it to at least "
                     "max_prompt_len - 1 + k * max_new_tokens")
  free: list[int] = []
  where = np.zeros((len(sizes), 3), np.int64)  # bin, offset, slot
  groups: list[int] = []
  for b in np.argsort(-sizes, kind="stable"):
    fits = np.nonzero(np.asarray(free) >= sizes[b])[0] if free else ()
    if len(fits):
      i = int(fits[0])
    else:
      i = len(free)
      free.append(budget)
      groups.append(0)
    where[b] = (i, budget - free[i], groups[i])
    free[i] -= int(sizes[b])
    groups[i] += 1
  bins = where[:, 0]
  i32 = lambda x: np.asarray(x, np.int32)  # noqa: E731
  return Plan(i32(bins % rows), i32(bins // rows), i32(where[:, 1]), i32(where[:, 2]),
              -(-len(free) // rows))


def padding_fraction(prompt_lengths_b, lengths_n, *, k: int, budget: int, rows: int) -> float:
  """The fraction of the packed microbatches' tokens that are padding."""
  p = plan(prompt_lengths_b, lengths_n, k=k, budget=budget, rows=rows)
  used = group_tokens(prompt_lengths_b, lengths_n, k).sum()
  return float(1.0 - used / (p.count * rows * budget))


@struct.dataclass
class PackedMicrobatch:
  """One microbatch: `rows` packed rows [D, L] and the minibatch's [N, T] arrays, samples of other
  microbatches masked out (their mask and advantages zero)."""
  tokens_dl: jax.Array
  positions_dl: jax.Array
  key_ok_dl: jax.Array
  segment_dl: jax.Array
  shared_dl: jax.Array
  target_dl: jax.Array      # int32: the completion token each position predicts (0: none)
  pred_dl: jax.Array        # int32: n * T + t of that token, N * T where none
  start_n: jax.Array        # int32 [N]: flat [D * L] index of completion n's first position
  completions_nt: jax.Array
  cmask_nt: jax.Array
  old_logp_nt: jax.Array
  advantages_n: jax.Array

  def hidden(self, fns, params):
    """Hidden states [D, L, E] (before the final norm) of the packed rows."""
    return fns.hidden(params, self.tokens_dl, self.positions_dl, self.key_ok_dl,
                      segments=(self.segment_dl, self.shared_dl))

  def _to_nt(self, x_dl):
    """[D, L] per-position values -> [N, T], zero where `cmask_nt` is False."""
    t = self.completions_nt.shape[1]
    idx = jnp.clip(self.start_n[:, None] + jnp.arange(t)[None, :], 0, x_dl.size - 1)
    return jnp.where(self.cmask_nt, x_dl.reshape(-1)[idx], 0.0)

  def logprobs(self, fns, params, *, chunk_size: int, with_entropy: bool = False):
    """(log-probs [N, T], entropies [N, T] or None), float32, as `rollout.logprobs`."""
    logp, ent = loss.chunked_logprobs(fns.head, fns.head_params(params), self.hidden(fns, params),
                                      self.target_dl, self.pred_dl < self.cmask_nt.size,
                                      chunk_size=chunk_size, with_entropy=with_entropy)
    return self._to_nt(logp), None if ent is None else self._to_nt(ent)

  def linear_loss(self, fns, params, coef_nt, *, chunk_size: int):
    """(sum of coef_nt * log-probs, log-probs [N, T], entropies [N, T]) by
    `head_loss.linear_logprob_loss` over the packed positions."""
    coef_dl = jnp.append(coef_nt.reshape(-1), 0.0)[self.pred_dl]
    value, logp, ent = head_loss.linear_logprob_loss(
        fns.head, fns.head_params(params), self.hidden(fns, params), self.target_dl, coef_dl,
        chunk_size=chunk_size, with_entropy=True)
    return value, self._to_nt(logp), self._to_nt(ent)


@struct.dataclass
class PackedRows:
  """A minibatch packed: [D, M, L] rows (D rows a microbatch, up to M microbatches of which
  `count_d` (every entry the same) are in use), `microbatch_n` [N] the microbatch of each sample,
  and the minibatch's [N, T] arrays. Laid out so that a batch sharding of the leading axis puts
  each microbatch's D rows on the D batch shards."""
  tokens_dml: jax.Array
  positions_dml: jax.Array
  key_ok_dml: jax.Array
  segment_dml: jax.Array
  shared_dml: jax.Array
  target_dml: jax.Array
  pred_dml: jax.Array
  microbatch_n: jax.Array
  start_n: jax.Array
  count_d: jax.Array
  completions_nt: jax.Array
  cmask_nt: jax.Array
  old_logp_nt: jax.Array
  advantages_n: jax.Array

  def microbatch(self, i) -> PackedMicrobatch:
    rows = [x[:, i] for x in (self.tokens_dml, self.positions_dml, self.key_ok_dml,
                               self.segment_dml, self.shared_dml, self.target_dml, self.pred_dml)]
    mine = self.microbatch_n == i
    return PackedMicrobatch(*rows, self.start_n, self.completions_nt,
                            self.cmask_nt & mine[:, None], self.old_logp_nt,
                            jnp.where(mine, self.advantages_n, 0.0))

  def accumulate(self, fn, constrain=lambda x: x):
    """The sum of `fn(microbatch)` (a pytree of arrays) over the microbatches in use."""
    zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype),
                         jax.eval_shape(fn, self.microbatch(0)))

    def body(i, total):
      return jax.tree.map(jnp.add, total, fn(constrain(self.microbatch(i))))

    return jax.lax.fori_loop(0, self.count_d[0], body, zeros)


def pack(rows, shard_b, microbatch_b, offset_b, slot_b, count, *, k: int, budget: int,
         rows_per_microbatch: int, max_microbatches: int) -> PackedRows:
  """`rollout.GroupedRows` (a minibatch) packed by a `plan`'s arrays. Pure; jit it with the
  static keywords. Completion masks must be prefixes (tokens up to and including EOS)."""
  b, p = rows.prompt_tokens_bp.shape
  n, t = rows.completions_nt.shape
  d, m, l = rows_per_microbatch, max_microbatches, budget
  total = d * m * l
  rep = lambda x: jnp.repeat(x, k, axis=0)  # noqa: E731
  p_b = rows.prompt_mask_bp.sum(1).astype(jnp.int32)
  len_n = rows.cmask_nt.sum(1).astype(jnp.int32)
  row_b = shard_b * m + microbatch_b
  base_b = row_b * l + offset_b
  # The prompt but its last token: left-padded column c holds prompt token c - (P - p_b).
  rel_bp = jnp.arange(p)[None, :] - (p - p_b)[:, None]
  dest_bp = jnp.where((rel_bp >= 0) & (rel_bp < p_b[:, None] - 1), base_b[:, None] + rel_bp,
                      total)
  # Completion j's segment: [prompt's last token | its tokens but the last], after the earlier
  # completions of its group.
  len_bk = len_n.reshape(b, k)
  before_n = (jnp.cumsum(len_bk, axis=1) - len_bk).reshape(n)
  start_n = rep(base_b + p_b - 1) + before_n
  cols = jnp.arange(t)[None, :]
  dest_nt = jnp.where(cols < len_n[:, None], start_n[:, None] + cols, total)
  first = lambda x_bp: rep(x_bp[:, p - 1])[:, None]  # noqa: E731
  seg_tokens = jnp.concatenate([first(rows.prompt_tokens_bp), rows.completions_nt[:, :t - 1]], 1)
  seg_positions = jnp.concatenate([first(rows.prompt_positions_bp),
                                   rows.completion_positions_nt[:, :t - 1]], 1)
  prompt_seg_b = slot_b * (k + 1)
  own_seg_n = rep(prompt_seg_b) + 1 + jnp.tile(jnp.arange(k, dtype=jnp.int32), b)
  full_nt = lambda x: jnp.broadcast_to(x[:, None], (n, t))  # noqa: E731
  full_bp = lambda x: jnp.broadcast_to(x[:, None], (b, p))  # noqa: E731

  def scatter(prompt_bp, completion_nt, fill, dtype):
    out = jnp.full((total,), fill, dtype)
    out = out.at[dest_bp.reshape(-1)].set(prompt_bp.reshape(-1).astype(dtype), mode="drop")
    out = out.at[dest_nt.reshape(-1)].set(completion_nt.reshape(-1).astype(dtype), mode="drop")
    return out.reshape(d, m, l)

  i32 = jnp.int32
  return PackedRows(
      tokens_dml=scatter(rows.prompt_tokens_bp, seg_tokens, 0, i32),
      positions_dml=scatter(rows.prompt_positions_bp, seg_positions, 0, i32),
      key_ok_dml=scatter(jnp.ones((b, p), bool), jnp.ones((n, t), bool), False, bool),
      segment_dml=scatter(full_bp(prompt_seg_b), full_nt(own_seg_n), PAD_SEGMENT, i32),
      shared_dml=scatter(full_bp(prompt_seg_b), full_nt(rep(prompt_seg_b)), PAD_SEGMENT, i32),
      target_dml=scatter(jnp.zeros((b, p), i32), rows.completions_nt, 0, i32),
      pred_dml=scatter(jnp.full((b, p), n * t, i32),
                       jnp.arange(n * t, dtype=i32).reshape(n, t), n * t, i32),
      microbatch_n=rep(microbatch_b).astype(i32),
      start_n=(rep(shard_b * l + offset_b + p_b - 1) + before_n).astype(i32),
      count_d=jnp.full((d,), count, i32),
      completions_nt=rows.completions_nt, cmask_nt=rows.cmask_nt, old_logp_nt=rows.old_logp_nt,
      advantages_n=rows.advantages_n)


@dataclasses.dataclass(frozen=True)
class Packer:
  """`plan` on the host, then `pack` jitted: `Packer(...)(grouped_rows) -> PackedRows`."""
  k: int
  budget: int
  rows_per_microbatch: int
  max_microbatches: int
  rows_sharding: object = None

  def __post_init__(self):
    static = dict(k=self.k, budget=self.budget, rows_per_microbatch=self.rows_per_microbatch,
                  max_microbatches=self.max_microbatches)
    sh = self.rows_sharding
    object.__setattr__(self, "_pack", jax.jit(
        lambda rows, *plan_arrays: pack(rows, *plan_arrays, **static), out_shardings=sh))

  def plan(self, rows) -> Plan:
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    host = lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True))  # noqa: E731
    return plan(host(rows.prompt_mask_bp.sum(1)), host(rows.cmask_nt.sum(1)), k=self.k,
                budget=self.budget, rows=self.rows_per_microbatch)

  def __call__(self, rows, the_plan: Plan | None = None) -> PackedRows:
    pl = self.plan(rows) if the_plan is None else the_plan
    if pl.count > self.max_microbatches:
      raise ValueError(f"{pl.count} packed microbatches exceed the {self.max_microbatches} "
                       "allotted")
    return self._pack(rows, pl.shard_b, pl.microbatch_b, pl.offset_b, pl.slot_b,
                      np.int32(pl.count))

  def abstract(self, rows) -> PackedRows:
    """The PackedRows shapes for (abstract) grouped rows: what the memory planner lowers."""
    b = rows.prompt_tokens_bp.shape[0]
    arr = jax.ShapeDtypeStruct((b,), jnp.int32)
    return jax.eval_shape(self._pack, rows, arr, arr, arr, arr,
                          jax.ShapeDtypeStruct((), jnp.int32))

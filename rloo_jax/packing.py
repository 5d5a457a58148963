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
import functools
from typing import NamedTuple, Optional

from flax import struct
import jax
import jax.numpy as jnp
import numpy as np

from rloo_jax import head_loss, loss, platform

# A row's unused tail: each token a segment of its own (PAD_SEGMENT + its column), above any
# group's, so ids never decrease along a row and the blockwise kernel visits one block per tail
# block (one shared tail segment would make it attend the tail to itself, square in its length).
PAD_SEGMENT = 2**29


def min_tokens(max_prompt_len: int, max_new_tokens: int) -> int:
  """The smallest budget any completion fits in, with its prompt."""
  return max_prompt_len - 1 + max_new_tokens


def check_config(config) -> None:
  """config.train.microbatch_tokens against the rest of the config, before anything compiles."""
  r, t = config.rloo, config.train
  budget = t.get("microbatch_tokens", 0)
  if budget != "auto" and (isinstance(budget, bool) or not isinstance(budget, int)
                           or budget < 0):
    raise ValueError(f"config.train.microbatch_tokens = {budget!r}: a token budget (an int), "
                     "0 (off) or 'auto' (the largest that fits)")
  if not budget:
    return
  need = min_tokens(config.data.max_prompt_len, r.max_new_tokens)
  if not t.shared_prefix:
    raise ValueError("config.train.microbatch_tokens packs whole groups: set "
                     "config.train.shared_prefix=True, or microbatch_tokens=0")
  if t.get("microbatch_size", 0):
    raise ValueError("config.train.microbatch_tokens and config.train.microbatch_size both cut "
                     "the update: set one of them to 0")
  if budget != "auto" and budget < need:
    raise ValueError(f"config.train.microbatch_tokens={budget} cannot hold a completion at "
                     f"full length with its prompt: set it to at least {need} "
                     "(data.max_prompt_len - 1 + rloo.max_new_tokens), or 0 (off)")


class Plan(NamedTuple):
  """Where everything goes. A piece is a group's prompt (but its last token) followed by some of
  its completions in one row: a group goes whole into one piece where a row has room, else its
  completions spread over rows, the prompt again in each. Pieces [N] (the first `pieces` valid):
  group, shard (row of its microbatch), microbatch, offset (column), slot (its order in the row).
  Completions [N]: shard, microbatch, start column, order within their piece. `count`
  microbatches in use."""
  piece_group: np.ndarray
  piece_shard: np.ndarray
  piece_microbatch: np.ndarray
  piece_offset: np.ndarray
  piece_slot: np.ndarray
  shard_n: np.ndarray
  microbatch_n: np.ndarray
  start_n: np.ndarray
  piece_n: np.ndarray        # the piece each completion is in
  order_n: np.ndarray        # its order within that piece
  pieces: int
  count: int
  tokens: int                # tokens packed (prompts once per piece, completions)


def plan(prompt_lengths_b, lengths_n, *, k: int, budget: int, rows: int) -> Plan:
  """First-fit-decreasing of the groups into rows of `budget` tokens, `rows` rows a microbatch;
  a group that fits no row whole is split (its largest completions first), its prompt repeated
  in each row it reaches."""
  p1_b = np.asarray(prompt_lengths_b, np.int64) - 1
  len_bk = np.asarray(lengths_n, np.int64).reshape(-1, k)
  n = len_bk.size
  if (p1_b[:, None] + len_bk).max() > budget:
    raise ValueError(f"a completion of {int((p1_b[:, None] + len_bk).max())} tokens with its "
                     f"prompt does not fit config.train.microbatch_tokens={budget}; set it to at "
                     "least max_prompt_len - 1 + max_new_tokens")
  free = np.zeros(n, np.int64)  # per row; a new row opens at index `opened`
  slots = np.zeros(n, np.int64)
  opened = 0
  pieces = {name: np.zeros(n, np.int64) for name in ("group", "row", "offset", "slot")}
  row_n, start_n, piece_n, order_n = (np.zeros(n, np.int64) for _ in range(4))
  count = 0

  def first_fit(need):
    """The first open row with `need` tokens free (a number, or one per open row), else a new
    row."""
    nonlocal opened
    fits = np.nonzero(free[:opened] >= need)[0]
    if len(fits):
      return int(fits[0])
    free[opened] = budget
    opened += 1
    return opened - 1

  def open_piece(b, r):
    nonlocal count
    for name, v in (("group", b), ("row", r), ("offset", budget - free[r]), ("slot", slots[r])):
      pieces[name][count] = v
    slots[r] += 1
    free[r] -= p1_b[b]
    count += 1
    return count - 1

  def put(b, j, piece, r, order):
    i = b * k + j
    row_n[i], start_n[i], piece_n[i], order_n[i] = r, budget - free[r], piece, order
    free[r] -= len_bk[b, j]

  for b in np.argsort(-(p1_b + len_bk.sum(1)), kind="stable"):
    whole = p1_b[b] + len_bk[b].sum()
    if whole <= budget:
      r = first_fit(whole)
      piece = open_piece(b, r)
      for j in range(k):
        put(b, j, piece, r, j)
      continue
    here: dict[int, list[int]] = {}  # row -> [piece, completions placed]
    for j in np.argsort(-len_bk[b], kind="stable"):
      # A row already holding this group's prompt needs room for the completion only.
      prompt = np.ones(opened, bool)
      prompt[list(here)] = False
      r = first_fit(prompt * p1_b[b] + len_bk[b, j])
      if r not in here:
        here[r] = [open_piece(b, r), 0]
      put(b, j, here[r][0], r, here[r][1])
      here[r][1] += 1
  i32 = lambda x: np.asarray(x, np.int32)  # noqa: E731
  prow = pieces["row"]
  return Plan(i32(pieces["group"]), i32(prow % rows), i32(prow // rows), i32(pieces["offset"]),
              i32(pieces["slot"]), i32(row_n % rows), i32(row_n // rows), i32(start_n),
              i32(piece_n), i32(order_n), count, -(-opened // rows),
              int(p1_b[pieces["group"][:count]].sum() + len_bk.sum()))


def padding_fraction(prompt_lengths_b, lengths_n, *, k: int, budget: int, rows: int) -> float:
  """The fraction of the packed microbatches' tokens that are padding."""
  p = plan(prompt_lengths_b, lengths_n, k=k, budget=budget, rows=rows)
  return float(1.0 - p.tokens / (p.count * rows * budget))


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
  sampler_logp_nt: Optional[jax.Array] = None  # as `rollout.GroupedRows`'
  # The head runs `chunk_scale` times the positions a chunk of grouped rows would, over one row
  # in place of a group's k: the same logits per chunk, in k times fewer, larger products.
  chunk_scale: int = struct.field(pytree_node=False, default=1)

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
                                      chunk_size=chunk_size * self.chunk_scale,
                                      with_entropy=with_entropy)
    return self._to_nt(logp), None if ent is None else self._to_nt(ent)

  def linear_loss(self, fns, params, coef_nt, *, chunk_size: int):
    """(sum of coef_nt * log-probs, log-probs [N, T], entropies [N, T]) by
    `head_loss.linear_logprob_loss` over the packed positions."""
    coef_dl = jnp.append(coef_nt.reshape(-1), 0.0)[self.pred_dl]
    value, logp, ent = head_loss.linear_logprob_loss(
        fns.head, fns.head_params(params), self.hidden(fns, params), self.target_dl, coef_dl,
        chunk_size=chunk_size * self.chunk_scale, with_entropy=True)
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
  sampler_logp_nt: Optional[jax.Array] = None
  chunk_scale: int = struct.field(pytree_node=False, default=1)

  def microbatch(self, i) -> PackedMicrobatch:
    rows = [x[:, i] for x in (self.tokens_dml, self.positions_dml, self.key_ok_dml,
                               self.segment_dml, self.shared_dml, self.target_dml, self.pred_dml)]
    mine = self.microbatch_n == i
    return PackedMicrobatch(*rows, self.start_n, self.completions_nt,
                            self.cmask_nt & mine[:, None], self.old_logp_nt,
                            jnp.where(mine, self.advantages_n, 0.0), self.sampler_logp_nt,
                            chunk_scale=self.chunk_scale)

  def accumulate(self, fn, constrain=lambda x: x, combine=None):
    """`fn(microbatch)` (a pytree of arrays) over the microbatches in use, summed (or by
    `combine(total, out)`)."""
    combine = combine or (lambda total, out: jax.tree.map(jnp.add, total, out))
    zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype),
                         jax.eval_shape(fn, self.microbatch(0)))

    def body(i, total):
      return combine(total, fn(constrain(self.microbatch(i))))

    return jax.lax.fori_loop(0, self.count_d[0], body, zeros)


def pack(rows, pl, *, k: int, budget: int, rows_per_microbatch: int,
         max_microbatches: int) -> PackedRows:
  """`rollout.GroupedRows` (a minibatch) packed by a `plan` (`pl`, its fields as arrays).
  Pure; jit it with the static keywords. Completion masks must be prefixes (tokens up to and
  including EOS)."""
  b, p = rows.prompt_tokens_bp.shape
  n, t = rows.completions_nt.shape
  m, l = max_microbatches, budget
  total = rows_per_microbatch * m * l
  i32 = jnp.int32
  p_b = rows.prompt_mask_bp.sum(1).astype(i32)
  len_n = rows.cmask_nt.sum(1).astype(i32)
  # Pieces: the prompt but its last token; left-padded column c holds token c - (P - p).
  g_i = pl.piece_group
  p_i = p_b[g_i]
  base_i = (pl.piece_shard * m + pl.piece_microbatch) * l + pl.piece_offset
  rel_ip = jnp.arange(p)[None, :] - (p - p_i)[:, None]
  keep_ip = (jnp.arange(n) < pl.pieces)[:, None] & (rel_ip >= 0) & (rel_ip < p_i[:, None] - 1)
  dest_ip = jnp.where(keep_ip, base_i[:, None] + rel_ip, total)
  # Completion n's segment: [its prompt's last token | its tokens but the last].
  cols = jnp.arange(t)[None, :]
  row_start_n = (pl.shard_n * m + pl.microbatch_n) * l + pl.start_n
  dest_nt = jnp.where(cols < len_n[:, None], row_start_n[:, None] + cols, total)
  group_n = jnp.arange(n) // k
  first = lambda x_bp: x_bp[group_n, p - 1][:, None]  # noqa: E731
  seg_tokens = jnp.concatenate([first(rows.prompt_tokens_bp), rows.completions_nt[:, :t - 1]], 1)
  seg_positions = jnp.concatenate([first(rows.prompt_positions_bp),
                                   rows.completion_positions_nt[:, :t - 1]], 1)
  prompt_seg_i = pl.piece_slot * (k + 1)
  shared_n = prompt_seg_i[pl.piece_n]
  full = lambda x, cols: jnp.broadcast_to(x[:, None], (x.shape[0], cols))  # noqa: E731
  tail = PAD_SEGMENT + jnp.arange(total, dtype=i32) % l

  def scatter(prompt_ip, completion_nt, fill, dtype):
    out = jnp.broadcast_to(jnp.asarray(fill, dtype), (total,))
    out = out.at[dest_ip.reshape(-1)].set(prompt_ip.reshape(-1).astype(dtype), mode="drop")
    out = out.at[dest_nt.reshape(-1)].set(completion_nt.reshape(-1).astype(dtype), mode="drop")
    return out.reshape(rows_per_microbatch, m, l)

  return PackedRows(
      tokens_dml=scatter(rows.prompt_tokens_bp[g_i], seg_tokens, 0, i32),
      positions_dml=scatter(rows.prompt_positions_bp[g_i], seg_positions, 0, i32),
      key_ok_dml=scatter(jnp.ones((n, p), bool), jnp.ones((n, t), bool), False, bool),
      segment_dml=scatter(full(prompt_seg_i, p), full(shared_n + 1 + pl.order_n, t), tail, i32),
      shared_dml=scatter(full(prompt_seg_i, p), full(shared_n, t), tail, i32),
      target_dml=scatter(jnp.zeros((n, p), i32), rows.completions_nt, 0, i32),
      pred_dml=scatter(jnp.full((n, p), n * t, i32),
                       jnp.arange(n * t, dtype=i32).reshape(n, t), n * t, i32),
      microbatch_n=pl.microbatch_n.astype(i32),
      start_n=(pl.shard_n * l + pl.start_n).astype(i32),
      count_d=jnp.full((rows_per_microbatch,), pl.count, i32),
      completions_nt=rows.completions_nt, cmask_nt=rows.cmask_nt, old_logp_nt=rows.old_logp_nt,
      advantages_n=rows.advantages_n, sampler_logp_nt=rows.sampler_logp_nt, chunk_scale=k)


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
    object.__setattr__(self, "_pack", platform.jit(functools.partial(pack, **static),
                                                   out_shardings=self.rows_sharding))

  def plan(self, rows) -> Plan:
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    host = lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True))  # noqa: E731
    return plan(host(rows.prompt_mask_bp.sum(1)), host(rows.cmask_nt.sum(1)), k=self.k,
                budget=self.budget, rows=self.rows_per_microbatch)

  def __call__(self, rows, the_plan: Plan | None = None) -> PackedRows:
    if isinstance(rows.cmask_nt, jax.core.Tracer):  # traced for shapes only (jax.eval_shape)
      return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), self.abstract(rows))
    pl = self.plan(rows) if the_plan is None else the_plan
    if pl.count > self.max_microbatches:
      raise ValueError(f"{pl.count} packed microbatches exceed the {self.max_microbatches} "
                       "allotted")
    return self._pack(rows, jax.tree.map(lambda x: np.asarray(x, np.int32), pl))

  def abstract(self, rows) -> PackedRows:
    """The PackedRows shapes for (abstract) grouped rows: what the memory planner lowers."""
    n = rows.completions_nt.shape[0]
    per_n, scalar = (jax.ShapeDtypeStruct(s, jnp.int32) for s in ((n,), ()))
    return jax.eval_shape(self._pack, rows, Plan(*[per_n] * 10, scalar, scalar, scalar))


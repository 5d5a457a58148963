"""The one attention entry point: `attend(q, k, v, spec)`, for every layout the model runs.

`spec` (an `AttentionSpec`) carries what the masks need: the layout of the rows (`Causal`, the
grouped `PromptGroup`, or `SharedPrefixDecode`), the score scale and soft-cap, a sliding window,
and the implementation (`config.model.attention`, a key of `IMPLEMENTATIONS`). An
implementation is a function `(q, k, v, spec) -> o`; 'xla' is the einsum one below, the reference
every other implementation is tested against. One that lacks a layout must raise naming it,
never fall back silently.

Every layout computes its scores and softmax in float32, whatever the activation dtype.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from rloo_jax.models import (attention_blockwise, attention_cudnn, attention_paged,
                             attention_splash, traced_mesh)
from rloo_jax.models import cache as cache_lib

# Finite rather than -inf: a query whose keys are all masked (e.g. a pad row) then gets a uniform,
# finite distribution instead of NaNs that would leak into gradients through a masked mean.
_MASKED = -1e30


@dataclasses.dataclass(frozen=True)
class Causal:
  """Rows attending causally in index order, keys masked where `mask_bt` is False, so padding
  may sit anywhere in a row. `positions_bt` (queries' and keys' alike) is read only by a
  sliding window. q [B,S,Hkv,G,D], k and v [B,S,Hkv,D].

  Packed rows (`rloo_jax.packing`): with `segment_bt` (int, never decreasing along a row), a
  query reads only keys of its own segment or of its `shared_bt` one: a group's completions
  share their prompt's segment, so several groups sit in one row, each prompt computed once."""

  mask_bt: jax.Array
  positions_bt: jax.Array | None = None
  segment_bt: jax.Array | None = None
  shared_bt: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class PromptGroup:
  """Rows laid out per prompt as [prompt (P) | T tokens x M completions], the completions
  token-major (row P + i*M + j: token i of completion j). The prompt attends causally within
  itself; each completion to the prompt's keys (computed once, never tiled M times) and causally
  to its own tokens. `prompt_mask_bp` [B,P], `mask_bmt` [B,M,T] mask keys; `positions_bs`
  (laid out as the rows) is read only by a sliding window. q [B,S,Hkv,G,D], k and v [B,S,Hkv,D]
  with S = P + T*M."""

  prompt_mask_bp: jax.Array
  mask_bmt: jax.Array
  positions_bs: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class SharedPrefixDecode:
  """One query per stream, K streams per prompt row, attending to the row's prompt (one prefix
  cache that its K streams share, masked by `prefix_mask_bp` [B,P]) and to the stream's own
  slots 0..`index` (an int, or [B,K] per stream). q [B,K,Hkv,G,D];
  k = (prefix_k [B,Hkv,D,P], stream_k [B,K,Hkv,D,T]);
  v = (prefix_v [B,Hkv,P,D], stream_v [B,K,Hkv,T,D]). `positions_bk` (the queries') and
  `prefix_positions_bp` are read only by a sliding window; stream slot j sits index - j
  positions before its query. `column` (the engine's ring): every stream wrote this step's
  token at slot `column` of a ring of T slots, so slot j sits (column - j) mod T positions back
  and holds the stream's token while that distance is at most its index."""

  prefix_mask_bp: jax.Array
  index: jax.Array
  positions_bk: jax.Array | None = None
  prefix_positions_bp: jax.Array | None = None
  column: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
  """What `attend` needs besides q, k, v. The scores are q.k * `scale`, soft-capped to
  softcap * tanh(s / softcap) when softcap > 0 (Gemma 2); with a `window` (a traced int32 per
  layer; None: no layer slides) keys at positions <= query position - window are masked, as
  transformers' sliding_window_overlay masks them (a global layer gets a window no distance
  reaches, so every layer runs the same scanned code). `window_size`: the config's window, the
  static value a traced `window` takes on sliding layers (read by kernels whose masks are
  static: 'splash', 'cudnn')."""

  layout: Causal | PromptGroup | SharedPrefixDecode
  scale: float
  softcap: float = 0.0
  window: jax.Array | None = None
  implementation: str = 'xla'
  window_size: int = 0

  def logits(self, scores):
    scores = scores * self.scale
    if self.softcap:
      scores = self.softcap * jnp.tanh(scores / self.softcap)
    return scores


def attend(q, k, v, spec: AttentionSpec):
  """The attention output, laid out as q ([..., Hkv, G, D]), in v's dtype."""
  return IMPLEMENTATIONS[spec.implementation](q, k, v, spec)


def check_platform(name: str, platform: str, packed: bool = False) -> None:
  """Raises where config.model.attention `name` cannot run on `platform` (the mesh's devices) or
  on `packed` update rows (config.train.microbatch_tokens)."""
  if name == 'splash' and platform not in ('tpu', 'cpu'):
    raise ValueError(f"config.model.attention='splash' is TPU's Pallas kernel (interpreted on "
                     f"CPU, for tests); on {platform} use 'auto' or 'blockwise'")
  if name == 'cudnn' and platform != 'gpu':
    raise ValueError(f"config.model.attention='cudnn' is cuDNN's flash attention, on GPUs; on "
                     f"{platform} use 'auto' or 'blockwise'")
  if name in ('splash', 'cudnn') and packed:
    raise ValueError(f"config.model.attention={name!r} has no packed-row form (a completion "
                     "reads its group's prompt segment and its own); with "
                     "config.train.microbatch_tokens use 'auto' or 'blockwise'")


def check_implementation(name: str) -> str:
  """`name` if it is an implementation; else the one-line error naming config.model.attention."""
  if name not in IMPLEMENTATIONS:
    raise ValueError(f'unknown config.model.attention {name!r}; choose one of '
                     f'{tuple(IMPLEMENTATIONS)}')
  return name


# ----------------------------------------------------------------------------------------------
# 'xla': einsum scores, a float32 softmax over the masked scores, einsum values. O(S^2) memory
# in the sequence; the reference for any blockwise or fused kernel added beside it.


def _softmax_f32(scores: jax.Array, mask: jax.Array) -> jax.Array:
  return jax.nn.softmax(jnp.where(mask, scores, _MASKED), axis=-1)


def _in_window(q_pos, k_pos, window):
  """[..., S, T] whether each key (positions k_pos [..., T]) is within the window of each query
  (q_pos [..., S])."""
  return (q_pos[..., :, None] - k_pos[..., None, :]) < window


def _causal(q_bshgd, k_bthd, v_bthd, spec: AttentionSpec, mask_bt, positions_bt=None,
            segment_bt=None, shared_bt=None):
  s, t = q_bshgd.shape[1], k_bthd.shape[1]
  scores = spec.logits(jnp.einsum('bshgd,bthd->bhgst', q_bshgd, k_bthd,
                                  preferred_element_type=jnp.float32))
  causal_st = jnp.arange(s)[:, None] >= jnp.arange(t)[None, :]
  mask = causal_st[None, None, None] & mask_bt.astype(bool)[:, None, None, None, :]
  if segment_bt is not None:
    seg_k = segment_bt[:, None, :]
    same = (seg_k == segment_bt[:, :, None]) | (seg_k == shared_bt[:, :, None])
    mask = mask & same[:, None, None]
  if spec.window is not None:
    mask = mask & _in_window(positions_bt, positions_bt, spec.window)[:, None, None]
  probs = _softmax_f32(scores, mask).astype(v_bthd.dtype)
  return jnp.einsum('bhgst,bthd->bshgd', probs, v_bthd)


def _prompt_group(q_bshgd, k_bshd, v_bshd, spec: AttentionSpec):
  layout = spec.layout
  prompt_mask_bp, mask_bmt, positions_bs = (layout.prompt_mask_bp, layout.mask_bmt,
                                            layout.positions_bs)
  b, p = prompt_mask_bp.shape
  _, _, h, g, d = q_bshgd.shape
  m, t = mask_bmt.shape[1:]
  qp, kp, vp = q_bshgd[:, :p], k_bshd[:, :p], v_bshd[:, :p]
  pos_p = None if positions_bs is None else positions_bs[:, :p]
  out_p = _causal(qp, kp, vp, spec, prompt_mask_bp, pos_p)
  qc = q_bshgd[:, p:].reshape(b, t, m, h, g, d)
  kc = k_bshd[:, p:].reshape(b, t, m, h, d)
  vc = v_bshd[:, p:].reshape(b, t, m, h, d)
  f32 = jnp.float32
  # Both score blocks of a completion query share one float32 softmax.
  scores_p = jnp.einsum('btmhgd,bphd->bmhgtp', qc, kp, preferred_element_type=f32)
  scores_c = jnp.einsum('btmhgd,bsmhd->bmhgts', qc, kc, preferred_element_type=f32)
  scores = spec.logits(jnp.concatenate([scores_p, scores_c], axis=-1))
  mask_p = jnp.broadcast_to(prompt_mask_bp.astype(bool)[:, None, None, None, None, :],
                            (b, m, 1, 1, t, p))
  causal_ts = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
  mask_c = causal_ts[None, None, None, None] & mask_bmt.astype(bool)[:, :, None, None, None, :]
  mask = jnp.concatenate([mask_p, mask_c], axis=-1)
  if spec.window is not None:
    pos_bmt = positions_bs[:, p:].reshape(b, t, m).transpose(0, 2, 1)
    near = jnp.concatenate([_in_window(pos_bmt, pos_p[:, None], spec.window),
                            _in_window(pos_bmt, pos_bmt, spec.window)], axis=-1)
    mask = mask & near[:, :, None, None]
  probs = _softmax_f32(scores, mask).astype(v_bshd.dtype)
  out_c = (jnp.einsum('bmhgtp,bphd->btmhgd', probs[..., :p], vp)
           + jnp.einsum('bmhgts,bsmhd->btmhgd', probs[..., p:], vc))
  return jnp.concatenate([out_p, out_c.reshape(b, t * m, h, g, d)], axis=1)


def _decode_mask(layout: SharedPrefixDecode, k: int, t: int, window):
  """[B, K, 1, 1, P + T] keys a decode query sees: the prompt's valid columns, then the
  stream's own slots 0..index; with a sliding window only those within it."""
  b, p = layout.prefix_mask_bp.shape
  index = layout.index
  mask_p = jnp.broadcast_to(layout.prefix_mask_bp.astype(bool)[:, None, :], (b, k, p))
  index = index[..., None] if jnp.ndim(index) else index  # [B, K]: each stream its own
  back_t = index - jnp.arange(t) if layout.column is None else (layout.column - jnp.arange(t)) % t
  mask_t = jnp.broadcast_to((back_t >= 0) & (back_t <= index), (b, k, t))
  if window is not None:
    q_pos_bk, pos_bp = layout.positions_bk, layout.prefix_positions_bp
    mask_p = mask_p & _in_window(q_pos_bk[..., None], pos_bp[:, None], window)[:, :, 0]
    mask_t = mask_t & (back_t < window)
  return jnp.concatenate([mask_p, mask_t], axis=-1)[:, :, None, None, :]


def _shared_prefix_decode(q_bkhgd, k, v, spec: AttentionSpec, pallas: bool = False):
  """The decode's attention (`SharedPrefixDecode`); paged streams (`cache.PagedStreams`) read
  through the Pallas paged kernel where `pallas` and it applies, else gathered."""
  if len(k) == 3:  # paged: read in place by the Pallas kernel, or gathered
    if pallas and attention_paged.applies(spec):
      return attention_paged.decode(q_bkhgd, k, v, spec,
                                    functools.partial(_prefix_and_streams, lse=True))
    (prefix_k, pool_k, paged), (prefix_v, pool_v, _) = k, v
    k, v = cache_lib.read_pages(pool_k, pool_v, paged.pages_bm, paged.slots)
    k, v = (prefix_k, k), (prefix_v, v)
  return _prefix_and_streams(q_bkhgd, k, v, spec)[0]


def _prefix_and_streams(q_bkhgd, k, v, spec: AttentionSpec, lse: bool = False):
  """(o, with `lse` the log-sum-exp of the scores [B,K,Hkv,G], else None) of the decode queries
  over a prefix and the streams' own slots. The prefix is contracted against all K queries at
  once instead of being tiled per stream, so its memory traffic is paid once per row; both
  score blocks share one float32 softmax."""
  (prefix_k_bhdp, k_bkhdt), (prefix_v_bhpd, v_bkhtd) = k, v
  f32 = jnp.float32
  # Scored in dot_general's own order (batch b, h first), then moved: XLA:CPU has no
  # bf16 x bf16 -> f32 kernel for the einsum written straight to [b, k, h, g, p].
  scores_p = jnp.einsum('bkhgd,bhdp->bhkgp', q_bkhgd, prefix_k_bhdp,
                        preferred_element_type=f32).transpose(0, 2, 1, 3, 4)
  scores_t = jnp.einsum('bkhgd,bkhdt->bkhgt', q_bkhgd, k_bkhdt, preferred_element_type=f32)
  p, t = scores_p.shape[-1], scores_t.shape[-1]
  scores = spec.logits(jnp.concatenate([scores_p, scores_t], axis=-1))
  mask = _decode_mask(spec.layout, q_bkhgd.shape[1], t, spec.window)
  probs = _softmax_f32(scores, mask).astype(v_bkhtd.dtype)
  o = (jnp.einsum('bkhgp,bhpd->bkhgd', probs[..., :p], prefix_v_bhpd)
       + jnp.einsum('bkhgt,bkhtd->bkhgd', probs[..., p:], v_bkhtd))
  return o, (jax.nn.logsumexp(jnp.where(mask, scores, _MASKED), axis=-1) if lse else None)


def _xla(q, k, v, spec: AttentionSpec):
  layout = spec.layout
  if isinstance(layout, Causal):
    return _causal(q, k, v, spec, layout.mask_bt, layout.positions_bt, layout.segment_bt,
                   layout.shared_bt)
  if isinstance(layout, PromptGroup):
    return _prompt_group(q, k, v, spec)
  if isinstance(layout, SharedPrefixDecode):
    return _shared_prefix_decode(q, k, v, spec)
  raise TypeError(f'attention layout {type(layout).__name__} has no xla implementation')


def _blockwise(q, k, v, spec: AttentionSpec):
  """'blockwise' (attention_blockwise): Causal and PromptGroup in O(S) memory. SharedPrefixDecode
  runs the xla form above: one query per stream, its memory is already O(S)."""
  layout = spec.layout
  if isinstance(layout, SharedPrefixDecode):
    return _shared_prefix_decode(q, k, v, spec)
  kernel = functools.partial(attention_blockwise.attend, scale=spec.scale, softcap=spec.softcap)

  def run(q, k, v, key_ok, segment=None, positions=None, shared=None):
    # Per shard of the traced mesh: the blocks each query block visits are its device's rows'.
    return traced_mesh.per_shard(kernel, (q, k, v, key_ok, segment, positions, spec.window,
                                          shared), (2, 2, 2) + (None,) * 5, 2)

  if isinstance(layout, Causal):
    return run(q, k, v, layout.mask_bt, layout.segment_bt, layout.positions_bt,
               layout.shared_bt)
  if not isinstance(layout, PromptGroup):
    raise TypeError(f'attention layout {type(layout).__name__} has no blockwise implementation')
  b, m, t = layout.mask_bmt.shape
  p = layout.prompt_mask_bp.shape[1]
  # Completion-major inside ([prompt | completion 0 | ... | completion M-1], a transpose of the
  # token-major rows): each completion is one contiguous segment, so the kernel skips the key
  # blocks of the others (M times fewer completion scores than the interleaved rows).
  def swap(x, n1, n2):  # rows [P | n1 x n2] -> [P | n2 x n1]
    rest = x[:, p:]
    return jnp.concatenate(
        [x[:, :p], rest.reshape(b, n1, n2, *x.shape[2:]).swapaxes(1, 2).reshape(rest.shape)], 1)

  major = lambda x: swap(x, t, m)  # noqa: E731
  key_ok_bs = jnp.concatenate([layout.prompt_mask_bp, layout.mask_bmt.reshape(b, m * t)], 1)
  # The prompt is segment 0, which every row reads; completion j is segment j + 1.
  segment_ms = jnp.repeat(jnp.arange(1, m + 1), t)
  segment_bs = jnp.concatenate([jnp.zeros((b, p), jnp.int32),
                                jnp.broadcast_to(segment_ms, (b, m * t))], 1)
  positions_bs = None if layout.positions_bs is None else major(layout.positions_bs)
  o = run(major(q), major(k), major(v), key_ok_bs.astype(bool), segment_bs, positions_bs)
  return swap(o, m, t)


def _splash(q, k, v, spec: AttentionSpec):
  """'splash' (attention_splash): Pallas splash attention, TPU's flash kernel, for Causal rows
  without segments and PromptGroup rows; packed rows raise. SharedPrefixDecode runs the xla form,
  its paged streams' pages read in place by the Pallas paged kernel (`attention_paged`)."""
  layout = spec.layout
  if isinstance(layout, Causal):
    return attention_splash.causal(q, k, v, spec, layout.mask_bt, layout.segment_bt)
  if isinstance(layout, PromptGroup):
    return attention_splash.prompt_group(q, k, v, spec)
  if isinstance(layout, SharedPrefixDecode):
    return _shared_prefix_decode(q, k, v, spec, pallas=True)
  raise TypeError(f'attention layout {type(layout).__name__} has no splash implementation')


def _cudnn(q, k, v, spec: AttentionSpec):
  """'cudnn' (attention_cudnn): cuDNN's flash attention for Causal rows without segments and
  PromptGroup rows; what it lacks raises. SharedPrefixDecode runs the xla form."""
  layout = spec.layout
  if isinstance(layout, SharedPrefixDecode):
    return _shared_prefix_decode(q, k, v, spec)
  lacking = attention_cudnn.supported(
      q, spec, packed=isinstance(layout, Causal) and layout.segment_bt is not None)
  if lacking:
    raise ValueError(f"config.model.attention='cudnn' cannot run {lacking}; use 'auto' or "
                     "'blockwise'")
  if isinstance(layout, Causal):
    return attention_cudnn.causal(q, k, v, spec, layout.mask_bt)
  if isinstance(layout, PromptGroup):
    return attention_cudnn.prompt_group(q, k, v, spec)
  raise TypeError(f'attention layout {type(layout).__name__} has no cudnn implementation')


# Queries reading this many keys or more run a flash kernel under 'auto'. On an H200 (Qwen2.5-1.5B's
# heads, docs/PERFORMANCE.md) 'xla' held 0.47 GiB of scores a row at 2K tokens and 7.5 at 8K,
# 'blockwise' 0.06 and 0.13, for 1.15x the attention's time at 8K.
AUTO_BLOCKWISE_MIN_TOKENS = 4096


def resolve(name: str, keys: int, platform: str = '', packed: bool = False) -> str:
  """The kernel implementation `name` runs where a query reads up to `keys` keys: 'auto' is a
  flash kernel from AUTO_BLOCKWISE_MIN_TOKENS keys (the scores would dominate a device's
  memory), the platform's own for the rows it holds (not `packed` ones): 'splash' on a TPU,
  'cudnn' on a GPU (`_auto` then checks the rows' dtype and heads), else 'blockwise'; under
  that, 'xla'."""
  if name != 'auto':
    return name
  if keys < AUTO_BLOCKWISE_MIN_TOKENS:
    return 'xla'
  own = {'tpu': 'splash', 'gpu': 'cudnn'}.get(platform)
  return own if own and not packed else 'blockwise'


def _auto(q, k, v, spec: AttentionSpec):
  """'auto' (`resolve`) on the keys a query reads: a causal row's length, a group's prompt plus
  one completion (xla never scores one completion against another), none for the decode's one
  query a stream; on the platform the program is built for (`traced_mesh.platform`)."""
  layout = spec.layout
  if isinstance(layout, SharedPrefixDecode):  # paged streams: as under 'splash'
    return _shared_prefix_decode(q, k, v, spec, pallas=True)
  if isinstance(layout, PromptGroup):
    keys = layout.prompt_mask_bp.shape[1] + layout.mask_bmt.shape[2]
  else:
    keys = q.shape[1]
  packed = isinstance(layout, Causal) and layout.segment_bt is not None
  name = resolve('auto', keys, traced_mesh.platform(), packed)
  if name == 'cudnn' and attention_cudnn.supported(q, spec, packed):
    name = 'blockwise'
  kernels = {'xla': _xla, 'blockwise': _blockwise, 'splash': _splash, 'cudnn': _cudnn}
  return kernels[name](q, k, v, spec)


# config.model.attention -> (q, k, v, spec) -> o. A new kernel is one more entry here, tested
# against 'xla' on every layout it supports.
IMPLEMENTATIONS: dict[str, Callable[[Any, Any, Any, AttentionSpec], jax.Array]] = {
    'xla': _xla, 'blockwise': _blockwise, 'splash': _splash, 'cudnn': _cudnn, 'auto': _auto}

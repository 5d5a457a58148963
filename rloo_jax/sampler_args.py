"""Argument checks of `rloo_jax.sampler.sample`, run on the host before anything is compiled, and
the trainer's rollout on its layout (`RolloutShape`): its sampler, pools and layer layout."""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rloo_jax.sharding import leading_ways

MODES = ('shared', 'unshared')


def model_max_seq_len(fns):
  """The context `fns` (or its config) declares, or None."""
  for source in (fns, getattr(fns, 'config', None)):
    value = getattr(source, 'max_seq_len', None)
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
      return int(value)
  return None


def _check_int(name, value, minimum=None):
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise ValueError(f'sample: {name} must be an integer, got {value!r}')
  if minimum is not None and value < minimum:
    raise ValueError(f'sample: {name} must be >= {minimum}, got {value}')
  return int(value)


def stop_ids(eos_id: int | Sequence[int]) -> tuple[int, ...]:
  """eos_id as a non-empty tuple of ints: one end token or several (an instruct model's list)."""
  ids = (eos_id,) if isinstance(eos_id, (int, np.integer)) else eos_id
  if isinstance(ids, np.ndarray):
    ids = ids.reshape(-1).tolist()
  try:
    ids = tuple(ids)
  except TypeError:
    raise ValueError(f'sample: eos_id must be an integer or a sequence of them, '
                     f'got {eos_id!r}') from None
  if not ids:
    raise ValueError('sample: eos_id is an empty sequence; give at least one stop id')
  return tuple(_check_int('eos_id', i) for i in ids)


def validate(prompt_tokens_bp, prompt_lengths_b, *, k, max_new_tokens, method, eos_id, pad_id,
              mode, max_seq_len):
  """Checks `sample`'s arguments; returns (k, max_new_tokens, stop ids tuple, pad_id) as ints."""
  if mode not in MODES:
    raise ValueError(f'sample: mode must be one of {MODES}, got {mode!r}')
  if not callable(getattr(method, 'process', None)) or not hasattr(method, 'is_greedy'):
    raise ValueError(
        f'sample: method must be a rloo_jax.sampling method (Greedy, Temperature, TopK, TopP), '
        f'got {method!r}')
  k = _check_int('k', k, 1)
  max_new_tokens = _check_int('max_new_tokens', max_new_tokens, 1)
  eos_id = stop_ids(eos_id)
  pad_id = _check_int('pad_id', pad_id)
  tokens_shape = np.shape(prompt_tokens_bp)
  lengths_shape = np.shape(prompt_lengths_b)
  if len(tokens_shape) != 2:
    raise ValueError(
        f'sample: prompt_tokens_bp must be 2-D [batch, prompt_len], got shape {tokens_shape}')
  num_prompts, num_cols = tokens_shape
  if num_prompts < 1 or num_cols < 1:
    raise ValueError(f'sample: prompt_tokens_bp must be non-empty, got shape {tokens_shape}')
  if lengths_shape != (num_prompts,):
    raise ValueError(
        f'sample: prompt_lengths_b must have shape ({num_prompts},) to match prompt_tokens_bp '
        f'{tokens_shape}, got {lengths_shape}')
  for name, arr in (('prompt_tokens_bp', prompt_tokens_bp), ('prompt_lengths_b', prompt_lengths_b)):
    if not jnp.issubdtype(jnp.result_type(arr), jnp.integer):
      raise ValueError(f'sample: {name} must be integers, got {jnp.result_type(arr)}')
  if isinstance(prompt_lengths_b, jax.core.Tracer):
    return k, max_new_tokens, eos_id, pad_id  # Traced under an outer jit: values unknown here.
  if isinstance(prompt_lengths_b, jax.Array) and not prompt_lengths_b.is_fully_addressable:
    # Multi-process: each process checks the rows it holds (indices below are local).
    lengths = np.concatenate([np.asarray(s.data).reshape(-1)
                              for s in prompt_lengths_b.addressable_shards])
  else:
    lengths = np.asarray(jax.device_get(prompt_lengths_b))
  empty = np.flatnonzero(lengths < 1)
  if empty.size:
    raise ValueError(f'sample: empty prompt (length {lengths[empty[0]]}) at batch index '
                     f'{empty[0]}; every prompt needs at least one token')
  too_long = np.flatnonzero(lengths > num_cols)
  if too_long.size:
    raise ValueError(f'sample: prompt {too_long[0]} has length {lengths[too_long[0]]} > the '
                     f'{num_cols} columns of prompt_tokens_bp')
  if max_seq_len is not None:
    longest = int(lengths.max())
    if longest > max_seq_len:
      raise ValueError(
          f'sample: prompt {int(lengths.argmax())} has {longest} tokens, longer than the model '
          f'context max_seq_len={max_seq_len}')
    if longest + max_new_tokens > max_seq_len:
      raise ValueError(
          f'sample: prompt length {longest} + max_new_tokens {max_new_tokens} = '
          f'{longest + max_new_tokens} exceeds the model context max_seq_len={max_seq_len}')
  return k, max_new_tokens, eos_id, pad_id


DECODE_LAYERS = ('auto', 'scanned', 'unstacked')


def _decode_layers(rloo_config) -> str:
  value = rloo_config.get('decode_layers', 'auto')
  if value not in DECODE_LAYERS:
    raise ValueError(f'unknown config.rloo.decode_layers {value!r}; choose one of {DECODE_LAYERS}')
  return value


def layer_bytes(m, itemsize: int, tensor: int = 1) -> float:
  """One layer's weights of TransformerConfig `m` on one device, at `itemsize` bytes a weight
  and split over `tensor` devices."""
  embedding = m.vocab_size * m.hidden_size * (1 if m.tie_embeddings else 2)
  return (m.num_params - embedding) / m.num_layers * itemsize / tensor


def layer_bytes_per_device(exp) -> float:
  """One layer's weights on one device, as stored (param_dtype; split over mesh.tensor)."""
  m = exp.model_config
  return layer_bytes(m, jnp.dtype(m.param_dtype).itemsize, exp.layout.shape['tensor'])


def decode_unstacked(exp) -> bool:
  """`unstacked` of an Experiment (or what has its config and layout)."""
  return unstacked(exp.config.rloo, exp.layout)


def unstacked(rloo_config, layout) -> bool:
  """config.rloo.decode_layers resolved on `layout`: whether the decode loop runs on per-layer
  copies of the weights and KV buffers (`sampler.sample`'s unstack_layers). 'unstacked' under FSDP
  gathers every layer once a rollout instead of at every token, for the whole model held gathered
  while decoding (the memory plan names it when that fits). 'auto' is 'unstacked' on GPU meshes
  whose weights are not FSDP-sharded (an H200 decoded 1.67x faster so: docs/PERFORMANCE.md), else
  'scanned' (no TPU measurement yet)."""
  value = _decode_layers(rloo_config)
  if value == 'auto':
    return layout.platform == 'gpu' and layout.shape['fsdp'] == 1
  return value == 'unstacked'


def per_layer(fns, unstack_layers) -> bool:
  """Whether a decode runs unrolled over per-layer weights and caches (both samplers)."""
  return bool(unstack_layers) and bool(getattr(fns, 'decode_weights', None))


def chunk_engine_slots(rloo_config, prompts: int | None = None) -> int:
  """config.rloo.rollout_engine (rollout_slots 0): a rollout of `prompts` (default num_prompts)
  streams through the engine's C * k slots, a chunk's stream KV refilled as streams end, C
  being rollout_chunk_prompts below the batch, else the batch (every stream admitted at once;
  the engine's phases then read the longest live stream's KV, not the cap's). 0: the static
  sampler: rollout_engine off, or an unshared sampler of unchunked rollouts (chunked, it is
  `validate_decode_layout`'s error)."""
  r = rloo_config
  prompts = prompts or r.num_prompts
  chunk = int(r.get('rollout_chunk_prompts', 0) or 0)
  chunked = 0 < chunk < prompts
  if (r.get('rollout_slots', 0) or not r.get('rollout_engine', False)
      or not (chunked or r.get('sampler_mode', 'shared') == 'shared')):
    return 0
  return (chunk if chunked else prompts) * int(r.k)


def stream_slots(rloo_config, sampler_mode: str, batch: int, k: int) -> int:
  """The engine's slots for prompts in batches of `batch` (evaluation,
  `Policy.generate`): batch * k, the whole set streaming through one batch's KV
  (config.rloo.rollout_engine, as a rollout); 0 (the static sampler, batch by batch) with an
  unshared sampler, or config.rloo.rollout_slots set (every batch runs the engine then)."""
  r = {} if rloo_config is None else rloo_config
  on = r.get('rollout_engine', True) and not r.get('rollout_slots', 0)
  return batch * k if on and sampler_mode == 'shared' else 0


def rollout_slots(rloo_config) -> int:
  """The rollout's engine slots: config.rloo.rollout_slots, else `chunk_engine_slots` (0: the
  static sampler)."""
  return int(rloo_config.get('rollout_slots', 0) or 0) or chunk_engine_slots(rloo_config)


def validate_decode_layout(rloo_config) -> None:
  """config.rloo.decode_layers: a known value; rollout_slots: 0, or the engine's checks."""
  _decode_layers(rloo_config)
  engine_key = ('rollout_slots' if rloo_config.get('rollout_slots', 0) else
                'rollout_engine' if chunk_engine_slots(rloo_config) else None)
  if engine_key and rloo_config.sampler_mode != 'shared':
    fix = ("" if engine_key == 'rollout_slots' else
           " (or config.rloo.rollout_engine=False: the static sampler, chunk by chunk)")
    raise ValueError(f"config.rloo.{engine_key} (the rollout engine) shares each prompt's "
                     f"prefill among its k streams: set config.rloo.sampler_mode='shared'{fix}")
  slots = rollout_slots(rloo_config)
  if slots:
    check_slots(slots, rloo_config.k,
                rloo_config.get('rollout_prefix_rows', 0), key='config.rloo.rollout_slots')
    check_pages(rloo_config.get('rollout_pages', 0), rloo_config.get('rollout_page_size', 64),
                rloo_config.max_new_tokens, key='config.rloo.rollout_pages')
  elif rloo_config.get('rollout_pages', 0):
    raise ValueError("config.rloo.rollout_pages pages the rollout engine's KV: set "
                     "config.rloo.rollout_engine=True or rollout_slots (or rollout_pages=0)")


def check_pages(pages, page_size, max_new_tokens: int, key: str = 'pages',
                ways: int = 1) -> None:
  """The engine's page pool: 0 (off), or on each of `ways` shards at least the pages of one
  stream at full length."""
  if not pages:
    return
  need = -(-max_new_tokens // page_size) if isinstance(page_size, int) and page_size > 0 else 0
  if (not need or isinstance(pages, bool) or not isinstance(pages, int) or pages % ways
      or pages // ways < need):
    raise ValueError(f'{key} = {pages!r} (pages of {page_size!r} slots) must hold one stream at '
                     f'max_new_tokens = {max_new_tokens} on each of the {ways} batch shard(s): '
                     f'a multiple of {ways} of at least {ways * max(need, 1)} (0: no pages)')


def default_prefix_rows(slots: int, k: int, ways: int = 1) -> int:
  """Prefix rows for `slots` streams split `ways` ways: on each shard, room for twice the groups
  its slots hold whole (a group keeps its row until its last stream ends)."""
  per = slots // ways
  return ways * max(1, min(per, 2 * math.ceil(per / k)))


def check_slots(slots, k: int, prefix_rows, key: str = 'slots', ways: int = 1,
                rows: int | None = None) -> tuple[int, int]:
  """(slots, prefix rows) checked for a batch of `rows` prompts split `ways` ways (an engine
  a shard); `key` names the setting in the error."""
  if (isinstance(slots, bool) or not isinstance(slots, int) or slots % ways
      or slots // ways < k):
    raise ValueError(f'{key} = {slots!r} must be an integer >= k = {k} on each of the batch\'s '
                     f'{ways} shard(s) (a group\'s k streams are admitted together); set it to '
                     f'a multiple of {ways * k}, e.g. {8 * ways * k}')
  if rows is not None and rows % ways:
    raise ValueError(f'{key}: the rollout engine runs one engine a batch shard, but {rows} '
                     f'prompts do not split over {ways} shards')
  got = prefix_rows or default_prefix_rows(slots, k, ways)
  if (isinstance(got, bool) or not isinstance(got, int) or got % ways
      or not 1 <= got // ways <= slots // ways):
    raise ValueError(f'{key.replace("slots", "prefix_rows")} = {prefix_rows!r} must be an '
                     f'integer in 1..slots = {slots} and a multiple of the {ways} batch '
                     'shard(s) (0: the default)')
  return slots, got


def engine_pools(prompts: int, slots: int, prefix_rows: int, k: int, ways: int = 1,
                 paged: bool = False) -> tuple[int, int]:
  """(stream slots, prefix rows) an engine over `prompts` holds, all `ways` shards: no more
  prompt rows than prompts; unpaged, with a slot for every stream and a row for every prompt,
  exactly those (`engine.start` admits every group at once, in the static sampler's layout)."""
  rows = min(prefix_rows, prompts)
  if not paged and prompts // ways <= min(slots // ways // k, rows // ways):
    return prompts * k, prompts
  return slots, rows


def chunk_prompts(rloo_config, prompts: int | None = None) -> int:
  """Prompts per sampler call over a batch of `prompts` (default num_prompts):
  config.rloo.rollout_chunk_prompts below the batch, else (or with the engine taking the batch
  through a chunk's slots, `chunk_engine_slots`) the batch."""
  prompts = prompts or int(rloo_config.num_prompts)
  chunk = int(rloo_config.get('rollout_chunk_prompts', 0) or 0)
  if 0 < chunk < prompts and not chunk_engine_slots(rloo_config, prompts):
    return chunk
  return prompts


def engine_slots(rloo_config, ways: int = 1) -> tuple[int, int]:
  """(stream slots, prefix rows) the rollout engine holds over `ways` batch shards for a
  rollout of config.rloo.num_prompts (`engine_pools`); (0, 0): the static sampler."""
  r = rloo_config
  slots = rollout_slots(r)
  if not slots:
    return 0, 0
  slots, rows = check_slots(slots, int(r.k), int(r.get('rollout_prefix_rows', 0) or 0),
                            key='config.rloo.rollout_slots', ways=ways)
  return engine_pools(chunk_prompts(r), slots, rows, int(r.k), ways,
                      bool(r.get('rollout_pages', 0)))


def describe(rloo_config, ways: int = 1) -> str:
  """The rollout's sampler and the pools it holds, in the line a run logs before it starts."""
  r = rloo_config
  n, k = int(r.num_prompts), int(r.k)
  slots, rows = engine_slots(r, ways)
  if not slots:
    chunk = chunk_prompts(r)
    calls = f" in {n // chunk} calls of {chunk}" if chunk < n else ""
    return (f"[rollout] the static sampler ({r.sampler_mode}): {n} prompts x k={k}{calls}, "
            "each call decoding until its longest stream ends")
  pages = int(r.get('rollout_pages', 0) or 0)
  kv = (f"their KV in {pages} pages of {r.get('rollout_page_size', 64)} tokens" if pages else
        f"each a KV buffer of {r.max_new_tokens} tokens")
  shards = f", over {ways} batch shards" if ways > 1 else ""
  asked = int(r.get('rollout_slots', 0) or 0)
  held = (f"; config.rloo.rollout_slots={asked} is more than the streams need, so {slots} are "
          "held" if asked > slots else "")
  return (f"[rollout] the engine: {n} prompts x k={k} streams through {slots} stream slots "
          f"({kv}) and {rows} prompt rows{shards}{held}")


def decode_options(exp) -> dict:
  """`sampler.sample`'s decode layout arguments for `exp`: the layer layout, and the rollout
  engine's slots (config.rloo.rollout_slots; 0: the static sampler)."""
  r = exp.config.rloo
  return dict(unstack_layers=decode_unstacked(exp), slots=int(r.get('rollout_slots', 0) or 0),
              prefix_rows=int(r.get('rollout_prefix_rows', 0) or 0),
              pages=int(r.get('rollout_pages', 0) or 0),
              page_size=int(r.get('rollout_page_size', 64)))


@dataclasses.dataclass(frozen=True)
class RolloutShape:
  """A run's rollout on its layout, derived in this one place (`rollout_shape`, read as
  `Experiment.rollout_shape`) for the sampler calls, the memory plan and the run's log line."""
  chunk: int        # prompts a sampler call (`chunk_prompts`)
  slots: int        # the engine's stream slots over every shard (0: the static sampler)
  prefix_rows: int  # its prompt rows (`engine_slots`)
  pages: int        # its KV pages (config.rloo.rollout_pages; 0: a KV buffer a slot)
  page_size: int    # slots a page (0 unpaged)
  ways: int         # batch shards, an engine each
  unstacked: bool   # the decode on per-layer weights (`decode_unstacked`)
  line: str         # what the run logs before it starts (`describe`)


def rollout_shape(config, layout) -> RolloutShape:
  """The rollout of `config` (an experiment config) on `layout` (a sharding.Layout)."""
  r, ways = config.rloo, leading_ways(layout.batch_sharding)
  slots, rows = engine_slots(r, ways)
  pages = int(r.get('rollout_pages', 0) or 0)
  return RolloutShape(chunk=chunk_prompts(r), slots=slots, prefix_rows=rows, pages=pages,
                      page_size=int(r.get('rollout_page_size', 64)) if pages else 0, ways=ways,
                      unstacked=unstacked(r, layout), line=describe(r, ways))

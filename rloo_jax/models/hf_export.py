"""Export our Transformer's params as a Hugging Face checkpoint (`save_pretrained`): the inverse
of rloo_jax.models.hf's loaders, so transformers, vLLM and lm-eval can read a trained policy.

Writes config.json, generation_config.json, model.safetensors (or transformers' sharded layout:
model-0000N-of-0000M.safetensors + model.safetensors.index.json) and, from `tokenizer_dir`, the
tokenizer files. The safetensors files are written by hand, one tensor at a time: every tensor's
shape and dtype is known from the config before any weight is read, so the header goes first and
each tensor is gathered to host, converted and written before the next is touched. Exporting an
8B model so never holds a second full copy of it in host memory. Needs neither torch nor
transformers.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Callable

from absl import logging
import jax
from jax.experimental import multihost_utils
import ml_dtypes
import numpy as np
from flax import nnx

from rloo_jax.models import hf_hub, lora
from rloo_jax.models.hf_tokenizer import HFTokenizer
from rloo_jax.models.config import TransformerConfig
from rloo_jax.models.hf_export_config import (  # noqa: F401  (re-exported)
    check_exportable, hf_config)

DTYPES = {'float32': (np.float32, 'F32'), 'bfloat16': (ml_dtypes.bfloat16, 'BF16'),
          'float16': (np.float16, 'F16')}
# transformers' default shard size ('5GB', decimal as it counts).
DEFAULT_MAX_SHARD_BYTES = 5_000_000_000
# What a tokenizer directory may hold that AutoTokenizer reads (whatever of these exist is copied).
TOKENIZER_FILES = ('tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json',
                   'added_tokens.json', 'vocab.json', 'merges.txt', 'tokenizer.model',
                   'chat_template.jinja', 'chat_template.json')

# (HF name, shape, producer): the producer returns that tensor as host numpy, read when written.
Entry = tuple[str, tuple[int, ...], Callable[[], np.ndarray]]


def to_host(x) -> np.ndarray:
  """A (possibly sharded, possibly multi-process) array as host numpy: as Layout.gather does,
  a multi-process array is all-gathered, anything else copied with device_get."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(jax.device_get(x))


def _leaves(params) -> dict[str, object]:
  """'layers.attn.q_kernel' -> the leaf's array (still on device)."""
  flat = nnx.to_flat_state(params) if isinstance(params, nnx.State) else (
      jax.tree_util.tree_flatten_with_path(params)[0])
  out = {}
  for path, v in flat:
    keys = [str(getattr(k, 'key', k)) for k in path]
    out['.'.join(keys)] = v[...] if isinstance(v, nnx.Variable) else v
  return out


def tensors(params, c: TransformerConfig) -> list[Entry]:
  """Every tensor of the HF checkpoint of `c`, in the names and layouts transformers saves.

  The inverse of hf_weights._load_llama / _load_gpt2 / _load_gpt_neox: our kernels are [in, heads,
  head_dim] (o: [heads, head_dim, out]) where torch Linear is [out, in], GPT-2's Conv1D [in, out]
  with q | k | v fused along out, and GPT-NeoX's query_key_value rows are per head (H, 3, D)."""
  check_exportable(c)
  leaf = _leaves(params)
  e = c.hidden_size
  out: list[Entry] = []

  def top(name, key, fn=lambda w: w):
    out.append((name, tuple(fn(np.empty(leaf[key].shape, np.bool_)).shape),
                lambda: fn(to_host(leaf[key]))))

  def per_layer(name, keys, fn=lambda w: w):
    # Slicing on device first: only layer i's slice reaches the host.
    keys = (keys,) if isinstance(keys, str) else keys
    shape = tuple(fn(*(np.empty(leaf['layers.' + k].shape[1:], np.bool_) for k in keys)).shape)
    for i in range(c.num_layers):
      out.append((name.format(i), shape,
                  lambda i=i: fn(*(to_host(leaf['layers.' + k][i]) for k in keys))))

  lin = lambda w: w.reshape(e, -1).T  # [E, H, D] -> torch [H*D, E]
  flat = lambda w: w.reshape(-1)
  if c.family in ('llama', 'qwen2', 'qwen3', 'gemma2', 'gemma3'):
    top('model.embed_tokens.weight', 'embedding')
    p = 'model.layers.{}.'
    per_layer(p + 'input_layernorm.weight', 'attn_norm.scale')
    if c.sandwich_norm:  # Gemma's post_attention_layernorm norms the attention's output
      per_layer(p + 'post_attention_layernorm.weight', 'post_attn_norm.scale')
      per_layer(p + 'pre_feedforward_layernorm.weight', 'mlp_norm.scale')
      per_layer(p + 'post_feedforward_layernorm.weight', 'post_mlp_norm.scale')
    else:
      per_layer(p + 'post_attention_layernorm.weight', 'mlp_norm.scale')
    for n in 'qkv':
      per_layer(p + f'self_attn.{n}_proj.weight', f'attn.{n}_kernel', lin)
      if c.qkv_bias:
        per_layer(p + f'self_attn.{n}_proj.bias', f'attn.{n}_bias', flat)
    per_layer(p + 'self_attn.o_proj.weight', 'attn.o_kernel', lambda w: w.reshape(-1, e).T)
    if c.qk_norm:
      per_layer(p + 'self_attn.q_norm.weight', 'attn.q_norm_scale')
      per_layer(p + 'self_attn.k_norm.weight', 'attn.k_norm_scale')
    for n in ('gate', 'up', 'down'):
      per_layer(p + f'mlp.{n}_proj.weight', f'mlp.{n}_kernel', lambda w: w.T)
    top('model.norm.weight', 'final_norm.scale')
    if c.head == 'lm' and not c.tie_embeddings:
      top('lm_head.weight', 'lm_head', lambda w: w.T)
  elif c.family == 'gpt2':
    top('transformer.wte.weight', 'embedding')
    top('transformer.wpe.weight', 'pos_embedding')
    p = 'transformer.h.{}.'
    for ln, ours in (('ln_1', 'attn_norm'), ('ln_2', 'mlp_norm')):
      per_layer(p + ln + '.weight', ours + '.scale')
      per_layer(p + ln + '.bias', ours + '.bias')
    qkv = lambda *ws: np.concatenate([w.reshape(e, -1) for w in ws], axis=1)
    per_layer(p + 'attn.c_attn.weight', ('attn.q_kernel', 'attn.k_kernel', 'attn.v_kernel'), qkv)
    per_layer(p + 'attn.c_attn.bias', ('attn.q_bias', 'attn.k_bias', 'attn.v_bias'),
              lambda *bs: np.concatenate([b.reshape(-1) for b in bs]))
    per_layer(p + 'attn.c_proj.weight', 'attn.o_kernel', lambda w: w.reshape(-1, e))
    per_layer(p + 'attn.c_proj.bias', 'attn.o_bias')
    for conv, ours in (('c_fc', 'up'), ('c_proj', 'down')):
      per_layer(p + f'mlp.{conv}.weight', f'mlp.{ours}_kernel')
      per_layer(p + f'mlp.{conv}.bias', f'mlp.{ours}_bias')
    top('transformer.ln_f.weight', 'final_norm.scale')
    top('transformer.ln_f.bias', 'final_norm.bias')
  else:  # gpt_neox
    top('gpt_neox.embed_in.weight', 'embedding')
    p = 'gpt_neox.layers.{}.'
    for name in ('input_layernorm', 'post_attention_layernorm'):
      ours = 'attn_norm' if name == 'input_layernorm' else 'mlp_norm'
      per_layer(p + name + '.weight', ours + '.scale')
      per_layer(p + name + '.bias', ours + '.bias')
    # [E, H, D] each -> [H, 3, D, E] -> [3*H*D, E]: head h's q, k, v rows adjacent.
    per_layer(p + 'attention.query_key_value.weight',
              ('attn.q_kernel', 'attn.k_kernel', 'attn.v_kernel'),
              lambda *ws: np.stack([w.transpose(1, 2, 0) for w in ws], axis=1).reshape(-1, e))
    if c.qkv_bias:
      per_layer(p + 'attention.query_key_value.bias',
                ('attn.q_bias', 'attn.k_bias', 'attn.v_bias'),
                lambda *bs: np.stack(bs, axis=1).reshape(-1))
    per_layer(p + 'attention.dense.weight', 'attn.o_kernel', lambda w: w.reshape(-1, e).T)
    if c.out_bias:
      per_layer(p + 'attention.dense.bias', 'attn.o_bias')
    per_layer(p + 'mlp.dense_h_to_4h.weight', 'mlp.up_kernel', lambda w: w.T)
    per_layer(p + 'mlp.dense_h_to_4h.bias', 'mlp.up_bias')
    per_layer(p + 'mlp.dense_4h_to_h.weight', 'mlp.down_kernel', lambda w: w.T)
    per_layer(p + 'mlp.dense_4h_to_h.bias', 'mlp.down_bias')
    top('gpt_neox.final_layer_norm.weight', 'final_norm.scale')
    top('gpt_neox.final_layer_norm.bias', 'final_norm.bias')
    if c.head == 'lm' and not c.tie_embeddings:
      # The name Pythia's checkpoints (and transformers 5's save) use for the LM head.
      top('embed_out.weight', 'lm_head', lambda w: w.T)
  if c.head == 'scalar':  # *ForSequenceClassification's score: Linear(E, 1, bias=False)
    top('score.weight', 'score_kernel', lambda w: w.T)
    if np.any(to_host(leaf['score_bias'])):
      # A Bradley-Terry loss never moves the bias (it cancels in every margin), so only a value
      # model has one. Written so that hf.load_checkpoint reads it back; transformers' class has
      # no bias and drops it: its scores are shifted by a constant.
      logging.warning('score_bias is nonzero: written as score.bias, which transformers\' '
                      '*ForSequenceClassification ignores (its scores shift by a constant)')
      top('score.bias', 'score_bias')
  return out


def _shards(entries: list[Entry], itemsize: int, max_bytes: int) -> list[list[Entry]]:
  """Greedy in order, as transformers shards: a new file when the next tensor would overflow
  (a tensor larger than max_bytes gets a file of its own)."""
  shards, size = [[]], 0
  for ent in entries:
    n = int(np.prod(ent[1], dtype=np.int64)) * itemsize
    if shards[-1] and size + n > max_bytes:
      shards.append([])
      size = 0
    shards[-1].append(ent)
    size += n
  return shards


def _write_safetensors(path: str, entries: list[Entry], np_dtype, st_dtype: str) -> int:
  """The safetensors format (8-byte little-endian header length, JSON header of dtype, shape
  and byte offsets, then the raw little-endian data), written tensor by tensor. Returns the
  bytes of tensor data written."""
  itemsize = np.dtype(np_dtype).itemsize
  header, offset = {'__metadata__': {'format': 'pt'}}, 0
  for name, shape, _ in entries:
    n = int(np.prod(shape, dtype=np.int64)) * itemsize
    header[name] = {'dtype': st_dtype, 'shape': list(shape), 'data_offsets': [offset, offset + n]}
    offset += n
  blob = json.dumps(header, separators=(',', ':')).encode()
  blob += b' ' * (-len(blob) % 8)  # data aligned to 8 bytes, as the reference writer pads
  with open(path, 'wb') as f:
    f.write(len(blob).to_bytes(8, 'little'))
    f.write(blob)
    for name, shape, produce in entries:
      w = np.ascontiguousarray(produce().astype(np_dtype))
      if w.shape != shape:  # a mapping bug, not a user error
        raise AssertionError(f'{name}: produced {w.shape}, planned {shape}')
      f.write(w.tobytes())
  return offset


def _copy_tokenizer(tokenizer_dir: str, out_dir: str) -> list[str]:
  src = hf_hub.resolve_path(tokenizer_dir, what='tokenizer_dir')
  copied = []
  for name in TOKENIZER_FILES:
    if os.path.isfile(os.path.join(src, name)):
      copied.append(shutil.copy(os.path.join(src, name), os.path.join(out_dir, name)))
  if not any(p.endswith('tokenizer.json') for p in copied):
    raise FileNotFoundError(f'tokenizer_dir={tokenizer_dir!r} holds no tokenizer.json')
  return copied


def check_out_dir(out_dir: str) -> None:
  """Refuses a non-empty out_dir: a stale shard or index next to new files would be loaded."""
  if os.path.isdir(out_dir) and os.listdir(out_dir):
    raise FileExistsError(f'out dir {out_dir} is not empty; pass an empty or new directory '
                          '(or delete its contents)')
  if os.path.exists(out_dir) and not os.path.isdir(out_dir):
    raise FileExistsError(f'out dir {out_dir} is a file; pass a directory')


def save_pretrained(params, config: TransformerConfig, out_dir: str, *, dtype: str = 'bfloat16',
                    tokenizer_dir: str | None = None,
                    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, bos_id: int | None = None,
                    eos_id: int | None = None, pad_id: int | None = None,
                    extra_config: dict | None = None) -> list[str]:
  """Writes `params` (an nnx.State as hf.load_checkpoint / create return, layer parameters
  stacked on a leading layers axis; sharded or not) as a Hugging Face checkpoint that
  `AutoModelForCausalLM.from_pretrained(out_dir)` loads. Returns the written paths. A LoRA
  model's adapters are merged into the base (`lora.merged`); `peft_export` writes them apart.

  dtype: the stored dtype ('bfloat16', 'float32', 'float16'). tokenizer_dir: a checkpoint
  directory or hub id whose tokenizer files are copied and whose bos/eos/pad ids go into
  config.json and generation_config.json (bos_id / eos_id / pad_id override them).
  max_shard_bytes: above it the weights are split into model-0000N-of-0000M.safetensors files
  plus model.safetensors.index.json. On a multi-process run every process gathers each tensor
  (a collective) but only process 0 writes. A reward model (head='scalar') is written as the
  family's *ForSequenceClassification (score.weight, num_labels=1, pad_token_id). extra_config:
  more config.json keys (a reward model's scoring layout and whitening statistics).
  """
  if dtype not in DTYPES:
    raise ValueError(f'dtype={dtype!r}; supported: {tuple(DTYPES)}')
  np_dtype, st_dtype = DTYPES[dtype]
  if config.lora_rank:  # LoRA: W + (alpha / r) A B, a plain checkpoint of the base model
    params, config = lora.merged(config, params), lora.base_config(config)
  entries = tensors(params, config)  # validates the config before anything is written
  check_out_dir(out_dir)
  if tokenizer_dir is not None:
    tok = HFTokenizer.from_dir(hf_hub.resolve_path(tokenizer_dir, what='tokenizer_dir'))
    bos_id = tok.bos_id if bos_id is None else bos_id
    eos_id = tok.eos_id if eos_id is None else eos_id
    pad_id = tok.pad_id if pad_id is None else pad_id
  ids = dict(bos_id=bos_id, eos_id=eos_id, pad_id=pad_id)
  hf_json = {**hf_config(config, dtype=dtype, **ids), **(extra_config or {})}  # raises first
  writer = jax.process_index() == 0
  paths: list[str] = []
  if writer:
    os.makedirs(out_dir, exist_ok=True)
  shards = _shards(entries, np.dtype(np_dtype).itemsize, int(max_shard_bytes))
  names = (['model.safetensors'] if len(shards) == 1 else
           [f'model-{i + 1:05d}-of-{len(shards):05d}.safetensors' for i in range(len(shards))])
  total = 0
  for name, shard in zip(names, shards):
    if writer:
      total += _write_safetensors(os.path.join(out_dir, name), shard, np_dtype, st_dtype)
      paths.append(os.path.join(out_dir, name))
    else:  # the gathers are collectives: every process takes part in each one
      for _, _, produce in shard:
        produce()
  if not writer:
    return []
  if len(shards) > 1:
    index = {'metadata': {'total_size': total},
             'weight_map': {ent[0]: n for n, shard in zip(names, shards) for ent in shard}}
    paths.append(_write_json(os.path.join(out_dir, 'model.safetensors.index.json'), index))
  paths.append(_write_json(os.path.join(out_dir, 'config.json'), hf_json))
  gen = {'_from_model_config': True}
  gen.update({k[:-3] + '_token_id': int(v) for k, v in ids.items() if v is not None})
  paths.append(_write_json(os.path.join(out_dir, 'generation_config.json'), gen))
  if tokenizer_dir is not None:
    paths += _copy_tokenizer(tokenizer_dir, out_dir)
  return paths


def _write_json(path: str, obj: dict) -> str:
  with open(path, 'w') as f:
    json.dump(obj, f, indent=2, sort_keys=True)
    f.write('\n')
  return path


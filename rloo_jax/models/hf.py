"""Import Hugging Face checkpoints (Llama incl. 3.1+ rope scaling, Mistral, Qwen2, Qwen3, GPT-2,
GPT-NeoX / Pythia) and their tokenizer.json (`HFTokenizer`, in hf_tokenizer).

Reads config.json and safetensors (single file or sharded index) straight into our Transformer's
params; needs neither torch nor transformers. A local directory is read as it is; a hub id
('org/name') is resolved by `resolve_path` through huggingface_hub's cache (the network only when
the files are not cached and HF_HUB_OFFLINE is unset).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rloo_jax.models.hf_config import (  # noqa: F401  (re-exported)
    CAUSAL_LM, SEQ_CLS, SUPPORTED, architecture, config_from_hf)
from rloo_jax.models.hf_tokenizer import HFTokenizer  # noqa: F401  (re-exported)
from rloo_jax.models.transformer import _DTYPES, Transformer, TransformerConfig, abstract


# What snapshot_download fetches: the config, the weights and the tokenizer files, nothing else
# (repos often also hold pytorch_model.bin, ONNX or GGUF copies many times the size).
HUB_PATTERNS = ('config.json', 'generation_config.json', '*.safetensors',
                'model.safetensors.index.json', 'tokenizer.json', 'tokenizer_config.json',
                'special_tokens_map.json')
# 'org/name': exactly one slash, no leading '/', '.' or '~' (those are paths).
_REPO_ID = re.compile(r'^[A-Za-z0-9][\w\-.]*/[\w\-.]+$')


def _env_true(name: str) -> bool:
  return os.environ.get(name, '').strip().upper() in ('1', 'ON', 'YES', 'TRUE')


def _hub_cache_dir() -> str | None:
  """HF_HUB_CACHE, else $HF_HOME/hub, read now: huggingface_hub.constants reads them once at its
  import, so a process (or a test) that sets them later would otherwise be ignored."""
  if os.environ.get('HF_HUB_CACHE'):
    return os.path.expanduser(os.environ['HF_HUB_CACHE'])
  if os.environ.get('HF_HOME'):
    return os.path.join(os.path.expanduser(os.environ['HF_HOME']), 'hub')
  return None  # huggingface_hub's own default (~/.cache/huggingface/hub)


def resolve_path(path_or_id: str, *, what: str = 'config.model.init_from') -> str:
  """A local checkpoint directory for a local path or a Hugging Face hub id.

  A local directory passes through unchanged. Anything else that looks like 'org/name' is
  fetched with huggingface_hub.snapshot_download (HUB_PATTERNS only) into the hub cache, or read
  from that cache when HF_HUB_OFFLINE=1; the snapshot directory is returned. Otherwise a
  FileNotFoundError naming `what` (the setting the value came from) and the fix.
  """
  path = os.path.expanduser(str(path_or_id))
  if os.path.isdir(path):
    return path
  if not _REPO_ID.match(path) or os.path.exists(path):
    raise FileNotFoundError(
        f'{what}={path_or_id!r} is not a directory; point it at a local Hugging Face '
        "checkpoint (config.json + model.safetensors) or a hub id 'org/name'")
  try:
    # Only for hub ids: local checkpoints never import it.
    from huggingface_hub import constants as hub_constants, snapshot_download
  except ImportError as e:
    raise FileNotFoundError(f'{what}={path_or_id!r} is not a local directory, and loading it as '
                            'a hub id needs huggingface_hub (pip install huggingface_hub)') from e
  # Read at call time, like the cache directory: constants.HF_HUB_OFFLINE is fixed at import.
  offline = _env_true('HF_HUB_OFFLINE') or _env_true('TRANSFORMERS_OFFLINE') or bool(
      hub_constants.HF_HUB_OFFLINE)
  try:
    return snapshot_download(path, cache_dir=_hub_cache_dir(), allow_patterns=list(HUB_PATTERNS),
                             local_files_only=offline)
  except Exception as e:  # pylint: disable=broad-except  (offline miss, 404, gated, no network)
    hint = ('HF_HUB_OFFLINE is set and it is not in the hub cache '
            f'({_hub_cache_dir() or hub_constants.HF_HUB_CACHE}); download it once '
            'online, or unset HF_HUB_OFFLINE' if offline else
            'the hub could not serve it (check the id, your network and, for a gated repo, '
            'HF_TOKEN)')
    raise FileNotFoundError(f'{what}={path_or_id!r} is not a local directory and could not be '
                            f'loaded as a Hugging Face hub id: {hint} ({type(e).__name__}: '
                            f'{str(e)[:300]})') from e


def _read_json(path: str) -> dict:
  with open(path) as f:
    return json.load(f)


class _Tensors:
  """Lazy name -> numpy array lookup over one safetensors file or a sharded index."""

  def __init__(self, path: str, arch: str):
    from safetensors import safe_open  # import here so the model code does not need it

    self.arch, self.path = arch, path
    index = os.path.join(path, 'model.safetensors.index.json')
    single = os.path.join(path, 'model.safetensors')
    if os.path.exists(index):
      self.file_of = {k: os.path.join(path, f) for k, f in _read_json(index)['weight_map'].items()}
    elif os.path.exists(single):
      with safe_open(single, framework='numpy') as f:
        self.file_of = {k: single for k in f.keys()}
    else:
      raise ValueError(f'{path}: no model.safetensors or model.safetensors.index.json '
                       '(only safetensors checkpoints are supported)')
    self._open, self._safe_open = {}, safe_open

  def __contains__(self, key: str) -> bool:
    return key in self.file_of

  def _file(self, key: str):
    if key not in self.file_of:
      raise ValueError(f'{self.arch}: tensor {key!r} missing from the checkpoint in {self.path}')
    fname = self.file_of[key]
    if fname not in self._open:
      # 'flax' rather than 'numpy': numpy's safetensors reader rejects bfloat16.
      self._open[fname] = self._safe_open(fname, framework='flax')
    return self._open[fname]

  def __call__(self, key: str) -> np.ndarray:
    return np.asarray(self._file(key).get_tensor(key))

  def shape(self, key: str) -> tuple:  # from the file's header: reads no data
    return tuple(self._file(key).get_slice(key).get_shape())

  def read(self, key: str, index: tuple) -> np.ndarray:  # tensor[slices], reading only those
    return np.asarray(self._file(key).get_slice(key)[index])


@dataclasses.dataclass(frozen=True)
class _View:
  """A torch tensor's conversion to our layout: `fn` for the whole tensor, `out` the source of
  each output axis, so a sharded load reads just the slice a device's block needs (`block`). An
  int: that raw axis whole; (r, 'h') / (r, 'd'): the heads / head_dim factor of raw axis r, laid
  out `offset` + heads x `group` x `d`, this tensor at place `j` of each group (GPT-2's fused
  c_attn: offset j * E; GPT-NeoX's per-head q, k, v: group 3). None: the tensor as it is."""
  fn: Callable = lambda w: w
  out: Any = None
  h: int = 0
  d: int = 0
  group: int = 1
  j: int = 0
  offset: int = 0
  total: int = 0  # the raw split axis's size (0: h * group * d)

  def shape(self, raw: tuple) -> tuple | None:
    """The converted shape from the raw one alone; None where the tensor does not fit."""
    axes, size = self.out or tuple(range(len(raw))), self.total or self.h * self.group * self.d
    if {o if isinstance(o, int) else o[0] for o in axes} != set(range(len(raw))) or any(
        not isinstance(o, int) and raw[o[0]] != size for o in axes):
      return None
    return tuple(raw[o] if isinstance(o, int) else self.h if o[1] == 'h' else self.d for o in axes)

  def block(self, read: Callable, ndim: int, index: list) -> np.ndarray:
    """fn(tensor)[index] (index: (start, stop) per output axis) from read(raw slices), which
    covers no more of the tensor than the block needs (all of each group, for group > 1)."""
    axes, raw, split = self.out or tuple(range(ndim)), [slice(None)] * ndim, None
    for o, (a, b) in zip(axes, index):
      if isinstance(o, int):
        raw[o] = slice(a, b)
      elif o[1] == 'h':
        span, split, heads = self.group * self.d, o[0], b - a
        raw[split] = slice(self.offset + a * span, self.offset + b * span)
      else:
        dims = slice(a, b)
    blk, labels = read(tuple(raw)), list(range(ndim))
    if split is not None:
      blk = blk.reshape(blk.shape[:split] + (heads, self.group, self.d) + blk.shape[split + 1:])
      blk = blk[(slice(None),) * (split + 1) + (self.j, dims)]
      labels[split:split + 1] = [(split, 'h'), (split, 'd')]
    return blk.transpose([labels.index(o) for o in axes])


_T = _View(lambda w: w.T, (1, 0))
H0, D0, H1, D1 = (0, 'h'), (0, 'd'), (1, 'h'), (1, 'd')  # heads / head_dim of raw axis 0 or 1


def _putters(get: _Tensors, c: TransformerConfig, dtype, shard_of=None):
  """(put, layer): put(var, key, view) fills a parameter with view(tensor `key`); layer(var, key,
  view) a stacked layer parameter (`key` formats the layer index). With `shard_of` (var ->
  NamedSharding) each device's block is read as slices of the files (`_View.block`)."""
  def fill(var, keys, view, stacked):
    want = tuple(var.shape[stacked:])
    for i, key in enumerate(keys):  # headers only: a wrong tensor fails before any is read
      if view.shape(get.shape(key)) != want:
        where = f' (layer {i} of the {c.family} model)' if stacked else ''
        raise ValueError(f'tensor {key!r} has shape {get.shape(key)}, which does not fit '
                         f'{want}{where}')
    if shard_of is None:  # whole tensors, converted one at a time
      values = [np.asarray(view.fn(get(key)), dtype) for key in keys]
      return var.set_value(jnp.asarray(np.stack(values) if stacked else values[0]))

    def block(key, bounds):  # one tensor's part of this device's block, in the param dtype
      return np.asarray(view.block(lambda r: get.read(key, r), len(get.shape(key)), bounds), dtype)

    sharding, shape, arrays, first = shard_of(var), tuple(var.shape), [], {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
      bounds = tuple(s.indices(n)[:2] for s, n in zip(index, shape))
      if bounds not in first:  # a replica is copied from the first device holding it, not read
        # Layer slices go to the device as read, stacked there: the host holds one at a time.
        first[bounds] = (jnp.stack([jax.device_put(block(keys[i], bounds[1:]), device)
                                    for i in range(*bounds[0])]) if stacked else
                         jax.device_put(block(keys[0], bounds), device))
      arrays.append(jax.device_put(first[bounds], device))
    var.set_value(jax.make_array_from_single_device_arrays(shape, sharding, arrays))

  def put(var, key, view=_View()):
    fill(var, [key], view, False)

  def layer(var, key, view=_View()):
    fill(var, [key.format(i) for i in range(c.num_layers)], view, True)
  return put, layer


def _load_llama(model: Transformer, get: _Tensors, c: TransformerConfig, dtype, shard_of):
  pre = 'model.' if 'model.embed_tokens.weight' in get else ''
  e, hq, hkv, d = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
  (put, layer), blk = _putters(get, c, dtype, shard_of), model.layers
  put(model.embedding, pre + 'embed_tokens.weight')
  p = pre + 'layers.{}.'
  layer(blk.attn_norm.scale, p + 'input_layernorm.weight')
  layer(blk.mlp_norm.scale, p + 'post_attention_layernorm.weight')
  # torch Linear stores [out, in]; our kernels are [in, heads, head_dim].
  layer(blk.attn.q_kernel, p + 'self_attn.q_proj.weight',
        _View(lambda w: w.T.reshape(e, hq, d), (1, H0, D0), hq, d))
  layer(blk.attn.k_kernel, p + 'self_attn.k_proj.weight',
        _View(lambda w: w.T.reshape(e, hkv, d), (1, H0, D0), hkv, d))
  layer(blk.attn.v_kernel, p + 'self_attn.v_proj.weight',
        _View(lambda w: w.T.reshape(e, hkv, d), (1, H0, D0), hkv, d))
  layer(blk.attn.o_kernel, p + 'self_attn.o_proj.weight',
        _View(lambda w: w.T.reshape(hq, d, e), (H1, D1, 0), hq, d))
  if c.qkv_bias:
    layer(blk.attn.q_bias, p + 'self_attn.q_proj.bias',
          _View(lambda w: w.reshape(hq, d), (H0, D0), hq, d))
    layer(blk.attn.k_bias, p + 'self_attn.k_proj.bias',
          _View(lambda w: w.reshape(hkv, d), (H0, D0), hkv, d))
    layer(blk.attn.v_bias, p + 'self_attn.v_proj.bias',
          _View(lambda w: w.reshape(hkv, d), (H0, D0), hkv, d))
  if c.qk_norm:
    layer(blk.attn.q_norm_scale, p + 'self_attn.q_norm.weight')
    layer(blk.attn.k_norm_scale, p + 'self_attn.k_norm.weight')
  layer(blk.mlp.gate_kernel, p + 'mlp.gate_proj.weight', _T)
  layer(blk.mlp.up_kernel, p + 'mlp.up_proj.weight', _T)
  layer(blk.mlp.down_kernel, p + 'mlp.down_proj.weight', _T)
  put(model.final_norm.scale, pre + 'norm.weight')
  if c.head == 'lm' and not c.tie_embeddings:
    put(model.lm_head, 'lm_head.weight', _T)


def _load_gpt2(model: Transformer, get: _Tensors, c: TransformerConfig, dtype, shard_of):
  pre = 'transformer.' if 'transformer.wte.weight' in get else ''
  e, h, d = c.hidden_size, c.num_heads, c.head_dim
  (put, layer), blk = _putters(get, c, dtype, shard_of), model.layers
  put(model.embedding, pre + 'wte.weight')
  put(model.pos_embedding, pre + 'wpe.weight')
  p = pre + 'h.{}.'
  layer(blk.attn_norm.scale, p + 'ln_1.weight')
  layer(blk.attn_norm.bias, p + 'ln_1.bias')
  layer(blk.mlp_norm.scale, p + 'ln_2.weight')
  layer(blk.mlp_norm.bias, p + 'ln_2.bias')
  # GPT-2's Conv1D stores [in, out] with q, k, v fused along out.
  key = p + 'attn.c_attn.weight'
  if get.shape(key.format(0)) != (e, 3 * e):
    raise ValueError(f'tensor {key.format(0)!r} has shape {get.shape(key.format(0))}, expected '
                     f'{(e, 3 * e)}')
  for j, (kern, bias) in enumerate([(blk.attn.q_kernel, blk.attn.q_bias),
                                    (blk.attn.k_kernel, blk.attn.k_bias),
                                    (blk.attn.v_kernel, blk.attn.v_bias)]):
    layer(kern, key, _View(lambda w, j=j: w[:, j * e:(j + 1) * e].reshape(e, h, d), (0, H1, D1),
                           h, d, offset=j * e, total=3 * e))
    layer(bias, p + 'attn.c_attn.bias', _View(lambda w, j=j: w[j * e:(j + 1) * e].reshape(h, d),
                                              (H0, D0), h, d, offset=j * e, total=3 * e))
  layer(blk.attn.o_kernel, p + 'attn.c_proj.weight',
        _View(lambda w: w.reshape(h, d, e), (H0, D0, 1), h, d))
  layer(blk.attn.o_bias, p + 'attn.c_proj.bias')
  layer(blk.mlp.up_kernel, p + 'mlp.c_fc.weight')
  layer(blk.mlp.up_bias, p + 'mlp.c_fc.bias')
  layer(blk.mlp.down_kernel, p + 'mlp.c_proj.weight')
  layer(blk.mlp.down_bias, p + 'mlp.c_proj.bias')
  put(model.final_norm.scale, pre + 'ln_f.weight')
  put(model.final_norm.bias, pre + 'ln_f.bias')


def _load_gpt_neox(model: Transformer, get: _Tensors, c: TransformerConfig, dtype, shard_of):
  pre = 'gpt_neox.' if 'gpt_neox.embed_in.weight' in get else ''
  e, h, d = c.hidden_size, c.num_heads, c.head_dim
  (put, layer), blk = _putters(get, c, dtype, shard_of), model.layers
  put(model.embedding, pre + 'embed_in.weight')
  p = pre + 'layers.{}.'
  for norm, name in ((blk.attn_norm, 'input_layernorm'),
                     (blk.mlp_norm, 'post_attention_layernorm')):
    layer(norm.scale, p + name + '.weight')
    layer(norm.bias, p + name + '.bias')
  # query_key_value's [3*H*D, E] output is laid out per head, (H, 3, D): head h's q, k and v are
  # adjacent rows, not three q | k | v blocks as in GPT-2's c_attn.
  qkv = p + 'attention.query_key_value.'
  for j, n in enumerate('qkv'):
    layer(getattr(blk.attn, n + '_kernel'), qkv + 'weight',
          _View(lambda w, j=j: w.reshape(h, 3, d, e)[:, j].transpose(2, 0, 1), (1, H0, D0), h, d,
                group=3, j=j))
    if c.qkv_bias:
      layer(getattr(blk.attn, n + '_bias'), qkv + 'bias',
            _View(lambda w, j=j: w.reshape(h, 3, d)[:, j], (H0, D0), h, d, group=3, j=j))
  layer(blk.attn.o_kernel, p + 'attention.dense.weight',
        _View(lambda w: w.T.reshape(h, d, e), (H1, D1, 0), h, d))
  if c.out_bias:
    layer(blk.attn.o_bias, p + 'attention.dense.bias')
  layer(blk.mlp.up_kernel, p + 'mlp.dense_h_to_4h.weight', _T)
  layer(blk.mlp.up_bias, p + 'mlp.dense_h_to_4h.bias')
  layer(blk.mlp.down_kernel, p + 'mlp.dense_4h_to_h.weight', _T)
  layer(blk.mlp.down_bias, p + 'mlp.dense_4h_to_h.bias')
  put(model.final_norm.scale, pre + 'final_layer_norm.weight')
  put(model.final_norm.bias, pre + 'final_layer_norm.bias')
  if c.head == 'lm' and not c.tie_embeddings:
    # Pythia's checkpoints name the head embed_out; transformers 5 loads it as lm_head.
    put(model.lm_head, 'embed_out.weight' if 'embed_out.weight' in get else 'lm_head.weight',
        _T)


_LOADERS = {'llama': _load_llama, 'qwen2': _load_llama, 'qwen3': _load_llama, 'gpt2': _load_gpt2,
            'gpt_neox': _load_gpt_neox}


def load_checkpoint(path: str, *, seed: int = 0, shardings=None, **overrides):
  """Loads an HF checkpoint: a local directory or a hub id (`resolve_path`).

  Returns (config, params) where params is an nnx.State matching `create(config)` (so
  `model_fns(abstract(config)[0])` runs it). `overrides` set TransformerConfig fields, e.g.
  dtype='bfloat16', param_dtype='bfloat16', head='scalar' (a value model on a causal-LM backbone:
  the score head is freshly initialised from `seed`).

  `shardings` (the params' NamedShardings, e.g. `Experiment.state_shardings.params`, or a
  `sharding.Layout`): each parameter is made on them, each device's block read as file slices;
  the host holds about one layer's tensor at a time, each process reads only its devices' blocks.
  """
  path = resolve_path(path)
  hf = _read_json(os.path.join(path, 'config.json'))
  arch = architecture(hf)
  config = config_from_hf(hf, **overrides)
  if arch in SEQ_CLS and config.head != 'scalar':
    raise ValueError(f'{arch} has no LM head; load it with head="scalar"')
  get = _Tensors(path, arch)
  # Build on the abstract model and fill it in, so no random weights are ever materialised
  # for the backbone.
  model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(seed)))
  dtype = _DTYPES[config.param_dtype]
  shard_of = None if shardings is None else _sharding_lookup(model, shardings)
  put, _ = _putters(get, config, dtype, shard_of)
  _LOADERS[config.family](model, get, config, dtype, shard_of)
  if config.head == 'scalar':
    if 'score.weight' in get:
      put(model.score_kernel, 'score.weight', _T)
    else:
      kernel = nnx.initializers.normal(0.02)(jax.random.key(seed), (config.hidden_size, 1), dtype)
      _set(model.score_kernel, kernel, shard_of)
    if 'score.weight' in get and 'score.bias' in get:
      put(model.score_bias, 'score.bias')
    else:
      _set(model.score_bias, np.zeros((1,), dtype), shard_of)
  _, params = nnx.split(model)
  leftover = [k for k, v in nnx.to_flat_state(params) if isinstance(v[...], jax.ShapeDtypeStruct)]
  if leftover:  # a bug in the mapping above, not a user error
    raise AssertionError(f'parameters not loaded: {leftover}')
  return config, params


def _sharding_lookup(model, shardings) -> Callable:
  """var -> its NamedSharding, by the var's path in `model` (`shardings` a tree or a Layout)."""
  if hasattr(shardings, 'tree_shardings'):
    shardings = shardings.tree_shardings(nnx.split(model)[1])
  by_path = {tuple(k): v.get_value() if isinstance(v, nnx.Variable) else v
             for k, v in nnx.to_flat_state(shardings)}
  by_id = {id(v): by_path[tuple(k)] for k, v in nnx.iter_graph(model)
           if isinstance(v, nnx.Variable) and tuple(k) in by_path}
  return lambda var: by_id[id(var)]


def _set(var, value, shard_of) -> None:
  """A small parameter made here (the same on every process), placed on its sharding."""
  value = np.asarray(value)
  var.set_value(jnp.asarray(value) if shard_of is None else
                jax.make_array_from_callback(value.shape, shard_of(var), lambda i: value[i]))


def load_model(path: str, **kwargs):
  """(config, graphdef, params): load_checkpoint (a directory or a hub id) plus the graphdef
  model_fns needs."""
  config, params = load_checkpoint(path, **kwargs)
  return config, abstract(config)[0], params


def load_tokenizer(path: str) -> HFTokenizer:
  """tokenizer.json of a local directory or a hub id (`resolve_path`)."""
  return HFTokenizer.from_dir(resolve_path(path))

"""Import Hugging Face checkpoints (Llama incl. 3.1+ rope scaling, Mistral, Qwen2, Qwen3, GPT-2,
GPT-NeoX / Pythia) and their tokenizer.json (`HFTokenizer`, in hf_tokenizer).

Reads config.json and safetensors (single file or sharded index) straight into our Transformer's
params; needs neither torch nor transformers. A local directory is read as it is; a hub id
('org/name') is resolved by `resolve_path` through huggingface_hub's cache (the network only when
the files are not cached and HF_HUB_OFFLINE is unset).
"""

from __future__ import annotations

import json
import os
import re

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

    self.arch = arch
    self.path = path
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
    self._open = {}
    self._safe_open = safe_open

  def __contains__(self, key: str) -> bool:
    return key in self.file_of

  def __call__(self, key: str) -> np.ndarray:
    if key not in self.file_of:
      raise ValueError(f'{self.arch}: tensor {key!r} missing from the checkpoint in {self.path}')
    fname = self.file_of[key]
    if fname not in self._open:
      # 'flax' rather than 'numpy': numpy's safetensors reader rejects bfloat16.
      self._open[fname] = self._safe_open(fname, framework='flax')
    return np.asarray(self._open[fname].get_tensor(key))


def _put(var: nnx.Param, value: np.ndarray, key: str, dtype) -> None:
  if tuple(value.shape) != tuple(var.shape):
    raise ValueError(f'tensor {key!r} has shape {tuple(value.shape)}, expected {tuple(var.shape)}')
  var.set_value(jnp.asarray(value, dtype))


def _putters(get: _Tensors, c: TransformerConfig, dtype):
  """(put, layer): put(var, key, fn) fills a parameter with fn(tensor `key`); layer(var, key, fn)
  a stacked layer parameter, `key` a format string of the layer index, the L tensors converted
  one by one and stacked on the leading layers axis."""
  def put(var, key, fn=lambda w: w):
    _put(var, fn(get(key)), key, dtype)

  def layer(var, key, fn=lambda w: w):
    layers = []
    want = tuple(var.shape[1:])
    for i in range(c.num_layers):
      raw = get(key.format(i))
      try:
        w = fn(raw)
      except ValueError:  # fn transposes, slices, reshapes: a wrong size fails its reshape
        w = raw
      if tuple(w.shape) != want:
        raise ValueError(f'tensor {key.format(i)!r} has shape {tuple(raw.shape)}, which does not '
                         f'fit {want} (layer {i} of the {c.family} model)')
      layers.append(np.asarray(w, dtype))
    var.set_value(jnp.asarray(np.stack(layers)))
  return put, layer


def _load_llama(model: Transformer, get: _Tensors, c: TransformerConfig, dtype, arch: str):
  pre = 'model.' if 'model.embed_tokens.weight' in get else ''
  e, hq, hkv, d = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
  (put, layer), blk = _putters(get, c, dtype), model.layers
  put(model.embedding, pre + 'embed_tokens.weight')
  p = pre + 'layers.{}.'
  layer(blk.attn_norm.scale, p + 'input_layernorm.weight')
  layer(blk.mlp_norm.scale, p + 'post_attention_layernorm.weight')
  # torch Linear stores [out, in]; our kernels are [in, heads, head_dim].
  layer(blk.attn.q_kernel, p + 'self_attn.q_proj.weight', lambda w: w.T.reshape(e, hq, d))
  layer(blk.attn.k_kernel, p + 'self_attn.k_proj.weight', lambda w: w.T.reshape(e, hkv, d))
  layer(blk.attn.v_kernel, p + 'self_attn.v_proj.weight', lambda w: w.T.reshape(e, hkv, d))
  layer(blk.attn.o_kernel, p + 'self_attn.o_proj.weight', lambda w: w.T.reshape(hq, d, e))
  if c.qkv_bias:
    layer(blk.attn.q_bias, p + 'self_attn.q_proj.bias', lambda w: w.reshape(hq, d))
    layer(blk.attn.k_bias, p + 'self_attn.k_proj.bias', lambda w: w.reshape(hkv, d))
    layer(blk.attn.v_bias, p + 'self_attn.v_proj.bias', lambda w: w.reshape(hkv, d))
  if c.qk_norm:
    layer(blk.attn.q_norm_scale, p + 'self_attn.q_norm.weight')
    layer(blk.attn.k_norm_scale, p + 'self_attn.k_norm.weight')
  layer(blk.mlp.gate_kernel, p + 'mlp.gate_proj.weight', lambda w: w.T)
  layer(blk.mlp.up_kernel, p + 'mlp.up_proj.weight', lambda w: w.T)
  layer(blk.mlp.down_kernel, p + 'mlp.down_proj.weight', lambda w: w.T)
  put(model.final_norm.scale, pre + 'norm.weight')
  if c.head == 'lm' and not c.tie_embeddings:
    put(model.lm_head, 'lm_head.weight', lambda w: w.T)


def _load_gpt2(model: Transformer, get: _Tensors, c: TransformerConfig, dtype, arch: str):
  pre = 'transformer.' if 'transformer.wte.weight' in get else ''
  e, h, d = c.hidden_size, c.num_heads, c.head_dim
  (put, layer), blk = _putters(get, c, dtype), model.layers
  put(model.embedding, pre + 'wte.weight')
  put(model.pos_embedding, pre + 'wpe.weight')
  p = pre + 'h.{}.'
  layer(blk.attn_norm.scale, p + 'ln_1.weight')
  layer(blk.attn_norm.bias, p + 'ln_1.bias')
  layer(blk.mlp_norm.scale, p + 'ln_2.weight')
  layer(blk.mlp_norm.bias, p + 'ln_2.bias')
  # GPT-2's Conv1D stores [in, out] with q, k, v fused along out.
  key = p + 'attn.c_attn.weight'
  w0 = get(key.format(0))
  if w0.shape != (e, 3 * e):
    raise ValueError(f'tensor {key.format(0)!r} has shape {w0.shape}, expected {(e, 3 * e)}')
  for j, (kern, bias) in enumerate([(blk.attn.q_kernel, blk.attn.q_bias),
                                    (blk.attn.k_kernel, blk.attn.k_bias),
                                    (blk.attn.v_kernel, blk.attn.v_bias)]):
    layer(kern, key, lambda w, j=j: w[:, j * e:(j + 1) * e].reshape(e, h, d))
    layer(bias, p + 'attn.c_attn.bias', lambda w, j=j: w[j * e:(j + 1) * e].reshape(h, d))
  layer(blk.attn.o_kernel, p + 'attn.c_proj.weight', lambda w: w.reshape(h, d, e))
  layer(blk.attn.o_bias, p + 'attn.c_proj.bias')
  layer(blk.mlp.up_kernel, p + 'mlp.c_fc.weight')
  layer(blk.mlp.up_bias, p + 'mlp.c_fc.bias')
  layer(blk.mlp.down_kernel, p + 'mlp.c_proj.weight')
  layer(blk.mlp.down_bias, p + 'mlp.c_proj.bias')
  put(model.final_norm.scale, pre + 'ln_f.weight')
  put(model.final_norm.bias, pre + 'ln_f.bias')


def _load_gpt_neox(model: Transformer, get: _Tensors, c: TransformerConfig, dtype, arch: str):
  pre = 'gpt_neox.' if 'gpt_neox.embed_in.weight' in get else ''
  e, h, d = c.hidden_size, c.num_heads, c.head_dim
  (put, layer), blk = _putters(get, c, dtype), model.layers
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
          lambda w, j=j: w.reshape(h, 3, d, e)[:, j].transpose(2, 0, 1))
    if c.qkv_bias:
      layer(getattr(blk.attn, n + '_bias'), qkv + 'bias', lambda w, j=j: w.reshape(h, 3, d)[:, j])
  layer(blk.attn.o_kernel, p + 'attention.dense.weight', lambda w: w.T.reshape(h, d, e))
  if c.out_bias:
    layer(blk.attn.o_bias, p + 'attention.dense.bias')
  layer(blk.mlp.up_kernel, p + 'mlp.dense_h_to_4h.weight', lambda w: w.T)
  layer(blk.mlp.up_bias, p + 'mlp.dense_h_to_4h.bias')
  layer(blk.mlp.down_kernel, p + 'mlp.dense_4h_to_h.weight', lambda w: w.T)
  layer(blk.mlp.down_bias, p + 'mlp.dense_4h_to_h.bias')
  put(model.final_norm.scale, pre + 'final_layer_norm.weight')
  put(model.final_norm.bias, pre + 'final_layer_norm.bias')
  if c.head == 'lm' and not c.tie_embeddings:
    # Pythia's checkpoints name the head embed_out; transformers 5 loads it as lm_head.
    put(model.lm_head, 'embed_out.weight' if 'embed_out.weight' in get else 'lm_head.weight',
        lambda w: w.T)


_LOADERS = {'llama': _load_llama, 'qwen2': _load_llama, 'qwen3': _load_llama, 'gpt2': _load_gpt2,
            'gpt_neox': _load_gpt_neox}


def load_checkpoint(path: str, *, seed: int = 0, **overrides):
  """Loads an HF checkpoint: a local directory or a hub id (`resolve_path`).

  Returns (config, params) where params is an nnx.State matching `create(config)` (so
  `model_fns(abstract(config)[0])` runs it). `overrides` set TransformerConfig fields, e.g.
  dtype='bfloat16', param_dtype='bfloat16', head='scalar' (a value model on a causal-LM backbone:
  the score head is freshly initialised from `seed`).
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
  _LOADERS[config.family](model, get, config, dtype, arch)
  if config.head == 'scalar':
    if 'score.weight' in get:
      _put(model.score_kernel, get('score.weight').T, 'score.weight', dtype)
      _put(model.score_bias, get('score.bias') if 'score.bias' in get else np.zeros(1),
           'score.bias', dtype)
    else:
      kernel = nnx.initializers.normal(0.02)(jax.random.key(seed), (config.hidden_size, 1), dtype)
      model.score_kernel.set_value(kernel)
      model.score_bias.set_value(jnp.zeros((1,), dtype))
  _, params = nnx.split(model)
  leftover = [k for k, v in nnx.to_flat_state(params) if isinstance(v[...], jax.ShapeDtypeStruct)]
  if leftover:  # a bug in the mapping above, not a user error
    raise AssertionError(f'parameters not loaded: {leftover}')
  return config, params


def load_model(path: str, **kwargs):
  """(config, graphdef, params): load_checkpoint (a directory or a hub id) plus the graphdef
  model_fns needs."""
  config, params = load_checkpoint(path, **kwargs)
  return config, abstract(config)[0], params


def load_tokenizer(path: str) -> HFTokenizer:
  """tokenizer.json of a local directory or a hub id (`resolve_path`)."""
  return HFTokenizer.from_dir(resolve_path(path))

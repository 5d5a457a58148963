"""Import Hugging Face checkpoints (Llama incl. 3.1+ rope scaling, Mistral and Qwen with their
sliding windows, Qwen2, Qwen3, Gemma 2, Gemma 3, GPT-2, GPT-NeoX / Pythia; each family's weight
map in hf_weights, its config.json in hf_config) and their tokenizer.json (`HFTokenizer`).

Reads config.json and safetensors (single file or sharded index) straight into our Transformer's
params; needs neither torch nor transformers. A local directory is read as it is; a hub id
('org/name') is resolved by `resolve_path` through huggingface_hub's cache (the network only when
the files are not cached and HF_HUB_OFFLINE is unset).
"""

from __future__ import annotations

import json
import os
from typing import Callable

import jax
import numpy as np
from flax import nnx

from rloo_jax.models.hf_config import (  # noqa: F401  (re-exported)
    SEQ_CLS, architecture, config_from_hf)
from rloo_jax.models.hf_hub import resolve_path  # noqa: F401  (re-exported)
from rloo_jax.models.hf_read import _T, _putters, _Tensors
from rloo_jax.models.hf_tokenizer import HFTokenizer  # noqa: F401  (re-exported)
from rloo_jax.models.hf_weights import _LOADERS
from rloo_jax.models.transformer import _DTYPES, Transformer, abstract


def _read_json(path: str) -> dict:
  with open(path) as f:
    return json.load(f)


def load_checkpoint(path: str, *, seed: int = 0, shardings=None, **overrides):
  """Loads an HF checkpoint: a local directory or a hub id (`resolve_path`).

  Returns (config, params) where params is an nnx.State matching `create(config)` (so
  `model_fns(abstract(config)[0])` runs it). `overrides` set TransformerConfig fields, e.g.
  dtype='bfloat16', param_dtype='bfloat16', head='scalar' (a value model on a causal-LM backbone:
  the score head is freshly initialised from `seed`).

  `shardings` (the params' NamedShardings, e.g. `Experiment.state_shardings.params`, or a
  `sharding.Layout`): each parameter is made on them, each device's block read as file slices
  (pread, no memory map) and sent whole; the host holds one device's block of one parameter at a
  time, each process reads only its devices' blocks. Without, each parameter is assembled whole
  on the host and sent to the default device.
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
  var.set_value(jax.device_put(value) if shard_of is None else
                jax.make_array_from_callback(value.shape, shard_of(var), lambda i: value[i]))


def load_model(path: str, **kwargs):
  """(config, graphdef, params): load_checkpoint (a directory or a hub id) plus the graphdef
  model_fns needs."""
  config, params = load_checkpoint(path, **kwargs)
  return config, abstract(config)[0], params


def save_model(path: str, config, params, **kwargs) -> list[str]:
  """The inverse of load_model: writes `params` (of `config`) as a Hugging Face checkpoint in the
  directory `path` (head='scalar': as *ForSequenceClassification); `kwargs` (dtype,
  tokenizer_dir, max_shard_bytes, bos/eos/pad ids, extra_config) go to
  hf_export.save_pretrained. Returns the written paths."""
  from rloo_jax.models import hf_export  # here: hf_export imports this module
  return hf_export.save_pretrained(params, config, path, **kwargs)


def load_tokenizer(path: str) -> HFTokenizer:
  """tokenizer.json of a local directory or a hub id (`resolve_path`)."""
  return HFTokenizer.from_dir(resolve_path(path))

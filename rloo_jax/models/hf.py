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
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rloo_jax.models.hf_config import (  # noqa: F401  (re-exported)
    CAUSAL_LM, SEQ_CLS, SUPPORTED, architecture, config_from_hf)
from rloo_jax.models.hf_read import _T, _putters, _Tensors
from rloo_jax.models.hf_tokenizer import HFTokenizer  # noqa: F401  (re-exported)
from rloo_jax.models.hf_weights import _LOADERS
from rloo_jax.models.transformer import _DTYPES, Transformer, abstract


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

"""Import Hugging Face checkpoints (Llama, Qwen2, GPT-2) and their tokenizer.json.

Reads config.json and safetensors (single file or sharded index) straight into our Transformer's
params; needs neither torch nor transformers. A local directory is read as it is; a hub id
('org/name') is resolved by `resolve_path` through huggingface_hub's cache (the network only when
the files are not cached and HF_HUB_OFFLINE is unset).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rloo_jax.models.transformer import _DTYPES, Transformer, TransformerConfig, abstract

CAUSAL_LM = {'LlamaForCausalLM': 'llama', 'Qwen2ForCausalLM': 'qwen2', 'GPT2LMHeadModel': 'gpt2'}
# A reward model saved as *ForSequenceClassification (num_labels=1) maps onto head='scalar'.
SEQ_CLS = {'LlamaForSequenceClassification': 'llama', 'Qwen2ForSequenceClassification': 'qwen2',
           'GPT2ForSequenceClassification': 'gpt2'}
SUPPORTED = tuple(CAUSAL_LM) + tuple(SEQ_CLS)
_MODEL_TYPES = {'llama': 'LlamaForCausalLM', 'qwen2': 'Qwen2ForCausalLM', 'gpt2': 'GPT2LMHeadModel'}


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


def architecture(hf_config: dict) -> str:
  archs = hf_config.get('architectures') or []
  if not archs and hf_config.get('model_type') in _MODEL_TYPES:
    archs = [_MODEL_TYPES[hf_config['model_type']]]
  if len(archs) != 1 or archs[0] not in SUPPORTED:
    raise ValueError(f'Unsupported architecture {archs or hf_config.get("model_type")!r}; '
                     f'supported: {", ".join(SUPPORTED)}')
  return archs[0]


def _rope_theta(hf: dict, arch: str) -> float:
  # transformers >= 5 writes rope_parameters; older versions rope_theta (+ rope_scaling).
  params = hf.get('rope_parameters') or {}
  scaling = hf.get('rope_scaling') or {}
  rope_type = params.get('rope_type') or scaling.get('rope_type') or scaling.get('type') or 'default'
  if rope_type != 'default':
    raise ValueError(f'{arch}: rope_type {rope_type!r} is not supported (only default RoPE)')
  theta = params.get('rope_theta', hf.get('rope_theta'))
  if theta is None:
    raise ValueError(f'{arch}: config.json has neither rope_parameters.rope_theta nor rope_theta')
  return float(theta)


def config_from_hf(hf: dict, **overrides) -> TransformerConfig:
  """TransformerConfig from a config.json dict; overrides (dtype, param_dtype, head...) win."""
  arch = architecture(hf)
  family = CAUSAL_LM.get(arch) or SEQ_CLS[arch]
  head = 'scalar' if arch in SEQ_CLS else 'lm'
  if family == 'gpt2':
    act = hf.get('activation_function', 'gelu_new')
    if act not in ('gelu_new', 'gelu_pytorch_tanh'):
      raise ValueError(f'{arch}: activation_function {act!r} not supported (gelu_new only)')
    if hf.get('scale_attn_by_inverse_layer_idx') or hf.get('reorder_and_upcast_attn'):
      raise ValueError(f'{arch}: scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn '
                       'are not supported')
    e, h = hf['n_embd'], hf['n_head']
    kw = dict(vocab_size=hf['vocab_size'], hidden_size=e, num_layers=hf['n_layer'], num_heads=h,
              num_kv_heads=h, head_dim=e // h, intermediate_size=hf.get('n_inner') or 4 * e,
              max_seq_len=hf['n_positions'], norm_eps=hf.get('layer_norm_epsilon', 1e-5),
              tie_embeddings=True, qkv_bias=True, head=head)
    return TransformerConfig.gpt2(**{**kw, **overrides})
  if hf.get('hidden_act', 'silu') != 'silu':
    raise ValueError(f'{arch}: hidden_act {hf["hidden_act"]!r} not supported (silu only)')
  if hf.get('mlp_bias') or (family == 'llama' and hf.get('attention_bias')):
    raise ValueError(f'{arch}: attention_bias / mlp_bias are not supported for llama')
  if (family == 'qwen2' and hf.get('use_sliding_window')) or any(
      t != 'full_attention' for t in hf.get('layer_types') or ()):
    raise ValueError(f'{arch}: sliding-window attention is not supported')
  heads = hf['num_attention_heads']
  kw = dict(vocab_size=hf['vocab_size'], hidden_size=hf['hidden_size'],
            num_layers=hf['num_hidden_layers'], num_heads=heads,
            num_kv_heads=hf.get('num_key_value_heads') or heads,
            head_dim=hf.get('head_dim') or hf['hidden_size'] // heads,
            intermediate_size=hf['intermediate_size'],
            max_seq_len=hf.get('max_position_embeddings', 2048),
            norm_eps=hf.get('rms_norm_eps', 1e-6), rope_theta=_rope_theta(hf, arch),
            tie_embeddings=bool(hf.get('tie_word_embeddings', False)),
            qkv_bias=(family == 'qwen2'), head=head)
  return getattr(TransformerConfig, family)(**{**kw, **overrides})


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


def _load_llama(model: Transformer, get: _Tensors, c: TransformerConfig, dtype, arch: str):
  pre = 'model.' if 'model.embed_tokens.weight' in get else ''
  e, hq, hkv, d = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim

  def put(var, key, fn=lambda w: w):
    _put(var, fn(get(key)), key, dtype)

  put(model.embedding, pre + 'embed_tokens.weight')
  for i, blk in enumerate(model.layers):
    p = f'{pre}layers.{i}.'
    put(blk.attn_norm.scale, p + 'input_layernorm.weight')
    put(blk.mlp_norm.scale, p + 'post_attention_layernorm.weight')
    # torch Linear stores [out, in]; our kernels are [in, heads, head_dim].
    put(blk.attn.q_kernel, p + 'self_attn.q_proj.weight', lambda w: w.T.reshape(e, hq, d))
    put(blk.attn.k_kernel, p + 'self_attn.k_proj.weight', lambda w: w.T.reshape(e, hkv, d))
    put(blk.attn.v_kernel, p + 'self_attn.v_proj.weight', lambda w: w.T.reshape(e, hkv, d))
    put(blk.attn.o_kernel, p + 'self_attn.o_proj.weight', lambda w: w.T.reshape(hq, d, e))
    if c.qkv_bias:
      put(blk.attn.q_bias, p + 'self_attn.q_proj.bias', lambda w: w.reshape(hq, d))
      put(blk.attn.k_bias, p + 'self_attn.k_proj.bias', lambda w: w.reshape(hkv, d))
      put(blk.attn.v_bias, p + 'self_attn.v_proj.bias', lambda w: w.reshape(hkv, d))
    put(blk.mlp.gate_kernel, p + 'mlp.gate_proj.weight', lambda w: w.T)
    put(blk.mlp.up_kernel, p + 'mlp.up_proj.weight', lambda w: w.T)
    put(blk.mlp.down_kernel, p + 'mlp.down_proj.weight', lambda w: w.T)
  put(model.final_norm.scale, pre + 'norm.weight')
  if c.head == 'lm' and not c.tie_embeddings:
    put(model.lm_head, 'lm_head.weight', lambda w: w.T)


def _load_gpt2(model: Transformer, get: _Tensors, c: TransformerConfig, dtype, arch: str):
  pre = 'transformer.' if 'transformer.wte.weight' in get else ''
  e, h, d = c.hidden_size, c.num_heads, c.head_dim

  def put(var, key, fn=lambda w: w):
    _put(var, fn(get(key)), key, dtype)

  put(model.embedding, pre + 'wte.weight')
  put(model.pos_embedding, pre + 'wpe.weight')
  for i, blk in enumerate(model.layers):
    p = f'{pre}h.{i}.'
    put(blk.attn_norm.scale, p + 'ln_1.weight')
    put(blk.attn_norm.bias, p + 'ln_1.bias')
    put(blk.mlp_norm.scale, p + 'ln_2.weight')
    put(blk.mlp_norm.bias, p + 'ln_2.bias')
    # GPT-2's Conv1D stores [in, out] with q, k, v fused along out.
    w_qkv = get(p + 'attn.c_attn.weight')
    b_qkv = get(p + 'attn.c_attn.bias')
    for j, (kern, bias) in enumerate([(blk.attn.q_kernel, blk.attn.q_bias),
                                      (blk.attn.k_kernel, blk.attn.k_bias),
                                      (blk.attn.v_kernel, blk.attn.v_bias)]):
      key = p + 'attn.c_attn.weight'
      if w_qkv.shape != (e, 3 * e):
        raise ValueError(f'tensor {key!r} has shape {w_qkv.shape}, expected {(e, 3 * e)}')
      _put(kern, w_qkv[:, j * e:(j + 1) * e].reshape(e, h, d), key, dtype)
      _put(bias, b_qkv[j * e:(j + 1) * e].reshape(h, d), p + 'attn.c_attn.bias', dtype)
    put(blk.attn.o_kernel, p + 'attn.c_proj.weight', lambda w: w.reshape(h, d, e))
    put(blk.attn.o_bias, p + 'attn.c_proj.bias')
    put(blk.mlp.up_kernel, p + 'mlp.c_fc.weight')
    put(blk.mlp.up_bias, p + 'mlp.c_fc.bias')
    put(blk.mlp.down_kernel, p + 'mlp.c_proj.weight')
    put(blk.mlp.down_bias, p + 'mlp.c_proj.bias')
  put(model.final_norm.scale, pre + 'ln_f.weight')
  put(model.final_norm.bias, pre + 'ln_f.bias')


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
  if config.family == 'gpt2':
    _load_gpt2(model, get, config, dtype, arch)
  else:
    _load_llama(model, get, config, dtype, arch)
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


def _token_str(tok: Any) -> str | None:
  return tok.get('content') if isinstance(tok, dict) else tok


class HFTokenizer:
  """tokenizer.json via the `tokenizers` library, with special-token ids from the config files."""

  def __init__(self, tokenizer, *, bos_id: int | None, eos_id: int | None, pad_id: int | None):
    self.tokenizer = tokenizer
    self.bos_id = bos_id
    self.eos_id = eos_id
    # Pad falls back to EOS (GPT-2/Llama ship none); padding is masked everywhere anyway.
    self.pad_id = pad_id if pad_id is not None else eos_id

  @classmethod
  def from_dir(cls, path: str) -> 'HFTokenizer':
    import tokenizers

    tok_file = os.path.join(path, 'tokenizer.json')
    if not os.path.exists(tok_file):
      raise ValueError(f'{path}: no tokenizer.json (only fast-tokenizer files are supported)')
    tok = tokenizers.Tokenizer.from_file(tok_file)
    sources = [os.path.join(path, n)
               for n in ('tokenizer_config.json', 'generation_config.json', 'config.json')]
    cfgs = [_read_json(p) for p in sources if os.path.exists(p)]

    def special(name: str) -> int | None:
      for cfg in cfgs:
        s = _token_str(cfg.get(f'{name}_token'))
        if s is not None and tok.token_to_id(s) is not None:
          return tok.token_to_id(s)
        i = cfg.get(f'{name}_token_id')
        if isinstance(i, list):
          i = i[0] if i else None
        if i is not None:
          return int(i)
      return None

    return cls(tok, bos_id=special('bos'), eos_id=special('eos'), pad_id=special('pad'))

  @property
  def vocab_size(self) -> int:
    return self.tokenizer.get_vocab_size(with_added_tokens=True)

  # Same conventions as rloo_jax.data.tokenizer, so either can serve the pipeline: encode adds no
  # special tokens (the pipeline prepends bos_id itself), decode stops at the first EOS.
  def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
    return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

  def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
    encoded = self.tokenizer.encode_batch(list(texts), add_special_tokens=add_special_tokens)
    return [e.ids for e in encoded]

  def decode(self, ids, skip_special_tokens: bool = True) -> str:
    ids = [int(i) for i in np.asarray(ids).reshape(-1)]
    if self.eos_id is not None and self.eos_id in ids:
      ids = ids[:ids.index(self.eos_id)]
    return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

  def decode_batch(self, ids_nt, skip_special_tokens: bool = True) -> list[str]:
    return [self.decode(row, skip_special_tokens) for row in ids_nt]


def load_tokenizer(path: str) -> HFTokenizer:
  """tokenizer.json of a local directory or a hub id (`resolve_path`)."""
  return HFTokenizer.from_dir(resolve_path(path))

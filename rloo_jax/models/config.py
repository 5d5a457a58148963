"""The transformer's hyperparameters: `TransformerConfig`, its per-family presets, and the mapping
from an experiment's `config.model` section."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from rloo_jax.models import attention_ops

FAMILIES = ('llama', 'qwen2', 'qwen3', 'gpt2', 'gpt_neox', 'gemma2', 'gemma3')
# transformers' layer_types names.
LAYER_TYPES = ('full_attention', 'sliding_attention')
# RoPE variants `layers.inv_freq` implements (transformers' rope_type names).
ROPE_TYPES = ('default', 'linear', 'llama3')
HEADS = ('lm', 'scalar')
# Rematerialisation of the scanned layer body (`transformer.remat_policy`): 'none' keeps every
# intermediate for the backward, 'full' keeps only each layer's input and recomputes the rest,
# 'dots' keeps the matmul outputs (no batch dims) and recomputes the elementwise work, 'names'
# keeps the layer's intermediates named in `remat_names` (of CHECKPOINT_NAMES) and recomputes
# the rest.
REMAT_POLICIES = ('none', 'full', 'dots', 'names')
# The layer body's `checkpoint_name`s (`block.Block`): q, k, v after RoPE, the attention output
# before its projection, the MLP's normed input and its output.
CHECKPOINT_NAMES = ('query', 'key', 'value', 'attention', 'mlp_in', 'mlp_out')
_DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16, 'float16': jnp.float16}


def gemma_layer_types(num_layers: int, every: int) -> tuple:
  """Gemma's `layer_types`: layer i is global when (i + 1) % every == 0, else it slides (Gemma 2
  alternates, every = 2; Gemma 3 has a global layer every 6)."""
  return tuple(LAYER_TYPES[int((i + 1) % every != 0)] for i in range(num_layers))


def check_remat_names(remat: str, names) -> tuple:
  """`names` (a tuple, or a comma-separated string) checked against `remat`; returns the tuple."""
  names = tuple(n.strip() for n in names.split(',') if n.strip()) if isinstance(names, str) \
      else tuple(names)
  unknown = sorted(set(names) - set(CHECKPOINT_NAMES))
  if unknown:
    raise ValueError(f'config.model.remat_names: unknown {unknown}; choose from {CHECKPOINT_NAMES}')
  if remat == 'names' and not names:
    raise ValueError("config.model.remat='names' saves the intermediates config.model.remat_names "
                     f"lists, and it is empty; list some of {CHECKPOINT_NAMES} (or remat='full')")
  if names and remat != 'names':
    raise ValueError(f"config.model.remat_names is read only with remat='names' (now "
                     f"{remat!r}); set config.model.remat='names' or remat_names=''")
  return names


def dtype_of(name: str):
  """The jnp dtype of a config dtype name ('float32', 'bfloat16', 'float16')."""
  if name not in _DTYPES:
    raise ValueError(f'dtype {name!r}; supported: {tuple(_DTYPES)}')
  return _DTYPES[name]


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Hashable (frozen) so it may be a static argument; `family` selects norm/MLP/position flavour.

  rotary_pct: the share of each head's dims that RoPE rotates (GPT-NeoX: the first
  int(head_dim * rotary_pct), the rest pass through). parallel_residual: attention and MLP both
  read the layer input, x + attn(ln1(x)) + mlp(ln2(x)) (GPT-NeoX / Pythia), instead of the MLP
  reading the attention's output.

  rope_type: 'default', 'linear' (every inverse frequency divided by rope_factor) or 'llama3'
  (Llama 3.1+: a frequency whose wavelength exceeds rope_original_max_len / rope_low_freq_factor
  is divided by rope_factor, one shorter than rope_original_max_len / rope_high_freq_factor is
  kept, those between are blended smoothly). Scalar fields rather than a dict so the config
  stays hashable; the rope_* fields other than rope_type are read only by the type using them.

  sliding_window: with W > 0 a query at position p sees only keys at positions > p - W, in the
  layers `layer_types` marks 'sliding_attention' (every layer when layer_types is empty: Mistral).
  local_rope_theta: the RoPE base of the sliding layers, which then rotate without rope scaling
  (Gemma 3's rope_local_base_freq); 0: every layer uses rope_theta and the scaling.
  attn_softcap / final_softcap: scores (logits) become cap * tanh(x / cap) (Gemma 2); 0: off.
  query_pre_attn_scalar: the scores are scaled by its -1/2 power instead of head_dim's (Gemma).
  """

  family: str = 'llama'
  vocab_size: int = 32000
  hidden_size: int = 256
  num_layers: int = 4
  num_heads: int = 4
  num_kv_heads: int = 4
  head_dim: int = 64
  intermediate_size: int = 1024
  max_seq_len: int = 2048
  norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  tie_embeddings: bool = False
  qkv_bias: bool = False
  dtype: str = 'float32'
  param_dtype: str = 'float32'
  head: str = 'lm'
  remat: str = 'none'
  remat_names: tuple = ()
  attention: str = 'auto'  # an `attention_ops.IMPLEMENTATIONS` key
  rotary_pct: float = 1.0
  parallel_residual: bool = False
  rope_type: str = 'default'
  rope_factor: float = 1.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_max_len: int = 8192
  sliding_window: int = 0
  layer_types: tuple = ()
  local_rope_theta: float = 0.0
  attn_softcap: float = 0.0
  final_softcap: float = 0.0
  query_pre_attn_scalar: float = 0.0
  # LoRA (rloo_jax.models.lora): rank 0 = off; targets from lora.TARGETS.
  lora_rank: int = 0
  lora_alpha: float = 16.0
  lora_targets: tuple = ()

  def __post_init__(self):
    # A config read back from JSON (a saved reward model's) has a list: keep it hashable.
    for name in ('layer_types', 'lora_targets', 'remat_names'):
      object.__setattr__(self, name, tuple(getattr(self, name)))
    if self.family not in FAMILIES:
      raise ValueError(f'family={self.family!r}; supported: {FAMILIES}')
    if self.head not in HEADS:
      raise ValueError(f'head={self.head!r}; supported: {HEADS}')
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f'remat={self.remat!r}; supported: {REMAT_POLICIES} (config.model.remat)')
    check_remat_names(self.remat, self.remat_names)
    attention_ops.check_implementation(self.attention)
    for name in ('dtype', 'param_dtype'):
      if getattr(self, name) not in _DTYPES:
        raise ValueError(f'config.model.{name} = {getattr(self, name)!r}; supported: '
                         f'{tuple(_DTYPES)}')
    if self.rope_type not in ROPE_TYPES:
      raise ValueError(f'rope_type={self.rope_type!r}; supported: {ROPE_TYPES}')
    if self.rope_type == 'llama3' and not self.rope_high_freq_factor > self.rope_low_freq_factor:
      # The blend divides by their difference.
      raise ValueError(f'rope_type llama3 needs rope_high_freq_factor '
                       f'({self.rope_high_freq_factor}) > rope_low_freq_factor '
                       f'({self.rope_low_freq_factor})')
    if self.layer_types and (len(self.layer_types) != self.num_layers
                             or set(self.layer_types) - set(LAYER_TYPES)):
      raise ValueError(f'layer_types={self.layer_types!r}: needs one of {LAYER_TYPES} per layer '
                       f'(num_layers={self.num_layers})')
    if self.sliding_window < 0:
      raise ValueError(f'sliding_window={self.sliding_window} must be >= 0 (0: no window)')
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f'num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}')
    # rotate_half pairs dim i with i + rotary_dim / 2, so the rotated block needs an even width
    # (GPT-2 has no RoPE to check).
    if not self.is_gpt2 and (not 0 < self.rotary_pct <= 1 or self.rotary_dim < 2
                             or self.rotary_dim % 2):
      raise ValueError(f'rotary_pct={self.rotary_pct} gives {self.rotary_dim} rotary dims of '
                       f'head_dim={self.head_dim}; it must be in (0, 1] and give a positive even '
                       'number')

  @classmethod
  def llama(cls, **overrides) -> 'TransformerConfig':
    kw = dict(family='llama', norm_eps=1e-5, rope_theta=10000.0, tie_embeddings=False,
              qkv_bias=False)
    return cls(**{**kw, **overrides})

  @classmethod
  def qwen2(cls, **overrides) -> 'TransformerConfig':
    kw = dict(family='qwen2', norm_eps=1e-6, rope_theta=1000000.0, tie_embeddings=True,
              qkv_bias=True)
    return cls(**{**kw, **overrides})

  @classmethod
  def qwen3(cls, **overrides) -> 'TransformerConfig':
    """Qwen2's layout without the qkv bias, with an RMSNorm on each q and k head (qk_norm)."""
    kw = dict(family='qwen3', norm_eps=1e-6, rope_theta=1000000.0, tie_embeddings=True,
              qkv_bias=False)
    return cls(**{**kw, **overrides})

  @classmethod
  def gpt2(cls, **overrides) -> 'TransformerConfig':
    kw = dict(family='gpt2', vocab_size=50257, hidden_size=768, num_layers=12, num_heads=12,
              num_kv_heads=12, head_dim=64, intermediate_size=3072, max_seq_len=1024,
              norm_eps=1e-5, tie_embeddings=True, qkv_bias=True)
    return cls._no_gqa(kw, overrides)

  @classmethod
  def gpt_neox(cls, **overrides) -> 'TransformerConfig':
    """Pythia's flavour: rotary on a quarter of each head, parallel residual, untied head."""
    kw = dict(family='gpt_neox', norm_eps=1e-5, rope_theta=10000.0, tie_embeddings=False,
              qkv_bias=True, rotary_pct=0.25, parallel_residual=True)
    return cls._no_gqa(kw, overrides)

  @classmethod
  def _no_gqa(cls, kw, overrides) -> 'TransformerConfig':
    # GPT-2 and GPT-NeoX have no GQA: kv heads follow the heads unless told otherwise.
    if 'num_heads' in overrides and 'num_kv_heads' not in overrides:
      overrides = {**overrides, 'num_kv_heads': overrides['num_heads']}
    return cls(**{**kw, **overrides})

  @classmethod
  def gemma2(cls, **overrides) -> 'TransformerConfig':
    """Gemma 2: scaled embeddings, (1 + w) RMSNorms around attention and MLP, GeGLU, soft-capped
    scores and logits, sliding-window layers alternating with global ones (the first slides)."""
    kw = dict(family='gemma2', norm_eps=1e-6, rope_theta=10000.0, tie_embeddings=True,
              qkv_bias=False, sliding_window=4096, attn_softcap=50.0, final_softcap=30.0,
              query_pre_attn_scalar=256.0)
    kw = {**kw, **overrides}
    kw.setdefault('layer_types', gemma_layer_types(kw.get('num_layers', cls.num_layers), 2))
    return cls(**kw)

  @classmethod
  def gemma3(cls, **overrides) -> 'TransformerConfig':
    """Gemma 3 text: Gemma 2's layout with q/k (1 + w) RMSNorms and no soft-capping; five
    sliding layers (RoPE base 10k) to each global one (base 1M)."""
    kw = dict(family='gemma3', norm_eps=1e-6, rope_theta=1000000.0, tie_embeddings=True,
              qkv_bias=False, sliding_window=512, local_rope_theta=10000.0,
              query_pre_attn_scalar=256.0)
    kw = {**kw, **overrides}
    kw.setdefault('layer_types', gemma_layer_types(kw.get('num_layers', cls.num_layers), 6))
    return cls(**kw)

  def replace(self, **changes) -> 'TransformerConfig':
    return dataclasses.replace(self, **changes)

  @property
  def is_gpt2(self) -> bool:
    """Learned absolute positions instead of RoPE."""
    return self.family == 'gpt2'

  @property
  def layer_norm(self) -> bool:
    """LayerNorm with bias (else RMSNorm)."""
    return self.family in ('gpt2', 'gpt_neox')

  @property
  def is_gemma(self) -> bool:
    """Embeddings scaled by sqrt(hidden_size), RMSNorms scaling by (1 + w) in float32, a norm
    after attention and after the MLP too (`sandwich_norm`), GeGLU with tanh GELU."""
    return self.family in ('gemma2', 'gemma3')

  @property
  def sandwich_norm(self) -> bool:
    """Each branch's output is normed before the residual add (Gemma's post_*_layernorm)."""
    return self.is_gemma

  @property
  def gated_mlp(self) -> bool:
    """A gated MLP without biases: SwiGLU, or GeGLU for Gemma (else a GELU MLP with biases)."""
    return self.family in ('llama', 'qwen2', 'qwen3', 'gemma2', 'gemma3')

  @property
  def qk_norm(self) -> bool:
    """RMSNorm over head_dim on every q and k head, before RoPE (Qwen3's and Gemma 3's q_norm /
    k_norm)."""
    return self.family in ('qwen3', 'gemma3')

  @property
  def sliding_layers(self) -> tuple:
    """Per layer, whether its attention slides (see `sliding_window`)."""
    if not self.sliding_window:
      return (False,) * self.num_layers
    if not self.layer_types:
      return (True,) * self.num_layers
    return tuple(t == 'sliding_attention' for t in self.layer_types)

  @property
  def attn_scale(self) -> float:
    return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

  @property
  def out_bias(self) -> bool:
    """Whether the attention's output projection has a bias: GPT-NeoX ties it to the qkv one
    (transformers' attention_bias)."""
    return self.is_gpt2 or (self.family == 'gpt_neox' and self.qkv_bias)

  @property
  def rope_scaling(self) -> tuple:
    """(rope_type, factor, low_freq_factor, high_freq_factor, original_max_len): what
    `layers.inv_freq` reads."""
    return (self.rope_type, self.rope_factor, self.rope_low_freq_factor,
            self.rope_high_freq_factor, self.rope_original_max_len)

  @property
  def rotary_dim(self) -> int:
    # int() truncates as transformers does (rotary_ndims = int(head_size * rotary_pct)).
    return int(self.head_dim * self.rotary_pct)

  @property
  def num_params(self) -> int:
    """Parameter count, computed from shapes (equals the size of `create(config)[1]`)."""
    e, hd, f, v = self.hidden_size, self.head_dim, self.intermediate_size, self.vocab_size
    q, kv = self.num_heads * hd, self.num_kv_heads * hd
    norm = 2 * e if self.layer_norm else e
    attn = e * (q + 2 * kv) + q * e
    if self.qkv_bias:
      attn += q + 2 * kv
    if self.out_bias:
      attn += e
    if self.qk_norm:
      attn += 2 * hd
    mlp = 3 * e * f if self.gated_mlp else 2 * e * f + f + e
    norms = 4 * norm if self.sandwich_norm else 2 * norm
    total = self.num_layers * (norms + attn + mlp) + norm + v * e
    if self.is_gpt2:
      total += self.max_seq_len * e
    if self.head == 'scalar':
      total += e + 1
    elif not self.tie_embeddings:
      total += e * v
    return total

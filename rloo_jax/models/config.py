"""The transformer's hyperparameters: `TransformerConfig`, its per-family presets, and the mapping
from an experiment's `config.model` section."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

FAMILIES = ('llama', 'qwen2', 'gpt2')
HEADS = ('lm', 'scalar')
_DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16, 'float16': jnp.float16}


def dtype_of(name: str):
  """The jnp dtype of a config dtype name ('float32', 'bfloat16', 'float16')."""
  if name not in _DTYPES:
    raise ValueError(f'dtype {name!r}; supported: {tuple(_DTYPES)}')
  return _DTYPES[name]


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Hashable (frozen) so it may be a static argument; `family` selects norm/MLP/position flavour."""

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

  def __post_init__(self):
    if self.family not in FAMILIES:
      raise ValueError(f'family={self.family!r}; supported: {FAMILIES}')
    if self.head not in HEADS:
      raise ValueError(f'head={self.head!r}; supported: {HEADS}')
    for name in ('dtype', 'param_dtype'):
      if getattr(self, name) not in _DTYPES:
        raise ValueError(f'{name}={getattr(self, name)!r}; supported: {tuple(_DTYPES)}')
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f'num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}')

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
  def gpt2(cls, **overrides) -> 'TransformerConfig':
    kw = dict(family='gpt2', vocab_size=50257, hidden_size=768, num_layers=12, num_heads=12,
              num_kv_heads=12, head_dim=64, intermediate_size=3072, max_seq_len=1024,
              norm_eps=1e-5, tie_embeddings=True, qkv_bias=True)
    kw = {**kw, **overrides}
    # GPT-2 has no GQA; keep kv heads equal to heads unless told otherwise.
    if 'num_heads' in overrides and 'num_kv_heads' not in overrides:
      kw['num_kv_heads'] = kw['num_heads']
    return cls(**kw)

  def replace(self, **changes) -> 'TransformerConfig':
    return dataclasses.replace(self, **changes)

  @property
  def is_gpt2(self) -> bool:
    return self.family == 'gpt2'

  @property
  def num_params(self) -> int:
    """Parameter count, computed from shapes (equals the size of `create(config)[1]`)."""
    e, hd, f, v = self.hidden_size, self.head_dim, self.intermediate_size, self.vocab_size
    q, kv = self.num_heads * hd, self.num_kv_heads * hd
    norm = 2 * e if self.is_gpt2 else e
    attn = e * (q + 2 * kv) + q * e
    if self.qkv_bias:
      attn += q + 2 * kv
    if self.is_gpt2:
      attn += e  # output-projection bias
      mlp = 2 * e * f + f + e
    else:
      mlp = 3 * e * f
    total = self.num_layers * (2 * norm + attn + mlp) + norm + v * e
    if self.is_gpt2:
      total += self.max_seq_len * e
    if self.head == 'scalar':
      total += e + 1
    elif not self.tie_embeddings:
      total += e * v
    return total


_PRESETS = {'llama': TransformerConfig.llama, 'qwen2': TransformerConfig.qwen2,
            'gpt2': TransformerConfig.gpt2}


def from_experiment_config(model_cfg, vocab_size: int) -> TransformerConfig:
  """The TransformerConfig of an experiment's `config.model` section (family preset + sizes)."""
  m = model_cfg
  if m.family not in _PRESETS:
    raise ValueError(f'unknown config.model.family {m.family!r}; choose one of {sorted(_PRESETS)}')
  return _PRESETS[m.family](
      vocab_size=vocab_size, hidden_size=m.hidden_size, num_layers=m.num_layers,
      num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
      intermediate_size=m.intermediate_size, max_seq_len=m.max_seq_len, dtype=m.dtype,
      param_dtype=m.param_dtype)

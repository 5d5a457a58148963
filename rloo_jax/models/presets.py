"""Architectures of public Hugging Face checkpoints, by name, with no weights.

A preset is the architecture of one checkpoint's config.json (vocab included: a real run uses
that checkpoint's tokenizer), so a job can be planned, compiled or trained from scratch at that
scale without downloading anything (`config.model.preset`, the memory planner).

    from rloo_jax.models import presets
    presets.get('qwen2.5-1.5b', dtype='bfloat16').num_params  # 1_543_714_304

Shapes are the base models' config.json (not -Instruct), each pinned by its published parameter
count (tests/test_scale_config.py). Qwen's sliding window is off in every one of them.
"""

from __future__ import annotations

import difflib
import types

from rloo_jax.models import attention_ops
from rloo_jax.models import config as config_lib

_QWEN2 = dict(family='qwen2', norm_eps=1e-6, rope_theta=1000000.0, qkv_bias=True)
_LLAMA3 = dict(family='llama', norm_eps=1e-5, rope_theta=500000.0, qkv_bias=False,
               vocab_size=128256)
# Llama 3.1+ (rope_scaling of their config.json); Llama-3-8B has none.
_LLAMA3_ROPE = dict(rope_type='llama3', rope_factor=32.0, rope_low_freq_factor=1.0,
                    rope_high_freq_factor=4.0, rope_original_max_len=8192)
# Qwen/Qwen3-*: q/k norms, no qkv bias, head_dim 128 whatever the width (so heads x head_dim is
# not the hidden size), context 40960; tied embeddings up to 4B.
_QWEN3 = dict(family='qwen3', norm_eps=1e-6, rope_theta=1000000.0, qkv_bias=False,
              vocab_size=151936, max_seq_len=40960, head_dim=128)
# GPT-NeoX (Pythia): parallel residual (attention and MLP both read the layer input), rotary on
# the first 25% of each head's dims, LayerNorm with bias, gelu MLP with biases, untied
# embeddings. Pythia's vocab is padded to a multiple of 128 x the training model parallelism,
# hence 50304 up to 2.8B and 50432 at 6.9B, above the tokenizer's 50277 tokens.
_PYTHIA = dict(family='gpt_neox', norm_eps=1e-5, rope_theta=10000.0, tie_embeddings=False,
               qkv_bias=True, max_seq_len=2048, rotary_pct=0.25, parallel_residual=True)
# google/gemma-2-*: (1 + w) sandwich norms, GeGLU, soft-capped scores (50) and logits (30),
# 4096-token windows on every other layer (the first slides), head_dim 256, tied embeddings.
_GEMMA2 = dict(family='gemma2', norm_eps=1e-6, rope_theta=10000.0, qkv_bias=False,
               vocab_size=256000, max_seq_len=8192, head_dim=256, tie_embeddings=True,
               sliding_window=4096, attn_softcap=50.0, final_softcap=30.0,
               query_pre_attn_scalar=256.0)
# google/gemma-3-1b-pt: q/k norms, no soft-capping, five 512-token sliding layers (RoPE base
# 10k) to each global one (base 1M).
_GEMMA3 = dict(family='gemma3', norm_eps=1e-6, rope_theta=1000000.0, local_rope_theta=10000.0,
               qkv_bias=False, vocab_size=262144, max_seq_len=32768, head_dim=256,
               tie_embeddings=True, sliding_window=512, query_pre_attn_scalar=256.0)


def _arch(base, *, e, layers, heads, kv, ff, **kw):
  return {**base, 'hidden_size': e, 'num_layers': layers, 'num_heads': heads,
          'num_kv_heads': kv, 'head_dim': kw.pop('head_dim', base.get('head_dim', e // heads)),
          'intermediate_size': ff, **kw}


# name -> TransformerConfig keyword arguments (architecture only: no dtype, remat or head).
PRESETS = types.MappingProxyType({
    # Qwen/Qwen2.5-*: tied embeddings up to 3B; 7B unties them and pads the vocab to 152064.
    'qwen2.5-0.5b': _arch(_QWEN2, e=896, layers=24, heads=14, kv=2, ff=4864,
                          vocab_size=151936, max_seq_len=32768, tie_embeddings=True),
    'qwen2.5-1.5b': _arch(_QWEN2, e=1536, layers=28, heads=12, kv=2, ff=8960,
                          vocab_size=151936, max_seq_len=131072, tie_embeddings=True),
    'qwen2.5-3b': _arch(_QWEN2, e=2048, layers=36, heads=16, kv=2, ff=11008,
                        vocab_size=151936, max_seq_len=32768, tie_embeddings=True),
    'qwen2.5-7b': _arch(_QWEN2, e=3584, layers=28, heads=28, kv=4, ff=18944,
                        vocab_size=152064, max_seq_len=131072, tie_embeddings=False),
    # deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B (DeepScaleR's start): Qwen2.5-Math-1.5B's
    # shapes, RoPE base 10k, its head untied from the embedding.
    'deepseek-r1-distill-qwen-1.5b': _arch(_QWEN2, e=1536, layers=28, heads=12, kv=2, ff=8960,
                                           vocab_size=151936, max_seq_len=131072,
                                           tie_embeddings=False, rope_theta=10000.0),
    # Qwen/Qwen2-7B: the same shapes as Qwen2.5-7B.
    'qwen2-7b': _arch(_QWEN2, e=3584, layers=28, heads=28, kv=4, ff=18944,
                      vocab_size=152064, max_seq_len=131072, tie_embeddings=False),
    # meta-llama/Meta-Llama-3-8B and Llama-3.2-{1B,3B} (the 3.2 models tie their embeddings).
    'llama-3-8b': _arch(_LLAMA3, e=4096, layers=32, heads=32, kv=8, ff=14336,
                        max_seq_len=8192, tie_embeddings=False),
    # huggyllama/llama-7b and meta-llama/Llama-2-7b-hf (the same shapes; Llama 2 has 4096
    # context): the paper's HH "Llama-7B", 6,738,415,616 parameters.
    'llama-2-7b': _arch(dict(family='llama', norm_eps=1e-5, rope_theta=10000.0, qkv_bias=False,
                             vocab_size=32000), e=4096, layers=32, heads=32, kv=32, ff=11008,
                        max_seq_len=4096, tie_embeddings=False),
    # The shapes of Llama-3.1-70B / Llama-3.3-70B (llama3 rope, factor 8, 128k context).
    'llama-3-70b': _arch(_LLAMA3, e=8192, layers=80, heads=64, kv=8, ff=28672,
                         max_seq_len=131072, tie_embeddings=False,
                         **{**_LLAMA3_ROPE, 'rope_factor': 8.0}),
    'llama-3.2-1b': _arch(_LLAMA3, e=2048, layers=16, heads=32, kv=8, ff=8192,
                          max_seq_len=131072, tie_embeddings=True, **_LLAMA3_ROPE),
    'llama-3.2-3b': _arch(_LLAMA3, e=3072, layers=28, heads=24, kv=8, ff=8192,
                          max_seq_len=131072, tie_embeddings=True, **_LLAMA3_ROPE),
    'qwen3-0.6b': _arch(_QWEN3, e=1024, layers=28, heads=16, kv=8, ff=3072,
                        tie_embeddings=True),
    'qwen3-1.7b': _arch(_QWEN3, e=2048, layers=28, heads=16, kv=8, ff=6144,
                        tie_embeddings=True),
    'qwen3-4b': _arch(_QWEN3, e=2560, layers=36, heads=32, kv=8, ff=9728, tie_embeddings=True),
    'qwen3-8b': _arch(_QWEN3, e=4096, layers=36, heads=32, kv=8, ff=12288,
                      tie_embeddings=False),
    # EleutherAI/pythia-* (no GQA: kv heads = heads).
    'pythia-160m': _arch(_PYTHIA, e=768, layers=12, heads=12, kv=12, ff=3072,
                         vocab_size=50304),
    'pythia-410m': _arch(_PYTHIA, e=1024, layers=24, heads=16, kv=16, ff=4096,
                         vocab_size=50304),
    'pythia-1b': _arch(_PYTHIA, e=2048, layers=16, heads=8, kv=8, ff=8192, vocab_size=50304),
    'pythia-2.8b': _arch(_PYTHIA, e=2560, layers=32, heads=32, kv=32, ff=10240,
                         vocab_size=50304),
    'pythia-6.9b': _arch(_PYTHIA, e=4096, layers=32, heads=32, kv=32, ff=16384,
                         vocab_size=50432),
    'gemma-2-2b': _arch(_GEMMA2, e=2304, layers=26, heads=8, kv=4, ff=9216,
                        layer_types=config_lib.gemma_layer_types(26, 2)),
    'gemma-2-9b': _arch(_GEMMA2, e=3584, layers=42, heads=16, kv=8, ff=14336,
                        layer_types=config_lib.gemma_layer_types(42, 2)),
    'gemma-3-1b': _arch(_GEMMA3, e=1152, layers=26, heads=4, kv=1, ff=6912,
                        layer_types=config_lib.gemma_layer_types(26, 6)),
})


def unknown_message(name: str, what: str = 'preset') -> str:
  """The error for a name not in PRESETS: the closest name, then every name."""
  close = difflib.get_close_matches(str(name).lower(), list(PRESETS), n=1, cutoff=0.5)
  hint = f' (did you mean {close[0]!r}?)' if close else ''
  return f'unknown {what} {name!r}{hint}; choose one of {tuple(PRESETS)}'


def get(name: str, *, what: str = 'preset', **overrides) -> config_lib.TransformerConfig:
  """The TransformerConfig of preset `name`; `overrides` (dtype, param_dtype, remat, head...)
  win. `what` names the setting the name came from, in the errors.

  Raises ValueError for an unknown name, and for a preset whose model family this version of
  `rloo_jax.models.config` does not have yet (GPT-NeoX for the pythia presets)."""
  if name not in PRESETS:
    raise ValueError(unknown_message(name, what))
  kw = {**PRESETS[name], **overrides}
  if kw['family'] not in config_lib.FAMILIES:
    raise ValueError(f'{what} {name!r} needs the model family {kw["family"]!r}, which '
                     f'rloo_jax.models.config does not implement (families: '
                     f'{config_lib.FAMILIES}); choose another preset')
  return config_lib.TransformerConfig(**kw)


def available(name: str) -> bool:
  """Whether preset `name`'s family is implemented (so `get(name)` builds a config)."""
  return PRESETS[name]['family'] in config_lib.FAMILIES


# The family constructors config.model.family names (their defaults, the section's sizes).
_FAMILY_CONSTRUCTORS = {'llama': config_lib.TransformerConfig.llama,
                        'qwen2': config_lib.TransformerConfig.qwen2,
                        'qwen3': config_lib.TransformerConfig.qwen3,
                        'gpt2': config_lib.TransformerConfig.gpt2,
                        'gpt_neox': config_lib.TransformerConfig.gpt_neox,
                        'gemma2': config_lib.TransformerConfig.gemma2,
                        'gemma3': config_lib.TransformerConfig.gemma3}


def run_options(model_cfg) -> dict:
  """How `config.model` runs any architecture: remat (and the names it saves) and the
  attention implementation. .get: run_config files written before these keys still load."""
  remat = model_cfg.get('remat', 'none')
  return dict(remat=remat,
              remat_names=config_lib.check_remat_names(remat, model_cfg.get('remat_names', '')),
              attention=attention_ops.check_implementation(model_cfg.get('attention', 'auto')))


def from_experiment_config(model_cfg, vocab_size: int) -> config_lib.TransformerConfig:
  """The TransformerConfig of an experiment's `config.model` section: the architecture of
  `config.model.preset` when set (`rloo_jax.models.presets`), else the family preset with the
  section's sizes; the section's dtype / param_dtype / `run_options` either way.

  vocab_size: the task tokenizer's. A preset keeps its own (the checkpoint's embedding size, so
  a job planned or trained from a preset has the real model's memory), which must cover it."""
  m = model_cfg
  run = run_options(m)
  preset = m.get('preset', '')
  if preset:
    cfg = get(preset, what='config.model.preset', dtype=m.dtype,
                      param_dtype=m.param_dtype, **run)
    if cfg.vocab_size < vocab_size:
      raise ValueError(
          f'config.model.preset={preset!r} embeds {cfg.vocab_size} tokens, fewer than the task '
          f"tokenizer's vocab_size {vocab_size}; use that checkpoint's tokenizer, or set "
          f"config.model.preset='' to size the model from config.model")
    return cfg
  if m.family not in _FAMILY_CONSTRUCTORS:
    raise ValueError(f'unknown config.model.family {m.family!r}; choose one of '
                     f'{sorted(_FAMILY_CONSTRUCTORS)}')
  return _FAMILY_CONSTRUCTORS[m.family](
      vocab_size=vocab_size, hidden_size=m.hidden_size, num_layers=m.num_layers,
      num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
      intermediate_size=m.intermediate_size, max_seq_len=m.max_seq_len, dtype=m.dtype,
      param_dtype=m.param_dtype, **run)

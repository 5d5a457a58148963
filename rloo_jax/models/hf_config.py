"""config.json -> TransformerConfig for the Hugging Face architectures `hf` imports: which
architectures map onto which family, and the checks that refuse what the model does not
implement (rope types, biases, activations, bidirectional attention)."""

from __future__ import annotations

from rloo_jax.models.config import (LAYER_TYPES, ROPE_TYPES, TransformerConfig,
                                    gemma_layer_types)

# Mistral is the Llama architecture with every layer on its sliding window.
CAUSAL_LM = {'LlamaForCausalLM': 'llama', 'MistralForCausalLM': 'llama',
             'Qwen2ForCausalLM': 'qwen2', 'Qwen3ForCausalLM': 'qwen3', 'GPT2LMHeadModel': 'gpt2',
             'GPTNeoXForCausalLM': 'gpt_neox', 'Gemma2ForCausalLM': 'gemma2',
             'Gemma3ForCausalLM': 'gemma3', 'Gemma3ForConditionalGeneration': 'gemma3'}
# A reward model saved as *ForSequenceClassification (num_labels=1) maps onto head='scalar'.
SEQ_CLS = {'LlamaForSequenceClassification': 'llama', 'MistralForSequenceClassification': 'llama',
           'Qwen2ForSequenceClassification': 'qwen2', 'Qwen3ForSequenceClassification': 'qwen3',
           'GPT2ForSequenceClassification': 'gpt2', 'GPTNeoXForSequenceClassification': 'gpt_neox',
           'Gemma2ForSequenceClassification': 'gemma2',
           'Gemma3TextForSequenceClassification': 'gemma3'}
SUPPORTED = tuple(CAUSAL_LM) + tuple(SEQ_CLS)
# config.json's model_type -> architecture, for configs without an architectures list.
_MODEL_TYPES = {'llama': 'LlamaForCausalLM', 'mistral': 'MistralForCausalLM',
                'qwen2': 'Qwen2ForCausalLM', 'qwen3': 'Qwen3ForCausalLM',
                'gpt2': 'GPT2LMHeadModel', 'gpt_neox': 'GPTNeoXForCausalLM',
                'gemma2': 'Gemma2ForCausalLM', 'gemma3_text': 'Gemma3ForCausalLM',
                'gemma3': 'Gemma3ForConditionalGeneration'}


def architecture(hf_config: dict) -> str:
  archs = hf_config.get('architectures') or []
  if not archs and hf_config.get('model_type') in _MODEL_TYPES:
    archs = [_MODEL_TYPES[hf_config['model_type']]]
  if len(archs) != 1 or archs[0] not in SUPPORTED:
    raise ValueError(f'Unsupported architecture {archs or hf_config.get("model_type")!r}; '
                     f'supported: {", ".join(SUPPORTED)}')
  return archs[0]


def _rope(hf: dict, arch: str, default_theta: float | None = None) -> dict:
  """The TransformerConfig rope_* fields of a config.json.

  transformers >= 5 writes rope_parameters (rope_type, rope_theta and the type's parameters);
  older versions rope_theta plus an optional rope_scaling ('type' before 'rope_type'), or for
  GPT-NeoX rotary_emb_base."""
  params = hf.get('rope_parameters') or {}
  scaling = {**(hf.get('rope_scaling') or {}), **params}
  rope_type = scaling.get('rope_type') or scaling.get('type') or 'default'
  if rope_type not in ROPE_TYPES:
    raise ValueError(f'{arch}: rope_type {rope_type!r} is not supported (supported: '
                     f'{", ".join(ROPE_TYPES)})')
  theta = params.get('rope_theta', hf.get('rope_theta', hf.get('rotary_emb_base', default_theta)))
  if theta is None:
    raise ValueError(f'{arch}: config.json has neither rope_parameters.rope_theta nor rope_theta')
  out = dict(rope_theta=float(theta), rope_type=rope_type)
  if rope_type in ('linear', 'llama3'):
    out['rope_factor'] = float(scaling['factor'])
  if rope_type == 'llama3':
    # transformers falls back to max_position_embeddings for the original context.
    out.update(rope_low_freq_factor=float(scaling['low_freq_factor']),
               rope_high_freq_factor=float(scaling['high_freq_factor']),
               rope_original_max_len=int(scaling.get('original_max_position_embeddings')
                                         or hf.get('max_position_embeddings', 2048)))
  return out


def _window(hf: dict, arch: str, window: int, default: tuple) -> dict:
  """sliding_window + layer_types (config.json's, else `default`) as TransformerConfig has them:
  no window when no layer slides (Gemma's classes need a window even then), layer_types ()
  when every layer does."""
  types = tuple(hf.get('layer_types') or default)
  if set(types) - set(LAYER_TYPES) or len(types) != hf['num_hidden_layers']:
    raise ValueError(f'{arch}: layer_types {list(types)} needs one of {LAYER_TYPES} per layer '
                     f'(num_hidden_layers={hf["num_hidden_layers"]})')
  if not window or 'sliding_attention' not in types:
    return dict(sliding_window=0, layer_types=())
  return dict(sliding_window=int(window),
              layer_types=() if set(types) == {'sliding_attention'} else types)


def _sliding(hf: dict, arch: str, family: str) -> dict:
  """sliding_window + layer_types: Mistral slides in every layer whenever sliding_window is set;
  Qwen only with use_sliding_window, then in the layers from max_window_layers on (transformers
  ignores the window, and the layer types, without it)."""
  window = hf.get('sliding_window')
  if family in ('qwen2', 'qwen3'):
    if not hf.get('use_sliding_window') or not window:
      return dict(sliding_window=0, layer_types=())
    n, first = hf['num_hidden_layers'], hf.get('max_window_layers', 28)
    return _window(hf, arch, window, tuple(LAYER_TYPES[int(i >= first)] for i in range(n)))
  if family == 'gpt_neox':
    return dict(sliding_window=0, layer_types=())
  # MistralConfig has no layer_types: Ministral's alternating layers are another class.
  if 'sliding_attention' in (hf.get('layer_types') or ()):
    raise ValueError(f'{arch}: layer_types with sliding_attention is not supported (a sliding '
                     'window here applies to every layer)')
  return dict(sliding_window=int(window or 0), layer_types=())


def _gemma_rope(hf: dict, arch: str) -> dict:
  """Gemma 3's rope_* fields: transformers 5 writes rope_parameters per layer type (the sliding
  layers' plain RoPE, the global layers' possibly scaled one), transformers 4 rope_theta,
  rope_scaling (global layers) and rope_local_base_freq."""
  params = hf.get('rope_parameters') or {}
  if set(params) & set(LAYER_TYPES):
    full = _rope({'rope_parameters': params.get('full_attention') or {},
                  'max_position_embeddings': hf.get('max_position_embeddings')}, arch, 1e6)
    local = params.get('sliding_attention') or {}
  else:
    full = _rope(hf, arch, 1e6)
    local = {'rope_theta': hf.get('rope_local_base_freq', 1e4)}
  if local == params.get('full_attention'):  # both layer types on the same RoPE
    return {**full, 'local_rope_theta': 0.0}
  if local.get('rope_type', 'default') != 'default':
    raise ValueError(f'{arch}: rope_parameters.sliding_attention.rope_type '
                     f'{local["rope_type"]!r} is not supported (default only)')
  return {**full, 'local_rope_theta': float(local.get('rope_theta', 1e4))}


def _gemma(hf: dict, arch: str, family: str, head: str, overrides: dict) -> TransformerConfig:
  """Gemma 2 / Gemma 3 text (for Gemma3ForConditionalGeneration its text_config); a missing key
  takes the transformers config class's default."""
  act = hf.get('hidden_activation', 'gelu_pytorch_tanh')
  if act != 'gelu_pytorch_tanh':
    raise ValueError(f'{arch}: hidden_activation {act!r} not supported (gelu_pytorch_tanh only)')
  for key in ('attention_bias', 'use_bidirectional_attention'):
    if hf.get(key):
      raise ValueError(f'{arch}: {key}=true is not supported')
  g2, n, heads = family == 'gemma2', hf['num_hidden_layers'], hf['num_attention_heads']
  # Layer i slides unless (i + 1) is a multiple of the pattern: Gemma 2 alternates, Gemma 3 has
  # a global layer every sliding_window_pattern (transformers 4's key).
  every = 2 if g2 else hf.get('sliding_window_pattern', 6)
  window = int(hf.get('sliding_window', 4096) or 0)
  # Gemma 2's class defaults both caps on, Gemma 3's off; null: off.
  cap = lambda key, on: float((hf.get(key, on) if g2 else hf.get(key)) or 0.0)
  kw = dict(vocab_size=hf.get('vocab_size', 256000 if g2 else 262208),
            hidden_size=hf['hidden_size'], num_layers=n, num_heads=heads,
            num_kv_heads=hf.get('num_key_value_heads') or heads, head_dim=hf.get('head_dim', 256),
            intermediate_size=hf['intermediate_size'],
            max_seq_len=hf.get('max_position_embeddings', 8192 if g2 else 131072),
            norm_eps=hf.get('rms_norm_eps', 1e-6),
            tie_embeddings=bool(hf.get('tie_word_embeddings', True)), qkv_bias=False, head=head,
            **_window(hf, arch, window, gemma_layer_types(n, every)),
            attn_softcap=cap('attn_logit_softcapping', 50.0),
            final_softcap=cap('final_logit_softcapping', 30.0),
            query_pre_attn_scalar=float(hf.get('query_pre_attn_scalar', 256)),
            **(_rope(hf, arch, 10000.0) if g2 else _gemma_rope(hf, arch)))
  return getattr(TransformerConfig, family)(**{**kw, **overrides})


def config_from_hf(hf: dict, **overrides) -> TransformerConfig:
  """TransformerConfig from a config.json dict; overrides (dtype, param_dtype, head...) win."""
  arch = architecture(hf)
  family = CAUSAL_LM.get(arch) or SEQ_CLS[arch]
  head = 'scalar' if arch in SEQ_CLS else 'lm'
  if family in ('gemma2', 'gemma3'):
    # The multimodal Gemma 3's decoder is its text_config (tie_word_embeddings may sit outside).
    text = {**{k: v for k, v in hf.items() if k == 'tie_word_embeddings'},
            **hf['text_config']} if 'text_config' in hf else hf
    return _gemma(text, arch, family, head, overrides)
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
  # GPT-NeoX shares the Llama keys but for its norm eps and extras; a missing key takes the
  # transformers config class's default.
  neox = family == 'gpt_neox'
  act = 'gelu' if neox else 'silu'
  if hf.get('hidden_act', act) != act:
    raise ValueError(f'{arch}: hidden_act {hf["hidden_act"]!r} not supported ({act} only)')
  if hf.get('mlp_bias') or (family in ('llama', 'qwen3') and hf.get('attention_bias')):
    raise ValueError(f'{arch}: attention_bias / mlp_bias are not supported for {family}')
  heads = hf['num_attention_heads']
  kw = dict(vocab_size=hf['vocab_size'], hidden_size=hf['hidden_size'],
            num_layers=hf['num_hidden_layers'], num_heads=heads,
            num_kv_heads=hf.get('num_key_value_heads') or heads,
            head_dim=hf.get('head_dim') or hf['hidden_size'] // heads,
            intermediate_size=hf['intermediate_size'],
            max_seq_len=hf.get('max_position_embeddings', 2048),
            norm_eps=hf.get('layer_norm_eps', 1e-5) if neox else hf.get('rms_norm_eps', 1e-6),
            **_rope(hf, arch, 10000.0 if neox else None),
            tie_embeddings=bool(hf.get('tie_word_embeddings', False)),
            qkv_bias=(family == 'qwen2') or (neox and bool(hf.get('attention_bias', True))),
            head=head, **_sliding(hf, arch, family))
  if neox:
    # transformers 5 moved rotary_pct into rope_parameters.partial_rotary_factor.
    pct = (hf.get('rope_parameters') or {}).get('partial_rotary_factor', hf.get('rotary_pct', 0.25))
    kw.update(rotary_pct=float(pct), parallel_residual=bool(hf.get('use_parallel_residual', True)))
  return getattr(TransformerConfig, family)(**{**kw, **overrides})

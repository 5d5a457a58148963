"""config.json -> TransformerConfig for the Hugging Face architectures `hf` imports: which
architectures map onto which family, and the checks that refuse what the model does not
implement (rope types, sliding windows, biases, activations)."""

from __future__ import annotations

from rloo_jax.models.config import ROPE_TYPES, TransformerConfig

# Mistral is the Llama architecture (its sliding window aside, see `_check_sliding_window`).
CAUSAL_LM = {'LlamaForCausalLM': 'llama', 'MistralForCausalLM': 'llama',
             'Qwen2ForCausalLM': 'qwen2', 'Qwen3ForCausalLM': 'qwen3', 'GPT2LMHeadModel': 'gpt2',
             'GPTNeoXForCausalLM': 'gpt_neox'}
# A reward model saved as *ForSequenceClassification (num_labels=1) maps onto head='scalar'.
SEQ_CLS = {'LlamaForSequenceClassification': 'llama', 'MistralForSequenceClassification': 'llama',
           'Qwen2ForSequenceClassification': 'qwen2', 'Qwen3ForSequenceClassification': 'qwen3',
           'GPT2ForSequenceClassification': 'gpt2', 'GPTNeoXForSequenceClassification': 'gpt_neox'}
SUPPORTED = tuple(CAUSAL_LM) + tuple(SEQ_CLS)
# config.json's model_type -> architecture, for configs without an architectures list.
_MODEL_TYPES = {'llama': 'LlamaForCausalLM', 'mistral': 'MistralForCausalLM',
                'qwen2': 'Qwen2ForCausalLM', 'qwen3': 'Qwen3ForCausalLM',
                'gpt2': 'GPT2LMHeadModel', 'gpt_neox': 'GPTNeoXForCausalLM'}


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


def _check_sliding_window(hf: dict, arch: str, config: TransformerConfig) -> None:
  """Mistral's sliding window, or Qwen's when use_sliding_window is on, is not implemented in
  the attention masks: allowed only when no sequence can reach it (a window >= the model's
  context, which a max_seq_len override may shorten)."""
  window = hf.get('sliding_window')
  if config.family in ('qwen2', 'qwen3') and not hf.get('use_sliding_window'):
    window = None
  if window is not None and int(window) < config.max_seq_len:
    raise ValueError(f'{arch}: sliding_window={window} is shorter than the max context '
                     f'{config.max_seq_len} and sliding-window attention is not supported; load '
                     f'it with max_seq_len={window} (or less) to use it within the window')


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
  # GPT-NeoX shares the Llama keys but for its norm eps and extras; a missing key takes the
  # transformers config class's default.
  neox = family == 'gpt_neox'
  act = 'gelu' if neox else 'silu'
  if hf.get('hidden_act', act) != act:
    raise ValueError(f'{arch}: hidden_act {hf["hidden_act"]!r} not supported ({act} only)')
  if hf.get('mlp_bias') or (family in ('llama', 'qwen3') and hf.get('attention_bias')):
    raise ValueError(f'{arch}: attention_bias / mlp_bias are not supported for {family}')
  # Per-layer types other than full attention (sliding layers of Qwen's max_window_layers);
  # Qwen3 writes one entry per layer even when all are full.
  if any(t != 'full_attention' for t in hf.get('layer_types') or ()):
    raise ValueError(f'{arch}: layer_types {sorted(set(hf["layer_types"]))} is not supported '
                     '(sliding-window attention layers)')
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
            head=head)
  if neox:
    # transformers 5 moved rotary_pct into rope_parameters.partial_rotary_factor.
    pct = (hf.get('rope_parameters') or {}).get('partial_rotary_factor', hf.get('rotary_pct', 0.25))
    kw.update(rotary_pct=float(pct), parallel_residual=bool(hf.get('use_parallel_residual', True)))
  config = getattr(TransformerConfig, family)(**{**kw, **overrides})
  _check_sliding_window(hf, arch, config)
  return config

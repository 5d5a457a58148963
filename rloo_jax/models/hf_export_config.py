"""The config.json half of the Hugging Face export (`hf_export`): which transformers class each
family is written as, what those classes cannot express (refused by `check_exportable`), and
`hf_config`, the inverse of hf_config.config_from_hf."""

from __future__ import annotations

from absl import logging

from rloo_jax.models.config import TransformerConfig

# One class per family; a llama with a sliding window is written as Mistral (`architecture`).
ARCHITECTURES = {'llama': 'LlamaForCausalLM', 'qwen2': 'Qwen2ForCausalLM',
                 'qwen3': 'Qwen3ForCausalLM', 'gpt2': 'GPT2LMHeadModel',
                 'gpt_neox': 'GPTNeoXForCausalLM', 'gemma2': 'Gemma2ForCausalLM',
                 'gemma3': 'Gemma3ForCausalLM'}
# A reward model (head='scalar') is written as the family's *ForSequenceClassification class, the
# classes hf_config.SEQ_CLS reads back.
SEQ_CLS_ARCHITECTURES = {'llama': 'LlamaForSequenceClassification',
                         'qwen2': 'Qwen2ForSequenceClassification',
                         'qwen3': 'Qwen3ForSequenceClassification',
                         'gpt2': 'GPT2ForSequenceClassification',
                         'gpt_neox': 'GPTNeoXForSequenceClassification',
                         'gemma2': 'Gemma2ForSequenceClassification',
                         'gemma3': 'Gemma3TextForSequenceClassification'}
MODEL_TYPES = {'MistralForCausalLM': 'mistral', 'Gemma3ForCausalLM': 'gemma3_text',
               'MistralForSequenceClassification': 'mistral',
               'Gemma3TextForSequenceClassification': 'gemma3_text'}
_GEMMA_ONLY = ('attn_softcap', 'final_softcap', 'query_pre_attn_scalar', 'local_rope_theta')


def architecture(c: TransformerConfig) -> str:
  if c.head == 'scalar':
    return 'MistralForSequenceClassification' if c.family == 'llama' and c.sliding_window else (
        SEQ_CLS_ARCHITECTURES[c.family])
  # Mistral's class is Llama's with every layer on the sliding window.
  return 'MistralForCausalLM' if c.family == 'llama' and c.sliding_window else (
      ARCHITECTURES[c.family])


def check_exportable(c: TransformerConfig) -> None:
  """Raises ValueError naming what the Hugging Face class of `c.family` cannot express."""
  if c.family not in ARCHITECTURES:
    raise ValueError(f'family {c.family!r} has no export mapping; supported: '
                     f'{", ".join(ARCHITECTURES)}')
  if c.family in ('gpt2', 'gpt_neox'):
    if c.num_kv_heads != c.num_heads or c.num_heads * c.head_dim != c.hidden_size:
      raise ValueError(f'{c.family} needs num_kv_heads == num_heads and num_heads * head_dim == '
                       f'hidden_size (got {c.num_kv_heads}, {c.num_heads} x {c.head_dim}, '
                       f'{c.hidden_size})')
    if c.sliding_window:
      raise ValueError(f'sliding_window={c.sliding_window} has no {ARCHITECTURES[c.family]} '
                       'equivalent')
  # transformers' classes hard-wire these: Llama's (and Gemma's) attention_bias also biases
  # o_proj (ours has none), Qwen2 always biases q/k/v, GPT-2 always ties and biases.
  if c.family in ('llama', 'gemma2', 'gemma3') and c.qkv_bias:
    raise ValueError(f'{c.family} with qkv_bias=True has no {ARCHITECTURES[c.family]} equivalent '
                     '(its attention_bias also adds an o_proj bias); export it as family qwen2')
  if c.family == 'qwen3' and c.qkv_bias:
    raise ValueError('qwen3 with qkv_bias=True has no Qwen3ForCausalLM equivalent')
  if c.family == 'qwen2' and not c.qkv_bias:
    raise ValueError('qwen2 with qkv_bias=False has no Qwen2ForCausalLM equivalent; export it as '
                     'family llama')
  if c.family == 'gpt2' and not (c.tie_embeddings and c.qkv_bias):
    raise ValueError('gpt2 needs tie_embeddings=True and qkv_bias=True (GPT2LMHeadModel has both)')
  if c.rope_type != 'default' and c.family in ('gpt2', 'gpt_neox'):
    raise ValueError(f'rope_type={c.rope_type!r} is only exported for llama / qwen / gemma '
                     'families')
  if c.rotary_pct != 1.0 and c.family != 'gpt_neox' and not c.is_gpt2:
    raise ValueError(f'rotary_pct={c.rotary_pct} is only expressible for gpt_neox')
  if c.family == 'gpt_neox' and not c.parallel_residual:
    raise ValueError('gpt_neox with parallel_residual=False is not exported (only the '
                     'parallel-residual layout round-trips through the loader)')
  if c.family == 'llama' and c.sliding_window and c.layer_types:
    raise ValueError(f'llama with layer_types={c.layer_types} has no MistralForCausalLM '
                     'equivalent (its sliding window applies to every layer)')
  if not c.is_gemma:
    for name in _GEMMA_ONLY:
      if getattr(c, name):
        raise ValueError(f'{name}={getattr(c, name)} is only exported for gemma2 / gemma3')
  if c.family == 'gemma2' and c.local_rope_theta:
    raise ValueError(f'local_rope_theta={c.local_rope_theta} has no Gemma2ForCausalLM '
                     'equivalent (one RoPE for every layer); export it as family gemma3')


def _rope_parameters(c: TransformerConfig) -> dict:
  """rope_parameters as transformers 5 writes them; the inverse of hf_config._rope."""
  rope = {'rope_type': c.rope_type, 'rope_theta': c.rope_theta}
  if c.rope_type in ('linear', 'llama3'):
    rope['factor'] = c.rope_factor
  if c.rope_type == 'llama3':
    rope.update(low_freq_factor=c.rope_low_freq_factor, high_freq_factor=c.rope_high_freq_factor,
                original_max_position_embeddings=c.rope_original_max_len)
  return rope


def _layer_types(c: TransformerConfig) -> list:
  """One entry per layer, as transformers 5 writes them (our () means: all slide, or none)."""
  return ['sliding_attention' if s else 'full_attention' for s in c.sliding_layers]


def _number(x: float):
  return int(x) if float(x).is_integer() else x  # transformers types these fields int


def _gemma(c: TransformerConfig, out: dict, rope: dict) -> None:
  """Gemma2Config / Gemma3TextConfig keys (a soft-cap is null when off)."""
  out.update(num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.norm_eps,
             hidden_activation='gelu_pytorch_tanh', hidden_act='gelu_pytorch_tanh',
             query_pre_attn_scalar=_number(c.query_pre_attn_scalar or c.head_dim),
             # No window: every layer full, and a window anyway (transformers builds the
             # sliding mask unconditionally).
             sliding_window=c.sliding_window or c.max_seq_len, layer_types=_layer_types(c),
             attn_logit_softcapping=c.attn_softcap or None,
             final_logit_softcapping=c.final_softcap or None, attention_bias=False,
             attention_dropout=0.0,
             use_bidirectional_attention=None if c.family == 'gemma2' else False)
  if c.family == 'gemma2':
    out['rope_parameters'] = rope
    return
  # Gemma 3: the sliding layers on plain RoPE at local_rope_theta (0: the global layers' RoPE).
  local = {'rope_type': 'default', 'rope_theta': c.local_rope_theta} if c.local_rope_theta else (
      dict(rope))
  out['rope_parameters'] = {'full_attention': rope, 'sliding_attention': local}
  out['rope_local_base_freq'] = local['rope_theta']  # transformers 4's key


def hf_config(c: TransformerConfig, *, dtype: str = 'bfloat16', bos_id=None, eos_id=None,
              pad_id=None) -> dict:
  """config.json for `c`: config_from_hf(hf_config(c)) == c (up to dtype / remat, which are
  runtime choices, not checkpoint ones). Old and new key spellings are both written (rope_theta
  and rope_parameters, torch_dtype and dtype) so transformers 4 and 5 and vLLM read the same."""
  check_exportable(c)
  arch = architecture(c)
  out = {'architectures': [arch], 'model_type': MODEL_TYPES.get(arch, c.family),
         'vocab_size': c.vocab_size, 'tie_word_embeddings': c.tie_embeddings,
         'torch_dtype': dtype, 'dtype': dtype, 'use_cache': True}
  if c.head == 'scalar':
    if pad_id is None:  # transformers pools a batch at each row's last token != pad_token_id
      raise ValueError("a reward model (head='scalar') is exported as *ForSequenceClassification, "
                       "which needs a pad_token_id to find each row's last token: pass "
                       "tokenizer_dir= (its pad id) or pad_id=")
    if pad_id == eos_id:
      # transformers pools at the last token that is not the pad id: a row ending in eos is
      # scored one token early there (hf_reward_model: reads the layout and is not affected).
      logging.warning('pad_token_id == eos_token_id (%s): transformers scores a row ending in '
                      'eos at the token before it', pad_id)
    # One score per sequence: what transformers' regression head with num_labels=1 reads.
    out.update(num_labels=1, id2label={'0': 'LABEL_0'}, label2id={'LABEL_0': 0})
  if c.family == 'gpt2':
    out.update(n_embd=c.hidden_size, n_head=c.num_heads, n_layer=c.num_layers,
               n_positions=c.max_seq_len, n_ctx=c.max_seq_len, n_inner=c.intermediate_size,
               layer_norm_epsilon=c.norm_eps, activation_function='gelu_new',
               scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False,
               reorder_and_upcast_attn=False)
  else:
    rope = _rope_parameters(c)
    out.update(hidden_size=c.hidden_size, num_hidden_layers=c.num_layers,
               num_attention_heads=c.num_heads, intermediate_size=c.intermediate_size,
               max_position_embeddings=c.max_seq_len, rope_theta=c.rope_theta)
    if c.family == 'gpt_neox':
      rope['partial_rotary_factor'] = c.rotary_pct
      out.update(hidden_act='gelu', layer_norm_eps=c.norm_eps, rotary_pct=c.rotary_pct,
                 rotary_emb_base=c.rope_theta, use_parallel_residual=c.parallel_residual,
                 attention_bias=c.qkv_bias)
    elif c.is_gemma:
      _gemma(c, out, rope)
    else:
      out.update(hidden_act='silu', rms_norm_eps=c.norm_eps, num_key_value_heads=c.num_kv_heads,
                 head_dim=c.head_dim, mlp_bias=False)
      if c.family != 'qwen2':
        out['attention_bias'] = False
      if c.family == 'llama' and c.sliding_window:
        out['sliding_window'] = c.sliding_window
      if c.family != 'llama':
        # Qwen's window counts only with use_sliding_window; transformers reads layer_types
        # (max_window_layers, the first sliding layer, only when they are absent).
        types = _layer_types(c)
        out.update(use_sliding_window=bool(c.sliding_window),
                   sliding_window=c.sliding_window or None,
                   max_window_layers=(types.index('sliding_attention') if c.sliding_window
                                      and 'sliding_attention' in types else c.num_layers),
                   layer_types=types)
    out.setdefault('rope_parameters', rope)
    if rope['rope_type'] != 'default':  # transformers 4's spelling (vLLM, older lm-eval)
      out['rope_scaling'] = {k: v for k, v in rope.items() if k != 'rope_theta'}
  for name, value in (('bos_token_id', bos_id), ('eos_token_id', eos_id),
                      ('pad_token_id', pad_id)):
    if value is not None:
      out[name] = int(value)
  return out

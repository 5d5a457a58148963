"""Each family's weight map: which checkpoint tensor fills which parameter of our Transformer, in
which layout (`hf_read._View`). One loader per checkpoint naming scheme."""

from __future__ import annotations

from rloo_jax.models.config import TransformerConfig
from rloo_jax.models.hf_read import D0, D1, H0, H1, _T, _Tensors, _View, _putters
from rloo_jax.models.transformer import Transformer


# Where the decoder's tensors sit: a *ForCausalLM's model., none for a bare *Model, and for
# Gemma3ForConditionalGeneration's text decoder transformers 5's model.language_model. or the
# hub checkpoints' (transformers 4) language_model.model.
_PREFIXES = ('model.', 'model.language_model.', 'language_model.model.')


def _load_llama(model: Transformer, get: _Tensors, c: TransformerConfig, dtype, shard_of):
  """Llama, Mistral, Qwen2/3 and Gemma 2/3, which name their tensors alike."""
  pre = next((p for p in _PREFIXES if p + 'embed_tokens.weight' in get), '')
  e, hq, hkv, d = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
  (put, layer), blk = _putters(get, c, dtype, shard_of), model.layers
  put(model.embedding, pre + 'embed_tokens.weight')
  p = pre + 'layers.{}.'
  layer(blk.attn_norm.scale, p + 'input_layernorm.weight')
  # Gemma's post_attention_layernorm norms the attention's output (its MLP's input norm is
  # pre_feedforward_layernorm); Llama's is the MLP's input norm. The scales are the raw w of
  # Gemma's (1 + w), as the model reads them.
  if c.sandwich_norm:
    layer(blk.post_attn_norm.scale, p + 'post_attention_layernorm.weight')
    layer(blk.mlp_norm.scale, p + 'pre_feedforward_layernorm.weight')
    layer(blk.post_mlp_norm.scale, p + 'post_feedforward_layernorm.weight')
  else:
    layer(blk.mlp_norm.scale, p + 'post_attention_layernorm.weight')
  # torch Linear stores [out, in]; our kernels are [in, heads, head_dim].
  layer(blk.attn.q_kernel, p + 'self_attn.q_proj.weight',
        _View(lambda w: w.T.reshape(e, hq, d), (1, H0, D0), hq, d))
  layer(blk.attn.k_kernel, p + 'self_attn.k_proj.weight',
        _View(lambda w: w.T.reshape(e, hkv, d), (1, H0, D0), hkv, d))
  layer(blk.attn.v_kernel, p + 'self_attn.v_proj.weight',
        _View(lambda w: w.T.reshape(e, hkv, d), (1, H0, D0), hkv, d))
  layer(blk.attn.o_kernel, p + 'self_attn.o_proj.weight',
        _View(lambda w: w.T.reshape(hq, d, e), (H1, D1, 0), hq, d))
  if c.qkv_bias:
    layer(blk.attn.q_bias, p + 'self_attn.q_proj.bias',
          _View(lambda w: w.reshape(hq, d), (H0, D0), hq, d))
    layer(blk.attn.k_bias, p + 'self_attn.k_proj.bias',
          _View(lambda w: w.reshape(hkv, d), (H0, D0), hkv, d))
    layer(blk.attn.v_bias, p + 'self_attn.v_proj.bias',
          _View(lambda w: w.reshape(hkv, d), (H0, D0), hkv, d))
  if c.qk_norm:
    layer(blk.attn.q_norm_scale, p + 'self_attn.q_norm.weight')
    layer(blk.attn.k_norm_scale, p + 'self_attn.k_norm.weight')
  layer(blk.mlp.gate_kernel, p + 'mlp.gate_proj.weight', _T)
  layer(blk.mlp.up_kernel, p + 'mlp.up_proj.weight', _T)
  layer(blk.mlp.down_kernel, p + 'mlp.down_proj.weight', _T)
  put(model.final_norm.scale, pre + 'norm.weight')
  if c.head == 'lm' and not c.tie_embeddings:
    head = 'language_model.lm_head.weight' if pre == 'language_model.model.' else 'lm_head.weight'
    put(model.lm_head, head, _T)


def _load_gpt2(model: Transformer, get: _Tensors, c: TransformerConfig, dtype, shard_of):
  pre = 'transformer.' if 'transformer.wte.weight' in get else ''
  e, h, d = c.hidden_size, c.num_heads, c.head_dim
  (put, layer), blk = _putters(get, c, dtype, shard_of), model.layers
  put(model.embedding, pre + 'wte.weight')
  put(model.pos_embedding, pre + 'wpe.weight')
  p = pre + 'h.{}.'
  layer(blk.attn_norm.scale, p + 'ln_1.weight')
  layer(blk.attn_norm.bias, p + 'ln_1.bias')
  layer(blk.mlp_norm.scale, p + 'ln_2.weight')
  layer(blk.mlp_norm.bias, p + 'ln_2.bias')
  # GPT-2's Conv1D stores [in, out] with q, k, v fused along out.
  key = p + 'attn.c_attn.weight'
  if get.shape(key.format(0)) != (e, 3 * e):
    raise ValueError(f'tensor {key.format(0)!r} has shape {get.shape(key.format(0))}, expected '
                     f'{(e, 3 * e)}')
  for j, (kern, bias) in enumerate([(blk.attn.q_kernel, blk.attn.q_bias),
                                    (blk.attn.k_kernel, blk.attn.k_bias),
                                    (blk.attn.v_kernel, blk.attn.v_bias)]):
    layer(kern, key, _View(lambda w, j=j: w[:, j * e:(j + 1) * e].reshape(e, h, d), (0, H1, D1),
                           h, d, offset=j * e, total=3 * e))
    layer(bias, p + 'attn.c_attn.bias', _View(lambda w, j=j: w[j * e:(j + 1) * e].reshape(h, d),
                                              (H0, D0), h, d, offset=j * e, total=3 * e))
  layer(blk.attn.o_kernel, p + 'attn.c_proj.weight',
        _View(lambda w: w.reshape(h, d, e), (H0, D0, 1), h, d))
  layer(blk.attn.o_bias, p + 'attn.c_proj.bias')
  layer(blk.mlp.up_kernel, p + 'mlp.c_fc.weight')
  layer(blk.mlp.up_bias, p + 'mlp.c_fc.bias')
  layer(blk.mlp.down_kernel, p + 'mlp.c_proj.weight')
  layer(blk.mlp.down_bias, p + 'mlp.c_proj.bias')
  put(model.final_norm.scale, pre + 'ln_f.weight')
  put(model.final_norm.bias, pre + 'ln_f.bias')


def _load_gpt_neox(model: Transformer, get: _Tensors, c: TransformerConfig, dtype, shard_of):
  pre = 'gpt_neox.' if 'gpt_neox.embed_in.weight' in get else ''
  e, h, d = c.hidden_size, c.num_heads, c.head_dim
  (put, layer), blk = _putters(get, c, dtype, shard_of), model.layers
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
          _View(lambda w, j=j: w.reshape(h, 3, d, e)[:, j].transpose(2, 0, 1), (1, H0, D0), h, d,
                group=3, j=j))
    if c.qkv_bias:
      layer(getattr(blk.attn, n + '_bias'), qkv + 'bias',
            _View(lambda w, j=j: w.reshape(h, 3, d)[:, j], (H0, D0), h, d, group=3, j=j))
  layer(blk.attn.o_kernel, p + 'attention.dense.weight',
        _View(lambda w: w.T.reshape(h, d, e), (H1, D1, 0), h, d))
  if c.out_bias:
    layer(blk.attn.o_bias, p + 'attention.dense.bias')
  layer(blk.mlp.up_kernel, p + 'mlp.dense_h_to_4h.weight', _T)
  layer(blk.mlp.up_bias, p + 'mlp.dense_h_to_4h.bias')
  layer(blk.mlp.down_kernel, p + 'mlp.dense_4h_to_h.weight', _T)
  layer(blk.mlp.down_bias, p + 'mlp.dense_4h_to_h.bias')
  put(model.final_norm.scale, pre + 'final_layer_norm.weight')
  put(model.final_norm.bias, pre + 'final_layer_norm.bias')
  if c.head == 'lm' and not c.tie_embeddings:
    # Pythia's checkpoints name the head embed_out; transformers 5 loads it as lm_head.
    put(model.lm_head, 'embed_out.weight' if 'embed_out.weight' in get else 'lm_head.weight',
        _T)


_LOADERS = {'llama': _load_llama, 'qwen2': _load_llama, 'qwen3': _load_llama, 'gpt2': _load_gpt2,
            'gpt_neox': _load_gpt_neox, 'gemma2': _load_llama, 'gemma3': _load_llama}

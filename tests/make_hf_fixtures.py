"""Writes tiny random HF checkpoints + reference outputs to tests/fixtures/hf/<family>/.

Needs the "hf" extra (torch CPU + transformers); the default test run only reads what this writes.

  python tests/make_hf_fixtures.py            # rewrite every family's fixture
  python tests/make_hf_fixtures.py --out DIR  # elsewhere
  python tests/make_hf_fixtures.py --family gpt_neox  # one family only (repeatable)

Each directory holds config.json, model.safetensors, generation_config.json, tokenizer.json,
tokenizer_config.json and reference.npz with:
  {right,left}_{tokens,mask,positions}  [2,S]  a padded batch (right- and left-padded)
  {right,left}_logits                   [2,S,V] float32 transformers logits on that batch
  prompt_tokens [2,P] right-padded, prompt_lengths [2], greedy_tokens [2,N] (generate,
  do_sample=False, one prompt at a time so transformers sees no padding), greedy_min_margin
  (smallest top1-top2 logit gap along the greedy paths, so a parity failure can be told apart
  from a near tie).
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

# A fixture per architecture flavour; the directory name, not always the model family (llama3 and
# mistral load as family 'llama').
FAMILIES = ('llama', 'qwen2', 'gpt2', 'gpt_neox', 'llama3', 'qwen3', 'mistral', 'gemma2',
            'gemma3')
VOCAB = 128
NEW_TOKENS = 8
# Seeds picked so the greedy paths are varied (not one repeated token) and far from ties.
SEEDS = {'llama': 2, 'qwen2': 2, 'gpt2': 1, 'gpt_neox': 0, 'llama3': 0, 'qwen3': 2, 'mistral': 1,
         'gemma2': 4, 'gemma3': 0}
SPECIALS = ['<pad>', '<s>', '</s>', '<unk>']  # ids 0..3
SENTENCES = [
    'the quick brown fox jumps over the lazy dog',
    'a policy samples k completions for every prompt',
    'leave one out baselines reduce the variance of the gradient',
    'the reward model scores each completion of the prompt',
    'two plus two is four and three plus four is seven',
    'we prefill the prompt once and decode every stream',
]
PROMPTS = ['the quick brown fox jumps over', 'two plus two is']
TEXTS = ['leave one out baselines reduce the variance', 'the reward model']


def build_tokenizer():
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

  tok = Tokenizer(models.BPE(unk_token='<unk>'))
  tok.pre_tokenizer = pre_tokenizers.Metaspace()
  tok.decoder = decoders.Metaspace()
  tok.train_from_iterator(SENTENCES, trainers.BpeTrainer(vocab_size=100, special_tokens=SPECIALS))
  # Like Llama's tokenizer: prepend BOS when add_special_tokens=True.
  tok.post_processor = processors.TemplateProcessing(single='<s> $A', special_tokens=[('<s>', 1)])
  assert tok.get_vocab_size() <= VOCAB
  return tok


def build_model(family: str, seed: int = 0, **overrides):
  """A tiny random transformers model; `overrides` change config fields (used by live tests)."""
  import torch
  import transformers

  common = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
  if family == 'llama':
    # Untied embeddings, GQA (4 q heads on 2 kv heads), a non-default rope_theta.
    cfg = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rope_theta=500000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.3, **common)
    cls = transformers.LlamaForCausalLM
  elif family == 'qwen2':
    # Tied embeddings, qkv bias, GQA with 3 query heads per kv head.
    cfg = transformers.Qwen2Config(
        hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=64, rope_theta=1000000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True, initializer_range=0.3, **common)
    cls = transformers.Qwen2ForCausalLM
  elif family == 'gpt2':
    cfg = transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=4, n_positions=64, initializer_range=0.3, **common)
    cls = transformers.GPT2LMHeadModel
  elif family == 'gpt_neox':
    # Pythia's layout: parallel residual, rotary on a quarter of each head (2 of 8 dims), untied
    # embed_out, exact GELU; a non-default rotary base.
    cfg = transformers.GPTNeoXConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, rotary_pct=0.25, rotary_emb_base=20000.0,
        use_parallel_residual=True, hidden_act='gelu', layer_norm_eps=1e-5,
        tie_word_embeddings=False, initializer_range=0.3, **common)
    cls = transformers.GPTNeoXForCausalLM
  elif family == 'llama3':
    # Llama 3.1+ rope scaling with a short original context, so that within the fixture's
    # positions the scaling bites: head_dim 16 at theta 1e4 has wavelengths 6.3, 20, 63, ...,
    # i.e. with original context 32 (band 8..32) one kept, one blended, the rest divided by 8.
    # Tied embeddings, as Llama 3.2.
    cfg = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
        rope_parameters=dict(rope_type='llama3', rope_theta=10000.0, factor=8.0,
                             low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=32),
        rms_norm_eps=1e-5, tie_word_embeddings=True, initializer_range=0.3, **common)
    cls = transformers.LlamaForCausalLM
  elif family == 'qwen3':
    # q_norm / k_norm per head, no qkv bias, head_dim 16 != hidden / heads = 8, tied.
    cfg = transformers.Qwen3Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rope_theta=1000000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True, initializer_range=0.3, **common)
    cls = transformers.Qwen3ForCausalLM
  elif family == 'mistral':
    # MQA, head_dim 12 != hidden / heads = 8, untied; a sliding window equal to the context
    # (so never reached: a Llama).
    cfg = transformers.MistralConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=12, max_position_embeddings=64, sliding_window=64,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        initializer_range=0.3, **common)
    cls = transformers.MistralForCausalLM
  elif family == 'gemma2':
    # Layers slide, attend fully, slide; a window of 3, shorter than every reference sequence;
    # head_dim 16 != hidden / heads = 8 and query_pre_attn_scalar 12 != head_dim; both soft-caps
    # below the magnitudes they cap (scores up to ~15, logits up to ~3.4), so tanh bends them. Eager
    # attention: sdpa cannot soft-cap.
    cfg = transformers.Gemma2Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, query_pre_attn_scalar=12,
        sliding_window=3, attn_logit_softcapping=8.0, final_logit_softcapping=3.0,
        rope_parameters=dict(rope_type='default', rope_theta=10000.0), rms_norm_eps=1e-6,
        tie_word_embeddings=True, initializer_range=0.3, attn_implementation='eager', **common)
    cls = transformers.Gemma2ForCausalLM
  elif family == 'gemma3':
    # q/k norms; explicit layer types (not the default every-sixth pattern) with both kinds and a
    # window of 4; the global layers on linear-scaled RoPE at base 1e6, the sliding ones on
    # plain RoPE at base 1e3 (rope_local_base_freq), both biting at the fixture's positions.
    cfg = transformers.Gemma3TextConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=64, query_pre_attn_scalar=20,
        sliding_window=4, layer_types=['sliding_attention', 'sliding_attention',
                                       'full_attention', 'sliding_attention'],
        rope_parameters=dict(
            full_attention=dict(rope_type='linear', factor=4.0, rope_theta=1000000.0),
            sliding_attention=dict(rope_type='default', rope_theta=1000.0)),
        rms_norm_eps=1e-6, tie_word_embeddings=True, initializer_range=0.3,
        attn_implementation='eager', **common)
    cls = transformers.Gemma3ForCausalLM
  else:
    raise ValueError(family)
  for k, v in overrides.items():
    setattr(cfg, k, v)
  torch.manual_seed(seed)
  model = cls(cfg).eval()
  # Random biases are zero-initialised by HF; make them non-zero so the import of every bias is
  # actually exercised.
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith('bias') or 'norm' in name or name.split('.')[-2].startswith('ln'):
        p.add_(0.1 * torch.randn_like(p))
    if family.startswith('gemma'):
      # Gemma multiplies the embeddings by sqrt(hidden): at this init a token's own embedding
      # then dominates the residual stream and the tied head just repeats the last token.
      model.model.embed_tokens.weight.mul_(0.5)
  return model


def padded_batch(tok, texts, left: bool):
  ids = [tok.encode(t).ids for t in texts]
  s = max(map(len, ids))
  tokens = np.zeros((len(ids), s), np.int32)
  mask = np.zeros((len(ids), s), bool)
  for i, row in enumerate(ids):
    sl = slice(s - len(row), s) if left else slice(0, len(row))
    tokens[i, sl] = row
    mask[i, sl] = True
  positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
  if not left:
    positions = np.broadcast_to(np.arange(s, dtype=np.int32), (len(ids), s)).copy()
  return tokens, mask, positions


def reference_outputs(model, tok) -> dict:
  import torch

  out = {}
  for side in ('right', 'left'):
    tokens, mask, positions = padded_batch(tok, TEXTS, left=(side == 'left'))
    with torch.no_grad():
      logits = model(input_ids=torch.tensor(tokens, dtype=torch.long),
                     attention_mask=torch.tensor(mask, dtype=torch.long),
                     position_ids=torch.tensor(positions, dtype=torch.long)).logits
    out[f'{side}_tokens'], out[f'{side}_mask'], out[f'{side}_positions'] = tokens, mask, positions
    out[f'{side}_logits'] = logits.float().numpy()
  prompt_tokens, prompt_mask, _ = padded_batch(tok, PROMPTS, left=False)
  greedy, margins = [], []
  for row, m in zip(prompt_tokens, prompt_mask):
    ids = torch.tensor(row[m][None], dtype=torch.long)
    # eos_token_id=None: always NEW_TOKENS tokens, so the comparison never depends on stopping.
    res = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                         do_sample=False, eos_token_id=None, pad_token_id=0,
                         output_scores=True, return_dict_in_generate=True)
    greedy.append(res.sequences[0, ids.shape[1]:].numpy())
    for s in res.scores:
      top2 = torch.topk(s[0].float(), 2).values
      margins.append(float(top2[0] - top2[1]))
  out['prompt_tokens'] = prompt_tokens
  out['prompt_lengths'] = prompt_mask.sum(1).astype(np.int32)
  out['greedy_tokens'] = np.stack(greedy).astype(np.int32)
  out['greedy_min_margin'] = np.float32(min(margins))
  return out


def write_family(family: str, out_dir: str, seed: int = 0, **overrides) -> dict:
  import transformers

  os.makedirs(out_dir, exist_ok=True)
  tok = build_tokenizer()
  model = build_model(family, seed, **overrides)
  model.save_pretrained(out_dir)
  tok.save(os.path.join(out_dir, 'tokenizer.json'))
  with open(os.path.join(out_dir, 'tokenizer_config.json'), 'w') as f:
    json.dump({'bos_token': '<s>', 'eos_token': '</s>', 'pad_token': '<pad>',
               'unk_token': '<unk>'}, f, indent=2)
  ref = reference_outputs(model, tok)
  ref['transformers_version'] = np.array(transformers.__version__)
  np.savez_compressed(os.path.join(out_dir, 'reference.npz'), **ref)
  return ref


def main():
  here = os.path.dirname(os.path.abspath(__file__))
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--out', default=os.path.join(here, 'fixtures', 'hf'))
  parser.add_argument('--family', action='append', choices=FAMILIES,
                      help='write only this family (repeatable); default: all')
  args = parser.parse_args()
  for family in args.family or FAMILIES:
    ref = write_family(family, os.path.join(args.out, family), SEEDS[family])
    print(f'{family}: greedy {ref["greedy_tokens"].tolist()} '
          f'min top1-top2 margin {float(ref["greedy_min_margin"]):.3g}')


if __name__ == '__main__':
  main()

"""Writes tiny random HF reward models (*ForSequenceClassification, num_labels=1) + reference
scores to tests/fixtures/hf_rm/<family>/, one per make_hf_fixtures family.

Needs the "hf" extra (torch CPU + transformers); the default test run only reads what this writes
(tests/test_hf_reward_models.py).

  python tests/make_hf_rm_fixtures.py            # rewrite every family's fixture
  python tests/make_hf_rm_fixtures.py --out DIR  # elsewhere
  python tests/make_hf_rm_fixtures.py --family gemma3  # one family only (repeatable)

Each directory holds config.json, model.safetensors and reference.npz with:
  {right,left}_{tokens,mask,positions}  [B,S]  a padded batch (make_hf_fixtures.padded_batch)
  {right,left}_scores                   [B]    transformers' pooled score (at the rightmost
                                               non-pad token, pad_token_id=0)
  {right,left}_values                   [B,S]  the score head at every position (what a value
                                               model reads), from the backbone + score directly
No tokenizer is written: the batches are stored as ids (the causal fixtures carry the tokenizer).
"""

from __future__ import annotations

import argparse
import os

import numpy as np

# The same configs, seeds, tokenizer and batch layout as the causal-LM fixtures: a reward model is
# the same backbone with a score head, so one config builder serves both (tests/ is on sys.path:
# the script's own directory when run, pytest's rootdir conftest when imported).
from make_hf_fixtures import FAMILIES, SEEDS, build_model, build_tokenizer, padded_batch

# Three rows of three lengths, so the pooling position differs per row in both paddings.
TEXTS = ['leave one out baselines reduce the variance', 'the reward model',
         'two plus two is four']
# The score head's init: at the configs' initializer_range (0.3) the two closest rows of a batch
# score only ~0.2 apart in some families (~0.01 at the usual 0.02); at 1.0 at least ~0.7, so a
# mix-up of rows or pooling positions is far outside any float32 tolerance.
SCORE_STD = 1.0
MIN_ROW_GAP = 0.2  # the smallest pairwise gap between a batch's scores this script accepts


def seq_cls_class(family: str):
  import transformers

  return {'llama': transformers.LlamaForSequenceClassification,
          'llama3': transformers.LlamaForSequenceClassification,
          'mistral': transformers.MistralForSequenceClassification,
          'qwen2': transformers.Qwen2ForSequenceClassification,
          'qwen3': transformers.Qwen3ForSequenceClassification,
          'gpt2': transformers.GPT2ForSequenceClassification,
          'gpt_neox': transformers.GPTNeoXForSequenceClassification,
          'gemma2': transformers.Gemma2ForSequenceClassification,
          'gemma3': transformers.Gemma3TextForSequenceClassification}[family]


def build_reward_model(family: str, seed: int = 0, **overrides):
  """make_hf_fixtures.build_model's causal LM, its backbone moved under a score head.

  Built from the causal model rather than from the config alone so that its non-zero biases and
  norms (and Gemma's scaled-down embedding) carry over: the backbone's state-dict keys are the
  same in both classes (base_model_prefix), only the LM head is left behind."""
  import torch

  causal = build_model(family, seed, **overrides)
  cfg = causal.config
  cfg.num_labels = 1
  cfg.architectures = None  # save_pretrained writes the new class's name
  # pad_token_id is what transformers pools by (the rightmost non-pad token); build_model sets 0.
  assert cfg.pad_token_id == 0, cfg.pad_token_id
  torch.manual_seed(seed)
  model = seq_cls_class(family)(cfg).eval()
  missing, unexpected = model.load_state_dict(causal.state_dict(), strict=False)
  assert missing == ['score.weight'], missing
  assert set(unexpected) <= {'lm_head.weight', 'embed_out.weight'}, unexpected
  with torch.no_grad():
    model.score.weight.normal_(0.0, SCORE_STD)
  assert model.score.bias is None  # HF's score head has none; the loader zeroes score_bias
  return model


def reference_scores(model, tok) -> dict:
  import torch

  backbone = getattr(model, model.base_model_prefix)
  out = {}
  for side in ('right', 'left'):
    tokens, mask, positions = padded_batch(tok, TEXTS, left=(side == 'left'))
    assert not (tokens[mask] == 0).any()  # a real pad id inside the text would move the pooling
    kw = dict(input_ids=torch.tensor(tokens, dtype=torch.long),
              attention_mask=torch.tensor(mask, dtype=torch.long),
              position_ids=torch.tensor(positions, dtype=torch.long))
    with torch.no_grad():
      scores = model(**kw).logits[:, 0].float().numpy()
      values = model.score(backbone(**kw).last_hidden_state)[..., 0].float().numpy()
    last = mask.shape[1] - 1 - np.argmax(mask[:, ::-1], axis=1)
    # The pooled score is the per-position value at the last valid token, as the test reads it.
    np.testing.assert_allclose(scores, values[np.arange(len(last)), last], atol=1e-6, rtol=0)
    gaps = np.abs(scores[:, None] - scores[None, :])[np.triu_indices(len(scores), 1)]
    assert gaps.min() > MIN_ROW_GAP, (side, scores)
    out[f'{side}_tokens'], out[f'{side}_mask'], out[f'{side}_positions'] = tokens, mask, positions
    out[f'{side}_scores'], out[f'{side}_values'] = scores, values
  return out


def write_family(family: str, out_dir: str, seed: int = 0, **overrides) -> dict:
  import transformers

  os.makedirs(out_dir, exist_ok=True)
  model = build_reward_model(family, seed, **overrides)
  model.save_pretrained(out_dir)
  # Not needed to load the weights: keep the committed fixture to the three files it uses.
  extra = os.path.join(out_dir, 'generation_config.json')
  if os.path.exists(extra):
    os.remove(extra)
  ref = reference_scores(model, build_tokenizer())
  ref['transformers_version'] = np.array(transformers.__version__)
  np.savez_compressed(os.path.join(out_dir, 'reference.npz'), **ref)
  return ref


def main():
  here = os.path.dirname(os.path.abspath(__file__))
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--out', default=os.path.join(here, 'fixtures', 'hf_rm'))
  parser.add_argument('--family', action='append', choices=FAMILIES,
                      help='write only this family (repeatable); default: all')
  args = parser.parse_args()
  for family in args.family or FAMILIES:
    ref = write_family(family, os.path.join(args.out, family), SEEDS[family])
    fmt = lambda x: ' '.join(f'{v:.3f}' for v in x)
    print(f'{family}: scores right [{fmt(ref["right_scores"])}] left [{fmt(ref["left_scores"])}]')


if __name__ == '__main__':
  main()

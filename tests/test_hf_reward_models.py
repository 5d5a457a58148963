"""Hugging Face reward models (*ForSequenceClassification, num_labels=1) load as head='scalar'
with transformers' scores, through committed fixtures (no torch needed).

Fixtures come from tests/make_hf_rm_fixtures.py: the causal fixtures' backbones under a score
head, with transformers' pooled scores on a right- and a left-padded batch. A reward is the
scalar head's value at each row's last valid token, where transformers pools (the rightmost
non-pad token).
"""

import json
import os

import jax
import numpy as np
import pytest
from numerics import FIXTURE_TERMS, assert_f32_close

from rloo_jax.models import hf, model_fns

# Float comparisons of two computations: rerun by .ci/run under other CPU flags.
pytestmark = pytest.mark.numerics

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'fixtures', 'hf_rm')
ARCH = {'llama': 'LlamaForSequenceClassification', 'llama3': 'LlamaForSequenceClassification',
        'mistral': 'MistralForSequenceClassification',
        'qwen2': 'Qwen2ForSequenceClassification', 'qwen3': 'Qwen3ForSequenceClassification',
        'gpt2': 'GPT2ForSequenceClassification', 'gpt_neox': 'GPTNeoXForSequenceClassification',
        'gemma2': 'Gemma2ForSequenceClassification',
        'gemma3': 'Gemma3TextForSequenceClassification'}
FAMILIES = tuple(ARCH)  # make_hf_fixtures.FAMILIES, one reward model each
MODEL_FAMILY = {'llama3': 'llama', 'mistral': 'llama'}


def last_valid(mask):
  """Each row's last True column: the last token for right padding, the last column for left."""
  return mask.shape[1] - 1 - np.argmax(mask[:, ::-1], axis=1)


# One test per family, both paddings in it: the two batches share a shape, so each family costs
# one compile of its forward (the compile, not the run, is what a 2-core CPU spends its time on).
@pytest.mark.parametrize('family', FAMILIES)
def test_reward_model_scores_match_transformers(family):
  path = os.path.join(FIXTURES, family)
  with open(os.path.join(path, 'config.json')) as f:
    assert json.load(f)['architectures'] == [ARCH[family]]
  ref = dict(np.load(os.path.join(path, 'reference.npz')))
  # No head= passed: the architecture alone picks the scalar head and loads score.weight.
  config, graphdef, params = hf.load_model(path)
  assert config.head == 'scalar' and config.family == MODEL_FAMILY.get(family, family)
  assert 'lm_head' not in params and params['score_kernel'].shape == (config.hidden_size, 1)
  # HF's score head has no bias: the loader's zeros stand in for it.
  np.testing.assert_array_equal(params['score_bias'][...], np.zeros(1, np.float32))
  forward = jax.jit(model_fns(graphdef).forward)
  errors = {}
  for side in ('right', 'left'):
    mask = ref[f'{side}_mask']
    values = np.asarray(forward(params, ref[f'{side}_tokens'], ref[f'{side}_positions'], mask))
    assert values.shape == mask.shape and values.dtype == np.float32
    rows = np.arange(mask.shape[0])
    scores = values[rows, last_valid(mask)]
    errors[side] = float(np.abs(scores - ref[f'{side}_scores']).max())
    assert_f32_close(scores, ref[f'{side}_scores'], FIXTURE_TERMS,
                     err_msg=f'{family} {side}-padded scores')
    # Every valid position too: what a value model (or a per-token reward) reads.
    assert_f32_close(values[mask], ref[f'{side}_values'][mask], FIXTURE_TERMS,
                     err_msg=f'{family} {side}-padded values')
  # The fixture's rows score far apart, so a mix-up of rows or of pooling positions would show.
  s = ref['right_scores']
  assert np.abs(s[:, None] - s[None, :])[np.triu_indices(len(s), 1)].min() > 0.1
  print(f'{family}: max |score - transformers| right {errors["right"]:.2e} '
        f'left {errors["left"]:.2e}')


def test_reward_model_as_lm_head_is_refused():
  """A sequence-classification checkpoint has no LM head to load: asked for head='lm', the
  loader names the architecture (before any tensor is read)."""
  for family in ('llama', 'gemma3'):
    with pytest.raises(ValueError, match=f'{ARCH[family]} has no LM head; load it with head='):
      hf.load_checkpoint(os.path.join(FIXTURES, family), head='lm')


def test_score_kernel_is_the_checkpoints_score_weight():
  """score.weight [1, E] lands transposed in score_kernel [E, 1], not the fresh init a causal
  backbone loaded with head='scalar' gets."""
  from safetensors.numpy import load_file

  src = os.path.join(FIXTURES, 'qwen2')
  tensors = load_file(os.path.join(src, 'model.safetensors'))
  assert 'lm_head.weight' not in tensors
  _, params = hf.load_checkpoint(src)
  np.testing.assert_array_equal(params['score_kernel'][...], tensors['score.weight'].T)

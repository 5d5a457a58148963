"""Reward functions `fn(prompts, completions, **fields) -> float array [N]` (NaN = unscorable).

  registry        resolve(spec): a callable, 'package.module:function', 'reward_model:<dir>' or
                  'hf_reward_model:<dir or hub id>'
  reward_set      RewardSet: the weighted sum a run optimises, with per-function parts
  verifiers       programmatic rewards (arithmetic exact match) and load_reward_fn
  math_answer     competition-math answers by math-verify (the [math] extra; not imported here)
  noise           reward noise for robustness ablations
  reward_model    Bradley-Terry reward-model training
  scorer          RewardModelScorer: a trained reward model as a reward function; save/load
  hf_reward       HFRewardModel: a Hugging Face *ForSequenceClassification, sharded; the export
  summarize_gold  the summarize task's hidden labeller (gold_reward)
  preferences     labeller noise (bradley_terry_prefer) and win rates
"""

from rloo_jax.rewards.registry import HF_REWARD_MODEL_PREFIX
from rloo_jax.rewards.registry import REWARD_MODEL_PREFIX
from rloo_jax.rewards.registry import resolve
from rloo_jax.rewards.reward_set import RewardFunctionError
from rloo_jax.rewards.reward_set import RewardReturnError
from rloo_jax.rewards.reward_set import RewardSet
from rloo_jax.rewards.reward_set import RewardTimeoutError
from rloo_jax.rewards.reward_set import reward_name
from rloo_jax.rewards.verifiers import arithmetic_exact_match
from rloo_jax.rewards.verifiers import load_reward_fn

__all__ = ["HF_REWARD_MODEL_PREFIX", "REWARD_MODEL_PREFIX", "resolve", "RewardFunctionError",
           "RewardReturnError", "RewardSet",
           "RewardTimeoutError", "reward_name",
           "arithmetic_exact_match", "load_reward_fn"]

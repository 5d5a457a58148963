"""Reward functions `fn(prompts, completions, **fields) -> float array [N]` (NaN = unscorable)."""

from rloo_jax.rewards.verifiers import arithmetic_exact_match
from rloo_jax.rewards.verifiers import load_reward_fn

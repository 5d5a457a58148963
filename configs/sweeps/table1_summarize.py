"""Table 1 in miniature on the summarize task (TL;DR-like). The RL methods optimise the gold reward
directly (configs/summarize.py's trainer default: an oracle stand-in for the learned reward, which
`experiments/rlhf_pipeline.py` trains); DPO trains on the reward-model issue's preference pairs (SFT
samples labelled by the gold reward with Bradley-Terry noise, `rloo_jax.preference_pairs.build_pairs`).
Evaluation (`rloo_jax.evaluation.Evaluator`, the SFT policy as reference): the held-out greedy win
rate against the SFT policy (`win_rate_vs_ref`: both policies' greedy summaries of each prompt
scored by the gold reward, ties half), and the held-out greedy gold reward.

    python experiments/sweep.py --sweep=configs/sweeps/table1_summarize.py --root=/work/runs/table1_summarize
"""
CONFIG = "configs/summarize.py"
SEEDS = (0, 1, 2)
COMMON = {
    "train.num_iterations": 30, "train.eval_every": 10, "train.eval_prompts": 128,
    "train.eval_batch_size": 128, "train.checkpoint_every": 30, "train.keep_checkpoints": 1,
    "train.progress_bar": False, "rloo.num_prompts": 32,
}
SINGLE = {"rloo.k": 1, "rloo.num_prompts": 128}


def get_sweep():
  return [
      dict(name="rloo_k4", **{"advantage.estimator": "rloo", "rloo.k": 4}),
      dict(name="rloo_k2", **{"advantage.estimator": "rloo", "rloo.k": 2}),
      dict(name="raft_k4", **{"advantage.estimator": "raft", "rloo.k": 4}),
      dict(name="raft_k2", **{"advantage.estimator": "raft", "rloo.k": 2}),
      dict(name="reinforce_ema", **{"advantage.estimator": "reinforce_ema", **SINGLE}),
      dict(name="vanilla_pg", **{"advantage.estimator": "vanilla", **SINGLE}),
      dict(name="ppo", algorithm="ppo", **SINGLE),
      dict(name="dpo", algorithm="dpo", **{
          "dpo.pairs": "rlhf", "dpo.steps": 60, "dpo.batch_size": 32, "dpo.eval_every": 20,
          "rlhf.num_pair_prompts": 1024}),
      dict(name="grpo_k4", **{"advantage.estimator": "grpo", "rloo.k": 4}),
  ]

"""Table 1 in miniature on the arithmetic task (held-out exact-match accuracy, greedy).

Every run starts from the same SFT policy (configs/arithmetic.py, seed 0) and trains with the
default experiment's budget (100 iterations, its learning rates). Sample budget per iteration:
the k-sample methods take 32 prompts x k; the single-sample methods (Vanilla PG, REINFORCE with
baseline, PPO) take 128 prompts x 1, the same 128 samples as RLOO k=4. DPO trains offline on
best-vs-worst pairs of 4 SFT samples per prompt.

    python experiments/sweep.py --sweep=configs/sweeps/table1_arithmetic.py --root=runs/table1_arithmetic
"""
CONFIG = "configs/arithmetic.py"
SEEDS = (0, 1, 2)
COMMON = {"train.checkpoint_every": 100, "train.keep_checkpoints": 1,
          "train.progress_bar": False}
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
          "dpo.steps": 60, "dpo.batch_size": 32, "dpo.num_pair_prompts": 1024,
          "dpo.samples_per_prompt": 4, "dpo.eval_every": 20, "dpo.beta": 0.1}),
      dict(name="grpo_k4", **{"advantage.estimator": "grpo", "rloo.k": 4}),
  ]

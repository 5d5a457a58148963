"""The RLOO paper's Table 1, TL;DR rows, at any Pythia size (configs/tldr.py's setting).

Every row spends the same 512 completions per rollout batch: the k-sample methods (RLOO and
RAFT, k = 2 and 4) take 512 / k prompts, the single-sample ones (REINFORCE with a moving-average
baseline, Vanilla PG, PPO with its critic) 512 prompts x 1. DPO trains offline on the human
comparisons (dpo.pairs='dataset': TL;DR's comparison batches, as the paper's DPO did). All rows
start from the same SFT checkpoint and optimise the same reward model, given by --config_arg;
evaluate each run the paper's way with `python -m rloo_jax.winrate` (docs/EVALUATION.md).

    python experiments/sweep.py --sweep=configs/sweeps/table1_tldr.py --root=/runs/table1_tldr_6.9b \
        --config_arg=model=/ckpt/pythia-6.9b-tldr-sft,rm=/ckpt/pythia-6.9b-tldr-rm
    # 1B / 2.8B: the same with their checkpoints; --dry_run lists the runs
"""
CONFIG = "configs/tldr.py"
SEEDS = (0,)  # one seed per row at 1-7B (the paper's table reports one run per cell)
COMMON = {"train.progress_bar": False}
COMPLETIONS = 512


def samples(k: int) -> dict:
  return {"rloo.k": k, "rloo.num_prompts": COMPLETIONS // k}


def get_sweep():
  return [
      dict(name="rloo_k2", **{"advantage.estimator": "rloo", **samples(2)}),
      dict(name="rloo_k4", **{"advantage.estimator": "rloo", **samples(4)}),
      dict(name="raft_k2", **{"advantage.estimator": "raft", **samples(2)}),
      dict(name="raft_k4", **{"advantage.estimator": "raft", **samples(4)}),
      dict(name="reinforce_baseline", **{"advantage.estimator": "reinforce_ema", **samples(1)}),
      dict(name="vanilla_pg", **{"advantage.estimator": "vanilla", **samples(1)}),
      dict(name="ppo", algorithm="ppo", **samples(1)),
      dict(name="dpo", algorithm="dpo", **{
          "dpo.pairs": "dataset", "dpo.num_pair_prompts": 1_000_000, "dpo.steps": 2000,
          "dpo.batch_size": 64, "dpo.beta": 0.1, "dpo.learning_rate": 1e-6,
          "dpo.eval_every": 200}),
  ]

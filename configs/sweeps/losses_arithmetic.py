"""RLOO k=4 against the 2025-26 losses on arithmetic, at the default experiment's budget
(configs/arithmetic.py: 3000 SFT steps, 100 iterations of 32 prompts, 2 epochs a rollout, so the
second epoch sees ratios off 1), 3 seeds: GSPO (the clipped, length-normalised sequence ratio,
its paper's clip range), CISPO (a clipped, held importance weight on every token; no lower clip,
as its paper) and DAPO (GRPO advantages, a token-level ratio with clip-higher, token-mean
aggregation, overlong shaping over the last quarter of the cap, dynamic sampling), beside RLOO
with the sampler-trainer gap truncated (TIS). Every run keeps the default KL penalty, so the loss
(and for DAPO its sampling) is what differs; GSPO and CISPO keep RLOO's advantages.

    python experiments/sweep.py --sweep=configs/sweeps/losses_arithmetic.py \
        --root=/work/runs/losses_arithmetic
"""
CONFIG = "configs/arithmetic.py"
COMMON = {"train.progress_bar": False, "train.checkpoint_every": 100,
          "train.keep_checkpoints": 1}
SEEDS = (0, 1, 2)


def get_sweep():
  rloo4 = {"advantage.estimator": "rloo", "rloo.k": 4}
  return [
      dict(name="rloo_k4", **rloo4),
      dict(name="rloo_k4_tis", **rloo4, **{"loss.is_correction": "tis"}),
      dict(name="gspo_k4", **rloo4, **{"loss.type": "gspo", "loss.clip_eps": 3e-4,
                                       "loss.clip_eps_high": 4e-4}),
      dict(name="cispo_k4", **rloo4, **{"loss.type": "cispo", "loss.clip_eps": 1.0,
                                        "loss.clip_eps_high": 0.28,
                                        "loss.aggregation": "token_mean"}),
      dict(name="dapo_k4", **{"advantage.estimator": "grpo", "rloo.k": 4,
                              "loss.type": "ppo_clip", "loss.ratio_level": "token",
                              "loss.clip_eps": 0.2, "loss.clip_eps_high": 0.28,
                              "loss.aggregation": "token_mean", "rewards.overlong_buffer": 2,
                              "rloo.dynamic_sampling": True}),
  ]

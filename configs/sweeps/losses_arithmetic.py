"""RLOO k=4 against the 2025-26 losses on arithmetic, Table 1's budget (COMMON), 3 seeds:
GSPO (the clipped, length-normalised sequence ratio, its paper's clip range), CISPO (a clipped,
held importance weight on every token; no lower clip, as its paper) and DAPO (GRPO advantages,
a token-level ratio with clip-higher, token-mean aggregation, overlong shaping over the last
quarter of the cap), beside RLOO with the sampler-trainer gap truncated (TIS). GSPO and CISPO
keep RLOO's advantages, so the loss is what differs.

    python experiments/sweep.py --sweep=configs/sweeps/losses_arithmetic.py \
        --root=/work/runs/losses_arithmetic --sft_from=/work/runs/table1_arithmetic/_shared
"""
import importlib.util
import os

_spec = importlib.util.spec_from_file_location(
    "table1", os.path.join(os.path.dirname(os.path.abspath(__file__)), "table1_arithmetic.py"))
_table1 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_table1)

CONFIG = _table1.CONFIG
COMMON = {**_table1.COMMON, "train.num_minibatches": 2}  # a second step sees ratios off 1
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
                              "loss.aggregation": "token_mean", "rewards.overlong_buffer": 2}),
  ]

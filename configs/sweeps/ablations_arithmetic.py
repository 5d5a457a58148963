"""Ablations on arithmetic: robustness (reward noise, larger beta) for RLOO k=4 and PPO, a clipped
RLOO objective (its active-clip fraction), and k = 2, 4, 8 at equal prompts / equal samples.
Baselines (RLOO k=4, RLOO k=2, PPO) are the Table-1 runs; same COMMON budget.

    python experiments/sweep.py --sweep=configs/sweeps/ablations_arithmetic.py \
        --root=/work/runs/ablations_arithmetic --sft_from=/work/runs/table1_arithmetic/_shared
"""
import importlib.util
import os

_spec = importlib.util.spec_from_file_location(
    "table1", os.path.join(os.path.dirname(os.path.abspath(__file__)), "table1_arithmetic.py"))
_table1 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_table1)

CONFIG = _table1.CONFIG
COMMON = _table1.COMMON
SINGLE = _table1.SINGLE
SEEDS = (0, 1, 2)
EXACT = "rloo_jax.rewards.verifiers:arithmetic_exact_match"
NOISE = "rloo_jax.rewards.noise:standard_normal"


def _noise(sigma):
  return {"rewards.fns": [EXACT, NOISE], "rewards.weights": [1.0, sigma]}


def get_sweep():
  rloo4 = {"advantage.estimator": "rloo", "rloo.k": 4}
  ppo = dict(algorithm="ppo", **SINGLE)
  return [
      dict(name="rloo_k4_noise0.5", **rloo4, **_noise(0.5)),
      dict(name="ppo_noise0.5", **ppo, **_noise(0.5)),
      dict(name="rloo_k4_beta0.25", **rloo4, **{"kl.beta": 0.25}),
      dict(name="ppo_beta0.25", **ppo, **{"kl.beta": 0.25}),
      dict(name="rloo_k4_noise1.0", **rloo4, **_noise(1.0)),
      dict(name="ppo_noise1.0", **ppo, **_noise(1.0)),
      dict(name="rloo_k4_clip", **rloo4, **{"loss.type": "ppo_clip"}),
      dict(name="rloo_k8", **{"advantage.estimator": "rloo", "rloo.k": 8}),
      dict(name="rloo_k2_p64", **{"advantage.estimator": "rloo", "rloo.k": 2,
                                  "rloo.num_prompts": 64}),
      dict(name="rloo_k8_p16", **{"advantage.estimator": "rloo", "rloo.k": 8,
                                  "rloo.num_prompts": 16}),
  ]

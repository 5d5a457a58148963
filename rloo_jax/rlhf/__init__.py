"""The RLHF pipeline: SFT -> preference pairs -> reward model -> RLOO -> report.

    from rloo_jax import rlhf
    summary = rlhf.run(config, workdir)

    pipeline.py  the stages, their caches, and the RL stage through the one outer loop
    report.py    plots and the stage table
The pairs stage (`rloo_jax.preference_pairs`) sits below the algorithms: DPO trains on it too.
"""

from rloo_jax.rlhf.pipeline import build_reward_model, run, validate  # noqa: F401

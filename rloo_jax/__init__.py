"""rloo_jax: critic-free online RLHF with REINFORCE Leave-One-Out (RLOO) in JAX.

The pure core is importable without side effects:

    from rloo_jax import advantage, loss
    adv = advantage.get("rloo")(rewards_bk)
"""

__version__ = "0.1.0"

from rloo_jax import advantage, loss  # noqa: F401  (the pure math core)

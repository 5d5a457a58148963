"""rloo_jax: critic-free online RLHF with REINFORCE Leave-One-Out (RLOO) in JAX.

The pure core is importable without side effects:

    from rloo_jax import advantage, loss
    adv = advantage.get("rloo")(rewards_bk)

A trained (or Hugging Face) policy, text in and text out (`rloo_jax.policy`):

    policy = rloo_jax.load_policy("/tmp/rloo_arith")   # or an HF directory / hub id 'org/name'
    policy.generate(["12+34="]), policy.logprobs(["12+34="], ["46"])
"""

__version__ = "0.1.0"

from rloo_jax import advantage, loss  # noqa: F401  (the pure math core)


def __getattr__(name):
  # `rloo_jax.load_policy` loads the trainer's modules on first use, so `import rloo_jax` stays
  # the light pure core above.
  if name in ("Policy", "load_policy"):
    from rloo_jax import policy
    return getattr(policy, name)
  raise AttributeError(f"module 'rloo_jax' has no attribute {name!r}")

r"""The embedded default experiment: RLOO on multi-digit addition with an exact-answer verifier.

A small Llama-shaped policy is trained from scratch by SFT on imperfect demonstrations (a fraction
drop their carries), then RLOO (k = 4, sequence-level REINFORCE, two gradient steps per rollout
batch, KL to the SFT reference) raises its held-out exact-match accuracy.

    python -m rloo_jax.train --config=configs/arithmetic.py --workdir=/tmp/rloo_arith
    python -m rloo_jax.train --config=configs/arithmetic.py:smoke --workdir=/tmp/rloo_smoke
    python -m rloo_jax.train --config=configs/arithmetic.py:k=2 --workdir=/tmp/k2 \
        --config.kl.beta=0.1 --config.loss.type=ppo_clip
"""
from rloo_jax.config_utils import base_config, parse_arg


def get_config(arg=None):
  arg = parse_arg(arg, smoke=False, k=4, seed=0)
  c = base_config()
  c.seed = arg.seed
  c.rloo.k = arg.k
  c.sft.demo_error_rate = 0.5
  # Measured on seeds 0, 1 and 2 (docs/RESULTS.md): SFT at 1e-3 escapes the loss plateau that
  # stalled seed 1 at 3e-3, and RLOO at 1e-4 keeps climbing for 100 iterations where 3e-4 peaked
  # near iteration 25 and then drifted back below its start (KL 1-2). 3000 SFT steps (cosine to
  # zero) converge to the demonstrator's plateau; after 1500 the SFT policy was still diffuse
  # and, for some seeds, float rounding alone decided whether RLOO gained 3 points or 30.
  c.sft.learning_rate = 1e-3
  c.sft.steps = 3000
  c.optim.learning_rate = 1e-4
  if arg.smoke:  # everything shrunk: the whole pipeline in seconds (tests use this)
    c.data.update(num_train=256, num_test=16)
    c.model.update(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                   intermediate_size=64)
    c.sft.update(steps=20, batch_size=16, log_every=10)
    c.rloo.update(num_prompts=4, max_new_tokens=5)
    c.train.update(num_iterations=2, eval_every=2, eval_prompts=16, eval_batch_size=16,
                   checkpoint_every=1, progress_bar=False)
  return c

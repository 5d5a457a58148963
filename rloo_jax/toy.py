"""An autoregressive policy small enough to enumerate every sequence.

Used to check gradient estimators against the exact policy gradient: with a vocabulary of V tokens
and length L there are V**L sequences, so E_y[r(y)] and its gradient are exact sums. The policy is a
table of logits indexed by (position, previous token), with BOS as the previous token of position 0.
"""

from __future__ import annotations

import functools
import itertools


import jax
import jax.numpy as jnp
import numpy as np

from rloo_jax import advantage


class ToyPolicy:

  def __init__(self, vocab: int = 3, length: int = 3, seed: int = 0):
    self.vocab, self.length = vocab, length
    key_theta, key_reward = jax.random.split(jax.random.PRNGKey(seed))
    self.theta = 0.5 * jax.random.normal(key_theta, (length, vocab + 1, vocab))
    self.sequences = jnp.array(list(itertools.product(range(vocab), repeat=length)), jnp.int32)
    # A fixed, arbitrary reward per sequence: estimators must work for any reward.
    self.reward_table = jax.random.uniform(key_reward, (len(self.sequences),))

  def reward(self, seqs_nl: jax.Array) -> jax.Array:
    index = jnp.zeros(seqs_nl.shape[:-1], jnp.int32)
    for t in range(self.length):
      index = index * self.vocab + seqs_nl[..., t]
    return self.reward_table[index]

  def _prev(self, seqs_nl):
    bos = jnp.full(seqs_nl.shape[:-1] + (1,), self.vocab, jnp.int32)
    return jnp.concatenate([bos, seqs_nl[..., :-1]], axis=-1)

  def logp(self, theta, seqs_nl: jax.Array) -> jax.Array:
    """log pi(y) of each sequence (summed over its tokens)."""
    logits = theta[jnp.arange(self.length), self._prev(seqs_nl)]  # [..., L, V]
    logp_t = jnp.take_along_axis(jax.nn.log_softmax(logits), seqs_nl[..., None], -1)[..., 0]
    return logp_t.sum(-1)

  def exact_gradient(self) -> jax.Array:
    """grad_theta E_{y ~ pi}[r(y)], by enumerating every sequence."""
    rewards = self.reward(self.sequences)
    objective = lambda th: jnp.sum(jnp.exp(self.logp(th, self.sequences)) * rewards)
    return jax.grad(objective)(self.theta)

  def sample(self, rng, shape) -> jax.Array:
    tokens = []
    prev = jnp.full(shape, self.vocab, jnp.int32)
    for t, key in enumerate(jax.random.split(rng, self.length)):
      tok = jax.random.categorical(key, self.theta[t, prev])
      tokens.append(tok)
      prev = tok
    return jnp.stack(tokens, -1)

  @functools.partial(jax.jit, static_argnums=(0, 2, 3, 4))
  def gradient_estimates(self, rng, num_groups: int, k: int,
                         estimator: str = "rloo") -> jax.Array:
    """One gradient estimate per group of k samples: mean_i A_i grad log pi(y_i), [G, *theta]."""
    seqs = self.sample(rng, (num_groups, k))
    rewards = self.reward(seqs)
    if estimator == "mean_baseline":  # the shrunk estimator: includes y_i in its own baseline
      adv = rewards - rewards.mean(axis=1, keepdims=True)
    else:
      adv, _ = advantage.call(estimator, rewards)
    grads = jax.vmap(jax.vmap(jax.grad(self.logp), (None, 0)), (None, 0))(self.theta, seqs)
    return jnp.einsum("gk,gk...->g...", adv, grads) / k


def estimator_statistics(policy: ToyPolicy, k: int, num_groups: int, seed: int = 0,
                         estimator: str = "rloo", chunk: int = 20_000) -> dict:
  """Mean, standard error and total variance of the per-group estimate, against the exact one."""
  exact = np.asarray(policy.exact_gradient()).ravel()
  estimates = []
  rng = jax.random.PRNGKey(seed)
  for i in range(0, num_groups, chunk):
    n = min(chunk, num_groups - i)
    estimates.append(np.asarray(policy.gradient_estimates(jax.random.fold_in(rng, i), n, k,
                                                          estimator)).reshape(n, -1))
  est = np.concatenate(estimates).astype(np.float64)
  mean = est.mean(0)
  return {
      "exact": exact,
      "mean": mean,
      "stderr": est.std(0, ddof=1) / np.sqrt(len(est)),
      # Total variance (trace of the covariance) of one group's estimate.
      "variance": float(est.var(0, ddof=1).sum()),
      # Projection of the mean estimate on the exact gradient: 1 when unbiased.
      "scale": float(mean @ exact / (exact @ exact)),
  }

"""The RLOO scoring pass and update: pure functions jitted by `algorithms.rloo`, and the loop of
`num_epochs` x `num_minibatches` donated steps over one rollout's rows.

    score_rollout: reference log-probs -> KL -> R = r - beta * KL -> advantages  (all [B, k])
    train_step:    one gradient step on a minibatch of rows -> (state, metrics)
"""

from __future__ import annotations

from typing import Callable

import jax

from rloo_jax import advantage, loss
from rloo_jax.optim import apply_if_finite


def constrain(tree, shardings):
  """`with_sharding_constraint`, or nothing when there is no FSDP gather to express."""
  return tree if shardings is None else jax.lax.with_sharding_constraint(tree, shardings)


def train_step(state, rows, *, fns, tx, spec: loss.LossSpec, compute_shardings=None,
               param_shardings=None):
  """One gradient step on a minibatch of rollout rows (`rollout.GroupedRows` or
  `SequenceRows`). Pure; jitted with the state donated. A step whose loss or gradient is not
  finite leaves the state unchanged (`optim.apply_if_finite`).

  FSDP: params are gathered into `compute_shardings` for the forward/backward and the gradients
  reduce-scattered back onto `param_shardings` (both None without fsdp)."""
  def loss_fn(params):
    logits = rows.logits(fns, constrain(params, compute_shardings))
    logp = loss.token_logprobs(logits, rows.completions_nt, rows.cmask_nt)
    return loss.policy_loss(spec, logp, rows.old_logp_nt, rows.cmask_nt, rows.advantages_n,
                            logits)

  (value, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  grads = constrain(grads, param_shardings)
  params, opt_state, guard = apply_if_finite(tx, grads, state.opt_state, state.params, value)
  return state.replace(params=params, opt_state=opt_state), dict(metrics, loss=value, **guard)


def score_rollout(ref_params, adv_state, rows, rewards_bk, usable_bk, *, fns, beta: float,
                  kl_estimator: str, kl_reduction: str, estimator: str, options: tuple,
                  compute_shardings=None):
  """Reference log-probs, KL, penalised rewards R = r - beta * KL and advantages, all [B, k].

  Returns ({kl_bk, penalised_bk, advantages_bk, ref_logp_nt}, new estimator state)."""
  b, k = rewards_bk.shape
  ref_logits = rows.logits(fns, constrain(ref_params, compute_shardings))
  ref_logp = loss.token_logprobs(ref_logits, rows.completions_nt, rows.cmask_nt)
  penalised, kl = loss.penalized_reward(rewards_bk.reshape(-1), rows.old_logp_nt, ref_logp,
                                        rows.cmask_nt, beta=beta, estimator=kl_estimator,
                                        reduction=kl_reduction)
  adv, new_adv_state = advantage.call(estimator, penalised.reshape(b, k), usable_bk,
                                      state=adv_state, **dict(options))
  return dict(kl_bk=kl.reshape(b, k), penalised_bk=penalised.reshape(b, k), advantages_bk=adv,
              ref_logp_nt=ref_logp), new_adv_state


def minibatch_updates(step_fn: Callable, take_fn: Callable, state, rows, rng, *,
                      num_epochs: int, num_minibatches: int):
  """`num_epochs` shuffled passes over the rows in `num_minibatches` minibatches.

  What is shuffled is `rows.num_units`: whole groups for `GroupedRows` (a prompt and its k
  samples stay together, so the prompt is still computed once), single samples otherwise.
  `take_fn(rows, idx)` gathers a minibatch (jitted, with the batch sharding). Epoch e's order
  comes from fold_in(rng, 1 + e), so a resumed run replays it exactly; with one minibatch the
  rows are used as they are (the order of rows within one step changes only float rounding).
  Returns (state, [metrics of each step]). Shared by RLOO and the PPO baseline.
  """
  step_metrics = []
  units = rows.num_units
  mb = units // num_minibatches
  for epoch in range(num_epochs):
    if num_minibatches == 1:
      state, m = step_fn(state, rows)
      step_metrics.append(m)
      continue
    order = jax.random.permutation(jax.random.fold_in(rng, 1 + epoch), units)
    for i in range(num_minibatches):
      state, m = step_fn(state, take_fn(rows, order[i * mb:(i + 1) * mb]))
      step_metrics.append(m)
  return state, step_metrics

"""The RLOO scoring pass and update: pure functions jitted by `algorithms.rloo`, and the loop of
`num_epochs` x `num_minibatches` donated steps over one rollout's rows.

    score_rollout: reference log-probs -> KL -> R = r - beta * KL -> advantages  (all [B, k]);
                   reference_logprobs and advantages_of are its two halves
    TrainStep:     one optimizer step on a minibatch of rows, its gradient accumulated over
                   microbatches -> (state, metrics)

Log-probs come from the final hidden states in chunks of positions (`rollout.logprobs`), so
neither program holds [N, T, V] logits.
"""

from __future__ import annotations

from typing import Callable

import functools

import jax
import jax.numpy as jnp

from rloo_jax import advantage, loss, packing, platform, rollout
from rloo_jax.models import lora
from rloo_jax.optim import apply_if_finite
from rloo_jax.sharding import leading_ways


def constrain(tree, shardings):
  """`with_sharding_constraint`, or nothing when there is no sharding to express. One sharding
  for a tree of rows: a field with fewer rows than its batch shards (a microbatch's prompts,
  fewer groups than devices) is gathered whole instead, not split where it cannot be."""
  if shardings is None:
    return tree
  if not isinstance(shardings, jax.sharding.NamedSharding):
    return jax.lax.with_sharding_constraint(tree, shardings)
  ways = leading_ways(shardings)
  whole = jax.sharding.NamedSharding(shardings.mesh, jax.sharding.PartitionSpec())
  return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(
      x, shardings if x.ndim and x.shape[0] % ways == 0 else whole), tree)


def microbatches(config, *, per: str) -> int:
  """How many microbatches `config.train.microbatch_size` cuts a minibatch (per='minibatch':
  the update) or the whole rollout (per='rollout': the reference pass) into; 1 when it is 0.
  The size counts groups (prompts) with train.shared_prefix, rows otherwise."""
  c = config
  size = int(c.train.get("microbatch_size", 0))
  units = c.rloo.num_prompts if c.train.shared_prefix else c.rloo.num_prompts * c.rloo.k
  if per == "minibatch":
    units //= c.train.num_minibatches
  return max(units // size, 1) if size else 1


def combine(total, out):
  """Two microbatches' (losses, gradients, metrics) as one: sums, but the maximum for a metric
  named '..._max'."""
  def pair(path, a, b):
    key = getattr(path[-1], "key", "") if path else ""
    return jnp.maximum(a, b) if isinstance(key, str) and key.endswith("_max") else a + b
  return jax.tree_util.tree_map_with_path(pair, total, out)


def accumulate(fn, rows, *, microbatches: int, k: int, rows_sharding=None):
  """Sums `fn(microbatch)` (a pytree of arrays: losses, gradients, metrics) over `microbatches`
  slices of the rows with a `lax.scan`, so one microbatch's activations live at a time; with 1
  it is `fn(rows)`. Exact for anything that sums over rows (the losses, given a whole-minibatch
  `loss.normalizer`)."""
  if isinstance(rows, packing.PackedRows):
    return rows.accumulate(fn, lambda mb: constrain(mb, rows_sharding), combine)
  if microbatches == 1:
    return fn(rows)
  split = rows.microbatches(microbatches, k)
  first = jax.tree.map(lambda x: x[0], split)
  zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(fn, first))

  def body(total, mb):
    return combine(total, fn(constrain(mb, rows_sharding))), None

  return jax.lax.scan(body, zeros, split)[0]


def fuses_head(spec: loss.LossSpec, fused_head: bool) -> bool:
  """Whether `gradients` computes the head's gradient in the log-prob pass: asked for
  (config.train.fused_head_grad) and a loss linear in the log-probs."""
  return (bool(fused_head) and spec.type in loss.LINEAR_LOSS_TYPES
          and spec.is_correction == "none")


def gradients(params, rows, frozen=None, *, fns, spec: loss.LossSpec, k: int, chunk_size: int,
              microbatches: int = 1, param_shardings=None, rows_sharding=None,
              fused_head: bool = True):
  """The policy loss's gradient on a minibatch of rollout rows (`rollout.GroupedRows` or
  `SequenceRows`), summed over `microbatches` slices of it (gradient accumulation: the same
  gradient for any number, up to float rounding). Returns (grads, loss, metrics). Pure.

  `frozen`: with LoRA, the base the adapters `params` sit on (`rloo_jax.adapters`): an argument
  that is not differentiated, so the gradient (and the optimizer) covers the adapters only.

  `fused_head` (config.train.fused_head_grad): for a loss linear in the log-probs
  (loss.LINEAR_LOSS_TYPES), the head's gradient is computed in the log-prob pass
  (`head_loss.linear_logprob_loss`: one pass over the head, not two); the same gradient. Other
  loss types ignore it.

  FSDP: `fns` gathers each layer's weights as the layer scan reaches it and reduce-scatters its
  gradient (`sharding.ParamGather`); the summed gradient stays on `param_shardings`."""
  norm = loss.normalizer(spec, rows.cmask_nt)
  fused = fuses_head(spec, fused_head)

  def grads_of(mb):
    def loss_fn(params):
      full = params if frozen is None else lora.join(frozen, params)
      if not fused:
        logp, entropy = rollout.logprobs(mb, fns, full, chunk_size=chunk_size,
                                         with_entropy=True)
        return loss.policy_loss(spec, logp, mb.old_logp_nt, mb.cmask_nt, mb.advantages_n,
                                entropy, normalizer=norm, sampler_logp_bt=mb.sampler_logp_nt)
      coef = loss.linear_coefficients(spec, mb.cmask_nt, mb.advantages_n, normalizer=norm)
      value, logp, entropy = mb.linear_loss(fns, full, coef, chunk_size=chunk_size)
      # The metrics from the same log-probs (no gradient); policy_loss among them equals value.
      _, metrics = loss.policy_loss(spec, jnp.where(mb.cmask_nt, logp, 0.0), mb.old_logp_nt,
                                    mb.cmask_nt, mb.advantages_n, entropy, normalizer=norm,
                                    sampler_logp_bt=mb.sampler_logp_nt)
      return value, metrics
    (value, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    return constrain(grads, param_shardings), value, metrics

  return accumulate(grads_of, rows, microbatches=microbatches, k=k, rows_sharding=rows_sharding)


def apply_gradients(state, grads, value, *, tx):
  """The optimizer update of `state` (params, opt_state) by `grads`, skipped when the loss or
  the gradient is not finite (`optim.apply_if_finite`). Pure; jitted with the state donated, so
  the new params and moments overwrite the old in place."""
  params, opt_state, guard = apply_if_finite(tx, grads, state.opt_state, state.params, value)
  return state.replace(params=params, opt_state=opt_state), guard


class TrainStep:
  """One optimizer step on a minibatch, `step(state, rows) -> (state, metrics)`, run as two
  jitted programs: `gradients` (params read, not donated) then `apply_gradients` (the state
  donated).

  Why two: XLA copies every donated buffer that a while loop reads (the layer scan reads the
  stacked weights, the chunked log-probs the head) before the loop, so that the output can
  overwrite it afterwards; in one program that is a second copy of the parameters. Split, the
  gradient program donates nothing, and the update program has no loop.
  """

  def __init__(self, *, fns, tx, spec: loss.LossSpec, k: int, chunk_size: int, microbatches: int,
               state_shardings, rows_sharding, replicated, fused_head: bool = True,
               packer: packing.Packer | None = None):
    params_sh = state_shardings.params
    # config.train.microbatch_tokens: each minibatch packed (`packing.Packer`) before the step.
    self.packer = packer
    # Whether the head's gradient is computed in the log-prob pass (`gradients`' fused_head).
    self.fused_head = fuses_head(spec, fused_head)
    # LoRA: the frozen base is a third, read-only argument of the gradient program.
    self.lora = getattr(state_shardings, "lora", False)
    frozen_sh = (state_shardings.ref_params,) if self.lora else ()
    self.grad_fn = platform.jit(
        functools.partial(gradients, fns=fns, spec=spec, k=k, chunk_size=chunk_size,
                          microbatches=microbatches, param_shardings=params_sh,
                          rows_sharding=rows_sharding, fused_head=fused_head),
        in_shardings=(params_sh, rows_sharding, *frozen_sh),
        out_shardings=(params_sh, replicated, replicated), sharding=replicated)
    self.apply_fn = platform.jit(
        functools.partial(apply_gradients, tx=tx),
        in_shardings=(state_shardings, params_sh, replicated),
        out_shardings=(state_shardings, replicated), donate_argnums=0, sharding=replicated)

  def __call__(self, state, rows):
    if self.packer is not None:
      rows = self.packer(rows)
    grads, value, metrics = self.grad_fn(*self._grad_args(state, rows))
    state, guard = self.apply_fn(state, grads, value)
    return state, dict(metrics, loss=value, **guard)

  def lower(self, state, rows) -> dict:
    """{'update_gradients', 'update_apply'}: both programs lowered on (abstract) arguments."""
    if self.packer is not None:
      rows = self.packer.abstract(rows)
    gradients_lowered = self.grad_fn.lower(*self._grad_args(state, rows))
    grads, value, _ = gradients_lowered.out_info  # traced once: no eval_shape beside the lower
    return {"update_gradients": gradients_lowered,
            "update_apply": self.apply_fn.lower(state, grads, value)}

  def _grad_args(self, state, rows) -> tuple:
    return (state.params, rows, state.ref_params) if self.lora else (state.params, rows)

  def _cache_size(self) -> int:
    """Compiled shapes of the gradient program (one per distinct rows shape)."""
    return self.grad_fn._cache_size()  # pylint: disable=protected-access


def reference_logprobs(ref_params, rows, frozen=None, *, fns, k: int, chunk_size: int,
                       microbatches: int = 1, rows_sharding=None):
  """The reference policy's log-probs [N, T] of the rows' completions, float32, computed in
  `microbatches` slices (the rows come back in their own order); packed rows, over their
  microbatches (each gives its samples' log-probs, zero elsewhere). `frozen`: LoRA's base, the
  params then its adapters (the policy's log-probs: config.loss.old_logprobs='recompute')."""
  if frozen is not None:
    ref_params = lora.join(frozen, ref_params)
  if isinstance(rows, packing.PackedRows):
    return rows.accumulate(lambda mb: mb.logprobs(fns, ref_params, chunk_size=chunk_size)[0],
                           lambda mb: constrain(mb, rows_sharding))
  if microbatches == 1:
    return rollout.logprobs(rows, fns, ref_params, chunk_size=chunk_size)[0]
  split = rows.microbatches(microbatches, k)
  logp = jax.lax.map(lambda mb: rollout.logprobs(constrain(mb, rows_sharding), fns, ref_params,
                                                 chunk_size=chunk_size)[0], split)
  # Undo the interleaving of `microbatches`: slice i holds units i, i + m, ...
  n, t = rows.completions_nt.shape
  per_unit = n // rows.num_units
  m = microbatches
  return logp.reshape(m, -1, per_unit, t).swapaxes(0, 1).reshape(n, t)


class ReferencePass:
  """`reference_logprobs` jitted, `ref(ref_params, rows[, frozen]) -> [N, T]`; with a
  `packing.Packer` (config.train.microbatch_tokens) the rollout's rows are packed first."""

  def __init__(self, *, fns, k: int, chunk_size: int, microbatches: int, ref_sharding,
               rows_sharding, packer: packing.Packer | None = None, frozen_sharding=None):
    self.packer = packer
    self.fn = platform.jit(
        functools.partial(reference_logprobs, fns=fns, k=k, chunk_size=chunk_size,
                          microbatches=microbatches, rows_sharding=rows_sharding),
        in_shardings=(ref_sharding, rows_sharding,
                      *(() if frozen_sharding is None else (frozen_sharding,))),
        out_shardings=rows_sharding, sharding=rows_sharding)

  def pack(self, rows):
    """The rows this pass reads: packed once, and then shared with another pass of its packer."""
    if self.packer is None or isinstance(rows, packing.PackedRows):
      return rows
    return self.packer(rows)

  def __call__(self, ref_params, rows, *frozen):
    return self.fn(ref_params, self.pack(rows), *frozen)

  def lower(self, ref_params, rows):
    return self.fn.lower(ref_params, rows if self.packer is None else self.packer.abstract(rows))

  def _cache_size(self) -> int:
    return self.fn._cache_size()  # pylint: disable=protected-access


def score_rollout(ref_params, adv_state, rows, rewards_bk, usable_bk, *, fns, beta: float,
                  kl_estimator: str, kl_reduction: str, estimator: str, options: tuple,
                  chunk_size: int, microbatches: int = 1, rows_sharding=None):
  """Reference log-probs, KL, penalised rewards R = r - beta * KL and advantages, all [B, k]:
  `reference_logprobs` then `advantages_of`, which RLOO runs as two programs so the reference
  pass runs on the devices while the host scores the rewards.

  Returns ({kl_bk, penalised_bk, advantages_bk, ref_logp_nt}, new estimator state)."""
  ref_logp = reference_logprobs(ref_params, rows, fns=fns, k=rewards_bk.shape[1],
                                chunk_size=chunk_size, microbatches=microbatches,
                                rows_sharding=rows_sharding)
  return advantages_of(ref_logp, adv_state, rows, rewards_bk, usable_bk, beta=beta,
                       kl_estimator=kl_estimator, kl_reduction=kl_reduction,
                       estimator=estimator, options=options)


def advantages_of(ref_logp, adv_state, rows, rewards_bk, usable_bk, *, beta: float,
                  kl_estimator: str, kl_reduction: str, estimator: str, options: tuple):
  """KL, penalised rewards and advantages of the rows given the reference's log-probs [N, T]."""
  b, k = rewards_bk.shape
  penalised, kl = loss.penalized_reward(rewards_bk.reshape(-1), rows.old_logp_nt, ref_logp,
                                        rows.cmask_nt, beta=beta, estimator=kl_estimator,
                                        reduction=kl_reduction)
  adv, new_adv_state = advantage.call(estimator, penalised.reshape(b, k), usable_bk,
                                      state=adv_state, **dict(options))
  return dict(kl_bk=kl.reshape(b, k), penalised_bk=penalised.reshape(b, k), advantages_bk=adv,
              ref_logp_nt=ref_logp), new_adv_state


def take_units(rows, idx, *, k: int):
  """Rollout units `idx` of the rows (whole groups of k, or samples): `minibatch_updates`'
  take_fn, jitted by its caller."""
  return rows.take(idx, k)


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

"""PPO with a learned critic: the baseline RLOO is measured against (the paper's "four-model"
setup).

Four models take part in one iteration: the policy (trained), the critic (a separate value model of
the policy's size with a scalar head, trained), the frozen reference (the SFT policy) and the reward
(a verifier or a reward model, named in `config.rewards` exactly as for RLOO).

PPO as InstructGPT / TRL's PPOTrainer do it, every choice at the token level:

- per-token reward  r_t = -beta * KL_t  (KL_t = log pi(y_t) - log pi_ref(y_t), config.kl.estimator),
  plus the sequence reward at the completion's last token;
- values V_t = critic([prompt | y_<t]) at the position that predicts y_t, V = 0 after the end;
- GAE: delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lambda A_{t+1}; returns A + V;
  advantages whitened over the batch's completion tokens (config.ppo.whiten_advantages);
- policy: the clipped surrogate with one ratio per token, -min(rho A, clip(rho, 1-eps, 1+eps) A);
- critic: the clipped value loss 0.5 max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2).

Rollout, rewards, rows, the minibatch loop, evaluation and the outer loop are RLOO's own, so the
two algorithms differ only where the algorithms differ. The math is in `algorithms.ppo_math`.

    python -m rloo_jax.train --config=configs/arithmetic.py --workdir=/tmp/ppo \
        --config.algorithm=ppo --config.rloo.k=1
"""

from __future__ import annotations

import functools
import time
from typing import Any

from flax import struct
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from rloo_jax import adapters, config_utils, loss, platform, rollout, update
from rloo_jax import experiment as experiment_lib
from rloo_jax.algorithms import ppo_math
from rloo_jax.algorithms.base import AlgorithmBase
from rloo_jax.algorithms.rloo import (rollout_metrics, rollout_rows, sample_rows,
                                     timed_updates, trim_rollout)
from rloo_jax.models import transformer
from rloo_jax.optim import apply_if_finite, make_optimizer, with_learning_rate
from rloo_jax.rewards import reward_model

PPO_DEFAULTS = dict(
    gamma=1.0,  # no discounting inside a completion (InstructGPT, TRL)
    lam=0.95,  # GAE lambda
    value_clip=0.2,  # clip range of the value loss (0 = unclipped)
    value_learning_rate=0.0,  # 0 = the policy's config.optim.learning_rate
    whiten_advantages=True,
    aggregation="token_mean",  # PPO's token-level average (config.loss.aggregation is RLOO's)
    critic_init="policy",  # 'policy': SFT backbone + fresh scalar head; 'random'
)


def with_defaults(config) -> ml_collections.ConfigDict:
  """A copy of the config with a complete `config.ppo` section (missing fields get defaults)."""
  c = config_utils.with_section_defaults(config, "ppo", PPO_DEFAULTS)
  with c.unlocked():
    # PPO's advantages come from GAE; the RLOO estimator is unused, and a group estimator's
    # k >= 2 check must not reject PPO's usual one sample per prompt. PPO scores full rows.
    c.advantage.estimator = "vanilla"
    c.train.shared_prefix = False
  return c


def validate(config) -> None:
  p = config.ppo
  if not 0.0 <= p.gamma <= 1.0 or not 0.0 <= p.lam <= 1.0:
    raise ValueError(f"config.ppo.gamma = {p.gamma} and config.ppo.lam = {p.lam} must be in [0, 1]")
  if p.value_clip < 0:
    raise ValueError(f"config.ppo.value_clip = {p.value_clip} must be >= 0 (0 = unclipped)")
  if p.aggregation not in loss.AGGREGATIONS:
    raise ValueError(f"config.ppo.aggregation = {p.aggregation!r}; choose one of "
                     f"{loss.AGGREGATIONS}")
  if p.critic_init not in ("policy", "random"):
    raise ValueError(f"config.ppo.critic_init = {p.critic_init!r}; choose 'policy' or 'random'")
  if config.train.get("microbatch_tokens", 0):
    raise ValueError("config.train.microbatch_tokens (packed updates) is RLOO's; PPO's update "
                     "reads unpacked rows: set it to 0")


@struct.dataclass
class PPOState:
  step: jax.Array
  params: Any  # policy
  ref_params: Any  # frozen reference
  value_params: Any  # critic (scalar head)
  opt_state: Any
  value_opt_state: Any
  rng: jax.Array


@struct.dataclass
class PPORows:
  """The rollout's [prompt | completion] rows plus GAE's per-token targets."""
  seq: rollout.SequenceRows
  loss_mask_nt: jax.Array      # bool [N, T]: completion tokens of scorable samples
  advantages_nt: jax.Array     # float32 [N, T]
  returns_nt: jax.Array        # float32 [N, T]
  old_values_nt: jax.Array     # float32 [N, T]

  @property
  def num_units(self) -> int:
    return self.seq.num_units

  def take(self, idx, k: int) -> "PPORows":
    del k
    return jax.tree.map(lambda x: x[idx], self)


def score(ref_params, value_params, rows: rollout.SequenceRows, rewards_n, usable_n, *, fns,
          value_fns, beta: float, kl_estimator: str, gamma: float, lam: float,
          whiten_advantages: bool, chunk_size: int):
  """Reference log-probs, values, per-token rewards, GAE advantages and returns."""
  ref_logp = rollout.logprobs(rows, fns, ref_params, chunk_size=chunk_size)[0]
  values = rows.logits(value_fns, value_params).astype(jnp.float32)
  # Unscorable samples (NaN reward) take no part in the update at all.
  lmask = rows.cmask_nt & usable_n[:, None]
  kl_nt = jnp.where(rows.cmask_nt, loss.kl_per_token(rows.old_logp_nt, ref_logp, kl_estimator),
                    0.0)
  r_nt = ppo_math.token_rewards(jnp.where(usable_n, rewards_n, 0.0), kl_nt, lmask, beta=beta)
  adv, returns = ppo_math.gae(r_nt, values, lmask, gamma=gamma, lam=lam)
  if whiten_advantages:
    adv = ppo_math.whiten(adv, lmask)
  return PPORows(rows, lmask, adv, returns, jnp.where(lmask, values, 0.0)), dict(
      kl_n=kl_nt.sum(-1), penalised_n=rewards_n - beta * kl_nt.sum(-1))


def train_step(state: PPOState, rows: PPORows, *, fns, value_fns, tx, value_tx, clip_eps: float,
               value_clip: float, aggregation: str, chunk_size: int):
  """One gradient step of the policy and one of the critic on a minibatch. Pure; donated."""
  seq, lmask = rows.seq, rows.loss_mask_nt

  def policy_fn(params):
    logp, entropy = rollout.logprobs(seq, fns, params, chunk_size=chunk_size, with_entropy=True)
    # Per-token GAE advantages through the shared clipped surrogate (token-level ratios).
    return loss.ppo_clip_loss(jnp.where(lmask, logp, 0.0), seq.old_logp_nt, lmask,
                              rows.advantages_nt, clip_eps=clip_eps, ratio_level="token",
                              aggregation=aggregation, entropy_bt=entropy)

  def critic_fn(value_params):
    return ppo_math.value_loss(seq.logits(value_fns, value_params), rows.old_values_nt,
                               rows.returns_nt, lmask, clip=value_clip)

  (pl, pm), grads = jax.value_and_grad(policy_fn, has_aux=True)(state.params)
  (vl, vm), vgrads = jax.value_and_grad(critic_fn, has_aux=True)(state.value_params)
  params, opt_state, guard = apply_if_finite(tx, grads, state.opt_state, state.params, pl)
  value_params, value_opt_state, vguard = apply_if_finite(
      value_tx, vgrads, state.value_opt_state, state.value_params, vl)
  state = state.replace(params=params, opt_state=opt_state, value_params=value_params,
                        value_opt_state=value_opt_state)
  return state, dict(pm, **vm, loss=pl + vl, grad_norm=guard["grad_norm"],
                     value_grad_norm=vguard["grad_norm"],
                     nonfinite_steps=jnp.maximum(guard["nonfinite_steps"],
                                                 vguard["nonfinite_steps"]))


class PPO(AlgorithmBase):
  """PPO as an algorithm of the outer loop (`rloo_jax.loop`)."""

  name = "ppo"
  label = "PPO"

  def __init__(self, exp):
    super().__init__(exp)
    c, p = exp.config, exp.config.ppo
    self.k = int(c.rloo.k)
    self.value_config = exp.model_config.replace(head="scalar")
    self.value_fns = transformer.model_fns(transformer.abstract(self.value_config)[0])
    steps = c.train.num_iterations * exp.updates_per_iteration
    self.value_tx = make_optimizer(with_learning_rate(c.optim, p.value_learning_rate), steps)
    self.score_fn = platform.jit(functools.partial(
        score, fns=exp.fns, value_fns=self.value_fns, beta=float(c.kl.beta),
        kl_estimator=c.kl.estimator, gamma=float(p.gamma), lam=float(p.lam),
        whiten_advantages=bool(p.whiten_advantages),
        chunk_size=int(c.train.logprob_chunk_size)))
    self.state_shardings = exp.layout.tree_shardings(self._unsharded_abstract())
    rows_sh = exp.layout.batch_sharding
    step = functools.partial(
        train_step, fns=exp.fns, value_fns=self.value_fns, tx=exp.tx, value_tx=self.value_tx,
        clip_eps=float(c.loss.clip_eps), value_clip=float(p.value_clip),
        aggregation=p.aggregation, chunk_size=int(c.train.logprob_chunk_size))
    self.step_fn = platform.jit(step, in_shardings=(self.state_shardings, rows_sh),
                                out_shardings=(self.state_shardings, exp.layout.replicated),
                                donate_argnums=0)
    self.rows_fn = platform.jit(functools.partial(sample_rows, k=self.k, shared_prefix=False),
                                out_shardings=rows_sh)
    self.take_fn = platform.jit(functools.partial(update.take_units, k=self.k),
                                out_shardings=rows_sh)

  def init_critic(self, policy_params, seed: int):
    if self.exp.config.ppo.critic_init == "random":
      return transformer.create(self.value_config, seed=seed)[1]
    # The reward model's initialisation: the SFT backbone under a fresh scalar head.
    return reward_model.init_from_policy(self.exp.model_config, policy_params, seed=seed)[2]

  def _init_state(self, params, value_params) -> PPOState:
    c = self.exp.config
    return PPOState(step=jnp.zeros((), jnp.int32), params=params,
                    ref_params=adapters.reference_copy(c, params),
                    value_params=value_params,
                    opt_state=self.exp.tx.init(params),
                    value_opt_state=self.value_tx.init(value_params),
                    rng=jax.random.PRNGKey(c.seed))

  def _unsharded_abstract(self) -> PPOState:
    _, params = transformer.abstract(self.exp.model_config)
    _, vparams = transformer.abstract(self.value_config)
    return jax.eval_shape(self._init_state, params, vparams)

  def init_state(self, params, value_params=None) -> PPOState:
    """The state laid out on the experiment's mesh by the logical rules, as RLOO's is."""
    if value_params is None:
      value_params = self.init_critic(params, self.exp.config.seed)
    sh = self.state_shardings
    put = self.exp.layout.put
    return jax.jit(self._init_state, out_shardings=sh)(put(params, sh.params),
                                                       put(value_params, sh.value_params))

  def abstract_state(self) -> PPOState:
    return self.exp.layout.abstract(self._unsharded_abstract(), self.state_shardings)

  def iteration(self, state: PPOState, batch: dict):
    """rollout -> rewards -> reference + critic -> GAE -> epochs x minibatches."""
    exp, k = self.exp, self.k
    rng = jax.random.fold_in(state.rng, int(state.step))
    out, rewards_bk, usable_bk, num_nonfinite, parts, timings, _ = rollout.timed_rollout(
        exp, state.params, batch, rng, k=k)

    t0 = time.perf_counter()
    layout = exp.layout
    # GAE, whitening and the value loss are masked, so the columns past every end change nothing.
    out = trim_rollout(exp, out, exp.config.ppo.aggregation)
    seq = rollout_rows(self, batch, out)
    rows, s = self.score_fn(state.ref_params, state.value_params, seq,
                            layout.put_global_batch(rewards_bk.reshape(-1).astype(np.float32)),
                            layout.put_global_batch(usable_bk.reshape(-1)))
    jax.block_until_ready(rows.advantages_nt)
    timings["reference_s"] = time.perf_counter() - t0  # reference + critic forward + GAE

    state, m = timed_updates(self, state, rows, rng, timings)
    lm = layout.gather(rows.loss_mask_nt)
    values, returns = layout.gather(rows.old_values_nt)[lm], layout.gather(rows.returns_nt)[lm]
    m.update(rollout_metrics(exp, out, rewards_bk, usable_bk, num_nonfinite, parts, timings))
    m.update(
        kl=float(layout.gather(s["kl_n"]).mean()),
        penalised_reward=float(layout.gather(s["penalised_n"])[usable_bk.reshape(-1)].mean())
        if usable_bk.any() else 0.0,
        value_mean=float(values.mean()) if values.size else 0.0,
        explained_variance=float(1.0 - np.var(returns - values) / max(np.var(returns), 1e-8))
        if values.size else 0.0,
        update_columns=float(out.tokens_bkt.shape[2]))
    m["iteration_s"] = sum(timings.values())
    return state, m

  def log_line(self, step: int, m: dict) -> str:
    return (f"[ppo] iteration {step}: reward {m['reward_mean']:.3f} kl {m['kl']:.3f} "
            f"clip {m['clip_fraction']:.3f} ev {m['explained_variance']:.2f} "
            f"({m['iteration_s']:.2f}s)")

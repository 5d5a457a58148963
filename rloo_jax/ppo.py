"""PPO with a learned critic: the baseline RLOO is measured against (the paper's "four-model" setup).

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

Rollout, rewards, reference log-probs and evaluation are the RLOO trainer's own pure functions
(`trainer.rollout`, `rollout_sequences`, `completion_logits`, `evaluate`), so the two algorithms
differ only where the algorithms differ. `run(config, workdir)` mirrors `trainer.run` (SFT stage,
Orbax checkpoints with resume, metrics.jsonl, summary.json).

    python experiments/sweep.py --sweep=configs/sweeps/table1_arithmetic.py --root=/tmp/t1 --only=ppo
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import os
import time
from typing import Any

from flax import struct
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from rloo_jax import loss, trainer
from rloo_jax.checkpoint import Checkpointer
from rloo_jax.data import pipeline
from rloo_jax.metrics import MetricWriter
from rloo_jax.models import transformer

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
  c = copy.deepcopy(config)
  with c.unlocked():
    if "ppo" not in c:
      c.ppo = ml_collections.ConfigDict()
    for name, value in PPO_DEFAULTS.items():
      if name not in c.ppo:
        c.ppo[name] = value
    # PPO's advantages come from GAE; the RLOO estimator is unused, and a group estimator's
    # k >= 2 check must not reject PPO's usual one sample per prompt.
    c.advantage.estimator = "vanilla"
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


# ----------------------------------------------------------------------------------------------
# Pure math


def token_rewards(rewards_n, kl_nt, mask_nt, *, beta: float):
  """PPO's per-token reward [N, T]: -beta * KL_t everywhere, plus the sequence reward at the last
  completion token (the eos, or the last token of a completion cut at max_new_tokens)."""
  mask = mask_nt.astype(bool)
  length_n = mask.sum(-1)
  last_nt = jax.nn.one_hot(jnp.maximum(length_n - 1, 0), mask.shape[1], dtype=jnp.float32)
  last_nt = last_nt * (length_n > 0)[:, None]
  r = -beta * kl_nt.astype(jnp.float32) + rewards_n.astype(jnp.float32)[:, None] * last_nt
  return jnp.where(mask, r, 0.0)


def gae(rewards_nt, values_nt, mask_nt, *, gamma: float, lam: float):
  """Generalised advantage estimation over each completion; (advantages, returns), both [N, T].

  The value after the last completion token is 0 (the episode ends); the mask is a prefix.
  """
  mask = mask_nt.astype(jnp.float32)
  values = values_nt.astype(jnp.float32) * mask
  next_values = jnp.concatenate([values[:, 1:], jnp.zeros_like(values[:, :1])], axis=1)
  deltas = (rewards_nt.astype(jnp.float32) + gamma * next_values - values) * mask

  def step(carry_n, x):
    delta_n, m_n = x
    a = (delta_n + gamma * lam * carry_n) * m_n
    return a, a

  _, adv_tn = jax.lax.scan(step, jnp.zeros(values.shape[0], jnp.float32),
                           (deltas.T, mask.T), reverse=True)
  adv = adv_tn.T
  return adv, (adv + values) * mask


def whiten(x_nt, mask_nt, shift_mean: bool = True):
  mean = loss.masked_mean(x_nt, mask_nt)
  var = loss.masked_mean((x_nt - mean) ** 2, mask_nt)
  out = (x_nt - mean) * jax.lax.rsqrt(var + 1e-8)
  if not shift_mean:
    out = out + mean
  return jnp.where(mask_nt, out, 0.0)


def value_loss(values_nt, old_values_nt, returns_nt, mask_nt, *, clip: float):
  """0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2), masked token mean.

  Returns (loss, metrics with the fraction of tokens where the clipped term was the larger)."""
  v = values_nt.astype(jnp.float32)
  err = (v - returns_nt) ** 2
  if clip > 0:
    v_clipped = old_values_nt + jnp.clip(v - old_values_nt, -clip, clip)
    err_clipped = (v_clipped - returns_nt) ** 2
    per_token = 0.5 * jnp.maximum(err, err_clipped)
    frac = loss.masked_mean((err_clipped > err).astype(jnp.float32), mask_nt)
  else:
    per_token = 0.5 * err
    frac = jnp.zeros((), jnp.float32)
  value = loss.masked_mean(per_token, mask_nt)
  return value, {"value_loss": value, "value_clip_fraction": frac}


# ----------------------------------------------------------------------------------------------
# State and jitted steps


@struct.dataclass
class PPOState:
  step: jax.Array
  params: Any  # policy
  ref_params: Any  # frozen reference
  value_params: Any  # critic (scalar head)
  opt_state: Any
  value_opt_state: Any
  rng: jax.Array


@dataclasses.dataclass
class PPOExperiment:
  """The RLOO Experiment (task, policy fns, rewards, sampler) plus the critic's pieces."""
  exp: trainer.Experiment
  value_config: transformer.TransformerConfig
  value_graphdef: Any
  value_fns: transformer.ModelFns
  value_tx: optax.GradientTransformation
  score_fn: Any
  step_fn: Any

  @property
  def config(self):
    return self.exp.config


def score(ref_params, value_params, tokens_ns, positions_ns, mask_ns, completions_nt, cmask_nt,
          policy_logp_nt, rewards_n, usable_n, *, fns, value_fns, num_prompt: int, beta: float,
          kl_estimator: str, gamma: float, lam: float, whiten_advantages: bool):
  """Reference log-probs, values, per-token rewards, GAE advantages and returns."""
  t = completions_nt.shape[1]
  ref_logits = trainer.completion_logits(fns, ref_params, tokens_ns, positions_ns, mask_ns,
                                         num_prompt, t)
  ref_logp = loss.token_logprobs(ref_logits, completions_nt, cmask_nt)
  values = trainer.completion_logits(value_fns, value_params, tokens_ns, positions_ns, mask_ns,
                                     num_prompt, t).astype(jnp.float32)
  # Unscorable samples (NaN reward) take no part in the update at all.
  lmask = cmask_nt & usable_n[:, None]
  kl_nt = jnp.where(cmask_nt, loss.kl_per_token(policy_logp_nt, ref_logp, kl_estimator), 0.0)
  r_nt = token_rewards(jnp.where(usable_n, rewards_n, 0.0), kl_nt, lmask, beta=beta)
  adv, returns = gae(r_nt, values, lmask, gamma=gamma, lam=lam)
  if whiten_advantages:
    adv = whiten(adv, lmask)
  return dict(ref_logp_nt=ref_logp, values_nt=jnp.where(lmask, values, 0.0), advantages_nt=adv,
              returns_nt=returns, kl_n=kl_nt.sum(-1), loss_mask_nt=lmask,
              penalised_n=rewards_n - beta * kl_nt.sum(-1))


def train_step(state: PPOState, batch: dict, *, fns, value_fns, tx, value_tx, clip_eps: float,
               value_clip: float, aggregation: str, num_prompt: int):
  """One gradient step of the policy and one of the critic on a minibatch. Pure; donated."""
  t = batch["completions"].shape[1]
  lmask = batch["loss_mask"]

  def policy_fn(params):
    logits = trainer.completion_logits(fns, params, batch["tokens"], batch["positions"],
                                       batch["mask"], num_prompt, t)
    logp = loss.token_logprobs(logits, batch["completions"], lmask)
    # Per-token GAE advantages through the shared clipped surrogate (token-level ratios).
    return loss.ppo_clip_loss(logp, batch["old_logp"], lmask, batch["advantages"],
                              clip_eps=clip_eps, ratio_level="token", aggregation=aggregation,
                              logits_btv=logits)

  def critic_fn(value_params):
    v = trainer.completion_logits(value_fns, value_params, batch["tokens"], batch["positions"],
                                  batch["mask"], num_prompt, t)
    return value_loss(v, batch["old_values"], batch["returns"], lmask, clip=value_clip)

  (pl, pm), grads = jax.value_and_grad(policy_fn, has_aux=True)(state.params)
  (vl, vm), vgrads = jax.value_and_grad(critic_fn, has_aux=True)(state.value_params)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  vupdates, value_opt_state = value_tx.update(vgrads, state.value_opt_state, state.value_params)
  state = state.replace(params=optax.apply_updates(state.params, updates), opt_state=opt_state,
                        value_params=optax.apply_updates(state.value_params, vupdates),
                        value_opt_state=value_opt_state)
  return state, dict(pm, **vm, loss=pl + vl, grad_norm=optax.global_norm(grads),
                     value_grad_norm=optax.global_norm(vgrads))


def build(config, workdir: str, task=None) -> PPOExperiment:
  config = with_defaults(config)
  validate(config)
  exp = trainer.build(config, workdir, task=task)
  c, p = config, config.ppo
  vcfg = exp.model_config.replace(head="scalar")
  vgraphdef, _ = transformer.abstract(vcfg)
  value_fns = transformer.model_fns(vgraphdef)
  steps = c.train.num_iterations * c.train.num_epochs * c.train.num_minibatches
  voptim = copy.deepcopy(c.optim)
  if p.value_learning_rate:
    voptim.learning_rate = p.value_learning_rate
  value_tx = trainer.make_optimizer(voptim, steps)
  num_prompt = c.data.max_prompt_len
  score_fn = jax.jit(functools.partial(
      score, fns=exp.fns, value_fns=value_fns, num_prompt=num_prompt, beta=float(c.kl.beta),
      kl_estimator=c.kl.estimator, gamma=float(p.gamma), lam=float(p.lam),
      whiten_advantages=bool(p.whiten_advantages)))
  step_fn = jax.jit(functools.partial(
      train_step, fns=exp.fns, value_fns=value_fns, tx=exp.tx, value_tx=value_tx,
      clip_eps=float(c.loss.clip_eps), value_clip=float(p.value_clip),
      aggregation=p.aggregation, num_prompt=num_prompt), donate_argnums=0)
  return PPOExperiment(exp, vcfg, vgraphdef, value_fns, value_tx, score_fn, step_fn)


def init_critic(pexp: PPOExperiment, policy_params, seed: int):
  if pexp.config.ppo.critic_init == "random":
    return transformer.create(pexp.value_config, seed=seed)[1]
  from rloo_jax.rewards import reward_model  # the RM's backbone copy: SFT weights, fresh head
  return reward_model.init_from_policy(pexp.exp.model_config, policy_params, seed=seed)[2]


def init_state(pexp: PPOExperiment, params, value_params=None) -> PPOState:
  c = pexp.config
  if value_params is None:
    value_params = init_critic(pexp, params, c.seed)
  return PPOState(step=jnp.zeros((), jnp.int32), params=params,
                  ref_params=jax.tree.map(jnp.copy, params), value_params=value_params,
                  opt_state=pexp.exp.tx.init(params),
                  value_opt_state=pexp.value_tx.init(value_params),
                  rng=jax.random.PRNGKey(c.seed))


def abstract_state(pexp: PPOExperiment) -> PPOState:
  _, params = transformer.abstract(pexp.exp.model_config)
  _, vparams = transformer.abstract(pexp.value_config)
  return jax.eval_shape(lambda p, v: init_state(pexp, p, v), params, vparams)


# ----------------------------------------------------------------------------------------------
# One iteration and the outer loop


def ppo_iteration(pexp: PPOExperiment, state: PPOState, batch: dict):
  """rollout -> rewards -> reference + critic -> GAE -> epochs x minibatches. (state, metrics)."""
  exp, c = pexp.exp, pexp.config
  k = c.rloo.k
  rng = jax.random.fold_in(state.rng, int(state.step))
  out, rewards_bk, usable_bk, num_nonfinite, _, timings = trainer.timed_rollout(
      exp, state.params, batch, rng, k=k)

  t0 = time.perf_counter()
  b = rewards_bk.shape[0]
  n = b * k
  completions_nt = out.tokens_bkt.reshape(n, -1)
  cmask_nt = out.mask_bkt.reshape(n, -1)
  old_logp_nt = out.policy_logprobs_bkt.reshape(n, -1)
  tokens, positions, mask = exp.sequences_fn(jnp.asarray(batch["prompt_tokens"]),
                                             jnp.asarray(batch["prompt_lengths"]),
                                             completions_nt, cmask_nt, k=k)
  s = pexp.score_fn(state.ref_params, state.value_params, tokens, positions, mask, completions_nt,
                    cmask_nt, old_logp_nt, jnp.asarray(rewards_bk.reshape(-1)),
                    jnp.asarray(usable_bk.reshape(-1)))
  jax.block_until_ready(s["advantages_nt"])
  timings["reference_s"] = time.perf_counter() - t0  # reference + critic forward + GAE

  t0 = time.perf_counter()
  rows = dict(tokens=tokens, positions=positions, mask=mask, completions=completions_nt,
              loss_mask=s["loss_mask_nt"], old_logp=old_logp_nt, advantages=s["advantages_nt"],
              returns=s["returns_nt"], old_values=s["values_nt"])
  state, step_metrics = trainer.minibatch_updates(exp, pexp.step_fn, state, rows, n, rng)
  jax.block_until_ready(state.params)
  timings["update_s"] = time.perf_counter() - t0
  state = state.replace(step=state.step + 1)

  m = {name: float(np.mean([float(x[name]) for x in step_metrics])) for name in step_metrics[0]}
  r = rewards_bk[usable_bk]
  lengths = np.asarray(out.lengths_bk)
  lm = np.asarray(s["loss_mask_nt"])
  values, returns = np.asarray(s["values_nt"])[lm], np.asarray(s["returns_nt"])[lm]
  m.update(
      reward_mean=float(r.mean()) if r.size else float("nan"),
      reward_std=float(r.std()) if r.size else float("nan"),
      kl=float(np.asarray(s["kl_n"]).mean()),
      penalised_reward=float(np.asarray(s["penalised_n"])[usable_bk.reshape(-1)].mean())
      if r.size else 0.0,
      value_mean=float(values.mean()) if values.size else 0.0,
      explained_variance=float(1.0 - np.var(returns - values) / max(np.var(returns), 1e-8))
      if values.size else 0.0,
      completion_length=float(lengths.mean()), num_unscorable=float((~usable_bk).sum()),
      num_nonfinite=float(num_nonfinite),
      rollout_tokens_per_s=int(lengths.sum()) / max(timings["rollout_s"], 1e-9), **timings)
  m["iteration_s"] = sum(timings.values())
  return state, m


def run(config, workdir: str, *, log=print) -> dict:
  """Trains PPO (resuming from `workdir`) and returns the summary, as `trainer.run` does."""
  workdir = os.path.abspath(workdir)
  os.makedirs(workdir, exist_ok=True)
  pexp = build(config, workdir)
  exp, c = pexp.exp, pexp.config
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=c.train.keep_checkpoints)
  data = pipeline.prompt_batches(exp.task.train, exp.tokenizer, global_batch_size=c.rloo.num_prompts,
                                 max_prompt_len=c.data.max_prompt_len, seed=c.seed,
                                 overlong=c.data.overlong)
  restored = ckpt.restore(abstract_state(pexp)) if ckpt.latest_step() is not None else None
  eval_rng = jax.random.PRNGKey(c.seed + 1)
  evaluate = functools.partial(trainer.evaluate, exp, source=exp.task.test, rng=eval_rng,
                               num_prompts=c.train.eval_prompts,
                               batch_size=c.train.eval_batch_size)
  if restored is not None:
    _, state, meta = restored
    data.set_state(meta["data"])
    before = meta.get("before")
  else:
    state = init_state(pexp, trainer.initial_params(exp, log=log))
    before = evaluate(state.params, ref_params=state.ref_params)
    log(f"[eval] SFT policy: {json.dumps(before)}")
  writer = MetricWriter(workdir)
  if restored is None:
    writer.write(0, before, prefix="eval/")
  for it in range(int(state.step), c.train.num_iterations):
    state, m = ppo_iteration(pexp, state, next(data))
    step = it + 1
    if step % c.train.log_every == 0 or step == c.train.num_iterations:
      writer.write(step, m, prefix="train/")
    if step % max(c.train.log_every, 10) == 0:
      log(f"[ppo] iteration {step}: reward {m['reward_mean']:.3f} kl {m['kl']:.3f} "
          f"clip {m['clip_fraction']:.3f} ev {m['explained_variance']:.2f} "
          f"({m['iteration_s']:.2f}s)")
    if c.train.eval_every and step % c.train.eval_every == 0 and step != c.train.num_iterations:
      writer.write(step, evaluate(state.params, ref_params=state.ref_params), prefix="eval/")
    if step % c.train.checkpoint_every == 0 or step == c.train.num_iterations:
      ckpt.save(step, state, {"data": data.get_state(), "before": before}, force=True)
  ckpt.close()
  after = evaluate(state.params, ref_params=state.ref_params)
  writer.write(int(state.step), after, prefix="eval/")
  writer.close()
  summary = {"algorithm": "ppo", "before": before, "after": after,
             "iterations": int(state.step), "seed": c.seed,
             "eval_prompts": min(c.train.eval_prompts, len(exp.task.test))}
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  log(trainer.format_summary(summary).replace("RLOO", "PPO "))
  return dict(summary, state=state)

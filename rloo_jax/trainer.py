"""The RLOO trainer: rollout -> rewards -> reference log-probs -> penalised rewards -> advantages
-> `num_epochs` x minibatches of one jitted, donated `train_step(state, batch) -> (state, metrics)`.

Everything between the data iterator and the metric writer is a pure function of arrays; the outer
loop (`run`) owns the side effects: data, checkpoints, logging, the progress bar.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from typing import Any, Callable, Optional, Sequence

from absl import logging
from flax import struct
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from rloo_jax import advantage, loss, sampler, sampling
from rloo_jax import sharding as sharding_lib
from rloo_jax.checkpoint import Checkpointer
from rloo_jax.data import pipeline
from rloo_jax.metrics import MetricWriter, win_rate_stats
from rloo_jax.models import transformer
from rloo_jax import rewards as rewards_lib

LOSS_TYPES = ("reinforce", "ppo_clip")


# ----------------------------------------------------------------------------------------------
# State and optimizer


@struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: RL iterations completed
  params: Any  # policy, an nnx.State
  ref_params: Any  # frozen reference (the SFT policy), an nnx.State
  opt_state: Any
  rng: jax.Array  # base key; iteration i uses fold_in(rng, i), so resuming replays exactly
  adv_state: Any  # the advantage estimator's state (a scalar placeholder when stateless)


def make_optimizer(c: ml_collections.ConfigDict, total_steps: int) -> optax.GradientTransformation:
  """AdamW with linear warm-up then constant or cosine decay, after global-norm clipping."""
  warmup = max(int(c.warmup_steps), 0)
  if c.schedule == "constant":
    after = optax.constant_schedule(c.learning_rate)
  elif c.schedule == "cosine":
    after = optax.cosine_decay_schedule(c.learning_rate, max(total_steps - warmup, 1))
  else:
    raise ValueError(f"unknown schedule {c.schedule!r}; choose 'constant' or 'cosine' "
                     "(config.optim.schedule)")
  schedule = optax.join_schedules(
      [optax.linear_schedule(0.0, c.learning_rate, max(warmup, 1)), after], [warmup]) \
      if warmup else after
  return optax.chain(
      optax.clip_by_global_norm(c.max_grad_norm) if c.max_grad_norm > 0 else optax.identity(),
      optax.adamw(schedule, b1=c.b1, b2=c.b2, weight_decay=c.weight_decay))


# ----------------------------------------------------------------------------------------------
# Pure pieces of one iteration


def _left_padded_prompts(prompt_tokens_bp, prompt_lengths_b):
  """Prompts moved to the right end of their P columns: (tokens, positions, mask), all [B, P]."""
  b, p = prompt_tokens_bp.shape
  shift_b = p - prompt_lengths_b
  idx_bp = sampler.left_pad_index(prompt_lengths_b, p)
  left_bp = jnp.take_along_axis(prompt_tokens_bp, idx_bp, axis=1)
  pmask_bp = jnp.arange(p)[None, :] >= shift_b[:, None]
  ppos_bp = jnp.maximum(jnp.arange(p)[None, :] - shift_b[:, None], 0)
  return left_bp.astype(jnp.int32), ppos_bp.astype(jnp.int32), pmask_bp


def _completion_positions(prompt_lengths_b, k: int, t: int):
  """Positions [B*k, T] of the completions' tokens: each continues its prompt's true length."""
  return (jnp.repeat(prompt_lengths_b, k, axis=0)[:, None] + jnp.arange(t)[None, :]).astype(
      jnp.int32)


def rollout_sequences(prompt_tokens_bp, prompt_lengths_b, completions_nt, cmask_nt, k: int):
  """Rows of [left-padded prompt | completion] for the B*k samples, n = b * k + j.

  Left-padding the prompt puts every completion at the same offset P, so the logits that
  predict completion token t are always at P - 1 + t; RoPE sees the true positions.
  Returns tokens_ns, positions_ns, mask_ns (S = P + T).
  """
  left_bp, ppos_bp, pmask_bp = _left_padded_prompts(prompt_tokens_bp, prompt_lengths_b)
  rep = lambda x: jnp.repeat(x, k, axis=0)
  cpos_nt = _completion_positions(prompt_lengths_b, k, completions_nt.shape[1])
  tokens = jnp.concatenate([rep(left_bp), completions_nt], axis=1)
  positions = jnp.concatenate([rep(ppos_bp), cpos_nt], axis=1)
  mask = jnp.concatenate([rep(pmask_bp), cmask_nt], axis=1)
  return tokens.astype(jnp.int32), positions.astype(jnp.int32), mask


def model_inputs(prompt_tokens_bp, prompt_lengths_b, completions_nt, cmask_nt, k: int,
                 shared_prefix: bool) -> dict:
  """What the reference and policy forwards of one rollout read, besides completions / cmask.

  shared_prefix: each prompt once ([B, P] left-padded prompt tokens, positions and mask) plus
  the completions' positions [B*k, T], for `fns.grouped`; otherwise the B*k rows of
  `rollout_sequences` (tokens / positions / mask [B*k, P + T]) for `fns.forward`.
  """
  if not shared_prefix:
    tokens, positions, mask = rollout_sequences(prompt_tokens_bp, prompt_lengths_b,
                                                completions_nt, cmask_nt, k)
    return dict(tokens=tokens, positions=positions, mask=mask)
  left_bp, ppos_bp, pmask_bp = _left_padded_prompts(prompt_tokens_bp, prompt_lengths_b)
  return dict(prompt_tokens=left_bp, prompt_positions=ppos_bp, prompt_mask=pmask_bp,
              completion_positions=_completion_positions(prompt_lengths_b, k,
                                                         completions_nt.shape[1]))


def completion_logits(fns, params, tokens_ns, positions_ns, mask_ns, num_prompt: int, t: int):
  """Logits predicting the T completion tokens: positions P - 1 .. P + T - 2 only.

  The last column is not fed: its hidden state predicts nothing scored, and under the causal
  mask no earlier position sees it."""
  s = tokens_ns.shape[1] - 1
  return fns.forward(params, tokens_ns[:, :s], positions_ns[:, :s], mask_ns[:, :s],
                     head_slice=(num_prompt - 1, t))


def rows_logits(fns, params, rows: dict, num_prompt: int, saved=None):
  """Logits [N, T, V] predicting rows['completions'] from either form of `model_inputs`;
  `saved` (shared-prefix form only): the rollout's recorded activations
  (`SampleOutput.activations`)."""
  if "prompt_tokens" in rows:
    return fns.grouped(params, rows["prompt_tokens"], rows["prompt_positions"],
                       rows["prompt_mask"], rows["completions"], rows["completion_positions"],
                       rows["cmask"], **({} if saved is None else {"saved": saved}))
  if saved is not None:
    raise ValueError("replayed activations need the shared-prefix rows "
                     "(config.train.shared_prefix=True)")
  return completion_logits(fns, params, rows["tokens"], rows["positions"], rows["mask"],
                           num_prompt, rows["completions"].shape[1])


@dataclasses.dataclass(frozen=True)
class LossSpec:
  """The static (hashable) part of the policy loss, resolved from config once."""
  type: str = "reinforce"
  clip_eps: float = 0.2
  clip_eps_high: Optional[float] = None
  ratio_level: str = "sequence"
  aggregation: str = "sequence_sum"

  @classmethod
  def from_config(cls, c):
    return cls(c.type, c.clip_eps, c.clip_eps_high or None, c.ratio_level, c.aggregation)


def policy_loss(spec: LossSpec, logp_nt, old_logp_nt, cmask_nt, adv_n, logits_ntv):
  t = cmask_nt.shape[1]
  if spec.type == "reinforce":
    return loss.reinforce_loss(logp_nt, cmask_nt, adv_n, aggregation=spec.aggregation,
                               max_len=t, logits_btv=logits_ntv)
  return loss.ppo_clip_loss(logp_nt, old_logp_nt, cmask_nt, adv_n, clip_eps=spec.clip_eps,
                            clip_eps_high=spec.clip_eps_high, ratio_level=spec.ratio_level,
                            aggregation=spec.aggregation, max_len=t, logits_btv=logits_ntv)


def train_step(state: TrainState, batch: dict, saved=None, *, fns, tx, spec: LossSpec,
               num_prompt: int, compute_shardings=None, param_shardings=None):
  """One gradient step on a minibatch of rollout rows. Pure; jitted with the state donated.

  saved: the rollout's trunk matmul outputs for these rows (`SampleOutput.activations`), valid only
  while state.params are the params that sampled them: the forward then replays them and only
  the backward's matmuls run. Same gradient up to float rounding.
  FSDP: params are gathered into `compute_shardings` for the forward/backward and the gradients
  reduce-scattered back onto `param_shardings` (both None without fsdp).
  """
  def loss_fn(params):
    params = _constrain(params, compute_shardings)
    logits = rows_logits(fns, params, batch, num_prompt, saved)
    logp = loss.token_logprobs(logits, batch["completions"], batch["cmask"])
    return policy_loss(spec, logp, batch["old_logp"], batch["cmask"], batch["advantages"], logits)

  (value, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  grads = _constrain(grads, param_shardings)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = dict(metrics, loss=value, grad_norm=optax.global_norm(grads))
  return state.replace(params=params, opt_state=opt_state), metrics


def score_rollout(ref_params, adv_state, inputs, completions_nt, cmask_nt, policy_logp_nt,
                  rewards_bk, usable_bk, *, fns, num_prompt: int, beta: float,
                  kl_estimator: str, kl_reduction: str, estimator: str, options: tuple,
                  compute_shardings=None):
  """Reference log-probs, KL, penalised rewards R = r - beta * KL and advantages, all [B, k].

  `inputs`: either form of `model_inputs`."""
  b, k = rewards_bk.shape
  ref_params = _constrain(ref_params, compute_shardings)
  ref_logits = rows_logits(fns, ref_params, dict(inputs, completions=completions_nt,
                                                 cmask=cmask_nt), num_prompt)
  ref_logp = loss.token_logprobs(ref_logits, completions_nt, cmask_nt)
  penalised, kl = loss.penalized_reward(rewards_bk.reshape(-1), policy_logp_nt, ref_logp,
                                        cmask_nt, beta=beta, estimator=kl_estimator,
                                        reduction=kl_reduction)
  adv, new_adv_state = advantage.call(estimator, penalised.reshape(b, k), usable_bk,
                                      state=adv_state, **dict(options))
  return dict(kl_bk=kl.reshape(b, k), penalised_bk=penalised.reshape(b, k), advantages_bk=adv,
              ref_logp_nt=ref_logp), new_adv_state


def _constrain(tree, shardings):
  return tree if shardings is None else jax.lax.with_sharding_constraint(tree, shardings)


# ----------------------------------------------------------------------------------------------
# Rewards (host side: reward functions are arbitrary Python)


def _reward_name(spec) -> str:
  """A short metric name: 'pkg.mod:fn' -> 'fn', 'reward_model:/runs/rm' -> 'reward_model'."""
  if not isinstance(spec, str):
    return getattr(spec, "__name__", "fn")
  if spec.startswith("reward_model:"):
    return "reward_model"
  return spec.rsplit(":", 1)[-1]


@dataclasses.dataclass
class RewardSet:
  fns: Sequence[Callable[..., Any]]
  weights: Sequence[float]
  names: Sequence[str]

  @classmethod
  def from_config(cls, c):
    if len(c.fns) != len(c.weights):
      raise ValueError(f"config.rewards.fns has {len(c.fns)} entries but config.rewards.weights "
                       f"has {len(c.weights)}; give one weight per reward function")
    if not c.fns:
      raise ValueError("config.rewards.fns is empty: name at least one reward function "
                       "('package.module:function')")
    return cls([rewards_lib.resolve(f) for f in c.fns],
               [float(w) for w in c.weights],
               [_reward_name(f) for f in c.fns])

  def __call__(self, prompts, completions, fields):
    """Weighted sum [N] and per-function scores; NaN (unscorable) in any function -> NaN."""
    total = np.zeros(len(completions), np.float64)
    parts = {}
    for fn, w, name in zip(self.fns, self.weights, self.names):
      r = fn(list(prompts), list(completions), **fields)
      r = np.array([np.nan if x is None else x for x in r], np.float64)
      if r.shape != (len(completions),):
        raise ValueError(f"reward function {name} returned shape {r.shape}; expected "
                         f"({len(completions)},): one score per completion")
      parts[name] = r
      total = total + w * r
    return total, parts


# ----------------------------------------------------------------------------------------------
# Validation: every check that can fail runs before anything compiles.


def validate_config(config) -> None:
  r = config.rloo
  est = advantage.spec(config.advantage.estimator)  # raises naming the registry
  if r.k < est.min_k:
    raise ValueError(f"config.rloo.k = {r.k}, but estimator {est.name!r} needs k >= {est.min_k} "
                     f"(a leave-one-out baseline needs another sample); set config.rloo.k >= "
                     f"{est.min_k}")
  if r.k < 1 or r.num_prompts < 1 or r.max_new_tokens < 1:
    raise ValueError("config.rloo.k, num_prompts and max_new_tokens must be >= 1")
  if config.loss.type not in LOSS_TYPES:
    raise ValueError(f"unknown config.loss.type {config.loss.type!r}; choose one of {LOSS_TYPES}")
  if config.loss.aggregation not in loss.AGGREGATIONS:
    raise ValueError(f"unknown config.loss.aggregation {config.loss.aggregation!r}; choose one "
                     f"of {loss.AGGREGATIONS}")
  if config.loss.ratio_level not in ("sequence", "token"):
    raise ValueError(f"config.loss.ratio_level must be 'sequence' or 'token', got "
                     f"{config.loss.ratio_level!r}")
  if config.kl.estimator not in loss.KL_ESTIMATORS:
    raise ValueError(f"unknown config.kl.estimator {config.kl.estimator!r}; choose one of "
                     f"{loss.KL_ESTIMATORS}")
  if config.kl.reduction not in ("sum", "mean"):
    raise ValueError(f"config.kl.reduction must be 'sum' or 'mean', got {config.kl.reduction!r}")
  n = r.num_prompts * r.k
  if n % config.train.num_minibatches:
    raise ValueError(f"the rollout batch (config.rloo.num_prompts * config.rloo.k = {n}) is not "
                     f"divisible by config.train.num_minibatches = {config.train.num_minibatches}; "
                     f"choose num_minibatches dividing {n}")
  if config.train.shared_prefix and r.num_prompts % config.train.num_minibatches:
    raise ValueError(f"config.train.shared_prefix minibatches whole groups, but "
                     f"config.rloo.num_prompts = {r.num_prompts} is not divisible by "
                     f"config.train.num_minibatches = {config.train.num_minibatches}; choose "
                     f"num_minibatches dividing {r.num_prompts}, or set "
                     f"config.train.shared_prefix=False to minibatch single samples")
  if config.train.reuse_rollout_activations and not (config.train.shared_prefix
                                                     and r.sampler_mode == "shared"):
    raise ValueError(f"config.train.reuse_rollout_activations replays the rollout's prefill and "
                     f"decode matmuls in the shared-prefix update, so it needs "
                     f"config.train.shared_prefix=True and config.rloo.sampler_mode='shared' "
                     f"(got {bool(config.train.shared_prefix)} and {r.sampler_mode!r}); set those "
                     f"or config.train.reuse_rollout_activations=False")
  if config.train.num_epochs < 1 or config.train.num_iterations < 0:
    raise ValueError("config.train.num_epochs must be >= 1 and num_iterations >= 0")
  need = config.data.max_prompt_len + r.max_new_tokens
  if need > config.model.max_seq_len:
    raise ValueError(f"config.data.max_prompt_len ({config.data.max_prompt_len}) + "
                     f"config.rloo.max_new_tokens ({r.max_new_tokens}) = {need} exceeds the "
                     f"model context config.model.max_seq_len = {config.model.max_seq_len}; "
                     f"shorten one or raise the context")
  if config.rewards.nan_policy not in ("raise", "mask"):
    raise ValueError(f"config.rewards.nan_policy must be 'raise' or 'mask', got "
                     f"{config.rewards.nan_policy!r}")
  sampling_method(r)  # raises on bad temperature / top_k / top_p
  if config.model.init_from and not os.path.isdir(config.model.init_from):
    raise FileNotFoundError(f"config.model.init_from={config.model.init_from!r} is not a "
                            "directory; point it at a local Hugging Face checkpoint "
                            "(config.json + model.safetensors)")


def sampling_method(r) -> sampling.Method:
  if r.top_k and r.top_p < 1.0:
    raise ValueError("set at most one of config.rloo.top_k and config.rloo.top_p")
  if r.top_k:
    return sampling.TopK(int(r.top_k), float(r.temperature))
  if r.top_p < 1.0:
    return sampling.TopP(float(r.top_p), float(r.temperature))
  if r.temperature == 0:
    return sampling.Greedy()
  return sampling.Temperature(float(r.temperature))


# ----------------------------------------------------------------------------------------------
# Set-up


def model_config(config, vocab_size: int) -> transformer.TransformerConfig:
  m = config.model
  maker = {"llama": transformer.TransformerConfig.llama, "qwen2": transformer.TransformerConfig.qwen2,
           "gpt2": transformer.TransformerConfig.gpt2}
  if m.family not in maker:
    raise ValueError(f"unknown config.model.family {m.family!r}; choose one of {sorted(maker)}")
  return maker[m.family](
      vocab_size=vocab_size, hidden_size=m.hidden_size, num_layers=m.num_layers,
      num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
      intermediate_size=m.intermediate_size, max_seq_len=m.max_seq_len, dtype=m.dtype,
      param_dtype=m.param_dtype)


@dataclasses.dataclass
class Experiment:
  """The static pieces of a run, resolved from the config once."""
  config: ml_collections.ConfigDict
  workdir: str
  task: Any
  model_config: transformer.TransformerConfig
  graphdef: Any
  fns: transformer.ModelFns
  tx: optax.GradientTransformation
  loss_spec: LossSpec
  rewards: RewardSet
  method: sampling.Method
  step_fn: Callable
  score_fn: Callable
  sequences_fn: Callable
  # The mesh and rules (a 1-device mesh for a 1-device run: one code path), the train state's
  # shardings, and the jitted minibatch gather.
  layout: sharding_lib.Layout = None
  state_shardings: Any = None
  rows_fn: Callable = None
  inputs_fn: Callable = None  # model_inputs for this config's train.shared_prefix
  groups_fn: Callable = None  # whole-group minibatch gather (shared-prefix rows)
  compute_shardings: Any = None  # params gathered over fsdp (None without fsdp)
  # config.train.reuse_rollout_activations: the first update step replays the rollout's matmuls.
  replay_step_fn: Callable = None  # train_step(state, rows, saved)
  saved_groups_fn: Callable = None  # the recording's rows of whole groups, jitted
  # Device buffers reused from one iteration to the next (never part of the results): the last
  # rollout's recorded activations, donated to the next rollout to be written over.
  workspace: dict = dataclasses.field(default_factory=dict)

  @property
  def tokenizer(self):
    return self.task.tokenizer


def validate_layout(config, layout: sharding_lib.Layout) -> None:
  """Every batch the run shards must split evenly over the batch axes (and the processes)."""
  r, t = config.rloo, config.train
  check = sharding_lib.check_batch
  check("config.rloo.num_prompts", r.num_prompts, layout)
  check("the rollout batch (config.rloo.num_prompts * config.rloo.k)", r.num_prompts * r.k, layout)
  if (r.num_prompts * r.k) % t.num_minibatches == 0:
    check("the minibatch (num_prompts * k / config.train.num_minibatches)",
          r.num_prompts * r.k // t.num_minibatches, layout)
  if t.shared_prefix and r.num_prompts % t.num_minibatches == 0:
    check("the minibatch's prompts (config.rloo.num_prompts / config.train.num_minibatches, "
          "whole groups with config.train.shared_prefix)", r.num_prompts // t.num_minibatches,
          layout)
  check("config.train.eval_batch_size", t.eval_batch_size, layout)
  if not config.model.init_from:
    check("config.sft.batch_size", config.sft.batch_size, layout)


def build(config, workdir: str, task=None, *, devices=None) -> Experiment:
  """Validates the config and the mesh, prepares the task and compiles nothing yet.

  `devices` (default: all of jax.devices()) are the devices the config.mesh is laid over.
  """
  from rloo_jax import tasks  # tasks import data builders; keep `import trainer` light
  validate_config(config)
  layout = sharding_lib.make_layout(config.mesh, devices)
  validate_layout(config, layout)
  rewards = RewardSet.from_config(config.rewards)
  if task is None:
    task = _make_task(tasks, config, os.path.join(workdir, "data"))
  if config.model.init_from:
    from rloo_jax.models import hf
    mcfg, graphdef, _ = hf.load_model(config.model.init_from, dtype=config.model.dtype)
  else:
    mcfg = model_config(config, task.tokenizer.vocab_size)
    graphdef, _ = transformer.abstract(mcfg)
  if config.data.max_prompt_len + config.rloo.max_new_tokens > mcfg.max_seq_len:
    raise ValueError(f"config.data.max_prompt_len + config.rloo.max_new_tokens = "
                     f"{config.data.max_prompt_len + config.rloo.max_new_tokens} exceeds the "
                     f"model's context of {mcfg.max_seq_len} tokens")
  fns = transformer.model_fns(graphdef)
  r = config.rloo
  updates_per_iteration = config.train.num_epochs * config.train.num_minibatches
  tx = make_optimizer(config.optim, config.train.num_iterations * updates_per_iteration)
  spec = LossSpec.from_config(config.loss)
  p = config.data.max_prompt_len
  exp = Experiment(config, workdir, task, mcfg, graphdef, fns, tx, spec, rewards,
                   sampling_method(r), None, None, None, layout=layout)
  # Explicit shardings: params / reference / optimizer moments by the logical rules, scalars
  # replicated, every rollout row array split over the batch axes.
  abstract = _abstract_state(exp)
  state_sh = exp.state_shardings = layout.tree_shardings(abstract)
  rows, rep = layout.batch_sharding, layout.replicated
  compute_sh = exp.compute_shardings = layout.compute_shardings(abstract.params)
  step = functools.partial(train_step, fns=fns, tx=tx, spec=spec, num_prompt=p,
                           compute_shardings=compute_sh,
                           param_shardings=compute_sh and state_sh.params)
  exp.step_fn = jax.jit(step, in_shardings=(state_sh, rows), out_shardings=(state_sh, rep),
                        donate_argnums=0)
  exp.score_fn = jax.jit(functools.partial(
      score_rollout, fns=fns, num_prompt=p, beta=float(config.kl.beta),
      kl_estimator=config.kl.estimator, kl_reduction=config.kl.reduction,
      estimator=config.advantage.estimator,
      options=tuple(sorted(dict(config.advantage.options).items())),
      compute_shardings=compute_sh),
      in_shardings=(state_sh.ref_params, state_sh.adv_state) + (rows,) * 6,
      out_shardings=(rows, state_sh.adv_state))
  sequences = jax.jit(rollout_sequences, static_argnums=4, in_shardings=(rows,) * 4,
                      out_shardings=rows)
  # jit takes no keyword arguments once in_shardings is given; keep the `k=` call style.
  exp.sequences_fn = lambda tokens_bp, lengths_b, completions_nt, cmask_nt, k: sequences(
      tokens_bp, lengths_b, completions_nt, cmask_nt, k)
  inputs = jax.jit(model_inputs, static_argnums=(4, 5), in_shardings=(rows,) * 4,
                   out_shardings=rows)
  exp.inputs_fn = lambda tokens_bp, lengths_b, completions_nt, cmask_nt, k: inputs(
      tokens_bp, lengths_b, completions_nt, cmask_nt, k, bool(config.train.shared_prefix))
  exp.rows_fn = jax.jit(_take_rows, out_shardings=rows)
  exp.groups_fn = jax.jit(_take_groups, static_argnums=2, out_shardings=rows)
  if config.train.reuse_rollout_activations:
    # No in_shardings: the recorded activations keep the layout the sampler's matmuls gave them
    # (rows over the batch axes, and e.g. the MLP width over 'tensor' under tensor parallelism);
    # forcing one spec on them would all-gather every recording. The state and the rows arrive
    # committed to state_sh and the batch sharding, as step_fn requires of them.
    exp.replay_step_fn = jax.jit(step, out_shardings=(state_sh, rep), donate_argnums=0)
    exp.saved_groups_fn = jax.jit(
        lambda saved, group_idx: jax.tree.map(lambda y_bsf: y_bsf[group_idx], saved))
  return exp


def _make_task(tasks, config, data_dir: str):
  """Multi-process: process 0 prepares the data files first; the rest then only read them."""
  if jax.process_count() == 1:
    return tasks.make(config, data_dir)
  from jax.experimental import multihost_utils
  task = tasks.make(config, data_dir) if jax.process_index() == 0 else None
  multihost_utils.sync_global_devices("rloo_task_prepared")
  return task if task is not None else tasks.make(config, data_dir)


def _take_rows(rows: dict, idx):
  return jax.tree.map(lambda x: x[idx], rows)


_PROMPT_KEYS = ("prompt_tokens", "prompt_positions", "prompt_mask")


def _take_groups(rows: dict, group_idx, k: int):
  """Whole groups: prompt arrays at group_idx, sample rows at group_idx * k + 0..k-1."""
  sample_idx = (group_idx[:, None] * k + jnp.arange(k)[None, :]).reshape(-1)
  return {name: x[group_idx] if name in _PROMPT_KEYS else x[sample_idx]
          for name, x in rows.items()}


def initial_params(exp: Experiment, *, log=print):
  """The starting policy: a local HF checkpoint, or the task's SFT stage from scratch."""
  config = exp.config
  if config.model.init_from:
    from rloo_jax.models import hf
    _, params = hf.load_checkpoint(config.model.init_from, dtype=config.model.dtype)
    return params
  from rloo_jax import sft
  params = create_params(exp, seed=config.seed)
  return sft.train(config, exp.workdir, exp.fns, params, exp.task, log=log,
                   shard_batch=exp.layout.shard_batch)


def create_params(exp: Experiment, seed: int = 0):
  """A freshly initialised policy, created directly sharded (never whole on one device)."""
  from flax import nnx
  mcfg = exp.model_config
  return jax.jit(lambda: nnx.split(transformer.Transformer(mcfg, rngs=nnx.Rngs(seed)))[1],
                 out_shardings=exp.state_shardings.params)()


def _init_state(exp: Experiment, params) -> TrainState:
  spec = advantage.spec(exp.config.advantage.estimator)
  adv_state = spec.init_state() if spec.stateful else jnp.zeros((), jnp.float32)
  # A real copy: policy and reference must not share buffers, since the policy is donated.
  ref_params = jax.tree.map(jnp.copy, params)
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, ref_params=ref_params,
                    opt_state=exp.tx.init(params), rng=jax.random.PRNGKey(exp.config.seed),
                    adv_state=adv_state)


def init_state(exp: Experiment, params) -> TrainState:
  """The train state on the mesh: jit(init, out_shardings=...), so the optimizer moments and
  the reference are created sharded. `params` may be host values or arrays on any layout."""
  params = exp.layout.put(params, exp.state_shardings.params)
  return jax.jit(functools.partial(_init_state, exp), out_shardings=exp.state_shardings)(params)


def _abstract_state(exp: Experiment) -> TrainState:
  _, params = transformer.abstract(exp.model_config)
  return jax.eval_shape(lambda p: _init_state(exp, p), params)


def abstract_state(exp: Experiment) -> TrainState:
  """ShapeDtypeStructs with this experiment's shardings: the Orbax restore target, so a
  checkpoint written on any mesh restores onto this one."""
  return exp.layout.abstract(_abstract_state(exp), exp.state_shardings)


# ----------------------------------------------------------------------------------------------
# One iteration


def decode_completions(tokenizer, tokens_nt, lengths_n) -> list[str]:
  eos = tokenizer.eos_id
  out = []
  for row, n in zip(np.asarray(tokens_nt), np.asarray(lengths_n)):
    ids = [int(t) for t in row[:n] if int(t) != eos]
    out.append(tokenizer.decode(ids))
  return out


def rollout(exp: Experiment, params, batch: dict, rng, *, k: int, method=None,
            record_activations: bool = False, activations_buffer=None):
  """Samples k completions per prompt and scores them with the reward functions (host side).
  record_activations: the sample output also carries the trunk's matmul outputs (`sampler`),
  written over `activations_buffer` (a previous rollout's, donated) when given."""
  c = exp.config
  layout = exp.layout
  if exp.compute_shardings is not None:
    # FSDP: gather the policy over fsdp once for the whole decode loop (freed after sampling),
    # rather than once per generated token.
    params = jax.device_put(params, exp.compute_shardings)
  # `batch` holds this process's rows; the sampler sees the global batch, split over the mesh.
  out = sampler.sample(exp.fns, params, layout.shard_batch(batch["prompt_tokens"]),
                       layout.shard_batch(batch["prompt_lengths"]), rng,
                       k=k, max_new_tokens=c.rloo.max_new_tokens,
                       method=method or exp.method, eos_id=exp.tokenizer.eos_id,
                       pad_id=exp.tokenizer.pad_id, mode=c.rloo.sampler_mode,
                       max_seq_len=exp.model_config.max_seq_len,
                       batch_sharding=layout.batch_sharding,
                       record_activations=record_activations,
                       activations_buffer=activations_buffer)
  b = batch["prompt_tokens"].shape[0]
  tokens_nt = layout.local_rows(out.tokens_bkt).reshape(b * k, -1)
  lengths_n = layout.local_rows(out.lengths_bk).reshape(-1)
  completions = decode_completions(exp.tokenizer, tokens_nt, lengths_n)
  fields = {name: np.repeat(np.asarray(v), k, axis=0) for name, v in batch.items()
            if name not in ("prompt_tokens", "prompt_lengths", "prompt", "index", "valid")}
  prompts = list(np.repeat(np.asarray(batch["prompt"], object), k))
  # Each process scores its own rows; the rewards (and parts) returned are the global batch's.
  rewards_n, parts = exp.rewards(prompts, completions, fields)
  parts = {name: layout.gather_rows(v) for name, v in parts.items()}
  return out, layout.gather_rows(rewards_n.reshape(b, k)), completions, parts


def minibatch_updates(exp: Experiment, step_fn, state, rows: dict, n: int, rng, saved=None):
  """`num_epochs` shuffled passes over the n rollout rows in `num_minibatches` minibatches.

  Epoch e's order comes from fold_in(rng, 1 + e), so a resumed run replays it exactly. Returns
  (state, [metrics of each step]). Shared by RLOO and the PPO baseline.

  Rows in the shared-prefix form (`model_inputs`) are shuffled as whole groups (a prompt and its
  k samples stay together, so the prompt is still computed once); with one minibatch they are
  used as they are, since the order of rows in a single step changes nothing but float rounding.

  saved: the rollout's recorded activations (`SampleOutput.activations`). The first step
  is the only one taken at the params that sampled the rollout, so it alone replays them
  (`exp.replay_step_fn`); every later step runs its own forward.
  """
  c = exp.config.train
  step_metrics = []
  grouped = "prompt_tokens" in rows
  units = rows["prompt_tokens"].shape[0] if grouped else n  # what is shuffled: groups or rows
  mb = units // c.num_minibatches
  take = ((lambda idx: exp.groups_fn(rows, idx, n // units)) if grouped
          else (lambda idx: exp.rows_fn(rows, idx)))

  def step(state, batch, saved_batch):
    if saved_batch is None:
      return step_fn(state, batch)
    return exp.replay_step_fn(state, batch, saved_batch)

  for epoch in range(c.num_epochs):
    if grouped and c.num_minibatches == 1:
      state, m = step(state, rows, saved if epoch == 0 else None)
      step_metrics.append(m)
      continue
    order = jax.random.permutation(jax.random.fold_in(rng, 1 + epoch), units)
    for i in range(c.num_minibatches):
      idx = order[i * mb:(i + 1) * mb]
      first = epoch == 0 and i == 0 and saved is not None
      state, m = step(state, take(idx), exp.saved_groups_fn(saved, idx) if first else None)
      step_metrics.append(m)
  return state, step_metrics


def timed_rollout(exp: Experiment, params, batch: dict, rng, *, k: int,
                  record_activations: bool = False, activations_buffer=None):
  """The rollout and its validated rewards, timed: the first half of every on-policy iteration.

  Returns (sample output, rewards [B, k] float32, usable mask, number masked as non-finite,
  per-function scores, {'rollout_s', 'reward_s'}).
  """
  t0 = time.perf_counter()
  out, raw_rewards_bk, _, parts = rollout(exp, params, batch, jax.random.fold_in(rng, 0), k=k,
                                          record_activations=record_activations,
                                          activations_buffer=activations_buffer)
  jax.block_until_ready(out.tokens_bkt)
  timings = {"rollout_s": time.perf_counter() - t0}
  t0 = time.perf_counter()
  rewards_bk, usable_bk, num_nonfinite = advantage.prepare_rewards(
      raw_rewards_bk, nan_policy=exp.config.rewards.nan_policy)
  timings["reward_s"] = time.perf_counter() - t0
  return out, rewards_bk, usable_bk, num_nonfinite, parts, timings


def rl_iteration(exp: Experiment, state: TrainState, batch: dict):
  """rollout -> rewards -> reference -> advantages -> epochs x minibatches. Returns (state, metrics)."""
  c = exp.config
  k = c.rloo.k
  step = int(state.step)
  rng = jax.random.fold_in(state.rng, step)
  reuse = bool(c.train.reuse_rollout_activations)
  out, rewards_bk, usable_bk, num_nonfinite, parts, timings = timed_rollout(
      exp, state.params, batch, rng, k=k, record_activations=reuse,
      activations_buffer=exp.workspace.pop("activations", None) if reuse else None)

  t0 = time.perf_counter()
  layout = exp.layout
  b = rewards_bk.shape[0]  # the global batch
  completions_nt = layout.reshard_batch(out.tokens_bkt.reshape(b * k, -1))
  cmask_nt = layout.reshard_batch(out.mask_bkt.reshape(b * k, -1))
  policy_logp_nt = layout.reshard_batch(out.policy_logprobs_bkt.reshape(b * k, -1))
  inputs = exp.inputs_fn(layout.shard_batch(batch["prompt_tokens"]),
                         layout.shard_batch(batch["prompt_lengths"]), completions_nt, cmask_nt,
                         k=k)
  scored, adv_state = exp.score_fn(state.ref_params, state.adv_state, inputs,
                                   completions_nt, cmask_nt, policy_logp_nt,
                                   layout.put_global_batch(rewards_bk.astype(np.float32)),
                                   layout.put_global_batch(usable_bk))
  jax.block_until_ready(scored["advantages_bk"])
  timings["reference_s"] = time.perf_counter() - t0
  state = state.replace(adv_state=adv_state)

  t0 = time.perf_counter()
  rows = dict(inputs, completions=completions_nt, cmask=cmask_nt, old_logp=policy_logp_nt,
              advantages=scored["advantages_bk"].reshape(-1))
  n = b * k
  state, step_metrics = minibatch_updates(exp, exp.step_fn, state, rows, n, rng,
                                          saved=out.activations if reuse else None)
  jax.block_until_ready(state.params)
  if reuse:  # read by the replayed step only, which is done: the next rollout writes over it
    exp.workspace["activations"] = out.activations
  timings["update_s"] = time.perf_counter() - t0
  state = state.replace(step=state.step + 1)

  m = {name: float(np.mean([float(x[name]) for x in step_metrics])) for name in step_metrics[0]}
  usable = usable_bk
  r = rewards_bk[usable]
  lengths = layout.gather(out.lengths_bk)
  num_tokens = int(lengths.sum())
  all_equal = np.array([np.ptp(row[u]) == 0 if u.sum() >= 2 else True
                        for row, u in zip(rewards_bk, usable)])
  adv = layout.gather(scored["advantages_bk"])
  # Each reward function's own mean (before weighting), over the samples it could score.
  m.update({f"reward/{name}": float(np.nanmean(v)) if np.isfinite(v).any() else float("nan")
            for name, v in parts.items()})
  m.update(
      reward_mean=float(r.mean()) if r.size else float("nan"),
      reward_std=float(r.std()) if r.size else float("nan"),
      kl=float(layout.gather(scored["kl_bk"]).mean()),
      penalised_reward=float(layout.gather(scored["penalised_bk"])[usable].mean()) if r.size else 0.0,
      advantage_mean=float(adv.mean()), advantage_std=float(adv.std()),
      advantage_abs_max=float(np.abs(adv).max()),
      completion_length=float(lengths.mean()),
      frac_groups_all_equal=float(all_equal.mean()),
      num_unscorable=float((~usable).sum()), num_nonfinite=float(num_nonfinite),
      rollout_tokens_per_s=num_tokens / max(timings["rollout_s"], 1e-9),
      # Tokens of the n [prompt | completion] rows trained on, however the prompt is shared.
      update_tokens_per_s=(c.train.num_epochs * n * (batch["prompt_tokens"].shape[1]
                                                     + completions_nt.shape[1]))
      / max(timings["update_s"], 1e-9),
      **timings)
  m["iteration_s"] = sum(timings.values())
  return state, m


def _nanmean(x: np.ndarray) -> float:
  return float(np.nanmean(x)) if np.isfinite(x).any() else float("nan")


def _eval_pass(exp: Experiment, params, records, rng, method, batch_size: int):
  """One completion per held-out prompt (k = 1), in `records` order (global rows): the weighted
  reward [N], the completion length [N] and each reward function's own score {name: [N]}."""
  c = exp.config
  batches = pipeline.prompt_batches(records, exp.tokenizer, global_batch_size=batch_size,
                                    max_prompt_len=c.data.max_prompt_len, shuffle=False,
                                    num_epochs=1, drop_remainder=False,
                                    overlong=c.data.overlong,
                                    process_index=jax.process_index(),
                                    process_count=jax.process_count())
  scores, lengths, per_fn = [], [], {}
  for i, batch in enumerate(batches):
    out, r_bk, _, parts = rollout(exp, params, batch, jax.random.fold_in(rng, i), k=1,
                                  method=method)
    valid = exp.layout.gather_rows(batch["valid"])  # global rows, like r_bk
    scores.append(np.asarray(r_bk)[valid, 0])
    lengths.append(exp.layout.gather(out.lengths_bk)[valid, 0])
    for fn_name, v in parts.items():
      per_fn.setdefault(fn_name, []).append(np.asarray(v)[valid])
  return (np.concatenate(scores), np.concatenate(lengths),
          {fn_name: np.concatenate(chunks) for fn_name, chunks in per_fn.items()})


@jax.jit
def _fingerprint(params):
  """Per-leaf sum and sum of squares: a content key for the reference-score cache."""
  return jnp.stack([jnp.stack([jnp.sum(x.astype(jnp.float32)),
                               jnp.sum(jnp.square(x.astype(jnp.float32)))])
                    for x in jax.tree.leaves(params)])


def _reference_greedy_scores(exp: Experiment, ref_params, source, records, rng,
                             batch_size: int) -> np.ndarray:
  """The reference policy's greedy per-prompt scores (first reward function), computed once per
  experiment, reference and held-out set. The key is the reference's content, not the Python
  object: the run loops' jitted, donated steps hand back new `ref_params` arrays every iteration."""
  cache = exp.__dict__.setdefault("_eval_ref_cache", {})
  fp = exp.layout.gather(_fingerprint(ref_params))
  key = (str(jax.tree.structure(ref_params)), fp.tobytes(), id(source), len(records), batch_size)
  hit = cache.get(key)
  if hit is None or hit[0] is not source:  # holding `source` keeps its id from being reused
    _, _, per_fn = _eval_pass(exp, ref_params, records, rng, sampling.Greedy(), batch_size)
    hit = cache[key] = (source, per_fn[exp.rewards.names[0]])
  return hit[1]


def evaluate(exp: Experiment, params, source, rng, *, num_prompts: int, batch_size: int,
             ref_params=None) -> dict:
  """Held-out reward with greedy decoding (exact-match accuracy for verifier tasks) and sampled.

  With `ref_params` (the reference, i.e. SFT, policy) it also reports the greedy win rate against
  the reference, as the paper's Table 1 does: prompt by prompt, the policy's greedy completion is
  scored against the reference's greedy completion, ties counted half, prompts either cannot
  score left out. Both are judged by the FIRST function of config.rewards.fns on its own (the
  task's reward: summarize's gold reward, arithmetic's verifier; with a weighted sum such as
  verifier + injected noise, the noise-free first term), the same per-function score that
  `greedy_reward/<name>` reports. Keys: win_rate_vs_ref, wins_vs_ref, ties_vs_ref,
  losses_vs_ref, n_vs_ref. The reference's greedy scores are computed once per run (cached on
  `exp`), and the reference evaluated against itself scores exactly 0.5 (greedy decoding is
  deterministic, so every prompt is a tie).
  """
  n = min(num_prompts, len(source))
  records = [source[i] for i in range(n)]
  results = {}
  first = exp.rewards.names[0]
  for name, method in (("greedy", sampling.Greedy()), ("sampled", exp.method)):
    scores, lengths, per_fn = _eval_pass(exp, params, records, rng, method, batch_size)
    results[f"{name}_reward"] = _nanmean(scores)
    results[f"{name}_length"] = float(lengths.mean())
    # Each reward function on its own: with a weighted sum (e.g. verifier + injected noise in the
    # robustness ablation) the verifier's accuracy is the number to report.
    for fn_name, v in per_fn.items():
      results[f"{name}_reward/{fn_name}"] = _nanmean(v)
    if name == "greedy" and ref_params is not None:
      ref = _reference_greedy_scores(exp, ref_params, source, records, rng, batch_size)
      stats = win_rate_stats(per_fn[first], ref)
      results.update(win_rate_vs_ref=stats["win_rate"], wins_vs_ref=stats["wins"],
                     ties_vs_ref=stats["ties"], losses_vs_ref=stats["losses"],
                     n_vs_ref=stats["n"])
  return results


# ----------------------------------------------------------------------------------------------
# The outer loop


def _progress(total: int, initial: int, enabled: bool):
  if not enabled:
    return None
  from tqdm import tqdm
  return tqdm(total=total, initial=initial, desc="rloo", dynamic_ncols=True)


def run(config, workdir: str, *, log=print) -> dict:
  """Trains (resuming from `workdir` if it holds checkpoints) and returns the summary."""
  workdir = os.path.abspath(workdir)
  os.makedirs(workdir, exist_ok=True)
  exp = build(config, workdir)
  c = config
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=c.train.keep_checkpoints)
  data = pipeline.prompt_batches(exp.task.train, exp.tokenizer,
                                 global_batch_size=c.rloo.num_prompts,
                                 max_prompt_len=c.data.max_prompt_len, seed=c.seed,
                                 overlong=c.data.overlong, process_index=jax.process_index(),
                                 process_count=jax.process_count())
  restored = ckpt.restore(abstract_state(exp)) if ckpt.latest_step() is not None else None
  eval_rng = jax.random.PRNGKey(c.seed + 1)
  if restored is not None:
    step, state, meta = restored
    data.set_state(meta["data"])
    before = meta.get("before")
    log(f"[rloo] resumed from step {step} in {ckpt.directory}")
  else:
    state = init_state(exp, initial_params(exp, log=log))
    before = evaluate(exp, state.params, exp.task.test, eval_rng,
                      num_prompts=c.train.eval_prompts, batch_size=c.train.eval_batch_size,
                      ref_params=state.ref_params)
    log(f"[eval] SFT policy: {json.dumps(before)}")
  writer = MetricWriter(workdir)
  if restored is None:
    writer.write(0, before, prefix="eval/")
  start = int(state.step)
  bar = _progress(c.train.num_iterations, start, c.train.progress_bar)
  metrics = {}
  for it in range(start, c.train.num_iterations):
    state, metrics = rl_iteration(exp, state, next(data))
    step = it + 1
    if step % c.train.log_every == 0 or step == c.train.num_iterations:
      writer.write(step, metrics, prefix="train/")
    if bar is not None:
      bar.update(1)
      bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", kl=f"{metrics['kl']:.3f}")
    elif step % c.train.log_every == 0:
      log(f"[rloo] iteration {step}: reward {metrics['reward_mean']:.3f} kl {metrics['kl']:.3f} "
          f"({metrics['iteration_s']:.2f}s)")
    if c.train.eval_every and step % c.train.eval_every == 0 and step != c.train.num_iterations:
      writer.write(step, evaluate(exp, state.params, exp.task.test, eval_rng,
                                  num_prompts=c.train.eval_prompts,
                                  batch_size=c.train.eval_batch_size,
                                  ref_params=state.ref_params), prefix="eval/")
    if step % c.train.checkpoint_every == 0 or step == c.train.num_iterations:
      ckpt.save(step, state, {"data": data.get_state(), "before": before}, force=True)
  if bar is not None:
    bar.close()
  ckpt.close()
  after = evaluate(exp, state.params, exp.task.test, eval_rng, num_prompts=c.train.eval_prompts,
                   batch_size=c.train.eval_batch_size, ref_params=state.ref_params)
  writer.write(int(state.step), after, prefix="eval/")
  writer.close()
  summary = {"before": before, "after": after, "iterations": int(state.step), "seed": c.seed,
             "eval_prompts": min(c.train.eval_prompts, len(exp.task.test))}
  if jax.process_index() == 0:
    with open(os.path.join(workdir, "summary.json"), "w") as f:
      json.dump(summary, f, indent=2)
  log(format_summary(summary))
  return dict(summary, state=state, last_metrics=metrics)


def format_summary(summary: dict) -> str:
  b, a = summary["before"], summary["after"]
  rows = [("held-out greedy reward (exact match)", "greedy_reward"),
          ("held-out mean sampled reward", "sampled_reward"),
          ("mean completion length (greedy)", "greedy_length")]
  lines = [f"\nheld-out evaluation on {summary['eval_prompts']} prompts, seed {summary['seed']}, "
           f"{summary['iterations']} RLOO iterations",
           f"| {'metric':<40} | {'SFT':>8} | {'RLOO':>8} |", f"|{'-' * 42}|{'-' * 10}|{'-' * 10}|"]
  if "win_rate_vs_ref" in a:
    rows.append(("greedy win rate vs SFT (ties half)", "win_rate_vs_ref"))
  for label, key in rows:
    lines.append(f"| {label:<40} | {b.get(key, float('nan')):>8.3f} | {a[key]:>8.3f} |")
  return "\n".join(lines)

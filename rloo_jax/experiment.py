"""The experiment: the config validated, the task prepared, the model, mesh, optimizer, reward
set and sampling method resolved once, and the RL train state with its shardings.

Every check that can fail on the config runs in `build`, before anything compiles.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Optional

from absl import logging
from flax import struct
import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils
import ml_collections
import optax

from rloo_jax import advantage, loss, rollout, sampling, tasks
from rloo_jax import sharding as sharding_lib
from rloo_jax.config_utils import sequence_length
from rloo_jax.data import pipeline
from rloo_jax.models import config as model_config_lib
from rloo_jax.models import hf, transformer
from rloo_jax.optim import make_optimizer
from rloo_jax.rewards import RewardSet


@struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: RL iterations completed
  params: Any  # policy, an nnx.State
  ref_params: Any  # frozen reference (the starting policy), an nnx.State
  opt_state: Any
  rng: jax.Array  # base key; iteration i uses fold_in(rng, i), so resuming replays exactly
  adv_state: Any  # the advantage estimator's state (a scalar placeholder when stateless)


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
  loss_spec: loss.LossSpec
  rewards: RewardSet  # what the policy is trained on
  eval_rewards: RewardSet  # what evaluations report; the first function judges win rates
  method: sampling.Method
  # The mesh and rules (a 1-device mesh for a 1-device run: one code path), the train state's
  # shardings, and the params gathered over fsdp for compute (None without fsdp).
  layout: sharding_lib.Layout
  state_shardings: Any = None
  compute_shardings: Any = None

  @property
  def tokenizer(self):
    return self.task.tokenizer

  @property
  def updates_per_iteration(self) -> int:
    return self.config.train.num_epochs * self.config.train.num_minibatches


def _check_choice(name: str, value, choices) -> None:
  if value not in choices:
    raise ValueError(f"unknown {name} {value!r}; choose one of {tuple(choices)}")


def _check_at_least(config, minimum, *names: str) -> None:
  """Each `section.key` must be a number >= minimum, named in the error with its fix."""
  for name in names:
    section, key = name.split(".")
    if section not in config or key not in config[section]:
      continue
    value = config[section][key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum:
      raise ValueError(f"config.{name} = {value!r} must be >= {minimum}; set "
                       f"--config.{name}=<a value >= {minimum}>")


def validate_config(config) -> None:
  """The config's own consistency; raises ValueError naming the setting and a fix."""
  r, t = config.rloo, config.train
  # Before the checks below divide or compare by them.
  _check_at_least(config, 1, "rloo.k", "rloo.num_prompts", "rloo.max_new_tokens",
                  "train.num_minibatches")
  est = advantage.spec(config.advantage.estimator)  # raises naming the registry
  if r.k < est.min_k:
    raise ValueError(f"config.rloo.k = {r.k}, but estimator {est.name!r} needs k >= {est.min_k} "
                     f"(a leave-one-out baseline needs another sample); set config.rloo.k >= "
                     f"{est.min_k}")
  _check_choice("config.loss.type", config.loss.type, loss.LOSS_TYPES)
  _check_choice("config.loss.aggregation", config.loss.aggregation, loss.AGGREGATIONS)
  _check_choice("config.loss.ratio_level", config.loss.ratio_level, loss.RATIO_LEVELS)
  _check_choice("config.kl.estimator", config.kl.estimator, loss.KL_ESTIMATORS)
  _check_choice("config.kl.reduction", config.kl.reduction, ("sum", "mean"))
  _check_choice("config.rewards.nan_policy", config.rewards.nan_policy, ("raise", "mask"))
  n = r.num_prompts * r.k
  if n % t.num_minibatches:
    raise ValueError(f"the rollout batch (config.rloo.num_prompts * config.rloo.k = {n}) is not "
                     f"divisible by config.train.num_minibatches = {t.num_minibatches}; "
                     f"choose num_minibatches dividing {n}")
  if t.shared_prefix and r.num_prompts % t.num_minibatches:
    raise ValueError(f"config.train.shared_prefix minibatches whole groups, but "
                     f"config.rloo.num_prompts = {r.num_prompts} is not divisible by "
                     f"config.train.num_minibatches = {t.num_minibatches}; choose "
                     f"num_minibatches dividing {r.num_prompts}, or set "
                     f"config.train.shared_prefix=False to minibatch single samples")
  _check_at_least(config, 1, "train.num_epochs", "train.log_every",
                  "train.checkpoint_every", "train.keep_checkpoints", "train.eval_batch_size",
                  "train.eval_prompts", "train.max_nonfinite_steps",
                  "train.max_unscorable_iterations", "sft.batch_size")
  _check_at_least(config, 0, "train.num_iterations", "train.eval_every", "kl.beta",
                  "sft.steps", "optim.learning_rate", "optim.warmup_steps",
                  "optim.max_grad_norm", "loss.clip_eps")
  need = sequence_length(config)
  if need > config.model.max_seq_len and not config.model.init_from:
    raise ValueError(f"config.data.max_prompt_len ({config.data.max_prompt_len}) + "
                     f"config.rloo.max_new_tokens ({r.max_new_tokens}) = {need} exceeds the "
                     f"model context config.model.max_seq_len = {config.model.max_seq_len}; "
                     f"shorten one or raise the context")
  sampling.from_config(r)  # raises on bad temperature / top_k / top_p
  init = config.model.init_from
  # A hub id is fetched (or found in the hub cache) here, before anything is built; a local
  # directory passes through. Raises FileNotFoundError naming config.model.init_from.
  local = hf.resolve_path(init, what="config.model.init_from") if init else ""
  if init and not os.path.isfile(os.path.join(local, "config.json")):
    raise FileNotFoundError(f"config.model.init_from={init!r} has no config.json"
                            f"{'' if local == init else f' (in {local})'}; point it at a "
                            "Hugging Face checkpoint directory (config.json + "
                            "model.safetensors, as save_pretrained writes it) or hub id")


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


def dry_run_rewards(rewards: RewardSet, task, num_samples: int = 2) -> None:
  """Calls the reward functions once on a few training prompts (their answers, when the task
  has them, as completions) with the fields a rollout passes, so an exception or a wrong
  output length shows in seconds, before the SFT stage and any compile."""
  records = [task.train[i] for i in range(min(num_samples, len(task.train)))]
  if not records:
    return
  batch = pipeline.record_fields(records)
  prompts = [str(r["prompt"]) for r in records]
  completions = [str(a) for a in batch["answer"]]
  fields = rollout.reward_fields(batch, 1)
  for fn, name in zip(rewards.fns, rewards.names):
    try:
      RewardSet([fn], [1.0], [name])(prompts, completions, fields)
    except Exception as e:  # pylint: disable=broad-except
      raise ValueError(f"reward function {name} (config.rewards.fns) failed on a dry run with "
                       f"{len(prompts)} training prompts: {type(e).__name__}: {e}") from e


def _make_task(config, data_dir: str):
  """Multi-process: process 0 prepares the data files first; the rest then only read them."""
  if jax.process_count() == 1:
    return tasks.make(config, data_dir)
  task = tasks.make(config, data_dir) if jax.process_index() == 0 else None
  multihost_utils.sync_global_devices("rloo_task_prepared")
  return task if task is not None else tasks.make(config, data_dir)


# Architecture settings of config.model that a checkpoint's own config.json decides.
_ARCHITECTURE_KEYS = ("family", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                      "head_dim", "intermediate_size", "max_seq_len")


def _warn_overridden(model_cfg, mcfg) -> None:
  """Says which config.model settings the checkpoint of config.model.init_from overrides."""
  ignored = [f"config.model.{k}={model_cfg[k]!r} (the checkpoint has {getattr(mcfg, k)!r})"
             for k in _ARCHITECTURE_KEYS if k in model_cfg and model_cfg[k] != getattr(mcfg, k)]
  if ignored:
    logging.warning("config.model.init_from=%s sets the architecture; ignored: %s",
                    model_cfg.init_from, "; ".join(ignored))


def build(config, workdir: str, task=None, *, devices=None, rewards: Optional[RewardSet] = None,
          eval_rewards: Optional[RewardSet] = None) -> Experiment:
  """Validates the config and the mesh, prepares the task and compiles nothing.

  `devices` (default: all of jax.devices()) are the devices the config.mesh is laid over.
  `rewards` / `eval_rewards` replace the reward set of config.rewards (the RLHF pipeline trains
  on a reward model it made itself)."""
  validate_config(config)
  layout = sharding_lib.make_layout(config.mesh, devices)
  validate_layout(config, layout)
  rewards = rewards or RewardSet.from_config(config.rewards)
  if task is None:
    task = _make_task(config, os.path.join(workdir, "data"))
  dry_run_rewards(rewards, task)
  if config.model.init_from:
    mcfg, graphdef, _ = hf.load_model(config.model.init_from, dtype=config.model.dtype)
    _warn_overridden(config.model, mcfg)
  else:
    mcfg = model_config_lib.from_experiment_config(config.model,
                                                  task.tokenizer.vocab_size)
    graphdef, _ = transformer.abstract(mcfg)
  if sequence_length(config) > mcfg.max_seq_len:
    raise ValueError(f"config.data.max_prompt_len + config.rloo.max_new_tokens = "
                     f"{sequence_length(config)} exceeds the model's context of "
                     f"{mcfg.max_seq_len} tokens")
  t = config.train
  tx = make_optimizer(config.optim, t.num_iterations * t.num_epochs * t.num_minibatches)
  exp = Experiment(config, workdir, task, mcfg, graphdef, transformer.model_fns(graphdef), tx,
                   loss.LossSpec.from_config(config.loss), rewards, eval_rewards or rewards,
                   sampling.from_config(config.rloo), layout)
  # Explicit shardings: params / reference / optimizer moments by the logical rules, scalars
  # replicated.
  abstract = _abstract_state(exp)
  exp.state_shardings = layout.tree_shardings(abstract)
  exp.compute_shardings = layout.compute_shardings(abstract.params)
  return exp


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


"""The experiment: the task prepared, the model, mesh, optimizer, reward set and sampling method
resolved once, and the RL train state with its shardings. The config's checks live here and run
once, from `rloo_jax.algorithms.validate`, before anything is built; `build` trusts them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any, Callable, Optional

from flax import struct
import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils
import ml_collections
import numpy as np
import optax

from rloo_jax import (adapters, advantage, config_utils, dynamic_sampling, loss, offpolicy,
                      packing, rollout, sampler_args, sampling, tasks)
from rloo_jax import sharding as sharding_lib
from rloo_jax.config_utils import sequence_length
from rloo_jax.data import chat, pipeline
from rloo_jax.models import config as model_config_lib
from rloo_jax.models import hf, lora, presets, transformer
from rloo_jax.optim import SCHEDULES, make_optimizer
from rloo_jax.rewards import RewardReturnError, RewardSet, RewardTimeoutError, overlong


@struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: RL iterations completed
  params: Any  # policy, an nnx.State
  ref_params: Any  # frozen reference (the starting policy), an nnx.State
  opt_state: Any
  rng: jax.Array  # base key; iteration i uses fold_in(rng, i), so resuming replays exactly
  adv_state: Any  # the advantage estimator's state (a scalar placeholder when stateless)
  # LoRA (rloo_jax.adapters): params are the adapters, ref_params the frozen base.
  lora: bool = struct.field(pytree_node=False, default=False)

  @property
  def policy_params(self):
    """What the policy's model functions (`Experiment.fns`) run on."""
    return lora.join(self.ref_params, self.params) if self.lora else self.params


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
  rewards: Optional[RewardSet]  # what the policy is trained on (None: `build_abstract`)
  eval_rewards: Optional[RewardSet]  # what evaluations report; the first judges win rates
  method: sampling.Method
  # The mesh and rules (one device: a 1-device mesh, one code path); the state's shardings.
  layout: sharding_lib.Layout
  state_shardings: Any = None
  # The frozen base's model functions (with LoRA: the reference); `fns` without LoRA.
  base_fns: Optional[transformer.ModelFns] = None

  tokenizer = property(lambda self: self.task.tokenizer)
  # The rollout's sampler, pools and layer layout, of the config as it is now (not cached).
  rollout_shape = property(lambda self: sampler_args.rollout_shape(self.config, self.layout))

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


# Storage dtypes of the frozen reference (config.model.ref_dtype); '' = the policy's.
REF_DTYPES = ("", "bfloat16", "float32", "float16")


def _divisor_check(name: str, value: int, total: int, what: str, zero: str) -> None:
  """`name` (0 = off) must divide `total`, the size of `what`."""
  if value and total % value:
    divisors = [d for d in range(1, total + 1) if total % d == 0]
    raise ValueError(f"config.{name} = {value} does not divide {what} = {total}; set "
                     f"--config.{name} to one of {divisors} (or 0: {zero})")


def _batch_divisors(config) -> None:
  """The microbatch and the rollout chunk must divide what they split."""
  r, t = config.rloo, config.train
  if t.shared_prefix:
    units, what = r.num_prompts // t.num_minibatches, (
        "the minibatch's groups (config.rloo.num_prompts / config.train.num_minibatches, "
        "whole groups with config.train.shared_prefix)")
  else:
    units, what = r.num_prompts * r.k // t.num_minibatches, (
        "the minibatch's rows (config.rloo.num_prompts * config.rloo.k / "
        "config.train.num_minibatches)")
  _divisor_check("train.microbatch_size", t.get("microbatch_size", 0), units, what,
                 "the whole minibatch in one pass")
  _divisor_check("rloo.rollout_chunk_prompts", r.get("rollout_chunk_prompts", 0),
                 r.num_prompts, "config.rloo.num_prompts", "the whole batch in one call")


def validate_config(config) -> None:
  """The config's own consistency; raises ValueError naming the setting and a fix. First the
  numbers and choices read here (so no check after them divides by zero), then each section's
  owner checks its own settings, then what spans sections (the context, temperature 0), and
  last what needs config.model.init_from's files (a hub id is fetched there)."""
  r, t, m = config.rloo, config.train, config.model
  _check_at_least(config, 1, "rloo.k", "rloo.num_prompts", "rloo.max_new_tokens",
                  "train.num_minibatches", "train.logprob_chunk_size", "train.num_epochs",
                  "train.log_every", "train.checkpoint_every", "train.keep_checkpoints",
                  "train.eval_batch_size", "train.eval_prompts", "train.max_nonfinite_steps",
                  "train.max_unscorable_iterations", "sft.batch_size")
  _check_at_least(config, 0, "train.microbatch_size", "rloo.trim_bucket",
                  "rloo.rollout_chunk_prompts", "train.num_iterations", "train.eval_every",
                  "train.eval_samples", "rewards.overlong_buffer", "kl.beta", "sft.steps",
                  "optim.learning_rate", "optim.warmup_steps", "optim.max_grad_norm",
                  "loss.clip_eps")
  for name, value, choices in (
      ("loss.type", config.loss.type, loss.LOSS_TYPES),
      ("loss.aggregation", config.loss.aggregation, loss.AGGREGATIONS),
      ("loss.ratio_level", config.loss.ratio_level, loss.RATIO_LEVELS),
      ("kl.estimator", config.kl.estimator, loss.KL_ESTIMATORS),
      ("kl.reduction", config.kl.reduction, ("sum", "mean")),
      ("rewards.nan_policy", config.rewards.nan_policy, ("raise", "mask")),
      ("rloo.sampler_mode", r.sampler_mode, sampler_args.MODES),
      ("model.remat", m.get("remat", "none"), model_config_lib.REMAT_POLICIES),
      ("model.ref_dtype", m.get("ref_dtype", ""), REF_DTYPES),
      ("optim.schedule", config.optim.schedule, SCHEDULES)):
    _check_choice(f"config.{name}", value, choices)
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
  _batch_divisors(config)
  preset, init = m.get("preset", ""), m.init_from
  if preset and init:
    raise ValueError(f"config.model.preset={preset!r} and config.model.init_from={init!r} both "
                     f"set the architecture; set one of config.model.preset / "
                     f"config.model.init_from (the other to '')")
  # Each section's owner, from the higher layers down.
  dynamic_sampling.check_config(config)
  packing.check_config(config)
  overlong.check_config(config)
  offpolicy.check_config(config)
  sampler_args.validate_decode_layout(r)
  adapters.check_config(config)
  need = sequence_length(config)
  est = advantage.spec(config.advantage.estimator)  # raises naming the registry
  presets.run_options(m)  # remat_names and attention: one-line errors before any compile
  # Raises naming the closest preset, or the model family a preset needs and this build lacks.
  arch = presets.get(preset, what="config.model.preset") if preset else None
  sampling.from_config(r)  # raises on bad temperature / top_k / top_p, naming the key
  if r.k < est.min_k:
    raise ValueError(f"config.rloo.k = {r.k}, but estimator {est.name!r} needs k >= {est.min_k} "
                     f"(a leave-one-out baseline needs another sample); set config.rloo.k >= "
                     f"{est.min_k}")
  if arch is not None and need > arch.max_seq_len:
    raise ValueError(f"config.data.max_prompt_len ({config.data.max_prompt_len}) + "
                     f"config.rloo.max_new_tokens ({r.max_new_tokens}) = {need} exceeds the "
                     f"context of config.model.preset={preset!r}, "
                     f"{arch.max_seq_len} tokens; shorten one")
  if arch is None and need > m.max_seq_len and not init:
    raise ValueError(f"config.data.max_prompt_len ({config.data.max_prompt_len}) + "
                     f"config.rloo.max_new_tokens ({r.max_new_tokens}) = {need} exceeds the "
                     f"model context config.model.max_seq_len = {m.max_seq_len}; "
                     f"shorten one or raise the context")
  if r.temperature == 0 and r.k >= 2 and est.compares_samples:
    raise ValueError(f"config.rloo.temperature = 0 samples the same completion k = {r.k} times, "
                     f"so estimator {est.name!r}, which compares a prompt's samples, has nothing "
                     "to compare (zero advantage: no learning); set --config.rloo.temperature=1.0")
  # Last, what reads files: a hub id is fetched (or found in the hub cache) here, before anything
  # is built; a local directory passes through. Raises FileNotFoundError naming it.
  local = hf.resolve_path(init, what="config.model.init_from") if init else ""
  if init and not os.path.isfile(os.path.join(local, "config.json")):
    raise FileNotFoundError(f"config.model.init_from={init!r} has no config.json"
                            f"{'' if local == init else f' (in {local})'}; point it at a "
                            "Hugging Face checkpoint directory (config.json + "
                            "model.safetensors, as save_pretrained writes it) or hub id")
  if init:  # the checkpoint's own architecture: a causal LM, long enough for the run
    with open(os.path.join(local, "config.json")) as f:
      ckpt = hf.config_from_hf(json.load(f), dtype=m.dtype)
    if ckpt.head != "lm":
      raise ValueError(f"config.model.init_from={init!r} is a sequence-classification "
                       "checkpoint (no LM head); the policy needs a causal LM checkpoint")
    if need > ckpt.max_seq_len:
      raise ValueError(f"config.data.max_prompt_len + config.rloo.max_new_tokens = {need} "
                       f"exceeds the context of config.model.init_from={init!r}, "
                       f"{ckpt.max_seq_len} tokens; shorten one")
  chat.check(config, local)


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
  mb = t.get("microbatch_size", 0)
  if mb:
    rows = mb * r.k if t.shared_prefix else mb
    check("the microbatch (config.train.microbatch_size"
          f"{' * config.rloo.k, in rows' if t.shared_prefix else ''})", rows, layout)
  # Every sampled batch larger than a chunk (evaluation's too) is sampled chunk by chunk.
  chunk = r.get("rollout_chunk_prompts", 0)
  if chunk:
    check("the rollout chunk (config.rloo.rollout_chunk_prompts)", chunk, layout)
  check("config.train.eval_batch_size", t.eval_batch_size, layout)
  if not config.model.init_from:
    check("config.sft.batch_size", config.sft.batch_size, layout)


def dry_run_rewards(rewards: RewardSet, task, num_samples: int = 2, log=print) -> None:
  """Calls the reward functions once on a few training prompts (their answers, when the task
  has them, as completions) with the fields a rollout passes, so an exception, a hang (under
  config.rewards.timeout_s), a wrong output or no score at all shows in seconds, before the SFT
  stage and any compile."""
  records = [task.train[i] for i in range(min(num_samples, len(task.train)))]
  if not records:
    return
  batch = pipeline.record_fields(records)
  prompts = [str(r["prompt"]) for r in records]
  completions = [str(a) for a in batch["answer"]]
  fields = rollout.reward_fields(batch, 1)
  log(f"[rewards] dry run: calling {', '.join(rewards.names)} on {len(prompts)} training prompts "
      f"(deadline config.rewards.timeout_s={rewards.timeout_s:g} s)")
  for fn, name in zip(rewards.fns, rewards.names):
    try:
      _, parts = RewardSet([fn], [1.0], [name], rewards.timeout_s)(prompts, completions, fields)
    except (RewardTimeoutError, RewardReturnError) as e:
      raise type(e)(f"{e} (on a dry run with {len(prompts)} training prompts)") from e
    except Exception as e:  # pylint: disable=broad-except
      raise ValueError(f"reward function {name} (config.rewards.fns) failed on a dry run with "
                       f"{len(prompts)} training prompts: {type(e).__name__}: {e}") from e
    if np.isnan(parts[name]).all():
      raise ValueError(f"reward function {name} (config.rewards.fns) scored none of "
                       f"{len(prompts)} training prompts' reference answers on a dry run (all "
                       "NaN: cannot score); check that it reads the fields this task passes")


def _make_task(config, data_dir: str):
  """Multi-process: process 0 prepares the data files first; the rest then only read them."""
  if jax.process_count() == 1:
    return tasks.make(config, data_dir)
  task = tasks.make(config, data_dir) if jax.process_index() == 0 else None
  multihost_utils.sync_global_devices("rloo_task_prepared")
  return task if task is not None else tasks.make(config, data_dir)


def model_config(config, vocab_size: Callable[[], int]) -> transformer.TransformerConfig:
  """The policy's architecture: config.model.init_from's config.json (no weights are read),
  else config.model's (a preset's, or sized by the task tokenizer's `vocab_size()`); the
  config decides how to run it (dtype, remat) either way."""
  m = config.model
  if m.init_from:
    local = hf.resolve_path(m.init_from, what="config.model.init_from")
    with open(os.path.join(local, "config.json")) as f:
      mcfg = hf.config_from_hf(json.load(f), dtype=m.dtype).replace(**presets.run_options(m))
  else:
    mcfg = presets.from_experiment_config(m, vocab_size())
  if m.init_from or m.get("preset", ""):  # the architecture comes from there, not config.model
    config_utils.warn_overridden(m, mcfg)
  return adapters.model_config(config, mcfg)


def _assemble(config, workdir: str, task, layout: sharding_lib.Layout,
              mcfg: transformer.TransformerConfig, rewards, eval_rewards) -> Experiment:
  """The Experiment of a resolved architecture: optimizer, loss, model functions (with FSDP's
  ParamGather) and the train state's shardings. What `build` and `build_abstract` share."""
  # max_len: fixed_length's constant normaliser stays max_new_tokens whatever length the
  # rollout's completions are trimmed to.
  spec = loss.LossSpec.from_config(config.loss, max_len=config.rloo.max_new_tokens)
  method = sampling.from_config(config.rloo)
  graphdef, abstract_params = transformer.abstract(mcfg)
  t = config.train
  tx = make_optimizer(config.optim, t.num_iterations * t.num_epochs * t.num_minibatches)
  # FSDP: the model functions gather each layer's weights as the layer scan reaches them.
  gather = layout.param_gather(abstract_params)
  fns = transformer.model_fns(graphdef, gather)
  base_fns = (transformer.model_fns(transformer.abstract(lora.base_config(mcfg))[0], gather)
              if mcfg.lora_rank else fns)
  exp = Experiment(config, workdir, task, mcfg, graphdef, fns, tx, spec, rewards,
                   eval_rewards or rewards, method, layout, base_fns=base_fns)
  # Explicit shardings: params / reference / optimizer moments by the logical rules, scalars
  # replicated.
  exp.state_shardings = layout.tree_shardings(_abstract_state(exp))
  return exp


def build(config, workdir: str, task=None, *, layout: Optional[sharding_lib.Layout] = None,
          devices=None, rewards: Optional[RewardSet] = None,
          eval_rewards: Optional[RewardSet] = None, log=print) -> Experiment:
  """The experiment of a validated config (`algorithms.validate`): prepares the task and
  compiles nothing.

  `layout` (default: config.mesh over `devices`, default all of jax.devices()) is the mesh.
  `rewards` / `eval_rewards` replace the reward set of config.rewards (the RLHF pipeline trains
  on a reward model it made itself)."""
  layout = layout or sharding_lib.make_layout(config.mesh, devices)
  rewards = rewards or RewardSet.from_config(config.rewards, layout)  # RMs on the mesh
  if task is None:
    task = _make_task(config, os.path.join(workdir, "data"))
  dry_run_rewards(rewards, task, log=log)
  mcfg = model_config(config, lambda: task.tokenizer.vocab_size)
  return _assemble(config, workdir, task, layout, mcfg, rewards, eval_rewards)


def build_abstract(config, devices=None, num_layers: Optional[int] = None) -> Experiment:
  """The static Experiment with no task, rewards or weights (its `task` and reward sets are
  None): what the memory planner (`rloo_jax.plan`) compiles the training programs from. The
  architecture is a preset's, init_from's config.json, or config.model sized by the task's
  tokenizer (`tasks.vocab_size`); `num_layers` replaces its depth (scaling studies). The
  config is validated (`algorithms.validate`)."""
  layout = sharding_lib.make_layout(config.mesh, devices)

  def vocab_size() -> int:
    size = tasks.vocab_size(config)
    if size is None and not config.model.get("preset", ""):
      raise ValueError(f"task {config.task!r} registered no tokenizer to size the model from "
                       "without its data (tasks.register(..., tokenizer=...)); set "
                       "config.model.preset or config.model.init_from")
    return size or 0  # a preset keeps its own vocabulary

  mcfg = model_config(config, vocab_size)
  if num_layers:
    mcfg = mcfg.replace(num_layers=int(num_layers))
  return _assemble(config, "", None, layout, mcfg, None, None)


def _init_state(exp: Experiment, params) -> TrainState:
  spec = advantage.spec(exp.config.advantage.estimator)
  adv_state = spec.init_state() if spec.stateful else jnp.zeros((), jnp.float32)
  ref_params = adapters.reference_copy(exp.config, params)
  mcfg = exp.model_config
  if mcfg.lora_rank:  # the reference is the base itself; only the adapters train
    params = adapters.init_adapters(mcfg, exp.config.seed)
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, ref_params=ref_params,
                    opt_state=exp.tx.init(params), rng=jax.random.PRNGKey(exp.config.seed),
                    adv_state=adv_state, lora=bool(mcfg.lora_rank))


def init_state(exp: Experiment, params) -> TrainState:
  """The train state on the mesh: jit(init, out_shardings=...), so the optimizer moments and
  the reference are created sharded. `params` may be host values or arrays on any layout."""
  params = exp.layout.put(params, exp.state_shardings.ref_params)
  return jax.jit(functools.partial(_init_state, exp), out_shardings=exp.state_shardings)(params)


def _abstract_state(exp: Experiment) -> TrainState:
  _, params = transformer.abstract(lora.base_config(exp.model_config))
  return jax.eval_shape(lambda p: _init_state(exp, p), params)


def abstract_state(exp: Experiment) -> TrainState:
  """ShapeDtypeStructs with this experiment's shardings: the Orbax restore target, so a
  checkpoint written on any mesh restores onto this one."""
  return exp.layout.abstract(_abstract_state(exp), exp.state_shardings)


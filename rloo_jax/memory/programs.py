"""The programs an RLOO iteration runs, lowered on abstract inputs (ShapeDtypeStructs carrying
the real shardings) and compiled, with what each holds in device memory.

    update   `RLOO.step_fn` on one minibatch of rows (worst case: T = max_new_tokens); when
             it runs as several programs (`update.TrainStep.lower` gives them by name:
             update_gradients, update_apply), each is measured under its own name
    score    `RLOO.reference_fn` on the whole rollout (the reference's log-probs; the KL and
             advantages after it, `RLOO.advantage_fn`, are a few [B, k] arrays)
    start    `sampler.start` on one rollout chunk (prefill + the first token)
    decode   `sampler.decode_loop` on that chunk's SamplingState (donated)
    engine   with config.rloo.rollout_slots, instead of the two: `engine.start` and
             `engine.phase` on one chunk (the larger peak; its slot pool's KV buffers and
             prefix pool)

A program's peak on a device is its arguments + outputs - the donated (aliased) bytes + XLA's
temporaries (`Compiled.memory_analysis`, per device for a partitioned program), plus what stays
resident beside it: the parts of the persistent train state (params, reference, optimizer state)
it does not take as arguments, a learned reward model's weights (`hf_reward_model:` rewards),
and during the scoring pass and the update the rollout's own arrays (its sample output, rows
and scores).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp

from rloo_jax import engine, experiment, rollout, sampler, update
from rloo_jax.memory import targets
from rloo_jax.models import traced_mesh
from rloo_jax.sharding import per_device_bytes

NAMES = ("update", "score", "start", "decode", "engine")
# The rollout's programs: the static sampler's start and decode (config.rloo.rollout_slots = 0),
# or the engine's one program; a plan asking for any of them gets the run's own.
ROLLOUT = ("start", "decode", "engine")
# The train state's parts each update program takes as arguments (the rest stays resident
# beside it): the gradient program reads the params only, the optimizer step the whole state.
_UPDATE_STATE_ARGS = {"update": ("params", "ref_params", "opt_state"),
                      "update_gradients": ("params",),
                      "update_apply": ("params", "ref_params", "opt_state")}


@dataclasses.dataclass
class Measured:
  """One compiled program's bytes per device, and its compile time."""
  name: str
  argument: int
  output: int
  alias: int
  temp: int
  resident: int  # persistent state not among its arguments + the rollout arrays alive beside it
  compile_s: float
  hoisted: int = 0  # planned for an accelerator: what its loop-invariant code motion adds
  # The compiler's cost analysis, per device (None where the backend gives none, as the GPU's).
  flops: float | None = None
  bytes_accessed: float | None = None

  @property
  def peak(self) -> int:
    return (self.resident + self.argument + self.output - self.alias + self.temp
            + self.hoisted)


def _with(tree, sharding):
  """ShapeDtypeStructs of `tree` (abstract values) all carrying `sharding`."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def _with_shardings(tree, shardings):
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree,
                      shardings)


def _struct(shape, dtype, sharding):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


@dataclasses.dataclass
class Inputs:
  """The abstract arguments of the four programs of one experiment."""
  state: Any  # TrainState of ShapeDtypeStructs with the state's shardings
  rows: Any  # the whole rollout's rows (GroupedRows or SequenceRows)
  minibatch: Any  # one minibatch of them
  prompts: tuple  # (prompt tokens [C, P], lengths [C]) of one rollout chunk
  rng: Any
  token_id: Any  # an int32 scalar: pad_id
  stop_ids: Any  # int32 [S]: the tokenizer's stop ids, as sampler.sample passes them


def divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def microbatch(config) -> dict:
  """The update's microbatch: in config.train.microbatch_size's units (groups with
  train.shared_prefix, rows otherwise), in rows, in groups, and how many make a minibatch."""
  c = config
  k, grouped = c.rloo.k, bool(c.train.shared_prefix)
  units = (c.rloo.num_prompts if grouped else c.rloo.num_prompts * k) // c.train.num_minibatches
  m = update.microbatches(c, per="minibatch")
  size = units // m
  rows = size * k if grouped else size
  return dict(microbatch_size=size, microbatch_rows=rows,
              microbatch_groups=size if grouped else rows / k, microbatches=m,
              microbatch_tokens=int(c.train.get("microbatch_tokens", 0) or 0))


def inputs(exp) -> Inputs:
  """The shapes training runs: P = config.data.max_prompt_len, T = config.rloo.max_new_tokens
  (before trimming), minibatches of num_prompts * k / num_minibatches rows."""
  c, layout = exp.config, exp.layout
  rows_sh, rep = layout.batch_sharding, layout.replicated
  b, k, p, t = c.rloo.num_prompts, c.rloo.k, c.data.max_prompt_len, c.rloo.max_new_tokens
  n = b * k
  make = functools.partial(rollout.make_rows, k=k, shared_prefix=bool(c.train.shared_prefix))
  rows = jax.eval_shape(make, jax.ShapeDtypeStruct((b, p), jnp.int32),
                        jax.ShapeDtypeStruct((b,), jnp.int32),
                        jax.ShapeDtypeStruct((n, t), jnp.int32),
                        jax.ShapeDtypeStruct((n, t), jnp.bool_),
                        jax.ShapeDtypeStruct((n, t), jnp.float32))
  if c.loss.get("old_logprobs", "sampler") == "recompute":  # the sampler's beside the trainer's
    rows = rows.replace(sampler_logp_nt=rows.old_logp_nt)
  # Every field's leading axis is prompts or rows; a minibatch holds 1 / num_minibatches of
  # each (whole groups with GroupedRows, single samples with SequenceRows).
  m = c.train.num_minibatches
  minibatch = jax.tree.map(lambda x: jax.ShapeDtypeStruct((x.shape[0] // m, *x.shape[1:]),
                                                          x.dtype), rows)
  chunk = exp.rollout_shape.chunk
  return Inputs(state=experiment.abstract_state(exp), rows=_with(rows, rows_sh),
                minibatch=_with(minibatch, rows_sh),
                prompts=(_struct((chunk, p), jnp.int32, rows_sh),
                         _struct((chunk,), jnp.int32, rows_sh)),
                rng=_with(jax.eval_shape(lambda: jax.random.PRNGKey(0)), rep),
                token_id=_struct((), jnp.int32, rep),
                stop_ids=_struct((_num_stop_ids(exp),), jnp.int32, rep))


def _num_stop_ids(exp) -> int:
  """How many stop ids the rollout passes (1 when planned without a tokenizer)."""
  task = getattr(exp, "task", None)
  return len(rollout.stop_ids(task.tokenizer)) if task is not None else 1


def _sampler_static(exp) -> dict:
  """The static arguments `sampler.sample` passes (`rollout._sample_rows`)."""
  c = exp.config
  return dict(method=exp.method, mode=c.rloo.sampler_mode,
              batch_sharding=exp.layout.batch_sharding)


# XLA:CPU computes bfloat16 / float16 in float32, and its loop-invariant code motion then hoists
# the convert of every stacked layer weight out of the layer scan: a float32 copy of all the
# weights at once, 2x a bf16 base, which an accelerator (native bf16) never makes. Planned for
# an accelerator, the programs compile with that pass off (`memory.plan`, which measures the
# hoists an accelerator does make apart).
ACCELERATOR_OPTIONS = {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}


def reward_model_bytes(exp) -> int:
  """Per device, the weights of the config's `hf_reward_model:` rewards, which stay loaded (on
  the policy's mesh, in the spec's dtype) beside every program of the run. A local checkpoint
  is sized by its config.json; with no path yet (a preset plan) or a hub id not in this
  machine's cache, as the policy's own architecture with a scalar head: the paper's setting,
  whose reward models are the size of the policy."""
  # pylint: disable-next=import-outside-toplevel
  from rloo_jax.models import hf, hf_hub, lora, transformer
  from rloo_jax.rewards import registry  # pylint: disable=import-outside-toplevel
  total = 0
  for spec in exp.config.rewards.fns:
    if not (isinstance(spec, str) and spec.startswith(registry.HF_REWARD_MODEL_PREFIX)):
      continue
    path, options = registry.parse_hf_reward_model_spec(spec, require_path=False)
    dtype = options.get("dtype", "bfloat16")
    mcfg = lora.base_config(exp.model_config).replace(head="scalar")
    try:
      local = hf_hub.resolve_path(path, what="hf_reward_model") if path else None
    except (FileNotFoundError, ValueError, OSError):
      local = None
    if local and os.path.isfile(os.path.join(local, "config.json")):
      with open(os.path.join(local, "config.json")) as f:
        mcfg = hf.config_from_hf(json.load(f))
    mcfg = mcfg.replace(head="scalar", dtype=dtype, param_dtype=dtype)
    params = transformer.abstract(mcfg)[1]
    total += per_device_bytes(exp.layout.abstract(params))
  return total


def _compile_with(lowered, options=None):
  t0 = time.perf_counter()
  lowered = lowered()
  try:
    compiled = lowered.compile(compiler_options=options)
  except jax.errors.JaxRuntimeError as e:  # the TPU compiler refuses what exceeds the device
    compiled = targets.refused(e)
  return compiled, time.perf_counter() - t0


def _platform(compiled) -> str:
  """The platform a compiled program runs on, read from its shardings' devices."""
  for s in jax.tree.leaves((compiled.input_shardings, compiled.output_shardings)):
    return next(iter(s.device_set)).platform
  return "target"


def _measure(name, compiled, seconds, resident) -> Measured:
  stats = compiled.memory_analysis()
  if stats is None:
    raise RuntimeError(f"the {_platform(compiled)} backend reports no memory analysis of the "
                       f"{name} program, so it cannot be planned")
  cost = compiled.cost_analysis() or {}
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost  # older jax: one dict a device
  return Measured(name, int(stats.argument_size_in_bytes), int(stats.output_size_in_bytes),
                  int(stats.alias_size_in_bytes), int(stats.temp_size_in_bytes), int(resident),
                  round(seconds, 3), flops=cost.get("flops"),
                  bytes_accessed=cost.get("bytes accessed"))


@dataclasses.dataclass
class Compiled:
  """What `compile_programs` found: each program measured, and the abstract sampler state."""
  programs: dict  # name -> Measured
  state_bytes: dict  # params / ref_params / opt_state -> bytes per device
  kv_cache_bytes: int  # one rollout chunk's cache, per device
  rollout_bytes: dict  # sample_output / rows / scores -> bytes per device
  sampling_state: Any
  ref_itemsize: int  # bytes per element of the reference's floating weights (the widest)
  params_itemsize: int = 4  # the same of the trained params
  reward_model_bytes: int = 0  # hf_reward_model: weights per device, resident throughout


def program_names(exp, names=NAMES) -> tuple:
  """`names` with the rollout's programs (any of ROLLOUT) the experiment's own: the engine's one
  (`exp.rollout_shape.slots`), or the static sampler's start and decode ("engine": both)."""
  if not set(names) & set(ROLLOUT):
    return tuple(names)
  rest = tuple(n for n in names if n not in ROLLOUT)
  if exp.rollout_shape.slots:
    return rest + ("engine",)
  return rest + (tuple(n for n in names if n in ("start", "decode")) or ("start", "decode"))


def compile_programs(algo, names=NAMES, *, options=None) -> Compiled:
  """Compiles the RLOO programs `names` (a subset of NAMES, `program_names`; the decode loop
  needs the start compiled too) of `algo` (an `algorithms.rloo.RLOO`) on abstract inputs, with XLA
  `options` (compiler_options: e.g. ACCELERATOR_OPTIONS)."""
  with traced_mesh.on_mesh(algo.exp.layout.mesh):
    return _compile_programs(algo, names, options)


def _compile_programs(algo, names, options) -> Compiled:
  exp = algo.exp
  _compile = functools.partial(_compile_with, options=options)
  c = exp.config
  names = program_names(exp, names)
  x = inputs(exp)
  state = x.state
  parts = {name: per_device_bytes(getattr(state, name))
           for name in ("params", "ref_params", "opt_state")}
  # The reward model's weights (hf_reward_model:) stay loaded beside every program.
  reward_model = reward_model_bytes(exp)
  persistent = sum(parts.values()) + reward_model
  # The sampler runs on the policy's whole weights: with LoRA the base (ref_params) and the
  # adapters (params), the base then being no copy but the reference itself.
  policy_parts = ("params", "ref_params") if state.lora else ("params",)
  policy_bytes = sum(parts[p] for p in policy_parts)
  found = {}
  r = exp.rollout_shape
  # Named apart from the `rollout` module it would otherwise shadow.
  rollout_programs = _engine_rollout if r.slots else _static_rollout
  # Beside the rollout's programs: the state but the policy's weights, which they take.
  samp, kv_cache, sample_output = rollout_programs(exp, x, names, _compile, found,
                                                   persistent - policy_bytes)
  # The whole rollout's sample output (this chunk's, times the chunks) stays alive until the
  # iteration's metrics are taken.
  sample_output *= c.rloo.num_prompts // r.chunk
  rows_bytes = per_device_bytes(x.rows)
  rows_sh, shape_bk = exp.layout.batch_sharding, (c.rloo.num_prompts, c.rloo.k)
  # The scoring pass's outputs (KL, advantages, reference log-probs), split like the rows; the
  # advantages' program on the reference's float32 [N, T] log-probs (no model traced for it).
  score_args = (_struct(x.rows.cmask_nt.shape, jnp.float32, rows_sh), state.adv_state, x.rows,
                _struct(shape_bk, jnp.float32, rows_sh), _struct(shape_bk, jnp.bool_, rows_sh))
  scores = per_device_bytes(_with(jax.eval_shape(algo.advantage_fn, *score_args)[0], rows_sh))
  if "score" in names:
    # The scoring pass's program of any size: the reference's log-probs (the KL and advantages
    # after it are a few [B, k] operations, `RLOO.advantage_fn`).
    compiled, s = _compile(lambda: algo.reference_fn.lower(state.ref_params, x.rows))
    found["score"] = _measure("score", compiled, s,
                              persistent - parts["ref_params"] + sample_output)
  if "update" in names:
    # With one minibatch the rows are the step's argument; with more, the whole rollout's rows
    # stay alive beside each minibatch gathered from them.
    beside = sample_output + scores + (rows_bytes if c.train.num_minibatches > 1 else 0)
    lowered = algo.step_fn.lower(state, x.minibatch)
    for name, one in (lowered if isinstance(lowered, dict) else {"update": lowered}).items():
      if name not in _UPDATE_STATE_ARGS:
        raise ValueError(f"the memory plan does not know which train state the update program "
                         f"{name!r} takes (plan.programs._UPDATE_STATE_ARGS)")
      compiled, s = _compile(lambda one=one: one)
      args = _UPDATE_STATE_ARGS[name] + (("ref_params",) if state.lora else ())
      held = persistent - sum(parts[p] for p in set(args))
      found[name] = _measure(name, compiled, s, held + beside)
  itemsize = lambda tree: max((x.dtype.itemsize for x in jax.tree.leaves(tree)
                               if jnp.issubdtype(x.dtype, jnp.floating)), default=0)
  order = sorted((n for n in found if n.split("_")[0] in names),
                 key=lambda n: NAMES.index(n.split("_")[0]))  # stable: gradients, then apply
  return Compiled({n: found[n] for n in order}, parts, kv_cache,
                  dict(sample_output=sample_output, rows=rows_bytes, scores=scores), samp,
                  itemsize(state.ref_params), itemsize(state.params), reward_model)


def _static_rollout(exp, x, names, _compile, found, resident):
  """The static sampler's programs (`sampler.start`, then `sampler.decode_loop` on its donated
  state) among `names` into `found`; returns (sampling state, KV cache and sample output bytes
  per device)."""
  c, params, tok = exp.config, x.state.policy_params, x.token_id
  static, unstack = _sampler_static(exp), exp.rollout_shape.unstacked
  start_static = dict(static, k=int(c.rloo.k), max_new_tokens=int(c.rloo.max_new_tokens),
                      unstack_layers=unstack)
  start_args = (params, *x.prompts, x.rng, x.stop_ids, tok)
  shapes = jax.eval_shape(functools.partial(sampler.start, exp.fns, **start_static),
                          *start_args)
  if not ("start" in names or "decode" in names):
    # Uncompiled: the sampler splits every per-prompt array over the batch axes.
    ways = exp.layout.batch_parallelism
    return (shapes, *(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(t)) // ways
                      for t in (shapes.cache, shapes.output())))
  compiled, s = _compile(lambda: sampler.start.lower(exp.fns, *start_args, **start_static))
  found["start"] = _measure("start", compiled, s, resident)
  # The decode loop's input is the start's output, with the shardings the start gives it.
  samp = _with_shardings(shapes, compiled.output_shardings)
  if "decode" in names:
    compiled, s = _compile(lambda: sampler.decode_loop.lower(
        exp.fns, params, samp, x.stop_ids, tok, **static, unstack_layers=unstack))
    found["decode"] = _measure("decode", compiled, s, resident)
  return samp, per_device_bytes(samp.cache), per_device_bytes(samp.output())


def _engine_rollout(exp, x, names, _compile, found, resident):
  """`engine.start` and `engine.phase` (config.rloo.rollout_slots) on one chunk, the phase at
  the full KV limit (the longest live stream at the cap), measured as "engine" (the larger
  peak of the two) when `names` asks for it; returns (its EngineState, KV cache bytes (stream
  buffers + prefix pool) and sample output per device)."""
  c, r = exp.config, exp.rollout_shape
  t_cap = int(c.rloo.max_new_tokens)
  static = dict(k=int(c.rloo.k), max_new_tokens=t_cap, method=exp.method,
                unstack_layers=r.unstacked, batch_sharding=exp.layout.batch_sharding)
  args = (x.state.policy_params, *x.prompts, x.rng, x.stop_ids)
  pools = dict(slots=r.slots, prefix_rows=r.prefix_rows, pages=r.pages, page_size=r.page_size)
  shapes = jax.eval_shape(functools.partial(engine.start, exp.fns, **static, **pools), *args,
                          x.token_id)
  if "engine" not in names:
    # Uncompiled: the outputs and every shard's slot and prefix pools split over the batch axes.
    ways = exp.layout.batch_parallelism
    return (shapes, *(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(t)) // ways
                      for t in (shapes.cache, shapes.output())))
  start, s0 = _compile(lambda: engine.start.lower(exp.fns, *args, x.token_id, **static, **pools))
  state = _with_shardings(shapes, start.output_shardings)
  phase, s1 = _compile(lambda: engine.phase.lower(exp.fns, *args, state, kv_limit=t_cap,
                                                  **static))
  measured = [_measure("engine", start, s0, resident), _measure("engine", phase, s1, resident)]
  found["engine"] = max(measured, key=lambda m: m.peak)
  return state, per_device_bytes(state.cache), per_device_bytes(state.output())


def compile_at(algo, config, names=("update",), *, accelerator: bool,
               rebuild: bool = False) -> dict:
  """{name: Program} of `algo`'s programs `names` under `config` instead of its own (compiled
  again, with ACCELERATOR_OPTIONS when `accelerator`): the same experiment given the new
  config, or with rebuild (a model setting changed, e.g. remat) the experiment built anew."""
  if rebuild:  # on the same devices (a target's, when planned for one)
    exp = experiment.build_abstract(config, devices=list(algo.exp.layout.mesh.devices.flat),
                                    num_layers=algo.exp.model_config.num_layers)
  else:
    exp = dataclasses.replace(algo.exp, config=config)
  options = ACCELERATOR_OPTIONS if accelerator else None
  return compile_programs(type(algo)(exp), names, options=options).programs

"""The memory plan of an RLOO job: every program training runs, compiled on abstract inputs with
the real shardings (no data, no weights), and what it needs per device.

    python -m rloo_jax.plan --config=configs/arithmetic.py --config.model.preset=qwen2.5-1.5b \
        --config.mesh.data=1 --config.mesh.fsdp=8 --devices=8 [--device_memory_gb=80]

    report = memory.plan(RLOO(experiment.build_abstract(config)), device_memory_gb=80)

Sizes are GiB (2^30 bytes) per device. A program's peak is what it holds at once (`programs`);
the plan's peak is the largest. When it does not fit, `advice` names the settings to turn,
the largest consumer first. With config.train.check_memory, an accelerator run plans itself at
start-up (`check`, the preflight `algorithms.run` runs before the loop) and refuses a job that
would run out of memory.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from rloo_jax import experiment, packing, sampler_args
from rloo_jax.memory import flops as flops_lib
from rloo_jax.memory import programs as programs_lib
from rloo_jax.memory import slots as slots_lib
from rloo_jax.memory import speedups as speedups_lib
from rloo_jax.models import attention_ops, lora

GIB = 2 ** 30
DEFAULT_DEVICE_MEMORY_GB = 80.0
PROGRAM_LABELS = {"update": "update step", "update_gradients": "update grads",
                  "update_apply": "update apply", "score": "scoring pass",
                  "start": "sampler start", "decode": "sampler decode",
                  "engine": "rollout engine"}


class DoesNotFit(ValueError):
  """The job's largest program needs more device memory than the device has."""


def _gb(n: float) -> float:
  return n / GIB


def _size(n: float) -> str:
  return f"{n / GIB:.3g} GiB"


def _activations_program(programs: dict) -> Optional[str]:
  """The update program holding the activations: of the update's programs (one, or the
  gradient and optimizer programs), the one with the most temporaries."""
  update = [n for n in programs if n.split("_")[0] == "update"]
  return max(update, key=lambda n: programs[n].temp) if update else None


def _update_temp_at(algo, name: str, size: int, accelerator: bool) -> int:
  """Update program `name`'s temporaries with config.train.microbatch_size = `size` (one more
  compile)."""
  config = algo.exp.config.copy_and_resolve_references()
  config.train.microbatch_size = size
  return programs_lib.compile_at(algo, config, accelerator=accelerator)[name].temp


def _microbatch_advice(algo, name: str, update, need: int, accelerator: bool) -> list:
  """Smaller microbatches: the update's activations shrink with them. Its temporaries are
  guessed proportional to the microbatch first, which is optimistic (the gathered weights and
  the gradient do not shrink), so the guess is compiled, and when it does not fit, the two
  compiles' affine fit picks the size."""
  exp = algo.exp
  c, out = exp.config, []
  grouped = bool(c.train.shared_prefix)
  mb = programs_lib.microbatch(c)
  if mb["microbatch_tokens"]:
    return _packed_advice(algo, name, update, need, accelerator)
  size, units = mb["microbatch_size"], mb["microbatch_size"] * mb["microbatches"]
  rows = lambda d: d * c.rloo.k if grouped else d
  valid = [d for d in programs_lib.divisors(units) if d < size
           and rows(d) % exp.layout.batch_parallelism == 0]
  unit = "groups" if grouped else "rows"
  want = update.temp - need  # the temporaries that would fit
  if valid and update.temp:
    guess = max((d for d in valid if d <= size * want / update.temp), default=min(valid))
    at_guess = _update_temp_at(algo, name, guess, accelerator)
    slope = (update.temp - at_guess) / (size - guess)
    fixed = update.temp - slope * size
    fitting = [d for d in valid if fixed + slope * d <= want] if slope > 0 else []
    if at_guess <= want:
      pick, note = guess, f"compiled at {guess}: {_size(at_guess)} of temporaries"
    elif fitting:
      pick = max(fitting)
      note = f"about {_size(fixed + slope * pick)} of temporaries at {pick}"
    else:
      pick, note = min(valid), ("the smallest the mesh allows: not enough alone, the rest "
                                "does not shrink with the microbatch")
    # What dominates is the part that scales with the microbatch (fitted to the two compiles);
    # when none does, a smaller microbatch is no advice.
    activations = max(update.temp - max(fixed, 0.0), 0.0)
    if activations > 0:
      out.append((activations, f"--config.train.microbatch_size={pick} ({unit}; now {size}: "
                               f"{_size(activations)} of the update's {_size(update.temp)} of "
                               f"temporaries shrink with it; {note})"))
  if c.model.get("remat", "none") != "full":
    out.append((update.temp, "--config.model.remat=full (keep only each layer's input for the "
                             f"backward; now {c.model.get('remat', 'none')!r})"))
  return out


def _packed_advice(algo, name: str, update, need: int, accelerator: bool) -> list:
  """Packed updates: the smallest token budget (one completion and its prompt a row), compiled."""
  c = algo.exp.config
  now = int(c.train.microbatch_tokens)
  least = packing.min_tokens(c.data.max_prompt_len, c.rloo.max_new_tokens)
  if now <= least:
    return []
  config = c.copy_and_resolve_references()
  config.train.microbatch_tokens = least  # the model is unchanged: no rebuild
  temp = programs_lib.compile_at(algo, config, accelerator=accelerator)[name].temp
  if temp >= update.temp:
    return []
  return [(update.temp - temp, f"--config.train.microbatch_tokens={least} (now {now}: the "
                               f"update's temporaries {_size(update.temp)} -> {_size(temp)})")]


def _attention_advice(algo, name: str, update, need: int, accelerator: bool) -> list:
  """O(S) attention, where the update's rows still attend with [S, S] scores ('xla', or 'auto'
  below its blockwise length) and those scores could make room: the update compiled once more
  with 'blockwise'."""
  exp = algo.exp
  c, m = exp.config, exp.model_config
  kind = c.model.get("attention", "auto")
  tokens = c.data.max_prompt_len + c.rloo.max_new_tokens  # the keys a completion token reads
  if attention_ops.resolve(kind, tokens) != "xla":
    return []
  mb = programs_lib.microbatch(c)
  rows = mb["microbatch_rows"] / exp.layout.batch_parallelism
  if rows * m.num_heads * tokens ** 2 * 4 < need / 10:  # one layer's float32 scores
    return []
  config = c.copy_and_resolve_references()
  config.model.attention = "blockwise"
  temp = programs_lib.compile_at(algo, config, accelerator=accelerator, rebuild=True)[name].temp
  if temp >= update.temp:
    return []
  return [(update.temp - temp, f"--config.model.attention=blockwise (attention in O(S) memory: "
                               f"the update's temporaries {_size(update.temp)} -> {_size(temp)}; "
                               f"now {kind!r})")]


def _state_advice(exp, compiled, need: int) -> list:
  """More FSDP (the state splits over it) and a bfloat16 reference."""
  out = []
  shape = exp.layout.shape
  state = sum(compiled.state_bytes.values())
  f, batch = shape["fsdp"], shape["data"] * shape["fsdp"]
  if batch > f:
    want = math.ceil(f * state / (state - need)) if state > need else batch + 1
    pick = min((d for d in programs_lib.divisors(batch) if d >= want), default=batch)
    note = "" if pick >= want else "; the most these devices allow, not enough alone"
    out.append((state, f"--config.mesh.fsdp={pick} --config.mesh.data={batch // pick} (the "
                       f"train state, {_size(state)}, splits over fsdp; now fsdp={f}{note})"))
  elif state > need:  # else even endless devices would not make room: no advice
    out.append((state, f"--config.mesh.fsdp=<more> (the train state, {_size(state)}, splits "
                       f"over fsdp; fsdp={f} of {batch} batch-parallel devices: add devices)"))
  ref = compiled.state_bytes["ref_params"]
  if compiled.ref_itemsize > 2:
    out.append((ref / 2, f"--config.model.ref_dtype=bfloat16 (halves the reference, "
                         f"{_size(ref)} of {8 * compiled.ref_itemsize}-bit floats)"))
  return out


def advice(algo, compiled, limit: int, accelerator: bool = False) -> list[str]:
  """The settings to turn when a program's peak exceeds `limit` bytes, the largest consumer
  first, with values computed where the scaling is known."""
  exp = algo.exp
  over = {n: m.peak - limit for n, m in compiled.programs.items() if m.peak > limit}
  if not over:
    return []
  items = []
  name = _activations_program(compiled.programs)
  if name in over:
    items += _microbatch_advice(algo, name, compiled.programs[name], over[name], accelerator)
    items += _attention_advice(algo, name, compiled.programs[name], over[name], accelerator)
  items += _state_advice(exp, compiled, max(over.values()))
  items += slots_lib.advice(algo, compiled, limit, over, accelerator)
  if ("decode" in over or "engine" in over) and exp.rollout_shape.unstacked:
    # The layers whole on each device, at most as stored (an accelerator holds them in the
    # activation dtype, XLA:CPU in float32).
    layers = sampler_args.layer_bytes_per_device(exp) * exp.model_config.num_layers
    items.append((layers, f"--config.rloo.decode_layers=scanned (the decode loop's per-layer "
                          f"copy of the policy's layers, up to {_size(layers)}, goes; under FSDP "
                          f"the layers are then gathered one at a time at every token)"))
  items.sort(key=lambda item: -item[0])
  return [text for _, text in items]


def _with_hoists(algo, names, compiled) -> dict:
  """`compiled`'s programs (compiled with ACCELERATOR_OPTIONS) with what an accelerator's
  loop-invariant code motion adds to each, measured: the same programs with every float in
  float32 (where XLA:CPU converts nothing, so the pass hoists only what it would anywhere:
  the FSDP-gathered head out of the log-prob chunks and the decode loop, say) compiled with
  and without the pass, the difference scaled to the bytes per float of the weights the
  program runs (what the hoists copy)."""
  exp = algo.exp
  config = exp.config.copy_and_resolve_references()
  for key in ("dtype", "param_dtype", "ref_dtype"):
    config.model[key] = "float32"
  twin = type(algo)(experiment.build_abstract(config, devices=list(exp.layout.mesh.devices.flat),
                                              num_layers=exp.model_config.num_layers))
  with_pass = programs_lib.compile_programs(twin, names).programs
  without = programs_lib.compile_programs(twin, names,
                                          options=programs_lib.ACCELERATOR_OPTIONS).programs
  # The weights a program runs: the scoring pass the reference's; the others the policy's,
  # which with LoRA are the base's (the reference), the adapters being a few columns.
  policy = compiled.ref_itemsize if exp.model_config.lora_rank else compiled.params_itemsize
  itemsize = lambda name: compiled.ref_itemsize if name == "score" else policy
  return {n: dataclasses.replace(
              p, hoisted=int(max(with_pass[n].temp - without[n].temp, 0) * itemsize(n) / 4))
          for n, p in compiled.programs.items()}


def plan(algo, *, device_memory_gb: float = DEFAULT_DEVICE_MEMORY_GB,
         names=programs_lib.NAMES, accelerator: bool = False, speedups: bool = False,
         advise: bool = True, log=None) -> dict:
  """The memory plan of `algo` (an RLOO algorithm object, built by `experiment.build` or
  `build_abstract`): compiles its programs (`names`, default all) and returns the report.
  accelerator=True: the mesh's CPU devices stand for accelerators, which compute bf16 natively
  (`programs.ACCELERATOR_OPTIONS`); the plan of an N-chip job on simulated devices. A mesh of
  accelerators compiles as it runs, so it ignores the flag.
  speedups=True: a job that fits also gets `speedups`, the faster settings its spare memory
  allows, each compiled (`memory.speedups`: a few more compiles of the update and decode), said
  first through `log` when given.
  advise=False: no `advice` for a job that does not fit (its microbatch advice compiles the
  update at other sizes): for a caller that only asks whether it fits."""
  exp = algo.exp
  c, m, r = exp.config, exp.model_config, exp.rollout_shape
  accelerator = accelerator and exp.layout.platform == "cpu"
  compiled = programs_lib.compile_programs(
      algo, names, options=programs_lib.ACCELERATOR_OPTIONS if accelerator else None)
  if accelerator:
    compiled.programs = _with_hoists(algo, names, compiled)
  limit = int(device_memory_gb * GIB)
  peak = max(p.peak for p in compiled.programs.values())
  shape = dict(num_prompts=c.rloo.num_prompts, prompt_len=c.data.max_prompt_len, k=c.rloo.k,
               new_tokens=c.rloo.max_new_tokens, shared_prefix=bool(c.train.shared_prefix))
  f = flops_lib.model_flops_per_iteration(
      m, **shape, num_epochs=c.train.num_epochs, mode=c.rloo.sampler_mode,
      recompute_old=c.loss.get("old_logprobs", "sampler") == "recompute")
  f["remat_recompute"] = flops_lib.remat_recompute_flops(
      m, **shape, num_epochs=c.train.num_epochs, remat=m.remat,
      fused_head=algo.step_fn.fused_head)
  report = dict(
      peak_gb_per_device=_gb(peak), fits=bool(peak <= limit),
      params_gb=_gb(compiled.state_bytes["params"]),
      opt_state_gb=_gb(compiled.state_bytes["opt_state"]),
      ref_gb=_gb(compiled.state_bytes["ref_params"]),
      kv_cache_gb=_gb(compiled.kv_cache_bytes),
      reward_model_gb=_gb(compiled.reward_model_bytes),
      rollout_gb={k: _gb(v) for k, v in compiled.rollout_bytes.items()},
      programs={n: dict(peak_gb=_gb(p.peak), temp_gb=_gb(p.temp), argument_gb=_gb(p.argument),
                        output_gb=_gb(p.output), alias_gb=_gb(p.alias),
                        resident_gb=_gb(p.resident), hoisted_gb=_gb(p.hoisted),
                        compile_s=p.compile_s, flops=p.flops, bytes_accessed=p.bytes_accessed)
                for n, p in compiled.programs.items()},
      **programs_lib.microbatch(c),
      rollout_chunk_prompts=r.chunk,
      # The rollout engine's stream slots and prompt rows (0, 0: the static sampler).
      rollout_slots=r.slots, rollout_prefix_rows=r.prefix_rows, rollout_pages=r.pages,
      # Model FLOPs: rollout + reference + the old policy's + update (num_epochs passes over
      # every row); the backward's recompute is reported apart, not included.
      flops_per_iteration=int(f["rollout"] + f["reference"] + f["recompute"] + f["update"]),
      flops={k: int(v) for k, v in f.items()},
      update_steps=int(c.train.num_epochs * c.train.num_minibatches),
      devices=int(exp.layout.mesh.size), mesh=exp.layout.shape,
      # What compiled the programs: the mesh's devices ('tpu' / 'gpu' from a --target's
      # compiler, deviceless; 'cpu' for this host or simulated devices).
      platform=exp.layout.platform, device_kind=exp.layout.mesh.devices.flat[0].device_kind,
      device_memory_gb=float(device_memory_gb), num_layers=int(m.num_layers),
      num_params=int(m.num_params), remat=m.remat, dtype=m.dtype,
      # LoRA: params_gb / opt_state_gb are the adapters', ref_gb the frozen base (held once).
      lora=dict(rank=m.lora_rank, targets=list(m.lora_targets),
                adapter_params=lora.num_params(m)) if m.lora_rank else None,
      # Compiled as for an accelerator on this CPU (programs.ACCELERATOR_OPTIONS).
      accelerator_view=bool(accelerator),
      advice=advice(algo, compiled, limit, accelerator) if advise else [],
      speedups=(speedups_lib.speedups(algo, compiled, limit, accelerator, shape=shape, flops=f,
                                      log=log) if speedups and "update" in names else []))
  return report


def format_table(r: dict) -> str:
  """The report as a readable table (GiB per device)."""
  mesh = " ".join(f"{k}={v}" for k, v in r["mesh"].items())
  lines = [f"memory plan per device (GiB) | {r['devices']} x {r.get('device_kind', 'device')}, "
           f"mesh {mesh} | "
           f"{r['num_layers']} layers, {r['num_params'] / 1e9:.3f}B params, {r['dtype']}, "
           f"remat={r['remat']} | device memory {r['device_memory_gb']:g} GiB",
           f"  params            {r['params_gb']:10.4g}",
           f"  optimizer state   {r['opt_state_gb']:10.4g}",
           f"  reference         {r['ref_gb']:10.4g}",
           f"  KV cache          {r['kv_cache_gb']:10.4g}  (one rollout chunk of "
           f"{r['rollout_chunk_prompts']} prompts" + (
               f"; the engine's {r['rollout_slots']} stream slots + "
               f"{r['rollout_prefix_rows']} prompt rows" + (
                   f", its streams' KV in {r['rollout_pages']} pages)" if r.get("rollout_pages")
                   else ")") if r.get("rollout_slots") else ")"),
           *([f"  reward model      {r['reward_model_gb']:10.4g}  (hf_reward_model:, resident)"]
             if r.get("reward_model_gb") else []),
           f"  {'program':16}{'peak':>10}{'temp':>10}{'args':>10}{'out':>10}{'alias':>10}"
           f"{'resident':>10}{'compile_s':>11}{'TFLOP':>10}{'GB moved':>10}"]
  for name, p in r["programs"].items():
    gb = "".join(f"{p[k]:10.4g}" for k in ("peak_gb", "temp_gb", "argument_gb", "output_gb",
                                             "alias_gb", "resident_gb"))
    # The compiler's cost analysis per device (GPU compilers give none: '-').
    cost = "".join(f"{p[k] / d:{w}.4g}" if p.get(k) is not None else f"{'-':>{w}}"
                   for k, d, w in (("flops", 1e12, 10), ("bytes_accessed", 1e9, 10)))
    lines.append(f"  {PROGRAM_LABELS[name]:16}{gb}{p['compile_s']:11.1f}{cost}")
  f = r["flops"]
  mb = (f"packed rows of {r['microbatch_tokens']} tokens, one a batch shard"
        if r["microbatch_tokens"] else f"{r['microbatch_rows']} rows "
        f"({r['microbatch_groups']:g} groups), {r['microbatches']} per minibatch")
  lines += [f"  microbatch: {mb}; {r['update_steps']} update steps an iteration",
            f"  model FLOPs per iteration: {r['flops_per_iteration']:.3e} (rollout "
            f"{f['rollout']:.3e}, reference {f['reference']:.3e}, "
            + (f"old policy {f['recompute']:.3e}, " if f["recompute"] else "")
            + f"update {f['update']:.3e}; remat recompute {f['remat_recompute']:.3e} not "
            "included)",
            f"  peak {r['peak_gb_per_device']:.4g} GiB of {r['device_memory_gb']:g}: "
            f"{'fits' if r['fits'] else 'DOES NOT FIT'}"]
  hoisted = {n: p["hoisted_gb"] for n, p in r["programs"].items() if p.get("hoisted_gb")}
  if r.get("accelerator_view"):
    lines.append("  compiled as for an accelerator (no float32 copies of bf16 weights); peak "
                 "includes the loop-invariant hoists it makes: "
                 + (", ".join(f"{PROGRAM_LABELS[n]} {g:.4g}" for n, g in hoisted.items())
                    or "none"))
  if r.get("estimate"):
    lines.append(f"  estimate: {r['estimate']}")
  lines += [f"  advice: {a}" for a in r["advice"]]
  lines += [f"  faster, and fits: {s['text']}" for s in r.get("speedups", ())]
  return "\n".join(lines)


def device_memory_gb(exp, log=None) -> float:
  """What the mesh's first local device may allocate, GiB; where its backend does not say,
  DEFAULT_DEVICE_MEMORY_GB (said in `log`)."""
  device = exp.layout.mesh.local_devices[0]
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  if (stats or {}).get("bytes_limit"):
    return int(stats["bytes_limit"]) / GIB
  if log is not None:
    log(f"[plan] the device reports no memory limit; planning for {DEFAULT_DEVICE_MEMORY_GB:g} "
        "GiB")
  return DEFAULT_DEVICE_MEMORY_GB


def checks(exp) -> bool:
  """Whether config.train.check_memory plans this job: on, and its mesh of accelerators."""
  return bool(exp.config.train.get("check_memory", True)) and exp.layout.platform != "cpu"


def check(algo, *, log=print, bytes_limit: Optional[int] = None,
          report: Optional[dict] = None) -> Optional[dict]:
  """config.train.check_memory: when the job's mesh is of accelerators, plans the RLOO job with
  their memory (`bytes_limit`: default, `device_memory_gb`) and raises DoesNotFit naming the
  settings to turn; on a mesh of CPU devices it does nothing (`RLOO.preflight` calls it; PPO
  and DPO, which the plan does not cover, only say so). `report`: this job's plan at that
  memory, already made (`budget.resolve`)."""
  exp = algo.exp
  if not checks(exp):
    return None
  gb = bytes_limit / GIB if bytes_limit else device_memory_gb(exp, log)
  if report is None:
    report = plan(algo, device_memory_gb=gb)
  log(format_table(report))
  if not report["fits"]:
    worst = max(report["programs"].items(), key=lambda kv: kv[1]["peak_gb"])
    raise DoesNotFit(
        f"the job needs {report['peak_gb_per_device']:.2f} GiB per device (the "
        f"{PROGRAM_LABELS[worst[0]]}) but the device has {gb:.2f} GiB; set "
        + "; or ".join(report["advice"] or ["a smaller batch"])
        + " (config.train.check_memory=False skips this check)")
  return report

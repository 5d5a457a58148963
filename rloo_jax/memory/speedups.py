"""What a job that fits could spend its spare device memory on to run faster, each setting
compiled and checked to fit (`memory.plan`'s `speedups`, printed by `python -m rloo_jax.plan`).

- Less recomputation: `config.model.remat='dots'` keeps the layers' matmul outputs for the
  backward instead of recomputing the whole layer forward ('full'): the update then runs about
  a forward fewer of the trunk per step. Saved FLOPs are the plan's own count
  (`flops.remat_recompute_flops`).
- Bigger microbatches: fewer, larger matmuls per update step, and under FSDP each layer's
  weights gathered (and its gradient reduce-scattered) once per microbatch, so fewer of them.
- The decode on whole layers under FSDP: `config.rloo.decode_layers='unstacked'` gathers every
  layer once a rollout (in the activation dtype) instead of at every token, for the price of
  the whole model held gathered while it decodes (`models.decode_weights`). XLA:CPU keeps
  that copy in float32 where an accelerator keeps bfloat16, so the decode peak checked here
  is the larger one.

Each candidate is compiled with the job's shardings and compiler options, so its peak is a
compiled figure, not an estimate; every one must stay within `HEADROOM` of the device (room
for the allocator's fragmentation). Each is measured alone: after applying one, plan again.
"""

from __future__ import annotations

import jax.numpy as jnp

from rloo_jax import sampler_args
from rloo_jax.memory import flops as flops_lib
from rloo_jax.memory import programs as programs_lib

GIB = 2 ** 30
HEADROOM = 0.9  # a suggested setting's peak stays within this fraction of the device memory
# Recomputation in the backward, least first (`models.config.REMAT_POLICIES`).
_REMAT_ORDER = ("none", "dots", "full")


def _update_peak(algo, config, accelerator: bool, hoisted: int, rebuild: bool) -> int:
  """The largest peak of the update programs of `algo` under `config` (one compile), plus the
  loop-invariant hoists measured for the job (`hoisted`: they copy weights, which neither
  setting changes). rebuild: the model changes (remat), so the experiment is built again."""
  programs = programs_lib.compile_at(algo, config, accelerator=accelerator, rebuild=rebuild)
  return max(p.peak for p in programs.values()) + hoisted


def _remat(algo, limit: int, accelerator: bool, hoisted: int, shape: dict,
           executed: float) -> list:
  c, m = algo.exp.config, algo.exp.model_config
  now = m.remat
  recompute = lambda r: flops_lib.remat_recompute_flops(  # noqa: E731
      m, **shape, num_epochs=c.train.num_epochs, remat=r)
  # One step down: 'full' -> 'dots' saves the trunk's forward; 'dots' -> 'none' only the
  # attention products, for their [heads, T, T] probabilities kept (rarely worth it).
  if now not in _REMAT_ORDER[1:]:  # none already, or 'names': no order to step down
    return []
  remat = _REMAT_ORDER[_REMAT_ORDER.index(now) - 1]
  config = c.copy_and_resolve_references()
  config.model.remat = remat
  peak = _update_peak(algo, config, accelerator, hoisted, rebuild=True)
  saved = recompute(now) - recompute(remat)
  if peak > HEADROOM * limit or saved <= 0:
    return []
  return [dict(setting=f"--config.model.remat={remat}", peak_gb=peak / GIB,
               flops_saved=int(saved), fraction_saved=saved / executed,
               text=(f"--config.model.remat={remat} (now {now!r}): {saved:.3g} fewer FLOPs an "
                     f"iteration, {100 * saved / executed:.0f}% of what it executes; update "
                     f"peak {peak / GIB:.3g} GiB"))]


def _microbatch(algo, limit: int, accelerator: bool, hoisted: int, current_peak: int) -> list:
  """The largest microbatch whose update fits: the two compiles' affine fit of the peak in the
  microbatch size picks it, and it is compiled to check."""
  exp, c = algo.exp, algo.exp.config
  grouped = bool(c.train.shared_prefix)
  mb = programs_lib.microbatch(c)
  size, m = mb["microbatch_size"], mb["microbatches"]
  if mb["microbatch_tokens"]:  # packed: the budget, not a microbatch size, sets the rows
    return _packed_budget(algo, limit, accelerator, hoisted)
  units = size * m
  rows = lambda d: d * c.rloo.k if grouped else d  # noqa: E731
  valid = [d for d in programs_lib.divisors(units) if d > size
           and rows(d) % exp.layout.batch_parallelism == 0]
  if m == 1 or not valid:
    return []

  def peak_at(d):
    config = c.copy_and_resolve_references()
    config.train.microbatch_size = d
    return _update_peak(algo, config, accelerator, hoisted, rebuild=False)

  probe = valid[0]
  at_probe = peak_at(probe)
  if at_probe > HEADROOM * limit:
    return []
  slope = (at_probe - current_peak) / (probe - size)
  fitting = [d for d in valid if current_peak + slope * (d - size) <= HEADROOM * limit]
  pick, peak = probe, at_probe
  if max(fitting, default=probe) > probe:
    guess = max(fitting)
    at_guess = peak_at(guess)
    if at_guess <= HEADROOM * limit:
      pick, peak = guess, at_guess
  unit = "groups" if grouped else "rows"
  return [dict(setting=f"--config.train.microbatch_size={pick}", peak_gb=peak / GIB,
               microbatches=units // pick,
               text=(f"--config.train.microbatch_size={pick} ({unit}; now {size}): "
                     f"{units // pick} microbatches a minibatch instead of {m}: bigger "
                     f"matmuls, and (FSDP) each layer gathered {units // pick} times a step "
                     f"instead of {m}; update peak {peak / GIB:.3g} GiB"))]


def _packed_budget(algo, limit: int, accelerator: bool, hoisted: int) -> list:
  """Packed rows of 2x, then 4x the token budget while the update fits: fewer, longer rows."""
  c = algo.exp.config
  now = int(c.train.microbatch_tokens)
  pick = None
  for budget in (2 * now, 4 * now):
    config = c.copy_and_resolve_references()
    config.train.microbatch_tokens = budget
    peak = _update_peak(algo, config, accelerator, hoisted, rebuild=False)
    if peak > HEADROOM * limit:
      break
    pick = (budget, peak)
  if pick is None:
    return []
  budget, peak = pick
  return [dict(setting=f"--config.train.microbatch_tokens={budget}", peak_gb=peak / GIB,
               text=(f"--config.train.microbatch_tokens={budget} (now {now}): about "
                     f"{budget // now}x fewer packed microbatches, each row longer; update peak "
                     f"{peak / GIB:.3g} GiB"))]


def _decode_layers(algo, limit: int, accelerator: bool) -> list:
  exp, c, m = algo.exp, algo.exp.config, algo.exp.model_config
  fsdp = exp.layout.shape["fsdp"]
  # Only FSDP re-gathers a layer at every token; LoRA would hold its frozen base twice.
  if fsdp == 1 or exp.rollout_shape.unstacked or m.lora_rank:
    return []
  config = c.copy_and_resolve_references()
  config.rloo.decode_layers = "unstacked"
  # The decode loop's program: the static sampler's decode, or the rollout engine's one.
  name = "engine" if exp.rollout_shape.slots else "decode"
  peak = programs_lib.compile_at(algo, config, ("start", "decode"),
                                 accelerator=accelerator)[name].peak
  if peak > HEADROOM * limit:
    return []
  # What each device receives a token scanned: every layer but its own shard of it.
  per_token = (sampler_args.layer_bytes(m, jnp.dtype(m.dtype).itemsize, exp.layout.shape["tensor"])
               * m.num_layers * (fsdp - 1) / fsdp)
  return [dict(setting="--config.rloo.decode_layers=unstacked", peak_gb=peak / GIB,
               gathered_per_token_gb=per_token / GIB,
               text=(f"--config.rloo.decode_layers=unstacked (now scanned): "
                     f"every layer gathered once a rollout instead of at every token, "
                     f"{per_token / GIB:.3g} GiB of all-gathers a token fewer per device; "
                     f"{'rollout engine' if name == 'engine' else 'decode'} peak "
                     f"{peak / GIB:.3g} GiB"))]


def speedups(algo, compiled, limit: int, accelerator: bool = False, *, shape: dict,
             flops: dict, log=None) -> list[dict]:
  """[{setting, peak_gb, text, ...}]: settings that make the job faster and still fit within
  HEADROOM of `limit` bytes, each compiled. Empty when the job does not fit as it is.
  `shape` and `flops`: the plan's batch shape and its FLOPs an iteration (`memory.plan`: the
  model FLOPs and the backward's recompute, which together are what it executes)."""
  if max(p.peak for p in compiled.programs.values()) > limit:
    return []
  if log:  # XLA warns of a variant that does not fit (e.g. a remat it cannot reach) as it goes
    log("[plan] the job fits: compiling the faster settings its spare memory allows "
        "(--nospeedups skips them); an XLA warning from here on is about one of those")
  names = [n for n in compiled.programs if n.split("_")[0] == "update"]
  hoisted = max(compiled.programs[n].hoisted for n in names)
  current = max(compiled.programs[n].peak for n in names)
  return (_remat(algo, limit, accelerator, hoisted, shape, sum(flops.values()))
          + _microbatch(algo, limit, accelerator, hoisted, current)
          + (_decode_layers(algo, limit, accelerator)
             if {"decode", "engine"} & set(compiled.programs) else []))

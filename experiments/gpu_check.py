r"""Issue 21's accelerator figures, in one short run: the decode loop's tokens/s against the HBM
roofline, and the update step's MFU, on a preset's architecture with random weights.

- Decode: `sampler.start` (prefill + first token) then `sampler.decode_loop` timed apart, in the
  run's dtype with the weights stored in it too (a bf16 model; `--param_dtype float32` for a
  training policy's master weights, which the decode casts once), once per `--decode_layers`
  layout (the layer scan; per-layer weights and KV buffers). A decode step's roofline: the bytes
  it must read (every parameter once, the KV cache as the sampler lays it out) over
  `--hbm_tbps`. Prints `decode_tokens_per_s`, `roofline_tokens_per_s` and their ratio
  `roofline_over_measured` (issue 21: within 2x).
- Update: RLOO iterations of bench_step.py's synthetic task at this shape (float32 master
  weights, bf16 activations), `update_s` their median; MFU = the update's model FLOPs
  (`memory.flops`, rematerialisation not counted) / update_s / `--peak_tflops` (issue 21: >= 40%).
- Memory (`--checks memory`): the job `rloo_jax.plan` plans for configs/arithmetic.py at these
  shape flags on one device, its programs compiled here, then one real iteration; the device's
  measured peak beside the plan's (issue 37; docs/SCALE.md figure 8).

Defaults: Llama-3.2-1B, 64 prompts x k = 4 x (512 + 256), an H200 (4.8 TB/s, 989 TFLOP/s bf16).
On a CPU only as a smoke run (tiny shapes, figures meaningless):

    python experiments/gpu_check.py                                  # on the GPU
    python experiments/gpu_check.py --preset pythia-160m --num_layers 1 --prompts 2 \
        --prompt_len 16 --new_tokens 8 --iterations 1 --repeats 1 --microbatch_size 0  # CPU smoke
"""
import argparse
import json
import os
import statistics
import tempfile
import time

import numpy as np

import jax
import jax.numpy as jnp

import bench_step  # experiments/, beside this file

from rloo_jax import memory, sampler, sampling
from rloo_jax.config_utils import base_config, load_config_file
from rloo_jax.memory.flops import model_flops_per_iteration
from rloo_jax.models import decode_weights, presets, transformer


def _sig(x: float) -> float:
  """x to 5 significant figures (CPU and GPU figures span orders of magnitude)."""
  return float(f"{x:.5g}")


def timed(fn, repeats):
  """(median seconds, last result) of `fn()` run to completion `repeats` times after one
  untimed (compiling) run."""
  out = jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return statistics.median(times), out


def decode_check(args) -> dict:
  m = presets.get(args.preset, dtype=args.dtype, param_dtype=args.param_dtype or args.dtype,
                  max_seq_len=args.prompt_len + args.new_tokens,
                  **({"num_layers": args.num_layers} if args.num_layers else {}))
  graphdef, params = transformer.create(m, seed=0)
  fns = transformer.model_fns(graphdef)
  rng = np.random.default_rng(0)
  prompts = jnp.asarray(rng.integers(3, m.vocab_size, (args.prompts, args.prompt_len)),
                        jnp.int32)
  lengths = jnp.full((args.prompts,), args.prompt_len, jnp.int32)
  return {layout: _decode_one(args, m, fns, params, prompts, lengths, layout == "unstacked")
          for layout in args.decode_layers.split(",")}


def _decode_one(args, m, fns, params, prompts, lengths, unstack) -> dict:
  stops, pad = jnp.asarray([-1], jnp.int32), jnp.int32(0)  # no end token: every step runs
  method = sampling.Temperature(1.0)
  start = lambda: sampler.start(  # noqa: E731
      fns, params, prompts, lengths, jax.random.PRNGKey(0), stops, pad, k=args.k,
      max_new_tokens=args.new_tokens, method=method, mode="shared", unstack_layers=unstack)
  start_s, state = timed(start, args.repeats)
  cache = state.cache
  # The decode loop donates its state: a fresh start for every run, outside the timing.
  loop = lambda s: sampler.decode_loop(fns, params, s, stops, pad, method=method,  # noqa: E731
                                       mode="shared", unstack_layers=unstack)
  jax.block_until_ready(loop(start()))
  times = []
  for _ in range(args.repeats):
    s = jax.block_until_ready(start())
    t0 = time.perf_counter()
    jax.block_until_ready(loop(s).tokens_bkt)
    times.append(time.perf_counter() - t0)
  decode_s = statistics.median(times)
  steps = args.new_tokens - 1
  # What a step must read: every weight once, as the decode reads it (cast to the activation
  # dtype, `models.decode_weights`).
  weight_bytes = sum(x.size * x.dtype.itemsize
                     for x in jax.tree.leaves(decode_weights.cast(m, params)))
  kv_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache)
                 if hasattr(x, "dtype") and x.ndim >= 4)
  step_roofline_s = (weight_bytes + kv_bytes) / (args.hbm_tbps * 1e12)
  streams = args.prompts * args.k
  measured = streams * steps / decode_s
  roofline = streams / step_roofline_s
  return dict(start_s=round(start_s, 5), decode_s=round(decode_s, 5), decode_steps=steps,
              streams=streams, weight_gb=weight_bytes / 1e9, kv_cache_gb=kv_bytes / 1e9,
              decode_step_ms=_sig(1e3 * decode_s / steps),
              roofline_step_ms=_sig(1e3 * step_roofline_s),
              decode_tokens_per_s=_sig(measured), roofline_tokens_per_s=_sig(roofline),
              roofline_over_measured=_sig(roofline / measured))


def _bench_job(c, args):
  """`c` set to the flags' model and shape on the bench task (the synthetic reward); the task."""
  c.task = "bench"
  c.model.update(preset=args.preset, dtype=args.dtype, attention=args.attention)
  if args.num_layers:  # the preset's family and widths at this depth
    m = presets.get(args.preset, num_layers=args.num_layers)
    c.model.update(preset="", **{k: getattr(m, k) for k in (
        "family", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
        "intermediate_size")})
  c.data.max_prompt_len = args.prompt_len
  c.rloo.update(k=args.k, num_prompts=args.prompts, max_new_tokens=args.new_tokens)
  c.rewards.fns = [bench_step.synthetic_reward]
  c.rewards.weights = [1.0]
  return bench_step.bench_task(presets.get(args.preset).vocab_size, args.prompt_len,
                               fixed_length=True)


def update_check(args) -> dict:
  c = base_config()
  c.model.update(remat=args.remat, max_seq_len=args.prompt_len + args.new_tokens)
  task = _bench_job(c, args)
  c.train.update(num_epochs=1, num_minibatches=1, microbatch_size=args.microbatch_size)
  with tempfile.TemporaryDirectory() as workdir:
    algo, state = bench_step.build(c, task, workdir)
    data = bench_step.prompt_batches(task, args.prompts, args.prompt_len)
    state, _ = algo.iteration(state, next(data))  # compiles
    rows = []
    for _ in range(args.iterations):
      state, metrics = algo.iteration(state, next(data))
      rows.append(metrics)
    m = algo.exp.model_config
  update_s = float(np.median([r["update_s"] for r in rows]))
  flops = model_flops_per_iteration(m, args.prompts, args.prompt_len, args.k, args.new_tokens)
  mfu = flops["update"] / update_s / (args.peak_tflops * 1e12)
  return dict(update_s=round(update_s, 5), update_flops=flops["update"],
              update_tflops=round(flops["update"] / update_s / 1e12, 2), update_mfu=round(mfu, 4),
              iteration_s=round(float(np.median([r["iteration_s"] for r in rows])), 5),
              num_params=int(m.num_params))


def memory_check(args) -> dict:
  """The job `python -m rloo_jax.plan --config=configs/arithmetic.py` plans with these shape flags
  (one device), on the bench task at the preset's vocabulary: its programs compiled for this
  device (the plan), then one real RLOO iteration from random weights, and the device's
  measured peak (`memory_stats()['peak_bytes_in_use']`) beside the plan's peak."""
  c = load_config_file(os.path.join(os.path.dirname(__file__), "..", "configs", "arithmetic.py"))
  task = _bench_job(c, args)
  c.mesh.update(data=1, fsdp=1)
  device = jax.devices()[0]
  with tempfile.TemporaryDirectory() as workdir:
    algo, state = bench_step.build(c, task, workdir)
    limit = (device.memory_stats() or {}).get("bytes_limit")  # None on a CPU (smoke runs)
    report = memory.plan(algo, device_memory_gb=limit / 2**30 if limit else 80.0)
    data = bench_step.prompt_batches(task, args.prompts, args.prompt_len)
    t0 = time.perf_counter()
    state, metrics = algo.iteration(state, next(data))
    jax.block_until_ready(state)
    iteration_s = time.perf_counter() - t0
  stats = device.memory_stats() or {}
  planned = report["peak_gb_per_device"]
  measured = stats["peak_bytes_in_use"] / 2**30 if stats else None
  return dict(planned_peak_gb=round(planned, 3),
              planned_programs_gb={k: round(v["peak_gb"], 3)
                                   for k, v in report["programs"].items()},
              measured_peak_gb=round(measured, 3) if stats else None,
              bytes_limit_gb=round(limit / 2**30, 3) if limit else None,
              measured_over_planned=round(measured / planned, 3) if stats else None,
              first_iteration_s=round(iteration_s, 2), num_params=report["num_params"],
              reward_mean=float(metrics["reward_mean"]), loss=float(metrics["loss"]))


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--preset", default="llama-3.2-1b")
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--param_dtype", default="",
                 help="the decode's stored weights ('' = --dtype; float32: a training policy's)")
  p.add_argument("--num_layers", type=int, default=0, help="0: the preset's depth (smoke runs)")
  p.add_argument("--attention", default="auto", help="config.model.attention (update, memory)")
  p.add_argument("--decode_layers", default="scanned,unstacked",
                 help="decode layouts timed (config.rloo.decode_layers), each its own entry")
  p.add_argument("--prompts", type=int, default=64)
  p.add_argument("--k", type=int, default=4)
  p.add_argument("--prompt_len", type=int, default=512)
  p.add_argument("--new_tokens", type=int, default=256)
  p.add_argument("--remat", default="dots")
  p.add_argument("--microbatch_size", type=int, default=16, help="groups (0: the minibatch)")
  p.add_argument("--repeats", type=int, default=3, help="timed decode runs")
  p.add_argument("--iterations", type=int, default=3, help="timed RLOO iterations")
  p.add_argument("--hbm_tbps", type=float, default=4.8, help="H200: 4.8 TB/s")
  p.add_argument("--peak_tflops", type=float, default=989.0, help="H200 dense bf16")
  p.add_argument("--checks", default="decode,update",
                 help="of decode, update, memory (the plan beside one real iteration's peak)")
  args = p.parse_args()
  bad = set(args.decode_layers.split(",")) - {"scanned", "unstacked"}
  if bad:  # before any model is built
    p.error(f"--decode_layers {args.decode_layers!r}: {sorted(bad)} not among scanned, unstacked")
  out = dict(config=vars(args), backend=jax.default_backend(),
             device=str(jax.devices()[0].device_kind))
  if "decode" in args.checks:
    out["decode"] = decode_check(args)
  if "update" in args.checks:
    out["update"] = update_check(args)
  if "memory" in args.checks:
    out["memory"] = memory_check(args)
  print(json.dumps(out), flush=True)


if __name__ == "__main__":
  main()

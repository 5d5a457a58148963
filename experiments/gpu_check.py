r"""Issue 21's accelerator figures in one short run on a preset's architecture, random weights
(docs/PERFORMANCE.md, docs/SCALE.md figure 8). `--checks`: decode (`sampler.start`, then
`sampler.decode_loop` per `--decode_layers` layout, against the roofline: every weight once plus
the KV cache over `--hbm_tbps`), update (RLOO iterations of bench_step.py's task; MFU: the update's
`memory.flops` / median seconds / `--peak_tflops`), memory (configs/arithmetic.py's plan at these
shape flags on one device beside one real iteration's peak). Defaults: Llama-3.2-1B, 64 prompts x
k = 4 x (512 + 256), an H200; a CPU only as a smoke run:

    python experiments/gpu_check.py                                  # on the GPU
    python experiments/gpu_check.py --preset pythia-160m --num_layers 1 --vocab_size 2048 \
        --prompts 2 --prompt_len 16 --new_tokens 8 --iterations 1 --repeats 1 --microbatch_size 0
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


def median_s(run, repeats, setup=lambda: None) -> float:
  """Median seconds of `run(setup())` over `repeats` calls after an untimed (compiling) one;
  `setup` runs outside the timing (the decode loop donates its state: a fresh one each call)."""
  jax.block_until_ready(run(setup()))
  times = []
  for _ in range(repeats):
    x = jax.block_until_ready(setup())
    t0 = time.perf_counter()
    jax.block_until_ready(run(x))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def decode_check(args) -> dict:
  m = presets.get(args.preset, dtype=args.dtype, param_dtype=args.param_dtype or args.dtype,
                  max_seq_len=args.prompt_len + args.new_tokens, **_shrunk(args))
  graphdef, params = transformer.create(m, seed=0)
  fns = transformer.model_fns(graphdef)
  ids = np.random.default_rng(0).integers(3, m.vocab_size, (args.prompts, args.prompt_len))
  prompts = jnp.asarray(ids, jnp.int32)
  lengths = jnp.full((args.prompts,), args.prompt_len, jnp.int32)
  stops, pad = jnp.asarray([-1], jnp.int32), jnp.int32(0)  # no end token: every step runs
  method = sampling.Temperature(1.0)
  # A step reads every weight once, cast to the activation dtype (`models.decode_weights`).
  weight_bytes = sum(x.size * x.dtype.itemsize
                     for x in jax.tree.leaves(decode_weights.cast(m, params)))
  out, sig = {}, lambda x: float(f"{x:.5g}")  # 5 significant figures  # noqa: E731
  for layout in args.decode_layers.split(","):
    kw = dict(method=method, mode="shared", unstack_layers=layout == "unstacked")
    start = lambda: sampler.start(fns, params, prompts, lengths, jax.random.PRNGKey(0),  # noqa
                                  stops, pad, k=args.k, max_new_tokens=args.new_tokens, **kw)
    start_s = median_s(lambda _: start(), args.repeats)
    decode_s = median_s(lambda s: sampler.decode_loop(fns, params, s, stops, pad, **kw).tokens_bkt,
                        args.repeats, start)
    kv_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(start).cache)
                   if hasattr(x, "dtype") and x.ndim >= 4)
    steps, streams = args.new_tokens - 1, args.prompts * args.k
    step_roofline_s = (weight_bytes + kv_bytes) / (args.hbm_tbps * 1e12)
    measured, roofline = streams * steps / decode_s, streams / step_roofline_s
    out[layout] = dict(
        start_s=round(start_s, 5), decode_s=round(decode_s, 5), decode_steps=steps,
        streams=streams, weight_gb=weight_bytes / 1e9, kv_cache_gb=kv_bytes / 1e9,
        decode_step_ms=sig(1e3 * decode_s / steps), roofline_step_ms=sig(1e3 * step_roofline_s),
        decode_tokens_per_s=sig(measured), roofline_tokens_per_s=sig(roofline),
        roofline_over_measured=sig(roofline / measured))
  return out


def _shrunk(args) -> dict:
  """The preset's overrides of --num_layers and --vocab_size (smoke runs), those set."""
  return {k: getattr(args, k) for k in ("num_layers", "vocab_size") if getattr(args, k)}


def bench_job(c, args):
  """`c` set to the flags' model and shape on the bench task (the synthetic reward); the task."""
  c.task = "bench"
  c.model.update(preset=args.preset, dtype=args.dtype, attention=args.attention)
  m = presets.get(args.preset, **_shrunk(args))
  if _shrunk(args):  # the preset's family and widths at this depth (the task sets the vocab)
    c.model.update(preset="", **{k: getattr(m, k) for k in (
        "family", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
        "intermediate_size")})
  c.data.max_prompt_len = args.prompt_len
  c.rloo.update(k=args.k, num_prompts=args.prompts, max_new_tokens=args.new_tokens)
  c.rewards.update(fns=[bench_step.synthetic_reward], weights=[1.0])
  return bench_step.bench_task(m.vocab_size, args.prompt_len, fixed_length=True)


def update_check(args) -> dict:
  c = base_config()
  c.model.update(remat=args.remat, max_seq_len=args.prompt_len + args.new_tokens)
  task = bench_job(c, args)
  c.train.update(num_epochs=1, num_minibatches=1, microbatch_size=args.microbatch_size)
  with tempfile.TemporaryDirectory() as workdir:
    algo, state = bench_step.build(c, task, workdir)
    data = bench_step.prompt_batches(task, args.prompts, args.prompt_len)
    rows = []
    for i in range(1 + args.iterations):  # the first compiles
      state, metrics = algo.iteration(state, next(data))
      rows += [metrics] if i else []
    m = algo.exp.model_config
  update_s = float(np.median([r["update_s"] for r in rows]))
  flops = model_flops_per_iteration(m, args.prompts, args.prompt_len, args.k, args.new_tokens)
  mfu = flops["update"] / update_s / (args.peak_tflops * 1e12)
  return dict(update_s=round(update_s, 5), update_flops=flops["update"],
              update_tflops=round(flops["update"] / update_s / 1e12, 2), update_mfu=round(mfu, 4),
              iteration_s=round(float(np.median([r["iteration_s"] for r in rows])), 5),
              num_params=int(m.num_params))


def memory_check(args) -> dict:
  """configs/arithmetic.py's plan on the bench task beside one iteration's `peak_bytes_in_use`."""
  c = load_config_file(os.path.join(os.path.dirname(__file__), "..", "configs", "arithmetic.py"))
  task = bench_job(c, args)
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
  p.add_argument("--vocab_size", type=int, default=0, help="0: the preset's (smoke runs)")
  p.add_argument("--attention", default="auto", help="config.model.attention (update, memory)")
  p.add_argument("--decode_layers", default="scanned,unstacked",
                 help="decode layouts timed (config.rloo.decode_layers), each its own entry")
  for flag, default in (("prompts", 64), ("k", 4), ("prompt_len", 512), ("new_tokens", 256)):
    p.add_argument(f"--{flag}", type=int, default=default)
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
  for name, check in (("decode", decode_check), ("update", update_check), ("memory", memory_check)):
    if name in args.checks:
      out[name] = check(args)
  print(json.dumps(out), flush=True)


if __name__ == "__main__":
  main()

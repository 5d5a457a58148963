r"""Loading a real-size checkpoint onto a mesh (docs/SCALE.md "Loading"): a random
Qwen2.5-1.5B-shaped float32 checkpoint (about 6 GB, transformers' layout), written once by a
process of its own, loaded by `hf.load_checkpoint(..., shardings=...)` onto N simulated CPU
devices (fsdp=N) in a fresh process. One JSON line: parameter bytes, baseline and peak RSS and
their ratios to them, the RSS after the load (anonymous and file-backed), the seconds.

    python experiments/sharded_load.py --dir /tmp/qwen2.5-1.5b-random --devices 8 [--unsharded]
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time

# The checkout's package, so the command runs from a clone without an install.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write_checkpoint(path: str, preset: str):
  """A random `preset` checkpoint, float32, ~2 GiB safetensors shards, by `hf_export`."""
  from rloo_jax.models import hf_export, presets, transformer  # pylint: disable=C0415
  config = presets.get(preset, dtype="float32", param_dtype="float32")
  hf_export.save_pretrained(transformer.create(config, seed=0)[1], config, path, dtype="float32",
                            max_shard_bytes=2 * 2**30)


def _rss_now() -> dict:
  """Resident memory now: anonymous (heap, CPU device buffers), file-backed (mmaps); Linux."""
  try:
    with open("/proc/self/status") as f:
      return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f)
              if k in ("RssAnon", "RssFile")}
  except OSError:
    return {}


def load(path: str, devices: int, sharded: bool = True) -> dict:
  import jax  # pylint: disable=import-outside-toplevel
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", devices)
  from rloo_jax import config_utils, sharding  # pylint: disable=import-outside-toplevel
  from rloo_jax.models import hf  # pylint: disable=import-outside-toplevel

  jax.devices()
  baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  mesh = config_utils.base_config().mesh  # the default logical-axis rules: embed over fsdp
  mesh.data, mesh.fsdp, mesh.tensor = 1, devices, 1
  layout = sharding.make_layout(mesh)
  t0 = time.perf_counter()
  config, params = hf.load_checkpoint(path, shardings=layout if sharded else None)
  jax.block_until_ready(params)
  seconds = time.perf_counter() - t0
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
  now = _rss_now()
  return {"num_params": config.num_params, "param_bytes": nbytes, "devices": devices,
          "sharded": sharded, "per_device_bytes": sharding.per_device_bytes(params),
          "load_s": round(seconds, 1), "baseline_rss_bytes": baseline, "peak_rss_bytes": peak,
          "peak_rss_over_param_bytes": round(peak / nbytes, 3),
          "load_rss_over_param_bytes": round((peak - baseline) / nbytes, 3),
          **{f"after_{k}_over_param_bytes": round(v / nbytes, 3) for k, v in now.items()}}


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--dir", default="/tmp/qwen2.5-1.5b-random")
  p.add_argument("--preset", default="qwen2.5-1.5b")
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--unsharded", action="store_true",
                 help="load with shardings=None (whole tensors, on the default device)")
  p.add_argument("--side", default="main", choices=("main", "write", "load"))
  args = p.parse_args()
  if args.side == "write":
    write_checkpoint(args.dir, args.preset)
  elif args.side == "load":
    print(json.dumps(load(args.dir, args.devices, not args.unsharded)), flush=True)
  else:  # each side in a process of its own: the load's RSS is its own
    me = [sys.executable, os.path.abspath(__file__), "--dir", args.dir, "--preset", args.preset]
    if not os.path.exists(os.path.join(args.dir, "config.json")):
      subprocess.run(me + ["--side", "write"], check=True)
    subprocess.run(me + ["--side", "load", "--devices", str(args.devices)] +
                   ["--unsharded"] * args.unsharded, check=True)


if __name__ == "__main__":
  main()

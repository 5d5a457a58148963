r"""Loading a real-size checkpoint onto a mesh (docs/SCALE.md "Loading"): a random
Qwen2.5-1.5B-shaped checkpoint (float32, about 6 GB, transformers' tensor names and layout),
written once by a process of its own, loaded with `hf.load_checkpoint(..., shardings=...)` onto
N simulated CPU devices with fsdp=N in a fresh process. One JSON line: the parameter bytes, the
baseline (python + jax) and peak RSS, their ratios to the parameter bytes, the RSS after the load
split into anonymous and file-backed memory, and the seconds.

    python experiments/sharded_load.py --dir /tmp/qwen2.5-1.5b-random --devices 8
    python experiments/sharded_load.py --dir /tmp/qwen2.5-1.5b-random --devices 1 --unsharded
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time

import numpy as np

# The checkout's package, so the command runs from a clone without an install.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write_checkpoint(path: str, preset: str, shard_bytes: int = 2 * 2**30):
  """A random checkpoint of `preset`'s architecture in transformers' Qwen2 layout, sharded."""
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
  from rloo_jax.models import presets  # pylint: disable=import-outside-toplevel

  c = presets.get(preset)
  os.makedirs(path, exist_ok=True)
  e, f, hq, hkv, d = c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim
  shapes = {"model.embed_tokens.weight": (c.vocab_size, e), "model.norm.weight": (e,)}
  for i in range(c.num_layers):
    p = f"model.layers.{i}."
    shapes.update({
        p + "input_layernorm.weight": (e,), p + "post_attention_layernorm.weight": (e,),
        p + "self_attn.q_proj.weight": (hq * d, e), p + "self_attn.q_proj.bias": (hq * d,),
        p + "self_attn.k_proj.weight": (hkv * d, e), p + "self_attn.k_proj.bias": (hkv * d,),
        p + "self_attn.v_proj.weight": (hkv * d, e), p + "self_attn.v_proj.bias": (hkv * d,),
        p + "self_attn.o_proj.weight": (e, hq * d), p + "mlp.gate_proj.weight": (f, e),
        p + "mlp.up_proj.weight": (f, e), p + "mlp.down_proj.weight": (e, f)})
  rng = np.random.default_rng(0)
  files, current, size, weight_map = [], {}, 0, {}

  def flush():
    nonlocal current, size
    if current:
      name = f"model-{len(files) + 1:05d}.safetensors"
      save_file(current, os.path.join(path, name))
      files.append(name)
      weight_map.update({k: name for k in current})
      current, size = {}, 0

  for name, shape in shapes.items():
    current[name] = (rng.standard_normal(shape, np.float32) * 0.02).astype(np.float32)
    size += current[name].nbytes
    if size >= shard_bytes:
      flush()
  flush()
  total = sum(int(np.prod(s)) * 4 for s in shapes.values())
  with open(os.path.join(path, "model.safetensors.index.json"), "w") as fh:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh)
  with open(os.path.join(path, "config.json"), "w") as fh:
    json.dump({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": e,
               "intermediate_size": f, "num_hidden_layers": c.num_layers,
               "num_attention_heads": hq, "num_key_value_heads": hkv, "vocab_size": c.vocab_size,
               "max_position_embeddings": c.max_seq_len, "rms_norm_eps": c.norm_eps,
               "rope_theta": c.rope_theta, "tie_word_embeddings": c.tie_embeddings,
               "torch_dtype": "float32"}, fh)


def _rss_now() -> dict:
  """The process's resident memory now, anonymous (heap, device buffers on CPU) and file-backed
  (memory-mapped files) apart (Linux; empty elsewhere)."""
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
          "sharded": sharded,
          "per_device_bytes": sharding.per_device_bytes(params), "load_s": round(seconds, 1),
          "baseline_rss_bytes": baseline, "peak_rss_bytes": peak,
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
    return write_checkpoint(args.dir, args.preset)
  if args.side == "load":
    print(json.dumps(load(args.dir, args.devices, not args.unsharded)), flush=True)
    return None
  me = [sys.executable, os.path.abspath(__file__), "--dir", args.dir, "--preset", args.preset]
  if not os.path.exists(os.path.join(args.dir, "config.json")):
    subprocess.run(me + ["--side", "write"], check=True)
  subprocess.run(me + ["--side", "load", "--devices", str(args.devices)] +
                 ["--unsharded"] * args.unsharded, check=True)
  return None


if __name__ == "__main__":
  sys.exit(main())

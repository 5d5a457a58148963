r"""The memory plan (`rloo_jax.memory`, as `python -m rloo_jax.plan` prints it) of one job over several depths and remat policies, in one
process: each setting's peak per device and update-step compile time, then the growth per layer
(a least-squares line through the depths) and the compile-time ratio of the deepest to the
shallowest, per remat policy. No data and no weights: architecture presets, abstract inputs.

Prints one JSON line per setting, then a summary JSON line.

    python experiments/plan_sweep.py --preset qwen2.5-1.5b --layers 4,8,16,28 --remat full \
        --set rloo.num_prompts=64 --set rloo.k=4 --set data.max_prompt_len=256 \
        --set rloo.max_new_tokens=256 --set model.dtype=bfloat16 --set mesh.data=1 \
        --set mesh.fsdp=8 --devices 8
"""
import argparse
import json
import os
import sys
import time

import numpy as np

import jax


def parse_value(text: str):
  """'8' -> 8, '0.5' -> 0.5, 'true' -> True, anything else stays a string."""
  for cast in (int, float):
    try:
      return cast(text)
    except ValueError:
      pass
  return {"true": True, "false": False}.get(text.lower(), text)


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config", default=os.path.join(os.path.dirname(__file__), "..", "configs",
                                                  "arithmetic.py"))
  p.add_argument("--preset", required=True)
  p.add_argument("--layers", default="", help="comma list of depths ('' = the preset's)")
  p.add_argument("--remat", default="full", help="comma list of config.model.remat policies")
  p.add_argument("--set", action="append", default=[], help="section.key=value override")
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--device_memory_gb", type=float, default=80.0)
  p.add_argument("--as_compiled", action="store_true",
                 help="XLA:CPU's programs as compiled (float32 copies of bf16 weights included), "
                      "not as for an accelerator (rloo_jax.plan's --as_compiled)")
  args = p.parse_args()
  # Before any device is touched: the simulated device count is fixed at backend start.
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", args.devices)
  from rloo_jax import algorithms, experiment, memory  # pylint: disable=import-outside-toplevel
  from rloo_jax.config_utils import load_config_file  # pylint: disable=import-outside-toplevel

  depths = [int(x) for x in args.layers.split(",") if x] or [None]
  rows = []
  for remat in args.remat.split(","):
    for depth in depths:
      config = load_config_file(args.config)
      with config.unlocked():
        config.model.preset = args.preset
        config.model.remat = remat
        for item in args.set:
          key, _, value = item.partition("=")
          section, name = key.split(".")
          config[section][name] = parse_value(value)
      _, config = algorithms.resolve(config)
      t0 = time.perf_counter()
      exp = experiment.build_abstract(config, num_layers=depth)
      report = memory.plan(algorithms.ALGORITHMS["rloo"](exp),
                           device_memory_gb=args.device_memory_gb,
                           accelerator=not args.as_compiled)
      update = {name: v for name, v in report["programs"].items() if name.startswith("update")}
      row = dict(preset=args.preset, remat=remat, num_layers=report["num_layers"],
                 peak_gb_per_device=report["peak_gb_per_device"], fits=report["fits"],
                 programs={n: v["peak_gb"] for n, v in report["programs"].items()},
                 update_compile_s=round(sum(v["compile_s"] for v in update.values()), 2),
                 plan_s=round(time.perf_counter() - t0, 1))
      rows.append(row)
      print(json.dumps(row), flush=True)
  summary = {"preset": args.preset, "devices": args.devices, "overrides": args.set, "by_remat": {}}
  for remat in args.remat.split(","):
    mine = [r for r in rows if r["remat"] == remat]
    out = {"peak_gb": {r["num_layers"]: r["peak_gb_per_device"] for r in mine}}
    if len(mine) > 1:
      x = np.array([r["num_layers"] for r in mine], float)
      y = np.array([r["peak_gb_per_device"] for r in mine])
      out["growth_gb_per_layer"] = round(float(np.polyfit(x, y, 1)[0]), 4)
      lo, hi = min(mine, key=lambda r: r["num_layers"]), max(mine, key=lambda r: r["num_layers"])
      out["update_compile_ratio_deepest_over_shallowest"] = round(
          hi["update_compile_s"] / max(lo["update_compile_s"], 1e-9), 3)
    summary["by_remat"][remat] = out
  print(json.dumps(summary), flush=True)


if __name__ == "__main__":
  sys.exit(main())

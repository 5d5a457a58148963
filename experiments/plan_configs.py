r"""The memory plan of every paper config at the hardware its docstring names, in one table (and
the scale jobs of docs/SCALE.md, `--only scale`, and its long-completion jobs, `--only long`).
Each row is one `python -m rloo_jax.plan` subprocess (the simulated device count is fixed when jax
starts), one JSON line a row with XLA's "Involuntary full rematerialization" warnings counted.
`--targets` compiles each row with each accelerator's own compiler too (`pip install -e ".[plan]"`).

    python experiments/plan_configs.py --only tldr     # rows whose name starts with it
    python experiments/plan_configs.py --targets=tpu-v5p,h100 --no_estimate
"""
import argparse
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SCALE = ("configs/arithmetic.py --config.model.dtype=bfloat16 --config.mesh.data=1 "
          "--config.mesh.fsdp=8")
_LORA8B = ("configs/arithmetic.py --config.model.preset=llama-3-8b --config.model.dtype=bfloat16 "
           "--config.model.lora.rank=16 --config.rloo.k=4 --config.rloo.num_prompts=64 "
           "--config.data.max_prompt_len=512 --config.rloo.max_new_tokens=512 "
           "--config.train.microbatch_size=8 --config.mesh.data=1")
# Long reasoning traces (docs/SCALE.md "Long completions"): a prompt of 1024 tokens, k = 8.
_LONG = ("--config.data.max_prompt_len=1024 --config.model.remat=full "
         "--config.rloo.rollout_chunk_prompts=32 --config.rloo.max_new_tokens=")
_PACKED = "--config.train.microbatch_size=0 --config.train.microbatch_tokens="
# (name, config[:arg], devices, device memory GiB): the hardware of each config's docstring.
ROWS = (
    ("tldr pythia-1b k=4", "configs/tldr.py:model=pythia-1b,k=4", 8, 80),
    ("tldr pythia-2.8b k=4", "configs/tldr.py:model=pythia-2.8b,k=4", 8, 80),
    ("tldr pythia-6.9b k=2", "configs/tldr.py:model=pythia-6.9b,k=2", 8, 80),
    ("tldr pythia-6.9b k=4", "configs/tldr.py:model=pythia-6.9b,k=4", 8, 80),
    ("hh pythia-6.9b k=2", "configs/hh.py:model=pythia-6.9b,k=2", 8, 80),
    ("hh pythia-6.9b k=4", "configs/hh.py:model=pythia-6.9b,k=4", 8, 80),
    ("hh llama-2-7b k=4", "configs/hh.py:model=llama-2-7b,k=4", 8, 80),
    ("gsm8k qwen2-7b (veRL)", "configs/gsm8k.py:model=qwen2-7b", 8, 72),
    ("gsm8k single qwen2.5-0.5b full", "configs/gsm8k.py:single,model=qwen2.5-0.5b", 1, 80),
    ("gsm8k single qwen2.5-0.5b lora 16", "configs/gsm8k.py:single,model=qwen2.5-0.5b,lora=16",
     1, 80),
    ("gsm8k colab qwen2.5-0.5b lora 16", "configs/gsm8k.py:colab,model=qwen2.5-0.5b,lora=16",
     1, 15),
    ("lora llama-3-8b 16 1 device", _LORA8B + " --config.mesh.fsdp=1", 1, 80),
    ("lora llama-3-8b 16 fsdp=8", _LORA8B + " --config.mesh.fsdp=8", 8, 80),
    ("scale qwen2.5-1.5b 64x4x(256+256) fsdp=8", _SCALE + " --config.model.preset=qwen2.5-1.5b "
     "--config.rloo.num_prompts=64 --config.rloo.k=4 --config.data.max_prompt_len=256 "
     "--config.rloo.max_new_tokens=256", 8, 80),
    ("scale llama-3-8b 64x4x(512+512) fsdp=8", _SCALE + " --config.model.preset=llama-3-8b "
     "--config.rloo.num_prompts=64 --config.rloo.k=4 --config.data.max_prompt_len=512 "
     "--config.rloo.max_new_tokens=512", 8, 72),
    ("scale llama-3-70b lora 16 k=2 16x(512+512) fsdp=8", _SCALE + " --config.model.preset="
     "llama-3-70b --config.model.lora.rank=16 --config.rloo.num_prompts=16 --config.rloo.k=2 "
     "--config.data.max_prompt_len=512 --config.rloo.max_new_tokens=512", 8, 80),
    # Packed updates: microbatch_tokens per device, one completion and its prompt at the least.
    ("long deepscaler 128x8x(1024+8192) packed 36860", "configs/gsm8k.py:model=qwen2.5-1.5b,k=8 "
     "--config.rloo.num_prompts=128 " + _PACKED + "36860 " + _LONG + "8192", 8, 72),
    ("long qwen2.5-1.5b k=8 1024+24576 packed 25599", "configs/gsm8k.py:model=qwen2.5-1.5b,k=8 "
     "--config.rloo.num_prompts=32 " + _PACKED + "25599 " + _LONG + "24576", 8, 72),
    ("long qwen2.5-1.5b k=8 1024+32768 packed 33791", "configs/gsm8k.py:model=qwen2.5-1.5b,k=8 "
     "--config.rloo.num_prompts=32 " + _PACKED + "33791 " + _LONG + "32768", 8, 72),
    ("long qwen3-8b k=8 1024+16384 packed 17407", "configs/gsm8k.py:model=qwen3-8b,k=8 "
     "--config.rloo.num_prompts=32 " + _PACKED + "17407 " + _LONG + "16384 "
     "--config.rloo.rollout_chunk_prompts=8", 8, 72),
)


def plan(config: str, devices: int, memory_gb: float, target: str = "") -> dict:
  """One `python -m rloo_jax.plan` run: for `target` (a family, e.g. 'h100') its compiler at the
  row's device count and the device's own memory, else the CPU estimate on `devices`."""
  config, *overrides = config.split()
  where = ([f"--target={target}-{devices}"] if target else
           [f"--devices={devices}", f"--device_memory_gb={memory_gb}"])
  cmd = [sys.executable, "-m", "rloo_jax.plan", f"--config={config}", *overrides, *where,
         "--nospeedups"]
  out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                       env=dict(os.environ, ALLOW_MULTIPLE_LIBTPU_LOAD="1"))
  if out.returncode:
    raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
  report = json.loads(out.stdout.strip().splitlines()[-1])
  report["command"] = " ".join(["python", "-m", "rloo_jax.plan"] + cmd[3:])
  # XLA's SPMD partitioner logs when a sharding forces it to rebuild a whole array.
  report["involuntary_remat"] = out.stderr.count("Involuntary full rematerialization")
  return report


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--only", default="", help="run the rows whose name starts with this")
  p.add_argument("--targets", default="", help="comma-separated accelerator families (tpu-v5e, "
                 "tpu-v5p, tpu-v6e, h100, h200): each row also compiled by that compiler")
  p.add_argument("--no_estimate", action="store_true",
                 help="with --targets: no CPU estimate column (its compiles are the slowest)")
  args = p.parse_args()
  rows = [r for r in ROWS if r[0].startswith(args.only)]
  if args.targets:
    return compare(rows, [t for t in args.targets.split(",") if t], not args.no_estimate)
  print("| config | devices | peak GiB / device | at | reward model GiB | fits |")
  print("|---|---|---|---|---|---|")
  for name, config, devices, memory in rows:
    r = plan(config, devices, memory)
    at = max(r["programs"], key=lambda n: r["programs"][n]["peak_gb"])
    print(f"| {name} | {devices} x {memory} GiB | {r['peak_gb_per_device']:.1f} | {at} | "
          f"{r.get('reward_model_gb', 0):.2f} | {'yes' if r['fits'] else 'NO'} |", flush=True)
    print(json.dumps(dict(name=name, config=config, devices=devices, device_memory_gb=memory,
                          peak_gb_per_device=r["peak_gb_per_device"], program=at,
                          reward_model_gb=r.get("reward_model_gb", 0), fits=r["fits"],
                          advice=r["advice"], command=r["command"],
                          involuntary_remat=r["involuntary_remat"])), flush=True)


def _cell(r: dict) -> str:
  """update grads / update apply / peak, GiB per device (a bold peak does not fit)."""
  p = r["programs"]
  grads = p.get("update_gradients", p.get("update", {})).get("peak_gb", float("nan"))
  apply = p.get("update_apply", {}).get("peak_gb", float("nan"))
  peak = f"{r['peak_gb_per_device']:.2f}"
  return f"{grads:.2f} / {apply:.2f} / " + (peak if r["fits"] else f"**{peak}**")


def compare(rows, targets, estimate=True):
  """Each row as the CPU estimate and as each target's compiler makes it."""
  print("| job | devices | " + "CPU estimate | " * estimate + " | ".join(targets) + " |")
  print("|---|---|" + "---|" * (len(targets) + estimate))
  for name, config, devices, memory in rows:
    cells = [_cell(plan(config, devices, memory))] if estimate else []
    reports = {}
    for t in targets:
      if t.startswith("tpu") and devices < 4:  # the TPU compiler's smallest slice: 4 chips
        cells.append("-")
        continue
      reports[t] = plan(config, devices, memory, target=t)
      cells.append(_cell(reports[t]) + f" of {reports[t]['device_memory_gb']:.0f}")
    print(f"| {name} | {devices} | " + " | ".join(cells) + " |", flush=True)
    for t, r in reports.items():
      print(json.dumps(dict(name=name, target=t, peak_gb_per_device=r["peak_gb_per_device"],
                            fits=r["fits"], programs=r["programs"], command=r["command"],
                            involuntary_remat=r["involuntary_remat"])), flush=True)


if __name__ == "__main__":
  main()

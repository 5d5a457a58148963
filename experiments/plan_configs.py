r"""The memory plan of every paper config at the hardware its docstring names, in one table.

Each row is one `python -m rloo_jax.plan` run (a subprocess: the simulated device count is fixed
when jax starts), compiled as for an accelerator; prints the table (peak GiB per device, the
program at the peak, the reward model's resident GiB, fits) and one JSON line per row.

    python experiments/plan_configs.py                 # every row
    python experiments/plan_configs.py --only tldr     # rows whose name starts with it
    python experiments/plan_configs.py --speedups      # and the faster settings that fit
"""
import argparse
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
)


def plan(config: str, devices: int, memory_gb: float, speedups: bool = False) -> dict:
  cmd = [sys.executable, "-m", "rloo_jax.plan", f"--config={config}", f"--devices={devices}",
         f"--device_memory_gb={memory_gb}", "--speedups" if speedups else "--nospeedups"]
  out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
  if out.returncode:
    raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
  report = json.loads(out.stdout.strip().splitlines()[-1])
  report["command"] = " ".join(["python", "-m", "rloo_jax.plan"] + cmd[3:])
  return report


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--only", default="", help="run the rows whose name starts with this")
  p.add_argument("--speedups", action="store_true",
                 help="also each row's faster settings that fit (memory.speedups: more compiles)")
  args = p.parse_args()
  rows = [r for r in ROWS if r[0].startswith(args.only)]
  print(f"| config | devices | peak GiB / device | at | reward model GiB | fits |"
        + (" faster, and fits |" if args.speedups else ""))
  print("|---|---|---|---|---|---|" + ("---|" if args.speedups else ""))
  for name, config, devices, memory in rows:
    r = plan(config, devices, memory, args.speedups)
    at = max(r["programs"], key=lambda n: r["programs"][n]["peak_gb"])
    print(f"| {name} | {devices} x {memory} GiB | {r['peak_gb_per_device']:.1f} | {at} | "
          f"{r.get('reward_model_gb', 0):.2f} | {'yes' if r['fits'] else 'NO'} |"
          + (f" {'; '.join(x['setting'] for x in r['speedups']) or '-'} |"
             if args.speedups else ""), flush=True)
    print(json.dumps(dict(name=name, config=config, devices=devices, device_memory_gb=memory,
                          peak_gb_per_device=r["peak_gb_per_device"], program=at,
                          reward_model_gb=r.get("reward_model_gb", 0), fits=r["fits"],
                          advice=r["advice"], speedups=r["speedups"],
                          command=r["command"])), flush=True)


if __name__ == "__main__":
  main()

r"""rloo_jax against TRL's RLOOTrainer on the same workload, side by side in one run.

For each model size it runs experiments/bench_step.py (this interpreter) and then
experiments/bench_trl_rloo.py (the TRL virtual environment's interpreter), one after the other. It
then prints one JSON line per size with both medians and their ratio. Timings on a shared machine
are noisy, so the two runs of a pair are taken back to back.

    python -m venv .venv-trl && .venv-trl/bin/pip install torch==2.13.0 trl
    python experiments/compare_trl.py --trl_python .venv-trl/bin/python
"""
import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def last_json(cmd):
  out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
  return json.loads([l for l in out.splitlines() if l.startswith("{")][-1])


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--trl_python", default=os.path.join(os.path.dirname(HERE), ".venv-trl", "bin",
                                                      "python"))
  p.add_argument("--sizes", default="64x2,256x4", help="hidden x layers, comma separated")
  p.add_argument("--iterations", type=int, default=8)
  args = p.parse_args()
  if not os.path.exists(args.trl_python):
    sys.exit(f"no TRL interpreter at {args.trl_python}; create it with: python -m venv .venv-trl "
             "&& .venv-trl/bin/pip install torch==2.13.0 trl")
  for size in args.sizes.split(","):
    hidden, layers = size.split("x")
    common = ["--hidden", hidden, "--layers", layers, "--iterations", str(args.iterations)]
    ours = last_json([sys.executable, os.path.join(HERE, "bench_step.py"), *common])
    trl = last_json([args.trl_python, os.path.join(HERE, "bench_trl_rloo.py"), *common])
    print(json.dumps({
        "hidden": int(hidden), "layers": int(layers), "params": ours["params"],
        "rloo_jax_iteration_s": ours["median"]["iteration_s"],
        "rloo_jax_split_s": ours["median"],
        "trl_step_s": trl["median_step_s"],
        "speedup": round(trl["median_step_s"] / ours["median"]["iteration_s"], 2),
        "rloo_jax_achieved_gflops": ours["achieved_gflops"],
        "rloo_jax_fraction_of_peak": ours["fraction_of_peak"],
        "trl_version": trl["trl"], "torch": trl["torch"]}), flush=True)


if __name__ == "__main__":
  main()

r"""rloo_jax against TRL's RLOOTrainer on the same workload, side by side in one run.

For each model size it runs experiments/bench_step.py (this interpreter) and then
experiments/bench_trl_rloo.py (the TRL virtual environment's interpreter), one after the other,
`--rounds` times, alternating which framework goes first. It prints one JSON line per size: each
round's medians and ratio, and the median over rounds of the per-round ratio. This machine's speed
drifts by 30% within minutes, so only pairs taken back to back are compared.

    python -m venv .venv-trl && .venv-trl/bin/pip install torch==2.13.0 trl
    python experiments/compare_trl.py --trl_python .venv-trl/bin/python
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def last_json(cmd, **run_kwargs):
  """The last JSON line `cmd` prints (subprocess.run keyword arguments pass through)."""
  out = subprocess.run(cmd, check=True, capture_output=True, text=True, **run_kwargs).stdout
  return json.loads([l for l in out.splitlines() if l.startswith("{")][-1])


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--trl_python", default=os.path.join(os.path.dirname(HERE), ".venv-trl", "bin",
                                                      "python"))
  p.add_argument("--sizes", default="64x2,256x4", help="hidden x layers, comma separated")
  p.add_argument("--iterations", type=int, default=8)
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                 help="activation dtype of both (TRL: bf16 mixed precision)")
  args = p.parse_args()
  if not os.path.exists(args.trl_python):
    sys.exit(f"no TRL interpreter at {args.trl_python}; create it with: python -m venv .venv-trl "
             "&& .venv-trl/bin/pip install torch==2.13.0 trl")
  for size in args.sizes.split(","):
    hidden, layers = size.split("x")
    common = ["--hidden", hidden, "--layers", layers, "--iterations", str(args.iterations),
              "--dtype", args.dtype]
    ours_cmd = [sys.executable, os.path.join(HERE, "bench_step.py"), *common]
    trl_cmd = [args.trl_python, os.path.join(HERE, "bench_trl_rloo.py"), *common]
    rounds = []
    for r in range(args.rounds):
      if r % 2 == 0:
        ours, trl = last_json(ours_cmd), last_json(trl_cmd)
      else:
        trl, ours = last_json(trl_cmd), last_json(ours_cmd)
      rounds.append(dict(rloo_jax_split_s=ours["median"], trl_step_s=trl["median_step_s"],
                         speedup=round(trl["median_step_s"] / ours["median"]["iteration_s"], 2),
                         rloo_jax_achieved_gflops=ours["achieved_gflops"]))
    print(json.dumps({
        "hidden": int(hidden), "layers": int(layers), "dtype": args.dtype,
        "params": ours["params"],
        "median_speedup": statistics.median(x["speedup"] for x in rounds),
        "median_rloo_jax_iteration_s": statistics.median(
            x["rloo_jax_split_s"]["iteration_s"] for x in rounds),
        "median_trl_step_s": statistics.median(x["trl_step_s"] for x in rounds),
        "median_rloo_jax_achieved_gflops": statistics.median(
            x["rloo_jax_achieved_gflops"] for x in rounds),
        "rounds": rounds, "trl_version": trl["trl"], "torch": trl["torch"]}), flush=True)


if __name__ == "__main__":
  main()

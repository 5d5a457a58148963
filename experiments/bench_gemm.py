r"""The float32 matrix-multiply ceiling of this CPU for the shapes of the hidden-256 benchmark.

experiments/bench_step.py reports its achieved FLOP/s against the CPU's theoretical float32 peak
(about 390 GFLOP/s on 2 cores). This script measures what a single jitted matmul of each shape
the model runs actually reaches, so the utilisation figure can be read against the limit the
compiler's GEMM kernels approach, not only the theoretical one. Run it with torch installed
(e.g. the TRL virtual environment's interpreter cannot import jax, so this script runs each
framework it finds) to see the same shapes through torch's kernels.

    python experiments/bench_gemm.py
    .venv-trl/bin/python experiments/bench_gemm.py   # torch's kernels on the same shapes
"""
import argparse
import json
import statistics
import time

# (rows, contraction, columns, what): a training forward over 32 sequences x 48 tokens, the
# weight-gradient form (contraction over the 1536 rows) and one decode step of 32 streams.
SHAPES = [(1536, 256, 1024, "mlp up/gate"), (1536, 1024, 256, "mlp down"),
          (1536, 256, 256, "attention projection"), (256, 1536, 1024, "weight gradient"),
          (32, 256, 1024, "decode step, mlp up")]


def significant(x: float, digits: int) -> float:
  """x to `digits` significant figures, not fixed decimals: a figure printed on a CPU and on a
  GPU, or for a tiny and a large size, spans orders of magnitude (one decimal of 24 tokens/s is
  already a 0.2% error; a tiny size's floor is well under a millisecond)."""
  return float(f"{x:.{digits}g}")


def median_time(fn, repeats):
  fn()
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def run_jax(dtype, repeats):
  import jax
  import jax.numpy as jnp
  out = []
  for m, k, n, what in SHAPES:
    a = jnp.ones((m, k), dtype)
    b = jnp.ones((k, n), dtype)
    f = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32))
    t = median_time(lambda: f(a, b).block_until_ready(), repeats)
    out.append(dict(shape=[m, k, n], what=what, gflops=round(2 * m * k * n / t / 1e9, 1)))
  return dict(framework="jax", version=jax.__version__, dtype=jnp.dtype(dtype).name, results=out)


def run_torch(dtype, repeats, threads):
  import torch
  torch.set_num_threads(threads)
  dt = getattr(torch, dtype)
  out = []
  for m, k, n, what in SHAPES:
    a = torch.ones((m, k), dtype=dt)
    b = torch.ones((k, n), dtype=dt)
    t = median_time(lambda: torch.matmul(a, b), repeats)
    out.append(dict(shape=[m, k, n], what=what, gflops=round(2 * m * k * n / t / 1e9, 1)))
  return dict(framework="torch", version=torch.__version__, dtype=dtype, results=out)


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  p.add_argument("--repeats", type=int, default=50)
  p.add_argument("--threads", type=int, default=2, help="torch threads (XLA uses every core)")
  args = p.parse_args()
  for name, runner in (("jax", lambda: run_jax(args.dtype, args.repeats)),
                       ("torch", lambda: run_torch(args.dtype, args.repeats, args.threads))):
    try:
      __import__(name)
    except ImportError:
      continue
    print(json.dumps(runner()), flush=True)


if __name__ == "__main__":
  main()

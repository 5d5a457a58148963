r"""Where XLA:CPU spends an RLOO iteration's programs: bench_step.py's workload, each of its four
device programs (the rollout's decode, the reference pass, the update's gradient and its
optimizer step) run on its own
under `jax.profiler`, with XLA:CPU's per-thunk trace events on.

Prints one JSON line per program: `wall_s` (median seconds per run, traced), `thunk_s` (the
summed duration of its leaf thunks, the kernels, over all threads), `concurrency` (thunk_s /
wall_s: how many of the cores the program keeps busy on average), `thunks` (kernel launches per
run) and `top` (the costliest kernels: ms per run, launches per run, microseconds each).
`dynamic-slice*` kernels inside a loop are copies (a layer's weights sliced out of the stack);
`ynn_fusion*` are YNNPACK matmuls.

    python experiments/trace_programs.py --hidden 64 --layers 2
    python experiments/trace_programs.py --hidden 256 --layers 4 --programs gradient
    python experiments/trace_programs.py --size c --programs gradient --runs 2 --top 30
"""
import argparse
import collections
import glob
import json
import os
import statistics
import sys
import tempfile
import time

# Before jax starts: XLA:CPU emits a trace event per thunk only when asked.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_cpu_enable_xprof_traceme=true").strip()

import jax  # noqa: E402
from jax._src.lib import _profile_data  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_step  # noqa: E402
from compare_peers import SIZES, WORK  # noqa: E402

from rloo_jax import sampler, sampler_args  # noqa: E402

PROGRAMS = ("rollout", "reference", "gradient", "apply")


def size_work(size: str):
  """(hidden, layers, work) of a compare_peers size, for `workload`."""
  work = {key: SIZES[size][key] for key in WORK}
  return SIZES[size]["hidden"], SIZES[size]["layers"], work


def workload(hidden: int, layers: int, remat: str = "full", work=None, **train):
  """(algo, state after one iteration, prompt batches, the update's (params, rows) from that
  iteration): bench_step's workload, `work` as default_workload's (compare_peers.SIZES' heads,
  vocab, prompts, ...), `train` its config.train overrides."""
  algo, state, task = bench_step.default_workload(hidden, layers, model=dict(remat=remat),
                                                  work=work, **train)
  c = algo.exp.config
  data = bench_step.prompt_batches(task, c.rloo.num_prompts, c.data.max_prompt_len)
  captured = {}
  grad_fn = algo.step_fn.grad_fn

  def capture(*args):  # the update's own inputs (copied: the apply program donates the state)
    captured["args"] = jax.tree.map(lambda x: x.copy() if hasattr(x, "copy") else x, args)
    return grad_fn(*args)

  algo.step_fn.grad_fn = capture
  state, _ = algo.iteration(state, next(data))
  algo.step_fn.grad_fn = grad_fn
  return algo, state, data, captured["args"][:2]


def programs(hidden: int, layers: int, remat: str = "full", work=None) -> dict:
  """{name: a closure running that program once, to completion} on one rollout's inputs."""
  algo, state, data, (params, rows) = workload(hidden, layers, remat, work)
  exp, c = algo.exp, algo.exp.config
  grad_fn = algo.step_fn.grad_fn
  batch = next(data)
  rng = jax.random.PRNGKey(0)
  grads, value, _ = grad_fn(params, rows)
  held = {"state": state}

  def apply():  # the optimizer step donates the state: each run feeds it the last run's
    held["state"] = jax.block_until_ready(algo.step_fn.apply_fn(held["state"], grads, value)[0])

  return {
      "rollout": lambda: jax.block_until_ready(sampler.sample(
          exp.fns, state.policy_params, batch["prompt_tokens"], batch["prompt_lengths"], rng,
          k=c.rloo.k, max_new_tokens=c.rloo.max_new_tokens, method=exp.method, eos_id=-1,
          pad_id=0, mode=c.rloo.sampler_mode, max_seq_len=c.model.max_seq_len,
          **sampler_args.decode_options(exp))),
      "reference": lambda: jax.block_until_ready(algo.reference_fn(state.ref_params, rows)),
      "gradient": lambda: jax.block_until_ready(grad_fn(params, rows)),
      "apply": apply,
  }


def trace(fn, runs: int, top: int) -> dict:
  """`fn` run `runs` times under the profiler: the per-run figures of the module docstring."""
  walls = []
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
      for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t0)
    path = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)[0]
    data = _profile_data.ProfileData.from_file(path)
  total, count = collections.Counter(), collections.Counter()
  for plane in data.planes:
    for line in plane.lines:
      if not line.name.startswith("tf_XLA"):  # XLA's own threads; not the Python one
        continue
      for event in line.events:
        name = event.name
        # Containers and waits, not kernels: a program's execution, a loop, a pool wait.
        if "Execute" in name or "Await" in name or name.startswith("while"):
          continue
        total[name] += event.duration_ns
        count[name] += 1
  wall = statistics.median(walls)
  thunk_s = sum(total.values()) / 1e9 / runs
  return dict(wall_s=round(wall, 5), thunk_s=round(thunk_s, 5),
              concurrency=round(thunk_s / wall, 3), thunks=round(sum(count.values()) / runs),
              top=[[name, round(ns / 1e6 / runs, 3), round(count[name] / runs, 1),
                    round(ns / count[name] / 1e3, 1)] for name, ns in total.most_common(top)])


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--hidden", type=int, default=256)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--size", default="", choices=("",) + tuple(sorted(SIZES)),
                 help="a compare_peers size: its whole work (hidden, layers, heads, vocab, "
                      "prompts, lengths), in place of --hidden / --layers")
  p.add_argument("--programs", default=",".join(PROGRAMS))
  p.add_argument("--runs", type=int, default=5, help="traced runs, after 3 untraced")
  p.add_argument("--top", type=int, default=8)
  p.add_argument("--remat", default="full", choices=("none", "dots", "full"),
                 help="config.model.remat (bench_step's default: full)")
  args = p.parse_args()
  asked = args.programs.split(",")
  unknown = sorted(set(asked) - set(PROGRAMS))
  if unknown:
    p.error(f"unknown programs {unknown}; known: {list(PROGRAMS)}")
  work = None
  if args.size:
    args.hidden, args.layers, work = size_work(args.size)
  fns = programs(args.hidden, args.layers, args.remat, work)
  # In PROGRAMS' order whatever was asked: 'apply' donates the state the others read.
  for name in [n for n in PROGRAMS if n in asked]:
    for _ in range(3):  # compile and warm up
      fns[name]()
    print(json.dumps(dict(program=name, size=args.size, hidden=args.hidden, layers=args.layers,
                          remat=args.remat, **trace(fns[name], args.runs, args.top))),
          flush=True)


if __name__ == "__main__":
  main()

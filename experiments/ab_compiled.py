r"""A/B of a code variant inside one process: the bench_step.py workload's three programs (rollout,
reference-style forward of the policy loss, its gradient) compiled for the current code (A) and
for the code with a variant applied (B), then timed in interleaved pairs.

A variant is a Python file in experiments/variants/ with an `apply()` that monkeypatches rloo_jax
(e.g. swaps an attention function). Each side is compiled ahead of time after `jax.clear_caches()`:
`model_fns` is memoised per graphdef and the sampler's programs are jit-cached on it, so flipping
a switch between two experiments built in one process would time the same program twice.

Prints one JSON line: per program the medians of A and B, the median of the per-pair ratios
B / A (the figure to read: this machine's speed drifts, pairs taken back to back do not) and
whether the variant changed that program's compiled code at all; plus whether the rollout's
tokens and the gradient agree between A and B.

    python experiments/ab_compiled.py experiments/variants/unfused_decode_qkv.py
    python experiments/ab_compiled.py experiments/variants/head_major_attention.py --pairs 30
"""
import argparse
import collections
import importlib.util
import json
import os
import re
import sys
import time

import numpy as np

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_step  # noqa: E402
from ab_config import pair_summary  # noqa: E402
from compare_peers import round_order  # noqa: E402

from rloo_jax import loss, rollout, sampler  # noqa: E402


def workload(hidden, layers):
  """bench_step.py's configuration; returns (closures of the three programs, their arguments)."""
  algo, state, task = bench_step.default_workload(hidden, layers)
  exp = algo.exp
  c = exp.config
  batch = next(bench_step.prompt_batches(task, 8, 16))
  k, b = 4, 8

  def rollout_fn(params, prompt_tokens, prompt_lengths, rng):
    return sampler.sample(exp.fns, params, prompt_tokens, prompt_lengths, rng, k=k,
                          max_new_tokens=32, method=exp.method, eos_id=2, pad_id=0,
                          mode=c.rloo.sampler_mode, max_seq_len=48)

  out = rollout_fn(state.params, batch["prompt_tokens"], batch["prompt_lengths"],
                   jax.random.PRNGKey(0))
  # The rows the update trains on (grouped: config.train.shared_prefix, the default).
  rows = rollout.make_rows(batch["prompt_tokens"], batch["prompt_lengths"],
                           out.tokens_bkt.reshape(b * k, -1), out.mask_bkt.reshape(b * k, -1),
                           out.policy_logprobs_bkt.reshape(b * k, -1), k=k,
                           shared_prefix=bool(c.train.shared_prefix))
  rows = rows.replace(advantages_n=jnp.asarray(np.random.default_rng(0).standard_normal(b * k),
                                               jnp.float32))
  spec = loss.LossSpec()

  def loss_fn(params):
    # The trainer's log-probs: chunked from the hidden states, with the entropy metric.
    logp, entropy = rollout.logprobs(rows, exp.fns, params,
                                     chunk_size=int(c.train.logprob_chunk_size), with_entropy=True)
    return loss.policy_loss(spec, logp, rows.old_logp_nt, rows.cmask_nt, rows.advantages_n,
                            entropy)[0]

  programs = {"rollout": lambda *a: rollout_fn(*a).tokens_bkt, "forward": loss_fn,
              "gradient": jax.grad(loss_fn)}
  args = {"rollout": (state.params, batch["prompt_tokens"], batch["prompt_lengths"],
                      jax.random.PRNGKey(1)),
          "forward": (state.params,), "gradient": (state.params,)}
  return programs, args


_DEBUG_SECTIONS = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def program_text(compiled) -> str:
  """The optimized HLO without source metadata: a variant's own stack frames (its file, its
  wrapper functions) would otherwise make every program it merely passes through look changed."""
  lines, skipping = [], False
  for line in compiled.as_text().splitlines():
    if line.strip() in _DEBUG_SECTIONS:
      skipping = True
    elif skipping and not line.strip():
      continue
    elif skipping and line.startswith(("HloModule", "%", "ENTRY", "ROOT")):
      skipping = False
    if not skipping:
      lines.append(re.sub(r",? ?metadata=\{[^}]*\}|,? ?stack_frame_id=\d+", "", line))
  return "\n".join(lines)


def compile_all(programs, args):
  jax.clear_caches()
  out = {name: jax.jit(f).lower(*args[name]).compile() for name, f in programs.items()}
  for name, f in out.items():
    jax.block_until_ready(f(*args[name]))
  return out


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("variant", help="a file defining apply(), e.g. experiments/variants/*.py")
  p.add_argument("--hidden", type=int, default=256)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--pairs", type=int, default=20)
  args = p.parse_args()
  spec = importlib.util.spec_from_file_location("variant", args.variant)
  variant = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(variant)

  programs, prog_args = workload(args.hidden, args.layers)
  side_a = compile_all(programs, prog_args)
  variant.apply()
  side_b = compile_all(programs, prog_args)
  # Same results up to float rounding: the variant must not change what is computed.
  tokens_equal = bool(jnp.all(side_a["rollout"](*prog_args["rollout"])
                              == side_b["rollout"](*prog_args["rollout"])))
  grads = [side["gradient"](*prog_args["gradient"]) for side in (side_a, side_b)]
  grad_rel_diff = max(float(jnp.max(jnp.abs(x - y)) / (jnp.max(jnp.abs(x)) + 1e-30))
                      for x, y in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])))

  times = collections.defaultdict(list)
  compiled_by_side = {"A": side_a, "B": side_b}
  for i in range(args.pairs):
    for name in programs:
      for side in round_order(i, ("A", "B")):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled_by_side[side][name](*prog_args[name]))
        times[side, name].append(time.perf_counter() - t0)
  result = {"variant": os.path.basename(args.variant), "hidden": args.hidden,
            "layers": args.layers, "pairs": args.pairs, "rollout_tokens_equal": tokens_equal,
            "gradient_max_rel_diff": grad_rel_diff}
  for name in programs:
    result[name] = {**pair_summary(times["A", name], times["B", name]),
                    # Whether the variant reached this program at all (the pitfall this avoids).
                    "program_changed": program_text(side_a[name]) != program_text(side_b[name])}
  print(json.dumps(result))


if __name__ == "__main__":
  main()

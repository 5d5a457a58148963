r"""The fastest an RLOO iteration of a compare_peers size could run on this machine, and so the
largest speed-up over a peer's measured step that any implementation of the same work could show.

The work is fixed by the size (compare_peers.SIZES) and the float32 comparison: its model FLOPs
per program are the memory planner's count (`rloo_jax.memory.flops`: the rollout's prefill and
decode, the reference forward, the update's forward and backward, the prompt counted once per
group), plus what the update's backward recomputes at a given `--remat` (and, with
`--fused_head 0`, the head of every log-prob chunk). Each class of FLOPs is
timed at the rate this machine's XLA:CPU reaches on the matmuls that carry it, each matmul
alone in a compiled loop of its own (nothing else competes for the cores, and no dispatch
from Python is charged to it): the trunk's
four projections at the scoring forwards' row count, the head at its row count, and every
decode-step matmul at the decode's row count, as `x @ W` and as `W.T @ x.T` (the faster of the
two is taken: the decode's weights-left form). Attention is charged at the trunk's rate and the
elementwise work, the draw and every copy at nothing, so the floor is below what any program of
this work can reach; a peer's step over it bounds the ratio from above.

Prints one JSON line: the measured rates (GFLOP/s, median of --repeats), FLOPs per program,
`floor_s` per program and for the iteration, and with `--peer_s trl=83.2,tunix=...` the
`max_ratio` over each peer; with `--hf_generate_s` (bench_sampler's figure for the size's
rollout) the largest rollout speed-up over transformers' generate, `max_rollout_ratio_hf`.

    python experiments/bench_floor.py --size c --remat none --peer_s trl=83.2
    python experiments/bench_floor.py --size b --remat none --peer_s trl=0.754,tunix=0.799
"""
import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rloo_jax import experiment  # noqa: E402
from rloo_jax.config_utils import base_config  # noqa: E402
from rloo_jax.memory import flops as flops_lib  # noqa: E402
from rloo_jax.models import transformer  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_step  # noqa: E402
from bench_gemm import median_time, significant  # noqa: E402
from compare_peers import SIZES  # noqa: E402


def model_config(size: dict) -> transformer.TransformerConfig:
  """The model bench_step runs at `size` (its `model_fields`, resolved as an experiment does)."""
  c = base_config()
  c.model.update(**bench_step.model_fields(size["hidden"], size["layers"], size["heads"],
                                           size["prompt_len"], size["new_tokens"]))
  return experiment.model_config(c, lambda: size["vocab"])


# Products per timed call: one call's dispatch from Python (tens of microseconds) would
# otherwise be charged to a decode-sized product that itself takes about as long.
PRODUCTS_PER_CALL = 16


def product_loop(rows: int, inner: int, outer: int, left: bool = False):
  """(jitted f, its arguments): PRODUCTS_PER_CALL float32 [rows, inner] x [inner, outer] products
  in one compiled loop (as the decode and the layer scan run them); `left`: each computed as
  [outer, inner] @ [inner, rows], the weights on the left (as `layers.dense_left` does)."""
  key = jax.random.PRNGKey(0)
  if left:
    w = jax.random.normal(key, (outer, inner), jnp.float32)
    x = jax.random.normal(key, (inner, rows), jnp.float32)
    product = lambda w, x: w @ x  # noqa: E731
    out_shape = (outer, rows)
  else:
    x = jax.random.normal(key, (rows, inner), jnp.float32)
    w = jax.random.normal(key, (inner, outer), jnp.float32)
    product = lambda w, x: x @ w  # noqa: E731
    out_shape = (rows, outer)

  def products(w, x):
    def body(_, carry):
      x, acc = carry
      # The activations change every trip (a scaling XLA cannot fold), so no product is
      # loop-invariant; the barrier keeps a weights-left product from being swapped back.
      x = jax.lax.optimization_barrier(x * jnp.float32(1.0 + 2 ** -20))
      return x, acc + product(w, x)
    return jax.lax.fori_loop(0, PRODUCTS_PER_CALL, body,
                             (x, jnp.zeros(out_shape, jnp.float32)))[1]

  return jax.jit(products), (w, x)


def rate(rows: int, inner: int, outer: int, repeats: int, left: bool = False) -> float:
  """GFLOP/s of one [rows, inner] x [inner, outer] product in `product_loop`. Each trip's
  elementwise scaling and sum (a [rows, inner] and a [rows, outer] pass) are charged to it: the
  floor only gets higher by them, by 1/outer and 1/inner of the product's FLOPs."""
  f, args = product_loop(rows, inner, outer, left)
  seconds = median_time(lambda: jax.block_until_ready(f(*args)), repeats) / PRODUCTS_PER_CALL
  return 2 * rows * inner * outer / seconds / 1e9


def harmonic(rates_and_weights) -> float:
  """The rate of a FLOP mix run at each part's rate: total FLOPs over summed times."""
  total = sum(w for _, w in rates_and_weights)
  return total / sum(w / r for r, w in rates_and_weights)


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--size", default="c", choices=sorted(SIZES))
  p.add_argument("--remat", default="none", choices=("none", "dots", "full"),
                 help="what the update's backward recomputes, counted in its FLOPs")
  p.add_argument("--fused_head", type=int, default=1, choices=(0, 1),
                 help="1 (bench_step's default, config.train.fused_head_grad): the head's "
                      "gradient in the log-prob pass, so the backward recomputes no head; 0: "
                      "every log-prob chunk's head recomputed, as autodiff's two passes do")
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--peer_s", default="",
                 help="peer=seconds a step, comma-separated (compare_peers' medians)")
  p.add_argument("--hf_generate_s", type=float, default=0.0,
                 help="seconds of transformers' generate on the size's rollout "
                      "(bench_sampler's hf_generate_s)")
  args = p.parse_args()
  size = SIZES[args.size]
  m = model_config(size)
  h, i, v = m.hidden_size, m.intermediate_size, m.vocab_size
  b, k, plen, t = size["prompts"], size["k"], size["prompt_len"], size["new_tokens"]
  streams = b * k
  scored = b * plen + streams * (t - 1)  # the scoring forwards' rows, prompt once per group
  # Per layer: q, k, v, o are [h, h] (kv heads = heads), gate and up [h, i], down [i, h].
  trunk_shapes = [(h, h, 4 * h * h), (h, i, 2 * h * i), (i, h, h * i)]

  def trunk_rate(rows, left=False):
    return harmonic([(rate(rows, a, c, args.repeats, left), w) for a, c, w in trunk_shapes])

  rates = {
      "trunk_scoring": trunk_rate(scored),
      "head_scoring": rate(streams * t, h, v, args.repeats),
      "trunk_decode": max(trunk_rate(streams), trunk_rate(streams, left=True)),
      "head_decode": max(rate(streams, h, v, args.repeats),
                         rate(streams, h, v, args.repeats, left=True)),
  }
  trunk, attention, head = flops_lib.scoring_forward_flops(m, b, plen, k, t, True)
  recompute = flops_lib.remat_recompute_flops(m, b, plen, k, t, True, 1, args.remat,
                                              fused_head=bool(args.fused_head))
  trunk_params, head_params = flops_lib.matrix_params(m)
  rollout = flops_lib.rollout_flops(m, b, plen, k, t)
  # The rollout's share carried by the head: the decode steps' and the prefill's last positions.
  rollout_head = 2 * head_params * (streams * (t - 1) + b)
  fl = {"rollout": rollout, "reference": trunk + attention + head,
        "update": 3 * (trunk + attention + head) + recompute}
  floor = {
      "rollout": (rollout - rollout_head) / rates["trunk_decode"] / 1e9
                 + rollout_head / rates["head_decode"] / 1e9,
      "reference": (trunk + attention) / rates["trunk_scoring"] / 1e9
                   + head / rates["head_scoring"] / 1e9,
  }
  # The update: forward and backward (3 forwards) plus the recomputation, whose head part is
  # every log-prob chunk's head without --fused_head (remat_recompute_flops counts it then).
  update_head = 3 * head + (0 if args.fused_head else head)
  update_trunk = fl["update"] - update_head
  floor["update"] = (update_trunk / rates["trunk_scoring"]
                     + update_head / rates["head_scoring"]) / 1e9
  floor_s = sum(floor.values())
  out = dict(size=args.size, remat=args.remat, fused_head=args.fused_head, jax=jax.__version__,
             params=m.num_params, trunk_params=trunk_params, scored_rows=scored,
             decode_rows=streams,
             gflops={k_: round(r, 3) for k_, r in rates.items()},
             gflop={k_: round(f / 1e9, 6) for k_, f in fl.items()},
             floor_s={k_: significant(s, 6) for k_, s in floor.items()},
             floor_iteration_s=significant(floor_s, 6))
  if args.peer_s:
    peers = dict(kv.split("=") for kv in args.peer_s.split(","))
    out["max_ratio"] = {name: round(float(s) / floor_s, 3) for name, s in peers.items()}
  if args.hf_generate_s:
    out["max_rollout_ratio_hf"] = round(args.hf_generate_s / floor["rollout"], 3)
  print(json.dumps(out), flush=True)


if __name__ == "__main__":
  main()

r"""A decode step's matmuls, the weights on the right (as stored) or on the left (the trainer's
decode on CPU, `layers.dense_left`), on XLA:CPU.

One jitted program runs `--steps` decode steps of a Llama-shaped stack's matmuls on `--rows`
rows (the streams of a rollout): per layer the fused q/k/v, the output projection, gate, up and
down, then the head, with a norm and the activations between them, and nothing else (no
attention, no cache, no sampling). Each step reads every weight once, so with real model sizes
the weights stream from memory as a rollout's do. Forms, timed in alternating rounds:

  plain       x @ W, W [in, out] as stored
  left        `layers.dense_left`: (W.T @ x.T).T with W.T [out, in] laid out before the loop
  left_folded the same without its optimization barriers: XLA rewrites transpose(dot) as a dot
              of swapped operands, which is the plain product again, against W.T

Prints one JSON line: the median milliseconds per step of each form, the ratios to plain, and
the weight bytes a step reads over the step time (GB/s).

    python experiments/bench_decode_matmul.py                      # size (c): 0.5B, vocab 151936
    python experiments/bench_decode_matmul.py --hidden 256 --layers 4 --vocab 256 --rows 32
"""
import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rloo_jax.models.layers import dense_left  # noqa: E402

FORMS = ("plain", "left", "left_folded")


def _norm(x):
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def _folded(x, w_oi):
  """`dense_left` without its barriers."""
  b, s, e = x.shape
  return (w_oi @ x.reshape(b * s, e).T).T.reshape(b, s, w_oi.shape[0])


def _plain(x, w_io):
  b, s, e = x.shape
  return (x.reshape(b * s, e) @ w_io).reshape(b, s, w_io.shape[1])


def step_fn(matmul, hidden):
  def step(layers, head, x):
    for w in layers:
      qkv = matmul(_norm(x), w["qkv"])
      x = x + matmul(jnp.tanh(qkv[..., :hidden]), w["o"])
      h = _norm(x)
      x = x + matmul(jax.nn.silu(matmul(h, w["gate"])) * matmul(h, w["up"]), w["down"])
    return matmul(_norm(x), head)
  return step


def program(form, hidden, steps):
  matmul = {"plain": _plain, "left": dense_left, "left_folded": _folded}[form]
  step = step_fn(matmul, hidden)

  def run(layers, head, x):
    def body(x, _):  # each step's input depends on the last step's logits, as in a rollout
      return x + 1e-9 * step(layers, head, x).sum(), None
    return jax.lax.scan(body, x, None, length=steps)[0]
  return jax.jit(run)


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--hidden", type=int, default=896)
  p.add_argument("--layers", type=int, default=24)
  p.add_argument("--intermediate", type=int, default=0, help="0: 4 x hidden")
  p.add_argument("--vocab", type=int, default=151936)
  p.add_argument("--rows", type=int, default=16, help="streams decoded together")
  p.add_argument("--steps", type=int, default=8, help="decode steps per timed call")
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--forms", default=",".join(FORMS))
  args = p.parse_args()
  e, f, v = args.hidden, args.intermediate or 4 * args.hidden, args.vocab
  keys = iter(jax.random.split(jax.random.PRNGKey(0), 5 * args.layers + 2))
  normal = lambda shape: 0.02 * jax.random.normal(next(keys), shape)  # noqa: E731
  stored = [dict(qkv=normal((e, 3 * e)), o=normal((e, e)), gate=normal((e, f)),
                 up=normal((e, f)), down=normal((f, e))) for _ in range(args.layers)]
  head = normal((e, v))
  # The [out, in] layout the trainer's decode_weights prepares once a rollout.
  left = ([{name: w.T.copy() for name, w in layer.items()} for layer in stored], head.T.copy())
  weights = {"plain": (stored, head), "left": left, "left_folded": left}
  x = normal((args.rows, 1, e))
  forms = args.forms.split(",")
  fns = {form: program(form, e, args.steps) for form in forms}
  for form in forms:  # compile and warm up
    jax.block_until_ready(fns[form](*weights[form], x))
  times = {form: [] for form in forms}
  for _ in range(args.rounds):
    for form in forms:
      t0 = time.perf_counter()
      jax.block_until_ready(fns[form](*weights[form], x))
      times[form].append((time.perf_counter() - t0) / args.steps)
  step_bytes = 4 * (args.layers * (4 * e * e + 3 * e * f) + e * v)
  med = {form: statistics.median(ts) for form, ts in times.items()}
  print(json.dumps({
      "config": vars(args), "jax": jax.__version__, "backend": jax.default_backend(),
      "weight_mb_per_step": round(step_bytes / 1e6, 1),
      "ms_per_step": {form: round(s * 1e3, 2) for form, s in med.items()},
      "gb_per_s": {form: round(step_bytes / s / 1e9, 1) for form, s in med.items()},
      "plain_over": {form: round(med["plain"] / s, 3) for form, s in med.items()}
      if "plain" in med else None,
      "all_ms": {form: [round(t * 1e3, 2) for t in ts] for form, ts in times.items()},
  }))


if __name__ == "__main__":
  main()

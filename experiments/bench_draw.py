r"""The sampler's per-token draw on its own: `sampling.draw` (the two-level inverse CDF, two
uniforms per stream) against the Gumbel-max draw it replaced (`jax.random.categorical`'s:
argmax(logits + Gumbel noise), one variate per logit), at a decode step's shapes [B, K, V].

Gumbel-max is timed two ways, as the sampler ran it before: the noise drawn inside the step
(`in_step`: a rollout whose noise exceeded 64 MB, any large vocabulary) and pre-drawn
(`pre_drawn`: only the add and the argmax, the noise's own cost paid up front). Every program
is jitted on float32 logits and timed in interleaved rounds; prints one JSON line per shape
with the median milliseconds per step and the ratios.

    python experiments/bench_draw.py
    python experiments/bench_draw.py --shapes 4x4x151936 --rounds 50
"""
import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

from rloo_jax import sampling


def gumbel_in_step(keys_bk, logits_bkv):
  noise = jax.vmap(jax.vmap(lambda key: jax.random.gumbel(key, logits_bkv.shape[-1:])))(keys_bk)
  return gumbel_pre_drawn(noise, logits_bkv)


def gumbel_pre_drawn(noise_bkv, logits_bkv):
  tokens = jnp.argmax(logits_bkv + noise_bkv, axis=-1).astype(jnp.int32)
  logp = jax.nn.log_softmax(logits_bkv, axis=-1)
  return tokens, jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]


def inverse_cdf(uniforms_bk2, logits_bkv):
  return sampling.draw(sampling.Temperature(1.0), uniforms_bk2, logits_bkv)


def time_shape(b, k, v, rounds):
  logits = jax.random.normal(jax.random.key(1), (b, k, v)) * 2
  keys = sampling.stream_keys(jax.random.key(0), b, k)
  uniforms = jax.random.uniform(jax.random.key(2), (b, k, 2))
  noise = jax.random.gumbel(jax.random.key(3), (b, k, v))
  programs = {"inverse_cdf": (jax.jit(inverse_cdf), uniforms),
              "gumbel_in_step": (jax.jit(gumbel_in_step), keys),
              "gumbel_pre_drawn": (jax.jit(gumbel_pre_drawn), noise)}
  times = {name: [] for name in programs}
  for fn, first in programs.values():
    jax.block_until_ready(fn(first, logits))
  for _ in range(rounds):
    for name, (fn, first) in programs.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(first, logits))
      times[name].append(time.perf_counter() - start)
  ms = {name: round(1e3 * statistics.median(t), 4) for name, t in times.items()}
  return {"shape_bkv": [b, k, v], "grid": list(sampling._grid(v)), "ms_per_step": ms,
          "in_step_over_inverse_cdf": round(ms["gumbel_in_step"] / ms["inverse_cdf"], 2),
          "pre_drawn_over_inverse_cdf": round(ms["gumbel_pre_drawn"] / ms["inverse_cdf"], 2),
          "backend": jax.default_backend()}


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--shapes", default="8x4x256,8x4x4096,4x4x151936",
                 help="comma-separated BxKxV: prompts x streams x vocabulary")
  p.add_argument("--rounds", type=int, default=30)
  args = p.parse_args()
  for shape in args.shapes.split(","):
    try:
      b, k, v = (int(x) for x in shape.split("x"))
    except ValueError:
      raise SystemExit(f"--shapes: {shape!r} is not BxKxV (e.g. 8x4x4096)") from None
    print(json.dumps(time_shape(b, k, v, args.rounds)), flush=True)


if __name__ == "__main__":
  main()

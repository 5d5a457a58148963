"""The rollout engine (`sampler.sample(slots=S)`) beside the static sampler at the same KV memory,
and paged (--paged_slots slots in --paged_memory of that KV memory), on completion
lengths forced from a distribution (docs/PERFORMANCE.md, "Rollout engine": the forcing, the
same-memory rule, the figures). `lognormal`: median T/4, sigma 1; `uniform`: 1..T; `full`: no
end token. Useful tokens: every stream's up to its end. The three run in turn each round (after a
compile each), so a slow spell of the machine falls on all three: ratios are medians of each
round's, tokens/s medians over --repeats rounds.

    python experiments/bench_rollout.py
"""
import argparse
import json
import math
import statistics
import time

import numpy as np

import jax
import jax.numpy as jnp

from rloo_jax import engine as engine_lib
from rloo_jax import engine_pool
from rloo_jax import models, sampler, sampler_args, sampling

EOS = 1


def hazard(dist: str, t_cap: int, rng) -> np.ndarray:
  """h[i]: P(a stream ends at step i | it reached it), i = 0..T-1 (length i + 1)."""
  if dist == "full":
    return np.zeros(t_cap)
  edges = np.arange(t_cap + 1, dtype=np.float64)
  if dist == "lognormal":
    z = (np.log(np.maximum(edges, 1e-300)) - math.log(t_cap / 4)) / math.sqrt(2)
    cdf = 0.5 * (1 + np.vectorize(math.erf)(z))
  else:
    cdf = edges / t_cap
  pmf = np.diff(cdf)
  pmf[-1] += 1 - cdf[-1]
  survive = 1 - np.concatenate([[0], np.cumsum(pmf)[:-1]])
  return np.clip(pmf / np.maximum(survive, 1e-12), 0, 1)


def forced(fns, h, prompt_len: int):
  """`fns` with the end token's probability at completion step t set to h[t] (all prompts
  prompt_len long, so a decode input at position x draws step x - prompt_len + 1)."""
  logit_h = jnp.asarray(np.log(np.clip(h, 1e-30, 1)) - np.log(np.clip(1 - h, 1e-30, 1)),
                        jnp.float32)

  def at(logits, step):
    others = jnp.where(jnp.arange(logits.shape[-1]) == EOS, -jnp.inf, logits.astype(jnp.float32))
    eos = jax.nn.logsumexp(others, axis=-1) + logit_h[jnp.minimum(step, len(h) - 1)]
    return others.at[..., EOS].set(eos)

  def prefill(params, tokens, positions, mask, **kw):
    logits, prefix = fns.prefill(params, tokens, positions, mask, **kw)
    return at(logits, jnp.zeros(logits.shape[:-1], jnp.int32)), prefix

  def decode(params, tokens, positions, cache, **kw):
    logits, cache = fns.decode(params, tokens, positions, cache, **kw)
    return at(logits, positions - prompt_len + 1), cache

  return fns._replace(prefill=prefill, decode=decode)


def decode_cost(fns, params, a) -> dict:
  """FLOPs and bytes per token of one engine decode step (`cost_analysis` of the compiled
  model step over every slot) at each KV limit L the engine's phases read: they follow L."""
  t_cap, out = a.max_new_tokens, {}
  cache = jax.eval_shape(lambda: engine_pool.empty_cache(fns, params, a.prompt_len, a.slots,
                                                      a.slots, t_cap, False))
  tok = jax.ShapeDtypeStruct((a.slots, 1), jnp.int32)
  for lim in (t_cap // 8, t_cap // 4, t_cap // 2, t_cap):
    step = jax.jit(lambda p, t, x, c, lim=lim: fns.decode(p, t, x, c, kv_limit=lim))
    cost = step.lower(params, tok, tok, cache).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    out[lim] = {"flops_per_token": round(cost["flops"] / a.slots),
                "bytes_per_token": round(cost["bytes accessed"] / a.slots)}
    print(f"decode step reading {lim:5d} stream slots: {out[lim]['flops_per_token']:.4g} FLOPs, "
          f"{out[lim]['bytes_per_token']:.4g} bytes a token")
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  for flag, default in (("groups", 128), ("k", 4), ("slots", 32), ("prefix_rows", 0),
                        ("max_new_tokens", 256), ("prompt_len", 32), ("hidden", 256), ("layers", 4),
                        ("vocab", 1024), ("repeats", 3), ("paged_slots", 32), ("page_size", 32)):
    ap.add_argument(f"--{flag}", type=int, default=default)
  ap.add_argument("--dists", default="lognormal,uniform,full")
  ap.add_argument("--paged_memory", type=float, default=0.5)
  a = ap.parse_args()
  t_cap, b = a.max_new_tokens, a.slots // a.k
  prefix_rows = a.prefix_rows or sampler_args.default_prefix_rows(a.slots, a.k)
  config = models.TransformerConfig.llama(
      vocab_size=a.vocab, hidden_size=a.hidden, num_layers=a.layers, num_heads=4,
      num_kv_heads=2, head_dim=a.hidden // 4, intermediate_size=2 * a.hidden,
      max_seq_len=a.prompt_len + t_cap)
  graphdef, params = models.create(config, seed=0)
  rng = np.random.default_rng(0)
  prompts = rng.integers(2, a.vocab, (a.groups, a.prompt_len)).astype(np.int32)
  lengths = np.full((a.groups,), a.prompt_len, np.int32)
  kw = dict(k=a.k, max_new_tokens=t_cap, method=sampling.Temperature(1.0), eos_id=EOS, pad_id=0)
  result = {"decode_cost": decode_cost(models.model_fns(graphdef), params, a)}
  for dist in a.dists.split(","):
    fns = forced(models.model_fns(graphdef), hazard(dist, t_cap, rng), a.prompt_len)
    outs = {}

    def static():  # one batch (--groups = slots / k, an unchunked rollout): the engine's draws
      key = lambda i: jax.random.key(1) if b >= a.groups else jax.random.fold_in(  # noqa: E731
          jax.random.key(1), i)
      outs["static"] = [sampler.sample(fns, params, prompts[i:i + b], lengths[i:i + b], key(i),
                                       **kw) for i in range(0, a.groups, b)]
      return [o.tokens_bkt for o in outs["static"]]

    def engine(name="engine", slots=a.slots, pages=0):
      outs[name] = state = engine_lib.run(
          fns, params, jnp.asarray(prompts), jnp.asarray(lengths), jax.random.key(1),
          jnp.asarray([EOS]), jnp.int32(0), k=a.k, max_new_tokens=t_cap, method=kw["method"],
          slots=slots, prefix_rows=prefix_rows, pages=pages, page_size=a.page_size)
      return state.tokens_nkt

    pages = int(a.slots * t_cap * a.paged_memory) // a.page_size
    paged = lambda: engine("paged", a.paged_slots, pages)  # noqa: E731
    runs = {"static": static, "engine": engine, "paged": paged}
    times = {name: [] for name in runs}
    for r in range(a.repeats + 1):  # round 0 compiles
      for name, f in runs.items():
        t0 = time.perf_counter()
        jax.block_until_ready(f())
        if r:
          times[name].append(time.perf_counter() - t0)
    seconds = {name: statistics.median(t) for name, t in times.items()}
    useful = {"static": sum(int(np.sum(o.lengths_bk)) for o in outs["static"]),
              **{n: int(np.sum(outs[n].lengths_nk)) for n in ("engine", "paged")}}
    row = {f"{name}_tok_s": round(useful[name] / seconds[name], 1) for name in seconds}
    for name, key in (("engine", "ratio"), ("paged", "paged_ratio")):
      row[key] = round(statistics.median(
          useful[name] / e / (useful["static"] / s)
          for e, s in zip(times[name], times["static"])), 3)
    row["paged_preempted"] = int(outs["paged"].preempted.max())
    mean_len = useful["engine"] / (a.groups * a.k)
    steps = {"static": sum(int(o.lengths_bk.max()) - 1 for o in outs["static"]),
             "engine": int(outs["engine"].steps.max())}
    row.update({f"{name}_decode_steps": v for name, v in steps.items()})
    # A stream's first token comes from its prompt's prefill, the rest from decode steps.
    decoded = useful["engine"] - a.groups * a.k
    row["engine_occupancy"] = round(decoded / (steps["engine"] * a.slots), 3)
    print(f"{dist:10s} mean length {mean_len:6.1f} of {t_cap}: static {seconds['static']:.3f} s "
          f"({useful['static']} tokens), engine {seconds['engine']:.3f} s ({useful['engine']} "
          f"tokens, {steps['engine']} steps, {row['engine_occupancy']:.0%} of slots live), "
          f"useful tokens/s ratio {row['ratio']:.2f}x; paged ({a.paged_slots} slots) "
          f"{seconds['paged']:.3f} s, {row['paged_ratio']:.2f}x")
    result[dist] = row
  print(json.dumps(result))


if __name__ == "__main__":
  main()

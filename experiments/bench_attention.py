r"""Attention implementations side by side (`config.model.attention`, docs/PERFORMANCE.md
"Attention"): one layer's forward + backward through `attention_ops.attend` at growing lengths,
one JSON line per (layout, length). Per implementation (--impls; bfloat16, one row): `ms`
(median of --repeats after a compile), `temp_mib` (compiled temporaries), and `max_rel_err` of
the output and q, k, v gradients against 'xla' in float32 (TF32 on a GPU unless `--precision
highest`; 'cudnn' runs bfloat16 only, so its own error is bfloat16's). Layouts: `causal` (S tokens, the first 5% padding), `group` (a --prompt prompt, then S
tokens as 8 completions, token-major); no 'xla' past XLA_MAX tokens.

    python experiments/bench_attention.py --lengths 1024,2048 --heads 2,6 --head_dim 64  # CPU
    python experiments/bench_attention.py          # a GPU: Qwen2.5-1.5B's heads, 1K-16K, bf16
"""
import argparse
import json

import jax
import jax.numpy as jnp

import gpu_check  # experiments/, beside this file: its median_s
from rloo_jax.models import attention_ops as ops

LAYOUTS, COMPLETIONS, XLA_MAX = ("causal", "group"), 8, 20000


def layout(kind, b, s, prompt, m=COMPLETIONS):
  """(layout, rows, the rows that have a key to read: a pad row's output is unused and differs
  by implementation)."""
  pad = s // 20
  if kind == "causal":
    valid = jnp.arange(s)[None].repeat(b, 0) >= pad
    return ops.Causal(valid), s, valid
  t = s // m
  prompt_ok = jnp.arange(prompt)[None].repeat(b, 0) >= pad
  return (ops.PromptGroup(prompt_ok, jnp.ones((b, m, t), bool)), prompt + m * t,
          jnp.concatenate([prompt_ok, jnp.ones((b, m * t), bool)], 1))


def program(impl, spec_layout, valid_bs, scale):
  spec = ops.AttentionSpec(spec_layout, scale=scale, implementation=impl)
  def loss(q, k, v):
    o = ops.attend(q, k, v, spec).astype(jnp.float32)
    return jnp.sum(jnp.where(valid_bs[:, :, None, None, None], o, 0.0))
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def run(args, kind, s):
  hkv, g = (int(x) for x in args.heads.split(","))
  lay, rows, valid = layout(kind, 1, s, args.prompt)
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  kv = (1, rows, hkv, args.head_dim)
  shapes = [(1, rows, hkv, g, args.head_dim), kv, kv]
  out = dict(layout=kind, tokens=rows, backend=jax.default_backend())
  ref = None
  for impl in args.impls.split(","):
    if impl == "xla" and rows > XLA_MAX:
      out[impl] = "skipped: XLA_MAX"
      continue
    qkv = [jax.random.normal(kk, sh, jnp.bfloat16) for kk, sh in zip(keys, shapes)]
    fn = program(impl, lay, valid, args.head_dim ** -0.5)
    temp = fn.lower(*qkv).compile().memory_analysis().temp_size_in_bytes
    ms = 1e3 * gpu_check.median_s(lambda _: fn(*qkv), args.repeats)  # after a compiling call
    out[impl] = dict(ms=round(ms, 3), temp_mib=round(temp / 2**20, 2))
    # float32, against 'xla' (the reference)
    dt = jnp.bfloat16 if impl == "cudnn" else jnp.float32
    got = program(impl, lay, valid, args.head_dim ** -0.5)(*[x.astype(dt) for x in qkv])
    if impl == "xla":
      ref = got
    elif ref is not None:
      # Of each of the value, dq, dk, dv: max|diff| / max|ref|.
      out[impl]["max_rel_err"] = float(max(
          jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))
          for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref))))
  return out


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--lengths", default="1024,2048,4096,8192,16384")
  p.add_argument("--heads", default="2,6", help="kv heads, query heads per kv head (Qwen2.5-1.5B)")
  p.add_argument("--head_dim", type=int, default=128)
  p.add_argument("--prompt", type=int, default=1024, help="group: the prompt's tokens")
  p.add_argument("--impls", default="xla,blockwise", help="'xla' first; a GPU adds cudnn")
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--precision", default="", help="jax_default_matmul_precision ('highest')")
  args = p.parse_args()
  if args.precision:
    jax.config.update("jax_default_matmul_precision", args.precision)
  for kind in LAYOUTS:
    for s in (int(x) for x in args.lengths.split(",")):
      print(json.dumps(run(args, kind, s)), flush=True)


if __name__ == "__main__":
  main()

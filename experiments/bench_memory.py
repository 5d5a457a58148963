r"""Per-device memory of the sharded train state and of the compiled update step, for fsdp = 1..8.

    python experiments/bench_memory.py            # 8 simulated CPU devices; prints one JSON line

For each mesh (data = 8 / fsdp, fsdp, tensor = 1) it builds the trainer on a model whose dims
divide by 8, takes the train state's shardings (nothing is allocated: abstract arrays only), and
reports per device: parameter + optimizer-state bytes (the target is 1/fsdp of the total, within
10%), the frozen reference's bytes, and the compiled `train_step`'s memory analysis (peak temporary
bytes, arguments, outputs) from `jit(...).lower(...).compile().memory_analysis()`.
"""

from __future__ import annotations

import os
import sys

if "jax" not in sys.modules:  # simulated devices must be requested before jax starts
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()

import json
import tempfile

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rloo_jax import sharding, trainer  # noqa: E402
from rloo_jax.config_utils import base_config  # noqa: E402

MODEL = dict(hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=8, head_dim=64,
             intermediate_size=1536, max_seq_len=32)
NUM_PROMPTS, K = 32, 4


def config_for(fsdp: int):
  c = base_config()
  c.model.update(MODEL)
  c.rloo.update(num_prompts=NUM_PROMPTS, k=K, max_new_tokens=8)
  c.data.update(num_train=64, num_test=16)
  c.mesh.update(data=jax.device_count() // fsdp, fsdp=fsdp, tensor=1)
  return c


def abstract_rows(exp, rows: int):
  c = exp.config
  s, t = c.data.max_prompt_len + c.rloo.max_new_tokens, c.rloo.max_new_tokens
  sh = exp.layout.batch_sharding
  spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sh)
  return dict(tokens=spec((rows, s), jnp.int32), positions=spec((rows, s), jnp.int32),
              mask=spec((rows, s), jnp.bool_), completions=spec((rows, t), jnp.int32),
              cmask=spec((rows, t), jnp.bool_), old_logp=spec((rows, t), jnp.float32),
              advantages=spec((rows,), jnp.float32))


def measure(fsdp: int, workdir: str, task=None) -> tuple[dict, object]:
  exp = trainer.build(config_for(fsdp), workdir, task=task)
  state = trainer.abstract_state(exp)
  total = lambda tree: int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))
  params_opt = sharding.per_device_bytes((state.params, state.opt_state))
  full = total((state.params, state.opt_state))
  rows = NUM_PROMPTS * K // exp.config.train.num_minibatches
  compiled = exp.step_fn.lower(state, abstract_rows(exp, rows)).compile()
  mem = compiled.memory_analysis()
  row = dict(
      mesh=dict(exp.layout.mesh.shape), fsdp=fsdp,
      param_opt_bytes_per_device=params_opt, param_opt_bytes_total=full,
      fraction_of_total=round(params_opt / full, 4), target_fraction=round(1 / fsdp, 4),
      within_10pct=abs(params_opt * fsdp / full - 1) <= 0.10,
      ref_bytes_per_device=sharding.per_device_bytes(state.ref_params),
      step_temp_bytes=int(mem.temp_size_in_bytes),
      step_argument_bytes=int(mem.argument_size_in_bytes),
      step_output_bytes=int(mem.output_size_in_bytes),
      step_alias_bytes=int(mem.alias_size_in_bytes))
  return row, exp.task


def main():
  rows, task = [], None
  with tempfile.TemporaryDirectory() as workdir:
    for fsdp in (1, 2, 4, 8):
      row, task = measure(fsdp, workdir, task)
      rows.append(row)
  exp_cfg = trainer.model_config(config_for(1), task.tokenizer.vocab_size)
  print(json.dumps(dict(
      bench="memory", devices=jax.device_count(), platform=jax.devices()[0].platform,
      model=dict(MODEL, vocab_size=task.tokenizer.vocab_size, num_params=exp_cfg.num_params),
      rollout_rows=NUM_PROMPTS * K, results=rows)))


if __name__ == "__main__":
  main()

r"""Per-device memory of the sharded train state and of the compiled update step, for fsdp = 1..8.

    python experiments/bench_memory.py            # 8 simulated CPU devices; prints one JSON line

For each mesh (data = 8 / fsdp, fsdp, tensor = 1) it builds the RLOO experiment on a model whose dims
divide by 8, takes the train state's shardings (nothing is allocated: abstract arrays only), and
reports per device: parameter + optimizer-state bytes (the target is 1/fsdp of the total, within
10%), the frozen reference's bytes, and the compiled `train_step`'s memory analysis (peak temporary
bytes, arguments, outputs) from `jit(...).lower(...).compile().memory_analysis()`, for the rows
the configured layout trains on (`rollout.make_rows`: grouped rows with config.train.shared_prefix).
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
from rloo_jax import experiment, rollout, sharding  # noqa: E402
from rloo_jax.algorithms.rloo import RLOO  # noqa: E402
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


def abstract_rows(exp, prompts: int):
  """ShapeDtypeStructs of the update's rows for `prompts` prompts (k samples each), in the layout
  the config trains on: `rollout.make_rows` traced, nothing computed."""
  c = exp.config
  k, p, t = c.rloo.k, c.data.max_prompt_len, c.rloo.max_new_tokens
  n = prompts * k
  spec = jax.ShapeDtypeStruct
  return jax.eval_shape(
      lambda *a: rollout.make_rows(*a, k=k, shared_prefix=bool(c.train.shared_prefix)),
      spec((prompts, p), jnp.int32), spec((prompts,), jnp.int32), spec((n, t), jnp.int32),
      spec((n, t), jnp.bool_), spec((n, t), jnp.float32))


def measure(fsdp: int, workdir: str, task=None) -> tuple[dict, object]:
  exp = experiment.build(config_for(fsdp), workdir, task=task)
  algo = RLOO(exp)
  state = algo.abstract_state()
  total = lambda tree: int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))
  params_opt = sharding.per_device_bytes((state.params, state.opt_state))
  full = total((state.params, state.opt_state))
  prompts = NUM_PROMPTS // exp.config.train.num_minibatches
  # The update runs as two programs (update.TrainStep); the gradient one holds the activations.
  lowered = algo.step_fn.lower(state, abstract_rows(exp, prompts))
  mem = lowered["update_gradients"].compile().memory_analysis()
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
  return row, exp


def main():
  rows, exp = [], None
  with tempfile.TemporaryDirectory() as workdir:
    for fsdp in (1, 2, 4, 8):
      row, exp = measure(fsdp, workdir, exp and exp.task)
      rows.append(row)
  vocab = exp.tokenizer.vocab_size
  print(json.dumps(dict(
      bench="memory", devices=jax.device_count(), platform=jax.devices()[0].platform,
      model=dict(MODEL, vocab_size=vocab, num_params=exp.model_config.num_params),
      rollout_rows=NUM_PROMPTS * K, results=rows)))


if __name__ == "__main__":
  main()

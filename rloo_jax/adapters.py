"""LoRA in training (config.model.lora; the adapters in the model: rloo_jax.models.lora).

With config.model.lora.rank > 0 the RL train state is laid out so the base weights exist once:

    state.params      the adapters (nnx.LoRAParam leaves only): all the optimizer sees
    state.opt_state   AdamW's moments of the adapters
    state.ref_params  the frozen base, in the reference's dtype (config.model.ref_dtype): the
                      reference policy itself (run by the rank-0 model, `Experiment.base_fns`)
                      and the base under the policy's adapters (`TrainState.policy_params`)

Checkpoints hold everything but the base (`checkpoint_state`): it is named by
config.model.init_from or the workdir's cached SFT policy, and put back on resume
(`resume_state`) exactly as `init_state` made it, so a resumed run is bit-identical.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from rloo_jax.models import config as model_config_lib
from rloo_jax.models import lora, transformer

# What a checkpoint stores in place of the base.
_NO_BASE = ((), jnp.int8)


def model_config(config, mcfg: transformer.TransformerConfig) -> transformer.TransformerConfig:
  """`mcfg` with config.model.lora's rank, alpha and targets (unchanged when the rank is 0);
  raises naming config.model.lora when they do not fit the architecture."""
  section = config.model.get("lora", None)
  if section is None or not int(section.get("rank", 0)):
    return mcfg
  mcfg = mcfg.replace(lora_rank=int(section.rank), lora_alpha=float(section.alpha),
                      lora_targets=lora.parse_targets(section.targets))
  lora.check(mcfg)
  return mcfg


def check_config(config) -> None:
  """config.model.lora's own consistency, before anything is built (the targets against the
  architecture: `model_config`)."""
  section = config.model.get("lora", None)
  if section is None:
    return
  rank = section.get("rank", 0)
  if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
    raise ValueError(f"config.model.lora.rank = {rank!r}; 0 (off) or a positive integer")
  if not rank:
    return
  algorithm = config.get("algorithm", "rloo")
  if algorithm != "rloo":
    raise ValueError(f"config.model.lora is for config.algorithm='rloo' (its train state keeps "
                     f"the base once); {algorithm!r} trains every weight: set "
                     "--config.model.lora.rank=0")
  if not float(section.get("alpha", 0)) > 0:
    raise ValueError(f"config.model.lora.alpha = {section.get('alpha')!r} must be > 0")
  bad = [t for t in lora.parse_targets(section.get("targets", "")) if t not in lora.TARGETS]
  if bad or not lora.parse_targets(section.get("targets", "")):
    raise ValueError(f"config.model.lora.targets = {section.get('targets')!r}: a comma-separated "
                     f"subset of {','.join(lora.TARGETS)}")


def init_adapters(mcfg: transformer.TransformerConfig, seed: int):
  """Fresh adapters (A random, B zero) of the LoRA model `mcfg`. Traced inside the state's
  jitted init, so the base weights the module also creates are dead code XLA drops."""
  params = nnx.split(transformer.Transformer(mcfg, rngs=nnx.Rngs(seed)))[1]
  return lora.split(params)[0]


def reference_as_policy(state):
  """The reference in the LoRA model's form: the base under zero adapters, which gives the
  base's logits exactly (B = 0 makes every adapter term an exact zero)."""
  return lora.join(state.ref_params, jax.tree.map(jnp.zeros_like, state.params))


def checkpoint_state(state):
  """The state as checkpoints hold it: without the base (a scalar in its place)."""
  if not state.lora:
    return state
  return state.replace(ref_params=jnp.zeros(*_NO_BASE))


def abstract_checkpoint(exp, abstract_state):
  """The restore target of `checkpoint_state`'s form."""
  if not abstract_state.lora:
    return abstract_state
  return abstract_state.replace(
      ref_params=jax.ShapeDtypeStruct(*_NO_BASE, sharding=exp.layout.replicated))


def resume_state(exp, state, base_params):
  """A restored checkpoint with its base put back: `base_params` (the starting policy, as
  `policy_init.initial_params` gives it) stored as `init_state` stores it."""
  if not state.lora:
    return state
  base_sh = exp.state_shardings.ref_params
  base = jax.jit(lambda p: reference_copy(exp.config, p), out_shardings=base_sh)(
      exp.layout.put(base_params, base_sh))
  return state.replace(ref_params=base)


def reference_copy(config, params):
  """The frozen reference of `params`: their floating leaves in config.model.ref_dtype, by
  default ('') the activation dtype config.model.dtype, always a real copy. The reference is
  only ever run forward, where every weight is cast to the activation dtype anyway, so storing
  it in that dtype changes no number (LayerNorm's float32 scale/bias aside) and halves it under
  bfloat16 activations. Policy and reference must not share buffers, since the policy is
  donated to every train step."""
  name = config.model.get("ref_dtype", "") or config.model.dtype
  dtype = model_config_lib.dtype_of(name)

  def copy(x):
    if jnp.issubdtype(x.dtype, jnp.floating):
      return jnp.array(x, dtype=dtype, copy=True)
    return jnp.copy(x)

  return jax.tree.map(copy, params)

"""The starting policy (and so the RL reference): a local Hugging Face checkpoint, or the task's
own small model trained from scratch by the SFT stage (`rloo_jax.sft`, cached in the workdir)."""

from __future__ import annotations

from rloo_jax import platform, sft
from rloo_jax.models import hf, lora, transformer


def create_params(exp, seed: int = 0):
  """A freshly initialised policy, created directly sharded (never whole on one device). With
  LoRA it is the base (no adapters): the starting policy is the same either way."""
  init = platform.jit(transformer.init_params, static_argnums=(0, 1),
                      out_shardings=exp.state_shardings.ref_params)
  return init(lora.base_config(exp.model_config), seed)


def initial_params(exp, *, log=print):
  """config.model.init_from's weights, or SFT from scratch on the task's demonstrations."""
  config = exp.config
  if config.model.init_from:
    # Straight onto the mesh, each process reading only its own devices' slices of the files:
    # the host never holds the whole model (an 8B model is 32 GB in float32).
    _, params = hf.load_checkpoint(config.model.init_from, dtype=config.model.dtype,
                                   shardings=exp.state_shardings.ref_params)
    return params
  return sft.train(config, exp.workdir, exp.base_fns or exp.fns,
                   create_params(exp, seed=config.seed), exp.task,
                   log=log, layout=exp.layout)


def is_cached(config, workdir: str) -> bool:
  """True when `initial_params` will load rather than train (nothing to time)."""
  return bool(config.model.init_from) or sft.is_cached(config, workdir)

"""LoRA adapters as a PEFT directory (adapter_config.json + adapter_model.safetensors) that
`peft.PeftModel.from_pretrained(base, out_dir)` loads onto the base model's Hugging Face
checkpoint.

PEFT's layout per targeted torch Linear `<module>`: `base_model.model.<module>.lora_A.weight`
[r, in] and `lora_B.weight` [out, r], with `lora_alpha / r` as the scale, as here. Our A is
[in..., r] and B [r, out...], stacked over layers, with the in / out axes flattened in the order
hf_export flattens the kernels ([E, H, D] -> H*D), so the transposes are all the mapping.
"""

from __future__ import annotations

import json
import os

from rloo_jax.models import hf_export, lora
from rloo_jax.models.config import TransformerConfig

ADAPTER_CONFIG = 'adapter_config.json'
ADAPTER_WEIGHTS = 'adapter_model.safetensors'
_FAMILIES = ('llama', 'qwen2', 'qwen3')


def _module(target: str) -> str:
  return ('self_attn.' if target in ('q', 'k', 'v', 'o') else 'mlp.') + lora.HF_MODULES[target]


def adapter_tensors(params, c: TransformerConfig) -> list:
  """(PEFT name, shape, producer) of every adapter tensor of `params` (the LoRA model's state,
  or its adapters alone)."""
  if c.family not in _FAMILIES:
    raise ValueError(f'PEFT export maps the separate q/k/v/o and gate/up/down projections of '
                     f'{_FAMILIES}; family {c.family!r} fuses them')
  leaf = hf_export._leaves(lora.split(params)[0])  # pylint: disable=protected-access
  r, out = c.lora_rank, []
  for t in lora.targets_of(c):
    owner = 'attn' if t in ('q', 'k', 'v', 'o') else 'mlp'
    a, b = leaf[f'layers.{owner}.{t}_lora_a'], leaf[f'layers.{owner}.{t}_lora_b']
    fan_in, fan_out = a[0].size // r, b[0].size // r
    for i in range(c.num_layers):
      name = f'base_model.model.model.layers.{i}.{_module(t)}'
      # Defaults bind this target's arrays and sizes (the closures run when written).
      out.append((f'{name}.lora_A.weight', (r, fan_in),
                  lambda a=a, i=i, n=fan_in: hf_export.to_host(a[i]).reshape(n, r).T))
      out.append((f'{name}.lora_B.weight', (fan_out, r),
                  lambda b=b, i=i, n=fan_out: hf_export.to_host(b[i]).reshape(r, n).T))
  return out


def adapter_config(c: TransformerConfig, base_model: str = '') -> dict:
  return {
      'peft_type': 'LORA', 'task_type': 'CAUSAL_LM', 'r': c.lora_rank,
      'lora_alpha': float(c.lora_alpha), 'lora_dropout': 0.0, 'bias': 'none',
      'target_modules': sorted(lora.HF_MODULES[t] for t in lora.targets_of(c)),
      'fan_in_fan_out': False, 'use_rslora': False, 'use_dora': False,
      'init_lora_weights': True, 'inference_mode': True, 'modules_to_save': None,
      'base_model_name_or_path': base_model or None}


def save_adapter(params, c: TransformerConfig, out_dir: str, *, base_model: str = '',
                 dtype: str = 'float32') -> list[str]:
  """Writes the PEFT directory of a LoRA model's adapters; returns the written paths.
  base_model: what adapter_config.json names as the base (config.model.init_from)."""
  if not c.lora_rank:
    raise ValueError('the model has no LoRA adapters (config.model.lora.rank is 0); export the '
                     'whole model without --adapter')
  if dtype not in hf_export.DTYPES:
    raise ValueError(f'dtype={dtype!r}; supported: {tuple(hf_export.DTYPES)}')
  entries = adapter_tensors(params, c)
  hf_export.check_out_dir(out_dir)
  os.makedirs(out_dir, exist_ok=True)
  np_dtype, st_dtype = hf_export.DTYPES[dtype]
  weights = os.path.join(out_dir, ADAPTER_WEIGHTS)
  write = hf_export._write_safetensors  # pylint: disable=protected-access
  write(weights, entries, np_dtype, st_dtype)
  path = os.path.join(out_dir, ADAPTER_CONFIG)
  with open(path, 'w') as f:
    json.dump(adapter_config(c, base_model), f, indent=2)
  return [weights, path]

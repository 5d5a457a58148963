"""LoRA adapters on the transformer's projections (config.model.lora).

Each targeted projection y = x W gains y += (x A) B * alpha / rank, A [in, r] random, B [r, out]
zero, so a fresh adapter leaves every logit exactly as the base gives it. The adapters are
`nnx.LoRAParam` attributes created inside the modules (`add`), so the layers' `nnx.vmap` stacks
them on the 'layers' axis like every other parameter, the layer scan slices them, FSDP's
per-layer gather and the logical sharding rules see them, and one filter separates them from the
frozen base (`split`): the trainable part of the train state is the adapters alone.

The base keeps its own graphdef (`base_config`: the same model with rank 0), so the reference
policy is the base parameters run by the base model, which computes no adapter term at all.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

TARGETS = ('q', 'k', 'v', 'o', 'gate', 'up', 'down')
# transformers' module names of each target (PEFT's target_modules), per family.
HF_MODULES = {'q': 'q_proj', 'k': 'k_proj', 'v': 'v_proj', 'o': 'o_proj', 'gate': 'gate_proj',
              'up': 'up_proj', 'down': 'down_proj'}
# The rank axis has no rule in the mesh rules, so it is never split.
RANK_AXIS = 'lora_rank'


def targets_of(config) -> tuple:
  return tuple(config.lora_targets) if config.lora_rank else ()


def scale(config) -> float:
  return float(config.lora_alpha) / config.lora_rank


def check(config) -> None:
  """Raises naming config.model.lora when the targets do not fit the architecture."""
  if config.lora_rank < 0:
    raise ValueError(f'config.model.lora.rank = {config.lora_rank}; 0 (off) or a positive rank')
  if not config.lora_rank:
    return
  if not config.lora_targets:
    raise ValueError('config.model.lora.rank > 0 needs config.model.lora.targets, e.g. '
                     "'q,v' or 'q,k,v,o,gate,up,down'")
  for t in config.lora_targets:
    if t not in TARGETS:
      raise ValueError(f'config.model.lora.targets: unknown {t!r}; choose from {TARGETS}')
    if t == 'gate' and not config.gated_mlp:
      raise ValueError(f"config.model.lora.targets: 'gate', but family {config.family!r} has "
                       'no gated MLP')
  # A rank above a projection's smaller side adds parameters and no expressiveness (A B then has
  # full rank already).
  dims = _dims(config)
  limit, at = min((min(dims[t]), t) for t in config.lora_targets)
  if config.lora_rank > limit:
    raise ValueError(f'config.model.lora.rank = {config.lora_rank} exceeds the smaller side of '
                     f'the {at!r} projection, {limit} (hidden size {config.hidden_size}); set '
                     f'--config.model.lora.rank <= {limit}')


def parse_targets(value) -> tuple:
  """'q,v' / ('q', 'v') -> ('q', 'v')."""
  if isinstance(value, str):
    return tuple(t.strip() for t in value.split(',') if t.strip())
  return tuple(value)


def _lora_param(rngs, init, shape, axes) -> nnx.LoRAParam:
  # Drawn flat and reshaped, as layers._param does, so a seed gives the adapters it always
  # has. The adapters are float32 whatever the base's dtype: they are what the optimizer updates.
  def flat_init(key, shape, dtype):
    return init(key, (math.prod(shape),), dtype).reshape(shape)
  return nnx.LoRAParam(nnx.with_partitioning(flat_init, axes, eager_sharding=False)(
      rngs.params(), shape, jnp.float32))


def add(module, rngs, config, name: str, in_shape, in_axes, out_shape, out_axes) -> None:
  """Creates `module.<name>_lora_a` [*in, r] and `<name>_lora_b` [r, *out] when `name` is a
  target. A is PEFT's default init (kaiming-uniform with a = sqrt(5): U(+-1/sqrt(fan_in))),
  B zero."""
  if name not in targets_of(config):
    return
  r, fan_in = config.lora_rank, math.prod(in_shape)
  bound = 1.0 / math.sqrt(fan_in)
  uniform = lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, -bound, bound)
  setattr(module, f'{name}_lora_a',
          _lora_param(rngs, uniform, (*in_shape, r), (*in_axes, RANK_AXIS)))
  setattr(module, f'{name}_lora_b',
          _lora_param(rngs, nnx.initializers.zeros, (r, *out_shape), (RANK_AXIS, *out_axes)))


def _dense(x_bsi, w_io):
  # One 2-D matmul over the flattened rows, as layers._dense (its docstring says why).
  b, s, i = x_bsi.shape
  return jnp.matmul(x_bsi.reshape(b * s, i), w_io).reshape(b, s, w_io.shape[-1])


def apply(module, name: str, x, y):
  """y plus the adapter term of projection `name` on its input x ([B, S, in...]); y itself
  (no operation at all) when `name` has no adapter. The term has y's shape ([B, S, out...])."""
  a = getattr(module, f'{name}_lora_a', None)
  if a is None:
    return y
  b = getattr(module, f'{name}_lora_b')
  dt = x.dtype
  a_ir = jnp.asarray(a[...], dt)
  a_ir = a_ir.reshape(-1, a_ir.shape[-1])
  h_bsr = _dense(x.reshape(*x.shape[:2], -1), a_ir) * jnp.asarray(scale(module.config), dt)
  b_ro = jnp.asarray(b[...], dt)
  delta = _dense(h_bsr, b_ro.reshape(b_ro.shape[0], -1))
  return y + delta.reshape(y.shape)


def base_config(config):
  """The same architecture without adapters: the graphdef of the frozen base (the reference)."""
  return config.replace(lora_rank=0, lora_targets=())


def split(params):
  """(adapters, base) of a LoRA model's params state."""
  return nnx.split_state(params, nnx.LoRAParam, ...)


def join(base, adapters):
  """The LoRA model's params state from its base and adapters (no copy)."""
  return nnx.merge_state(base, adapters)


def merged(config, params):
  """The base params with every adapter folded in, W + (alpha / r) * A B, in W's dtype: the
  state of `base_config(config)`'s model that computes what the LoRA model computes."""
  adapters, base = split(params)
  flat = dict(nnx.to_flat_state(base))
  s = scale(config)
  for path, a in nnx.to_flat_state(adapters):
    name = path[-1]
    if not name.endswith('_lora_a'):
      continue
    prefix, target = path[:-1], name[:-len('_lora_a')]
    b = _get(adapters, (*prefix, f'{target}_lora_b'))
    w = flat[(*prefix, f'{target}_kernel')]
    flat[(*prefix, f'{target}_kernel')] = w.replace(fold(w[...], a[...], b[...], s))
  return nnx.from_flat_state(flat)


def _get(state, path):
  node = state
  for p in path:
    node = node[p]
  return node[...]


def fold(w, a, b, s):
  """W + s * A B for a kernel with a leading layers axis: A [L, *in, r], B [L, r, *out], W
  [L, *in, *out]; computed in float32, returned in W's dtype."""
  layers, r = a.shape[0], a.shape[-1]
  a2 = jnp.asarray(a, jnp.float32).reshape(layers, -1, r)
  b2 = jnp.asarray(b, jnp.float32).reshape(layers, r, -1)
  delta = (s * jnp.einsum('lir,lro->lio', a2, b2)).reshape(w.shape)
  return (jnp.asarray(w, jnp.float32) + delta).astype(w.dtype)


def _dims(config) -> dict:
  """(in, out) of each target projection."""
  e, f, hd = config.hidden_size, config.intermediate_size, config.head_dim
  q, kv = config.num_heads * hd, config.num_kv_heads * hd
  return {'q': (e, q), 'k': (e, kv), 'v': (e, kv), 'o': (q, e), 'gate': (e, f), 'up': (e, f),
          'down': (f, e)}


def num_params(config) -> int:
  """Adapter parameters of `config` (0 when LoRA is off)."""
  dims = _dims(config)
  return config.num_layers * config.lora_rank * sum(sum(dims[t]) for t in targets_of(config))

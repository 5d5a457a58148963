"""LoRA (rloo_jax.models.lora): the model's properties on a tiny llama."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import assert_f32_close
from flax import nnx

from rloo_jax.models import lora, transformer

# Float comparisons of two computations: rerun by .ci/run under other CPU flags.
pytestmark = pytest.mark.numerics

TINY = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
            intermediate_size=48, max_seq_len=16)


def _config(**kw):
  kw = {**dict(lora_rank=4, lora_alpha=8.0, lora_targets=lora.TARGETS), **kw}
  return transformer.TransformerConfig.llama(**TINY, **kw)


def _rows(b=2, s=10, seed=0):
  tokens = jax.random.randint(jax.random.PRNGKey(seed), (b, s), 0, TINY['vocab_size'])
  positions = jnp.broadcast_to(jnp.arange(s), (b, s))
  return tokens, positions, jnp.ones((b, s), bool)


def _randomise_b(params, seed=1):
  """Every B nonzero, so the adapters change the output (a fresh one does not)."""
  adapters, base = lora.split(params)
  keys = iter(jax.random.split(jax.random.PRNGKey(seed), 64))
  flat = {path: (v.replace(0.05 * jax.random.normal(next(keys), v.shape))
                 if path[-1].endswith('_lora_b') else v)
          for path, v in nnx.to_flat_state(adapters)}
  return lora.join(base, nnx.from_flat_state(flat))


def test_adapters_are_stacked_float32_and_apart_from_the_base():
  cfg = _config(param_dtype='bfloat16')
  _, params = transformer.create(cfg)
  adapters, base = lora.split(params)
  leaves = jax.tree.leaves(adapters)
  assert sum(x.size for x in leaves) == lora.num_params(cfg)
  assert all(x.dtype == jnp.float32 and x.shape[0] == cfg.num_layers for x in leaves)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(base))
  base_tree = transformer.abstract(lora.base_config(cfg))[1]
  assert jax.tree.structure(base) == jax.tree.structure(base_tree)


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_zero_adapters_give_the_base_logits_exactly(dtype):
  cfg = _config(dtype=dtype)
  graphdef, params = transformer.create(cfg)
  adapters, base = lora.split(params)
  assert all(not np.any(np.asarray(b)) for path, b in nnx.to_flat_state(adapters)
             if path[-1].endswith('_lora_b'))
  base_graphdef = transformer.abstract(lora.base_config(cfg))[0]
  rows = _rows()
  y_lora = transformer.model_fns(graphdef).forward(params, *rows)
  y_base = transformer.model_fns(base_graphdef).forward(base, *rows)
  np.testing.assert_array_equal(np.asarray(y_lora), np.asarray(y_base))


def test_merged_weights_compute_what_the_adapters_do_forward_and_decode():
  cfg = _config()
  graphdef, params = transformer.create(cfg)
  params = _randomise_b(params)
  base_graphdef = transformer.abstract(lora.base_config(cfg))[0]
  merged = lora.merged(cfg, params)
  fl, fm = transformer.model_fns(graphdef), transformer.model_fns(base_graphdef)
  rows = _rows()
  y_lora, y_merged = fl.forward(params, *rows), fm.forward(merged, *rows)
  assert float(jnp.max(jnp.abs(y_lora - fm.forward(lora.split(params)[1], *rows)))) > 1e-3
  np.testing.assert_allclose(np.asarray(y_lora), np.asarray(y_merged), atol=2e-5)
  # One cached decode step: the fused q/k/v projection carries the adapters too.
  tokens, positions, mask = rows
  outs = []
  for fns, p in ((fl, params), (fm, merged)):
    _, prefix = fns.prefill(p, tokens, positions, mask)
    cache = fns.init_cache(prefix, mask, 1, 2)
    nxt = tokens[:, -1:]
    outs.append(fns.decode(p, nxt, positions[:, -1:] + 1, cache)[0])
  np.testing.assert_allclose(np.asarray(outs[0]), np.asarray(outs[1]), atol=2e-5)


def _loss(fns, params, rows):
  logits = fns.forward(params, *rows)
  return jnp.mean(jax.nn.log_softmax(logits)[..., 3] * jnp.arange(logits.shape[1]))


def test_adapter_gradient_is_the_projection_of_the_full_gradient():
  """For W_eff = W + s A B: dL/dA = s G B^T and dL/dB = s A^T G, with G = dL/dW_eff the
  full-weight model's gradient at W_eff."""
  cfg = _config()
  graphdef, params = transformer.create(cfg)
  params = _randomise_b(params)
  adapters, base = lora.split(params)
  base_graphdef = transformer.abstract(lora.base_config(cfg))[0]
  rows = _rows()
  g_adapters = jax.grad(lambda a: _loss(transformer.model_fns(graphdef), lora.join(base, a),
                                        rows))(adapters)
  g_full = jax.grad(lambda p: _loss(transformer.model_fns(base_graphdef), p, rows))(
      lora.merged(cfg, params))
  s = lora.scale(cfg)
  flat_g = dict(nnx.to_flat_state(g_full))
  flat_a = dict(nnx.to_flat_state(adapters))
  flat_ga = dict(nnx.to_flat_state(g_adapters))
  checked = 0
  for path, a in flat_a.items():
    if not path[-1].endswith('_lora_a'):
      continue
    prefix, target = path[:-1], path[-1][:-len('_lora_a')]
    a_lir = np.asarray(a[...]).reshape(cfg.num_layers, -1, cfg.lora_rank)
    b_lro = np.asarray(flat_a[(*prefix, f'{target}_lora_b')][...]).reshape(
        cfg.num_layers, cfg.lora_rank, -1)
    g_lio = np.asarray(flat_g[(*prefix, f'{target}_kernel')][...]).reshape(
        cfg.num_layers, a_lir.shape[1], -1)
    want_a = s * np.einsum('lio,lro->lir', g_lio, b_lro)
    want_b = s * np.einsum('lir,lio->lro', a_lir, g_lio)
    got_a = np.asarray(flat_ga[path][...]).reshape(want_a.shape)
    got_b = np.asarray(flat_ga[(*prefix, f'{target}_lora_b')][...]).reshape(want_b.shape)
    assert np.abs(want_a).max() > 1e-6
    # Rounding relative to the gradients' scale: elements near 0 carry their neighbours' error.
    assert_f32_close(got_a, want_a, g_lio.shape[-1])
    assert_f32_close(got_b, want_b, g_lio.shape[1])
    checked += 1
  assert checked == len(lora.TARGETS)


def test_bad_targets_are_refused():
  with pytest.raises(ValueError, match='unknown'):
    lora.check(_config(lora_targets=('q', 'qkv')))
  with pytest.raises(ValueError, match='gated'):
    lora.check(transformer.TransformerConfig.gpt2(
        **{**TINY, 'num_kv_heads': 4}, lora_rank=2, lora_targets=('gate',)))
  with pytest.raises(ValueError, match='targets'):
    lora.check(_config(lora_targets=()))

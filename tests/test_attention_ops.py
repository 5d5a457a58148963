"""`attention_ops.attend`: every layout of every implementation against one dense reference written
out here (each query's allowed keys listed explicitly), values and gradients, with GQA, soft-caps
and sliding windows; 'blockwise' against 'xla' directly, in its memory and inside a model; the
implementation checked by name before anything compiles; the remat policies by name."""

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import assert_f32_close
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals

from rloo_jax import config_utils, experiment
from rloo_jax.models import (TransformerConfig, attention_blockwise, attention_cudnn,
                             attention_ops, create, model_fns, transformer)
from rloo_jax.models.config import CHECKPOINT_NAMES

# Float comparisons of two computations: rerun by .ci/run under other CPU flags.
pytestmark = pytest.mark.numerics

B, H, G, D = 2, 2, 2, 4
# (scale, softcap, window): plain, Gemma 2's soft-cap, a window, both.
SPECS = {'plain': (D ** -0.5, 0.0, None), 'softcap': (0.3, 1.5, None),
         'window': (D ** -0.5, 0.0, 3), 'softcap_window': (0.7, 2.0, 2)}


def _rand(rng, *shape):
  return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def _spec(name, layout, implementation='xla'):
  scale, softcap, window = SPECS[name]
  return attention_ops.AttentionSpec(layout, scale, softcap,
                                     None if window is None else jnp.int32(window), implementation)


def _cudnn_on_xla(monkeypatch):
  """'cudnn' here, where no cuDNN runs: its layouts (compaction, tiled prompts, lengths, windows)
  through `jax.nn.dot_product_attention`'s own xla implementation of the same call, in float32.
  cuDNN's own limits (bfloat16, head dims a multiple of 8) are lifted for the tests' float32
  rows; the cuDNN call itself is compiled by tests/test_accelerator_compile.py."""
  real = jax.nn.dot_product_attention
  monkeypatch.setattr(attention_cudnn.jax.nn, 'dot_product_attention',
                      lambda *a, implementation, **kw: real(*a, implementation='xla', **kw))
  monkeypatch.setattr(attention_cudnn, '_DTYPES', attention_cudnn._DTYPES + (jnp.float32,))
  monkeypatch.setattr(attention_cudnn, '_HEAD_DIM_MULTIPLE', 1)


@pytest.fixture(params=[n for n in attention_ops.IMPLEMENTATIONS if n != 'auto'])
def impl(request, monkeypatch):
  """Each kernel ('auto' picks one of them: its own test); 'blockwise' with blocks of 3, so the
  test rows run several blocks and a partial last one; 'cudnn' on xla (`_cudnn_on_xla`)."""
  monkeypatch.setattr(attention_blockwise, 'BLOCK', 3)
  if request.param == 'cudnn':
    _cudnn_on_xla(monkeypatch)
  return request.param


def _refused(impl, name, spec, q, k, v):
  """Whether `impl` refuses these rows, checked: 'cudnn' has no soft-cap."""
  if impl != 'cudnn' or not SPECS[name][1]:
    return False
  with pytest.raises(ValueError, match=r"'cudnn' cannot run soft-capped scores"):
    attention_ops.attend(q, k, v, spec)
  return True


def _dense(q_bshgd, k_bthd, v_bthd, allowed_bst, name):
  """softmax over each query's allowed keys (float32), written without any layout."""
  scale, softcap, _ = SPECS[name]
  s = jnp.einsum('bshgd,bthd->bhgst', q_bshgd, k_bthd) * scale
  if softcap:
    s = softcap * jnp.tanh(s / softcap)
  s = jnp.where(allowed_bst[:, None, None], s, -jnp.inf)
  p = jax.nn.softmax(s, axis=-1)
  p = jnp.where(allowed_bst.any(-1)[:, None, None, :, None], p, 0.0)
  return jnp.einsum('bhgst,bthd->bshgd', p, v_bthd)


def _allowed(q_pos_bs, k_pos_bt, key_ok_bst, name):
  window = SPECS[name][2]
  near = (q_pos_bs[:, :, None] - k_pos_bt[:, None, :]) < (window or 10 ** 6)
  return key_ok_bst & near


def _check(attend_fn, ref_fn, args, valid):
  """Values and gradients of attend_fn against ref_fn on the rows `valid` marks."""
  w = jnp.asarray(np.random.default_rng(9).standard_normal(valid.shape + (H, G, D)), jnp.float32)
  loss = lambda f: lambda *a: jnp.sum(jnp.where(valid[..., None, None, None], f(*a), 0.0) * w)
  # Jitted, as the model runs them: one program each, not hundreds of eager ops.
  got, want = jax.jit(attend_fn)(*args), jax.jit(ref_fn)(*args)
  terms = jax.tree.leaves(args[1])[0].size // B  # a row's keys x head_dim: bounds both sums
  assert_f32_close(np.asarray(got)[valid], np.asarray(want)[valid], terms)
  grads_got = jax.jit(jax.grad(loss(attend_fn), argnums=(0, 1, 2)))(*args)
  grads_want = jax.jit(jax.grad(loss(ref_fn), argnums=(0, 1, 2)))(*args)
  for a, b in zip(jax.tree.leaves(grads_got), jax.tree.leaves(grads_want)):
    assert_f32_close(a, b, terms)


@pytest.mark.parametrize('name', SPECS)
def test_causal_rows_with_padding_anywhere(name, impl):
  rng = np.random.default_rng(0)
  s = 7
  mask_bs = jnp.asarray([[0, 1, 1, 1, 1, 1, 1], [1, 1, 0, 1, 1, 0, 1]], bool)
  positions_bs = jnp.maximum(jnp.cumsum(mask_bs, axis=1) - 1, 0)
  spec = _spec(name, attention_ops.Causal(mask_bs, positions_bs), impl)
  allowed = _allowed(positions_bs, positions_bs,
                     jnp.tril(jnp.ones((s, s), bool))[None] & mask_bs[:, None, :], name)
  args = (_rand(rng, B, s, H, G, D), _rand(rng, B, s, H, D), _rand(rng, B, s, H, D))
  if _refused(impl, name, spec, *args):
    return
  _check(lambda q, k, v: attention_ops.attend(q, k, v, spec),
         lambda q, k, v: _dense(q, k, v, allowed, name), args, np.asarray(mask_bs))


@pytest.mark.parametrize('name', SPECS)
def test_prompt_group_equals_each_completion_on_its_tiled_prompt(name, impl):
  """Row P + i*M + j (token i of completion j) attends as it would in the row [prompt |
  completion j]; the prompt's rows as in the prompt alone."""
  rng = np.random.default_rng(1)
  p, m, t = 4, 3, 3
  prompt_mask_bp = jnp.asarray([[0, 1, 1, 1], [1, 1, 1, 1]], bool)  # left-padded
  mask_bmt = jnp.asarray(rng.random((B, m, t)) > 0.2).at[:, :, 0].set(True)
  if impl == 'cudnn' and SPECS[name][2]:
    # Its window counts distance in compacted rows: exact where a completion's valid tokens are
    # a prefix (tokens up to the stop, as rollouts give them), which positions then count.
    mask_bmt = jnp.cumprod(mask_bmt, axis=-1).astype(bool)
  prompt_pos_bp = jnp.maximum(jnp.cumsum(prompt_mask_bp, axis=1) - 1, 0)
  comp_pos_bmt = jnp.broadcast_to(prompt_pos_bp[:, -1:, None] + 1 + jnp.arange(t), (B, m, t))
  positions_bs = jnp.concatenate(
      [prompt_pos_bp, comp_pos_bmt.transpose(0, 2, 1).reshape(B, t * m)], axis=1)
  spec = _spec(name, attention_ops.PromptGroup(prompt_mask_bp, mask_bmt, positions_bs), impl)
  # The tiled rows: [prompt | completion j] for every (b, j), gathered from the grouped rows.
  cols_mt = p + jnp.arange(t)[None] * m + jnp.arange(m)[:, None]
  index_ms = jnp.concatenate([jnp.broadcast_to(jnp.arange(p), (m, p)), cols_mt], axis=1)
  tile = lambda x: x[:, index_ms]  # [B, M, P + T, ...]
  key_ok = jnp.concatenate([jnp.broadcast_to(prompt_mask_bp[:, None], (B, m, p)), mask_bmt], -1)
  s = p + t
  flat = lambda x: x.reshape(B * m, *x.shape[2:])
  pos = flat(tile(positions_bs))
  allowed = _allowed(pos, pos, jnp.tril(jnp.ones((s, s), bool))[None] & flat(key_ok)[:, None],
                     name)

  def ref(q, k, v):
    out = _dense(flat(tile(q)), flat(tile(k)), flat(tile(v)), allowed, name).reshape(
        B, m, s, H, G, D)
    # Back to the grouped rows: the prompt from stream 0, completion tokens where they sit.
    grouped = jnp.zeros_like(q).at[:, :p].set(out[:, 0, :p])
    return grouped.at[:, cols_mt].set(out[:, :, p:])

  valid = np.concatenate([np.asarray(prompt_mask_bp),
                          np.asarray(mask_bmt).transpose(0, 2, 1).reshape(B, t * m)], axis=1)
  rows = p + t * m
  args = (_rand(rng, B, rows, H, G, D), _rand(rng, B, rows, H, D), _rand(rng, B, rows, H, D))
  if _refused(impl, name, spec, *args):
    return
  _check(lambda q, k, v: attention_ops.attend(q, k, v, spec), ref, args, valid)


@pytest.mark.parametrize('name', SPECS)
@pytest.mark.parametrize('k', [1, 3])
def test_shared_prefix_decode_equals_each_stream_on_its_own_keys(name, k, impl):
  """K = 1 is the unshared cache (prompts tiled); K = 3 streams read one prefix per row."""
  rng = np.random.default_rng(2)
  p, t, index = 5, 4, 2
  prefix_mask_bp = jnp.asarray([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]], bool)
  prefix_pos_bp = jnp.maximum(jnp.cumsum(prefix_mask_bp, axis=1) - 1, 0)
  positions_bk = jnp.broadcast_to(prefix_pos_bp[:, -1:] + 1 + index, (B, k))
  spec = _spec(name, attention_ops.SharedPrefixDecode(prefix_mask_bp, jnp.int32(index),
                                                      positions_bk, prefix_pos_bp), impl)
  slot_pos_bkt = positions_bk[..., None] - index + jnp.arange(t)
  key_pos = jnp.concatenate([jnp.broadcast_to(prefix_pos_bp[:, None], (B, k, p)), slot_pos_bkt],
                            -1).reshape(B * k, p + t)
  key_ok = jnp.concatenate([jnp.broadcast_to(prefix_mask_bp[:, None], (B, k, p)),
                            jnp.broadcast_to(jnp.arange(t) <= index, (B, k, t))], -1)
  allowed = _allowed(positions_bk.reshape(B * k, 1), key_pos, key_ok.reshape(B * k, 1, p + t),
                     name)

  def ref(q, keys, values):
    (pk_bhdp, k_bkhdt), (pv_bhpd, v_bkhtd) = keys, values
    kk = jnp.concatenate([jnp.broadcast_to(pk_bhdp[:, None], (B, k, H, D, p)), k_bkhdt], -1)
    vv = jnp.concatenate([jnp.broadcast_to(pv_bhpd[:, None], (B, k, H, p, D)), v_bkhtd], -2)
    out = _dense(q.reshape(B * k, 1, H, G, D), kk.reshape(B * k, H, D, p + t).transpose(0, 3, 1, 2),
                 vv.reshape(B * k, H, p + t, D).transpose(0, 2, 1, 3), allowed, name)
    return out.reshape(B, k, H, G, D)

  args = (_rand(rng, B, k, H, G, D), (_rand(rng, B, H, D, p), _rand(rng, B, k, H, D, t)),
          (_rand(rng, B, H, p, D), _rand(rng, B, k, H, t, D)))
  _check(lambda q, kk, vv: attention_ops.attend(q, kk, vv, spec), ref, args,
         np.ones((B, k), bool))


def test_an_unknown_implementation_is_refused_before_any_compile():
  with pytest.raises(ValueError, match=r"^unknown config\.model\.attention 'flash'; choose one "
                                       r"of \('xla', 'blockwise', 'splash', 'cudnn', 'auto'\)$"):
    TransformerConfig.llama(attention='flash')
  c = config_utils.base_config()
  c.model.attention = 'flash'
  with pytest.raises(ValueError, match=r"unknown config\.model\.attention 'flash'"):
    experiment.validate_config(c)


def test_splash_and_cudnn_are_refused_off_their_platform_and_on_packed_rows_naming_the_fix():
  with pytest.raises(ValueError, match=r"config\.model\.attention='splash' is TPU's Pallas "
                                       r"kernel .*; on gpu use 'auto' or 'blockwise'$"):
    attention_ops.check_platform('splash', 'gpu')
  with pytest.raises(ValueError, match=r"'splash' has no packed-row form .* with "
                                       r"config\.train\.microbatch_tokens use 'auto'"):
    attention_ops.check_platform('splash', 'tpu', packed=True)
  with pytest.raises(ValueError, match=r"'cudnn' is cuDNN's flash attention, on GPUs; on tpu "
                                       r"use 'auto' or 'blockwise'$"):
    attention_ops.check_platform('cudnn', 'tpu')
  with pytest.raises(ValueError, match=r"'cudnn' has no packed-row form"):
    attention_ops.check_platform('cudnn', 'gpu', packed=True)
  attention_ops.check_platform('splash', 'tpu')
  attention_ops.check_platform('cudnn', 'gpu')
  attention_ops.check_platform('blockwise', 'gpu', packed=True)
  # 'auto' runs the platform's kernel from the flash length, except on packed rows.
  n = attention_ops.AUTO_BLOCKWISE_MIN_TOKENS
  assert [attention_ops.resolve('auto', n, 'tpu'), attention_ops.resolve('auto', n, 'tpu', True),
          attention_ops.resolve('auto', n, 'gpu'), attention_ops.resolve('auto', n, 'gpu', True),
          attention_ops.resolve('auto', n, 'cpu'), attention_ops.resolve('auto', n - 1, 'tpu')] \
      == ['splash', 'blockwise', 'cudnn', 'blockwise', 'blockwise', 'xla']


def test_bad_remat_names_are_refused_naming_the_key():
  with pytest.raises(ValueError, match=r"config\.model\.remat_names: unknown \['qkv'\]; choose "):
    TransformerConfig.llama(remat='names', remat_names=('qkv',))
  with pytest.raises(ValueError, match=r"remat_names lists, and it is empty"):
    TransformerConfig.llama(remat='names')
  with pytest.raises(ValueError, match=r"remat_names is read only with remat='names'"):
    TransformerConfig.llama(remat='full', remat_names=('query',))
  c = config_utils.base_config()
  c.model.update(remat='names', remat_names='query,mlp_outt')
  with pytest.raises(ValueError, match=r"unknown \['mlp_outt'\]"):
    experiment.validate_config(c)


def _tiny(**kw):
  return TransformerConfig.llama(vocab_size=48, hidden_size=16, num_layers=2, num_heads=4,
                                 num_kv_heads=2, head_dim=4, intermediate_size=32, max_seq_len=16,
                                 **kw)


def _named_residuals(config, capsys):
  """The checkpoint names a layer body saves for its backward under config's remat policy."""
  graphdef, params = create(config)
  model = nnx.merge(graphdef, params)
  block_def, stacked = nnx.split(model.layers)
  weights = jax.tree.map(lambda x: x[0], stacked)
  x = jnp.ones((1, 5, 16))
  positions = jnp.arange(5)[None]
  # pylint: disable=protected-access
  rotary = model._rotary(positions)[0]
  spec = model._spec(attention_ops.Causal(jnp.ones((1, 5), bool), positions), None)
  body = lambda w, x: nnx.merge(block_def, w)(x, rotary, spec)[0].sum()
  print_saved_residuals(jax.checkpoint(body, policy=transformer.remat_policy(config)), weights, x)
  return set(re.findall(r"named '(\w+)'", capsys.readouterr().out))


def test_remat_names_saves_what_it_names_and_every_policy_gives_the_same_gradients(capsys):
  assert _named_residuals(_tiny(remat='full'), capsys) == set()
  assert _named_residuals(_tiny(remat='names', remat_names=('query',)), capsys) == {'query'}
  # Every name but mlp_out, which no derivative reads (it only joins the residual sum).
  assert (_named_residuals(_tiny(remat='names', remat_names=CHECKPOINT_NAMES), capsys)
          == set(CHECKPOINT_NAMES) - {'mlp_out'})
  tokens = jnp.asarray([[3, 5, 7, 9, 11], [2, 4, 6, 8, 10]])
  positions = jnp.broadcast_to(jnp.arange(5), (2, 5))
  mask = jnp.ones((2, 5), bool)
  _, params = create(_tiny())
  grads = {}
  for remat, names in (('none', ()), ('full', ()), ('dots', ()), ('names', ('attention', 'key'))):
    fns = model_fns(create(_tiny(remat=remat, remat_names=names))[0])
    loss = lambda p: jnp.sum(jax.nn.log_softmax(fns.forward(p, tokens, positions, mask))[..., 1])
    grads[remat] = jax.jit(jax.grad(loss))(params)
  for remat in ('full', 'dots', 'names'):
    for a, b in zip(jax.tree.leaves(grads[remat]), jax.tree.leaves(grads['none'])):
      np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize('k', [1, 3])
def test_bfloat16_shared_prefix_decode_runs_and_rounds_like_float32(k):
  """bf16 q/k/v (a bf16 rollout) through every product of the decode, on any device: the
  scores in float32, the output within bf16 rounding of the float32 one."""
  rng = np.random.default_rng(4)
  p, t, index = 5, 4, 2
  prefix_mask_bp = jnp.asarray([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]], bool)
  prefix_pos_bp = jnp.maximum(jnp.cumsum(prefix_mask_bp, axis=1) - 1, 0)
  positions_bk = jnp.broadcast_to(prefix_pos_bp[:, -1:] + 1 + index, (B, k))
  spec = _spec('plain', attention_ops.SharedPrefixDecode(prefix_mask_bp, jnp.int32(index),
                                                         positions_bk, prefix_pos_bp))
  d = 8  # XLA:CPU runs these products through its dot kernel from about this size
  q, kk, vv = (_rand(rng, B, k, H, G, d), (_rand(rng, B, H, d, p), _rand(rng, B, k, H, d, t)),
               (_rand(rng, B, H, p, d), _rand(rng, B, k, H, t, d)))
  bf16 = lambda x: jax.tree.map(lambda a: a.astype(jnp.bfloat16), x)  # noqa: E731
  attend = jax.jit(lambda q, kk, vv: attention_ops.attend(q, kk, vv, spec))
  rounded = bf16((q, kk, vv))
  want = attend(*jax.tree.map(lambda a: a.astype(jnp.float32), rounded))
  got = attend(*rounded)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             atol=2 ** -7 * float(jnp.abs(want).max()))


@pytest.mark.parametrize('name', SPECS)
def test_blockwise_equals_xla_on_long_padded_rows(name, monkeypatch):
  """Blocks of 8 over 37 causal rows (padding in front and in the middle, the last block partial)
  and over a group of 3 completions of 12 tokens after a 7-token prompt, some of each masked (blocks
  mixing the prompt and completions, and query blocks that skip other completions' blocks)."""
  monkeypatch.setattr(attention_blockwise, 'BLOCK', 8)
  rng = np.random.default_rng(5)
  s = 37
  mask_bs = jnp.asarray(rng.random((B, s)) > 0.25).at[:, :2].set([False, True])
  positions_bs = jnp.maximum(jnp.cumsum(mask_bs, axis=1) - 1, 0)
  p, m, t = 7, 3, 12
  prompt_mask_bp = jnp.ones((B, p), bool).at[0, :2].set(False).at[1, 4].set(False)
  mask_bmt = jnp.asarray(rng.random((B, m, t)) > 0.3).at[:, :, 0].set(True)
  comp_pos_btm = jnp.broadcast_to((p + jnp.arange(t))[:, None], (B, t, m)).reshape(B, t * m)
  group_pos_bs = jnp.concatenate([jnp.broadcast_to(jnp.arange(p), (B, p)), comp_pos_btm], 1)
  group_ok_bs = jnp.concatenate([prompt_mask_bp, mask_bmt.transpose(0, 2, 1).reshape(B, t * m)],
                                axis=1)
  for layout, valid in ((attention_ops.Causal(mask_bs, positions_bs), mask_bs),
                        (attention_ops.PromptGroup(prompt_mask_bp, mask_bmt, group_pos_bs),
                         group_ok_bs)):
    rows = valid.shape[1]
    spec, blockwise = _spec(name, layout), _spec(name, layout, 'blockwise')
    _check(lambda q, k, v: attention_ops.attend(q, k, v, blockwise),
           lambda q, k, v: attention_ops.attend(q, k, v, spec),
           (_rand(rng, B, rows, H, G, D), _rand(rng, B, rows, H, D), _rand(rng, B, rows, H, D)),
           np.asarray(valid))


def _packed_row(groups, length):
  """A packed row (`rloo_jax.packing`'s layout) of groups given as (prompt, [completion lengths]):
  (segment, shared, key_ok, positions, group, part), each [length]; the tail is padding."""
  segment, shared, group, part, positions = [], [], [], [], []
  for g, (p, lengths) in enumerate(groups):
    base = g * 10
    segment += [base] * p
    shared += [base] * p
    part += [0] * p
    positions += list(range(p))
    for j, n in enumerate(lengths):
      segment += [base + 1 + j] * n
      shared += [base] * n
      part += [1 + j] * n
      positions += list(range(p, p + n))
    group += [g] * (p + sum(lengths))
  pad = length - len(segment)
  big = 2 ** 30
  as_i32 = lambda x, fill: np.asarray(x + [fill] * pad, np.int32)  # noqa: E731
  return (as_i32(segment, big), as_i32(shared, big),
          np.asarray([True] * len(group) + [False] * pad), as_i32(positions, 0),
          as_i32(group, -1), as_i32(part, -1))


@pytest.mark.parametrize('name', SPECS)
def test_packed_rows_read_their_own_completion_and_their_groups_prompt(name, impl):
  """Causal rows with segments: several groups (a prompt, then its completions) in one row; each
  token reads its own completion's earlier tokens and its group's prompt, nothing of another
  group or completion, against the dense reference."""
  rng = np.random.default_rng(11)
  rows = [_packed_row([(3, [2, 4]), (2, [3, 1, 2]), (4, [])], 23),
          _packed_row([(1, [5, 2]), (5, [3, 3])], 23)]
  seg, shared, ok, pos, group, part = (jnp.asarray(np.stack(x)) for x in zip(*rows))
  idx = jnp.arange(23)
  key_ok = (ok[:, None, :] & (idx[:, None] >= idx[None, :])[None]
            & (group[:, :, None] == group[:, None, :])
            & ((part[:, None, :] == 0) | (part[:, None, :] == part[:, :, None])))
  allowed = _allowed(pos, pos, key_ok, name)
  spec = _spec(name, attention_ops.Causal(ok, pos, seg, shared), impl)
  if impl in ('splash', 'cudnn'):  # neither mask holds a segment and its shared prompt's
    with pytest.raises(ValueError, match=r"'splash' has no packed-row form|'cudnn' cannot run "
                                         r"packed rows"):
      attention_ops.attend(*(jnp.zeros(x) for x in ((B, 23, H, G, D), (B, 23, H, D),
                                                    (B, 23, H, D))), spec)
    return
  _check(lambda q, k, v: attention_ops.attend(q, k, v, spec),
         lambda q, k, v: _dense(q, k, v, allowed, name),
         (_rand(rng, B, 23, H, G, D), _rand(rng, B, 23, H, D), _rand(rng, B, 23, H, D)),
         np.asarray(ok))


def test_blockwise_packed_rows_never_read_another_groups_blocks(monkeypatch):
  """Two groups in one row, each in blocks of its own (blocks of 8): NaN values in the first
  leave the second's output as with finite ones, so its blocks were never read."""
  monkeypatch.setattr(attention_blockwise, 'BLOCK', 8)
  rng = np.random.default_rng(8)
  seg, shared, ok, pos, group, _ = (jnp.asarray(np.stack([x, x])) for x in
                                    _packed_row([(4, [6, 6]), (8, [4, 4, 8])], 40))
  spec = _spec('plain', attention_ops.Causal(ok, pos, seg, shared), 'blockwise')
  q, k, v = _rand(rng, B, 40, H, G, D), _rand(rng, B, 40, H, D), _rand(rng, B, 40, H, D)
  first = np.asarray(group[0] == 0)
  v_nan = jnp.where(jnp.asarray(first)[None, :, None, None], jnp.nan, v)
  want, got = attention_ops.attend(q, k, v, spec), attention_ops.attend(q, k, v_nan, spec)
  assert np.all(np.isnan(np.asarray(got)[:, first]))
  np.testing.assert_array_equal(np.asarray(got)[:, ~first], np.asarray(want)[:, ~first])


def test_blockwise_prompt_group_never_reads_another_completions_blocks(monkeypatch):
  """Completion 1 in blocks of its own (prompt 8, completions 16, blocks 8) with NaN values: the
  prompt and completions 0 and 2 come out as with finite ones, so its blocks were never read
  (masked, they would still have multiplied 0 by NaN)."""
  monkeypatch.setattr(attention_blockwise, 'BLOCK', 8)
  rng = np.random.default_rng(7)
  p, m, t = 8, 3, 16
  layout = attention_ops.PromptGroup(jnp.ones((B, p), bool), jnp.ones((B, m, t), bool))
  spec = _spec('plain', layout, 'blockwise')
  q, k, v = _rand(rng, B, p + t * m, H, G, D), _rand(rng, B, p + t * m, H, D), _rand(
      rng, B, p + t * m, H, D)
  of_completion_1 = (jnp.arange(p + t * m) >= p) & ((jnp.arange(p + t * m) - p) % m == 1)
  v_nan = jnp.where(of_completion_1[None, :, None, None], jnp.nan, v)
  want, got = attention_ops.attend(q, k, v, spec), attention_ops.attend(q, k, v_nan, spec)
  assert np.all(np.isnan(np.asarray(got)[:, of_completion_1]))
  np.testing.assert_array_equal(np.asarray(got)[:, ~of_completion_1],
                                np.asarray(want)[:, ~of_completion_1])


def test_blockwise_memory_grows_linearly_in_the_sequence():
  """The compiled forward + backward's temporaries: 'xla' quadruples with each doubling of S,
  'blockwise' adds the same O(S) step each time above its per-block scores."""
  h, g, d = 1, 2, 16

  def temp_mib(impl, s):
    def loss(q, k, v, mask):
      spec = attention_ops.AttentionSpec(attention_ops.Causal(mask), d ** -0.5, 0.0, None, impl)
      return jnp.sum(attention_ops.attend(q, k, v, spec))
    sd = jax.ShapeDtypeStruct
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(
        sd((1, s, h, g, d), jnp.float32), sd((1, s, h, d), jnp.float32),
        sd((1, s, h, d), jnp.float32), sd((1, s), bool)).compile()
    return compiled.memory_analysis().temp_size_in_bytes / 2 ** 20

  xla = {s: temp_mib('xla', s) for s in (2048, 4096)}
  blockwise = {s: temp_mib('blockwise', s) for s in (2048, 4096, 8192)}
  assert xla[4096] > 3.5 * xla[2048]
  assert xla[4096] > 20 * blockwise[4096], (xla, blockwise)
  # Linear: the second doubling adds twice the first's step (quadratic: four times).
  step_small, step_large = blockwise[4096] - blockwise[2048], blockwise[8192] - blockwise[4096]
  assert 0 < step_large < 2.5 * step_small, blockwise


@pytest.mark.parametrize('family,kernel', [
    ('llama', 'blockwise'), ('gemma2', 'blockwise'), ('llama', 'splash'), ('gemma2', 'splash'),
    ('llama', 'cudnn'), ('gemma3', 'cudnn')])
def test_flash_model_equals_xla_log_probs_and_gradients(family, kernel, monkeypatch):
  """A tiny model with config.model.attention='blockwise', 'splash' or 'cudnn' (on xla,
  `_cudnn_on_xla`; remat'd around it) against 'xla': the same log-probs of the full forward
  (Causal) and the grouped one (PromptGroup), same gradients. Gemma's scanned layers alternate a
  traced window, which splash and cudnn run as two kernels under a cond."""
  monkeypatch.setattr(attention_blockwise, 'BLOCK', 4)
  if kernel == 'cudnn':
    _cudnn_on_xla(monkeypatch)
  tiny = dict(vocab_size=61, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
              head_dim=8, intermediate_size=48, max_seq_len=64)
  if family == 'llama':
    config = TransformerConfig.llama(**tiny)
    blockwise = config.replace(attention=kernel, remat='names', remat_names=('attention',))
  elif family == 'gemma3':  # windows of 3 on two layers of three, no soft-cap
    config = TransformerConfig.gemma3(sliding_window=3, query_pre_attn_scalar=12.0,
                                      layer_types=('sliding_attention', 'sliding_attention',
                                                   'full_attention'), **{**tiny, 'num_layers': 3})
    blockwise = config.replace(attention=kernel, remat='full')
  else:  # windows of 3 on alternate layers, soft-capped scores
    config = TransformerConfig.gemma2(sliding_window=3, attn_softcap=1.5, final_softcap=2.0,
                                      query_pre_attn_scalar=12.0, **{**tiny, 'num_layers': 3})
    blockwise = config.replace(attention=kernel, remat='full')
  rng = np.random.default_rng(6)
  _, params = create(config)
  b, p, k, t, s = 2, 6, 3, 5, 11
  tokens_bs = jnp.asarray(rng.integers(3, 61, (b, s)))
  mask_bs = jnp.ones((b, s), bool).at[0, 3].set(False).at[1, :2].set(False)
  positions_bs = jnp.maximum(jnp.cumsum(mask_bs, axis=1) - 1, 0)
  prompt_mask_bp = jnp.ones((b, p), bool).at[1, :2].set(False)
  prompt_pos_bp = jnp.maximum(jnp.cumsum(prompt_mask_bp, axis=1) - 1, 0)
  ctok_nt = jnp.asarray(rng.integers(3, 61, (b * k, t)))
  cpos_nt = jnp.repeat(prompt_pos_bp[:, -1:] + 1, k, axis=0) + jnp.arange(t)
  cmask_nt = jnp.ones((b * k, t), bool).at[1, 3:].set(False)

  def log_probs(cfg):
    fns = model_fns(create(cfg)[0])
    def loss(prm):
      full = jax.nn.log_softmax(fns.forward(prm, tokens_bs, positions_bs, mask_bs))[..., 1]
      grouped = jax.nn.log_softmax(fns.grouped(prm, tokens_bs[:, :p], prompt_pos_bp,
                                               prompt_mask_bp, ctok_nt, cpos_nt, cmask_nt))[..., 1]
      full, grouped = jnp.where(mask_bs, full, 0.0), jnp.where(cmask_nt, grouped, 0.0)
      return jnp.sum(full) + jnp.sum(grouped), (full, grouped)
    return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

  (_, want), grads_want = log_probs(config)
  (_, got), grads_got = log_probs(blockwise)
  for a, b_ in zip(got, want):
    np.testing.assert_allclose(a, b_, rtol=1e-5, atol=1e-5)
  for a, b_ in zip(jax.tree.leaves(grads_got), jax.tree.leaves(grads_want)):
    np.testing.assert_allclose(a, b_, rtol=1e-5, atol=1e-5 * float(jnp.abs(b_).max()))


def test_remat_names_saves_the_blockwise_attention_output(capsys):
  assert _named_residuals(_tiny(attention='blockwise', remat='names', remat_names=('attention',)),
                          capsys) == {'attention'}


def test_auto_runs_blockwise_from_the_keys_a_query_reads_and_the_decode_on_xla(monkeypatch):
  rng, calls = np.random.default_rng(0), []
  for name in ('_xla', '_blockwise', '_shared_prefix_decode'):
    kernel = getattr(attention_ops, name)
    monkeypatch.setattr(attention_ops, name, lambda *a, _k=kernel, _n=name, **kw: (
        calls.append(_n) or _k(*a, **kw)))
  monkeypatch.setattr(attention_ops, 'AUTO_BLOCKWISE_MIN_TOKENS', 12)
  for s in (11, 12):
    q, k = _rand(rng, 1, s, H, G, D), _rand(rng, 1, s, H, D)
    spec = attention_ops.AttentionSpec(attention_ops.Causal(np.ones((1, s), bool)), D ** -0.5,
                                       implementation='auto')
    attention_ops.attend(q, k, k, spec)
  # A group of 4 + 3 x 5 = 19 rows: a completion token reads at most 4 + 5 keys, under the 12.
  group = attention_ops.AttentionSpec(attention_ops.PromptGroup(
      np.ones((1, 4), bool), np.ones((1, 3, 5), bool)), D ** -0.5, implementation='auto')
  q, k = _rand(rng, 1, 19, H, G, D), _rand(rng, 1, 19, H, D)
  attention_ops.attend(q, k, k, group)
  p, t = 20, 4
  decode = attention_ops.AttentionSpec(attention_ops.SharedPrefixDecode(
      np.ones((1, p), bool), jnp.int32(2)), D ** -0.5, implementation='auto')
  attention_ops.attend(_rand(rng, 1, 2, H, G, D),
                       (_rand(rng, 1, H, D, p), _rand(rng, 1, 2, H, D, t)),
                       (_rand(rng, 1, H, p, D), _rand(rng, 1, 2, H, t, D)), decode)
  # The decode's xla form (its paged streams' pages through the Pallas kernel on one TPU chip).
  assert calls == ['_xla', '_blockwise', '_xla', '_shared_prefix_decode']


_MESH_SCRIPT = '''
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from rloo_jax.models import attention_ops, traced_mesh
mesh = Mesh(np.asarray(jax.devices()).reshape(2, 1, 2), ('data', 'fsdp', 'tensor'))
rng = np.random.default_rng(3)
b, p, m, t, h, g, d = 2, 5, 3, 4, 2, 2, 8
rows = p + m * t
prompt_mask = jnp.ones((b, p), bool).at[0, :2].set(False)
mask_bmt = jnp.ones((b, m, t), bool).at[1, 2, 3:].set(False)
pos_p = jnp.maximum(jnp.cumsum(prompt_mask, axis=1) - 1, 0)
pos_c = jnp.broadcast_to(pos_p[:, -1:, None] + 1 + jnp.arange(t), (b, m, t))
positions = jnp.concatenate([pos_p, pos_c.transpose(0, 2, 1).reshape(b, t * m)], 1)
put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
q = put(rng.standard_normal((b, rows, h, g, d)).astype(np.float32), P('data', None, 'tensor'))
k, v = (put(rng.standard_normal((b, rows, h, d)).astype(np.float32), P('data', None, 'tensor'))
        for _ in range(2))
def loss(impl):
  def f(q, k, v, window):
    spec = attention_ops.AttentionSpec(attention_ops.PromptGroup(prompt_mask, mask_bmt, positions),
                                       d ** -0.5, 2.0, window, impl, 3)
    valid = jnp.concatenate([prompt_mask, mask_bmt.transpose(0, 2, 1).reshape(b, t * m)], 1)
    o = attention_ops.attend(q, k, v, spec)  # pad queries read no key: any finite output
    return jnp.sum(jnp.where(valid[..., None, None, None], o, 0.0) ** 2)
  return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))
def check(loss, *args):
  want = loss('xla')(*args)
  for impl in impls:
    with traced_mesh.on_mesh(mesh):
      f = loss(impl)
      text = f.lower(*args).as_text()
      got = f(*args)
    err = max(float(jnp.max(jnp.abs(a - b_)))
              for a, b_ in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    print('ERR', err, 'MANUAL', 'manual_computation' in text, flush=True)
impls = ('splash', 'blockwise')
for window in (3, np.iinfo(np.int32).max):
  check(loss, q, k, v, jnp.int32(window))
# Packed rows, each row's groups its own: blockwise's blocks to visit are each device's.
seg = np.asarray([[0] * 3 + [1] * 4 + [2] * 4 + [3] * 2 + [4] * 4, [0] * 6 + [1] * 11])
shared = np.asarray([[0] * 11 + [3] * 6, [0] * 17])
ok = np.ones((b, rows), bool)
pos = np.tile(np.arange(rows), (b, 1))
def packed(impl):
  def f(q, k, v, window):
    spec = attention_ops.AttentionSpec(attention_ops.Causal(ok, pos, seg, shared), d ** -0.5,
                                       0.0, window, impl, 3)
    return jnp.sum(attention_ops.attend(q, k, v, spec) ** 2)
  return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))
impls = ('blockwise',)
check(packed, q, k, v, jnp.int32(3))
'''


def test_splash_and_blockwise_run_per_shard_over_the_mesh_and_equal_xla():
  """On 4 devices (rows over 'data', kv heads over 'tensor'), splash and blockwise traced for
  the mesh (`traced_mesh.on_mesh`) run under shard_map (the manual-sharding ops in their
  programs) and equal 'xla', values and gradients: grouped rows with a windowed layer and a
  global one (splash's two kernels under the traced window), and blockwise on packed rows."""
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu',
         'XLA_FLAGS': (os.environ.get('XLA_FLAGS', '')
                       + ' --xla_force_host_platform_device_count=4').strip()}
  out = subprocess.run([sys.executable, '-c', _MESH_SCRIPT], env=env, capture_output=True,
                       text=True, timeout=600, check=True).stdout
  lines = [l.split() for l in out.splitlines() if l.startswith('ERR')]
  assert len(lines) == 5, out
  for _, err, _, manual in lines:
    assert float(err) < 1e-4 and manual == 'True', out


@pytest.mark.skipif(jax.default_backend() != 'gpu', reason="cuDNN's attention runs on a GPU only "
                    "(here its layouts run on xla: `_cudnn_on_xla`)")
@pytest.mark.parametrize('layout', ['causal', 'group'])
def test_cudnn_equals_xla_on_a_gpu(layout):
  """cuDNN itself, bfloat16, against 'xla' on the same bfloat16 inputs computed in float32:
  values and gradients within bfloat16's rounding, windowed or not."""
  rng = np.random.default_rng(12)
  b, p, m, t, h, g, d = 2, 40, 3, 50, 2, 2, 64
  if layout == 'causal':
    s = p + t
    mask = jnp.ones((b, s), bool).at[0, :7].set(False).at[1, s - 9:].set(False)
    lay, valid = attention_ops.Causal(mask, jnp.maximum(jnp.cumsum(mask, 1) - 1, 0)), mask
  else:
    s = p + m * t
    prompt_mask = jnp.ones((b, p), bool).at[0, :5].set(False)
    mask_bmt = jnp.arange(t)[None, None] < jnp.asarray([[50, 31, 12], [7, 50, 44]])[..., None]
    pos_p = jnp.maximum(jnp.cumsum(prompt_mask, axis=1) - 1, 0)
    pos_c = jnp.broadcast_to(pos_p[:, -1:, None] + 1 + jnp.arange(t), (b, m, t))
    lay = attention_ops.PromptGroup(prompt_mask, mask_bmt, jnp.concatenate(
        [pos_p, pos_c.transpose(0, 2, 1).reshape(b, t * m)], 1))
    valid = jnp.concatenate([prompt_mask, mask_bmt.transpose(0, 2, 1).reshape(b, t * m)], 1)
  q, k, v = (jnp.asarray(rng.standard_normal(x), jnp.bfloat16)
             for x in ((b, s, h, g, d), (b, s, h, d), (b, s, h, d)))
  for window in (None, 16):
    def loss(impl, dtype):
      spec = attention_ops.AttentionSpec(lay, d ** -0.5, 0.0, window and jnp.int32(window), impl,
                                         window or 0)
      def f(q, k, v):
        o = attention_ops.attend(q.astype(dtype), k.astype(dtype), v.astype(dtype), spec)
        return jnp.sum(jnp.where(valid[..., None, None, None], o.astype(jnp.float32), 0.0) ** 2)
      return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(q, k, v)
    got, want = loss('cudnn', jnp.bfloat16), loss('xla', jnp.float32)
    for a, b_ in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      scale = float(jnp.max(jnp.abs(b_)))
      np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b_), atol=0.03 * scale)

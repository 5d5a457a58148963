"""Packed updates (`rloo_jax.packing`, config.train.microbatch_tokens): the plan, the packed
layout, and the loss and gradient of a packed minibatch against the unpacked one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rloo_jax import experiment, models, packing, update
from rloo_jax.algorithms.rloo import RLOO
from test_head_loss import _rows
from test_trim import tiny_config


def test_the_plan_fills_rows_first_fit_decreasing_and_refuses_a_group_too_big():
  # Groups of 3 + 7, 3 + 3, 3 + 5, 3 + 2 tokens (prompt 4 minus 1, k=2 completions).
  p = np.array([4, 4, 4, 4])
  lengths = np.array([3, 4, 1, 2, 2, 3, 1, 1])
  sizes = packing.group_tokens(p, lengths, 2)
  np.testing.assert_array_equal(sizes, [10, 6, 8, 5])
  pl = packing.plan(p, lengths, k=2, budget=16, rows=1)
  # Decreasing: 10 -> bin 0, 8 -> bin 1, 6 -> bin 0 (10 + 6 = 16), 5 -> bin 1.
  np.testing.assert_array_equal(pl.microbatch_b, [0, 0, 1, 1])
  np.testing.assert_array_equal(pl.offset_b, [0, 10, 0, 8])
  np.testing.assert_array_equal(pl.slot_b, [0, 1, 0, 1])
  assert pl.count == 2
  two = packing.plan(p, lengths, k=2, budget=16, rows=2)
  np.testing.assert_array_equal(two.shard_b, [0, 0, 1, 1])
  assert two.count == 1
  assert packing.padding_fraction(p, lengths, k=2, budget=16, rows=1) == pytest.approx(
      1 - 29 / 32)
  with pytest.raises(ValueError, match=r"group of 10 tokens does not fit "
                                       r"config.train.microbatch_tokens=9; set it to at least"):
    packing.plan(p, lengths, k=2, budget=9, rows=1)


def _packer(algo, rows, budget):
  b = rows.prompt_tokens_bp.shape[0]
  return packing.Packer(k=algo.k, budget=budget, rows_per_microbatch=1, max_microbatches=b)


def test_packed_rows_hold_each_group_once_with_its_segments(tmp_path):
  config = tiny_config()
  algo = RLOO(experiment.build(config, str(tmp_path)))
  state = algo.init_state(models.create(algo.exp.model_config)[1])
  rows = _rows(algo, state)
  k = algo.k
  p_b = np.asarray(rows.prompt_mask_bp.sum(1))
  len_n = np.asarray(rows.cmask_nt.sum(1))
  budget = int(packing.group_tokens(p_b, len_n, k).max()) + 3
  packer = _packer(algo, rows, budget)
  pl = packer.plan(rows)
  packed = packer(rows, pl)
  tokens = np.asarray(packed.tokens_dml)[0]
  used = np.asarray(packed.key_ok_dml)[0]
  assert used.sum() == packing.group_tokens(p_b, len_n, k).sum()
  for b in range(len(p_b)):
    row, off = tokens[pl.microbatch_b[b]], pl.offset_b[b]
    prompt = np.asarray(rows.prompt_tokens_bp[b])[-p_b[b]:]
    np.testing.assert_array_equal(row[off:off + p_b[b] - 1], prompt[:-1])
    at = off + p_b[b] - 1
    for j in range(k):
      n = b * k + j
      seg = row[at:at + len_n[n]]
      np.testing.assert_array_equal(seg, np.r_[prompt[-1], np.asarray(
          rows.completions_nt[n])[:len_n[n] - 1]])
      at += len_n[n]
  # Segment ids never decrease along a row (the blockwise kernel's precondition).
  assert (np.diff(np.asarray(packed.segment_dml), axis=-1) >= 0).all()


@pytest.mark.numerics
@pytest.mark.parametrize("loss_type,fused", [("reinforce", True), ("reinforce", False),
                                             ("ppo_clip", False)])
@pytest.mark.parametrize("aggregation", ["sequence_sum", "token_mean"])
def test_a_packed_minibatch_has_the_unpacked_loss_metrics_and_gradient(
    tmp_path, loss_type, fused, aggregation):
  config = tiny_config()
  config.loss.type = loss_type
  config.loss.aggregation = aggregation
  algo = RLOO(experiment.build(config, str(tmp_path)))
  exp = algo.exp
  state = algo.init_state(models.create(exp.model_config)[1])
  rows = _rows(algo, state)
  if loss_type == "ppo_clip":  # ratios away from 1
    rows = rows.replace(old_logp_nt=rows.old_logp_nt - 0.1 * rows.cmask_nt)
  p_b = np.asarray(rows.prompt_mask_bp.sum(1))
  len_n = np.asarray(rows.cmask_nt.sum(1))
  budget = int(packing.group_tokens(p_b, len_n, algo.k).max()) + 2
  packer = _packer(algo, rows, budget)
  packed = packer(rows)
  assert int(packed.count_d[0]) >= 2  # the sum runs over several microbatches
  run = lambda r: update.gradients(state.params, r, fns=exp.fns, spec=exp.loss_spec,  # noqa
                                   k=algo.k, chunk_size=5, fused_head=fused)
  (g0, v0, m0), (g1, v1, m1) = run(rows), run(packed)
  assert float(jnp.abs(v0)) > 0
  np.testing.assert_allclose(v1, v0, rtol=1e-5, atol=1e-7)
  assert set(m1) == set(m0)
  for name in m0:
    np.testing.assert_allclose(m1[name], m0[name], rtol=1e-5, atol=1e-6, err_msg=name)
  scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(g0))
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * scale)

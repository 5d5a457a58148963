"""Packed updates (`rloo_jax.packing`, config.train.microbatch_tokens): the plan, the packed
layout, and the loss and gradient of a packed minibatch against the unpacked one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rloo_jax import experiment, models, packing, update
from rloo_jax.algorithms.rloo import RLOO
from test_head_loss import _rows
from test_trim import MAX_NEW_TOKENS, tiny_config


def _check_plan(pl, p_b, len_n, k, budget):
  """Every completion placed once after its piece's prompt, in its piece's row; no row past the
  budget; the pieces of a row in slot order and nothing overlapping."""
  extent = {}  # (shard, microbatch) -> [(start, end, piece)]
  for i in range(pl.pieces):
    key = (pl.piece_shard[i], pl.piece_microbatch[i])
    end = pl.piece_offset[i] + p_b[pl.piece_group[i]] - 1
    extent.setdefault(key, []).append((pl.piece_offset[i], end, i))
  for n in range(len(len_n)):
    i = pl.piece_n[n]
    assert pl.piece_group[i] == n // k
    key = (pl.shard_n[n], pl.microbatch_n[n])
    assert key == (pl.piece_shard[i], pl.piece_microbatch[i])
    assert pl.start_n[n] >= pl.piece_offset[i] + p_b[n // k] - 1
    extent[key].append((pl.start_n[n], pl.start_n[n] + len_n[n], i))
  for spans in extent.values():
    spans.sort()
    assert spans[-1][1] <= budget
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    slots = [pl.piece_slot[i] for _, _, i in spans]
    assert slots == sorted(slots)
  assert pl.tokens == sum(p_b[pl.piece_group[i]] - 1 for i in range(pl.pieces)) + sum(len_n)
  return extent


def test_the_plan_fills_rows_first_fit_decreasing_and_refuses_a_completion_too_big():
  # Groups of 3 + 7, 3 + 3, 3 + 5, 3 + 2 tokens (prompts of 4 but the last token, k=2).
  p_b = np.array([4, 4, 4, 4])
  len_n = np.array([3, 4, 1, 2, 2, 3, 1, 1])
  pl = packing.plan(p_b, len_n, k=2, budget=16, rows=1)
  # Decreasing: 10 -> row 0, 8 -> row 1, 6 -> row 0 (10 + 6 = 16), 5 -> row 1.
  np.testing.assert_array_equal(pl.piece_group[:4], [0, 2, 1, 3])
  np.testing.assert_array_equal(pl.piece_microbatch[:4], [0, 1, 0, 1])
  np.testing.assert_array_equal(pl.piece_offset[:4], [0, 0, 10, 8])
  np.testing.assert_array_equal(pl.start_n, [3, 6, 13, 14, 3, 5, 11, 12])
  assert (pl.pieces, pl.count, pl.tokens) == (4, 2, 29)
  _check_plan(pl, p_b, len_n, 2, 16)
  two = packing.plan(p_b, len_n, k=2, budget=16, rows=2)
  np.testing.assert_array_equal(two.piece_shard[:4], [0, 1, 0, 1])
  assert two.count == 1
  assert packing.padding_fraction(p_b, len_n, k=2, budget=16, rows=1) == pytest.approx(
      1 - 29 / 32)
  with pytest.raises(ValueError, match=r"a completion of 7 tokens with its prompt does not fit "
                                       r"config.train.microbatch_tokens=6; set it to at least"):
    packing.plan(p_b, len_n, k=2, budget=6, rows=1)


def test_a_group_that_fits_no_row_is_split_its_prompt_in_each_row():
  rng = np.random.default_rng(0)
  k, budget = 4, 20
  p_b = rng.integers(2, 7, 9)
  len_n = rng.integers(1, budget - 5, 9 * k)
  for rows in (1, 2, 3):
    pl = packing.plan(p_b, len_n, k=k, budget=budget, rows=rows)
    assert pl.pieces > 9  # some groups split
    extent = _check_plan(pl, p_b, len_n, k, budget)
    fill = {key: sum(e - s for s, e, _ in spans) for key, spans in extent.items()}
    # First fit: at most one row less than half full.
    assert sum(v <= budget / 2 for v in fill.values()) <= 1
    assert pl.count == -(-len(fill) // rows)


def _packer(algo, rows, budget):
  return packing.Packer(k=algo.k, budget=budget, rows_per_microbatch=1,
                        max_microbatches=rows.completions_nt.shape[0])


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
def test_packed_rows_hold_each_completion_after_its_prompt(tmp_path, split):
  algo = RLOO(experiment.build(tiny_config(), str(tmp_path)))
  state = algo.init_state(models.create(algo.exp.model_config)[1])
  rows = _rows(algo, state)
  k = algo.k
  p_b = np.asarray(rows.prompt_mask_bp.sum(1))
  len_n = np.asarray(rows.cmask_nt.sum(1))
  whole = p_b - 1 + len_n.reshape(-1, k).sum(1)
  budget = int(whole.min()) if split else int(whole.max()) + 3
  packer = _packer(algo, rows, budget)
  pl = packer.plan(rows)
  assert (pl.pieces > len(p_b)) == split
  packed = packer(rows, pl)
  tokens = np.asarray(packed.tokens_dml)[0]
  assert np.asarray(packed.key_ok_dml).sum() == pl.tokens
  for i in range(pl.pieces):
    g = pl.piece_group[i]
    prompt = np.asarray(rows.prompt_tokens_bp[g])[-p_b[g]:]
    off = pl.piece_offset[i]
    np.testing.assert_array_equal(tokens[pl.piece_microbatch[i], off:off + p_b[g] - 1],
                                  prompt[:-1])
  for n in range(len(len_n)):
    prompt = np.asarray(rows.prompt_tokens_bp[n // k])
    seg = tokens[pl.microbatch_n[n], pl.start_n[n]:pl.start_n[n] + len_n[n]]
    np.testing.assert_array_equal(seg, np.r_[prompt[-1], np.asarray(
        rows.completions_nt[n])[:len_n[n] - 1]])
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
  # Split groups and whole ones: some rows hold a prompt twice.
  budget = int(np.median(p_b - 1 + len_n.reshape(-1, algo.k).sum(1)))
  packer = _packer(algo, rows, budget)
  pl = packer.plan(rows)
  assert pl.count >= 2 and pl.pieces > len(p_b)
  run = lambda r: update.gradients(state.params, r, fns=exp.fns, spec=exp.loss_spec,  # noqa
                                   k=algo.k, chunk_size=5, fused_head=fused)
  (g0, v0, m0), (g1, v1, m1) = run(rows), run(packer(rows, pl))
  assert float(jnp.abs(v0)) > 0
  np.testing.assert_allclose(v1, v0, rtol=1e-5, atol=1e-7)
  assert set(m1) == set(m0)
  for name in m0:
    np.testing.assert_allclose(m1[name], m0[name], rtol=1e-5, atol=1e-6, err_msg=name)
  scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(g0))
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.numerics
@pytest.mark.parametrize("attention", ["xla", "blockwise"])
def test_packed_reference_log_probs_equal_the_unpacked_ones(tmp_path, attention, monkeypatch):
  """The scoring pass's log-probs, packed over several microbatches (split groups among them),
  with either attention kernel (blockwise in blocks of 4, so rows run several)."""
  from rloo_jax.models import attention_blockwise  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(attention_blockwise, "BLOCK", 4)
  config = tiny_config()
  config.model.attention = attention
  algo = RLOO(experiment.build(config, str(tmp_path)))
  exp = algo.exp
  state = algo.init_state(models.create(exp.model_config)[1])
  rows = _rows(algo, state)
  p_b = np.asarray(rows.prompt_mask_bp.sum(1))
  len_n = np.asarray(rows.cmask_nt.sum(1))
  packer = _packer(algo, rows, int(np.median(p_b - 1 + len_n.reshape(-1, algo.k).sum(1))))
  ref = lambda r: update.reference_logprobs(state.ref_params, r, fns=exp.fns, k=algo.k,  # noqa
                                            chunk_size=5)
  want, got = ref(rows), ref(packer(rows))
  assert float(jnp.abs(want).max()) > 0
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("change,message", [
    (dict(shared_prefix=False), r"microbatch_tokens packs whole groups: set "
                                r"config.train.shared_prefix=True"),
    (dict(microbatch_size=2), r"microbatch_tokens and config.train.microbatch_size both cut"),
    (dict(microbatch_tokens=20), r"microbatch_tokens=20 cannot hold a completion at full length "
                                 r"with its prompt: set it to at least"),
    (dict(microbatch_tokens="most"), r"microbatch_tokens = 'most': a token budget \(an int\), 0 "
                                     r"\(off\) or 'auto'"),
    (dict(microbatch_tokens="auto", shared_prefix=False), r"microbatch_tokens packs whole"),
])
def test_bad_packing_settings_are_refused_naming_the_key(tmp_path, change, message):
  from rloo_jax import algorithms  # pylint: disable=import-outside-toplevel
  config = tiny_config()
  config.train.microbatch_tokens = 10_000
  config.train.update(change)
  with pytest.raises(ValueError, match=message):
    algorithms.validate(config, with_rewards=False)


def _length_reward(prompts, completions, **_):
  return [float(len(c)) for c in completions]


def test_a_packed_run_trains_and_reports_the_loss_of_the_unpacked_one(tmp_path):
  """One iteration of the tiny config, packed and not, from the same seed: the same rollout, so
  the same loss and gradient norm in the step's metrics."""
  from rloo_jax import algorithms  # pylint: disable=import-outside-toplevel
  out = {}
  for budget in (0, packing.min_tokens(16, MAX_NEW_TOKENS)):
    config = tiny_config()
    config.data.max_prompt_len = 16
    config.train.num_iterations = 1
    config.train.microbatch_tokens = budget
    config.rewards.fns = [_length_reward]  # rewards that differ within a group
    config.rewards.weights = [1.0]
    out[budget] = algorithms.run(config, str(tmp_path / str(budget)))["last_metrics"]
  plain, packed = out.values()
  assert abs(plain["loss"]) > 1e-3 and plain["grad_norm"] > 1e-3
  for key in ("loss", "grad_norm", "entropy", "reward_mean"):
    np.testing.assert_allclose(packed[key], plain[key], rtol=1e-4, atol=1e-7, err_msg=key)
  # The first iteration's policy is the reference: both KLs are 0 up to float32 rounding, whose
  # sign depends on the CPU (6e-8 against -7e-8, packed and not, on an AVX-512 host).
  assert abs(plain["kl"]) < 1e-6 and abs(packed["kl"]) < 1e-6, (plain["kl"], packed["kl"])


def test_auto_takes_the_largest_budget_that_fits_the_device(tmp_path, monkeypatch):
  """config.train.microbatch_tokens='auto': the candidates double from the least budget to a
  shard's whole minibatch; the largest whose plan fits the device's memory is taken, and a run
  with it trains, naming its pick."""
  from rloo_jax import algorithms, memory  # pylint: disable=import-outside-toplevel
  from rloo_jax.memory import budget  # pylint: disable=import-outside-toplevel
  config = tiny_config()
  config.train.microbatch_tokens = "auto"
  least = packing.min_tokens(config.data.max_prompt_len, MAX_NEW_TOKENS)
  assert budget.candidates(config, 1) == [least * 2 ** i for i in range(5)]  # 4 prompts x 4
  assert budget.candidates(config, 4) == [least, 2 * least, 4 * least]  # over 4 batch shards
  config.rloo.update(num_prompts=2, k=2)  # three candidates: each is a plan of every program
  tried = budget.candidates(config, 1)
  assert tried == [least, 2 * least, 4 * least]
  algo = RLOO(experiment.build(config, str(tmp_path)))
  peaks = [memory.plan(budget.with_budget(algo, b))["peak_gb_per_device"] for b in tried]
  assert peaks == sorted(peaks) and peaks[0] < peaks[-1], peaks
  i = max(j for j in range(len(tried) - 1) if peaks[j] < peaks[j + 1])
  lines = []
  got, report = budget.resolve(algo, device_memory_gb=(peaks[i] + peaks[i + 1]) / 2,
                               log=lines.append)
  assert got.exp.config.train.microbatch_tokens == tried[i], (lines, peaks)
  assert got.step_fn.packer.budget == tried[i]
  assert report["peak_gb_per_device"] == peaks[i]  # the pick's plan, handed to memory.check
  # The next candidate was planned over the memory: the line says so (an accelerator's compiler
  # warns about it above the line).
  over = lines[-1][lines[-1].rindex("["):lines[-1].index("did not")]
  assert str(tried[i + 1]) in over and "warning of XLA above is theirs" in lines[-1], lines
  compiled = []  # the bisection's two plans, no advice compiled for what does not fit
  compile_programs = memory.programs_lib.compile_programs
  monkeypatch.setattr(memory.programs_lib, "compile_programs",
                      lambda *a, **kw: compiled.append(1) or compile_programs(*a, **kw))
  none, report = budget.resolve(algo, device_memory_gb=peaks[0] / 2, log=lines.append)
  assert none.exp.config.train.microbatch_tokens == least and "none of" in lines[-1]
  assert report is None and len(compiled) == 2, compiled
  monkeypatch.undo()
  config.train.num_iterations = 1
  config.rewards.fns = [_length_reward]
  log = []
  m = algorithms.run(config, str(tmp_path / "run"), log=log.append)["last_metrics"]
  assert any(f"microbatch_tokens='auto': {tried[-1]} tokens" in line for line in log), log
  assert "[rollout] the engine: 2 prompts x k=2 streams through 4 stream slots" in "\n".join(log)
  assert np.isfinite(m["loss"]) and m["grad_norm"] > 0


def test_the_planner_names_packed_microbatches_and_their_budgets(tmp_path):
  """A packed job's plan: its microbatch line, a larger budget offered where the update fits,
  and the smallest budget advised where it does not."""
  from rloo_jax import memory  # pylint: disable=import-outside-toplevel
  config = tiny_config()
  least = packing.min_tokens(config.data.max_prompt_len, MAX_NEW_TOKENS)
  config.train.microbatch_tokens = 2 * least
  algo = RLOO(experiment.build(config, str(tmp_path)))
  report = memory.plan(algo, names=("update",), speedups=True)
  assert report["microbatch_tokens"] == 2 * least
  offered = [s["setting"] for s in report["speedups"]]
  assert f"--config.train.microbatch_tokens={8 * least}" in offered, offered
  assert "packed rows of" in memory.format_table(report)
  tight = memory.plan(algo, names=("update",),
                      device_memory_gb=report["peak_gb_per_device"] * 0.9)
  assert not tight["fits"]
  assert any(f"--config.train.microbatch_tokens={least} (now {2 * least}" in a
             for a in tight["advice"]), tight["advice"]


@pytest.mark.numerics
@pytest.mark.parametrize("attention", ["xla", "blockwise"])
def test_packed_gemma2_rows_with_windows_and_soft_caps_equal_the_grouped_ones(attention,
                                                                              monkeypatch):
  """Sliding windows (3, alternate layers) and soft-capped scores through packed rows, split
  groups among them: log-probs and their gradient equal the grouped 'xla' forward's."""
  from rloo_jax import rollout  # pylint: disable=import-outside-toplevel
  from rloo_jax.models import (TransformerConfig, attention_blockwise,  # noqa  pylint: disable=import-outside-toplevel
                               create, model_fns)
  monkeypatch.setattr(attention_blockwise, "BLOCK", 4)
  config = TransformerConfig.gemma2(
      vocab_size=61, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8,
      intermediate_size=48, max_seq_len=64, sliding_window=3, attn_softcap=1.5,
      final_softcap=2.0, query_pre_attn_scalar=12.0)
  _, params = create(config)
  rng = np.random.default_rng(5)
  b, k, p, t = 3, 2, 6, 7
  lengths_b = np.array([6, 3, 4])
  len_n = np.array([7, 2, 5, 1, 3, 6])
  cmask = np.arange(t)[None, :] < len_n[:, None]
  rows = rollout.make_rows(
      jnp.asarray(rng.integers(3, 61, (b, p))), jnp.asarray(lengths_b),
      jnp.asarray(np.where(cmask, rng.integers(3, 61, (b * k, t)), 0)), jnp.asarray(cmask),
      jnp.zeros((b * k, t)), k=k, shared_prefix=True)
  budget = 12  # holds every completion with its prompt, not every group: some split
  packer = packing.Packer(k=k, budget=budget, rows_per_microbatch=1, max_microbatches=b * k)
  pl = packer.plan(rows)
  assert pl.pieces > b
  packed = packer(rows, pl)

  def total(fns, r):
    def f(prm):
      lp = update.reference_logprobs(prm, r, fns=fns, k=k, chunk_size=4)
      return jnp.sum(lp), lp
    return jax.value_and_grad(f, has_aux=True)(params)

  (_, want), g_want = total(model_fns(create(config)[0]), rows)
  (_, got), g_got = total(model_fns(create(config.replace(attention=attention))[0]), packed)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  for a, b_ in zip(jax.tree.leaves(g_got), jax.tree.leaves(g_want)):
    np.testing.assert_allclose(a, b_, rtol=1e-5, atol=1e-5 * float(jnp.abs(b_).max()))

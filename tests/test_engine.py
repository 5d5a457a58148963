"""Tests of rloo_jax.engine: the continuous-batching rollout engine draws, token for token, what the
static sampler draws, whatever slot a stream lands in and whatever its slot held before."""

from __future__ import annotations

import dataclasses
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import FIXTURE_TERMS, assert_f32_close

from rloo_jax import engine, engine_paging, engine_pool, models, sampler, sampling

PAD = 0
STOPS = (45, 46, 47)
FAMILIES = ('llama', 'qwen2', 'qwen3', 'gpt2', 'gpt_neox', 'gemma2', 'gemma3')


def _tiny(family):
  overrides = dict(vocab_size=48, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=8, intermediate_size=64, max_seq_len=64)
  if family in ('gemma2', 'gemma3'):  # a window shorter than the prompts and completions
    overrides.update(sliding_window=4, layer_types=('sliding_attention', 'full_attention'))
  graphdef, params = models.create(getattr(models.TransformerConfig, family)(**overrides))
  return models.model_fns(graphdef), params


def _prompts(n=5, width=12, seed=0):
  rs = np.random.RandomState(seed)
  lengths = np.array([7, 2, 12, 5, 9, 12, 3, 8][:n], np.int32)
  tokens = np.where(np.arange(width)[None] < lengths[:, None], rs.randint(2, 45, (n, width)), PAD)
  return tokens.astype(np.int32), lengths


def _both(fns, params, method, *, slots, t=20, eos_id=STOPS, **kw):
  tokens, lengths = _prompts()
  args = dict(k=3, max_new_tokens=t, method=method, eos_id=eos_id, pad_id=PAD)
  static = sampler.sample(fns, params, tokens, lengths, jax.random.key(3), **args)
  ours = sampler.sample(fns, params, tokens, lengths, jax.random.key(3), slots=slots, **args, **kw)
  return jax.tree.map(np.asarray, static), jax.tree.map(np.asarray, ours)


def _assert_same(static, ours):
  np.testing.assert_array_equal(ours.tokens_bkt, static.tokens_bkt)
  np.testing.assert_array_equal(ours.mask_bkt, static.mask_bkt)
  np.testing.assert_array_equal(ours.lengths_bk, static.lengths_bk)
  assert_f32_close(ours.policy_logprobs_bkt, static.policy_logprobs_bkt, FIXTURE_TERMS)
  assert_f32_close(ours.logprobs_bkt, static.logprobs_bkt, FIXTURE_TERMS)


# Three slots for groups of three streams: every group after the first reuses the slots of
# streams that ended, and waits for them.
@pytest.mark.parametrize('family', FAMILIES)
def test_the_engine_draws_the_static_samplers_tokens(family):
  fns, params = _tiny(family)
  static, ours = _both(fns, params, sampling.Temperature(1.0), slots=3)
  _assert_same(static, ours)
  ends = np.isin(static.tokens_bkt, STOPS) & static.mask_bkt
  # Streams of several lengths, ended by each of the stop ids, some at the cap.
  assert len(np.unique(static.lengths_bk)) > 4 and (static.lengths_bk == 20).any()
  assert len(np.unique(static.tokens_bkt[ends])) >= 2


@pytest.mark.parametrize('method, slots, rows', [
    (sampling.Greedy(), 4, 0), (sampling.TopP(0.8, temperature=0.7), 6, 1),
    (sampling.TopK(5), 16, 0)], ids=['greedy', 'top_p', 'top_k'])
def test_every_method_and_slot_count(method, slots, rows):
  """Slots short of a group's k plus one, a prefix row for one group at a time, and more slots
  than the five groups' streams."""
  fns, params = _tiny('llama')
  # Greedy from these prompts ends at once on any of STOPS: one stop id, met later.
  eos = (47,) if method.is_greedy else STOPS
  static, ours = _both(fns, params, method, slots=slots, prefix_rows=rows, eos_id=eos)
  _assert_same(static, ours)
  assert static.lengths_bk.max() > 3


def test_unstacked_layers_and_a_one_token_cap():
  fns, params = _tiny('gemma3')
  _assert_same(*_both(fns, params, sampling.Temperature(1.0), slots=6, unstack_layers=True))
  _assert_same(*_both(fns, params, sampling.Temperature(1.0), slots=3, t=1))


def test_with_a_slot_for_every_stream_start_admits_all_and_a_phase_only_decodes():
  """An unchunked rollout's engine (a slot for each of the 5 * 3 streams, a prompt row for each
  prompt, more asked than there are prompts): `start` admits every group in one prefill (no
  admission loop), so a phase's loop holds no admission either (its while loop and the
  prefill's go), and it draws the static sampler's tokens."""
  fns, params = _tiny('llama')
  _assert_same(*_both(fns, params, sampling.Temperature(1.0), slots=15, prefix_rows=15))
  tokens, lengths = (jnp.asarray(x) for x in _prompts())
  args = (fns, params, tokens, lengths, jax.random.key(3), jnp.asarray(STOPS))
  static = dict(k=3, max_new_tokens=20, method=sampling.Temperature(1.0))

  def loops(slots, rows):
    pools = dict(slots=slots, prefix_rows=rows, **static)
    state = engine.start(*args, jnp.int32(PAD), **pools)
    assert state.refs_q.shape[-1] == min(rows, 5)  # no more prompt rows than prompts
    return tuple(f.lower(*args, x, **pools if f is engine.start else dict(
        static, kv_limit=20)).as_text().count('stablehlo.while')
                 for f, x in ((engine.start, jnp.int32(PAD)), (engine.phase, state)))

  at_once, waiting = loops(15, 15), loops(6, 2)
  assert at_once[0] < waiting[0] and at_once[1] < waiting[1] and waiting == loops(15, 4)


def test_with_every_group_admitted_at_once_a_decode_reads_the_prefix_rows_in_place():
  """The at-once engine keeps the static sampler's grouped layout (a group's k streams in its
  prefix row's stream row): no decode step gathers a copy of a prefix row for each stream
  (`DecodeCache.prefix_for_rows`), which the accelerator compilers keep live for every layer."""
  fns, params = _tiny('llama')
  tokens, lengths = (jnp.asarray(x) for x in _prompts())
  args = (fns, params, tokens, lengths, jax.random.key(3), jnp.asarray(STOPS))
  static = dict(k=3, max_new_tokens=20, method=sampling.Temperature(1.0))

  def prefix_gathers(slots, rows):
    state = engine.start(*args, jnp.int32(PAD), slots=slots, prefix_rows=rows, **static)
    # a layer's prefix keys or values [D, Q, Hkv, ...] as a gather's operand
    pool = {'x'.join(map(str, x.shape[:1] + x.shape[2:])) for x in (
        state.cache.prefix_k_lbhdp, state.cache.prefix_v_lbhpd)}
    hlo = engine.phase.lower(*args, state, kv_limit=20, **static).as_text()
    operands = re.findall(r'"stablehlo.gather".*?: \(tensor<([0-9x]+)x[a-z0-9]+>', hlo)
    return state, sum(o in pool for o in operands)

  state, gathers = prefix_gathers(15, 15)
  assert state.cache.k_lbkhdt.shape[2:4] == (5, 3) and state.cache.prefix_rows_b is None
  assert gathers == 0 and prefix_gathers(6, 2)[1] >= 2


@pytest.mark.parametrize('unstack', [False, True])
def test_a_decode_step_writes_every_slot_with_one_slice_update_not_a_scatter(unstack):
  """The ring: every slot writes one column, so the step's KV write is a dynamic-update-slice
  under the shards' vmap too (`cache._dus`). A scatter there makes the TPU compiler keep the
  loop's buffers in another layout than the state's and copy the whole KV in and out; a
  paged pool still scatters (each stream its own page)."""
  fns, params = _tiny('llama')
  tokens, lengths = (jnp.asarray(x) for x in _prompts())
  args = (fns, params, tokens, lengths, jax.random.key(3), jnp.asarray(STOPS))
  static = dict(k=3, max_new_tokens=20, method=sampling.Temperature(1.0), unstack_layers=unstack)

  def writes(**pool):
    state = engine.start(*args, jnp.int32(PAD), slots=6, prefix_rows=2, **static, **pool)
    hlo = engine.phase.lower(*args, state, kv_limit=20, **static).as_text()
    buffers = {str(x.shape) for x in jax.tree.leaves((state.cache.k_lbkhdt,
                                                       state.cache.v_lbkhtd))}
    lines = hlo.splitlines()
    found = set()
    for i, line in enumerate(lines):
      for op, name in (('stablehlo.scatter', 'scatter'), ('stablehlo.dynamic_update_slice', 'slice')):
        if op in line:  # its result type: on its line, or a scatter's after its update region
          end = next(t for t in lines[i:] if '->' in t and (op in t or t.strip()[:4] == '}) :'))
          dims = end.split('->')[-1].split('tensor<')[1].split('x')[:-1]
          found |= {name} if str(tuple(int(d) for d in dims)) in buffers else set()
    return found

  assert writes() == {'slice'}
  assert 'scatter' in writes(pages=8, page_size=4)


def _poison(monkeypatch, *fields):
  """The engine's empty caches start with `fields` full of large values (float32 leaves): what
  a previous stream could have left in a slot or page."""
  clean = engine_pool.empty_cache
  fill = lambda x: jnp.full_like(x, 30.0) if x.dtype == jnp.float32 else x  # noqa: E731

  def poisoned(*args, **kw):
    cache = clean(*args, **kw)
    return cache.replace(**{f: jax.tree.map(fill, getattr(cache, f)) for f in fields})

  monkeypatch.setattr(engine_pool, 'empty_cache', poisoned)


def test_a_rollout_compiles_the_engines_programs_and_no_eager_op(monkeypatch, caplog):
  """Between phases `run` reads its progress through one small program and returns its rows
  through one: no eager op compiles (on an accelerator each is a dispatch of its own)."""
  fns, params = _tiny('qwen2')
  monkeypatch.setattr(engine, 'SMALLEST_KV_LIMIT', 4)  # phases at 6 and 13 stream slots
  tokens, lengths = _prompts()
  rng = jax.random.key(3)
  jax.clear_caches()  # every program the rollout needs is compiled below, none in memory
  with jax.log_compiles(True), caplog.at_level(logging.WARNING):
    sampler.sample(fns, params, tokens, lengths, rng, k=3, max_new_tokens=13,
                   method=sampling.Temperature(1.0), eos_id=STOPS, pad_id=PAD, slots=6)
  names = sorted(re.findall(r'Compiling jit\((\w+)\)', caplog.text))
  # Two phases, their rings re-laid from 6 to 13 slots and back as the longest stream ends.
  assert names == ['_as_rows', '_progress', 'phase', 'phase', 'relayout', 'relayout', 'start'], (
      names)


def test_a_reused_slot_reads_nothing_of_its_previous_stream(monkeypatch):
  """Stream and prefix buffers start full of large values (what a previous stream could have
  left at any slot past the new stream's index): the tokens are still the static sampler's,
  so nothing past a stream's own index, and no other prompt's prefix column, is read."""
  fns, params = _tiny('llama')
  _poison(monkeypatch, 'k_lbkhdt', 'v_lbkhtd', 'prefix_k_lbhdp', 'prefix_v_lbhpd')
  # Phases reading 2, 4, 9 and 19 stream slots: a limit must never cut a live stream short.
  monkeypatch.setattr(engine, 'SMALLEST_KV_LIMIT', 2)
  assert engine.kv_limits(19, 4) == (2, 4, 9, 19)
  periods = []  # each phase change re-lays the streams' rings (engine_ring)
  relayout = engine.ring.relayout
  monkeypatch.setattr(engine.ring, 'relayout', lambda state, *, old, new: (
      periods.append((old, new)), relayout(state, old=old, new=new))[1])
  # t=19: a program no other test compiled, so it is traced with the poisoned cache.
  static, ours = _both(fns, params, sampling.Temperature(1.0), slots=3, prefix_rows=1, t=19)
  _assert_same(static, ours)
  # The slots were reused: 5 groups through 3 slots.
  tokens, lengths = _prompts()
  state = engine.run(fns, params, jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(3),
                     jnp.asarray(STOPS), jnp.int32(PAD), k=3, max_new_tokens=19,
                     method=sampling.Temperature(1.0), slots=3, prefix_rows=1)
  assert int(state.next_group.sum()) == 5 and not (np.asarray(state.group_s) >= 0).any()
  assert {(2, 4), (4, 9), (9, 19)} <= set(periods) and any(o > n for o, n in periods), periods
  # Every group admitted at once (the grouped layout), its rings re-laid between phases too.
  periods.clear()
  _assert_same(static, _both(fns, params, sampling.Temperature(1.0), slots=15, t=19)[1])
  assert {(2, 4), (4, 9), (9, 19)} <= set(periods), periods
  # Every decode step ran some slot: fewer steps than the sum of each group's longest stream.
  assert int(state.steps.max()) <= int(static.lengths_bk.max(axis=1).sum())


@pytest.mark.parametrize('family, unstack', [('llama', False), ('gemma3', True)])
def test_paged_streams_in_a_pool_of_one_streams_pages_draw_the_static_samplers_tokens(
    family, unstack, monkeypatch):
  """Paged KV (`pages`): 6 slots share 5 pages of 4 slots, what one stream at the cap of 20
  needs, so streams stall for pages and are preempted to start again. The pool and the
  streams' tails start full of large values and pages pass from stream to stream; the tokens are still the static
  sampler's, with sliding windows and unrolled layers too."""
  fns, params = _tiny(family)
  _poison(monkeypatch, 'k_lbkhdt', 'v_lbkhtd', 'k_pages', 'v_pages')
  paged = dict(slots=6, pages=5, page_size=4, unstack_layers=unstack)
  static, ours = _both(fns, params, sampling.Temperature(1.0), **paged)
  _assert_same(static, ours)
  tokens, lengths = _prompts()
  state = engine.run(fns, params, jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(3),
                     jnp.asarray(STOPS), jnp.int32(PAD), k=3, max_new_tokens=20,
                     method=sampling.Temperature(1.0), prefix_rows=2, **paged)
  assert int(state.preempted.sum()) > 0 and int(state.next_group.sum()) == 5
  assert bool(state.free_p.all())  # every page back in the pool


@pytest.mark.parametrize('kw, match', [
    (dict(slots=6, pages=3, page_size=1), r'pages = 3 \(pages of 1 slots\) must hold one stream'),
    (dict(slots=2), 'slots = 2 must be an integer >= k = 3'),
    (dict(slots=6, prefix_rows=7), 'prefix_rows = 7 must be an integer in 1..slots = 6'),
    (dict(slots=6, mode='unshared'), "set mode='shared'"),
])
def test_bad_engine_settings_fail_before_compiling(kw, match):
  fns, params = _tiny('llama')
  tokens, lengths = _prompts()
  with pytest.raises(ValueError, match=match):
    sampler.sample(fns, params, tokens, lengths, jax.random.key(0), k=3, max_new_tokens=4,
                   method=sampling.Greedy(), eos_id=47, pad_id=PAD, **kw)


def test_config_rollout_slots_drives_rollouts_evaluation_and_generate(tmp_path):
  """config.rloo.rollout_slots reaches every sampler call a run makes (rollouts, the
  Evaluator, Policy.generate, all through `sampler_args.decode_options`), which then draw the
  static sampler's completions (rollout_engine=False), as the default engine of the whole
  batch's slots does; a bad value fails the config's validation."""
  from rloo_jax import experiment, rollout, sampler_args  # pylint: disable=import-outside-toplevel
  from test_trim import first_batch, tiny_config  # pylint: disable=import-outside-toplevel
  outs = []
  # 6 pages of 4: two streams at the cap of 12.
  for slots, pages, on in ((0, 0, False), (8, 0, True), (8, 6, True), (0, 0, True)):
    config = tiny_config()
    config.rloo.update(rollout_slots=slots, rollout_pages=pages, rollout_page_size=4,
                       rollout_engine=on)
    exp = experiment.build(config, str(tmp_path / f'{slots}_{pages}_{on}'))
    assert sampler_args.decode_options(exp)['slots'] == slots
    assert sampler_args.rollout_slots(config.rloo) == (slots or on * config.rloo.num_prompts * config.rloo.k)
    assert sampler_args.decode_options(exp)['pages'] == pages
    params = models.create(exp.model_config)[1]
    outs.append(rollout.sample_batch(exp, params, first_batch(exp), jax.random.key(0),
                                     k=exp.config.rloo.k)[0])
  for out in outs[1:]:
    _assert_same(*(jax.tree.map(np.asarray, o) for o in (outs[0], out)))
  config = tiny_config()
  config.rloo.rollout_slots = 2
  with pytest.raises(ValueError, match=r'config.rloo.rollout_slots = 2 must be an integer >= k'):
    experiment.validate_config(config)
  config.rloo.update(rollout_slots=0, rollout_engine=False, rollout_pages=8)
  with pytest.raises(ValueError, match=r'config.rloo.rollout_pages pages the rollout engine'):
    experiment.validate_config(config)


@dataclasses.dataclass(frozen=True)
class _Stand:  # what the paging functions read of an EngineState and its cache
  pages_bm: jax.Array = None
  k_lbkhdt: jax.Array = None  # its last axis: the page size
  cache: _Stand = None
  free_p: jax.Array = None
  group_s: jax.Array = None
  stream_s: jax.Array = None
  age_s: jax.Array = None
  step_s: jax.Array = None
  last_s: jax.Array = None
  tokens_nkt: jax.Array = None
  lengths_nk: jax.Array = None
  preempted: jax.Array = None
  replace = dataclasses.replace


def test_a_stuck_pool_preempts_the_fewest_youngest_streams_that_let_every_other_step():
  """8 streams in lockstep, each holding 4 pages (of 1 slot) of a full pool of 32, each needing
  a fifth: two victims (their 8 pages >= the 6 others' needs; one would free 4 < 7), the two
  admitted last; then every older stream gets its page, and the victims the 2 left."""
  s, k, per = 8, 4, 8
  scratch = 32
  pages = np.full((s, per), scratch, np.int32)
  pages[:, :4] = np.arange(32).reshape(s, 4)
  tokens = np.arange(2 * k * 5).reshape(2, k, 5)
  st = _Stand(cache=_Stand(pages_bm=jnp.asarray(pages), k_lbkhdt=jnp.zeros((1, 33, 1, 1, 1))),
              free_p=jnp.zeros((32,), bool),
              group_s=jnp.repeat(jnp.arange(2), k), stream_s=jnp.tile(jnp.arange(k), 2),
              age_s=jnp.asarray([3, 0, 1, 2, 7, 4, 6, 5]), step_s=jnp.full((s,), 5),
              last_s=jnp.full((s,), 9), tokens_nkt=jnp.asarray(tokens),
              lengths_nk=jnp.full((2, k), 5), preempted=jnp.int32(0))
  st = engine_paging.preempt(st)
  victims = [4, 6]  # ages 7 and 6
  assert int(st.preempted) == 2
  np.testing.assert_array_equal(np.flatnonzero(np.asarray(st.step_s) == 1), victims)
  np.testing.assert_array_equal(np.asarray(st.last_s)[victims], tokens[1, [0, 2], 0])
  np.testing.assert_array_equal(np.asarray(st.lengths_nk)[1], [1, 5, 1, 5])
  assert int(st.free_p.sum()) == 8 and (np.asarray(st.cache.pages_bm)[victims] == scratch).all()
  index_s = jnp.maximum(st.step_s - 1, 0)
  st, steps_s = engine_paging.grant(st, st.group_s >= 0, index_s)
  assert bool(steps_s.all()) and int(st.free_p.sum()) == 0


def test_paged_streams_read_in_place_by_the_pallas_kernel_draw_the_static_samplers_tokens(
    monkeypatch):
  """On TPU a paged decode reads each stream's full pages where they lie (the Pallas paged
  kernel, `models.attention_paged`) and joins them to the prompt and the stream's tail by
  log-sum-exp. Here the kernel runs in Pallas' TPU interpreter, which rounds float32 products'
  operands to bfloat16, so the model is bfloat16 (head_dim 16: the scale 1/4 is exact); the
  pool and the tails start full of large values, pages pass between streams."""
  # pylint: disable-next=import-outside-toplevel
  from rloo_jax.models import attention_paged, traced_mesh
  config = models.TransformerConfig.llama(
      vocab_size=48, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
      intermediate_size=64, max_seq_len=64, dtype='bfloat16')
  graphdef, params = models.create(config)
  fns = models.model_fns(graphdef)
  _poison(monkeypatch, 'k_lbkhdt', 'v_lbkhtd', 'k_pages', 'v_pages')
  decode, read = attention_paged.decode, []
  monkeypatch.setattr(attention_paged, 'applies', lambda spec: not traced_mesh.shards_vmapped())
  monkeypatch.setattr(attention_paged, 'decode', lambda *a: (
      read.append(1), decode(*a, interpret=True))[1])
  tokens, lengths = _prompts(n=3)
  args = dict(k=2, max_new_tokens=8, method=sampling.Temperature(1.0), eos_id=STOPS, pad_id=PAD)
  static = sampler.sample(fns, params, tokens, lengths, jax.random.key(3), **args)
  ours = sampler.sample(fns, params, tokens, lengths, jax.random.key(3), slots=4, pages=4,
                        page_size=2, **args)
  assert read  # the kernel's program was traced
  static, ours = jax.tree.map(np.asarray, (static, ours))
  np.testing.assert_array_equal(ours.tokens_bkt, static.tokens_bkt)
  np.testing.assert_array_equal(ours.lengths_bk, static.lengths_bk)
  assert (static.lengths_bk == 8).sum() >= 2  # streams that filled pages and read them back
  np.testing.assert_allclose(ours.logprobs_bkt, static.logprobs_bkt, atol=4e-3)

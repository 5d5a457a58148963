"""The memory plan of a run decoding with the rollout engine (config.rloo.rollout_slots): the
engine's one program compiled instead of the static sampler's start and decode, its KV cache
(stream buffers + prefix pool) sized by the slots, and the slots that fit advised, compiled.
Planned in this process on its one CPU device, the rollout alone (a few small compiles)."""
import pytest

from conftest import load_config
from rloo_jax import experiment, sampler_args
from rloo_jax import memory as plan
from rloo_jax.algorithms.rloo import RLOO
from rloo_jax.memory import programs

GIB = plan.GIB
ROLLOUT = ("start", "decode")  # what a plan of the rollout asks for, whichever the run decodes with


def engine_algo(slots, prefix_rows=0, **rloo):
  c = load_config()
  with c.unlocked():
    c.rloo.update(num_prompts=8, max_new_tokens=16, rollout_slots=slots,
                  rollout_prefix_rows=prefix_rows, **rloo)
    c.model.max_seq_len = 32
  return RLOO(experiment.build_abstract(c))


def kv_bytes(algo, slots, prefix_rows):
  """K and V of `slots` stream buffers of T tokens and `prefix_rows` prompt rows of P, float32,
  [L, rows, Hkv, D, cols] each (plus the engine's per-row masks and indices, a few bytes)."""
  c, m = algo.exp.config, algo.exp.model_config
  return 2 * m.num_layers * m.num_kv_heads * m.head_dim * 4 * (
      slots * c.rloo.max_new_tokens + prefix_rows * c.data.max_prompt_len)


def slots_tip(r):
  tips = [a for a in r["advice"] if a.startswith("--config.rloo.rollout_slots=")]
  assert len(tips) == 1, r["advice"]
  return int(tips[0].split("=")[1].split()[0]), tips[0]


@pytest.fixture(scope="module")
def plans():
  """{slots: (algo, report)}: the rollout planned at 8 and 32 slots (4 and 16 prompt rows)."""
  return {s: (a, plan.plan(a, names=ROLLOUT)) for s, a in ((8, engine_algo(8)),
                                                          (32, engine_algo(32)))}


def test_an_engine_run_plans_the_engine_program_not_the_sampler(plans):
  algo, r = plans[8]
  assert list(r["programs"]) == ["engine"]
  assert (r["rollout_slots"], r["rollout_prefix_rows"]) == (8, 4)  # default: 2 * slots / k
  p = r["programs"]["engine"]
  assert p["argument_gb"] > 0 and p["temp_gb"] > 0 and p["compile_s"] > 0
  table = plan.format_table(r)
  assert "rollout engine" in table and "sampler decode" not in table
  assert "the engine's 8 stream slots + 4 prompt rows" in table
  # "engine" asked for by name compiles the same; a static run asked for it gets its own two.
  assert list(plan.plan(algo, names=("engine",))["programs"]) == ["engine"]
  static_exp = engine_algo(0, rollout_engine=False).exp
  static = static_exp.config
  assert programs.program_names(static_exp, ("update", "engine")) == ("update", "start", "decode")
  # By default (rollout_engine, unchunked) the engine takes the whole batch's 8 * k slots, with
  # a prompt row for each of the 8 prompts (not the default 2 * slots / k, 16: more than
  # there are prompts).
  default_exp = engine_algo(0).exp
  default = default_exp.config
  assert programs.program_names(default_exp, ("update", "start")) == ("update", "engine")
  assert sampler_args.engine_slots(default.rloo) == (32, 8)
  # The experiment's rollout, derived once for the plan, the sampler calls and the log line.
  r = default_exp.rollout_shape
  assert (r.chunk, r.slots, r.prefix_rows, r.pages, r.ways, r.unstacked) == (8, 32, 8, 0, 1, False)
  assert r.line == sampler_args.describe(default.rloo)
  # More slots than streams, all admitted at once: the engine holds the streams' 32 alone.
  more = engine_algo(64).exp.config.rloo
  assert sampler_args.engine_slots(more) == (32, 8)
  # ... and a run says so in the line it logs before it starts (`algorithms.run`).
  assert sampler_args.describe(more) == (
      "[rollout] the engine: 8 prompts x k=4 streams through 32 stream slots (each a KV buffer "
      "of 16 tokens) and 8 prompt rows; config.rloo.rollout_slots=64 is more than the streams "
      "need, so 32 are held")
  assert sampler_args.describe(more, ways=2).endswith("over 2 batch shards; config.rloo."
                                                      "rollout_slots=64 is more than the streams "
                                                      "need, so 32 are held")
  assert sampler_args.describe(static.rloo) == (
      "[rollout] the static sampler (shared): 8 prompts x k=4, each call decoding until its "
      "longest stream ends")


def test_the_engine_kv_cache_is_its_stream_buffers_and_prefix_pool_and_grows_with_the_slots(
    plans):
  (algo8, small), (algo32, big) = plans[8], plans[32]
  assert small["kv_cache_gb"] * GIB == pytest.approx(kv_bytes(algo8, 8, 4), rel=0.01)
  # 32 slots' default of 16 prompt rows is cut to the batch's 8 prompts.
  assert big["rollout_prefix_rows"] == 8
  assert big["kv_cache_gb"] * GIB == pytest.approx(kv_bytes(algo32, 32, 8), rel=0.01)
  assert (big["kv_cache_gb"] - small["kv_cache_gb"]) * GIB == pytest.approx(
      kv_bytes(algo8, 24, 4), rel=0.01)
  assert big["programs"]["engine"]["peak_gb"] > small["programs"]["engine"]["peak_gb"]
  # Prompt rows set apart from the default: the prefix pool follows them.
  r = plan.plan(engine_algo(8, prefix_rows=8), names=ROLLOUT)
  assert r["rollout_prefix_rows"] == 8
  assert (r["kv_cache_gb"] - small["kv_cache_gb"]) * GIB == pytest.approx(
      kv_bytes(algo8, 0, 4), rel=0.01)


def test_an_engine_over_the_device_is_told_the_slots_that_fit_compiled(plans):
  algo, r = plans[32]
  peak = r["peak_gb_per_device"]
  limit_gb = 0.95 * peak
  over = plan.plan(algo, names=ROLLOUT, device_memory_gb=limit_gb)
  assert not over["fits"]
  slots, tip = slots_tip(over)
  assert 4 <= slots < 32 and slots % 4 == 0, tip
  at = plan.plan(engine_algo(slots), names=ROLLOUT)["programs"]["engine"]["peak_gb"]
  assert at <= limit_gb and f"compiled at {slots}: engine peak {at:.3g} GiB" in tip
  assert f"now 32: the rollout engine's KV cache, {r['kv_cache_gb']:.3g} GiB" in tip
  # The state alone over the device: no slot count can help, so none is named.
  tiny = plan.plan(algo, names=ROLLOUT, device_memory_gb=0.3 * peak)
  assert not any("rollout_slots" in a for a in tiny["advice"])


def test_a_static_rollout_over_the_device_is_told_the_engine_slots_that_fit():
  algo = engine_algo(0, rollout_engine=False)
  r = plan.plan(algo, names=ROLLOUT)
  assert set(r["programs"]) == {"start", "decode"} and r["rollout_slots"] == 0
  limit_gb = 0.95 * r["peak_gb_per_device"]
  slots, tip = slots_tip(plan.plan(algo, names=ROLLOUT, device_memory_gb=limit_gb))
  assert 4 <= slots < 8 * 4 and slots % 4 == 0, tip
  assert plan.plan(engine_algo(slots), names=ROLLOUT)["peak_gb_per_device"] <= limit_gb
  assert "holds all 32 of a chunk" in tip


def test_a_chunked_rollout_plans_the_engine_in_a_chunks_slots_over_the_whole_batch():
  """rollout_chunk_prompts=2 of 8 prompts with rollout_engine (the default): the engine with
  2 * k = 8 slots over the batch (the plan of rollout_slots=8, prompts and outputs alike);
  without: the static sampler on a chunk of 2 prompts, 4 of its outputs alive."""
  chunked, explicit = engine_algo(0, rollout_chunk_prompts=2), engine_algo(8)
  r, want = (plan.plan(a, names=ROLLOUT) for a in (chunked, explicit))
  assert list(r["programs"]) == ["engine"] and r["rollout_slots"] == 8
  assert r["rollout_chunk_prompts"] == 8  # one call: the whole batch
  assert r["programs"]["engine"]["peak_gb"] == want["programs"]["engine"]["peak_gb"]
  static = plan.plan(engine_algo(0, rollout_chunk_prompts=2, rollout_engine=False), names=ROLLOUT)
  assert set(static["programs"]) == {"start", "decode"} and static["rollout_chunk_prompts"] == 2

"""Every program of the smoke configs compiled by a TPU's and a GPU's own compiler, deviceless on
this host (`memory.targets`): a compile error or a RESOURCE_EXHAUSTED on either fails here.

The compilers come with `pip install -e ".[plan]"`; without them these tests skip, saying so.
`.ci/run` installs them and sets RLOO_JAX_ACCELERATOR_COMPILERS=1, which turns a skip into a
failure.
"""
import os
import re

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # xdist workers each load libtpu

import jax
import jax.numpy as jnp
import pytest

from conftest import load_config
from rloo_jax import algorithms, experiment, memory, models, sampler_args
from rloo_jax.memory import programs as programs_lib
from rloo_jax.memory import targets
from rloo_jax.sharding import per_device_bytes

_MISSING = [p for p in ("tpu", "gpu") if not targets.available(p)]
if _MISSING and os.environ.get("RLOO_JAX_ACCELERATOR_COMPILERS"):
  raise RuntimeError(f"RLOO_JAX_ACCELERATOR_COMPILERS=1 but no {'/'.join(_MISSING)} compiler: "
                     'pip install -e ".[plan]"')
pytestmark = pytest.mark.skipif(
    bool(_MISSING), reason=f"no {'/'.join(_MISSING)} compiler here (pip install -e \".[plan]\")")
# Deviceless compiles turn the compilation cache off (`targets.devices`), as `rloo_jax.plan
# --target` does; conftest puts it back after this file instead of failing it.
CHANGES_COMPILATION_CACHE = True

# Four chips: the TPU compiler's smallest slice (a data-parallel mesh; each smoke config's batch
# grows to a minibatch of at least one prompt per chip).
SMOKE_TARGETS = ("tpu-v5e-4", "h100-4")
SMOKE_CONFIGS = (("arithmetic", "smoke"), ("tldr", "smoke"), ("hh", "smoke"),
                 ("gsm8k", "smoke"), ("gsm8k", "smoke,lora=4"))
_DEVICES = {}


def _devices(name):
  if name not in _DEVICES:
    _DEVICES[name] = targets.devices(targets.parse(name))
  return _DEVICES[name]


def _algo(config, target):
  devices = _devices(target)
  checked = algorithms.validate(config, devices=devices, with_rewards=False)
  return algorithms.ALGORITHMS["rloo"](experiment.build_abstract(checked.config, devices=devices))


@pytest.mark.parametrize("target", SMOKE_TARGETS)
@pytest.mark.parametrize("name,arg", SMOKE_CONFIGS)
def test_every_smoke_program_compiles_and_fits(name, arg, target):
  config = load_config(arg, name)
  config.mesh.data, config.mesh.fsdp = -1, 1
  config.rloo.num_prompts = max(config.rloo.num_prompts, 4 * config.train.num_minibatches)
  algo = _algo(config, target)
  report = memory.plan(algo, device_memory_gb=targets.parse(target).memory_gb)
  assert report["platform"] == targets.parse(target).platform
  assert set(report["programs"]) == {"update_gradients", "update_apply", "score", "engine"}
  assert all(p["argument_gb"] > 0 for p in report["programs"].values())
  assert report["fits"], report["programs"]


@pytest.mark.parametrize("target", SMOKE_TARGETS)
def test_the_rollout_engine_compiles_and_fits(target):
  """config.rloo.rollout_slots: the plan compiles the engine's start and phase (not the sampler's
  start and decode), and its KV cache is at most the whole slot and prefix pools."""
  config = load_config()
  config.mesh.data, config.mesh.fsdp = -1, 1
  ways = targets.parse(target).chips  # an engine a batch shard, 2 groups' slots for its 4
  config.rloo.rollout_slots, config.rloo.num_prompts = 2 * config.rloo.k * ways, 4 * ways
  report = memory.plan(_algo(config, target), names=("engine",),
                       device_memory_gb=targets.parse(target).memory_gb)
  assert list(report["programs"]) == ["engine"] and report["fits"]
  m, c = config.model, config
  rows = min(sampler_args.default_prefix_rows(c.rloo.rollout_slots, c.rloo.k, ways),
             c.rloo.num_prompts)  # no more prompt rows than prompts
  whole = 2 * m.num_layers * m.num_kv_heads * m.head_dim * 4 * (
      c.rloo.rollout_slots * c.rloo.max_new_tokens + rows * c.data.max_prompt_len)
  # Split over the shards: each device holds its own engine's slots and prefix rows (and their
  # indices and prompt masks, 1% here).
  assert whole / ways <= report["kv_cache_gb"] * memory.GIB <= whole / ways * 1.02


@pytest.mark.parametrize("target,data,tensor", [("tpu-v5e-1", 1, 1), ("tpu-v5e-4", 2, 2)],
                         ids=["one-chip", "data2-tensor2"])
def test_tpu_chips_read_the_engines_pages_in_place_through_the_pallas_kernel(
    monkeypatch, target, data, tensor):
  """The paged engine on TPU: under 'auto' or 'splash' its decode reads each stream's full pages
  where they lie (the Pallas paged kernel, `models.attention_paged`); under 'xla' it gathers
  them. On a mesh each chip calls the kernels on its own engine shard and its share of the kv
  heads, splash's prefill of an admitted prompt included. The kernel's phase holds less than the
  gather's and never a copy of the page pool."""
  compiled, real = [], programs_lib._compile_with  # pylint: disable=protected-access
  monkeypatch.setattr(programs_lib, "_compile_with", lambda lower, options=None: (
      lambda out: (compiled.append(out[0].as_text()), out)[1])(real(lower, options=options)))
  phases = {}
  for route, attention in (("gather", "xla"), ("kernel", "auto" if data == 1 else "splash")):
    config = load_config()
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = data, 1, tensor
    config.model.update(num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                        head_dim=128, intermediate_size=256, max_seq_len=1088,
                        dtype="bfloat16", attention=attention)
    config.data.max_prompt_len = 64
    config.rloo.update(num_prompts=16 * data, max_new_tokens=1024, rollout_slots=32 * data,
                       rollout_pages=192 * data, rollout_page_size=64)
    phases[route] = memory.plan(_algo(config, target), names=("engine",), device_memory_gb=16)
    phases[route]["hlo"] = next(t for t in compiled[::-1] if "jit_phase" in t[:100])
  # A chip's K pages: layers x its kv heads x pages x G x D, bfloat16.
  pool_gb = 2 * (2 // tensor) * 193 * 64 * 128 * 2 / memory.GIB
  kernel, gather = (phases[a]["programs"]["engine"] for a in ("kernel", "gather"))
  assert "tpu_custom_call" in phases["kernel"]["hlo"]
  assert "tpu_custom_call" not in phases["gather"]["hlo"]
  # The donated state comes back laid out as it went in (its KV's heads over 'tensor'): the
  # phase updates it in place.
  assert kernel["alias_gb"] > 0.99 * kernel["output_gb"], kernel
  assert gather["alias_gb"] > 0.99 * gather["output_gb"], gather
  if data == 1:
    assert kernel["temp_gb"] < pool_gb / 2 and kernel["temp_gb"] < gather["temp_gb"] / 2, (
        kernel, gather, pool_gb)
  else:
    # No chip gathers another's streams or pages for its call, and it moves fewer bytes.
    collectives = [re.findall(r"= \S+ (all-\w+|collective-permute|reduce-scatter)\(",
                              phases[a]["hlo"]) for a in ("kernel", "gather")]
    assert sorted(collectives[0]) == sorted(collectives[1]), collectives
    assert "all-gather" not in collectives[0], collectives
    assert "splash_mqa_fwd" in phases["kernel"]["hlo"]  # the admissions' prefill, per chip
    assert kernel["bytes_accessed"] < 0.9 * gather["bytes_accessed"], (kernel, gather)


def test_a_program_the_tpu_compiler_refuses_is_planned_as_not_fitting():
  """The TPU compiler refuses to compile a program whose temporaries alone exceed the chip's
  memory (RESOURCE_EXHAUSTED); the plan reports it as not fitting, with those temporaries and
  its advice, instead of failing with a traceback."""
  config = load_config()
  config.mesh.data = config.mesh.fsdp = 1
  config.model.update(hidden_size=1024, intermediate_size=8192, num_heads=8, num_kv_heads=8,
                      head_dim=128, max_seq_len=640, dtype="bfloat16")
  config.data.max_prompt_len, config.rloo.max_new_tokens = 64, 512
  config.rloo.num_prompts = 256
  report = memory.plan(_algo(config, "tpu-v5e-1"), names=("update",), device_memory_gb=16)
  refused = report["programs"]["update_gradients"]
  assert not report["fits"] and refused["temp_gb"] > 16 and refused["argument_gb"] == 0, refused
  assert any("microbatch" in a for a in report["advice"]), report["advice"]


def _qwen_1p5b(target):
  """Qwen2.5-1.5B, one layer, 64 prompts x 4 x (256 + 256), FSDP over 8: the job whose gradient
  program the H100 compiler refused with its default Triton GEMM (platform.GPU_COMPILER_OPTIONS)."""
  config = load_config("", "arithmetic")
  config.model.preset, config.model.dtype = "qwen2.5-1.5b", "bfloat16"
  config.rloo.num_prompts, config.rloo.k = 64, 4
  config.data.max_prompt_len = config.rloo.max_new_tokens = 256
  config.mesh.data, config.mesh.fsdp = 1, 8
  devices = _devices(target)
  checked = algorithms.validate(config, devices=devices, with_rewards=False)
  exp = experiment.build_abstract(checked.config, devices=devices, num_layers=1)
  algo = algorithms.ALGORITHMS["rloo"](exp)
  x = programs_lib.inputs(exp)
  return algo, x


def test_the_h100_compiles_the_qwen_gradient_program_only_without_triton_gemm():
  algo, x = _qwen_1p5b("h100-8")
  lowered = algo.step_fn.lower(x.state, x.minibatch)["update_gradients"]
  assert lowered.compile().memory_analysis().temp_size_in_bytes > 0
  # The same program with the GPU compiler's default GEMM emitter: the failure the option avoids.
  with pytest.raises(Exception, match="tile sizes"):
    lowered.compile(compiler_options={"xla_gpu_enable_triton_gemm": True})


@pytest.mark.parametrize("target", ("h100-8", "tpu-v5p-8"))
def test_the_optimizer_program_updates_the_donated_state_in_place(target):
  algo, x = _qwen_1p5b(target)
  grads_lowered = algo.step_fn.lower(x.state, x.minibatch)["update_apply"]
  stats = grads_lowered.compile().memory_analysis()
  state = sum(per_device_bytes(getattr(x.state, p)) for p in ("params", "opt_state"))
  # No second copy of params and moments (a cond's branches held one: 0.69 GiB here on H100).
  assert stats.temp_size_in_bytes < state / 4, (stats.temp_size_in_bytes, state)
  assert stats.alias_size_in_bytes >= state * 0.99


def _flash_config(attention, monkeypatch):
  """The smoke GSM8K config with `attention`, 'auto''s flash length lowered to its rows."""
  from rloo_jax.models import attention_ops  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(attention_ops, "AUTO_BLOCKWISE_MIN_TOKENS", 8)
  config = load_config("smoke", "gsm8k")
  config.model.attention = attention
  config.model.update(num_heads=4, num_kv_heads=2, head_dim=32)
  config.rloo.num_prompts = max(config.rloo.num_prompts, 4 * config.train.num_minibatches)
  return config


def _assert_kernel_in_programs_and_fits(config, target, call):
  """The grouped update and the scoring pass, traced for the target's mesh, hold the kernel's
  custom call `call`; the whole plan fits."""
  from rloo_jax.models import traced_mesh  # pylint: disable=import-outside-toplevel
  algo = _algo(config, target)
  x = programs_lib.inputs(algo.exp)
  with traced_mesh.on_mesh(algo.exp.layout.mesh):
    update = algo.step_fn.lower(x.state, x.minibatch)["update_gradients"].compile()
    score = algo.reference_fn.lower(x.state.ref_params, x.rows).compile()
  for compiled in (update, score):
    assert call in compiled.as_text()
  report = memory.plan(algo, device_memory_gb=targets.parse(target).memory_gb)
  assert report["fits"], report["programs"]


@pytest.mark.parametrize("attention,mesh", [("splash", (2, 1, 2)), ("auto", (1, 4, 1))])
def test_splash_attention_compiles_to_the_tpu_kernel_per_shard(attention, mesh, monkeypatch):
  """config.model.attention='splash' (and 'auto' on a TPU, its flash length lowered to the smoke
  rows): the grouped update and the scoring pass compile for a TPU topology with the Pallas
  kernel (Mosaic's custom call) in them, run per shard (data and tensor, or fsdp), and fit."""
  config = _flash_config(attention, monkeypatch)
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = mesh
  _assert_kernel_in_programs_and_fits(config, "tpu-v5e-4", "tpu_custom_call")


@pytest.mark.parametrize("attention", ["cudnn", "auto"])
def test_cudnn_attention_compiles_for_the_h100_in_bfloat16(attention, monkeypatch):
  """config.model.attention='cudnn' (and 'auto' on a GPU, its flash length lowered to the smoke
  rows): the grouped update and the scoring pass, bfloat16, compile for the H100 with cuDNN's
  fused attention (its custom call) in them, and fit."""
  config = _flash_config(attention, monkeypatch)
  config.model.dtype = "bfloat16"
  config.mesh.data, config.mesh.fsdp = -1, 1
  _assert_kernel_in_programs_and_fits(config, "h100-4", "__cudnn$fmha")


@pytest.mark.parametrize("m,window", [(1, None), (2, None), (2, 300), (3, 300)])
def test_the_splash_group_mask_lowers_to_mosaic_for_any_completions_a_row(m, window):
  """The grouped rows' static mask is evaluated inside the TPU kernel: it must lower for one,
  two (where comparing completion indices made an i1 compare Mosaic refused) and more
  completions a row, windowed or not, values and gradients."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from jax.sharding import Mesh, NamedSharding, PartitionSpec  # pylint: disable=import-outside-toplevel
  from rloo_jax.models import attention_ops, traced_mesh  # pylint: disable=import-outside-toplevel
  mesh = Mesh(np.asarray(_devices("tpu-v5e-4")).reshape(4, 1, 1), ("data", "fsdp", "tensor"))
  b, p, t, h, g, d = 4, 200, 600, 2, 2, 128
  rows = p + m * t

  def loss(q, k, v):
    layout = attention_ops.PromptGroup(jnp.ones((b, p), bool), jnp.ones((b, m, t), bool),
                                       jnp.zeros((b, rows), jnp.int32))
    spec = attention_ops.AttentionSpec(layout, d ** -0.5, 0.0, window and jnp.int32(window),
                                       "splash", window or 0)
    return jnp.sum(attention_ops.attend(q, k, v, spec).astype(jnp.float32))

  arg = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16,  # noqa: E731
                                            sharding=NamedSharding(mesh, PartitionSpec("data")))
  with traced_mesh.on_mesh(mesh):
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(
        arg(b, rows, h, g, d), arg(b, rows, h, d), arg(b, rows, h, d)).compile()
  assert "tpu_custom_call" in compiled.as_text()


def test_the_prefill_of_one_prompt_keeps_the_h100_head_in_bfloat16():
  """The engine prefills one prompt an admission. One row's head is a vector-matrix product,
  for which the GPU compiler converts the whole [E, V] head to float32 (Qwen3-8B: 2.32 GiB in
  the engine's loop); the prefill runs its head on two rows (`transformer._last_valid`)."""
  device = jax.sharding.SingleDeviceSharding(_devices("h100-1")[0])
  config = models.TransformerConfig.qwen2(
      vocab_size=151936, hidden_size=1536, num_layers=1, num_heads=12, num_kv_heads=2,
      head_dim=128, intermediate_size=256, max_seq_len=128, dtype="bfloat16",
      param_dtype="bfloat16")
  graphdef, params = models.abstract(config)
  fns = models.model_fns(graphdef)
  on = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=device)  # noqa: E731
  params = jax.tree.map(lambda x: on(x.shape, x.dtype), params)
  f32_head = re.compile(r"f32\[(1536,151936|151936,1536)\]")
  tokens, mask = on((1, 64), jnp.int32), on((1, 64), bool)
  prefill = jax.jit(fns.prefill).lower(params, tokens, tokens, mask).compile().as_text()
  assert not f32_head.search(prefill)
  # The compiler's conversion itself, on one row's head.
  one_row = jax.jit(fns.head).lower(fns.head_params(params), on((1, 1, 1536), jnp.bfloat16))
  assert f32_head.search(one_row.compile().as_text())


@pytest.mark.parametrize("layers", ["scanned", "unstacked"])
def test_the_gpu_engine_phase_keeps_the_prefix_pool_in_its_layout(layers, monkeypatch):
  """A streamed engine admits groups inside its decode loop, writing each prompt's rows into the
  prefix pool. The rows come in the layout the prefill's matmuls gave them; written as they
  came, they pulled the whole pool into it inside the loop, and the H100 compiler copied the
  pool in and out of that layout at every decode step (veRL's 256-prompt chunks: 0.88 GiB each
  for K and V). Every array of the pool's dimensions is now the pool itself, row-major."""
  config = load_config()
  config.mesh.data, config.mesh.fsdp = -1, 1
  config.model.update(num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32, dtype="bfloat16")
  config.data.max_prompt_len, config.rloo.decode_layers = 24, layers
  ways = targets.parse("h100-4").chips
  config.rloo.num_prompts, config.rloo.rollout_chunk_prompts = 4 * ways, 2 * ways  # streamed
  compiled = []
  real = programs_lib._compile_with  # pylint: disable=protected-access

  def spy(lower, options=None):
    program, seconds = real(lower, options=options)
    compiled.append(program)
    return program, seconds

  monkeypatch.setattr(programs_lib, "_compile_with", spy)
  memory.plan(_algo(config, "h100-4"), names=("engine",),
              device_memory_gb=targets.parse("h100-4").memory_gb)
  phase = next(p.as_text() for p in compiled if "jit_phase" in p.as_text()[:100])
  m, p = config.model, config.data.max_prompt_len
  rows = sampler_args.engine_slots(config.rloo, ways)[1] // ways
  lead = (m.num_layers,) if layers == "scanned" else ()  # unstacked: a pool a layer
  pools = {lead + (rows, m.num_kv_heads, m.head_dim, p),  # K, then V
           lead + (rows, m.num_kv_heads, p, m.head_dim)}

  def physical(dims, layout):  # sizes major to minor, size-1 axes (bitcasts) left out
    return tuple(dims[i] for i in reversed(layout) if dims[i] != 1)

  found = {physical(tuple(map(int, d.split(","))), tuple(map(int, lay.split(","))))
           for d, lay in re.findall(r"[a-z]+[0-9]*\[([0-9,]+)\]\{([0-9,]+)\}", phase)
           if sorted(int(x) for x in d.split(",") if x != "1") == sorted(next(iter(pools)))}
  assert found == pools, found

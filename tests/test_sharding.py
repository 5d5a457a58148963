"""Sharded training on simulated CPU devices: meshes, cross-mesh checkpoints, two processes.

XLA_FLAGS=--xla_force_host_platform_device_count=8 must be set before jax starts, so the
multi-device work runs in subprocesses: one worker (this file, run as a script) trains on every
mesh and writes what it measured as JSON, which the tests below check. That keeps the compiles to
one per (mesh, program), the cost that dominates on CPU.
"""
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import REPO, free_port, load_config, run_processes

MESHES = [(8, 1, 1), (2, 4, 1), (1, 2, 4), (2, 2, 2)]
# Metrics that must agree across meshes (timings and throughputs excluded).
COMPARED = ("loss", "grad_norm", "kl", "reward_mean", "reward_std", "penalised_reward",
            "advantage_mean", "advantage_std", "completion_length", "entropy", "clip_fraction")


def length_reward(prompts, completions, **fields):
  """A reward with spread inside every group (an untrained model never gets sums right)."""
  del prompts, fields
  return [float(len(c) % 4) + 0.25 * c.count("1") for c in completions]


def mesh_config(mesh=(1, 1, 1)):
  """The smoke config with dims that the test meshes divide (kv heads and the 15-token vocab
  deliberately not: those dimensions must fall back to replication)."""
  c = load_config()
  with c.unlocked():
    c.model.update(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64)
    c.rloo.update(num_prompts=8, k=2)
    c.rewards.fns = [length_reward]
    c.rewards.weights = [1.0]
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = mesh
  return c


# ----------------------------------------------------------------------------------------------
# The worker (runs with 8 simulated devices)


def _host(tree):
  import jax
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _max_diff(a, b):
  return max(float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64)), initial=0.0))
             for x, y in zip(a, b))


def _metric_diffs(m, ref):
  return {k: abs(m[k] - ref[k]) / max(1.0, abs(ref[k])) for k in COMPARED if k in ref}


def mesh_worker(workdir: str) -> dict:
  import jax
  from rloo_jax import experiment, models, sharding
  from rloo_jax.algorithms.rloo import RLOO
  from rloo_jax.checkpoint import Checkpointer
  from rloo_jax.data import pipeline
  assert jax.device_count() == 8, jax.devices()
  t_start = time.time()
  exp1 = experiment.build(mesh_config(), workdir, devices=jax.devices()[:1])
  algo1 = RLOO(exp1)
  task = exp1.task
  params0 = jax.device_get(models.create(exp1.model_config, seed=3)[1])
  data = pipeline.prompt_batches(task.train, task.tokenizer, global_batch_size=8,
                                 max_prompt_len=exp1.config.data.max_prompt_len, seed=0)
  batch1, batch2 = next(data), next(data)

  state, ref_m1 = algo1.iteration(algo1.init_state(params0), batch1)
  ref_s1 = _host(state)
  state, ref_m2 = algo1.iteration(state, batch2)
  ref_s2 = _host(state)
  out = {"meshes": {}, "restore": {}}
  algos = {}
  ckdir = os.path.join(workdir, "ckpt_2x4x1")
  for mesh in MESHES:
    t0 = time.time()
    algo = algos[mesh] = RLOO(experiment.build(mesh_config(mesh), workdir, task=task))
    state = algo.init_state(params0)
    state, m = algo.iteration(state, batch1)
    emb = state.params["embedding"][...]
    q = state.params["layers"]["attn"]["q_kernel"][...]  # [layers, embed, heads, head_dim]
    out["meshes"][str(mesh)] = dict(
        state_diff=_max_diff(_host(state), ref_s1), metric_diffs=_metric_diffs(m, ref_m1),
        step=int(state.step), seconds=time.time() - t0,
        embedding_spec=str(emb.sharding.spec), q_kernel_spec=str(q.sharding.spec),
        q_kernel_shard=list(q.addressable_shards[0].data.shape), q_kernel_shape=list(q.shape),
        num_devices=len(q.sharding.device_set),
        param_bytes_per_device=sharding.per_device_bytes(state.params),
        param_bytes_total=int(sum(x.nbytes for x in jax.tree.leaves(state.params))))
    if mesh == (2, 4, 1):
      ckpt = Checkpointer(ckdir)
      ckpt.save(1, state, {"data": "batch1"}, force=True)
      ckpt.close()

  # FSDP with the decode on layers gathered once a rollout (`models.decode_weights`): the
  # decode then gathers nothing per token, and draws what the scan does.
  c = mesh_config((2, 4, 1))
  with c.unlocked():
    c.rloo.decode_layers = "unstacked"
  algo = RLOO(experiment.build(c, workdir, task=task))
  state, m = algo.iteration(algo.init_state(params0), batch1)
  out["unstacked_fsdp"] = dict(state_diff=_max_diff(_host(state), ref_s1),
                               metric_diffs=_metric_diffs(m, ref_m1))

  # Packed updates over (2, 4, 1): eight packed rows a microbatch, one a device, and the
  # reference pass packed too; the same iteration as the unpacked one-device run.
  c = mesh_config((2, 4, 1))
  with c.unlocked():
    c.train.microbatch_tokens = c.data.max_prompt_len - 1 + c.rloo.max_new_tokens
  algo = RLOO(experiment.build(c, workdir, task=task))
  state, m = algo.iteration(algo.init_state(params0), batch1)
  out["packed"] = dict(state_diff=_max_diff(_host(state), ref_s1),
                       metric_diffs=_metric_diffs(m, ref_m1))

  # A microbatch of 4 groups over 8 batch shards, traced for the mesh as a run's programs are:
  # each group's 2 completions over 2 grouped rows, one a device; the same iteration.
  from rloo_jax.models import traced_mesh  # pylint: disable=import-outside-toplevel
  c = mesh_config((8, 1, 1))
  with c.unlocked():
    c.train.microbatch_size = 4
  algo = RLOO(experiment.build(c, workdir, task=task))
  with traced_mesh.on_mesh(algo.exp.layout.mesh):
    grouped = jax.make_jaxpr(algo.exp.fns.grouped)(
        state.params, *(np.zeros(s, np.int32) for s in ((4, 8),) * 2), np.ones((4, 8), bool),
        *(np.zeros((8, 3), np.int32),) * 2, np.ones((8, 3), bool))
    state, m = algo.iteration(algo.init_state(params0), batch1)
  out["split_groups"] = dict(state_diff=_max_diff(_host(state), ref_s1),
                             metric_diffs=_metric_diffs(m, ref_m1),
                             eight_prompt_rows="i32[8,8]" in str(grouped))

  # The rollout engine over (2, 4, 1): eight batch shards, an engine of 2 slots on each; the
  # iteration is the static sampler's on one device, and no device holds another's slots.
  c = mesh_config((2, 4, 1))
  with c.unlocked():
    c.rloo.rollout_slots = 16
  algo = RLOO(experiment.build(c, workdir, task=task))
  state, m = algo.iteration(algo.init_state(params0), batch1)
  from rloo_jax import engine  # pylint: disable=import-outside-toplevel
  prompts = np.zeros((8, c.data.max_prompt_len), np.int32) + 3
  st = engine.start(algo.exp.fns, state.params, algo.exp.layout.shard_batch(prompts),
                    algo.exp.layout.shard_batch(np.full((8,), 4, np.int32)),
                    jax.random.key(0), jax.numpy.asarray([1]), jax.numpy.int32(0), k=2,
                    max_new_tokens=c.rloo.max_new_tokens, method=algo.exp.method, slots=16,
                    prefix_rows=8, batch_sharding=algo.exp.layout.batch_sharding)
  out["engine"] = dict(state_diff=_max_diff(_host(state), ref_s1),
                       metric_diffs=_metric_diffs(m, ref_m1),
                       kv_shard=list(st.cache.k_lbkhdt.addressable_shards[0].data.shape),
                       kv_shape=list(st.cache.k_lbkhdt.shape))
  # Paged, each shard's pool one stream at the cap for its 2 slots: streams stall and restart.
  with c.unlocked():
    c.rloo.rollout_page_size = 2
    c.rloo.rollout_pages = 8 * -(-c.rloo.max_new_tokens // 2)
  algo = RLOO(experiment.build(c, workdir, task=task))
  state, m = algo.iteration(algo.init_state(params0), batch1)
  out["paged"] = dict(state_diff=_max_diff(_host(state), ref_s1),
                      metric_diffs=_metric_diffs(m, ref_m1))

  # A checkpoint written on (2, 4, 1) restores onto (8, 1, 1) and onto one device; both continue.
  for name, algo in (("8x1x1", algos[(8, 1, 1)]), ("1 device", algo1)):
    ckpt = Checkpointer(ckdir)
    step, state, meta = ckpt.restore(algo.abstract_state())
    ckpt.close()
    leaf = state.params["layers"]["mlp"]["up_kernel"][...]
    restored_diff = _max_diff(_host(state), ref_s1)
    state, m = algo.iteration(state, batch2)
    out["restore"][name] = dict(
        step=step, meta=meta, restored_diff=restored_diff,
        num_devices=len(leaf.sharding.device_set), spec=str(leaf.sharding.spec),
        continued_diff=_max_diff(_host(state), ref_s2),
        metric_diffs=_metric_diffs(m, ref_m2), final_step=int(state.step))
  out["seconds"] = time.time() - t_start
  return out


# ----------------------------------------------------------------------------------------------
# Helpers for the tests


def _env(devices=None):
  # conftest's PYTHONPATH holds the repo (the mp config's reward is
  # tests.test_sharding:length_reward) and tests/ (that module's `from conftest import ...`).
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  if devices:
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        f" --xla_force_host_platform_device_count={devices}").strip()
  return env


@pytest.fixture(scope="module")
def mesh_results(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("meshes"))
  result = os.path.join(workdir, "result.json")
  proc = subprocess.run([sys.executable, os.path.abspath(__file__), "meshes", workdir, result],
                        env=_env(8), capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-5000:]
  with open(result) as f:
    return json.load(f)


# float32 tolerance: reductions are split differently across devices, nothing else differs.
ATOL = 2e-5
MTOL = 1e-4


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: "x".join(map(str, m)))
def test_one_iteration_matches_one_device(mesh_results, mesh):
  r = mesh_results["meshes"][str(mesh)]
  assert r["num_devices"] == 8 and r["step"] == 1
  assert r["state_diff"] < ATOL, r
  bad = {k: v for k, v in r["metric_diffs"].items() if v > MTOL}
  assert not bad, bad
  data, fsdp, tensor = mesh
  # The parameters really are split: embed over fsdp, q heads over tensor; the stacked layers
  # axis is not split (each device holds its part of every layer).
  num_layers = r["q_kernel_shape"][0]
  assert r["q_kernel_shard"] == [num_layers, 32 // fsdp, 4 // tensor, 8], r
  if fsdp > 1 or tensor > 1:
    assert r["param_bytes_per_device"] < r["param_bytes_total"], r


def test_fsdp_decode_on_layers_gathered_once_matches_one_device(mesh_results):
  r = mesh_results["unstacked_fsdp"]
  assert r["state_diff"] < ATOL, r
  bad = {k: v for k, v in r["metric_diffs"].items() if v > MTOL}
  assert not bad, bad


def test_packed_updates_over_eight_devices_match_one_unpacked_device(mesh_results):
  r = mesh_results["packed"]
  assert r["state_diff"] < ATOL, r
  bad = {k: v for k, v in r["metric_diffs"].items() if v > MTOL}
  assert not bad, bad


def test_fewer_groups_than_batch_shards_split_over_rows_and_match_one_device(mesh_results):
  r = mesh_results["split_groups"]
  assert r["eight_prompt_rows"] and r["state_diff"] < ATOL, r
  bad = {k: v for k, v in r["metric_diffs"].items() if v > MTOL}
  assert not bad, bad


def test_the_rollout_engine_over_eight_shards_matches_the_static_sampler_on_one_device(
    mesh_results):
  r = mesh_results["engine"]
  assert r["state_diff"] < ATOL, r
  bad = {k: v for k, v in r["metric_diffs"].items() if v > MTOL}
  assert not bad, bad
  # [D=8, L, S/D=2, 1, Hkv, D, T] split over the shards: one shard's slots a device.
  assert r["kv_shape"][0] == 8 and r["kv_shard"][0] == 1, r
  r = mesh_results["paged"]  # its KV paged, a pool of one stream's pages on each shard
  assert r["state_diff"] < ATOL, r
  assert not {k: v for k, v in r["metric_diffs"].items() if v > MTOL}, r


def test_checkpoint_restores_onto_another_mesh_and_training_continues(mesh_results):
  for name, r in mesh_results["restore"].items():
    assert r["step"] == 1 and r["meta"] == {"data": "batch1"}, (name, r)
    assert r["restored_diff"] < ATOL, (name, r)  # the (2,4,1) state, bit for bit up to its noise
    assert r["final_step"] == 2, (name, r)
    assert r["continued_diff"] < ATOL, (name, r)
    bad = {k: v for k, v in r["metric_diffs"].items() if v > MTOL}
    assert not bad, (name, bad)
  assert mesh_results["restore"]["8x1x1"]["num_devices"] == 8
  assert mesh_results["restore"]["1 device"]["num_devices"] == 1


_MP_CONFIG = """
import importlib.util
def get_config(arg=None):
  spec = importlib.util.spec_from_file_location("arith", {path!r})
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config("smoke")
  # A reward with spread: with all-zero rewards the update is Adam-normalised float noise.
  c.rewards.fns = ["tests.test_sharding:length_reward"]
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 2, 2, 2
  c.train.eval_samples = 2  # pass@k and maj@k: each process holds its own groups' texts
  return c
"""


def _mp_flags(workdir, config_path):
  return [f"--config={config_path}", f"--workdir={workdir}"]


def test_two_processes_train_and_checkpoint_like_one(tmp_path):
  """Two processes x 4 CPU devices (gloo) vs one process x 8 devices, same global batch."""
  port = free_port()
  mp_dir, sp_dir = str(tmp_path / "two_processes"), str(tmp_path / "one_process")
  config_path = str(tmp_path / "mp_config.py")
  with open(config_path, "w") as f:
    f.write(_MP_CONFIG.format(path=os.path.join(REPO, "configs", "arithmetic.py")))
  train = [sys.executable, "-m", "rloo_jax.train"]
  # Process 1's compilation cache is a directory of its own, as each host's disk would be; moot:
  # XLA:CPU's cache keys differ between processes, so the run turns the cache off and says so.
  env = _env()
  cache = {0: env.pop("JAX_COMPILATION_CACHE_DIR"), 1: str(tmp_path / "process_1_cache")}
  runs = run_processes(
      [train + _mp_flags(mp_dir, config_path) + [
          f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2", f"--process_id={i}",
          "--num_cpu_devices=4", f"--config.train.compilation_cache_dir={cache[i]}"]
       for i in range(2)]
      + [train + _mp_flags(sp_dir, config_path) + [
          "--num_cpu_devices=8", f"--config.train.compilation_cache_dir={cache[0]}"]],
      env=env, cwd=REPO, timeout=900)
  for returncode, log in runs:
    assert returncode == 0, log[-5000:]
  said = "[compile] compilation cache off for this run: the 2 processes' cache keys differ"
  assert said in runs[0][1] and "[compile]" not in runs[1][1] + runs[2][1], runs[0][1][-3000:]
  assert "cannot read the compilation cache" not in runs[0][1]  # off: no cache to share
  assert not os.path.exists(cache[1])  # process 1 never wrote one

  import jax
  from rloo_jax import experiment
  from rloo_jax.checkpoint import Checkpointer
  config = load_config()
  config.rewards.fns = [length_reward]
  states, metas = [], []
  for workdir in (mp_dir, sp_dir):
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["1", "2"]
    exp = experiment.build(config, workdir)  # restores onto this process's one device
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"))
    step, state, meta = ckpt.restore(experiment.abstract_state(exp))
    ckpt.close()
    assert step == 2 and int(state.step) == 2
    states.append([np.asarray(x) for x in jax.tree.leaves(state)])
    metas.append(meta)
  assert metas[0]["data"] == metas[1]["data"]
  assert _max_diff(*states) < 1e-4
  rows = []
  for workdir in (mp_dir, sp_dir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      rows.append([json.loads(l) for l in f if "train/loss" in l])
  assert [r["step"] for r in rows[0]] == [1, 2]  # process 0 logged once
  for a, b in zip(*rows):
    for k in ("train/loss", "train/kl", "train/reward_mean", "train/completion_length"):
      assert abs(a[k] - b[k]) <= 1e-3 * max(1.0, abs(b[k])), (k, a[k], b[k])
  summaries = []
  for workdir in (mp_dir, sp_dir):
    with open(os.path.join(workdir, "summary.json")) as f:
      summaries.append(json.load(f))
  assert summaries[0]["iterations"] == 2
  keys = [k for k in summaries[1]["after"] if k.startswith(("pass@", "maj@"))]
  assert "maj@2" in keys and "pass@2" in keys
  assert {k: summaries[0]["after"][k] for k in keys} == {k: summaries[1]["after"][k] for k in keys}


@pytest.mark.parametrize("mesh, override, message", [
    (dict(data=3), {}, r"config\.mesh \(data=3, fsdp=1, tensor=1\) needs 3 devices but 1 are"),
    (dict(data=-1, fsdp=-1), {}, r"more than one -1"),
    (dict(rules=[("batch", ("data", "fsdp")), ("embed", "model")]), {},
     r"maps 'embed' onto an unknown mesh axis 'model'"),
    (dict(rules=[("hidden", "fsdp")]), {}, r"unknown logical axis 'hidden'"),
])
def test_bad_mesh_config_fails_before_compiling(tmp_path, mesh, override, message):
  from rloo_jax import algorithms
  config = load_config()
  config.mesh.update(mesh)
  start = time.time()
  with pytest.raises(ValueError, match=message):
    algorithms.run(config, str(tmp_path))
  assert time.time() - start < 10
  assert not os.listdir(tmp_path)  # nothing written to the workdir


def test_batch_not_divisible_by_data_parallelism_fails_before_compiling(tmp_path):
  """Checked on a (fake) 8-device layout: batches must split over data x fsdp."""
  from rloo_jax import experiment, sharding
  config = load_config()  # num_prompts = 4, k = 4
  layout = sharding.Layout(
      mesh=type("M", (), {"shape": {"data": 8, "fsdp": 1, "tensor": 1}})(),
      rules=sharding.parse_rules(config.mesh.rules))
  with pytest.raises(ValueError, match=r"config\.rloo\.num_prompts = 4 is not divisible by the "
                                       r"batch parallelism 8 \(mesh axes data x fsdp = 8 x 1\)"):
    experiment.validate_layout(config, layout)
  layout = sharding.Layout(
      mesh=type("M", (), {"shape": {"data": 2, "fsdp": 2, "tensor": 2}})(),
      rules=sharding.parse_rules(config.mesh.rules))
  config.train.num_minibatches = 8  # 16 rows / 8 = minibatches of 2, not divisible by 4
  with pytest.raises(ValueError, match=r"the minibatch .* = 2 is not divisible"):
    experiment.validate_layout(config, layout)


if __name__ == "__main__":
  if sys.argv[1] == "meshes":
    result = mesh_worker(sys.argv[2])
    with open(sys.argv[3], "w") as f:
      json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))

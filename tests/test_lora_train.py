"""LoRA in RLOO training (rloo_jax.adapters): only the adapters train, the reference is the base
with them off, checkpoints hold no base, and a run killed mid-way resumes bit-identical."""

import os
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import REPO, load_config
from rloo_jax import algorithms, loop, rollout
from rloo_jax.algorithms.rloo import RLOO, rollout_rows
from rloo_jax.checkpoint import Checkpointer, leaf_specs
from rloo_jax.models import lora

quiet = lambda *a, **k: None


def lora_smoke(**train):
  c = load_config("smoke")
  c.model.lora.update(rank=4, alpha=8.0, targets="q,v,o,up,down")
  c.train.update(**train)
  return c


@pytest.fixture(scope="module")
def started(tmp_path_factory):
  """An RLOO algorithm with LoRA and its state at iteration 0 on a random base (no SFT)."""
  from rloo_jax import experiment, policy_init  # pylint: disable=import-outside-toplevel
  wd = str(tmp_path_factory.mktemp("lora"))
  algo = RLOO(experiment.build(lora_smoke(), wd))
  state = algo.init_state(policy_init.create_params(algo.exp, seed=3))
  batch = next(loop.prompt_batches(algo.exp))
  return algo, state, batch


def test_the_state_holds_the_base_once_and_the_optimizer_only_adapters(started):
  algo, state, _ = started
  mcfg = algo.exp.model_config
  assert state.lora and mcfg.lora_rank == 4
  adapter_leaves = jax.tree.leaves(state.params)
  assert sum(x.size for x in adapter_leaves) == lora.num_params(mcfg)
  assert sum(x.size for x in jax.tree.leaves(state.ref_params)) == mcfg.num_params
  # AdamW's two moments per adapter leaf, nothing of the base's size.
  moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim]
  assert sum(x.size for x in moments) == 2 * lora.num_params(mcfg)


def test_kl_at_iteration_0_is_exactly_zero(started):
  """The scoring pass's reference (the base, rank-0 model) against the policy's own log-probs
  of the same rows (base + fresh adapters): identical to the last bit, so every KL is 0."""
  algo, state, batch = started
  exp = algo.exp
  out = rollout.rollout(exp, state.policy_params, batch, jax.random.PRNGKey(0), k=algo.k)[0]
  rows = rollout_rows(algo, batch, out)
  chunk = int(exp.config.train.logprob_chunk_size)
  policy_logp = jax.jit(lambda p, r: rollout.logprobs(r, exp.fns, p, chunk_size=chunk)[0])(
      state.policy_params, rows)
  rows = rows.replace(old_logp_nt=policy_logp)
  b = batch["prompt_tokens"].shape[0]
  scored, _ = algo.score_fn(state.ref_params, state.adv_state, rows,
                            jnp.ones((b, algo.k), jnp.float32), jnp.ones((b, algo.k), bool))
  np.testing.assert_array_equal(np.asarray(scored["ref_logp_nt"]), np.asarray(policy_logp))
  assert np.count_nonzero(np.asarray(scored["kl_bk"])) == 0
  assert np.abs(np.asarray(policy_logp)).max() > 0


def test_an_iteration_moves_the_adapters_and_leaves_the_base_bit_identical(started):
  algo, state, batch = started
  base = jax.tree.map(np.asarray, state.ref_params)
  before = jax.tree.map(np.asarray, state.params)
  new, metrics = algo.iteration(jax.tree.map(jnp.copy, state), batch)
  assert metrics["nonfinite_steps"] == 0
  for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(new.ref_params)):
    np.testing.assert_array_equal(a, np.asarray(b))
  # The first step moves every B; A's gradient, s G B^T, is exactly 0 while B is 0.
  after = jax.tree_util.tree_flatten_with_path(new.params)[0]
  for (path, b), a in zip(after, jax.tree.leaves(before)):
    name = jax.tree_util.keystr(path)
    assert np.array_equal(a, np.asarray(b)) == ("_lora_a" in name), name


_TRAIN = textwrap.dedent("""
  import sys
  sys.path.insert(0, {tests!r})
  from test_lora_train import lora_smoke
  from rloo_jax import algorithms
  c = lora_smoke(num_iterations=6, checkpoint_every=1, eval_every=0)
  out = algorithms.run(c, sys.argv[1], log=lambda s: print(s, flush=True))
  print("FINISHED", out["iterations"], flush=True)
""")


def test_checkpoints_hold_no_base_and_resume_after_sigkill_is_bit_identical(tmp_path):
  reference = algorithms.run(lora_smoke(num_iterations=6, checkpoint_every=1, eval_every=0),
                             str(tmp_path / "uninterrupted"), log=quiet)["state"]
  script = tmp_path / "train.py"
  script.write_text(_TRAIN.format(tests=os.path.join(REPO, "tests")))
  wd = str(tmp_path / "killed")
  proc = subprocess.Popen([sys.executable, str(script), wd], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, cwd=REPO)
  lines = []
  for line in proc.stdout:
    lines.append(line)
    if "iteration 3:" in line:
      proc.send_signal(signal.SIGKILL)
      break
  proc.wait(timeout=300)
  assert proc.returncode == -signal.SIGKILL, "".join(lines)
  ck = Checkpointer(os.path.join(wd, "checkpoints"))
  steps = ck.all_steps()
  assert steps and max(steps) < 6
  saved = ck.manager.item_metadata(max(steps))["state"]
  ck.close()
  # The base is a scalar placeholder; the adapters and their moments are all there is.
  specs = leaf_specs(saved)
  assert [v for k, v in specs.items() if k[0] == "ref_params"] == [((), "int8")]
  adapter_bytes = sum(x.nbytes for x in jax.tree.leaves(reference.params))
  saved_bytes = sum(int(np.prod(shape)) * np.dtype(dtype).itemsize
                    for shape, dtype in specs.values())
  # Adapters, two moments, and the scalars (step, rng, counters).
  assert saved_bytes < 3 * adapter_bytes + 1024
  logged = []
  resumed = algorithms.run(lora_smoke(num_iterations=6, checkpoint_every=1, eval_every=0), wd,
                           log=logged.append)
  assert resumed["iterations"] == 6
  # The base comes back from the cached SFT policy, loaded by the loop with the run's log.
  assert any(line.startswith("[sft] restored the cached SFT policy") for line in logged), logged
  state = resumed["state"]
  for name in ("params", "opt_state", "ref_params"):
    for a, b in zip(jax.tree.leaves(getattr(reference, name)),
                    jax.tree.leaves(getattr(state, name))):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_plan_counts_the_base_once_and_only_adapter_moments():
  from rloo_jax import experiment, memory  # pylint: disable=import-outside-toplevel
  reports = {}
  for rank in (0, 16):
    c = load_config()
    c.model.update(preset="qwen2.5-0.5b", dtype="bfloat16")
    c.model.lora.rank = rank
    c.rloo.update(num_prompts=2, k=2, max_new_tokens=8)
    algo = RLOO(experiment.build_abstract(c, num_layers=2))
    reports[rank] = memory.plan(algo, names=("update",)), algo.exp.model_config
  (full, _), (low, mcfg) = reports[0], reports[16]
  assert low["lora"] == dict(rank=16, targets=list(lora.TARGETS),
                             adapter_params=lora.num_params(mcfg))
  assert full["lora"] is None
  assert low["ref_gb"] == full["ref_gb"]  # the base, bfloat16, in both
  assert low["params_gb"] * 4 == pytest.approx(lora.num_params(mcfg) * 16 / 2**30)
  assert low["opt_state_gb"] < full["opt_state_gb"] / 20
  assert low["peak_gb_per_device"] < full["peak_gb_per_device"]
  # No weight gradients of the base: the update is 2 forwards plus the attention's third.
  assert low["flops"]["update"] < 0.8 * full["flops"]["update"]

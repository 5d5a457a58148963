"""Nothing lost: the workdir's config, checkpoints, non-finite guards, preemption, locks, and the
bad inputs that must fail before any compile. Each test is a row of docs/RELIABILITY.md."""
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import REPO, load_config
from rloo_jax import algorithms, experiment, loop, optim, rewards, workdir as workdir_lib
from rloo_jax.checkpoint import Checkpointer, CheckpointMismatchError

quiet = lambda *a, **k: None


def smoke(**overrides):
  c = load_config("smoke")
  with c.unlocked():
    for key, value in overrides.items():
      section, name = key.split(".")
      c[section][name] = value
  return c


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
  """One finished smoke run (2 iterations, a checkpoint each) to restart in many ways."""
  wd = str(tmp_path_factory.mktemp("finished"))
  summary = algorithms.run(smoke(), wd, log=quiet)
  return wd, summary


def _copy(src, dst):
  shutil.copytree(src, dst)
  for name in os.listdir(dst):  # a copy is a new run's workdir: no live lock in it
    if name.startswith(workdir_lib.LOCK_FILE):
      os.remove(os.path.join(dst, name))
  return str(dst)


def _listing(wd):
  return sorted(os.path.relpath(os.path.join(r, f), wd) for r, _, fs in os.walk(wd) for f in fs)


# ----------------------------------------------------------------------------------------------
# A workdir that knows its config


@pytest.mark.parametrize("override,key", [({"model.hidden_size": 64}, "model.hidden_size"),
                                          ({"rloo.k": 2}, "rloo.k"),
                                          ({"advantage.estimator": "grpo"},
                                           "advantage.estimator")])
def test_changed_config_on_resume_is_refused_and_nothing_moves(finished, tmp_path, override,
                                                               key):
  wd = _copy(finished[0], tmp_path / "wd")
  before = _listing(wd)
  with pytest.raises(workdir_lib.ConfigMismatchError, match=rf"config\.{key}: .* in the workdir"):
    algorithms.run(smoke(**override), wd, log=quiet)
  assert _listing(wd) == before  # nothing moved, nothing written
  assert not os.path.exists(os.path.join(wd, "checkpoints_corrupt"))


def test_resumable_setting_changes_continue_the_run(finished, tmp_path):
  wd = _copy(finished[0], tmp_path / "wd")
  logs = []
  out = algorithms.run(smoke(**{"train.num_iterations": 3}), wd, log=logs.append)
  assert out["iterations"] == 3
  assert any("resumed from iteration 2" in line for line in logs)
  steps = [r["step"] for r in map(json.loads, open(os.path.join(wd, "metrics.jsonl")))
           if any(k.startswith("train/") for k in r)]
  assert steps == [1, 2, 3]  # each step once after the resume


def test_run_config_records_versions(finished):
  saved = json.load(open(os.path.join(finished[0], workdir_lib.CONFIG_FILE)))
  assert saved["config"]["rloo.k"] == 4 and saved["versions"]["jax"] == jax.__version__


# ----------------------------------------------------------------------------------------------
# Checkpoints: quarantine only what cannot be read, keep earlier quarantined copies


def _tree(n):
  return {"w": jnp.arange(n, dtype=jnp.float32), "step": jnp.zeros((), jnp.int32)}


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def test_unreadable_checkpoints_are_quarantined_and_earlier_copies_kept(tmp_path):
  d = str(tmp_path / "checkpoints")
  for attempt in range(2):
    ck = Checkpointer(d, keep=3)
    ck.save(1, _tree(3), {"i": 1}, force=True)
    ck.save(2, _tree(3), {"i": 2}, force=True)
    ck.close()
    shutil.rmtree(os.path.join(d, "2", "state"))  # step 2 unreadable
    ck = Checkpointer(d, keep=3)
    step, state, meta = ck.restore(_abstract(_tree(3)))
    ck.close()
    assert step == 1 and meta == {"i": 1}
    # the next attempt overwrites step 2 again: the first quarantined copy survives
    shutil.rmtree(os.path.join(d, "1"))
  assert sorted(os.listdir(str(tmp_path / "checkpoints_corrupt"))) == ["2", "2.1"]


def test_a_readable_checkpoint_of_another_shape_is_an_error_not_corruption(tmp_path):
  d = str(tmp_path / "checkpoints")
  ck = Checkpointer(d)
  ck.save(1, _tree(3), {}, force=True)
  ck.close()
  ck = Checkpointer(d)
  with pytest.raises(CheckpointMismatchError, match=r"w: \(\(3,\), 'float32'\) in the checkpoint, "
                                                    r"\(\(5,\), 'float32'\) wanted"):
    ck.restore(_abstract(_tree(5)))
  ck.close()
  assert os.path.isdir(os.path.join(d, "1")) and not os.path.exists(d + "_corrupt")


def test_keep_checkpoints_zero_is_refused():
  with pytest.raises(ValueError, match=r"config.train.keep_checkpoints = 0 must be >= 1"):
    experiment.validate_config(smoke(**{"train.keep_checkpoints": 0}))


# ----------------------------------------------------------------------------------------------
# Non-finite guard


def test_a_non_finite_step_leaves_params_and_adam_state_unchanged():
  tx = optax.adam(1e-2)
  params = {"w": jnp.ones(3)}
  opt_state = tx.init(params)
  p1, s1, m = optim.apply_if_finite(tx, {"w": jnp.ones(3)}, opt_state, params, jnp.float32(1.0))
  assert float(m["nonfinite_steps"]) == 0 and not np.array_equal(p1["w"], params["w"])
  for grads, value in (({"w": jnp.array([1.0, jnp.nan, 0.0])}, jnp.float32(1.0)),
                       ({"w": jnp.ones(3)}, jnp.float32(jnp.inf))):
    p2, s2, m = optim.apply_if_finite(tx, grads, s1, p1, value)
    assert float(m["nonfinite_steps"]) == 1
    np.testing.assert_array_equal(p2["w"], p1["w"])
    for a, b in zip(jax.tree.leaves(s2), jax.tree.leaves(s1)):
      np.testing.assert_array_equal(a, b)


def test_exploding_learning_rate_stops_with_an_error_and_keeps_finite_checkpoints(tmp_path):
  wd = str(tmp_path / "wd")
  c = smoke(**{"optim.learning_rate": 1e38, "optim.max_grad_norm": 0.0,
               "train.num_iterations": 8, "train.max_nonfinite_steps": 2})
  with pytest.raises(optim.NonFiniteError, match=r"non-finite|not saved"):
    algorithms.run(c, wd, log=quiet)
  exp = experiment.build(c, wd)
  ck = Checkpointer(os.path.join(wd, "checkpoints"))
  steps = ck.all_steps()
  assert steps, "the last finite checkpoint must survive"
  for s in steps:
    _, state, _ = ck.restore(experiment.abstract_state(exp), step=s)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state.params))
  ck.close()


def test_all_unscorable_rewards_stop_the_run_naming_the_reward(tmp_path):
  rewards = tmp_path / "nan_reward.py"
  # Scores the dry run's reference answers, then nothing the policy writes.
  rewards.write_text("import numpy as np\n"
                     "calls = []\n"
                     "def never(prompts, completions, **fields):\n"
                     "  calls.append(1)\n"
                     "  return np.full(len(completions), 0.0 if len(calls) == 1 else np.nan)\n")
  c = smoke(**{"train.num_iterations": 6, "train.max_unscorable_iterations": 2})
  sys.path.insert(0, str(tmp_path))
  try:
    c.rewards.fns = ["nan_reward:never"]
    with pytest.raises(loop.UnscorableError, match=r"last 2 iterations.*\['never'\]"):
      algorithms.run(c, str(tmp_path / "wd"), log=quiet)
  finally:
    sys.path.remove(str(tmp_path))


# ----------------------------------------------------------------------------------------------
# Preemption and exceptions

_TRAIN = textwrap.dedent("""
  import sys
  sys.path.insert(0, {tests!r})
  from conftest import load_config
  from rloo_jax import algorithms, train
  c = load_config("smoke")
  c.train.update(num_iterations=6, checkpoint_every=100, eval_every=0)
  out = algorithms.run(c, sys.argv[1], log=lambda s: print(s, flush=True))
  print("PREEMPTED" if out["preempted"] else "FINISHED", out["iterations"], flush=True)
""")


def test_sigterm_finishes_the_iteration_saves_and_resumes_bit_identical(tmp_path):
  script = tmp_path / "train.py"
  script.write_text(_TRAIN.format(tests=os.path.join(REPO, "tests")))
  reference = algorithms.run(_sigterm_config(), str(tmp_path / "uninterrupted"),
                             log=quiet)["state"]
  wd = str(tmp_path / "preempted")
  proc = subprocess.Popen([sys.executable, str(script), wd], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, cwd=REPO)
  lines = []
  for line in proc.stdout:
    lines.append(line)
    if "iteration 2:" in line:  # mid-run: checkpoints are only due at the end
      proc.send_signal(signal.SIGTERM)
  assert proc.wait(timeout=300) == 0, "".join(lines)
  out = "".join(lines)
  assert "SIGTERM: stopped after iteration" in out and "PREEMPTED" in out
  stopped = int(out.split("PREEMPTED")[1].split()[0])
  assert 2 <= stopped < 6
  ck = Checkpointer(os.path.join(wd, "checkpoints"))
  assert ck.all_steps() == [stopped]  # saved at the stop, no iteration lost
  ck.close()
  resumed = algorithms.run(_sigterm_config(), wd, log=quiet)
  assert resumed["iterations"] == 6
  for a, b in zip(jax.tree.leaves(reference.params), jax.tree.leaves(resumed["state"].params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _sigterm_config():
  c = load_config("smoke")
  c.train.update(num_iterations=6, checkpoint_every=100, eval_every=0)
  return c


def test_an_exception_mid_run_keeps_the_saves_and_leaves_no_temp_dir(tmp_path):
  reward = tmp_path / "flaky_reward.py"
  # Fails on the third rollout (4 prompts x k = 4 completions), after two saved iterations.
  reward.write_text("import numpy as np\ncalls = [0]\n"
                    "def flaky(prompts, completions, **fields):\n"
                    "  calls[0] += len(set(prompts)) == 4 and len(completions) == 16\n"
                    "  if calls[0] == 3:\n"
                    "    raise RuntimeError('reward server went away')\n"
                    "  return np.zeros(len(completions))\n")
  c = smoke(**{"train.num_iterations": 5, "train.eval_every": 0})
  c.rewards.fns = ["flaky_reward:flaky"]
  sys.path.insert(0, str(tmp_path))
  wd = str(tmp_path / "wd")
  try:
    with pytest.raises(RuntimeError, match="reward function flaky raised RuntimeError: reward "
                                           "server went away") as failure:
      algorithms.run(c, wd, log=quiet)
  finally:
    sys.path.remove(str(tmp_path))
  assert failure.value.resume_from == f"checkpoint 2 in {wd}/checkpoints"
  names = _listing(wd)
  assert not [n for n in names if "orbax-checkpoint-tmp" in n], names
  ck = Checkpointer(os.path.join(wd, "checkpoints"))
  assert ck.all_steps() == [1, 2], "the iterations before the failure were saved"
  ck.close()
  assert not [n for n in os.listdir(wd) if n.startswith(workdir_lib.LOCK_FILE)]


def test_a_hung_reward_stops_at_its_deadline_in_one_line_and_the_checkpoints_survive(
    tmp_path):
  from rloo_jax import cli  # pylint: disable=import-outside-toplevel
  reward = tmp_path / "hung_reward.py"
  # Never returns on the third rollout, after two saved iterations.
  reward.write_text("import time\nimport numpy as np\ncalls = [0]\nstarted = []\n"
                    "def hung(prompts, completions, **fields):\n"
                    "  calls[0] += len(set(prompts)) == 4 and len(completions) == 16\n"
                    "  if calls[0] == 3:\n"
                    "    started.append(time.perf_counter())\n"
                    "    time.sleep(600)\n"
                    "  return np.zeros(len(completions))\n")
  c = smoke(**{"train.num_iterations": 5, "train.eval_every": 0})
  c.rewards.fns, c.rewards.timeout_s = ["hung_reward:hung"], 1.0
  sys.path.insert(0, str(tmp_path))
  wd = str(tmp_path / "wd")
  try:
    import hung_reward  # pylint: disable=import-outside-toplevel
    with pytest.raises(rewards.RewardTimeoutError,
                       match=r"reward function hung did not return within "
                             r"config.rewards.timeout_s=1 s \(scoring a batch of 16") as failure:
      algorithms.run(c, wd, log=quiet)
    waited = time.perf_counter() - hung_reward.started[0]
  finally:
    sys.path.remove(str(tmp_path))
  assert waited < 1.0 + 3.0, waited  # the deadline, plus the save in flight finishing
  ck = Checkpointer(os.path.join(wd, "checkpoints"))
  assert ck.all_steps() == [1, 2]
  zero = rewards.RewardSet([lambda p, comps, **f: np.zeros(len(comps))], [1.0], ["zero"])
  step, _, _ = ck.restore(algorithms.make(c, wd, rewards=zero).abstract_state())
  assert step == 2
  ck.close()
  # What `python -m rloo_jax.train` prints (exit 1; `RLOO_JAX_TRACEBACK=1` shows the traceback).
  line = cli.error_line("rloo_jax.train", failure.value)
  assert "\n" not in line
  assert line.startswith("rloo_jax.train: error: reward function hung did not return")
  assert line.endswith(f"rerun the same command to resume from checkpoint 2 in {wd}/checkpoints")


RUN_ERRORS = [
    "rewards.RewardTimeoutError('reward function hung did not return within "
    "config.rewards.timeout_s=1 s')",
    "rewards.RewardReturnError(\"reward function odd returned '1.0' (str) for completion 0\")",
    "rewards.RewardFunctionError('reward function flaky raised RuntimeError: gone')",
    "checkpoint.CheckpointSaveError('writing checkpoint 2 to /w failed: No space left on device')",
]


def test_the_train_cli_prints_run_errors_in_one_line_and_exits_1():
  # What `python -m rloo_jax.train` does with each error a run can stop on: its USER_ERRORS
  # handler (imported in a process of its own: train defines absl flags). One process for all
  # four (each was a process of its own, which spent its time importing): _fail's sys.exit(1)
  # is caught and its status printed, and the process's whole stderr is _fail's four lines.
  script = "import sys\nfrom rloo_jax import checkpoint, rewards, train\ncodes = []\n"
  for error in RUN_ERRORS:
    script += (f"e = {error}\ne.resume_from = 'checkpoint 2 in /w/checkpoints'\n"
               "try:\n  try:\n    raise e\n  except train.USER_ERRORS as caught:\n"
               "    train._fail(caught)\nexcept SystemExit as exit_:\n"
               "  codes.append(exit_.code)\n")
  script += "print(codes)\n"
  env = {k: v for k, v in os.environ.items() if k != "RLOO_JAX_TRACEBACK"}
  out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True,
                       env=env, timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip() == str([1] * len(RUN_ERRORS)), (out.stdout, out.stderr[-2000:])
  lines = out.stderr.strip().splitlines()
  assert len(lines) == len(RUN_ERRORS), out.stderr[-2000:]
  for line, error in zip(lines, RUN_ERRORS):
    assert line.startswith("rloo_jax.train: error: "), (line, error)
    assert line.endswith("; rerun the same command to resume from checkpoint 2 in /w/checkpoints")


def test_a_full_disk_while_saving_is_one_line_and_keeps_the_earlier_checkpoints(tmp_path):
  import errno  # pylint: disable=import-outside-toplevel
  from rloo_jax import checkpoint  # pylint: disable=import-outside-toplevel
  ck = checkpoint.Checkpointer(str(tmp_path / "ck"))
  ck.save(1, {"w": jnp.ones(3)}, {}, wait=True)

  def full(*args, **kw):
    raise OSError(errno.ENOSPC, "No space left on device")
  ck.manager.save = full
  with pytest.raises(checkpoint.CheckpointSaveError) as failure:
    ck.save(2, {"w": jnp.ones(3)}, {}, wait=True)
  assert str(failure.value) == (f"writing checkpoint 2 to {tmp_path}/ck failed: No space left on "
                                "device; free space there or rerun with another --workdir "
                                "(earlier checkpoints kept: [1])")
  assert ck.all_steps() == [1]
  ck.close()


# ----------------------------------------------------------------------------------------------
# SFT checkpoints


def test_sft_resumes_from_its_checkpoint_and_falls_back_past_a_corrupt_one(tmp_path):
  c = smoke(**{"sft.checkpoint_every": 5, "train.num_iterations": 0})
  from rloo_jax import policy_init, sft
  wd = str(tmp_path / "wd")
  exp = experiment.build(c, wd)
  full = policy_init.initial_params(exp, log=quiet)
  cache = sft.cache_dir(c, wd)
  assert sorted(int(s) for s in os.listdir(cache) if s.isdigit()) == [15, 20]
  shutil.rmtree(os.path.join(cache, "20"))  # killed before the last save
  shutil.rmtree(os.path.join(cache, "15", "state"))  # and the one before is corrupt
  # keep only 15 (corrupt): the stage must fall back to a fresh start, not crash
  logs = []
  again = policy_init.initial_params(exp, log=logs.append)
  assert not any("resuming" in line for line in logs)
  for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(again)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  shutil.rmtree(os.path.join(cache, "20"))  # now 15 is a good checkpoint: resume from it
  logs = []
  resumed = policy_init.initial_params(exp, log=logs.append)
  assert any("resuming from step 15" in line for line in logs)
  for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(resumed)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _params(wd):
  import rloo_jax
  return jax.tree.leaves(rloo_jax.load_policy(wd).params)


def test_the_reference_is_stored_once_and_old_or_incomplete_workdirs_say_so(finished, tmp_path):
  import orbax.checkpoint as ocp
  from rloo_jax import checkpoint as checkpoint_lib
  from rloo_jax.checkpoint import leaf_specs
  wd = finished[0]
  assert os.path.isdir(os.path.join(wd, checkpoint_lib.REFERENCE_DIR))
  ckpt = Checkpointer(os.path.join(wd, "checkpoints"))
  for step in ckpt.all_steps():  # each checkpoint: a scalar where the reference was
    ref = {k: v for k, v in leaf_specs(ckpt.manager.item_metadata(step)["state"]).items()
           if k[0] == "ref_params"}
    assert ref == {("ref_params",): ((), "int8")}
  ckpt.close()
  # A workdir written before the reference moved out: the reference inside its checkpoint.
  legacy = _copy(wd, tmp_path / "legacy")
  algo = algorithms.make(smoke(), legacy)
  ckpt = Checkpointer(os.path.join(legacy, "checkpoints"))
  step, state, meta = ckpt.restore(algo.abstract_state())
  ckpt.close()
  shutil.rmtree(os.path.join(legacy, "checkpoints"))
  shutil.rmtree(os.path.join(legacy, checkpoint_lib.REFERENCE_DIR))
  ckpt = Checkpointer(os.path.join(legacy, "checkpoints"))
  ckpt.manager.save(step, args=ocp.args.Composite(  # the old form: the reference inside
      state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)
  ckpt.close()
  assert ("ref_params", "embedding", "value") in leaf_specs(
      Checkpointer(os.path.join(legacy, "checkpoints")).manager.item_metadata(step)["state"])
  current = _copy(wd, tmp_path / "current")
  for d in (legacy, current):
    assert algorithms.run(smoke(**{"train.num_iterations": 3}), d, log=quiet)["iterations"] == 3
  assert os.path.isdir(os.path.join(legacy, checkpoint_lib.REFERENCE_DIR))  # written at resume
  for a, b in zip(_params(legacy), _params(current)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # Checkpoints without the reference and no reference/: one line naming the workdir.
  broken = _copy(wd, tmp_path / "broken")
  shutil.rmtree(os.path.join(broken, checkpoint_lib.REFERENCE_DIR))
  with pytest.raises(FileNotFoundError, match=rf"{broken} has checkpoints but no reference/"):
    algorithms.run(smoke(**{"train.num_iterations": 3}), broken, log=quiet)


# ----------------------------------------------------------------------------------------------
# A lock in the workdir


def test_a_second_live_run_is_refused_and_a_stale_lock_taken_over(tmp_path):
  wd = str(tmp_path)
  sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
  try:
    path = os.path.join(wd, f"{workdir_lib.LOCK_FILE}.0")
    with open(path, "w") as f:
      json.dump({"pid": sleeper.pid, "host": os.uname().nodename}, f)
    with pytest.raises(workdir_lib.WorkdirLockedError, match=rf"pid {sleeper.pid}"):
      workdir_lib.Lock(wd).acquire()
  finally:
    sleeper.kill()
    sleeper.wait()
  logs = []
  lock = workdir_lib.Lock(wd, log=logs.append).acquire()
  assert any("stale lock" in line for line in logs)
  assert json.load(open(path))["pid"] == os.getpid()
  lock.release()
  assert not os.path.exists(path)


def test_the_lock_works_where_hard_links_are_refused(tmp_path, monkeypatch):
  def no_links(*args):
    raise PermissionError("hard links not supported")  # gcsfuse and some network filesystems
  monkeypatch.setattr(os, "link", no_links)
  lock = workdir_lib.Lock(str(tmp_path)).acquire()
  path = os.path.join(str(tmp_path), f"{workdir_lib.LOCK_FILE}.0")
  assert json.load(open(path))["pid"] == os.getpid()
  with pytest.raises(workdir_lib.WorkdirLockedError):  # a second process's view: held
    workdir_lib.Lock(str(tmp_path))._check_other({"pid": -2, "host": "x"})  # pylint: disable=protected-access
  lock.release()
  assert os.listdir(str(tmp_path)) == []


def test_an_empty_lock_is_never_taken_over_while_fresh(tmp_path):
  # What a reader saw between an older writer's create and its write: a lock with no pid.
  path = os.path.join(str(tmp_path), f"{workdir_lib.LOCK_FILE}.0")
  open(path, "w").close()
  with pytest.raises(workdir_lib.WorkdirLockedError, match=r"has an unreadable lock .* written "
                                                           r"0 s ago; another run may be starting"):
    workdir_lib.Lock(str(tmp_path)).acquire()
  old = time.time() - 2 * workdir_lib.STALE_UNREADABLE_S
  os.utime(path, (old, old))
  logs = []
  lock = workdir_lib.Lock(str(tmp_path), log=logs.append).acquire()
  assert logs == [f"[workdir] taking over the stale lock of an unreadable lock ({path})"]
  assert json.load(open(path))["pid"] == os.getpid()  # written whole before it was visible
  lock.release()
  assert os.listdir(str(tmp_path)) == []  # no temporary left behind


# ----------------------------------------------------------------------------------------------
# Bad inputs fail before any compile, naming the setting


@pytest.mark.parametrize("override,message", [
    ({"kl.beta": -0.1}, r"config.kl.beta = -0.1 must be >= 0"),
    ({"train.checkpoint_every": 0}, r"config.train.checkpoint_every = 0 must be >= 1"),
    ({"train.log_every": 0}, r"config.train.log_every = 0 must be >= 1"),
    ({"train.num_minibatches": 0}, r"config.train.num_minibatches = 0 must be >= 1"),
    ({"train.keep_checkpoints": 0}, r"config.train.keep_checkpoints = 0 must be >= 1"),
    ({"rloo.temperature": 0}, r"^config.rloo.temperature = 0 samples the same completion k = 4 "
                              r"times, so estimator 'rloo', which compares a prompt's samples, has "
                              r"nothing to compare .*; set --config.rloo.temperature=1.0$"),
    ({"rloo.temperature": -0.5}, r"^config.rloo.temperature = -0.5 must be a finite number >= 0"),
    ({"rloo.top_p": 1.5}, r"^config.rloo.top_p = 1.5 must be in \(0, 1\] \(1: off\); set "
                          r"--config.rloo.top_p=1.0$"),
    ({"rloo.top_k": -1}, r"^config.rloo.top_k = -1 must be an integer >= 0"),
    ({"rloo.temperature": 0.0, "rloo.k": 1, "advantage.estimator": "vanilla", "rloo.top_k": 5},
     r"^config.rloo.temperature = 0 is greedy decoding, which config.rloo.top_k / top_p do not "
     r"change"),
    ({"model.dtype": "fp8"}, r"^config.model.dtype = 'fp8'; supported: \('float32', "),
])
def test_bad_settings_fail_before_anything_runs(tmp_path, override, message):
  wd = str(tmp_path / "wd")
  t0 = time.time()
  with pytest.raises(ValueError, match=message):
    algorithms.run(smoke(**override), wd, log=quiet)
  assert not os.path.exists(os.path.join(wd, "sft")) and time.time() - t0 < 30


def test_a_lora_rank_above_the_layer_sizes_is_refused(tmp_path):
  c = smoke()
  c.model.lora.rank = 1000
  with pytest.raises(ValueError, match=r"^config.model.lora.rank = 1000 exceeds the smaller side "
                                       r"of the 'k' projection, 16 \(hidden size 32\); set "
                                       r"--config.model.lora.rank <= 16$"):
    algorithms.run(c, str(tmp_path / "wd"), log=quiet)


def test_a_prompt_limit_no_record_fits_names_the_setting(tmp_path):
  with pytest.raises(ValueError, match=r"no record of .* fits config.data.max_prompt_len \+ "
                                       r"config.rloo.max_new_tokens = \d+ tokens \(the shortest of "
                                       r"its 256 records needs \d+\); raise "
                                       r"config.data.max_prompt_len$"):
    algorithms.run(smoke(**{"data.max_prompt_len": 1}), str(tmp_path / "wd"), log=quiet)


def test_a_preset_warns_only_about_architecture_settings_the_user_changed(caplog):
  from rloo_jax import config_utils  # pylint: disable=import-outside-toplevel
  c = config_utils.base_config()
  c.model.preset = "qwen2.5-0.5b"
  with caplog.at_level("WARNING"):
    experiment.model_config(c, lambda: 0)
  assert not [r for r in caplog.records if "ignored" in r.getMessage()]
  c.model.hidden_size = 64
  with caplog.at_level("WARNING"):
    experiment.model_config(c, lambda: 0)
  [warning] = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
  assert warning.endswith("ignored: config.model.hidden_size=64 (the preset has 896)")


def test_init_from_without_config_json_names_the_setting(tmp_path):
  (tmp_path / "ckpt").mkdir()
  with pytest.raises(FileNotFoundError, match=r"config.model.init_from=.* has no config.json"):
    experiment.validate_config(smoke(**{"model.init_from": str(tmp_path / "ckpt")}))


def test_a_reward_of_the_wrong_length_fails_before_sft(tmp_path):
  reward = tmp_path / "short_reward.py"
  reward.write_text("def short(prompts, completions, **fields):\n  return [0.0]\n")
  sys.path.insert(0, str(tmp_path))
  c = smoke()
  c.rewards.fns = ["short_reward:short"]
  wd = str(tmp_path / "wd")
  try:
    with pytest.raises(ValueError, match=r"reward function short .*dry run.*expected \(2,\)"):
      algorithms.run(c, wd, log=quiet)
  finally:
    sys.path.remove(str(tmp_path))
  assert not os.path.exists(os.path.join(wd, "sft"))


def test_the_dry_run_says_what_it_calls_and_refuses_a_reward_that_scores_nothing(tmp_path):
  from rloo_jax import tasks  # pylint: disable=import-outside-toplevel
  task = tasks.make(smoke(), str(tmp_path / "data"))
  said = []
  nan = rewards.RewardSet([lambda p, comps, **f: [float("nan")] * len(comps)], [1.0], ["nothing"],
                          timeout_s=5.0)
  with pytest.raises(ValueError, match=r"reward function nothing \(config.rewards.fns\) scored "
                                       r"none of 2 training prompts' reference answers on a dry "
                                       r"run \(all NaN: cannot score\)"):
    experiment.dry_run_rewards(nan, task, log=said.append)
  assert said == ["[rewards] dry run: calling nothing on 2 training prompts (deadline "
                  "config.rewards.timeout_s=5 s)"]
  text = rewards.RewardSet([lambda p, comps, **f: ["1.0"] * len(comps)], [1.0], ["text"])
  with pytest.raises(rewards.RewardReturnError, match=r"reward function text returned '1.0' "
                                                       r"\(str\) for completion 0.*dry run"):
    experiment.dry_run_rewards(text, task, log=said.append)


def test_unknown_config_key_names_the_closest_one_without_a_traceback(tmp_path):
  out = subprocess.run([sys.executable, "-m", "rloo_jax.train",
                        "--config=configs/arithmetic.py:smoke", f"--workdir={tmp_path}",
                        "--config.rloo.kk=2"], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
  assert out.returncode == 1
  assert "unknown config key --config.rloo.kk" in out.stderr
  assert "did you mean --config.rloo.k?" in out.stderr
  assert "Traceback" not in out.stderr

"""The trainer end to end on the shrunk default config, checkpoints, resume, validation, masking."""
import importlib.util
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from rloo_jax import trainer
from rloo_jax.checkpoint import Checkpointer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_config(arg="smoke"):
  spec = importlib.util.spec_from_file_location("arith_cfg", os.path.join(REPO, "configs",
                                                                          "arithmetic.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def quiet(*args, **kwargs):
  del args, kwargs


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("smoke"))
  config = load_config()
  summary = trainer.run(config, workdir, log=quiet)
  return workdir, config, summary


def test_smoke_run_end_to_end(smoke_run):
  workdir, config, summary = smoke_run
  assert summary["iterations"] == config.train.num_iterations == 2
  rows = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
  train_rows = [r for r in rows if "train/loss" in r]
  assert [r["step"] for r in train_rows] == [1, 2]
  for key in ("reward_mean", "reward_std", "kl", "penalised_reward", "advantage_mean",
              "clip_fraction", "entropy", "completion_length", "frac_groups_all_equal",
              "grad_norm", "rollout_tokens_per_s", "update_tokens_per_s", "rollout_s",
              "reference_s", "reward_s", "update_s"):
    assert f"train/{key}" in train_rows[-1], key
  assert all(np.isfinite(r["train/loss"]) for r in train_rows)
  # RLOO advantages of every group sum to zero, so their batch mean is zero.
  assert abs(train_rows[-1]["train/advantage_mean"]) < 1e-5
  evals = [r for r in rows if "eval/greedy_reward" in r]
  assert [r["step"] for r in evals] == [0, 2]
  # Each reward function is also evaluated on its own; with one function at weight 1 they agree.
  for r in evals:
    assert r["eval/greedy_reward/arithmetic_exact_match"] == r["eval/greedy_reward"]
  assert "reward/arithmetic_exact_match" in summary["last_metrics"]
  assert os.listdir(os.path.join(workdir, "tensorboard"))
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["1", "2"]
  assert json.load(open(os.path.join(workdir, "summary.json")))["iterations"] == 2
  # The policy moved away from its reference; the reference did not move.
  state = summary["state"]
  diff = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), state.params, state.ref_params)
  assert max(jax.tree.leaves(diff)) > 0


def test_checkpoint_round_trip_and_resume_is_a_no_op(smoke_run):
  workdir, config, summary = smoke_run
  exp = trainer.build(config, workdir)
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"))
  step, state, meta = ckpt.restore(trainer.abstract_state(exp))
  ckpt.close()
  assert step == 2 and int(state.step) == 2
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(summary["state"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert meta["data"]["step"] == 2 if "step" in meta["data"] else meta["data"]


def test_unreadable_newest_checkpoint_falls_back(smoke_run, tmp_path, capsys):
  workdir, config, _ = smoke_run
  copy = str(tmp_path / "run")
  shutil.copytree(workdir, copy)
  newest = os.path.join(copy, "checkpoints", "2", "state")
  for root, _, files in os.walk(newest):
    for name in files:  # truncate every data file of the newest checkpoint
      open(os.path.join(root, name), "wb").close()
  exp = trainer.build(config, copy)
  ckpt = Checkpointer(os.path.join(copy, "checkpoints"))
  step, state, _ = ckpt.restore(trainer.abstract_state(exp))
  ckpt.close()
  assert step == 1 and int(state.step) == 1
  assert "step 2" in capsys.readouterr().out
  # Nothing is deleted: the bad checkpoint is moved aside, and the rest of the workdir stays.
  assert os.path.isdir(os.path.join(copy, "checkpoints_corrupt", "2"))
  assert os.path.exists(os.path.join(copy, "metrics.jsonl"))


_RESUME_SCRIPT = """
import importlib.util, sys
from rloo_jax import trainer
spec = importlib.util.spec_from_file_location('c', sys.argv[1])
m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
c = m.get_config('smoke')
c.train.num_iterations = int(sys.argv[3])
trainer.run(c, sys.argv[2], log=lambda *a, **k: None)
"""


def test_sigkill_at_a_random_moment_then_resume_is_bit_identical(tmp_path):
  # Enough iterations that a kill within 1 s of the first checkpoint lands mid-run: with
  # explicit shardings nothing recompiles after iteration 1, so an iteration takes ~0.1 s.
  iterations = 30
  config = load_config()
  config.train.num_iterations = iterations
  reference = trainer.run(config, str(tmp_path / "uninterrupted"), log=quiet)["state"]

  workdir = str(tmp_path / "killed")
  cmd = [sys.executable, "-c", _RESUME_SCRIPT, os.path.join(REPO, "configs", "arithmetic.py"),
         workdir, str(iterations)]
  rng = random.Random(1234)
  proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  ckdir = os.path.join(workdir, "checkpoints")
  deadline = time.time() + 300
  while time.time() < deadline and not (os.path.isdir(ckdir) and "1" in os.listdir(ckdir)):
    time.sleep(0.05)
  time.sleep(rng.uniform(0.0, 1.0))
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
  done = sorted(int(s) for s in os.listdir(ckdir) if s.isdigit())
  assert done and done[-1] < iterations
  subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

  exp = trainer.build(config, workdir)
  ckpt = Checkpointer(ckdir)
  step, resumed, _ = ckpt.restore(trainer.abstract_state(exp))
  ckpt.close()
  assert step == iterations
  for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(reference)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("override, message", [
    (dict(rloo=dict(k=1)), r"config\.rloo\.k = 1, but estimator 'rloo' needs k >= 2"),
    (dict(advantage=dict(estimator="rlooo")),
     r"unknown advantage estimator 'rlooo'; registered estimators are \[.*'rloo'"),
    (dict(train=dict(num_minibatches=3)),
     r"num_prompts \* config\.rloo\.k = 16\) is not divisible by config\.train\.num_minibatches"),
    (dict(rloo=dict(max_new_tokens=40)),
     r"max_prompt_len \(16\) \+ config\.rloo\.max_new_tokens \(40\) = 56 exceeds the model context"),
    (dict(model=dict(init_from="/no/such/checkpoint")),
     r"config\.model\.init_from='/no/such/checkpoint' is not a directory"),
    (dict(loss=dict(type="ppo")), r"unknown config\.loss\.type 'ppo'"),
    (dict(rewards=dict(weights=[1.0, 2.0])), r"rewards\.fns has 1 entries but .*weights has 2"),
    (dict(rewards=dict(fns=["rloo_jax.rewards.verifiers:no_such_fn"])), r"no attribute 'no_such_fn'"),
])
def test_config_validation_messages(tmp_path, override, message):
  config = load_config()
  config.update_from_flattened_dict(
      {f"{a}.{b}": v for a, d in override.items() for b, v in d.items()})
  start = time.time()
  with pytest.raises((ValueError, FileNotFoundError), match=message):
    trainer.run(config, str(tmp_path), log=quiet)
  assert time.time() - start < 10  # raised before any data preparation or compile
  assert not os.path.exists(os.path.join(tmp_path, "checkpoints"))


def half_unscorable(prompts, completions, answer=None, **fields):
  """Scores the even samples 1.0, and cannot score the odd ones."""
  return [1.0 if i % 2 == 0 else None for i in range(len(completions))]


def test_unscorable_samples_are_masked_and_counted(tmp_path):
  config = load_config()
  with config.unlocked():
    config.rewards.fns = [half_unscorable]
    config.rewards.weights = [1.0]
  exp = trainer.build(config, str(tmp_path))
  state = trainer.init_state(exp, trainer.transformer.create(exp.model_config)[1])
  from rloo_jax.data import pipeline
  batch = next(pipeline.prompt_batches(exp.task.train, exp.tokenizer, global_batch_size=4,
                                       max_prompt_len=config.data.max_prompt_len))
  state, m = trainer.rl_iteration(exp, state, batch)
  assert m["num_unscorable"] == 8 and m["num_nonfinite"] == 8
  # Two usable samples per group, both rewarded 1.0: equal rewards, so the advantages are only
  # the (float-noise) KL differences between the cached sampler and the reference forward.
  assert m["advantage_abs_max"] < 1e-5 and np.isfinite(m["loss"])
  assert m["frac_groups_all_equal"] == 1.0
  config.rewards.nan_policy = "raise"
  exp = trainer.build(config, str(tmp_path))
  with pytest.raises(ValueError, match=r"8 reward\(s\) are NaN or inf; set config\.rewards\.nan_policy='mask'"):
    trainer.rl_iteration(exp, state, batch)

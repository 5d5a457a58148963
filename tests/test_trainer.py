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
  # Every evaluation reports the greedy win rate against the reference; the SFT policy ties itself.
  assert evals[0]["eval/win_rate_vs_ref"] == 0.5
  assert 0.0 <= evals[-1]["eval/win_rate_vs_ref"] <= 1.0
  assert summary["before"]["win_rate_vs_ref"] == 0.5
  after = json.load(open(os.path.join(workdir, "summary.json")))["after"]
  assert after["win_rate_vs_ref"] == evals[-1]["eval/win_rate_vs_ref"]
  assert after["wins_vs_ref"] + after["ties_vs_ref"] + after["losses_vs_ref"] == after["n_vs_ref"]
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
    (dict(train=dict(num_minibatches=8)),
     r"shared_prefix minibatches whole groups, but config\.rloo\.num_prompts = 4 is not "
     r"divisible by config\.train\.num_minibatches = 8"),
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



def test_shared_prefix_equals_tiled_rows(tmp_path):
  """train.shared_prefix (each prompt computed once for its k samples, in the reference and the
  policy forwards) against k tiled [prompt | completion] rows: one iteration from the same state
  and batch gives the same KL, advantages, loss and gradient norm up to float rounding."""
  config = load_config()
  config.train.num_epochs = 1  # metrics of one step, taken before its update
  from rloo_jax.data import pipeline
  results = {}
  for shared in (True, False):
    config.train.update(shared_prefix=shared, reuse_rollout_activations=shared)
    exp = trainer.build(config, str(tmp_path))
    state = trainer.init_state(exp, trainer.transformer.create(exp.model_config)[1])
    batch = next(pipeline.prompt_batches(exp.task.train, exp.tokenizer, global_batch_size=4,
                                         max_prompt_len=config.data.max_prompt_len))
    _, results[shared] = trainer.rl_iteration(exp, state, batch)
  for key in ("kl", "penalised_reward", "advantage_std", "advantage_abs_max", "loss", "grad_norm",
              "entropy", "reward_mean"):
    np.testing.assert_allclose(results[True][key], results[False][key], rtol=1e-4, atol=1e-6,
                               err_msg=key)
  # Two minibatches of whole groups (2 prompts with their 4 samples each): the epoch's steps run.
  config.train.update(shared_prefix=True, num_minibatches=2)
  exp = trainer.build(config, str(tmp_path))
  state = trainer.init_state(exp, trainer.transformer.create(exp.model_config)[1])
  state, m = trainer.rl_iteration(exp, state, batch)
  assert int(state.opt_state[1][0].count) == 2 and np.isfinite(m["loss"]) and m["grad_norm"] > 0


def test_take_groups_keeps_each_prompt_with_its_samples():
  rows = dict(prompt_tokens=jnp.arange(3)[:, None] * 10, completions=jnp.arange(6)[:, None],
              advantages=jnp.arange(6) * 1.0)
  out = trainer._take_groups(rows, jnp.array([2, 0]), 2)
  np.testing.assert_array_equal(out["prompt_tokens"][:, 0], [20, 0])
  np.testing.assert_array_equal(out["completions"][:, 0], [4, 5, 0, 1])
  np.testing.assert_array_equal(out["advantages"], [4.0, 5.0, 0.0, 1.0])


# ----------------------------------------------------------------------------------------------
# Held-out win rate against the reference (SFT) policy


def text_score(prompts, completions, **fields):
  """A deterministic, spread-out score of the completion's text (ties are rare but possible)."""
  return [float(sum(map(ord, c)) % 7) for c in completions]


def noise(prompts, completions, **fields):
  """Fresh noise on every call: a win rate judged on the weighted sum would not tie with itself."""
  return list(np.random.default_rng().standard_normal(len(completions)))


@pytest.fixture(scope="module")
def tiny_eval(tmp_path_factory):
  config = load_config()
  config.data.update(num_train=64, num_test=12, max_prompt_len=8)
  config.model.update(hidden_size=16, num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=32,
                      max_seq_len=16)
  config.rloo.update(k=2, num_prompts=2, max_new_tokens=4)
  with config.unlocked():
    config.rewards.fns = [text_score, noise]  # the first function is the judge
    config.rewards.weights = [1.0, 1.0]
  exp = trainer.build(config, str(tmp_path_factory.mktemp("win_rate")))
  ref = trainer.transformer.create(exp.model_config, seed=0)[1]
  other = trainer.transformer.create(exp.model_config, seed=1)[1]
  return exp, ref, other


def test_win_rate_of_the_reference_against_itself_is_one_half(tiny_eval, monkeypatch):
  exp, ref, _ = tiny_eval
  calls = []
  real = trainer._eval_pass
  monkeypatch.setattr(trainer, "_eval_pass", lambda *a, **k: calls.append(1) or real(*a, **k))
  ev = lambda params, ref_params: trainer.evaluate(
      exp, params, exp.task.test, jax.random.PRNGKey(0), num_prompts=12, batch_size=4,
      ref_params=ref_params)
  # A copy (another object, as the run loops' donated states hand back) hits the same cache.
  out = ev(ref, jax.tree.map(jnp.copy, ref))
  assert out["win_rate_vs_ref"] == 0.5
  assert out["ties_vs_ref"] == out["n_vs_ref"] == 12
  assert out["wins_vs_ref"] == out["losses_vs_ref"] == 0
  assert len(calls) == 3  # greedy, sampled, and the reference's greedy pass
  out = ev(jax.tree.map(jnp.copy, ref), ref)
  assert out["win_rate_vs_ref"] == 0.5 and len(calls) == 5  # reference scores cached
  assert "win_rate_vs_ref" not in trainer.evaluate(exp, ref, exp.task.test, jax.random.PRNGKey(0),
                                                   num_prompts=12, batch_size=4)


def test_win_rate_of_another_policy_prompt_by_prompt(tiny_eval):
  exp, ref, other = tiny_eval
  out = trainer.evaluate(exp, other, exp.task.test, jax.random.PRNGKey(0), num_prompts=12,
                         batch_size=4, ref_params=ref)
  # By hand: both policies' greedy completions of the same 12 prompts, judged by text_score.
  from rloo_jax import sampling
  from rloo_jax.data import pipeline
  batch = next(pipeline.prompt_batches([exp.task.test[i] for i in range(12)], exp.tokenizer,
                                       global_batch_size=12, max_prompt_len=8, shuffle=False))
  texts = {name: trainer.rollout(exp, p, batch, jax.random.PRNGKey(0), k=1,
                                 method=sampling.Greedy())[2] for name, p in
           (("policy", other), ("ref", ref))}
  a = np.array(text_score(None, texts["policy"]))
  b = np.array(text_score(None, texts["ref"]))
  assert (a != b).any(), "the two random policies should disagree somewhere"
  wins, ties = int((a > b).sum()), int((a == b).sum())
  assert (out["wins_vs_ref"], out["ties_vs_ref"], out["losses_vs_ref"]) == (wins, ties,
                                                                           12 - wins - ties)
  assert out["win_rate_vs_ref"] == pytest.approx((wins + 0.5 * ties) / 12)
  assert out["greedy_reward/text_score"] == pytest.approx(a.mean())

"""The RLOO loop end to end on the shrunk default config, checkpoints, resume, validation,
masking, the row layouts, held-out win rates, and PPO / DPO through the same loop."""
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
import numpy as np
import pytest

from conftest import REPO, count_traces, load_config
from rloo_jax import algorithms, experiment, loop, models, rollout, sampling
from rloo_jax.algorithms.rloo import RLOO
from rloo_jax.checkpoint import Checkpointer
from rloo_jax.data import pipeline
from rloo_jax.evaluation import Evaluator


def quiet(*args, **kwargs):
  del args, kwargs


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("smoke"))
  config = load_config()
  summary = algorithms.run(config, workdir, log=quiet)
  return workdir, config, summary


def test_smoke_run_end_to_end(smoke_run):
  workdir, config, summary = smoke_run
  assert summary["iterations"] == config.train.num_iterations == 2
  assert summary["algorithm"] == "rloo" and summary["initial_policy"] == "SFT"
  assert summary["reward"] == "arithmetic_exact_match"
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
  on_disk = json.load(open(os.path.join(workdir, "summary.json")))
  after = on_disk["after"]
  assert after["win_rate_vs_ref"] == evals[-1]["eval/win_rate_vs_ref"]
  assert after["wins_vs_ref"] + after["ties_vs_ref"] + after["losses_vs_ref"] == after["n_vs_ref"]
  assert "reward/arithmetic_exact_match" in summary["last_metrics"]
  assert os.listdir(os.path.join(workdir, "tensorboard"))
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["1", "2"]
  assert on_disk["iterations"] == 2 and on_disk["algorithm"] == "rloo"
  # The policy moved away from its reference; the reference did not move.
  state = summary["state"]
  diff = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), state.params, state.ref_params)
  assert max(jax.tree.leaves(diff)) > 0


def test_checkpoint_round_trip_and_resume_is_a_no_op(smoke_run):
  workdir, config, summary = smoke_run
  exp = experiment.build(config, workdir)
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"))
  step, state, meta = ckpt.restore(experiment.abstract_state(exp))
  ckpt.close()
  assert step == 2 and int(state.step) == 2
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(summary["state"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # The data position saved with the last checkpoint: the prompt iterator after 2 batches.
  data = loop.prompt_batches(exp)
  assert data.get_state()["step"] == 0
  next(data), next(data)
  assert meta["data"] == data.get_state()
  assert meta["data"]["step"] == 2
  assert meta["before"] == summary["before"]
  # Running again in (a copy of) the finished workdir resumes at the end and trains nothing.
  copy = workdir + "_rerun"
  shutil.copytree(workdir, copy)
  logs = []
  again = algorithms.run(config, copy, log=logs.append)
  assert any("resumed from iteration 2" in str(l) for l in logs)
  assert not any("iteration 1:" in str(l) or "iteration 2:" in str(l) for l in logs)
  assert again["iterations"] == 2 and again["before"] == summary["before"]
  assert again["after"] == summary["after"]


def test_unreadable_newest_checkpoint_falls_back(smoke_run, tmp_path, capsys):
  workdir, config, _ = smoke_run
  copy = str(tmp_path / "run")
  shutil.copytree(workdir, copy)
  newest = os.path.join(copy, "checkpoints", "2", "state")
  for root, _, files in os.walk(newest):
    for name in files:  # truncate every data file of the newest checkpoint
      open(os.path.join(root, name), "wb").close()
  exp = experiment.build(config, copy)
  ckpt = Checkpointer(os.path.join(copy, "checkpoints"))
  step, state, _ = ckpt.restore(experiment.abstract_state(exp))
  ckpt.close()
  assert step == 1 and int(state.step) == 1
  assert "step 2" in capsys.readouterr().out
  # Nothing is deleted: the bad checkpoint is moved aside, and the rest of the workdir stays.
  assert os.path.isdir(os.path.join(copy, "checkpoints_corrupt", "2"))
  assert os.path.exists(os.path.join(copy, "metrics.jsonl"))


_RESUME_SCRIPT = """
import importlib.util, sys
from rloo_jax import algorithms
spec = importlib.util.spec_from_file_location('c', sys.argv[1])
m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
c = m.get_config('smoke')
c.train.update(num_iterations=int(sys.argv[3]), eval_every=int(sys.argv[4]))
algorithms.run(c, sys.argv[2], log=lambda *a, **k: None)
"""


def test_sigkill_at_a_random_moment_then_resume_is_bit_identical(smoke_run, tmp_path):
  # Enough iterations that a kill within 1 s of the first checkpoint lands mid-run: with
  # explicit shardings nothing recompiles after iteration 1, so an iteration takes ~0.1 s.
  # Held-out evaluations every 10 (not the smoke's 2): they read the state, never write it, and
  # 15 of them a run were most of this test's time; two still run between kill and resume.
  iterations, eval_every = 30, 10
  config = load_config()
  config.train.update(num_iterations=iterations, eval_every=eval_every)
  # The reference starts from the smoke run's cached SFT policy and data (keyed on neither the
  # iterations nor evaluations); the killed run trains its own, so SFT must match it too.
  workdir, reference_dir = str(tmp_path / "killed"), str(tmp_path / "uninterrupted")
  for sub in ("sft", "data"):
    shutil.copytree(os.path.join(smoke_run[0], sub), os.path.join(reference_dir, sub))
  logs = []
  reference = algorithms.run(config, reference_dir, log=logs.append)["state"]
  assert any("restored the cached SFT policy" in str(l) for l in logs)

  cmd = [sys.executable, "-c", _RESUME_SCRIPT, os.path.join(REPO, "configs", "arithmetic.py"),
         workdir, str(iterations), str(eval_every)]
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

  exp = experiment.build(config, workdir)
  ckpt = Checkpointer(ckdir)
  step, resumed, _ = ckpt.restore(experiment.abstract_state(exp))
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
    (dict(optim=dict(schedule="linear")),
     r"unknown config\.optim\.schedule 'linear'; choose one of \('constant', 'cosine'\)"),
    (dict(rewards=dict(weights=[1.0, 2.0])), r"rewards\.fns has 1 entries but .*weights has 2"),
    (dict(rewards=dict(fns=["rloo_jax.rewards.verifiers:no_such_fn"])), r"no attribute 'no_such_fn'"),
])
def test_config_validation_messages(tmp_path, override, message):
  config = load_config()
  config.update_from_flattened_dict(
      {f"{a}.{b}": v for a, d in override.items() for b, v in d.items()})
  start = time.time()
  with pytest.raises((ValueError, FileNotFoundError), match=message):
    algorithms.run(config, str(tmp_path), log=quiet)
  assert time.time() - start < 10  # raised before any data preparation or compile
  # Nothing written: not even the workdir's run_config.json, which would make the corrected
  # config a mismatch in the same workdir.
  assert not os.listdir(tmp_path)


def test_unknown_algorithm_is_named(tmp_path):
  config = load_config()
  config.algorithm = "trpo"
  with pytest.raises(ValueError, match=r"unknown config\.algorithm 'trpo'; choose one of "
                                       r"\('rloo', 'ppo', 'dpo'\)"):
    algorithms.run(config, str(tmp_path), log=quiet)
  assert not os.listdir(tmp_path)


def half_unscorable(prompts, completions, answer=None, **fields):
  """Scores the even samples 1.0, and cannot score the odd ones."""
  return [1.0 if i % 2 == 0 else None for i in range(len(completions))]


def _first_batch(exp, n=4):
  return next(pipeline.prompt_batches(exp.task.train, exp.tokenizer, global_batch_size=n,
                                      max_prompt_len=exp.config.data.max_prompt_len))


def test_unscorable_samples_are_masked_and_counted(tmp_path):
  config = load_config()
  with config.unlocked():
    config.rewards.fns = [half_unscorable]
    config.rewards.weights = [1.0]
  exp = experiment.build(config, str(tmp_path))
  algo = RLOO(exp)
  state = algo.init_state(models.create(exp.model_config)[1])
  batch = _first_batch(exp)
  state, m = algo.iteration(state, batch)
  assert m["num_unscorable"] == 8 and m["num_nonfinite"] == 8
  # Two usable samples per group, both rewarded 1.0: equal rewards, so the advantages are only
  # the (float-noise) KL differences between the cached sampler and the reference forward.
  assert m["advantage_abs_max"] < 1e-5 and np.isfinite(m["loss"])
  assert m["frac_groups_all_equal"] == 1.0
  config.rewards.nan_policy = "raise"
  algo = RLOO(experiment.build(config, str(tmp_path)))
  with pytest.raises(ValueError, match=r"8 reward\(s\) are NaN or inf; set config\.rewards\.nan_policy='mask'"):
    algo.iteration(state, batch)


def test_shared_prefix_equals_tiled_rows(tmp_path):
  """train.shared_prefix (each prompt computed once for its k samples, in the reference and the
  policy forwards) against k tiled [prompt | completion] rows: one iteration from the same state
  and batch gives the same KL, advantages, loss and gradient norm up to float rounding."""
  config = load_config()
  config.train.num_epochs = 1  # metrics of one step, taken before its update
  results = {}
  for shared in (True, False):
    config.train.shared_prefix = shared
    exp = experiment.build(config, str(tmp_path))
    algo = RLOO(exp)
    state = algo.init_state(models.create(exp.model_config)[1])
    batch = _first_batch(exp)
    _, results[shared] = algo.iteration(state, batch)
  for key in ("kl", "penalised_reward", "advantage_std", "advantage_abs_max", "loss", "grad_norm",
              "entropy", "reward_mean"):
    np.testing.assert_allclose(results[True][key], results[False][key], rtol=1e-4, atol=1e-6,
                               err_msg=key)
  # Two minibatches of whole groups (2 prompts with their 4 samples each): the epoch's steps run.
  config.train.update(shared_prefix=True, num_minibatches=2)
  exp = experiment.build(config, str(tmp_path))
  algo = RLOO(exp)
  state = algo.init_state(models.create(exp.model_config)[1])
  state, m = algo.iteration(state, batch)
  assert int(state.opt_state[1][0].count) == 2 and np.isfinite(m["loss"]) and m["grad_norm"] > 0


def test_an_experiment_built_again_traces_none_of_its_programs(tmp_path, monkeypatch):
  """`platform.jit`: equal settings give one program object, so a second build of the same
  config (a notebook's second run, a memory plan's candidates) traces nothing again, and a
  changed setting retraces only the programs it enters (kl.beta: the advantages, not the
  gradient)."""
  from rloo_jax import update  # pylint: disable=import-outside-toplevel
  traced = {name: count_traces(monkeypatch, update, name)
            for name in ("gradients", "apply_gradients", "reference_logprobs", "advantages_of",
                         "take_units")}
  config = load_config()
  config.train.num_minibatches = 2  # the minibatch gather runs too

  def iteration():
    exp = experiment.build(config, str(tmp_path))
    algo = RLOO(exp)
    algo.iteration(algo.init_state(models.create(exp.model_config)[1]), _first_batch(exp))
    return algo

  first = iteration()
  once = {name: len(calls) for name, calls in traced.items()}
  assert all(once.values()), once
  again = iteration()
  assert again.step_fn.grad_fn is first.step_fn.grad_fn
  assert {name: len(calls) for name, calls in traced.items()} == once
  config.kl.beta = 2 * config.kl.beta
  iteration()
  assert {name: len(calls) for name, calls in traced.items()} == dict(
      once, advantages_of=2 * once["advantages_of"])


def test_grouped_rows_take_keeps_each_prompt_with_its_samples():
  b, k = 3, 2
  n = b * k
  col = lambda x: jnp.asarray(x)[:, None]
  rows = rollout.GroupedRows(
      prompt_tokens_bp=col(jnp.arange(b) * 10), prompt_positions_bp=col(jnp.arange(b) + 100),
      prompt_mask_bp=col(jnp.arange(b) != 1), completion_positions_nt=col(jnp.arange(n) + 200),
      completions_nt=col(jnp.arange(n)), cmask_nt=col(jnp.arange(n) % 3 != 0),
      old_logp_nt=col(-jnp.arange(n) * 1.0), advantages_n=jnp.arange(n) * 1.0)
  assert rows.num_units == b
  out = rows.take(jnp.array([2, 0]), k)
  assert isinstance(out, rollout.GroupedRows) and out.num_units == 2
  np.testing.assert_array_equal(out.prompt_tokens_bp[:, 0], [20, 0])
  np.testing.assert_array_equal(out.prompt_positions_bp[:, 0], [102, 100])
  np.testing.assert_array_equal(out.prompt_mask_bp[:, 0], [True, True])
  np.testing.assert_array_equal(out.completions_nt[:, 0], [4, 5, 0, 1])
  np.testing.assert_array_equal(out.completion_positions_nt[:, 0], [204, 205, 200, 201])
  np.testing.assert_array_equal(out.cmask_nt[:, 0], [True, True, False, True])
  np.testing.assert_array_equal(out.old_logp_nt[:, 0], [-4.0, -5.0, 0.0, -1.0])
  np.testing.assert_array_equal(out.advantages_n, [4.0, 5.0, 0.0, 1.0])
  # Jitted as the update does (k static), the same gather.
  jitted = jax.jit(lambda r, idx: r.take(idx, k))(rows, jnp.array([2, 0]))
  for a, b_ in zip(jax.tree.leaves(jitted), jax.tree.leaves(out)):
    np.testing.assert_array_equal(a, b_)


def test_make_rows_layouts_agree_and_sequence_rows_take_single_samples():
  """Both layouts from one rollout: the same completions at the same positions; SequenceRows
  rows are [left-padded prompt | completion], and its take() picks single samples."""
  prompt_bp = jnp.array([[5, 6, 0], [7, 0, 0]], jnp.int32)  # right-padded, lengths 2 and 1
  lengths_b = jnp.array([2, 1], jnp.int32)
  comp_nt = jnp.array([[1, 2], [3, 4], [8, 9], [10, 11]], jnp.int32)
  cmask_nt = jnp.array([[True, True], [True, False], [True, True], [False, False]])
  logp_nt = -jnp.arange(8, dtype=jnp.float32).reshape(4, 2)
  g = rollout.make_rows(prompt_bp, lengths_b, comp_nt, cmask_nt, logp_nt, k=2, shared_prefix=True)
  s = rollout.make_rows(prompt_bp, lengths_b, comp_nt, cmask_nt, logp_nt, k=2,
                        shared_prefix=False)
  assert isinstance(g, rollout.GroupedRows) and isinstance(s, rollout.SequenceRows)
  np.testing.assert_array_equal(g.prompt_tokens_bp, [[0, 5, 6], [0, 0, 7]])
  np.testing.assert_array_equal(g.prompt_mask_bp, [[False, True, True], [False, False, True]])
  np.testing.assert_array_equal(g.completion_positions_nt, [[2, 3], [2, 3], [1, 2], [1, 2]])
  np.testing.assert_array_equal(s.tokens_ns[2], [0, 0, 7, 8, 9])
  np.testing.assert_array_equal(s.positions_ns[2], [0, 0, 0, 1, 2])
  np.testing.assert_array_equal(s.mask_ns[1], [False, True, True, True, False])
  np.testing.assert_array_equal(g.advantages_n, np.zeros(4))
  assert s.num_units == 4 and g.num_units == 2
  out = s.take(jnp.array([3, 0]), 2)
  np.testing.assert_array_equal(out.completions_nt, [[10, 11], [1, 2]])
  np.testing.assert_array_equal(out.tokens_ns[0], [0, 0, 7, 10, 11])


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
  exp = experiment.build(config, str(tmp_path_factory.mktemp("win_rate")))
  ref = models.create(exp.model_config, seed=0)[1]
  other = models.create(exp.model_config, seed=1)[1]
  return exp, ref, other


def evaluator(exp):
  return Evaluator(exp, [exp.task.test[i] for i in range(12)], batch_size=4,
                   rng=jax.random.PRNGKey(0))


def test_win_rate_of_the_reference_against_itself_is_one_half(tiny_eval, monkeypatch):
  exp, ref, _ = tiny_eval
  ev = evaluator(exp)
  assert ev.num_prompts == 12 and ev.rewards.first == "text_score"
  calls = []
  real = ev.completions
  monkeypatch.setattr(ev, "completions", lambda *a, **k: calls.append(1) or real(*a, **k))
  # A copy (another object, as the run loops' donated states hand back) hits the same cache.
  out = ev(ref, jax.tree.map(jnp.copy, ref))
  assert out["win_rate_vs_ref"] == 0.5
  assert out["ties_vs_ref"] == out["n_vs_ref"] == 12
  assert out["wins_vs_ref"] == out["losses_vs_ref"] == 0
  # Sampled completions use common random numbers: the reference's samples tie with themselves.
  assert out["sampled_win_rate_vs_ref"] == 0.5 and out["sampled_ties_vs_ref"] == 12
  assert len(calls) == 4  # greedy, sampled, and the reference's greedy and sampled passes
  out = ev(jax.tree.map(jnp.copy, ref), ref)
  assert out["win_rate_vs_ref"] == 0.5 and len(calls) == 6  # reference scores cached
  assert "win_rate_vs_ref" not in ev(ref)
  assert "sampled_win_rate_vs_ref" not in ev(ref)


def test_win_rate_of_another_policy_prompt_by_prompt(tiny_eval):
  exp, ref, other = tiny_eval
  out = evaluator(exp)(other, ref)
  # By hand: both policies' greedy completions of the same 12 prompts, judged by text_score.
  batch = next(pipeline.prompt_batches([exp.task.test[i] for i in range(12)], exp.tokenizer,
                                       global_batch_size=12, max_prompt_len=8, shuffle=False))
  texts = {name: rollout.rollout(exp, p, batch, jax.random.PRNGKey(0), k=1,
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


# ----------------------------------------------------------------------------------------------
# PPO and DPO through the same outer loop


def length_reward(prompts, completions, **fields):
  """A reward with spread among an SFT policy's samples (exact match would tie them all)."""
  del prompts, fields
  return [float(len(c) % 4) + 0.25 * c.count("1") for c in completions]


@pytest.mark.parametrize("name", ["ppo", "dpo"])
def test_ppo_and_dpo_run_through_the_same_loop(smoke_run, tmp_path, monkeypatch, name):
  from rloo_jax.algorithms import dpo, ppo  # pylint: disable=import-outside-toplevel
  smoke_dir, _, rloo_summary = smoke_run
  workdir = str(tmp_path / name)
  os.makedirs(workdir)
  # The SFT fingerprint ignores the algorithm and rewards: reuse the smoke run's policy and data.
  for sub in ("sft", "data"):
    shutil.copytree(os.path.join(smoke_dir, sub), os.path.join(workdir, sub))
  config = load_config()
  config.algorithm = name
  if name == "ppo":
    config.rloo.k = 1  # PPO's usual one sample per prompt
  else:
    with config.unlocked():
      config.rewards.fns = [length_reward]
      config.dpo = dict(steps=2, num_pair_prompts=8, samples_per_prompt=4, batch_size=2,
                        sample_batch_size=8)
  logs = []
  traces = count_traces(monkeypatch, {"ppo": ppo, "dpo": dpo}[name], "train_step")
  summary = algorithms.run(config, workdir, log=logs.append)
  assert any("restored the cached SFT policy" in str(l) for l in logs)
  assert len(traces) == 1, traces  # both iterations run one compiled step
  on_disk = json.load(open(os.path.join(workdir, "summary.json")))
  for s in (summary, on_disk):
    assert s["algorithm"] == name and s["iterations"] == 2 and s["initial_policy"] == "SFT"
    for when in ("before", "after"):
      assert np.isfinite(s[when]["greedy_reward"]), (when, s[when])
      assert 0.0 <= s[when]["win_rate_vs_ref"] <= 1.0
    assert s["before"]["win_rate_vs_ref"] == 0.5  # the SFT start ties itself
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["1", "2"]
  rows = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
  assert [r["step"] for r in rows if "train/loss" in r] == [1, 2]
  assert [r["step"] for r in rows if "eval/greedy_reward" in r][-1] == 2
  if name == "ppo":
    # The same SFT start and held-out evaluation as the RLOO run.
    assert summary["before"]["greedy_reward"] == rloo_summary["before"]["greedy_reward"]
    assert summary["reward"] == "arithmetic_exact_match"
    for key in ("value_loss", "explained_variance", "kl"):
      assert np.isfinite(summary["last_metrics"][key]), key
  else:
    assert summary["reward"] == "length_reward" and summary["num_pairs"] >= 2
    assert os.path.exists(os.path.join(workdir, "dpo_pairs.json"))
    assert np.isfinite(summary["last_metrics"]["dpo_loss"])
  # Its state type round-trips through the loop's checkpoints.
  algo = algorithms.make(config, workdir)
  assert algo.name == name
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"))
  step, state, meta = ckpt.restore(algo.abstract_state())
  ckpt.close()
  assert step == 2 and int(state.step) == 2 and meta["before"] == summary["before"]
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(summary["state"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

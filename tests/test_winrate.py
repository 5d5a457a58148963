"""Pairwise judges (rloo_jax.judges) and the greedy win rate against reference completions at the
best checkpoint (rloo_jax.winrate): the Bradley-Terry judge by hand, custom judges by import path,
NaN handling, bad specs, the best-step rule on a constructed metrics.jsonl, and the command end to
end on a tiny trained workdir."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import load_config
import rloo_jax
from rloo_jax import algorithms, judges, sampling, winrate
from rloo_jax.evaluation import Evaluator

THIS = os.path.abspath(__file__)


def length_score(prompts, completions, *, bonus=None, **fields):
  """A deterministic toy reward: the completion's length, plus the record's `bonus` field (so a
  test sees the fields arrive), NaN for the completion '?'."""
  del prompts, fields
  extra = [0.0] * len(completions) if bonus is None else [float(x) for x in bonus]
  return [float("nan") if c == "?" else float(len(c)) + e for c, e in zip(completions, extra)]


def prefers_shorter(prompts, a, b, **fields):
  """A custom judge: 1 when a is shorter, 0 when longer, 0.5 on equal length, NaN when b is 'x'."""
  del prompts, fields
  return [float("nan") if y == "x" else 0.5 if len(x) == len(y) else float(len(x) < len(y))
          for x, y in zip(a, b)]


def no_fields(prompts, a, b):
  return [0.5] * len(a)


def raw_scores(prompts, a, b, **fields):
  return [3.0] * len(a)


def sigmoid(x):
  return 1.0 / (1.0 + math.exp(-x))


def test_bradley_terry_judge_by_hand():
  judge = judges.resolve_judge(f"reward:{THIS}:length_score")
  assert isinstance(judge, judges.RewardJudge)
  prompts = ["p"] * 4
  same = ["abc", "", "hello world", "x"]
  # Identical completions: exactly one half, whatever their reward.
  p = judges.judge_pairs(judge, prompts, same, same)
  assert p.dtype == np.float64 and (p == 0.5).all()
  p = judges.judge_pairs(judge, prompts, ["abc", "a", "abcdef", "?"], ["a", "abc", "abcdef", "ab"])
  assert p[0] == pytest.approx(sigmoid(2.0), rel=1e-12)
  assert p[1] == pytest.approx(sigmoid(-2.0), rel=1e-12)
  assert p[2] == 0.5 and np.isnan(p[3])  # a NaN score on either side: NaN
  # Fields reach the reward function once per pair, for both sides.
  p = judges.judge_pairs(judge, ["p"] * 2, ["ab", "ab"], ["a", "ab"], {"bonus": np.array([1, 5])})
  assert p[0] == pytest.approx(sigmoid(1.0)) and p[1] == 0.5
  # Extreme differences stay finite probabilities (no overflow).
  p = judges.judge_pairs(judge, ["p"] * 2, ["a" * 900, ""], ["", "a" * 900])
  assert p[0] == pytest.approx(1.0) and 0.0 <= p[1] < 1e-20
  stats = judges.preference_stats([sigmoid(2.0), sigmoid(-2.0), 0.5, np.nan])
  assert (stats["wins"], stats["ties"], stats["losses"], stats["n"]) == (1, 1, 1, 3)
  assert stats["n_unjudged"] == 1 and stats["win_rate"] == pytest.approx(0.5)
  assert stats["mean_p"] == pytest.approx((sigmoid(2.0) + sigmoid(-2.0) + 0.5) / 3)


def test_custom_judge_by_import_path_and_file():
  by_module = judges.resolve_judge("test_winrate:prefers_shorter")
  by_file = judges.resolve_judge(f"{THIS}:prefers_shorter")
  assert by_module is prefers_shorter  # the callable itself, not a wrapper
  assert by_file.__name__ == "prefers_shorter"
  records = [{"prompt": f"q{i}", "answer": ref, "id": str(i)}
             for i, ref in enumerate(["aa", "a", "abc", "x"])]
  out = winrate.win_rate_vs_references(by_file, records, ["a", "aa", "abc", "a"])
  np.testing.assert_array_equal(out["p"][:3], [1.0, 0.0, 0.5])
  assert np.isnan(out["p"][3])
  assert (out["wins"], out["ties"], out["losses"], out["n"], out["n_unjudged"]) == (1, 1, 1, 3, 1)
  assert out["win_rate"] == pytest.approx(0.5) and out["mean_p"] == pytest.approx(0.5)


def test_unjudged_overlong_and_missing_references_are_left_out_and_counted():
  judge = judges.resolve_judge(f"reward:{THIS}:length_score")
  records = [{"prompt": "a", "answer": "xx"}, {"prompt": "b", "answer": "xx"},
             {"prompt": "c", "answer": "xx"}, {"prompt": "d", "answer": ""},
             {"prompt": "e", "answer": "xx"}]
  # Record 1's completion scores NaN, record 2's prompt was over max_prompt_len (None), record 3
  # has no reference; only records 0 and 4 are judged.
  out = winrate.win_rate_vs_references(judge, records, ["xxx", "?", None, "x", "xx"])
  assert out["n"] == 2 and out["n_unjudged"] == 2 and out["n_overlong"] == 1
  assert out["n_no_reference"] == 1
  assert out["p"][0] == pytest.approx(sigmoid(1.0)) and out["p"][4] == 0.5
  assert np.isnan(out["p"][1:4]).all()
  assert out["win_rate"] == pytest.approx(0.75)
  assert out["mean_p"] == pytest.approx((sigmoid(1.0) + 0.5) / 2)
  # Nothing judgeable: NaN win rate and mean, no exception.
  out = winrate.win_rate_vs_references(judge, records[1:2], ["?"])
  assert out["n"] == 0 and out["n_unjudged"] == 1 and np.isnan(out["win_rate"])
  assert np.isnan(out["mean_p"])
  with pytest.raises(ValueError, match=r"no field 'chosen'.*--reference_field=answer"):
    winrate.win_rate_vs_references(judge, records, ["x"] * 5, reference_field="chosen")


@pytest.mark.parametrize("spec, message", [
    ("nonsense", r"judge 'nonsense': expected 'package.module:function'.*'reward:<reward spec>'"),
    ("reward:", r"no reward function after 'reward:'"),
    ("reward_model:/tmp/rm", r"use 'reward:reward_model:/tmp/rm'"),
    ("reward:reward_model:/tmp/rm?bad=1", r"unknown or valueless option 'bad=1'"),
    ("no_such_module_q:judge", r"module 'no_such_module_q' not found"),
    ("reward:no_such_module_q:f", r"judge 'reward:no_such_module_q:f'.*not found"),
    ("test_winrate:missing", r"has no attribute 'missing'"),
    ("test_winrate:no_fields", r"does not take \*\*fields"),
    ("test_winrate:THIS", r"not a callable"),
    ("", r"expected a string or a callable"),
    (3, r"expected a string or a callable"),
])
def test_bad_judge_specs_are_clear_value_errors(spec, message):
  with pytest.raises(ValueError, match=message):
    judges.resolve_judge(spec)


def test_judge_outputs_are_checked():
  with pytest.raises(ValueError, match=r"outside \[0, 1\].*'reward:<reward spec>'"):
    judges.judge_pairs(raw_scores, ["p"], ["a"], ["b"])
  with pytest.raises(ValueError, match=r"returned shape \(1,\); expected \(2,\)"):
    judges.judge_pairs(lambda p, a, b, **f: [0.5], ["p"] * 2, ["a"] * 2, ["b"] * 2)
  p = judges.judge_pairs(lambda p, a, b, **f: [None, np.inf], ["p"] * 2, ["a"] * 2, ["b"] * 2)
  assert np.isnan(p).all()


def _write_metrics(workdir, rows):
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)


def test_best_step_from_logged_metrics(tmp_path):
  workdir = str(tmp_path)
  _write_metrics(workdir, [
      {"step": 0, "eval/greedy_reward": 0.9},  # the initial policy: never checkpointed
      {"step": 1, "train/loss": 0.1}, {"step": 1, "eval/greedy_reward": 0.2},
      {"step": 2, "eval/greedy_reward": 0.7}, {"step": 3, "eval/greedy_reward": None},
      {"step": 4, "eval/greedy_reward": 0.3},
      {"step": 4, "eval/greedy_reward": 0.7},  # a resumed run's rewrite of step 4 wins
      {"step": 5, "eval/greedy_reward": 0.6}])
  rewards = winrate.logged_rewards(workdir)
  assert rewards == {0: 0.9, 1: 0.2, 2: 0.7, 4: 0.7, 5: 0.6}
  # A tie goes to the earliest step.
  got = winrate.choose_step(rewards, [2, 3, 4, 5])
  assert (got["step"], got["greedy_reward"], got["note"]) == (2, 0.7, "")
  # The best step's checkpoint was rotated away: the best of the kept ones, said in the note.
  # Step 2 was rotated away but step 4 logged the same reward: as good, no note.
  got = winrate.choose_step(rewards, [3, 4, 5])
  assert got["step"] == 4 and got["best_logged_step"] == 2 and got["note"] == ""
  got = winrate.choose_step(rewards, [1, 3, 5])
  assert got["step"] == 5 and got["greedy_reward"] == 0.6
  assert "step 2, whose checkpoint was not kept" in got["note"] and "step 5 (0.6000)" in got["note"]
  assert winrate.choose_step(rewards, [1, 3, 5], "latest")["step"] == 5
  got = winrate.choose_step(rewards, [1, 3, 5], "3")
  assert got["step"] == 3 and got["greedy_reward"] is None
  with pytest.raises(ValueError, match=r"no checkpoint of that step; kept checkpoints: \[1, 3, 5\]"):
    winrate.choose_step(rewards, [1, 3, 5], 7)
  with pytest.raises(ValueError, match=r"none of the kept checkpoints \[3\] has a logged"):
    winrate.choose_step(rewards, [3])
  with pytest.raises(ValueError, match=r"no held-out greedy reward for a trained step"):
    winrate.choose_step({0: 0.5}, [1, 2])
  with pytest.raises(ValueError, match=r"expected 'best', 'latest'"):
    winrate.parse_step("newest")
  with pytest.raises(FileNotFoundError, match="--step=latest"):
    winrate.logged_rewards(str(tmp_path / "empty"))


# ----------------------------------------------------------------------------------------------
# End to end on a tiny trained workdir


def spread_reward(prompts, completions, **fields):
  """The tiny run's reward and the judge's: deterministic, with spread over prompts even where
  the barely trained smoke policy writes one text for every prompt (exact match scores it 0
  everywhere, which would make every check below 0 == 0)."""
  del fields
  return [float((sum(map(ord, p)) + sum(map(ord, c))) % 5) / 4
          for p, c in zip(prompts, completions)]


SPREAD = f"{THIS}:spread_reward"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """4 RLOO iterations of the smoke config on `spread_reward`, evaluated after each, the 2
  newest checkpoints kept (3 and 4): steps 1 and 2's evaluations are logged, their checkpoints
  rotated away. At this learning rate the held-out reward moves between steps (on this CPU:
  0.531, 0.531, 0.469, 0.453, so the best kept step is not the newest and the best logged one
  was not kept); the assertions are relations that hold whatever the numbers."""
  workdir = str(tmp_path_factory.mktemp("winrate"))
  config = load_config()
  config.train.update(num_iterations=4, eval_every=1, keep_checkpoints=2)
  config.optim.learning_rate = 3e-3
  config.rewards.fns = [SPREAD]
  config.rewards.weights = [1.0]
  algorithms.run(config, workdir, log=lambda *a, **k: None)
  return workdir


def _by_hand(result):
  """P of each judged prompt recomputed from the returned texts with spread_reward."""
  rows = result["per_prompt"]
  prompts = [r["prompt"] for r in rows]
  r_c = spread_reward(prompts, [r["completion"] for r in rows])
  r_ref = spread_reward(prompts, [r["reference"] for r in rows])
  return r_c, [sigmoid(a - b) for a, b in zip(r_c, r_ref)]


def test_command_end_to_end(trained):
  proc = subprocess.run([sys.executable, "-m", "rloo_jax.winrate", f"--workdir={trained}",
                         f"--judge=reward:{SPREAD}"], capture_output=True, text=True,
                        timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  rewards = winrate.logged_rewards(trained)
  assert sorted(rewards) == [0, 1, 2, 3, 4]
  best_kept = max((3, 4), key=lambda s: (rewards[s], -s))
  assert result["step"] == best_kept and result["greedy_reward"] == rewards[best_kept]
  assert result["best_logged_step"] == max((1, 2, 3, 4), key=lambda s: (rewards[s], -s))
  assert bool(result["note"]) == (rewards[result["best_logged_step"]] > rewards[best_kept])
  assert result["n"] == result["num_prompts"] == 16 and result["n_unjudged"] == 0
  assert "greedy win rate vs 'answer'" in proc.stdout
  # The same evaluation from Python, checked by hand: the greedy texts are those the run scored
  # at that step (their mean reward is the logged eval/greedy_reward), and P is Bradley-Terry.
  again = winrate.evaluate(trained, f"reward:{SPREAD}", log=lambda *a: None)
  r_c, p = _by_hand(again)
  assert 0 < np.mean(r_c) == pytest.approx(result["greedy_reward"], abs=1e-6)
  assert 0 < result["win_rate"] < 1 and len(set(p)) > 2  # a check with something to check
  assert [r["p"] for r in again["per_prompt"]] == pytest.approx(p, abs=1e-12)
  stats = judges.preference_stats(p)
  for key in ("win_rate", "wins", "ties", "losses", "n", "mean_p"):
    assert result[key] == pytest.approx(stats[key], abs=1e-12), key
  # Errors carry their fix and no traceback.
  proc = subprocess.run([sys.executable, "-m", "rloo_jax.winrate", f"--workdir={trained}",
                         "--judge=reward_model:/nowhere"], capture_output=True, text=True,
                        timeout=600, check=False)
  assert proc.returncode == 1 and "use 'reward:reward_model:/nowhere'" in proc.stderr
  assert "Traceback" not in proc.stderr


def test_evaluate_from_python_with_a_custom_judge(trained, capsys):
  result = winrate.evaluate(trained, prefers_shorter, step="latest", num_prompts=5)
  assert result["step"] == 4 and result["step_rule"] == "latest"
  assert result["num_prompts"] == 5 and len(result["per_prompt"]) == 5
  # By hand from the per-prompt texts: the custom judge was the one called.
  want = [0.5 if len(r["completion"]) == len(r["reference"])
          else float(len(r["completion"]) < len(r["reference"])) for r in result["per_prompt"]]
  assert [r["p"] for r in result["per_prompt"]] == want
  assert result["mean_p"] == pytest.approx(np.mean(want))
  # The hook's greedy texts are the Evaluator's greedy texts (the ones greedy_reward scores).
  policy = rloo_jax.load_policy(trained, step=4)
  ev = Evaluator.from_config(policy.experiment, num_prompts=5)
  texts = ev.greedy_completions(policy.params)
  assert texts == ev.completions(policy.params, sampling.Greedy())[0]
  assert [r["completion"] for r in result["per_prompt"]] == texts
  assert winrate.main(["winrate", f"--workdir={trained}", "--judge=test_winrate:prefers_shorter",
                       "--step=3", "--num_prompts=4"]) == 0
  out = capsys.readouterr().out
  line = json.loads(out.strip().splitlines()[-1])
  assert line["step"] == 3 and line["n"] + line["n_unjudged"] == 4 and "per_prompt" not in line
  with pytest.raises(ValueError, match="at least one held-out prompt"):
    winrate.evaluate(trained, prefers_shorter, num_prompts=0)
  assert winrate.main(["winrate", f"--workdir={trained}"]) == 2
  assert "--judge required" in capsys.readouterr().err

"""rloo_jax.rewards.math_answer: competition-math answers checked by math-verify in worker
processes (equal forms score 1, hedges and wrong answers 0, unreadable references NaN), its
timeouts on the reward thread, dead workers, the missing extra, and `last_boxed`."""
import importlib
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from conftest import REPO
from rloo_jax import rewards
from rloo_jax.rewards import answers, math_answer, reward_set

SPEC = "rloo_jax.rewards.math_answer:math_answer"


def _score(completions, refs, **kw):
  return math_answer.math_answer(["p"] * len(completions), completions, answer=refs, **kw)


def test_equal_answers_score_one_whatever_their_form():
  completions = ["so \\boxed{0.75}", "\\boxed{\\dfrac{3}{4}}", "The final answer is $\\frac{3}{4}$",
                 "\\boxed{\\sqrt{12}}", "\\boxed{(1, 2)}", "\\boxed{[1,3)}", "\\boxed{10\\%}",
                 "\\boxed{x = 5}"]
  refs = ["\\frac{3}{4}", "3/4", "0.75", "2\\sqrt{3}", "(1,2)", "[1,3)", "10\\%", "5"]
  np.testing.assert_array_equal(_score(completions, refs), np.ones(8, np.float32))


def test_wrong_hedged_and_unboxed_answers_score_zero_and_no_reference_is_nan():
  completions = ["\\boxed{\\frac{2}{3}}", "\\boxed{3} or maybe \\boxed{5}", "the answer is 5",
                 "\\boxed{5}</s> \\boxed{7}", "\\boxed{5}", "\\boxed{5}", "\\boxed{5}"]
  refs = ["\\frac{3}{4}", "5", "5", "7", "", None, float("nan")]
  np.testing.assert_array_equal(_score(completions, refs, stop="</s>"),
                                np.array([0, 0, 0, 0, np.nan, np.nan, np.nan], np.float32))
  assert np.isnan(_score(["\\boxed{1}"], None)).all()
  with pytest.raises(ValueError, match="2 answers but 1 completions"):
    _score(["\\boxed{1}"], ["1", "2"])


def test_a_reasoning_models_answer_is_read_after_its_thoughts():
  completions = ["<think>maybe \\boxed{3}? no.</think> So \\boxed{5}.",
                 "<think>\\boxed{5}</think> \\boxed{3}", "<think>so \\boxed{5}"]
  np.testing.assert_array_equal(_score(completions, ["5"] * 3), [1.0, 0.0, 1.0])
  # think=true (DeepScaleR's rule): thoughts never closed (cut at the cap) score 0, a missing
  # reference is still NaN.
  strict = rewards.resolve(SPEC + "?think=true")
  np.testing.assert_array_equal(strict(["p"] * 3, completions, answer=["5"] * 3), [1.0, 0.0, 0.0])
  assert np.isnan(strict(["p"], ["<think>so \\boxed{5}"], answer=[""])).all()


def test_the_spec_resolves_and_scores_through_a_reward_set():
  fn = rewards.resolve(SPEC)
  rs = reward_set.RewardSet([fn], [1.0], ["math_answer"], timeout_s=60)
  total, parts = rs(["p", "p"], ["\\boxed{1/2}", "\\boxed{2}"], {"answer": ["0.5", "0.5"]})
  np.testing.assert_array_equal(total, [1.0, 0.0])


def test_a_hanging_answer_times_out_to_zero_on_the_reward_thread():
  """The reward set calls it on a thread (config.rewards.timeout_s), where SIGALRM cannot be set:
  in the worker processes math-verify's timeout (the spec's, 1 s) still stops sympy on
  9^(9^(9^9))."""
  start = time.time()
  out = reward_set.call_with_deadline(
      rewards.resolve(SPEC + "?timeout_s=1&workers=2"),
      (["p"] * 3, ["\\boxed{9^{9^{9^{9}}}}", "\\boxed{5}", "\\boxed{4}"]),
      {"answer": ["5", "5", "5"]}, 120, "math_answer", "a test")
  np.testing.assert_array_equal(out, [0.0, 1.0, 0.0])
  assert time.time() - start < 30
  with pytest.raises(ValueError, match=r"timeout_s=0 and workers=2 must be whole numbers >= 1"):
    rewards.resolve(SPEC + "?timeout_s=0&workers=2")(["p"], ["\\boxed{5}"], answer=["5"])


def test_a_worker_killed_between_calls_is_replaced_and_one_dying_in_a_call_is_an_error(
    tmp_path, monkeypatch, capfd):
  _score(["\\boxed{1}"], ["1"])
  for w in math_answer._workers:
    w.kill()
    w.wait()
  np.testing.assert_array_equal(_score(["\\boxed{1}"], ["1"]), [1.0])
  assert "a worker process had exited (code -9); starting another" in capfd.readouterr().err
  dying = tmp_path / "dying.py"
  dying.write_text("import sys\nsys.stdin.buffer.read(1)\nsys.exit(3)\n")
  math_answer._stop()
  monkeypatch.setattr(math_answer, "_WORKER", str(dying))
  with pytest.raises(RuntimeError, match=r"died scoring a batch \(exit codes \[3\]"):
    _score(["\\boxed{1}"], ["1"])
  monkeypatch.undo()
  np.testing.assert_array_equal(_score(["\\boxed{1}"], ["1"]), [1.0])


def test_workers_do_not_rerun_the_script_that_called_it(tmp_path):
  """multiprocessing's spawn would run an unguarded training script again in every worker."""
  script = tmp_path / "train_like.py"
  script.write_text(textwrap.dedent(f"""
      from rloo_jax.rewards.math_answer import math_answer
      print("started", flush=True)
      print(math_answer(["p"], ["\\\\boxed{{2}}"], answer=["2"])[0])
  """))
  out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=REPO,
                       timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.split() == ["started", "1.0"]


def test_without_math_verify_resolving_it_says_which_extra_to_install(monkeypatch):
  monkeypatch.setitem(sys.modules, "math_verify", None)  # `import math_verify` then fails
  monkeypatch.delitem(sys.modules, "rloo_jax.rewards.math_answer")
  with pytest.raises(ImportError) as e:
    rewards.resolve(SPEC)
  message = str(e.value)
  assert "\n" not in message and "pip install 'rloo_jax[math]'" in message
  assert "config.rewards.fns" in message
  monkeypatch.undo()
  importlib.import_module("rloo_jax.rewards.math_answer")


def test_last_boxed_matches_nested_braces_and_skips_an_unclosed_one():
  assert answers.last_boxed("a \\boxed{1} b \\boxed{\\frac{3}{4}}") == "\\frac{3}{4}"
  assert answers.last_boxed("\\boxed {x^{2}} then \\boxed{1") == "x^{2}"
  assert answers.last_boxed("no box") is None and answers.last_boxed("\\boxed{") is None

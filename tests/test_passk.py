"""pass@k and maj@n (`rloo_jax.passk`) against closed forms and brute force on known counts, and
in the evaluation of a run (config.train.eval_samples)."""

import itertools
import math

import numpy as np
import pytest

from rloo_jax import evaluation, passk, rewards


@pytest.mark.parametrize("n,c,k", [(5, 2, 2), (5, 0, 3), (5, 5, 1), (8, 3, 4), (10, 1, 1),
                                   (4, 3, 2)])
def test_pass_at_k_is_the_chance_a_k_subset_holds_a_correct_sample(n, c, k):
  closed = 1 - math.comb(n - c, k) / math.comb(n, k)
  subsets = list(itertools.combinations(range(n), k))
  brute = sum(any(i < c for i in s) for s in subsets) / len(subsets)
  assert passk.pass_at_k(n, c, k) == pytest.approx(closed, abs=1e-12)
  assert passk.pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12)
  assert passk.pass_at_k(n, c, 1) == pytest.approx(c / n)
  with pytest.raises(ValueError, match="1 <= k <= n"):
    passk.pass_at_k(n, c, n + 1)


def test_answer_ids_name_each_sample_by_the_first_in_its_group_with_its_answer():
  texts = ["so the answer is 4", "4", "#### 5", " 4 ", "x", "y", "x ", "The total is 7."]
  np.testing.assert_array_equal(evaluation.answer_ids(texts, 4), [[0, 0, 2, 0], [0, 1, 0, 3]])
  # Math answers vote by their last boxed answer (nested braces whole, spaces ignored), not by
  # the last number in it: 3/4 and 1/4 differ, \\frac{3}{4} twice agrees; 4.0 is 4.
  texts = ["so \\boxed{\\frac{3}{4}}", "\\boxed{\\frac{1}{4}}", "\\boxed{ \\frac{3}{4} }",
           "\\boxed{3} then \\boxed{\\frac{3}{4}} and \\boxed{1", "4", "\\boxed{4}", "4.0", "x"]
  np.testing.assert_array_equal(evaluation.answer_ids(texts, 4), [[0, 1, 0, 0], [0, 1, 0, 3]])
  assert passk.group_ids(["a", None, "b", "a"], 2).tolist() == [[0, -1], [0, 1]]


def test_math_answers_vote_together_when_math_verify_finds_them_equal_right_or_wrong():
  # math_answer's votes (think=true, as the spec sets them): -1 where it reads no answer (no box,
  # or thoughts never closed), and wrong answers written two ways are one answer.
  votes = rewards.resolve("rloo_jax.rewards.math_answer:math_answer?think=true&workers=2")
  texts = ["<think>\\boxed{3}</think> \\boxed{ 5 }", "<think>so \\boxed{5}", "</think>\\boxed{5}",
           "</think> 5", "</think>\\boxed{0.5}", "</think>\\boxed{\\frac{1}{3}}",
           "</think>The final answer is $1/3$", "</think>\\boxed{\\dfrac{1}{2}}"]
  ids = votes.answer_ids(texts, 4)
  np.testing.assert_array_equal(ids, [[0, -1, 0, -1], [0, 1, 1, 0]])
  # So a wrong answer given twice, however written, outvotes a right one given first, which it
  # did not when \\frac{1}{3} and 1/3 counted as two answers (one vote each, ties to the first).
  texts[7], correct = "</think>\\boxed{7}", [True, False, False, False]
  ids = votes.answer_ids(texts[4:], 4)
  assert ids.tolist() == [[0, 1, 1, 3]] and not passk.majority_correct(ids[0].tolist(), correct)
  assert passk.majority_correct(evaluation.answer_ids(texts[4:], 4)[0].tolist(), correct)
  assert votes.answer_ids([], 4).shape == (0, 4)
  with pytest.raises(ValueError, match=r"answer_ids returned shape \(4,\) for 4 texts in groups"):
    evaluation._votes(lambda texts, k: [0] * len(texts), texts[:4], 2)  # pylint: disable=W0212


def test_gsm8k_votes_by_the_number_it_scores():
  from rloo_jax.rewards import verifiers  # pylint: disable=import-outside-toplevel
  texts = ["so \\boxed{5} #### 72", "#### 72.0", "it is $72", "no number",
           "\\boxed{5}", "#### 5", "5", "x"]
  np.testing.assert_array_equal(verifiers.gsm8k(["p"] * 4, texts[:4], answer=["72"] * 4),
                                [1, 1, 1, 0])
  votes = rewards.resolve("rloo_jax.rewards.verifiers:gsm8k").answer_ids
  np.testing.assert_array_equal(votes(texts, 4), [[0, 0, 0, -1], [0, 0, 0, -1]])
  # The default reading takes the box first: the first sample, scored 72, would vote 5.
  np.testing.assert_array_equal(evaluation.answer_ids(texts, 4), [[0, 1, 1, 3], [0, 1, 1, 3]])


def test_majority_vote_takes_the_most_common_answer_ties_first_given():
  assert passk.majority_correct(["3", "4", "4"], [True, False, False]) is False
  assert passk.majority_correct(["3", "4", "3"], [True, False, True]) is True
  assert passk.majority_correct(["4", "3"], [False, True]) is False  # tie: "4" came first
  # Correct samples vote together however written: 0.5 and 1/2 (2 votes) beat 3 (2), given first.
  assert passk.majority_correct(["0.5", "3", "1/2", "3"], [True, False, True, False]) is True
  assert passk.majority_correct(["3", "0.5", "1/2", "3"], [False, True, True, False]) is False
  # A wrong sample that gives no answer (None: cut inside its thoughts) does not vote.
  assert passk.majority_correct([None, None, "17", "5"], [False, False, True, False]) is True
  assert passk.majority_correct(["17", "5", "5"], [True, False, False]) is False
  assert passk.majority_correct([None, None], [False, False]) is False
  assert passk.ks_of(8) == [1, 2, 4, 8] and passk.ks_of(6) == [1, 2, 4, 6]


def test_summary_means_over_prompts_with_intervals_around_them():
  correct = np.array([[1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], bool)
  answers = [["1", "2", "2", "2"], ["5"] * 4, ["7", "8", "9", "7"]]
  s = passk.summarize(correct, answers)
  assert s["pass@1"] == pytest.approx((0.25 + 1 + 0) / 3)
  assert s["pass@2"] == pytest.approx((0.5 + 1 + 0) / 3)
  assert s["pass@4"] == pytest.approx(2 / 3)
  assert s["maj@4"] == pytest.approx(1 / 3)
  for key in ("pass@1", "pass@2", "pass@4", "maj@4"):
    assert s[f"{key}_lo"] <= s[key] <= s[f"{key}_hi"]
  assert s["pass@4_lo"] < s["pass@4_hi"]


def test_a_run_evaluates_pass_at_k_when_asked(tmp_path):
  from rloo_jax import algorithms, evaluation  # pylint: disable=import-outside-toplevel
  from test_trim import tiny_config  # pylint: disable=import-outside-toplevel

  def even(prompts, completions, **fields):  # right and wrong samples in most groups
    del prompts, fields
    return [float(len(c) % 2 == 0) for c in completions]
  # The first reward's reading of an answer is the vote: reading none, the wrong samples do not
  # vote, so a prompt is solved by majority exactly when one sample is right (maj@4 = pass@4;
  # voting by their texts instead, maj@4 was 0.75 against pass@4's 1.0).
  even.answer_ids = lambda texts, k: passk.group_ids([None] * len(texts), k)
  config = tiny_config()
  config.train.update(num_iterations=1, eval_samples=4)
  config.rewards.fns = [even]
  summary = algorithms.run(config, str(tmp_path))
  after = summary["after"]
  for key in ("pass@1", "pass@2", "pass@4", "maj@4"):
    assert 0.0 <= after[f"{key}_lo"] <= after[key] <= after[f"{key}_hi"] <= 1.0, key
  assert after["pass@1"] <= after["pass@2"] <= after["pass@4"] == after["maj@4"]
  assert "pass@4 (sampled)" in evaluation.format_summary(summary)

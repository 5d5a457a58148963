"""GSM8K: the array_record builder on files in the source's format, the final-number verifier and
the format reward."""

import fractions
import json
import os
import re

import ml_collections
import numpy as np
import pytest

from conftest import TESTS
from rloo_jax import data, rewards
from rloo_jax.data import builder, gsm8k, gsm8k_answer
from rloo_jax.rewards import gsm8k as gsm8k_reward
from rloo_jax.rewards import verifiers

FIXTURES = os.path.join(TESTS, "fixtures", "gsm8k")


def _rows(split):
  with open(os.path.join(FIXTURES, f"{split}.jsonl"), encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def _score(completions, answer, fn=verifiers.gsm8k, **kwargs):
  completions = list(completions)
  answers = [answer] * len(completions) if isinstance(answer, str) else list(answer)
  return fn(["q"] * len(completions), completions, answer=answers, **kwargs)


def test_fixtures_are_gsm8k_shaped_and_their_arithmetic_is_right():
  # The verifier's 1.0 on reference solutions is only evidence if the fixtures are right: every
  # calculator annotation holds, and the '####' number is the last annotation's result.
  for split in ("train", "test"):
    rows = _rows(split)
    assert len(rows) >= 10
    for row in rows:
      assert set(row) == {"question", "answer"}
      steps = re.findall(r"<<([^=<>]+)=([^<>]+)>>", row["answer"])
      assert steps, row
      for expr, result in steps:
        assert fractions.Fraction(str(eval(expr, {}))) == fractions.Fraction(result), expr
      final = row["answer"].rsplit("\n", 1)[1]
      assert final.startswith("#### ")
      assert fractions.Fraction(final[5:].replace(",", "")) == fractions.Fraction(steps[-1][1])


@pytest.mark.parametrize("split", ["train", "test"])
def test_reference_solutions_score_one(split, tmp_path):
  b = gsm8k.prepare(tmp_path, source_dir=FIXTURES)
  source = data.load_split(b, split)
  records = [source[i] for i in range(len(source))]
  solutions = [r["solution"] for r in records]
  answers = [r["answer"] for r in records]
  np.testing.assert_array_equal(_score(solutions, answers), 1.0)
  # Against the raw '#### 1,200' reference too, and without the '####' line (the last number of
  # the reasoning is the answer in every fixture), as a model that skips the format writes it.
  np.testing.assert_array_equal(_score(solutions, solutions), 1.0)
  reasoning = [s[:s.rindex("####")] for s in solutions]
  np.testing.assert_array_equal(_score(reasoning, answers), 1.0)
  np.testing.assert_array_equal(_score(solutions, answers, fn=verifiers.gsm8k_format), 1.0)
  np.testing.assert_array_equal(_score(reasoning, answers, fn=verifiers.gsm8k_format), 0.0)


WRONG = [  # (completion, reference answer): each must score 0.0
    ("#### 71", "72"),
    ("#### 7", "72"),
    ("#### 720", "72"),
    ("#### 72.5", "72"),
    ("The answer is 72.5", "72"),
    ("She had 72 apples at first, then gave away 10, so 62 remain.", "72"),
    ("#### 72\nWait, that is wrong.\n#### 70", "72"),
    ("First 72... the answer is #### 80", "72"),
    ("I don't know.", "72"),
    ("", "72"),
    ("####", "72"),
    ("#### ", "72"),
    ("The answer is 72.\n####", "72"),
    ("#### seventy-two", "72"),
    ("#### -72", "72"),
    ("The change in temperature is 10 - 72", "-72"),  # an operator, not a sign
    ("#### 9", "-9"),
    ("#### 1,20", "120"),  # not a thousands group: reads 1 then 20, and '####' takes the first
    ("#### 1.200", "1200"),  # a decimal point, not a separator
    ("#### 12", "1,200"),
    ("#### 0.3333", "0.3333333"),  # exact comparison: no tolerance for near misses
    ("#### 6.05", "6.5"),
    ("x = 72 when y = 3", "72"),
    ("<<48+24=72>>72 bracelets, then 72-2 = 70", "72"),
    ("#### 72", "72\n#### 73"),  # the reference's own last '####' wins
]

RIGHT = [  # (completion, reference answer): each must score 1.0
    ("The answer is $1,200.", "1200"),
    ("The answer is 1200", "1,200"),
    ("#### 72.0", "72"),
    ("#### 72.00", "72"),
    ("so 72 apples.", "72"),
    ("-5", "-5"),
    ("The balance is \u2212$17.", "-17"),
    ("#### +72", "72"),
    ("#### $6.50", "6.5"),
    ("Each cup gets .25 liters.", "0.25"),
    ("#### 72\n", "72"),
    ("Total: 12,500 - 3,840 = 8,660 seats", "8660"),
    ("#### 1,234,567", "1234567"),
    ("It costs \u20ac45.", "45"),
    ("Reasoning with 3 and 4 and 5.\n#### 72 apples", "72"),
    ("#### 72\n\nQuestion: how many are 5 + 6?", "72"),  # ran past the answer; '####' decides
]


def test_wrong_and_malformed_completions_score_zero():
  assert len(WRONG) >= 20
  completions, answers = zip(*WRONG)
  scores = _score(completions, answers)
  bad = [w for w, s in zip(WRONG, scores) if s != 0.0]
  assert not bad, bad


def test_tricky_correct_completions_score_one():
  assert len(RIGHT) >= 8
  completions, answers = zip(*RIGHT)
  scores = _score(completions, answers)
  bad = [r for r, s in zip(RIGHT, scores) if s != 1.0]
  assert not bad, bad


def test_unscorable_references_are_nan_and_stop_cuts():
  scores = _score(["#### 72"] * 5, [None, "", "  ", "no number here", "#### "])
  assert np.isnan(scores).all() and scores.dtype == np.float32
  assert np.isnan(verifiers.gsm8k(["q"], ["#### 72"])).all()  # no answer field at all
  assert np.isnan(_score(["#### 72"], [float("nan")])).all()
  # Text after the stop string (an eos the tokenizer decodes) is not part of the answer.
  assert _score(["#### 72<eos>#### 5"], "72", stop="<eos>")[0] == 1.0
  assert _score(["#### 5<eos>#### 72"], "72", stop="<eos>")[0] == 0.0
  assert _score(["#### 72<eos>#### 5"], "72")[0] == 0.0
  with pytest.raises(ValueError, match="2 prompts but 1 completions"):
    verifiers.gsm8k(["a", "b"], ["#### 1"], answer=["1"])
  with pytest.raises(ValueError, match="2 answers but 1 completions"):
    verifiers.gsm8k(["a"], ["#### 1"], answer=["1", "2"])
  with pytest.raises(ValueError, match="2 prompts but 1 completions"):
    verifiers.gsm8k_format(["a", "b"], ["#### 1"])


def test_format_reward():
  ok = ["Step 1: 4 + 2 = 6.\n#### 6", "#### 1,200", "#### -9.", "#### 72\n\n", "x\n####   $5",
        "#### 72<eos>more text"]
  no = ["The answer is 6", "#### 6 apples", "####", "#### six", "#### 6\nThat is all.", "",
        "answer #### 6", "#### 6 7"]
  assert _score(ok, "0", fn=verifiers.gsm8k_format, stop="<eos>").tolist() == [1.0] * len(ok)
  assert _score(no, "0", fn=verifiers.gsm8k_format).tolist() == [0.0] * len(no)


def test_number_normalisation():
  assert [gsm8k_answer.reference_answer(t) for t in
          ["#### 1,200", "#### 72.0", "#### -0.50", "#### $5", "x\n#### 3000", "no"]] == [
              "1200", "72", "-0.5", "5", "3000", None]
  assert gsm8k_reward.parse_number("$1,200.") == 1200
  assert gsm8k_reward.parse_number("1 2") is None
  assert gsm8k_reward.normalize(gsm8k_reward.parse_number("-0.0")) == "0"
  # Exact beyond float precision: these two differ in the 20th significant digit.
  assert _score(["#### 12345678901234567891"], "12345678901234567890")[0] == 0.0


def test_spec_resolves():
  fn = rewards.resolve("rloo_jax.rewards.verifiers:gsm8k")
  assert fn is gsm8k_reward.gsm8k
  assert rewards.resolve("rloo_jax.rewards.verifiers:gsm8k_format") is gsm8k_reward.gsm8k_format
  config = ml_collections.ConfigDict({"fns": ["rloo_jax.rewards.verifiers:gsm8k",
                                              "rloo_jax.rewards.verifiers:gsm8k_format"],
                                      "weights": [1.0, 0.1]})
  scores, parts = rewards.RewardSet.from_config(config)(
      ["q", "q"], ["so 72", "#### 72"], {"answer": np.array(["72", "72"], object)})
  np.testing.assert_allclose(scores, [1.0, 1.1])
  assert set(parts) == {"gsm8k", "gsm8k_format"}


def test_builder_round_trip(tmp_path):
  b = gsm8k.prepare(tmp_path / "out", source_dir=FIXTURES)
  assert sorted(b.info.splits) == ["test", "train"]
  for split in ("train", "test"):
    rows = _rows(split)
    source = data.load_split(b, split)
    assert len(source) == len(rows)
    assert builder.stats(b)[split] == {"kept": len(rows)}
    for i, row in enumerate(rows):  # file order is kept
      assert source[i] == {
          "prompt": f"Question: {row['question']}\nAnswer:",
          "answer": gsm8k_answer.reference_answer(row["answer"]), "solution": row["answer"]}
  train = data.load_split(b, "train")
  assert train[0]["answer"] == "72"
  assert {train[i]["answer"] for i in range(len(train))} >= {"1200", "-9", "12.5", "6.5", "8660"}
  # Reading the prepared directory back, without the builder object.
  assert data.load_split(b.data_dir, "test")[2]["answer"] == "70000"
  # Another template, another cache directory; the template is validated up front.
  b2 = gsm8k.prepare(tmp_path / "out", source_dir=FIXTURES,
                     prompt_template="Solve: {question}\nEnd with '#### <number>'.\n")
  assert b2.data_dir != b.data_dir
  assert data.load_split(b2, "test")[1]["prompt"].startswith("Solve: A quilt takes 4 yards")
  with pytest.raises(ValueError, match="containing '{question}'"):
    gsm8k.prepare(tmp_path / "out", source_dir=FIXTURES, prompt_template="Q: {q}")
  with pytest.raises(ValueError, match="placeholders other than"):
    gsm8k.prepare(tmp_path / "out", source_dir=FIXTURES, prompt_template="{question} {n}")


def _write(path, rows):
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def test_builder_errors_name_file_and_line(tmp_path):
  good = {"question": "What is 2 + 3?", "answer": "2 + 3 = <<2+3=5>>5\n#### 5"}
  cases = [
      ({"question": "q"}, r"train.jsonl:2: missing field 'answer'"),
      ({"question": 7, "answer": "#### 5"}, r"train.jsonl:2: field 'question' should be str"),
      ({"question": "q", "answer": "it is 5"}, r"train.jsonl:2: field 'answer' has no '####"),
      ({"question": "q", "answer": "5\n####"}, r"train.jsonl:2: field 'answer' has no number"),
      ("{not json", r"train.jsonl:2: malformed JSON"),
  ]
  for i, (bad, message) in enumerate(cases):
    src = tmp_path / f"src{i}"
    _write(src / "train.jsonl", [good, bad])
    _write(src / "test.jsonl", [good])
    with pytest.raises(ValueError, match=message):
      gsm8k.prepare(tmp_path / f"out{i}", source_dir=src)
  src = tmp_path / "only_train"
  _write(src / "train.jsonl", [good])
  with pytest.raises(FileNotFoundError, match="test.jsonl"):
    gsm8k.prepare(tmp_path / "out_missing", source_dir=src)

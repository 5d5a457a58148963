"""Your own task (docs/YOUR_TASK.md): the example config end to end on JSONL files with extra
fields and a reward named by file path, training from scratch without init_from, and the rules
JsonlSource applies to the extra fields."""
import importlib.util
import json
import math
import os

import numpy as np
import pytest

from conftest import REPO
from rloo_jax import algorithms, rollout, tasks
from rloo_jax.data import JsonlSource, pipeline
from rloo_jax.data.tokenizer import ByteTokenizer

EXAMPLES = os.path.join(REPO, "configs", "examples")

# A reward file the test writes: it appends what each call received to received.jsonl beside
# itself (monitored at weight 0, so it changes nothing in the run it watches).
RECORDER = '''
import json, os
def record_fields(prompts, completions, **fields):
  row = {k: [v.item() if hasattr(v, "item") else v for v in vals] for k, vals in fields.items()}
  row["prompts"] = list(prompts)
  with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "received.jsonl"), "a") as f:
    f.write(json.dumps(row) + "\\n")
  return [0.0] * len(completions)
'''

WORDS = ("ab", "cd", "ef", "gh", "ij", "kl", "mn", "op")


def _module(name):
  spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _write(path, rows):
  with open(path, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  return str(path)


def _records(n, with_answers=True):
  rows = []
  for i in range(n):
    w = WORDS[i % len(WORDS)]
    row = {"prompt": f"say {w}:", "keyword": w, "target_length": 4 + i % 3, "id": f"r{i}"}
    if with_answers and i % 4:  # every fourth record has no answer: an RL-only prompt
      row["answer"] = f"{w} {w}"
    rows.append(row)
  return rows


def quiet(*args, **kwargs):
  del args, kwargs


@pytest.fixture(scope="module")
def example_run(tmp_path_factory):
  root = tmp_path_factory.mktemp("your_task")
  train = _write(root / "train.jsonl", _records(24))
  test = _write(root / "test.jsonl", _records(8, with_answers=False))
  recorder = root / "recorder.py"
  recorder.write_text(RECORDER)
  config = _module("jsonl_task").get_config("smoke")
  assert config.task == "jsonl" and not config.model.init_from
  config.data.jsonl_train, config.data.jsonl_test = train, test
  config.rewards.fns = list(config.rewards.fns) + [f"{recorder}:record_fields"]
  config.rewards.weights = list(config.rewards.weights) + [0.0]
  workdir = str(root / "run")
  summary = algorithms.run(config, workdir, log=quiet)
  received = [json.loads(l) for l in open(root / "received.jsonl")]
  return config, workdir, summary, received


def test_example_config_runs_end_to_end(example_run):
  config, workdir, summary, _ = example_run
  assert summary["iterations"] == config.train.num_iterations == 2
  assert summary["reward"] == "contains_keyword"
  rows = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
  train_rows = [r for r in rows if "train/loss" in r]
  assert [r["step"] for r in train_rows] == [1, 2]
  for name in ("contains_keyword", "near_target_length", "record_fields"):
    assert np.isfinite(train_rows[-1][f"train/reward/{name}"]), name
    assert f"greedy_reward/{name}" in summary["after"], name


def test_jsonl_without_init_from_trains_from_scratch(example_run):
  config, workdir, summary, _ = example_run
  assert summary["initial_policy"] == "SFT"
  assert os.path.isdir(os.path.join(workdir, "sft"))
  task = tasks.make(config, os.path.join(workdir, "data"))
  assert isinstance(task.tokenizer, ByteTokenizer)
  # Demonstrations: the training records with an answer; the rest stay RL prompts.
  assert len(task.train) == 24 and len(task.demonstrations) == 18
  assert all(r["answer"] for r in task.demonstrations)


def test_reward_receives_every_jsonl_field(example_run):
  config, _, _, received = example_run
  k, b = config.rloo.k, config.rloo.num_prompts
  # The dry run before SFT: the first two training records, once each.
  first = received[0]
  assert first["prompts"] == ["say ab:", "say cd:"]
  assert first["keyword"] == ["ab", "cd"] and first["target_length"] == [4, 5]
  assert first["id"] == ["r0", "r1"] and first["answer"] == ["", "cd cd"]
  # Rollouts: b prompts x k samples, each prompt's fields repeated for its k samples.
  rollouts = [r for r in received if len(r["prompts"]) == b * k]
  assert len(rollouts) >= config.train.num_iterations
  by_prompt = {f"say {w}:": w for w in WORDS}
  for row in rollouts:
    assert set(row) >= {"keyword", "target_length", "id", "answer"}
    assert [by_prompt[p] for p in row["prompts"]] == row["keyword"]
    assert row["keyword"] == [w for w in row["keyword"][::k] for _ in range(k)]
    assert all(isinstance(t, int) for t in row["target_length"])


def test_example_rewards_read_the_fields():
  reward = _module("my_reward")
  completions = ["the cat sat", "a dog", "dogs", "x"]
  got = reward.contains_keyword([""] * 4, completions,
                                keyword=np.array(["cat", "cat", "DOG", ""], object), answer=None)
  np.testing.assert_array_equal(got[:3], [1.0, 0.0, 1.0])
  assert math.isnan(got[3])  # a record without a keyword cannot be scored
  got = reward.near_target_length([""] * 4, completions,
                                  target_length=np.array([11.0, 10.0, np.nan, 0.0]))
  np.testing.assert_allclose(got[:2], [1.0, 0.5])
  assert np.isnan(got[2:]).all()
  assert reward.contains_keyword(["p"], ["c"]) == [None]  # no such field in the file


def test_example_data_loads_and_matches_its_generator():
  train = JsonlSource(os.path.join(EXAMPLES, "keyword_train.jsonl"))
  test = JsonlSource(os.path.join(EXAMPLES, "keyword_test.jsonl"))
  assert train.fields == test.fields == {"keyword": "string", "target_length": "number"}
  made_train, made_test = _module("make_keyword_data").records()
  assert [train[i] for i in range(len(train))] == made_train
  assert [test[i] for i in range(len(test))] == made_test


def test_jsonl_without_answers_or_init_from_names_the_fix(tmp_path):
  config = _module("jsonl_task").get_config("smoke")
  config.data.jsonl_train = _write(tmp_path / "a.jsonl", [{"prompt": "x", "keyword": "y"}])
  config.data.jsonl_test = config.data.jsonl_train
  with pytest.raises(ValueError, match=r"no record of .*a\.jsonl has a non-empty 'answer'.*"
                                       r"config\.model\.init_from"):
    tasks.make(config, str(tmp_path))


# --- JsonlSource: extra fields and their rules ---------------------------------------------------

def test_jsonl_source_keeps_every_field(tmp_path):
  path = _write(tmp_path / "p.jsonl", [
      {"prompt": "a", "answer": "1", "keyword": "x", "n": 3, "w": 0.5, "ok": True},
      {"prompt": "b", "n": 4, "w": 2, "ok": False},  # no keyword, no answer
      {"prompt": "c", "keyword": "z", "ok": True, "w": None},  # no n; w null
  ])
  src = JsonlSource(path)
  assert src.fields == {"keyword": "string", "n": "number", "w": "number", "ok": "number"}
  assert src[0] == {"prompt": "a", "answer": "1", "keyword": "x", "n": 3.0, "w": 0.5, "ok": 1}
  # Missing or null: '' for string fields, NaN for number fields (floats on every line then).
  assert src[1]["keyword"] == "" and src[1]["answer"] == "" and src[1]["ok"] == 0
  assert math.isnan(src[2]["n"]) and math.isnan(src[2]["w"]) and src[0]["n"] == 3.0
  assert all(isinstance(src[i]["n"], float) for i in range(3))
  # Every field stacks in any batch, so every batch passes it to the rewards, repeated k times.
  batch = next(pipeline.prompt_batches(src, ByteTokenizer(), global_batch_size=2,
                                       max_prompt_len=8, shuffle=False, num_epochs=1,
                                       drop_remainder=False))
  fields = rollout.reward_fields(batch, 2)
  assert set(fields) == {"answer", "keyword", "n", "w", "ok"}
  assert list(fields["keyword"]) == ["x", "x", "", ""]
  assert fields["n"].dtype == np.float64 and list(fields["ok"]) == [1, 1, 0, 0]


@pytest.mark.parametrize("line,match", [
    ({"prompt": "b", "tags": ["x", "y"]}, r"p\.jsonl:2: field 'tags' is a list; fields must be "
                                         r"strings or numbers"),
    ({"prompt": "b", "meta": {"a": 1}}, r"p\.jsonl:2: field 'meta' is an object"),
    ({"prompt": "b", "keyword": 7}, r"p\.jsonl:2: field 'keyword' is a number here but a "
                                    r"string at .*p\.jsonl:1"),
    ({"prompt": "b", "index": 3}, r"p\.jsonl:2: field 'index' is a name the batches use"),
    ({"prompt": "b", "tokens": "t"}, r"p\.jsonl:2: field 'tokens' is a name the batches use"),
])
def test_jsonl_source_rejects_nested_mixed_and_reserved_fields(tmp_path, line, match):
  path = _write(tmp_path / "p.jsonl", [{"prompt": "a", "keyword": "x"}, line])
  with pytest.raises(ValueError, match=match):
    JsonlSource(path)


def test_jsonl_source_rejects_non_finite_numbers(tmp_path):
  path = tmp_path / "p.jsonl"
  path.write_text('{"prompt": "a", "score": NaN}\n')
  with pytest.raises(ValueError, match=r"p\.jsonl:1: field 'score' is nan"):
    JsonlSource(path)

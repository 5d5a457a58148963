"""Data: tokenizers, tfds builders (array_record, no TensorFlow), JSONL, grain batching, rewards."""

import gzip
import json
import sys

import numpy as np
import pytest

from rloo_jax import data
from rloo_jax.data import arithmetic, builder, hh, summarize, tldr
from rloo_jax.data.tokenizer import ByteTokenizer, CharTokenizer, WordTokenizer
from rloo_jax.rewards import arithmetic_exact_match, load_reward_fn
from rloo_jax.rewards import summarize_gold


@pytest.fixture(scope="module")
def arith(tmp_path_factory):
  return arithmetic.prepare(tmp_path_factory.mktemp("arith"), min_digits=1, max_digits=2,
                            num_train=300, num_test=40, seed=3)


def test_no_tensorflow_imported(arith):
  data.load_split(arith, "train")[0]
  assert "tensorflow" not in sys.modules


# --- tokenizers ---------------------------------------------------------------------------------

def test_char_tokenizer_round_trip_and_specials():
  tok = CharTokenizer("0123456789+=")
  assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 2, 15)
  ids = tok.encode("23+458=", add_bos=True, add_eos=True)
  assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
  assert tok.decode(ids) == "23+458="
  # Decoding stops at the first eos and skips padding.
  assert tok.decode(tok.encode("481") + [tok.eos_id] + tok.encode("99") + [0, 0]) == "481"
  assert tok.decode(np.array(tok.encode("12") + [0, 0], np.int32)) == "12"


def test_tokenizer_unknown_symbol_is_named():
  with pytest.raises(ValueError, match="'x'"):
    CharTokenizer("0123456789").encode("12x")
  with pytest.raises(ValueError, match="'zebra'"):
    WordTokenizer(["a", "b"]).encode("a zebra")


def test_word_and_byte_tokenizers():
  tok = summarize.make_tokenizer()
  text = "doc: the storm river tl;dr:"
  assert tok.decode(tok.encode(text)) == text
  assert len(tok.encode(text)) == 5
  bt = ByteTokenizer()
  assert bt.vocab_size == 259
  assert bt.decode(bt.encode("héllo\n", add_eos=True)) == "héllo\n"


# --- arithmetic builder -------------------------------------------------------------------------

def test_arithmetic_builder(arith, tmp_path):
  train, test = data.load_split(arith, "train"), data.load_split(arith, "test")
  assert (len(train), len(test)) == (300, 40)
  rows = [train[i] for i in range(len(train))] + [test[i] for i in range(len(test))]
  for r in rows:
    a, b = map(int, r["prompt"][:-1].split("+"))
    assert r["prompt"] == f"{a}+{b}=" and r["answer"] == str(a + b)
  key = lambda r: frozenset(r["prompt"][:-1].split("+"))  # a+b and b+a are one problem
  assert not {key(r) for r in rows[:300]} & {key(r) for r in rows[300:]}
  assert len({key(r) for r in rows}) == 340
  assert builder.stats(arith) == {"train": {"kept": 300}, "test": {"kept": 40}}
  # Deterministic in the seed; readable from the prepared directory alone.
  again = data.load_split(arith.data_dir, "train")
  assert [again[i] for i in range(5)] == rows[:5]
  other = arithmetic.prepare(tmp_path, min_digits=1, max_digits=2, num_train=300, num_test=40,
                             seed=4)
  assert [data.load_split(other, "train")[i] for i in range(5)] != rows[:5]


def test_preparing_a_dataset_leaves_nothing_in_the_temp_dir(tmp_path, monkeypatch):
  """tfds looks a new dataset's info up in its GCS bucket (disabled offline) through a temp dir it
  never removes: one leaked directory per run before `builder._LocalInfo`."""
  import tempfile
  temp = tmp_path / "temp"
  temp.mkdir()
  monkeypatch.setattr(tempfile, "tempdir", str(temp))
  prepared = arithmetic.prepare(tmp_path / "data", min_digits=1, max_digits=1, num_train=20,
                                num_test=5, seed=0)
  arithmetic.prepare(tmp_path / "data", min_digits=1, max_digits=1, num_train=20, num_test=5,
                     seed=0)  # the cached one, read back
  assert len(data.load_split(prepared, "train")) == 20
  assert sorted(p.name for p in temp.iterdir()) == []


def test_arithmetic_too_many_problems(tmp_path):
  with pytest.raises(ValueError, match="only 55 exist with 1..1 digits"):
    arithmetic.prepare(tmp_path, min_digits=1, max_digits=1, num_train=60, num_test=0)
  # Near saturation the whole space is enumerated.
  probs = arithmetic.generate_problems(1, 1, 55, seed=0)
  assert len({frozenset(p) for p in probs}) == 55


# --- JSONL --------------------------------------------------------------------------------------

def test_jsonl_source(tmp_path):
  path = tmp_path / "p.jsonl"
  path.write_text('{"prompt": "1+1=", "answer": "2"}\n\n{"prompt": "2+2=", "answer": 4}\n'
                  '{"prompt": "3+3="}\n')
  src = data.JsonlSource(path)
  assert len(src) == 3
  assert [src[i]["answer"] for i in range(3)] == ["2", "4", ""]


@pytest.mark.parametrize("content,match", [
    ('{"prompt": "a"}\n{"prompt": "b"\n', r"p.jsonl:2: malformed JSON"),
    ('{"prompt": "a"}\n{"question": "b"}\n', r"p.jsonl:2: missing field 'prompt'"),
    ('{"prompt": 3}\n', r"p.jsonl:1: field 'prompt' must be a non-empty string"),
    ('{"prompt": "a", "answer": [1]}\n', r"p.jsonl:1: field 'answer' must be"),
    ('[1, 2]\n', r"p.jsonl:1: expected a JSON object"),
    ('\n', r"no records"),
])
def test_jsonl_errors(tmp_path, content, match):
  path = tmp_path / "p.jsonl"
  path.write_text(content)
  with pytest.raises(ValueError, match=match):
    data.JsonlSource(path)


def test_jsonl_missing_file(tmp_path):
  with pytest.raises(FileNotFoundError, match="nope.jsonl"):
    data.JsonlSource(tmp_path / "nope.jsonl")


# --- pipeline -----------------------------------------------------------------------------------

def _batches(it, n):
  return [next(it) for _ in range(n)]


def _assert_same(a, b):
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_array_equal(a[k], b[k])


def test_prompt_batches_layout(arith):
  tok = arithmetic.make_tokenizer()
  it = data.prompt_batches(data.load_split(arith, "train"), tok, global_batch_size=8,
                           max_prompt_len=8, seed=0)
  b = next(it)
  assert b["prompt_tokens"].shape == (8, 8) and b["prompt_tokens"].dtype == np.int32
  assert b["prompt_lengths"].dtype == np.int32 and b["prompt"].dtype == object
  for row, n, p in zip(b["prompt_tokens"], b["prompt_lengths"], b["prompt"]):
    assert row[0] == tok.bos_id and n == len(p) + 1
    assert tok.decode(row) == p and (row[n:] == tok.pad_id).all()
  assert b["valid"].all() and b["index"].dtype == np.int64


def test_drop_and_count_or_error():
  src = [{"prompt": "1+1="}, {"prompt": "123+456="}, {"prompt": "2+2=", "answer": "4"}]
  tok = arithmetic.make_tokenizer()
  it = data.prompt_batches(src, tok, global_batch_size=2, max_prompt_len=6, shuffle=False)
  assert (it.num_records, it.num_kept, it.num_dropped) == (3, 2, 1)
  b = next(it)
  assert list(b["prompt"]) == ["1+1=", "2+2="] and list(b["answer"]) == ["", "4"]
  with pytest.raises(ValueError,
                     match=r"exceed config.data.max_prompt_len=6: record 1 \(9 tokens\)"):
    data.prompt_batches(src, tok, global_batch_size=2, max_prompt_len=6, overlong="error")
  with pytest.raises(ValueError, match="record 0 of .*'x'"):
    data.prompt_batches([{"prompt": "1x"}], tok, global_batch_size=1, max_prompt_len=6)


def test_state_round_trip_gives_identical_batches(arith):
  src = data.load_split(arith, "train")
  tok = arithmetic.make_tokenizer()
  make = lambda: data.prompt_batches(src, tok, global_batch_size=32, max_prompt_len=8, seed=7)
  it = make()
  _batches(it, 12)  # past the end of the first epoch (300 records)
  state = json.loads(json.dumps(it.get_state()))
  expected = _batches(it, 6)
  resumed = make()
  resumed.set_state(state)
  for a, b in zip(expected, _batches(resumed, 6)):
    _assert_same(a, b)
  bad = dict(state, global_batch_size=16)
  with pytest.raises(ValueError, match="global_batch_size: saved 16 vs now 32"):
    make().set_state(bad)


def test_each_epoch_is_a_fresh_permutation():
  src = [{"prompt": f"{i}+0="} for i in range(40)]
  it = data.prompt_batches(src, arithmetic.make_tokenizer(), global_batch_size=8,
                           max_prompt_len=8, seed=1)
  epochs = [np.concatenate([b["index"] for b in _batches(it, 5)]) for _ in range(2)]
  for e in epochs:
    assert sorted(e) == list(range(40))
  assert not np.array_equal(epochs[0], epochs[1])


def test_process_shards_partition_the_global_batch(arith):
  src = data.load_split(arith, "train")
  tok = arithmetic.make_tokenizer()
  kw = dict(global_batch_size=12, max_prompt_len=8, seed=5)
  whole = _batches(data.prompt_batches(src, tok, **kw), 3)
  parts = [_batches(data.prompt_batches(src, tok, process_index=p, process_count=3, **kw), 3)
           for p in range(3)]
  for step in range(3):
    for k in whole[step]:
      np.testing.assert_array_equal(np.concatenate([parts[p][step][k] for p in range(3)]),
                                    whole[step][k])
  with pytest.raises(ValueError, match="not divisible by process_count=5"):
    data.prompt_batches(src, tok, process_count=5, **kw)


def test_finite_eval_pass_pads_the_last_batch(arith):
  src = data.load_split(arith, "test")  # 40 records
  it = data.prompt_batches(src, arithmetic.make_tokenizer(), global_batch_size=16,
                           max_prompt_len=8, shuffle=False, num_epochs=1, drop_remainder=False)
  got = list(it)
  assert it.num_batches == 3 and len(got) == 3
  assert [b["valid"].sum() for b in got] == [16, 16, 8]
  assert list(np.concatenate([b["index"][b["valid"]] for b in got])) == list(range(40))


def test_sft_batches_mask_the_answer():
  src = [{"prompt": "12+3=", "answer": "15"}, {"prompt": "1+1=", "answer": "2"},
         {"prompt": "99+99=", "answer": "198"}]
  tok = arithmetic.make_tokenizer()
  it = data.sft_batches(src, tok, global_batch_size=2, max_seq_len=10, shuffle=False)
  assert it.num_dropped == 1  # 1 + 6 + 3 + 1 = 11 tokens
  b = next(it)
  row, lm = b["tokens"][0], b["loss_mask"][0]
  assert tok.decode(row) == "12+3=15" and row[b["lengths"][0] - 1] == tok.eos_id
  assert tok.decode(row[lm]) == "15" and row[lm][-1] == tok.eos_id
  assert b["prompt_lengths"][0] == 6 and lm.sum() == 3
  assert (b["token_mask"].sum(1) == b["lengths"]).all()
  with pytest.raises(ValueError, match="record 0 of the source: no 'answer'"):
    data.sft_batches([{"prompt": "1="}], tok, global_batch_size=1, max_seq_len=10)
  with pytest.raises(ValueError, match="record 0 of the source: missing field 'prompt'"):
    data.prompt_batches([{"question": "1="}], tok, global_batch_size=1, max_prompt_len=10)


# --- rewards ------------------------------------------------------------------------------------

def test_arithmetic_exact_match():
  r = arithmetic_exact_match(["1+1="] * 5, ["2", " 2 ", "3", "02", "anything"],
                             answer=["2", "2", "2", "2", ""])
  assert r.dtype == np.float32
  np.testing.assert_array_equal(r[:4], [1, 1, 0, 0])
  assert np.isnan(r[4])
  r = arithmetic_exact_match(["a"], ["481</s>junk"], answer=["481"], stop="</s>", prompt_id=[3])
  assert r[0] == 1.0
  assert np.isnan(arithmetic_exact_match(["a"], ["1"])).all()


def test_load_reward_fn(tmp_path, monkeypatch):
  assert load_reward_fn("rloo_jax.rewards.verifiers:arithmetic_exact_match") is \
      arithmetic_exact_match
  with pytest.raises(ValueError, match="expected 'package.module:function'"):
    load_reward_fn("rloo_jax.rewards.verifiers.arithmetic_exact_match")
  with pytest.raises(ValueError, match="both parts non-empty"):
    load_reward_fn("rloo_jax.rewards:")
  with pytest.raises(ValueError, match="module 'no_such_pkg.mod' not found"):
    load_reward_fn("no_such_pkg.mod:f")
  with pytest.raises(ValueError, match="has no attribute 'nope'"):
    load_reward_fn("rloo_jax.rewards.verifiers:nope")
  with pytest.raises(TypeError, match="not a callable"):
    load_reward_fn("rloo_jax.data.summarize:VOCAB")
  (tmp_path / "broken_reward_mod.py").write_text("import missing_dependency_xyz\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  with pytest.raises(ImportError, match="missing_dependency_xyz"):
    load_reward_fn("broken_reward_mod:f")


# --- embedded summarisation task ----------------------------------------------------------------

def test_summarize_builder(tmp_path):
  b = summarize.prepare(tmp_path, num_train=300, num_test=50, seed=1)
  train, test = data.load_split(b, "train"), data.load_split(b, "test")
  rows = [train[i] for i in range(300)]
  assert not {r["prompt"] for r in rows} & {test[i]["prompt"] for i in range(50)}
  tok = summarize.make_tokenizer()
  for r in rows:
    tok.encode(r["prompt"] + " " + r["answer"])  # the word vocabulary covers the task
    assert r["reference"] == " ".join(summarize.key_words(summarize.parse_prompt(r["prompt"])))
  prompts = [r["prompt"] for r in rows]
  ideal = summarize_gold.gold_reward(prompts, [r["reference"] for r in rows])
  sft = summarize_gold.gold_reward(prompts, [r["answer"] for r in rows])
  np.testing.assert_allclose(ideal, 1.1, atol=1e-6)
  assert 0.2 < sft.mean() < 0.8  # imperfect references leave room for RL
  assert max(len(tok.encode(p)) for p in prompts) <= 18


# --- real datasets in their sources' formats ----------------------------------------------------

def _post(i, length=40):
  return {"id": f"t3_{i}", "subreddit": "relationships", "title": f"Title {i}",
          "post": ("word " * length).strip(), "summary": f" summary {i}"}


def _write_jsonl(path, rows):
  path.parent.mkdir(parents=True, exist_ok=True)
  opener = gzip.open if str(path).endswith(".gz") else open
  with opener(path, "wt", encoding="utf-8") as f:
    for r in rows:
      f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")


def test_tldr_prompts(tmp_path):
  src = tmp_path / "src"
  _write_jsonl(src / "train.jsonl", [_post(0), _post(1, length=200), _post(2)])
  _write_jsonl(src / "valid.jsonl", [_post(3)])
  _write_jsonl(src / "test.jsonl", [_post(4), _post(5)])
  b = tldr.prepare_prompts(tmp_path / "out", source_dir=src, max_prompt_tokens=448)
  train = data.load_split(b, "train")
  assert len(train) == 2 and builder.stats(b)["train"] == {"dropped_too_long": 1, "kept": 2}
  assert train[0]["prompt"] == ("SUBREDDIT: r/relationships\nTITLE: Title 0\nPOST: "
                                + ("word " * 40).strip() + "\nTL;DR:")
  assert train[0]["answer"] == " summary 0" and train[1]["id"] == "t3_2"
  assert len(data.load_split(b, "test")) == 2
  # Another tokenizer, another token count and cache directory.
  class Words:
    name = "words"

    def encode(self, text):
      return text.split()

  b2 = tldr.prepare_prompts(tmp_path / "out", source_dir=src, max_prompt_tokens=100,
                            tokenizer=Words())
  assert b2.data_dir != b.data_dir
  assert builder.stats(b2)["train"] == {"dropped_too_long": 1, "kept": 2}


def _comparison(i, split="train", choice=1):
  return {"info": {"id": f"t3_{i}", "post": "my post", "title": "t", "subreddit": "s"},
          "summaries": [{"text": " first", "policy": "ref", "note": None},
                        {"text": " second", "policy": "sup", "note": None}],
          "choice": choice, "worker": "w", "batch": "batch3", "split": split,
          "extra": {"confidence": 7}}


def test_tldr_comparisons_and_errors(tmp_path):
  src = tmp_path / "src"
  _write_jsonl(src / "batch3.json", [_comparison(0), _comparison(1, "valid2", choice=0)])
  _write_jsonl(src / "batch4.json", [_comparison(2, "valid1")])
  b = tldr.prepare_comparisons(tmp_path / "out", source_dir=src, batches=["batch3", "batch4"])
  train = data.load_split(b, "train")
  assert train[0] == {"prompt": "SUBREDDIT: r/s\nTITLE: t\nPOST: my post\nTL;DR:",
                      "chosen": " second", "rejected": " first", "id": "t3_0"}
  assert data.load_split(b, "test")[0]["chosen"] == " first"
  assert len(data.load_split(b, "validation")) == 1

  bad = _comparison(5)
  del bad["summaries"][1]["text"]
  _write_jsonl(src / "batch5.json", [_comparison(4), bad])
  with pytest.raises(ValueError, match=r"batch5.json:2: missing field 'summaries.1.text'"):
    tldr.prepare_comparisons(tmp_path / "out", source_dir=src, batches=["batch5"])
  with pytest.raises(FileNotFoundError, match="batch6.json"):
    tldr.prepare_comparisons(tmp_path / "out", source_dir=src, batches=["batch6"])
  _write_jsonl(src / "batch7.json", [dict(_comparison(7), split="dev")])
  with pytest.raises(ValueError, match=r"batch7.json:1: field 'split' is 'dev'"):
    tldr.prepare_comparisons(tmp_path / "out", source_dir=src, batches=["batch7"])


def test_tldr_prompts_missing_field(tmp_path):
  src = tmp_path / "src"
  row = _post(0)
  del row["post"]
  _write_jsonl(src / "train.jsonl", [_post(1), row])
  _write_jsonl(src / "valid.jsonl", [_post(3)])
  _write_jsonl(src / "test.jsonl", [_post(4)])
  with pytest.raises(ValueError, match=r"train.jsonl:2: missing field 'post'"):
    tldr.prepare_prompts(tmp_path / "out", source_dir=src)


def _dialogue(human, reply, history=""):
  return f"{history}\n\nHuman: {human}\n\nAssistant: {reply}"


def test_hh_preferences(tmp_path):
  src = tmp_path / "src"
  h = _dialogue("hi", "hello")
  rows = [
      {"chosen": _dialogue("how are you?", "fine, thanks", h),
       "rejected": _dialogue("how are you?", "go away", h)},
      {"chosen": "\n\nHuman: no reply marker", "rejected": "\n\nHuman: no reply marker x"},
      {"chosen": _dialogue("q", "same"), "rejected": _dialogue("q", "same")},
      {"chosen": _dialogue("q" * 400, "a"), "rejected": _dialogue("q" * 400, "b")},
      {"chosen": _dialogue("q", "a"), "rejected": _dialogue("other", "b")},
  ]
  _write_jsonl(src / "helpful-base" / "train.jsonl.gz", rows)
  _write_jsonl(src / "helpful-base" / "test.jsonl.gz", rows[:1])
  b = hh.prepare(tmp_path / "out", source_dir=src, subsets=["helpful-base"])
  train = data.load_split(b, "train")
  assert len(train) == 1
  assert train[0]["prompt"] == h + "\n\nHuman: how are you?\n\nAssistant:"
  assert (train[0]["chosen"], train[0]["rejected"]) == (" fine, thanks", " go away")
  assert builder.stats(b)["train"] == {
      "kept": 1, "dropped_no_assistant_turn": 1, "dropped_identical_responses": 1,
      "dropped_too_long": 1, "dropped_context_mismatch": 1}

  _write_jsonl(src / "harmless-base" / "train.jsonl", [{"chosen": "x"}])  # unzipped copy is fine
  _write_jsonl(src / "harmless-base" / "test.jsonl.gz", [])
  with pytest.raises(ValueError, match=r"harmless-base/train.jsonl.gz:1: missing field 'rejected'"):
    hh.prepare(tmp_path / "out", source_dir=src, subsets=["harmless-base"])
  with pytest.raises(FileNotFoundError, match="helpful-online/train.jsonl.gz"):
    hh.prepare(tmp_path / "out", source_dir=src, subsets=["helpful-online"])

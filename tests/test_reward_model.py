"""Reward model (Bradley-Terry training, scorer, save/load, resolve) and the RLHF pipeline smoke."""
import dataclasses
import functools
import json
import os
import time

from flax import nnx
import jax
import numpy as np
import pytest

from conftest import count_traces, load_config
from rloo_jax import rewards
from rloo_jax.data import summarize
from rloo_jax.metrics import read_jsonl
from rloo_jax.models import transformer
from rloo_jax.rewards import reward_model as rm
from rloo_jax.rewards import scorer as rm_scorer
from rloo_jax.rewards import summarize_gold
from rloo_jax.rewards.preferences import win_rate_stats
from rloo_jax import preference_pairs as rlhf_pairs
from rloo_jax.rlhf import pipeline

TOK = summarize.make_tokenizer()
SEQ_LEN = 16


def quiet(*args, **kwargs):
  del args, kwargs


@functools.lru_cache(maxsize=None)  # one init compile for the whole module
def tiny_policy():
  cfg = transformer.TransformerConfig.llama(
      vocab_size=TOK.vocab_size, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
      head_dim=16, intermediate_size=64, max_seq_len=SEQ_LEN)
  return cfg, transformer.create(cfg, seed=3)[1]


def toy_pairs(n, seed):
  """Cleanly separable: the chosen summary is one of the document's topic words, the rejected
  one a filler word (also from the document)."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    doc = [summarize.FILLER_WORDS[i] for i in rng.integers(0, len(summarize.FILLER_WORDS), 6)]
    key = summarize.TOPIC_WORDS[rng.integers(len(summarize.TOPIC_WORDS))]
    doc.insert(int(rng.integers(0, 7)), key)
    out.append(dict(prompt=summarize.format_prompt(doc), chosen=key,
                    rejected=doc[0] if doc[0] != key else doc[1]))
  return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  cfg, params = tiny_policy()
  train, held_out = toy_pairs(384, 0), toy_pairs(96, 1)
  scorer, history = rm.train(
      cfg, params, TOK, train, seq_len=SEQ_LEN, eval_pairs=held_out, score_batch_size=32,
      options=rm.TrainOptions(steps=50, batch_size=32, learning_rate=3e-3, warmup_steps=5,
                              log_every=25), log=quiet)
  directory = str(tmp_path_factory.mktemp("rm"))
  calibrated = scorer.calibrate([p["prompt"] for p in train[:64]],
                                [p["chosen"] for p in train[:64]])
  calibrated = dataclasses.replace(calibrated, clip=2.0)
  calibrated.save(directory, step=50, extra={"note": "toy"})
  return cfg, params, scorer, calibrated, history, held_out, directory


def test_reward_model_separates_a_clean_toy_preference(trained):
  _, _, scorer, _, history, held_out, _ = trained
  assert history[-1]["eval_accuracy"] >= 0.9, history
  assert history[-1]["train_loss"] < history[0]["train_loss"]
  assert history[-1]["train_loss"] < np.log(2)  # below chance (equal scores give log 2)
  ev = rm.evaluate_pairs(scorer, held_out)
  assert ev["accuracy"] == pytest.approx(history[-1]["eval_accuracy"])
  assert ev["num_pairs"] == 96


def test_init_copies_the_policy_backbone_and_adds_a_fresh_head():
  cfg, params = tiny_policy()
  rm_cfg, _, rm_params = rm.init_from_policy(cfg, params, seed=1)
  assert rm_cfg.head == "scalar" and rm_cfg.replace(head="lm") == cfg
  src, dst = nnx.to_pure_dict(params), nnx.to_pure_dict(rm_params)
  assert set(src) - set(dst) == {"lm_head"} and set(dst) - set(src) == {"score_kernel",
                                                                         "score_bias"}
  for a, b in zip(jax.tree.leaves(src["layers"]), jax.tree.leaves(dst["layers"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_array_equal(np.asarray(src["embedding"]), np.asarray(dst["embedding"]))
  assert dst["score_kernel"].shape == (cfg.hidden_size, 1)
  bad = cfg.replace(hidden_size=64, head_dim=32)
  with pytest.raises(ValueError, match=r"policy shape .* vs reward model shape"):
    rm.init_from_policy(bad, params)


def test_scorer_whitening_and_clipping_numbers(trained):
  _, _, scorer, calibrated, _, _, _ = trained
  s = dataclasses.replace(scorer, whiten=True, mean=1.0, std=2.0, clip=1.5)
  np.testing.assert_allclose(s.normalise(np.array([1.0, 3.0, -5.0, 5.0, np.nan])),
                             [0.0, 1.0, -1.5, 1.5, np.nan])
  no_whiten = dataclasses.replace(scorer, clip=0.5)
  np.testing.assert_allclose(no_whiten.normalise(np.array([0.2, -0.9])), [0.2, -0.5])
  # calibrate(): the calibration samples come out with mean 0 and std 1 (before clipping).
  pairs = toy_pairs(64, 0)
  prompts, texts = [p["prompt"] for p in pairs], [p["chosen"] for p in pairs]
  z = dataclasses.replace(calibrated, clip=0.0)(prompts, texts)
  assert abs(z.mean()) < 1e-4 and z.std() == pytest.approx(1.0, abs=1e-4)
  assert calibrated.stats_samples == 64 and np.abs(calibrated(prompts, texts)).max() <= 2.0


def test_scorer_fixed_shapes_padding_and_unscorable(trained):
  _, _, scorer, _, _, held_out, _ = trained
  prompts = [p["prompt"] for p in held_out]
  texts = [p["chosen"] for p in held_out]
  all_rows = scorer.raw(prompts, texts)  # 96 rows = 3 chunks of 32
  size = rm_scorer._score._cache_size()
  few = scorer.raw(prompts[5:8], texts[5:8])  # 3 rows padded to one chunk of 32
  np.testing.assert_allclose(few, all_rows[5:8], rtol=1e-5, atol=1e-6)
  assert rm_scorer._score._cache_size() == size  # no recompile for another batch size
  before = scorer.num_unscorable
  out = scorer(prompts[:3] + ["doc: storm tl;dr:"], texts[:3] + ["zebra"])  # out of vocabulary
  assert np.isnan(out[3]) and np.isfinite(out[:3]).all()
  too_long = " ".join(["storm"] * SEQ_LEN)
  assert np.isnan(scorer.raw([prompts[0]], [too_long])).all()
  assert scorer.num_unscorable == before + 2
  assert scorer.raw([], []).shape == (0,)
  with pytest.raises(ValueError, match="2 prompts but 1 completions"):
    scorer.raw(prompts[:2], texts[:1])


def test_save_load_and_resolve(trained):
  _, _, _, calibrated, _, held_out, directory = trained
  prompts, texts = [p["prompt"] for p in held_out[:8]], [p["rejected"] for p in held_out[:8]]
  expected = calibrated(prompts, texts)
  loaded = rm.RewardModelScorer.load(directory)
  np.testing.assert_allclose(loaded(prompts, texts), expected, rtol=1e-5, atol=1e-6)
  assert loaded.meta["extra"] == {"note": "toy"} and loaded.tokenizer == TOK
  via_config = rewards.resolve(f"reward_model:{directory}")
  assert via_config is rewards.resolve(f"reward_model:{directory}")  # loaded once
  np.testing.assert_allclose(via_config(prompts, texts, answer=["x"] * 8), expected,
                             rtol=1e-5, atol=1e-6)
  assert via_config.batch_size == 32  # saved with the scorer: the compiled shape is reused
  raw = rewards.resolve(f"reward_model:{directory}?whiten=false&clip=0&batch_size=32")
  assert not raw.whiten and raw.clip == 0 and raw.batch_size == 32
  np.testing.assert_allclose(raw(prompts, texts), calibrated.raw(prompts, texts), rtol=1e-5,
                             atol=1e-6)
  assert rewards.resolve("rloo_jax.rewards.summarize_gold:gold_reward") is \
      summarize_gold.gold_reward


def test_bad_inputs_fail_fast_with_clear_messages(tmp_path, trained):
  _, _, scorer, _, _, _, directory = trained
  start = time.time()
  with pytest.raises(FileNotFoundError, match=r"reward model directory .*nowhere does not exist"):
    rewards.resolve(f"reward_model:{tmp_path}/nowhere")
  with pytest.raises(FileNotFoundError, match=r"holds no reward-model checkpoint"):
    rm.RewardModelScorer.load(str(tmp_path))
  with pytest.raises(ValueError, match=r"unknown or valueless option 'temperature=2'"):
    rewards.resolve(f"reward_model:{directory}?temperature=2")
  with pytest.raises(ValueError, match=r"option clip='x' is not a float"):
    rewards.resolve(f"reward_model:{directory}?clip=x")
  with pytest.raises(ValueError, match=r"expected 'reward_model:<directory>'"):
    rewards.resolve("reward_model:")
  bad_meta = tmp_path / "other" / "checkpoints" / "1" / "meta"
  bad_meta.mkdir(parents=True)
  (bad_meta / "metadata").write_text(json.dumps({"format": "something else"}))
  with pytest.raises(ValueError, match=r"is not a reward model saved by rloo_jax"):
    rm.read_meta(str(tmp_path / "other"))
  with pytest.raises(ValueError, match=r"needs head='scalar'"):
    rm.RewardModelScorer(scorer.model_config.replace(head="lm"), scorer.params, TOK, seq_len=8)
  with pytest.raises(ValueError, match=r"whitening needs a finite mean and a positive std"):
    rm.RewardModelScorer(scorer.model_config, scorer.params, TOK, seq_len=8, whiten=True, std=0.0)
  with pytest.raises(ValueError, match=r"seq_len=99 exceeds the reward model's context of 16"):
    rm.RewardModelScorer(scorer.model_config, scorer.params, TOK, seq_len=99)
  cfg, params = tiny_policy()
  with pytest.raises(ValueError, match=r"preference pair 0 has no 'rejected' field"):
    rm.train(cfg, params, TOK, [dict(prompt="doc: a tl;dr:", chosen="a")], seq_len=8,
             options=rm.TrainOptions(), log=quiet)
  with pytest.raises(ValueError, match=r"no training preference pairs"):
    rm.train(cfg, params, TOK, [], seq_len=8, options=rm.TrainOptions(), log=quiet)
  with pytest.raises(ValueError, match=r"1 prompts, 1 chosen and 2 rejected"):
    rm.make_pair_batch(["p"], ["a"], ["b", "c"], TOK, 8)
  assert time.time() - start < 10  # all before any compile


@pytest.mark.parametrize("override, message", [
    ({"rlhf.samples_per_prompt": 1}, r"samples_per_prompt = 1: a preference pair needs"),
    ({"rlhf.pairs_per_prompt": 3}, r"pairs_per_prompt = 3: need 1 <= pairs_per_prompt <= "
                                   r"samples_per_prompt / 2 = 2"),
    ({"rlhf.eval_pair_fraction": 1.0}, r"eval_pair_fraction = 1.0 must be in \(0, 1\)"),
    ({"rlhf.sample_temperature": 0.0}, r"sample_temperature = 0.0 must be > 0"),
    ({"rlhf.gold_reward": "rloo_jax.rewards.summarize_gold:no_gold"},
     r"has no attribute 'no_gold'"),
    ({"rloo.max_new_tokens": 12}, r"20\) \+ config\.rloo\.max_new_tokens \(12\) \+ 1 = 33 exceeds "
                                  r"config\.model\.max_seq_len = 32"),
])
def test_pipeline_config_validation(tmp_path, override, message):
  config = load_config(name="summarize")
  config.update_from_flattened_dict(override)
  start = time.time()
  with pytest.raises((ValueError, FileNotFoundError), match=message):
    pipeline.run(config, str(tmp_path), log=quiet)
  assert time.time() - start < 5 and not os.listdir(tmp_path)  # nothing prepared or compiled


def test_missing_rlhf_section_is_named():
  with pytest.raises(ValueError, match=r"no `rlhf` section .* configs/summarize\.py"):
    pipeline.validate(load_config(name="arithmetic"))


def test_win_rate_on_hand_made_cases():
  s = win_rate_stats([1.0, 0.5, 0.2, np.nan], [0.5, 0.5, 0.9, 0.0])
  assert s == dict(win_rate=0.5, wins=1, ties=1, losses=1, n=3)
  assert win_rate_stats([1, 1, 1], [1, 1, 1])["win_rate"] == 0.5  # all ties: half each
  assert win_rate_stats([2, 2, 0, 0], [1, 1, 1, 1])["win_rate"] == 0.5
  assert win_rate_stats([2, 2, 2, 1], [1, 1, 1, 1])["win_rate"] == 0.875
  assert win_rate_stats([0.0], [1.0])["win_rate"] == 0.0
  assert np.isnan(win_rate_stats([np.nan], [1.0])["win_rate"])
  a, b = np.random.default_rng(0).integers(0, 3, (2, 50)).astype(float)
  by_hand = (np.sum(a > b) + 0.5 * np.sum(a == b)) / len(a)
  assert win_rate_stats(a, b)["win_rate"] == pytest.approx(by_hand)
  with pytest.raises(ValueError, match="one score per prompt"):
    win_rate_stats([1.0, 2.0], [1.0])


def test_make_pairs_labels_and_skips_identical_samples():
  prompts = ["doc: storm the river tl;dr:", "doc: the market a tl;dr:", "doc: a storm tl;dr:"]
  samples = [["the", "storm river", "the"], ["market", "market"], ["storm", "a storm"]]
  pairs, counts = rlhf_pairs.make_pairs(prompts, samples, summarize_gold.gold_reward,
                                        np.random.default_rng(0), bt_temperature=0.0,
                                        pairs_per_prompt=2)
  assert counts == dict(num_prompts=3, no_distinct_samples=1, unscorable=0)
  assert [p["prompt"] for p in pairs] == [prompts[0], prompts[2]]  # 2 distinct texts: one pair
  assert [(p["chosen"], p["rejected"]) for p in pairs] == [("storm river", "the"),
                                                           ("storm", "a storm")]
  for p in pairs:
    assert p["gold_chosen"] > p["gold_rejected"]  # noiseless labels follow gold
  four = ["storm", "river", "storm river", "the"]
  pairs, _ = rlhf_pairs.make_pairs(prompts[:1], [four], summarize_gold.gold_reward,
                                   np.random.default_rng(1), bt_temperature=0.0,
                                   pairs_per_prompt=2)
  assert len(pairs) == 2  # disjoint: every sample used once
  assert sorted(t for p in pairs for t in (p["chosen"], p["rejected"])) == sorted(four)
  both = pairs + [dict(p, prompt="other") for p in pairs]
  train, held_out = rlhf_pairs.split_by_prompt(both, 0.5)
  assert {p["prompt"] for p in train} == {prompts[0]} and {p["prompt"] for p in held_out} == {"other"}


def test_rlhf_pipeline_smoke(tmp_path, monkeypatch):
  """SFT -> pairs -> RM -> RLOO -> evaluation at a tiny size, then a rerun reuses every stage."""
  from rloo_jax import sft  # pylint: disable=import-outside-toplevel
  workdir = str(tmp_path / "rlhf")
  config = load_config(name="summarize")
  sft_traces = count_traces(monkeypatch, sft, "sft_step")
  rm_traces = count_traces(monkeypatch, rm, "train_step")
  # The RL stage goes through the algorithm's preflight, as algorithms.run does (its budget).
  from rloo_jax.algorithms.rloo import RLOO  # pylint: disable=import-outside-toplevel
  preflights = []
  real_preflight = RLOO.preflight
  monkeypatch.setattr(RLOO, "preflight", lambda self, log=print: (
      preflights.append(self), real_preflight(self, log))[1])
  summary = pipeline.run(config, workdir, log=quiet)
  assert len(preflights) == 1
  # The SFT and reward-model steps compile once each: their counters start on the mesh the
  # steps return them on (started on one device, each step compiled again at step 2).
  assert len(sft_traces) == 1 and len(rm_traces) == 1, (sft_traces, rm_traces)
  for name in ("rlhf_table.md", "rlhf_summary.json", "gold_vs_proxy.png", "reward_vs_kl.png",
               "timings.json", "pairs/pairs.json", "rloo/metrics.jsonl"):
    assert os.path.exists(os.path.join(workdir, name)), name
  with open(os.path.join(workdir, "gold_vs_proxy.png"), "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  assert summary["rloo_iterations"] == 2 and len(summary["history"]) == 2
  assert [e["step"] for e in summary["evals"]] == [0, 1, 2]
  for h in summary["history"]:
    assert np.isfinite([h["gold_reward"], h["proxy_reward"], h["kl"]]).all()
  # The RL stage trains on the proxy (the reward model) and logs the hidden gold reward beside
  # it at weight 0: every rollout row of its metrics carries both, and the history is read
  # from them.
  rl_rows = [r for r in read_jsonl(os.path.join(workdir, "rloo", "metrics.jsonl"))
             if "train/loss" in r]
  assert [r["step"] for r in rl_rows] == [1, 2]
  for r, h in zip(rl_rows, summary["history"]):
    assert np.isfinite([r["train/reward/gold"], r["train/reward/proxy"]]).all(), r
    assert h["gold_reward"] == r["train/reward/gold"]
    assert h["proxy_reward"] == r["train/reward_mean"]
    # The policy's reward is the proxy alone (weight 1; gold has weight 0).
    assert r["train/reward_mean"] == pytest.approx(r["train/reward/proxy"], abs=1e-5)
  with open(os.path.join(workdir, "rloo", "summary.json")) as f:
    rl_summary = json.load(f)
  assert rl_summary["algorithm"] == "rloo" and rl_summary["reward"] == "gold"
  assert summary["sft"]["win_rate"] == 0.5
  assert 0.0 <= summary["rloo"]["win_rate"] <= 1.0
  assert 0.0 <= summary["rloo_sampled"]["win_rate"] <= 1.0
  assert summary["rloo"]["n"] == config.rlhf.eval_prompts
  assert summary["pairs"]["train"] + summary["pairs"]["eval"] > 0
  assert 0.0 <= summary["reward_model"]["eval"]["accuracy"] <= 1.0
  assert summary["reward_model"]["whiten"] and summary["reward_model"]["std"] > 0
  table = open(os.path.join(workdir, "rlhf_table.md")).read()
  assert "win rate vs SFT (gold judge, ties half)" in table and "reward model" in table
  # The trained policy and the learned reward both stay usable: the RM dir resolves from a config.
  scorer = rewards.resolve(f"reward_model:{workdir}/reward_model")
  assert scorer.whiten and np.isfinite(scorer(["doc: storm a tl;dr:"], ["storm"])).all()

  logs = []
  again = pipeline.run(config, workdir, log=logs.append)
  text = "\n".join(map(str, logs))
  assert "restored the cached SFT policy" in text and "reusing" in text
  assert "resumed from iteration 2" in text and "[rloo] iteration" not in text
  assert again["rloo"]["gold_reward"] == pytest.approx(summary["rloo"]["gold_reward"])

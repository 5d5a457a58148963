"""The paper's configs (configs/tldr.py, hh.py, gsm8k.py) and configs/math.py: their settings,
their tasks' data (the paper's prompt formats and length filters, with counts), DPO on the tasks'
own preference data, and each `:smoke` variant end to end on a tiny random checkpoint."""
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, load_config
from rloo_jax import algorithms, experiment, tasks
from rloo_jax.data.builder import stats

SMOKE_RUNS = ("tldr", "hh", "gsm8k", "math")


@pytest.mark.parametrize("name,model,beta,prompt_len", [
    ("tldr", "pythia-6.9b", 0.03, 448), ("hh", "pythia-6.9b", 0.10, 348),
    ("hh", "llama-2-7b", 0.10, 348)])
def test_the_paper_settings(name, model, beta, prompt_len):
  c = load_config(f"model={model},k=4", name)
  assert (c.model.preset, c.model.init_from) == (model, "")
  assert c.kl.beta == beta and c.data.max_prompt_len == prompt_len
  # 512 completions per rollout batch in 2 optimizer steps, lr 1e-6 after a 3% warm-up.
  assert c.rloo.k * c.rloo.num_prompts == 512 and c.train.num_minibatches == 2
  assert c.train.num_epochs == 1 and c.train.num_iterations == 600
  assert c.optim.learning_rate == 1e-6 and c.optim.schedule == "constant"
  assert c.optim.warmup_steps == int(0.03 * 600 * 2)
  # The settings the plan shows fit 8 x 80 GB with room (docs/SCALE.md): matmul outputs kept,
  # each minibatch in one pass.
  assert (c.model.remat, c.train.microbatch_size) == ("dots", 0)
  experiment.validate_config(c)
  # A checkpoint path instead of a preset goes to init_from.
  c = load_config("model=/ckpt/sft,rm=/ckpt/rm", name)
  assert (c.model.preset, c.model.init_from) == ("", "/ckpt/sft")
  assert list(c.rewards.fns) == ["hf_reward_model:/ckpt/rm"]


def test_gsm8k_is_verls_rloo_example():
  c = load_config("model=qwen2-7b", "gsm8k")
  assert (c.rloo.num_prompts, c.rloo.k, c.data.max_prompt_len, c.rloo.max_new_tokens) == (
      1024, 5, 512, 1024)
  assert 1024 // c.train.num_minibatches == 256 and c.optim.learning_rate == 1e-6
  assert c.kl.beta == 0.001 and list(c.rewards.fns) == ["rloo_jax.rewards.verifiers:gsm8k"]
  assert c.model.remat == "dots"  # where veRL recomputes whole layers: the plan fits it in 72 GiB
  single = load_config("single,model=qwen2.5-0.5b,lora=16", "gsm8k")
  assert single.model.lora.rank == 16 and single.rloo.num_prompts == 128
  assert single.model.remat == "full"  # one device: the room goes to the batch
  assert load_config("single", "gsm8k").model.init_from == "Qwen/Qwen2.5-0.5B-Instruct"


def test_math_is_deepscalers_first_stage():
  c = load_config("", "math")
  assert (c.rloo.num_prompts, c.rloo.k, c.data.max_prompt_len, c.rloo.max_new_tokens) == (
      128, 8, 1024, 8192)
  assert (c.rloo.temperature, c.optim.learning_rate, c.train.num_minibatches) == (0.6, 1e-6, 2)
  assert c.model.init_from == "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B" and c.sft.steps == 0
  assert list(c.rewards.fns) == ["rloo_jax.rewards.math_answer:math_answer?think=true"]
  assert c.train.microbatch_tokens == "auto" and c.train.eval_samples == 16
  assert c.rloo.decode_layers == "unstacked"  # what the plan advises (docs/USAGE.md)
  later = load_config("max_new_tokens=24576,lora=16,model=deepseek-r1-distill-qwen-1.5b", "math")
  assert later.rloo.max_new_tokens == 24576
  assert later.model.preset == "deepseek-r1-distill-qwen-1.5b"
  assert later.model.lora.rank == 16 and later.rloo.decode_layers == "auto"


def test_a_paper_task_without_a_checkpoint_or_reward_model_names_the_fix(tmp_path):
  c = load_config("model=pythia-1b", "tldr")
  with pytest.raises(ValueError, match=r"config\.model\.init_from"):
    tasks.make(c, str(tmp_path))
  with pytest.raises(ValueError, match=r"rm= argument"):
    experiment.build(c, str(tmp_path))
  assert not os.listdir(tmp_path)  # refused before anything was prepared or written


def test_tldr_prompts_are_formatted_and_long_ones_dropped_and_counted(tmp_path, capsys):
  c = load_config("smoke", "tldr")
  task = tasks.make(c, str(tmp_path))
  record = task.train[0]
  assert record["prompt"].startswith("SUBREDDIT: r/") and record["prompt"].endswith("\nTL;DR:")
  assert record["answer"].startswith(" ")  # responses start with one space, as the paper's
  counted = {split: s for split, s in stats(os.path.join(
      tmp_path, "tldr_prompts", os.listdir(tmp_path / "tldr_prompts")[0], "1.0.0")).items()}
  # Every fixture prompt over 52 tokens of the checkpoint's tokenizer is gone, and counted.
  count = lambda text: len(task.tokenizer.encode(text))
  with open(os.path.join(c.data.source_dir, "train.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  too_long = sum(count(f"SUBREDDIT: r/{r['subreddit']}\nTITLE: {r['title']}\nPOST: {r['post']}"
                       "\nTL;DR:") > 52 for r in rows)
  assert too_long >= 3 and counted["train"]["dropped_too_long"] == too_long
  assert len(task.train) == len(rows) - too_long
  assert f"[data] tldr train: kept {len(rows) - too_long}; dropped: too_long {too_long}" in (
      capsys.readouterr().out)


def test_hh_prompts_end_at_the_last_assistant_turn_and_chosen_is_the_reference(tmp_path):
  task = tasks.make(load_config("smoke", "hh"), str(tmp_path))
  record = task.train[0]
  assert record["prompt"].startswith("\n\nHuman:") and record["prompt"].endswith("Assistant:")
  assert record["answer"] == record["chosen"] != record["rejected"]
  assert len(task.preferences()) == len(task.train)


def test_dpo_trains_on_the_tasks_preference_data(tmp_path):
  c = load_config("smoke", "tldr")
  with c.unlocked():
    c.algorithm = "dpo"
    c.dpo = dict(pairs="dataset", num_pair_prompts=8, steps=2, batch_size=4, eval_every=2)
    # DPO's pairs need no reward: an exact match stands in for the reward model (the dry run
    # before the build needs one that scores the reference summaries).
    c.rewards.fns = ["rloo_jax.rewards.verifiers:arithmetic_exact_match"]
  c = algorithms.resolve(c)[1]
  exp = experiment.build(c, str(tmp_path))
  from rloo_jax.algorithms import dpo
  pairs = dpo.dataset_pairs(c, exp)
  assert len(pairs) == 8 and all(p["chosen"] != p["rejected"] for p in pairs)
  assert all(p["prompt"].endswith("TL;DR:") for p in pairs)
  g = load_config("smoke", "gsm8k")
  with g.unlocked():
    g.algorithm, g.dpo = "dpo", dict(pairs="dataset")
  g = algorithms.resolve(g)[1]
  with pytest.raises(ValueError, match="task 'gsm8k' has no preference data"):
    dpo.dataset_pairs(g, experiment.build(g, str(tmp_path / "g")))


@pytest.mark.parametrize("name", SMOKE_RUNS)
def test_the_smoke_config_trains_end_to_end(name, tmp_path):
  """`python -m rloo_jax.train --config=configs/<name>.py:smoke`: the task's data prepared from
  its source-format files, the tiny checkpoint loaded, rollouts scored by the config's reward
  (the tiny reward-model checkpoint for tldr / hh, the verifier for gsm8k), RLOO, evaluation."""
  out = subprocess.run(
      [sys.executable, "-m", "rloo_jax.train", f"--config=configs/{name}.py:smoke",
       f"--workdir={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  summary = json.load(open(tmp_path / "summary.json"))
  assert summary["iterations"] == 2
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  train = [r for r in rows if "train/reward_mean" in r]
  assert len(train) == 2 and all(r["train/reward_mean"] == r["train/reward_mean"] for r in train)
  if name in ("gsm8k", "math"):
    return
  # The paper's evaluation on the trained run: greedy win rate against the references (TL;DR's
  # summaries, HH's chosen responses), judged by the tiny reward model (Bradley-Terry).
  fixtures = os.path.join(REPO, "tests", "fixtures")
  judge = (f"reward:hf_reward_model:{fixtures}/hf_rm/gpt_neox?tokenizer={fixtures}/hf/gpt_neox"
           "&batch_size=4&dtype=float32")
  out = subprocess.run([sys.executable, "-m", "rloo_jax.winrate", f"--workdir={tmp_path}",
                        f"--judge={judge}"], cwd=REPO, capture_output=True, text=True,
                       timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  r = json.loads(out.stdout.strip().splitlines()[-1])
  assert r["step"] in (1, 2) and r["n"] + r["n_unjudged"] + r["n_overlong"] == r["num_prompts"]
  assert r["n"] > 0 and r["win_rate"] == pytest.approx((r["wins"] + 0.5 * r["ties"]) / r["n"])

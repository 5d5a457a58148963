"""The command line: list settings as comma-separated values, the prompts a run leaves out, what
init_from overrides, and the paths a run reports."""
import json
import logging
import os
import subprocess
import sys

import ml_collections

from conftest import REPO
from rloo_jax import config_utils
from rloo_jax.models import config as model_config


def test_rewards_from_the_command_line_and_dropped_prompts_reported(tmp_path):
  reward = tmp_path / "const_reward.py"
  reward.write_text("import numpy as np\n"
                    "def const(prompts, completions, **fields):\n"
                    "  return np.full(len(completions), 0.25)\n")
  wd = tmp_path / "wd"
  out = subprocess.run(
      [sys.executable, "-m", "rloo_jax.train", "--config=configs/arithmetic.py:smoke",
       f"--workdir={wd}", "--config.train.num_iterations=1", "--config.data.max_prompt_len=6",
       f"--config.rewards.fns={reward}:const,rloo_jax.rewards.verifiers:arithmetic_exact_match",
       "--config.rewards.weights=1,0"],
      cwd=REPO, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  # 2-digit + 2-digit problems are 7 tokens with bos: left out, and said so at the start.
  line = next(l for l in out.stdout.splitlines() if "training prompts are longer" in l)
  assert line.startswith("[data] ")
  assert "of 256 training prompts are longer than config.data.max_prompt_len=6" in line
  assert int(line.split()[1]) > 0
  held_out = next(l for l in out.stdout.splitlines() if "held-out prompts are longer" in l)
  assert held_out.startswith("[data] ") and " of 16 held-out prompts" in held_out
  rows = [json.loads(l) for l in open(wd / "metrics.jsonl")]
  train = [r for r in rows if "train/reward_mean" in r]
  assert train[0]["train/reward/const"] == 0.25 and train[0]["train/reward_mean"] == 0.25
  assert "train/reward/arithmetic_exact_match" in train[0]  # weight 0: monitored only
  summary = json.load(open(wd / "summary.json"))
  assert summary["reward"] == "const" and summary["before"]["greedy_reward"] == 0.25
  assert summary["iterations"] == 1 and len(train) == 1
  assert f"wrote {wd}: summary.json, metrics.jsonl" in out.stdout


def test_init_from_names_the_settings_it_overrides(caplog):
  # Set away from their defaults (128, 32, 32): a default nobody set is not warned about.
  m = ml_collections.ConfigDict(dict(init_from="/ckpt", family="llama", hidden_size=96,
                                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=24,
                                     intermediate_size=384, max_seq_len=48))
  ckpt = model_config.TransformerConfig.llama(vocab_size=99, hidden_size=64, num_layers=2,
                                              num_heads=4, num_kv_heads=2, head_dim=16,
                                              intermediate_size=384, max_seq_len=2048)
  with caplog.at_level(logging.WARNING):
    config_utils.warn_overridden(m, ckpt)
  text = caplog.text
  assert "config.model.hidden_size=96 (the checkpoint has 64)" in text
  assert "config.model.head_dim=24 (the checkpoint has 16)" in text
  assert "max_seq_len=48 (the checkpoint has 2048)" in text
  assert "num_layers" not in text  # equal settings are not mentioned


def test_weights_and_biases_gets_the_same_rows_offline(tmp_path, monkeypatch):
  import wandb
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_SILENT", "true")
  from rloo_jax.metrics import MetricWriter, read_jsonl
  logged = []
  real_init = wandb.init

  def init(**kwargs):
    run = real_init(**kwargs)
    original = run.log
    run.log = lambda data, step=None: (logged.append((step, dict(data))), original(data, step=step))
    return run

  monkeypatch.setattr(wandb, "init", init)
  w = MetricWriter(str(tmp_path), tensorboard=False, wandb_project="rloo-test",
                   wandb_config={"rloo.k": 4})
  w.write(1, {"reward_mean": 0.5, "kl": float("nan")}, prefix="train/")
  w.write(1, {"greedy_reward": 0.75}, prefix="eval/")
  w.close()
  rows = read_jsonl(str(tmp_path / "metrics.jsonl"))
  assert rows == [{"step": 1, "train/reward_mean": 0.5, "train/kl": None},
                  {"step": 1, "eval/greedy_reward": 0.75}]
  # The same rows, non-finite values left out (as in TensorBoard).
  assert logged == [(1, {"train/reward_mean": 0.5}), (1, {"eval/greedy_reward": 0.75})]
  assert os.path.isdir(tmp_path / "wandb")  # the offline run is kept in the workdir


def test_local_datasets_say_generating_not_downloading(tmp_path, capsys):
  from rloo_jax.data import arithmetic
  arithmetic.prepare(str(tmp_path), num_train=8, num_test=4)
  first = capsys.readouterr().out
  assert first.startswith("[data] generating arithmetic") and "Downloading" not in first
  arithmetic.prepare(str(tmp_path), num_train=8, num_test=4)  # prepared: silent
  assert capsys.readouterr().out == ""


def test_the_compilation_cache_is_on_by_default_under_the_user_cache(monkeypatch, tmp_path):
  import ml_collections  # pylint: disable=import-outside-toplevel
  from rloo_jax import cli  # pylint: disable=import-outside-toplevel
  config = ml_collections.ConfigDict({"train": {"compilation_cache_dir": "auto"}})
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  assert cli.compilation_cache_dir(config) == f"{tmp_path}/rloo_jax/xla"
  monkeypatch.delenv("XDG_CACHE_HOME")
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  assert cli.compilation_cache_dir(config) == f"{tmp_path}/home/.cache/rloo_jax/xla"
  config.train.compilation_cache_dir = "~/elsewhere"
  assert cli.compilation_cache_dir(config) == f"{tmp_path}/home/elsewhere"
  config.train.compilation_cache_dir = ""
  assert cli.compilation_cache_dir(config) == ""
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/from/env")
  assert cli.compilation_cache_dir(config) == "/from/env"


def test_a_cache_directory_that_cannot_be_written_is_said_and_turned_off(monkeypatch, tmp_path):
  import jax  # pylint: disable=import-outside-toplevel
  from rloo_jax import cli  # pylint: disable=import-outside-toplevel
  (tmp_path / "a_file").write_text("")
  bad = str(tmp_path / "a_file" / "xla")  # under a file: no directory can be made there
  config = ml_collections.ConfigDict({"train": {"compilation_cache_dir": bad}})
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
  monkeypatch.setattr(jax.config, "update", lambda *a: updates.append(a))
  updates, lines = [], []
  assert cli.setup_compilation_cache(config, log=lines.append) == ""
  assert lines == [f"[compile] cannot write the compilation cache {bad} (NotADirectoryError: Not "
                   f"a directory): nothing is kept between starts; set "
                   f"--config.train.compilation_cache_dir (or env JAX_COMPILATION_CACHE_DIR) to "
                   f"a writable directory, or '' for none"]
  assert updates == [("jax_enable_compilation_cache", False)]
  config.train.compilation_cache_dir = str(tmp_path / "fine")  # made, and set
  assert cli.setup_compilation_cache(config, log=lines.append) == str(tmp_path / "fine")
  assert len(lines) == 1 and ("jax_compilation_cache_dir", str(tmp_path / "fine")) in updates
  # Off already (processes whose cache keys differ, or env): left off, nothing said.
  updates.clear()
  from jax._src import config as jax_config  # pylint: disable=import-outside-toplevel
  with jax_config.enable_compilation_cache(False):
    assert cli.setup_compilation_cache(config, log=lines.append) == "" and not updates
  assert len(lines) == 1

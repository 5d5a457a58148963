r"""Your own task: a JSONL file of prompts and your own reward function (docs/YOUR_TASK.md).

Copy this file and configs/examples/my_reward.py, point the data paths at your files and the
reward at your function. As shipped it runs the example keyword task next to it: a small
byte-level policy trained from scratch by SFT on the records' (imperfect) answers, then RLOO
against `contains_keyword`, which reads each record's extra `keyword` field.

    python -m rloo_jax.train --config=configs/examples/jsonl_task.py --workdir=/tmp/mine
    python -m rloo_jax.train --config=configs/examples/jsonl_task.py:smoke --workdir=/tmp/mine_smoke
    python -m rloo_jax.train --config=configs/examples/jsonl_task.py --workdir=/tmp/mine2 \
        --config.data.jsonl_train=/data/train.jsonl --config.data.jsonl_test=/data/test.jsonl

Add `--config.model.init_from=/path/to/hf_dir` to start from a local Hugging Face checkpoint
(its tokenizer replaces the byte tokenizer, no SFT stage); then also raise the lengths below to
fit your data in that tokenizer's tokens.
"""
import os

from rloo_jax.config_utils import base_config, parse_arg

# Paths relative to this file, so the config works from any directory (and from a copy that
# sits next to its own data and reward file).
HERE = os.path.dirname(os.path.abspath(__file__))


def get_config(arg=None):
  arg = parse_arg(arg, smoke=False, k=4, seed=0)
  c = base_config()
  c.seed = arg.seed
  c.task = "jsonl"
  c.data.jsonl_train = os.path.join(HERE, "keyword_train.jsonl")
  c.data.jsonl_test = os.path.join(HERE, "keyword_test.jsonl")
  # Lengths are in tokens: UTF-8 bytes without init_from (plus one bos per prompt). A prompt
  # longer than max_prompt_len is dropped and counted (config.data.overlong='error' to fail);
  # an SFT answer must fit max_new_tokens (with its eos) or its record is not imitated.
  c.data.max_prompt_len = 20
  c.rloo.max_new_tokens = 16
  c.model.max_seq_len = 36  # >= max_prompt_len + max_new_tokens
  c.rloo.k = arg.k
  # The first reward is trained on and judges the win rates; weight 0 = monitored only
  # (reward/near_target_length in metrics.jsonl). Entries are file paths or import paths.
  reward_file = os.path.join(HERE, "my_reward.py")
  c.rewards.fns = [f"{reward_file}:contains_keyword", f"{reward_file}:near_target_length"]
  c.rewards.weights = [1.0, 0.0]
  # The arithmetic recipe's rates (configs/arithmetic.py). 600 SFT steps fit the example's 360
  # demonstrations without memorising them: an SFT policy that always writes one answer gives
  # k identical samples, hence zero advantages (docs/YOUR_TASK.md). demo_error_rate stays 0: a
  # JSONL task imitates its answers as written (this example's data has its errors built in).
  c.sft.learning_rate = 1e-3
  c.sft.steps = 600
  c.optim.learning_rate = 1e-4
  c.train.eval_every = 25
  if arg.smoke:  # everything shrunk: the whole pipeline in seconds (tests use this)
    c.model.update(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                   intermediate_size=64)
    c.sft.update(steps=20, batch_size=8, log_every=10)
    c.rloo.update(num_prompts=4, max_new_tokens=8)
    c.model.max_seq_len = 28
    c.train.update(num_iterations=2, eval_every=2, eval_prompts=8, eval_batch_size=8,
                   checkpoint_every=1, progress_bar=False)
  return c

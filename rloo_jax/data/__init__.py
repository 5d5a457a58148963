"""Datasets (tfds builders written as array_record, read without TensorFlow) and grain batching.

  arithmetic.prepare(dir, ...)  embedded default task: addition, exact-answer verifier
  summarize.prepare(dir, ...)   embedded preference task (its hidden gold reward is
                                rloo_jax.rewards.summarize_gold, not data)
  tldr.prepare_prompts / tldr.prepare_comparisons / hh.prepare / gsm8k.prepare   real datasets
  load_split(builder_or_dir, split) -> random-access source of str records
  JsonlSource(path)             a JSONL file of prompts (optional answers)
  prompt_batches / sft_batches  checkpointable, multi-host batch iterators
"""

from rloo_jax.data.builder import load_split
from rloo_jax.data.builder import stats
from rloo_jax.data.jsonl import JsonlSource
from rloo_jax.data.pipeline import BatchIterator
from rloo_jax.data.pipeline import encode_prompts
from rloo_jax.data.pipeline import make_sft_batch
from rloo_jax.data.pipeline import prompt_batches
from rloo_jax.data.pipeline import sft_batches
from rloo_jax.data.tokenizer import ByteTokenizer
from rloo_jax.data.tokenizer import CharTokenizer
from rloo_jax.data.tokenizer import WordTokenizer

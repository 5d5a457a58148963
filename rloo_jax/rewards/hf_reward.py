"""Hugging Face reward models (*ForSequenceClassification, num_labels=1) as reward functions,
sharded over the mesh and scored in device batches.

    hf_reward_model:<local dir or hub id>[?name=value&...]
    hf_reward_model:Skywork/Skywork-Reward-Llama-3.1-8B-v0.2?max_len=2048&batch_size=128
    hf_reward_model:/ckpt/rm?tokenizer=/ckpt/policy&dtype=float32&whiten=true&mean=0.4&std=2.1

Options: dtype (bfloat16 | float32: weights and activations; scores are float32 either way),
batch_size (rows per device batch, a multiple of the mesh's batch parallelism), max_len (longest
row scored; longer rows get NaN), tokenizer (a directory or hub id, default the checkpoint's),
format ('hf': `tokenizer(prompt + completion)` with the tokenizer's own special tokens, pooled
at the last token that is not pad_token_id, as transformers pools; 'sft': `[bos] prompt
completion eos` scored at the eos, the layout `reward_model:` trains on), whiten / mean / std /
clip (as for `reward_model:`). A checkpoint exported from a `reward_model:` directory
(`export_reward_model`) carries its format, length and whitening statistics in config.json's
'rloo_jax_reward' entry, which set the defaults.

The weights are loaded straight into the layout's parameter shardings (`hf.load_checkpoint`),
FSDP-gathered one layer at a time in the forward (`Layout.param_gather`), and each device batch
is split over the layout's batch axes, so every device scores a slice of it. Rows are grouped
into power-of-two length buckets and padded to (batch_size, bucket): one compiled program per
bucket, reused by calls of any size. The experiment passes its own layout (config.mesh); without
one the model is sharded FSDP over all devices.
"""

from __future__ import annotations

import functools
import json
import math
import os
from typing import Optional, Sequence

from absl import logging
import jax
import numpy as np

from rloo_jax import config_utils, platform, sharding
from rloo_jax.models import hf
from rloo_jax.models import hf_export
from rloo_jax.models import transformer
from rloo_jax.rewards import scorer

OPTIONS = {"dtype": str, "batch_size": int, "max_len": int, "tokenizer": str, "format": str,
           "whiten": bool, "mean": float, "std": float, "clip": float}
DTYPES = ("bfloat16", "float32")
FORMATS = ("hf", "sft")
EXTRA_KEY = "rloo_jax_reward"  # config.json entry written by export_reward_model
DEFAULT_BATCH_SIZE = 64
# The shortest length bucket: below it a second compile costs more than the padding saves.
MIN_BUCKET = 32


def buckets(max_len: int) -> tuple[int, ...]:
  """The padded lengths rows are scored at: powers of two from MIN_BUCKET, capped at max_len."""
  out, n = [], MIN_BUCKET
  while n < max_len:
    out.append(n)
    n *= 2
  return tuple(out) + (max_len,)


def default_layout() -> sharding.Layout:
  """FSDP over every device (the default config's rules): the weights split, the rows too."""
  rules = config_utils.base_config().mesh.rules
  return sharding.make_layout(dict(data=1, fsdp=-1, tensor=1, rules=rules))


class HFRewardModel:
  """`fn(prompts, completions, **fields) -> float32 [N]`: a sequence-classification checkpoint's
  score of each prompt + completion, NaN where a row has more than `max_len` tokens or (format
  'hf') no text at all."""

  def __init__(self, config: transformer.TransformerConfig, params, tokenizer,
               layout: sharding.Layout, *, batch_size: int, max_len: int, format: str = "hf",
               pad_token_id: Optional[int] = None, add_bos: bool = True, whiten: bool = False,
               mean: float = 0.0, std: float = 1.0, clip: float = 0.0,
               name: str = "hf_reward_model"):
    self.config, self.params, self.tokenizer, self.layout = config, params, tokenizer, layout
    self.batch_size, self.max_len, self.format = int(batch_size), int(max_len), format
    self.pad_token_id, self.add_bos = pad_token_id, add_bos
    self.whiten, self.mean, self.std, self.clip = whiten, float(mean), float(std), float(clip)
    self.name, self.num_unscorable = name, 0
    self.buckets = buckets(self.max_len)
    # The fill of padding slots: any id works (masked), the pad id keeps the embedding in range.
    self._fill = next((i for i in (pad_token_id, tokenizer.pad_id) if i is not None), 0)
    self.fns = transformer.model_fns(transformer.abstract(config)[0], layout.param_gather(params))
    # One program per model and layout, shared by its scorers: one compile per bucket.
    self._score = platform.jit(functools.partial(scorer.sequence_scores, self.fns),
                               out_shardings=layout.batch_sharding)

  @property
  def __name__(self):  # RewardSet names its parts by __name__
    return self.name

  # -- tokenisation --------------------------------------------------------------------------

  def encode(self, prompts: Sequence[str], completions: Sequence[str]):
    """(tokens [N, max_len] int32, mask [N, max_len], last [N], ok [N]) in `self.format`."""
    if self.format == "sft":
      return scorer.encode_sft(prompts, completions, self.tokenizer, self.max_len, self.add_bos)
    n = len(prompts)
    tokens = np.full((n, self.max_len), self._fill, np.int32)
    mask = np.zeros((n, self.max_len), bool)
    last, ok = np.zeros((n,), np.int64), np.zeros((n,), bool)
    texts = [p + c for p, c in zip(prompts, completions)]
    rows = self.tokenizer.encode_batch(texts, add_special_tokens=True)
    bos = self.tokenizer.bos_id
    for i, ids in enumerate(rows):
      if bos is not None and ids[:2] == [bos, bos]:
        ids = ids[1:]  # the prompt already began with the bos text the tokenizer adds
      if not texts[i] or not ids or len(ids) > self.max_len:
        continue  # no text: only the tokenizer's own special tokens would be scored
      real = np.flatnonzero(np.asarray(ids) != self.pad_token_id) if (
          self.pad_token_id is not None) else [len(ids) - 1]
      if not len(real):
        continue  # nothing but pad tokens: transformers would pool at position 0, meaningless
      tokens[i, :len(ids)], mask[i, :len(ids)], last[i], ok[i] = ids, True, real[-1], True
    return tokens, mask, last, ok

  # -- scoring -------------------------------------------------------------------------------

  def raw(self, prompts: Sequence[str], completions: Sequence[str]) -> np.ndarray:
    """Unnormalised scores, float32 [N]; NaN where a row cannot be scored."""
    prompts, completions = list(prompts), list(completions)
    if len(prompts) != len(completions):
      raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    for i, c in enumerate(completions):
      if not isinstance(c, str):
        raise TypeError(f"completion {i} is a {type(c).__name__}, not a str")
    out = np.full((len(prompts),), np.nan, np.float32)
    tokens, mask, last, ok = self.encode(prompts, completions)
    if (~ok).any():
      self.num_unscorable += int((~ok).sum())
      logging.warning("%s: %d of %d rows unscorable (no text, or longer than max_len=%d tokens)",
                      self.name, int((~ok).sum()), len(ok), self.max_len)
    which = np.searchsorted(self.buckets, mask.sum(1))  # each row's bucket
    local = self.batch_size // jax.process_count()
    chunks = -(-np.bincount(which[ok], minlength=len(self.buckets)) // local)
    # Every process runs the same programs in the same order (they are collectives): as many
    # device batches per bucket as the process with the most rows in it needs.
    chunks = self.layout.gather_rows(chunks[None]).max(0)
    pending = []
    for b, (size, count) in enumerate(zip(self.buckets, chunks)):
      rows = np.flatnonzero(ok & (which == b))
      for j in range(int(count)):
        idx = rows[j * local:(j + 1) * local]
        t = np.full((local, size), self._fill, np.int32)
        m = np.zeros((local, size), bool)
        m[:, 0] = True  # a padding row is one token, so its (discarded) score stays finite
        l = np.zeros((local,), np.int32)
        t[:len(idx)], m[:len(idx)], l[:len(idx)] = tokens[idx, :size], mask[idx, :size], last[idx]
        put = self.layout.shard_batch
        # Dispatched without waiting: the host builds the next batch while the devices run.
        pending.append((idx, self._score(self.params, put(t), put(m), put(l))))
    for idx, s in pending:
      out[idx] = self.layout.local_rows(s)[:len(idx)]
    return out

  def normalise(self, raw: np.ndarray) -> np.ndarray:
    return scorer.normalise(raw, self.whiten, self.mean, self.std, self.clip)

  def __call__(self, prompts: Sequence[str], completions: Sequence[str], **fields) -> np.ndarray:
    del fields  # a learned reward judges the text alone
    return self.normalise(self.raw(prompts, completions))


def _option_error(name, value, fix: str) -> ValueError:
  return ValueError(f"hf_reward_model option {name}={value!r}: {fix}")


def load(path: str, *, layout: Optional[sharding.Layout] = None, dtype: str = "bfloat16",
         batch_size: Optional[int] = None, max_len: Optional[int] = None,
         tokenizer: Optional[str] = None, format: Optional[str] = None,
         whiten: Optional[bool] = None, mean: Optional[float] = None,
         std: Optional[float] = None, clip: Optional[float] = None) -> HFRewardModel:
  """An `HFRewardModel` of a local directory or hub id, its weights on `layout`'s shardings
  (default `default_layout()`). Options as in the module docstring; None takes the saved
  'rloo_jax_reward' entry's value, else the default."""
  # Every check below runs before any weight is read.
  if dtype not in DTYPES:
    raise _option_error("dtype", dtype, f"choose one of {DTYPES}")
  local = hf.resolve_path(path, what="hf_reward_model")
  with open(os.path.join(local, "config.json")) as f:
    hf_json = json.load(f)
  arch = hf.architecture(hf_json)
  if arch not in hf.SEQ_CLS:
    raise ValueError(f"hf_reward_model:{path} is a {arch}, not a reward model; it needs a "
                     f"*ForSequenceClassification checkpoint ({', '.join(hf.SEQ_CLS)})")
  labels = hf_json.get("num_labels") or len(hf_json.get("id2label") or {0: 0})
  if labels != 1:
    raise ValueError(f"hf_reward_model:{path} has num_labels={labels}; a reward model scores "
                     "each sequence with one number (num_labels=1)")
  saved = hf_json.get(EXTRA_KEY) or {}
  fmt = format or saved.get("format", "hf")
  if fmt not in FORMATS:
    raise _option_error("format", fmt, f"choose one of {FORMATS}")
  layout = layout or default_layout()
  ways = math.lcm(layout.batch_parallelism, jax.process_count())
  if batch_size is None:
    batch_size = -(-DEFAULT_BATCH_SIZE // ways) * ways
  elif batch_size < 1 or batch_size % ways:
    raise _option_error("batch_size", batch_size,
                        f"must be a positive multiple of {ways}, the mesh's batch parallelism "
                        f"(axes {layout.batch_axes} of {layout.shape}) and process count")
  tok_dir = hf.resolve_path(tokenizer, what="hf_reward_model option tokenizer") if (
      tokenizer) else local
  try:
    tok = hf.load_tokenizer(tok_dir)
  except ValueError as e:
    raise ValueError(f"hf_reward_model:{path}: no usable tokenizer ({e}); pass "
                     "?tokenizer=<directory or hub id> (the one the reward model was trained "
                     "with)") from None
  shape = hf.config_from_hf(hf_json)  # the architecture's sizes, from config.json alone
  vocab, context = shape.vocab_size, shape.max_seq_len
  if tok.vocab_size > vocab:  # ids past the embedding would be clipped, scoring garbage
    raise _option_error("tokenizer", tokenizer or local, f"its {tok.vocab_size} tokens exceed "
                        f"the model's vocab_size={vocab}: pass the reward model's own tokenizer")
  whiten = bool(saved.get("whiten", False) if whiten is None else whiten)
  if whiten and not saved.get("stats_samples") and (mean is None or std is None):
    raise _option_error("whiten", True, "whitening needs statistics: pass ?mean=..&std=.. (the "
                        "raw scores' mean and std on the starting policy's samples), or export "
                        "a calibrated reward_model: directory (export_reward_model)")
  mean = float(saved.get("mean", 0.0) if mean is None else mean)
  std = float(saved.get("std", 1.0) if std is None else std)
  if whiten and not (np.isfinite(mean) and np.isfinite(std) and std > 0):
    raise _option_error("std", std, "whitening needs a finite mean and a positive std")
  clip = float(saved.get("clip", 0.0) if clip is None else clip)
  if clip < 0:
    raise _option_error("clip", clip, "must be >= 0 (0 = no clipping)")
  if max_len is None:
    max_len = int(saved.get("seq_len") or context)
  if not 0 < max_len <= context:
    raise _option_error("max_len", max_len, f"must be in [1, {context}] (the model's context, "
                        "max_position_embeddings)")
  config, params = hf.load_checkpoint(local, shardings=layout, dtype=dtype, param_dtype=dtype)
  return HFRewardModel(config, params, tok, layout, batch_size=batch_size, max_len=max_len,
                       format=fmt, pad_token_id=hf_json.get("pad_token_id"),
                       add_bos=bool(saved.get("add_bos", True)), whiten=whiten, mean=mean,
                       std=std, clip=clip)


def export_reward_model(rm_dir: str, out_dir: str, *, dtype: str = "bfloat16",
                        max_shard_bytes: Optional[int] = None) -> list[str]:
  """Writes the reward model of a `reward_model:` directory (`RewardModelScorer.save`) as a
  Hugging Face *ForSequenceClassification checkpoint with its tokenizer; its scoring layout
  ('sft'), sequence length and whitening go into config.json's 'rloo_jax_reward', so
  `hf_reward_model:<out_dir>` scores exactly as `reward_model:<rm_dir>` does. Returns the paths."""
  hf_export.check_out_dir(out_dir)  # before the restore
  tok_spec = scorer.read_meta(rm_dir)["tokenizer"]
  if tok_spec.get("kind") != "hf":
    raise ValueError(f"{rm_dir} was trained with a {tok_spec.get('kind')!r} tokenizer, which has "
                     "no Hugging Face form (tokenizer.json); only reward models on a Hugging "
                     "Face tokenizer (a policy from config.model.init_from) are exported")
  rm = scorer.RewardModelScorer.load(rm_dir)
  tok = rm.tokenizer
  extra = {EXTRA_KEY: dict(format="sft", add_bos=rm.add_bos, seq_len=rm.seq_len,
                           whiten=rm.whiten, mean=rm.mean, std=rm.std, clip=rm.clip,
                           stats_samples=rm.stats_samples, source=os.path.abspath(rm_dir))}
  kw = {} if max_shard_bytes is None else dict(max_shard_bytes=int(max_shard_bytes))
  return hf_export.save_pretrained(
      rm.params, rm.model_config, out_dir, dtype=dtype,
      tokenizer_dir=os.path.join(os.path.abspath(rm_dir), tok_spec["dir"]),
      bos_id=tok.bos_id, eos_id=tok.eos_id, pad_id=tok.pad_id, extra_config=extra, **kw)

"""A trained reward model as a reward function, and its saved directory.

`RewardModelScorer` has the reward-function signature `fn(prompts, completions, **fields)`: each
text is tokenised as `[bos] prompt completion eos` (the layout `rloo_jax.rewards.reward_model`
trains on) and scored by the scalar head at its eos, optionally whitened and clipped.

A saved reward model is a directory:

    <dir>/checkpoints/<step>/{state,meta}   Orbax: params + JSON meta (model config, tokenizer,
                                            sequence length, whitening statistics, train metrics)
    <dir>/tokenizer/                        only for Hugging Face tokenizers (tokenizer.json)

and is loaded by `RewardModelScorer.load(dir)` or, from a config, by
`rloo_jax.rewards.resolve('reward_model:<dir>')`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any, Mapping, Optional, Sequence

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from rloo_jax.checkpoint import Checkpointer
from rloo_jax.data import pipeline
from rloo_jax.data import tokenizer as tok_lib
from rloo_jax.models import hf
from rloo_jax.models import transformer

FORMAT = "rloo_jax.reward_model/1"


# ----------------------------------------------------------------------------------------------
# Scores: the value at the last real token


def sequence_scores(fns, params, tokens_ns, mask_ns, last_n):
  """float32 [N]: the scalar head's value at each row's last real token."""
  positions = jnp.broadcast_to(jnp.arange(tokens_ns.shape[1]), tokens_ns.shape)
  values_ns = fns.forward(params, tokens_ns, positions, mask_ns).astype(jnp.float32)
  return jnp.take_along_axis(values_ns, last_n[:, None].astype(jnp.int32), axis=1)[:, 0]


def encode_sft(prompts, completions, tokenizer, seq_len: int, add_bos: bool):
  """(tokens [N, seq_len], mask, last [N], ok [N]) of `[bos] prompt completion eos` rows (the
  layout reward models are trained on, `pipeline.make_sft_batch`); rows that cannot be tokenised
  or do not fit are zeros with ok=False."""
  n = len(prompts)
  try:
    b = pipeline.make_sft_batch(prompts, completions, tokenizer, seq_len, add_bos)
    return b["tokens"], b["token_mask"], b["lengths"] - 1, np.ones((n,), bool)
  except ValueError:
    pass  # find the offending rows one by one; the common all-good case stays one call
  tokens = np.full((n, seq_len), tokenizer.pad_id, np.int32)
  mask = np.zeros((n, seq_len), bool)
  last = np.zeros((n,), np.int64)
  ok = np.zeros((n,), bool)
  for i, (p, c) in enumerate(zip(prompts, completions)):
    try:
      b = pipeline.make_sft_batch([p], [c], tokenizer, seq_len, add_bos)
    except ValueError as e:
      logging.warning("reward model cannot score sample %d: %s", i, e)
      continue
    tokens[i], mask[i] = b["tokens"][0], b["token_mask"][0]
    last[i], ok[i] = b["lengths"][0] - 1, True
  return tokens, mask, last, ok


def normalise(raw, whiten: bool, mean: float, std: float, clip: float) -> np.ndarray:
  """float32 clip(whiten(raw)): (raw - mean) / std if whiten, then [-clip, clip] if clip > 0."""
  r = np.asarray(raw, np.float32)
  if whiten:
    r = (r - np.float32(mean)) / np.float32(std)
  if clip > 0:
    r = np.clip(r, -clip, clip)  # NaN stays NaN
  return r.astype(np.float32)


# ----------------------------------------------------------------------------------------------
# Tokenizer (de)serialisation: a saved reward model must be scorable without its training code.


def _tokenizer_spec(tokenizer, directory: str) -> dict:
  if isinstance(tokenizer, tok_lib.ByteTokenizer):
    return {"kind": "byte"}
  if isinstance(tokenizer, (tok_lib.WordTokenizer, tok_lib.CharTokenizer)):
    return {"kind": tokenizer.kind, "symbols": list(tokenizer.symbols)}
  inner = getattr(tokenizer, "tokenizer", None)
  if inner is not None and hasattr(inner, "save"):  # rloo_jax.models.hf.HFTokenizer
    tok_dir = os.path.join(directory, "tokenizer")
    os.makedirs(tok_dir, exist_ok=True)
    inner.save(os.path.join(tok_dir, "tokenizer.json"))
    with open(os.path.join(tok_dir, "tokenizer_config.json"), "w") as f:
      json.dump({"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id,
                 "pad_token_id": tokenizer.pad_id}, f)
    return {"kind": "hf", "dir": "tokenizer"}
  return {"kind": "external", "type": type(tokenizer).__name__}


def _tokenizer_from_spec(spec: Mapping[str, Any], directory: str):
  kind = spec.get("kind")
  if kind == "byte":
    return tok_lib.ByteTokenizer()
  if kind == "word":
    return tok_lib.WordTokenizer(spec["symbols"])
  if kind == "char":
    return tok_lib.CharTokenizer("".join(spec["symbols"]))
  if kind == "hf":
    return hf.load_tokenizer(os.path.join(directory, spec["dir"]))
  raise ValueError(f"reward model {directory} was saved with a {spec.get('type', kind)!r} "
                   "tokenizer that cannot be rebuilt from the directory; pass tokenizer= to "
                   "RewardModelScorer.load")


# ----------------------------------------------------------------------------------------------
# The scorer


@functools.partial(jax.jit, static_argnums=0)
def _score(fns, params, tokens_ns, mask_ns, last_n):
  return sequence_scores(fns, params, tokens_ns, mask_ns, last_n)


@dataclasses.dataclass(frozen=True)
class RewardModelScorer:
  """`fn(prompts, completions, **fields) -> float32 [N]` scoring with a trained reward model.

  Each text is tokenised as `[bos] prompt completion eos` (the training layout) and scored at its
  eos. Rows are scored in chunks of exactly `batch_size` x `seq_len` (the last chunk padded with
  copies of a real row), so every call of any size reuses one compiled program.

  Output: `clip(whiten(raw))` where whiten is `(raw - mean) / std` with statistics measured on SFT
  samples (`calibrate`), applied only if `whiten`, and clip limits to [-clip, clip] if clip > 0.
  A text that cannot be tokenised or does not fit `seq_len` gets NaN (unscorable: the trainer masks
  it out of the baselines) and is counted in `num_unscorable`.
  """

  model_config: transformer.TransformerConfig
  params: Any
  tokenizer: Any
  seq_len: int
  batch_size: int = 64
  add_bos: bool = True
  whiten: bool = False
  mean: float = 0.0
  std: float = 1.0
  clip: float = 0.0
  stats_samples: int = 0
  name: str = "reward_model"
  meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  _counter: list = dataclasses.field(default_factory=lambda: [0], repr=False, compare=False)

  def __post_init__(self):
    if self.model_config.head != "scalar":
      raise ValueError(f"a reward model needs head='scalar', got head={self.model_config.head!r}")
    if self.seq_len > self.model_config.max_seq_len:
      raise ValueError(f"scorer seq_len={self.seq_len} exceeds the reward model's context of "
                       f"{self.model_config.max_seq_len} tokens")
    if self.batch_size < 1:
      raise ValueError(f"scorer batch_size={self.batch_size} must be >= 1")
    if self.clip < 0:
      raise ValueError(f"clip={self.clip} must be >= 0 (0 = no clipping)")
    if self.whiten and not (np.isfinite(self.std) and self.std > 0 and np.isfinite(self.mean)):
      raise ValueError(f"whitening needs a finite mean and a positive std, got mean={self.mean} "
                       f"std={self.std}; call calibrate() on SFT samples first")

  @property
  def __name__(self):  # RewardSet names its parts by __name__
    return self.name

  @property
  def fns(self) -> transformer.ModelFns:
    return transformer.model_fns(transformer.abstract(self.model_config)[0])

  @property
  def num_unscorable(self) -> int:
    return self._counter[0]

  def _encode(self, prompts, completions):
    return encode_sft(prompts, completions, self.tokenizer, self.seq_len, self.add_bos)

  def raw(self, prompts: Sequence[str], completions: Sequence[str]) -> np.ndarray:
    """Unnormalised scores, float32 [N]; NaN where a text cannot be scored."""
    prompts, completions = list(prompts), list(completions)
    if len(prompts) != len(completions):
      raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    n = len(prompts)
    out = np.full((n,), np.nan, np.float32)
    if n == 0:
      return out
    for i, c in enumerate(completions):
      if not isinstance(c, str):
        raise TypeError(f"completion {i} is a {type(c).__name__}, not a str")
    tokens, mask, last, ok = self._encode(prompts, completions)
    self._counter[0] += int((~ok).sum())
    rows = np.flatnonzero(ok)
    if not len(rows):
      return out
    fns, bs = self.fns, self.batch_size
    for start in range(0, len(rows), bs):
      idx = rows[start:start + bs]
      pad = np.concatenate([idx, np.full((bs - len(idx),), idx[0])])  # fixed shape: one compile
      s = _score(fns, self.params, *jax.device_put(
          (tokens[pad], mask[pad], last[pad].astype(np.int32))))
      out[idx] = np.asarray(s)[:len(idx)]
    return out

  def normalise(self, raw: np.ndarray) -> np.ndarray:
    return normalise(raw, self.whiten, self.mean, self.std, self.clip)

  def __call__(self, prompts: Sequence[str], completions: Sequence[str], **fields) -> np.ndarray:
    del fields  # a learned reward judges the text alone
    return self.normalise(self.raw(prompts, completions))

  def calibrate(self, prompts: Sequence[str], completions: Sequence[str],
                whiten: bool = True) -> "RewardModelScorer":
    """A copy whose whitening statistics are the mean/std of this RM's raw scores on the given
    (SFT-sampled) texts, so the starting policy's rewards are ~N(0, 1) whatever the RM's offset."""
    r = self.raw(prompts, completions)
    r = r[np.isfinite(r)]
    if len(r) < 2:
      raise ValueError(f"whitening statistics need at least 2 scorable samples, got {len(r)}")
    std = float(r.std())
    if not std > 1e-6:
      raise ValueError(f"the reward model gives the calibration samples (nearly) one score "
                       f"(std={std:.2e}); whitening would blow rewards up. Train it longer or "
                       "set whiten=False")
    return dataclasses.replace(self, whiten=whiten, mean=float(r.mean()), std=std,
                               stats_samples=int(len(r)))

  # -- persistence -------------------------------------------------------------------------

  def save(self, directory: str, *, step: int = 0, extra: Optional[Mapping[str, Any]] = None):
    """Writes params + meta (config, tokenizer, seq_len, whitening, `extra`) with Orbax."""
    directory = os.path.abspath(directory)
    os.makedirs(directory, exist_ok=True)
    meta = dict(format=FORMAT, model_config=dataclasses.asdict(self.model_config),
                tokenizer=_tokenizer_spec(self.tokenizer, directory), seq_len=self.seq_len,
                batch_size=self.batch_size,
                add_bos=self.add_bos, whiten=self.whiten, mean=self.mean, std=self.std,
                clip=self.clip, stats_samples=self.stats_samples, name=self.name,
                extra=dict(extra or {}))
    ckpt = Checkpointer(os.path.join(directory, "checkpoints"), keep=1)
    ckpt.save(step, self.params, meta, force=True)
    ckpt.close()

  @classmethod
  def load(cls, directory: str, *, tokenizer=None, whiten: Optional[bool] = None,
           clip: Optional[float] = None, batch_size: Optional[int] = None) -> "RewardModelScorer":
    """Restores a saved reward model; `whiten`/`clip`/`batch_size` override the saved settings."""
    meta = read_meta(directory)
    cfg = transformer.TransformerConfig(**meta["model_config"])
    if tokenizer is None:
      tokenizer = _tokenizer_from_spec(meta["tokenizer"], directory)
    if whiten and not meta.get("stats_samples"):
      raise ValueError(f"reward model {directory} has no whitening statistics (it was saved "
                       "before calibrate()); load it with whiten=False or recalibrate and save")
    ckpt = Checkpointer(os.path.join(directory, "checkpoints"), keep=1)
    restored = ckpt.restore(transformer.abstract(cfg)[1])
    ckpt.close()
    if restored is None:
      raise ValueError(f"reward model {directory}: no readable checkpoint under "
                       f"{os.path.join(directory, 'checkpoints')}; retrain it")
    _, params, _ = restored
    return cls(cfg, params, tokenizer, seq_len=int(meta["seq_len"]),
               batch_size=int(batch_size or meta.get("batch_size", 64)),
               add_bos=bool(meta["add_bos"]),
               whiten=bool(meta["whiten"] if whiten is None else whiten),
               mean=float(meta["mean"]), std=float(meta["std"]),
               clip=float(meta["clip"] if clip is None else clip),
               stats_samples=int(meta.get("stats_samples", 0)), name=meta.get("name", cls.name),
               meta=meta)


def read_meta(directory: str) -> dict:
  """The saved meta of a reward-model directory, with errors that say what is missing."""
  directory = os.path.abspath(directory)
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"reward model directory {directory} does not exist; train one with "
                            "`python experiments/rlhf_pipeline.py --workdir=...` (it writes "
                            "<workdir>/reward_model) or rloo_jax.rewards.reward_model.train")
  ckdir = os.path.join(directory, "checkpoints")
  steps = sorted((int(s) for s in os.listdir(ckdir) if s.isdigit()), reverse=True) \
      if os.path.isdir(ckdir) else []
  if not steps:
    raise FileNotFoundError(f"{directory} holds no reward-model checkpoint (expected "
                            f"{ckdir}/<step>/); point at the directory RewardModelScorer.save "
                            "wrote")
  for step in steps:
    path = os.path.join(ckdir, str(step), "meta", "metadata")
    try:
      with open(path) as f:
        meta = json.load(f)
      break
    except (OSError, ValueError):
      continue
  else:
    raise ValueError(f"{directory}: no checkpoint with readable meta ({ckdir}/<step>/meta); "
                     "retrain the reward model")
  if meta.get("format") != FORMAT:
    raise ValueError(f"{directory} is not a reward model saved by rloo_jax (format "
                     f"{meta.get('format')!r}, expected {FORMAT!r})")
  return meta

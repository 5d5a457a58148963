"""Bradley-Terry reward models: training on (prompt, chosen, rejected) pairs, Orbax save/restore,
and a jit-compiled scorer with the reward-function signature `fn(prompts, completions, **fields)`.

The model is the policy's own `Transformer` with `head='scalar'` ([B, S] float32 values). As in the
RLOO paper (and InstructGPT), it starts from the SFT policy: every backbone parameter is copied, the
scalar score head is fresh. The reward of a sequence `[bos] prompt completion eos` is the value at
its last real token (the eos), which has attended to the whole text.

Loss: -log sigmoid(r(chosen) - r(rejected)), in float32; logged with the pairwise accuracy
(fraction of pairs with r(chosen) > r(rejected)).

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
import time
from typing import Any, Callable, Mapping, Optional, Sequence

from absl import logging
from flax import nnx
from flax import struct
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from rloo_jax.checkpoint import Checkpointer
from rloo_jax.data import pipeline
from rloo_jax.models import transformer

FORMAT = "rloo_jax.reward_model/1"


# ----------------------------------------------------------------------------------------------
# Initialisation from the SFT policy


def _flatten(tree: Mapping[Any, Any], prefix=()) -> dict[tuple, Any]:
  out = {}
  for k, v in tree.items():
    if isinstance(v, Mapping):
      out.update(_flatten(v, prefix + (k,)))
    else:
      out[prefix + (k,)] = v
  return out


def _unflatten(flat: Mapping[tuple, Any]) -> dict:
  out: dict = {}
  for path, v in flat.items():
    node = out
    for k in path[:-1]:
      node = node.setdefault(k, {})
    node[path[-1]] = v
  return out


def init_from_policy(policy_config: transformer.TransformerConfig, policy_params, *,
                     seed: int = 0):
  """(rm_config, graphdef, params): the policy's backbone under a fresh scalar score head.

  Everything but the LM head (absent from a scalar model) is copied from the policy; a shape
  mismatch means the two configs disagree and is an error rather than a silent re-init.
  """
  rm_config = policy_config.replace(head="scalar")
  src = _flatten(nnx.to_pure_dict(policy_params))
  # Built on the abstract model: shapes are checked before anything is allocated, and no random
  # backbone is initialised (and compiled) only to be overwritten by the policy's.
  graphdef, rm_params = transformer.abstract(rm_config)
  dst = _flatten(nnx.to_pure_dict(rm_params))
  key = jax.random.PRNGKey(seed)
  for path, value in dst.items():
    if path[-1] == "score_kernel":  # the init Transformer gives a fresh head: normal(0.02)
      dst[path] = 0.02 * jax.random.normal(key, value.shape, jnp.float32).astype(value.dtype)
      continue
    if path[-1] == "score_bias":
      dst[path] = jnp.zeros(value.shape, value.dtype)
      continue
    if path not in src:
      raise ValueError(f"policy params lack {'/'.join(map(str, path))}: the policy config does "
                       "not match the reward model's; pass the policy's own TransformerConfig")
    if tuple(src[path].shape) != tuple(value.shape):
      raise ValueError(f"{'/'.join(map(str, path))}: policy shape {tuple(src[path].shape)} vs "
                       f"reward model shape {tuple(value.shape)}; pass the policy's own config")
    # A copy, not an alias: the RM's train step donates its params, the policy's must survive.
    dst[path] = jnp.array(src[path], dtype=value.dtype, copy=True)
  nnx.replace_by_pure_dict(rm_params, _unflatten(dst))
  return rm_config, graphdef, rm_params


# ----------------------------------------------------------------------------------------------
# Batches and the pure loss


def make_pair_batch(prompts: Sequence[str], chosen: Sequence[str], rejected: Sequence[str],
                    tokenizer, max_seq_len: int, add_bos: bool = True) -> dict[str, np.ndarray]:
  """Chosen rows then rejected rows (`[2B, S]`), each `[bos] prompt completion eos` right-padded
  exactly as the SFT stage and the scorer build them, so the RM is trained on what it scores.

  Returns `tokens` int32, `token_mask` bool [2B, S] and `last` int32 [2B] (index of the eos).
  """
  if not (len(prompts) == len(chosen) == len(rejected)):
    raise ValueError(f"{len(prompts)} prompts, {len(chosen)} chosen and {len(rejected)} rejected "
                     "completions: one of each per pair")
  c = pipeline.make_sft_batch(prompts, chosen, tokenizer, max_seq_len, add_bos)
  r = pipeline.make_sft_batch(prompts, rejected, tokenizer, max_seq_len, add_bos)
  return dict(tokens=np.concatenate([c["tokens"], r["tokens"]]),
              token_mask=np.concatenate([c["token_mask"], r["token_mask"]]),
              last=np.concatenate([c["lengths"], r["lengths"]]).astype(np.int32) - 1)


def sequence_scores(fns, params, tokens_ns, mask_ns, last_n):
  """float32 [N]: the scalar head's value at each row's last real token."""
  positions = jnp.broadcast_to(jnp.arange(tokens_ns.shape[1]), tokens_ns.shape)
  values_ns = fns.forward(params, tokens_ns, positions, mask_ns).astype(jnp.float32)
  return jnp.take_along_axis(values_ns, last_n[:, None].astype(jnp.int32), axis=1)[:, 0]


def bradley_terry_loss(fns, params, batch):
  """Mean -log sigmoid(r_chosen - r_rejected) over the (weighted) pairs, and pairwise accuracy."""
  scores = sequence_scores(fns, params, batch["tokens"], batch["token_mask"], batch["last"])
  b = scores.shape[0] // 2
  margin_b = scores[:b] - scores[b:]
  w = batch.get("weight")
  w = jnp.ones_like(margin_b) if w is None else w.astype(jnp.float32)
  denom = jnp.maximum(w.sum(), 1.0)
  # log_sigmoid is the stable log(1 / (1 + exp(-m))): no overflow for large negative margins.
  loss = -(jax.nn.log_sigmoid(margin_b) * w).sum() / denom
  accuracy = ((margin_b > 0).astype(jnp.float32) * w).sum() / denom
  return loss, dict(accuracy=accuracy, margin=(margin_b * w).sum() / denom,
                    reward_abs=(jnp.abs(scores[:b]) * w).sum() / denom)


@struct.dataclass
class RMState:
  step: jax.Array
  params: Any
  opt_state: Any


def train_step(state: RMState, batch, *, fns, tx):
  """One Bradley-Terry step; pure, jitted with the state donated."""
  (value, metrics), grads = jax.value_and_grad(
      functools.partial(bradley_terry_loss, fns), has_aux=True)(state.params, batch)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  return RMState(state.step + 1, params, opt_state), dict(metrics, loss=value,
                                                          grad_norm=optax.global_norm(grads))


# ----------------------------------------------------------------------------------------------
# Training


@dataclasses.dataclass
class TrainOptions:
  steps: int = 500
  batch_size: int = 64
  learning_rate: float = 1e-3
  warmup_steps: int = 25
  weight_decay: float = 0.0
  max_grad_norm: float = 1.0
  log_every: int = 100
  seed: int = 0


def _pair_length_fn(tokenizer, add_bos: bool):
  bos = 1 if add_bos and getattr(tokenizer, "bos_id", None) is not None else 0

  def length(record):
    p = len(tokenizer.encode(record["prompt"]))
    return bos + p + 1 + max(len(tokenizer.encode(record["chosen"])),
                             len(tokenizer.encode(record["rejected"])))
  return length


def _check_pairs(pairs, what: str):
  if len(pairs) == 0:
    raise ValueError(f"no {what} preference pairs: give a list of {{'prompt', 'chosen', "
                     "'rejected'}} records")
  for key in ("prompt", "chosen", "rejected"):
    if key not in pairs[0]:
      raise ValueError(f"{what} preference pair 0 has no {key!r} field (fields: "
                       f"{sorted(pairs[0])}); pairs are {{'prompt', 'chosen', 'rejected'}}")


def evaluate_pairs(scorer: "RewardModelScorer", pairs: Sequence[Mapping[str, Any]]) -> dict:
  """Held-out pairwise accuracy (and, when pairs carry `gold_chosen`/`gold_rejected`, agreement
  with the noiseless gold ordering on pairs whose gold scores differ)."""
  prompts = [p["prompt"] for p in pairs]
  rc = scorer.raw(prompts, [p["chosen"] for p in pairs])
  rr = scorer.raw(prompts, [p["rejected"] for p in pairs])
  ok = np.isfinite(rc) & np.isfinite(rr)
  out = dict(accuracy=float(np.mean(rc[ok] > rr[ok])) if ok.any() else float("nan"),
             loss=float(np.mean(np.logaddexp(0.0, -(rc[ok] - rr[ok])))) if ok.any()
             else float("nan"),
             num_pairs=int(ok.sum()))
  if "gold_chosen" in pairs[0]:
    gc = np.array([p["gold_chosen"] for p in pairs], np.float64)
    gr = np.array([p["gold_rejected"] for p in pairs], np.float64)
    strict = ok & (gc != gr)
    if strict.any():
      # Does the RM order pairs as the gold reward does (what RL will exploit), and how often did
      # the noisy labeller agree with gold (the ceiling for `accuracy`)?
      out["gold_agreement"] = float(np.mean((rc[strict] > rr[strict]) == (gc[strict] > gr[strict])))
      out["label_gold_agreement"] = float(np.mean(gc[strict] > gr[strict]))
  return out


def train(policy_config: transformer.TransformerConfig, policy_params, tokenizer,
          train_pairs: Sequence[Mapping[str, Any]], *, seq_len: int, options: TrainOptions,
          eval_pairs: Sequence[Mapping[str, Any]] = (), add_bos: bool = True,
          score_batch_size: int = 64, log: Callable[[str], None] = print):
  """Trains a reward model from the policy; returns `(scorer, history)`.

  `seq_len` is the longest `[bos] prompt completion eos` to train on and score (pairs longer than
  it are dropped and counted). `history` holds one dict per logged step.
  """
  _check_pairs(train_pairs, "training")
  if eval_pairs:
    _check_pairs(eval_pairs, "evaluation")
  if seq_len > policy_config.max_seq_len:
    raise ValueError(f"seq_len={seq_len} exceeds the model context of {policy_config.max_seq_len} "
                     "tokens; shorten the pairs or raise config.model.max_seq_len")
  if options.steps < 1 or options.batch_size < 1:
    raise ValueError(f"reward model steps={options.steps} and batch_size={options.batch_size} "
                     "must be >= 1")
  rm_config, graphdef, params = init_from_policy(policy_config, policy_params, seed=options.seed)
  fns = transformer.model_fns(graphdef)
  from rloo_jax.trainer import make_optimizer  # the same AdamW + schedule as the other stages
  tx = make_optimizer(ml_collections.ConfigDict(dict(
      learning_rate=options.learning_rate, warmup_steps=options.warmup_steps, schedule="cosine",
      weight_decay=options.weight_decay, b1=0.9, b2=0.99, max_grad_norm=options.max_grad_norm)),
      options.steps)
  state = RMState(jnp.zeros((), jnp.int32), params, tx.init(params))
  step_fn = jax.jit(functools.partial(train_step, fns=fns, tx=tx), donate_argnums=0)

  def make(records):
    return make_pair_batch([r["prompt"] for r in records], [r["chosen"] for r in records],
                           [r["rejected"] for r in records], tokenizer, seq_len, add_bos)

  train_pairs = list(train_pairs)
  length = _pair_length_fn(tokenizer, add_bos)
  batches = pipeline.BatchIterator(
      train_pairs, make, np.array([length(r) for r in train_pairs], np.int64),
      limit=seq_len, limit_name="seq_len", global_batch_size=options.batch_size,
      seed=options.seed)
  if batches.num_dropped:
    log(f"[rm] dropped {batches.num_dropped} of {batches.num_records} pairs longer than "
        f"seq_len={seq_len}")
  scorer = RewardModelScorer(rm_config, state.params, tokenizer, seq_len=seq_len,
                             batch_size=score_batch_size, add_bos=add_bos)
  history, window = [], []
  start = time.time()
  for i in range(options.steps):
    batch = next(batches)
    state, metrics = step_fn(state, {k: batch[k] for k in ("tokens", "token_mask", "last")})
    window.append(metrics)
    if (i + 1) % options.log_every == 0 or i + 1 == options.steps:
      m = {k: float(np.mean([float(x[k]) for x in window])) for k in window[0]}
      window = []
      row = dict(step=i + 1, train_loss=m["loss"], train_accuracy=m["accuracy"],
                 train_margin=m["margin"], elapsed_s=time.time() - start)
      if eval_pairs:
        scorer = dataclasses.replace(scorer, params=state.params)
        ev = evaluate_pairs(scorer, eval_pairs)
        row.update({f"eval_{k}": v for k, v in ev.items()})
      history.append(row)
      log(f"[rm] step {i + 1}/{options.steps} loss {row['train_loss']:.4f} accuracy "
          f"{row['train_accuracy']:.3f}" + (f" | held-out accuracy {row['eval_accuracy']:.3f}"
                                            if eval_pairs else "")
          + f" ({row['elapsed_s']:.0f}s)")
  return dataclasses.replace(scorer, params=state.params), history


# ----------------------------------------------------------------------------------------------
# Tokenizer (de)serialisation: a saved reward model must be scorable without its training code.


def _tokenizer_spec(tokenizer, directory: str) -> dict:
  from rloo_jax.data import tokenizer as tok_lib
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
  from rloo_jax.data import tokenizer as tok_lib
  kind = spec.get("kind")
  if kind == "byte":
    return tok_lib.ByteTokenizer()
  if kind == "word":
    return tok_lib.WordTokenizer(spec["symbols"])
  if kind == "char":
    return tok_lib.CharTokenizer("".join(spec["symbols"]))
  if kind == "hf":
    from rloo_jax.models import hf
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
    """(tokens, mask, last, ok) for all rows; rows that fail are zeros with ok=False."""
    n = len(prompts)
    try:
      b = pipeline.make_sft_batch(prompts, completions, self.tokenizer, self.seq_len, self.add_bos)
      return b["tokens"], b["token_mask"], b["lengths"] - 1, np.ones((n,), bool)
    except ValueError:
      pass  # find the offending rows one by one; the common all-good case stays one call
    tokens = np.full((n, self.seq_len), self.tokenizer.pad_id, np.int32)
    mask = np.zeros((n, self.seq_len), bool)
    last = np.zeros((n,), np.int64)
    ok = np.zeros((n,), bool)
    for i, (p, c) in enumerate(zip(prompts, completions)):
      try:
        b = pipeline.make_sft_batch([p], [c], self.tokenizer, self.seq_len, self.add_bos)
      except ValueError as e:
        logging.warning("reward model cannot score sample %d: %s", i, e)
        continue
      tokens[i], mask[i], last[i], ok[i] = b["tokens"][0], b["token_mask"][0], b["lengths"][0] - 1, True
    return tokens, mask, last, ok

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
      s = _score(fns, self.params, jnp.asarray(tokens[pad]), jnp.asarray(mask[pad]),
                 jnp.asarray(last[pad].astype(np.int32)))
      out[idx] = np.asarray(s)[:len(idx)]
    return out

  def normalise(self, raw: np.ndarray) -> np.ndarray:
    r = np.asarray(raw, np.float32)
    if self.whiten:
      r = (r - np.float32(self.mean)) / np.float32(self.std)
    if self.clip > 0:
      r = np.clip(r, -self.clip, self.clip)  # NaN stays NaN
    return r.astype(np.float32)

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

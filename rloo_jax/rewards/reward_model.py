"""Bradley-Terry reward models: training on (prompt, chosen, rejected) pairs.

The model is the policy's own `Transformer` with `head='scalar'` ([B, S] float32 values). As in the
RLOO paper (and InstructGPT), it starts from the SFT policy: every backbone parameter is copied, the
scalar score head is fresh. The reward of a sequence `[bos] prompt completion eos` is the value at
its last real token (the eos), which has attended to the whole text.

Loss: -log sigmoid(r(chosen) - r(rejected)), in float32; logged with the pairwise accuracy
(fraction of pairs with r(chosen) > r(rejected)).

`train` returns a `RewardModelScorer` (`rloo_jax.rewards.scorer`: scoring, save/load, the saved
directory's layout), re-exported here with `read_meta`.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Mapping, Sequence

from flax import nnx
from flax import struct
from flax import traverse_util
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from rloo_jax import platform
from rloo_jax.data import pipeline
from rloo_jax.models import transformer
from rloo_jax.optim import apply_if_finite, make_optimizer
from rloo_jax.rewards.scorer import RewardModelScorer
from rloo_jax.rewards.scorer import read_meta  # noqa: F401  (re-exported)
from rloo_jax.rewards.scorer import sequence_scores


# ----------------------------------------------------------------------------------------------
# Initialisation from the SFT policy


def init_from_policy(policy_config: transformer.TransformerConfig, policy_params, *,
                     seed: int = 0):
  """(rm_config, graphdef, params): the policy's backbone under a fresh scalar score head.

  Everything but the LM head (absent from a scalar model) is copied from the policy; a shape
  mismatch means the two configs disagree and is an error rather than a silent re-init.
  """
  rm_config = policy_config.replace(head="scalar")
  src = traverse_util.flatten_dict(nnx.to_pure_dict(policy_params))
  # Built on the abstract model: shapes are checked before anything is allocated, and no random
  # backbone is initialised (and compiled) only to be overwritten by the policy's.
  graphdef, rm_params = transformer.abstract(rm_config)
  dst = traverse_util.flatten_dict(nnx.to_pure_dict(rm_params))
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
  nnx.replace_by_pure_dict(rm_params, traverse_util.unflatten_dict(dst))
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
  params, opt_state, guard = apply_if_finite(tx, grads, state.opt_state, state.params, value)
  return RMState(state.step + 1, params, opt_state), dict(metrics, loss=value, **guard)


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


def evaluate_pairs(scorer: RewardModelScorer, pairs: Sequence[Mapping[str, Any]]) -> dict:
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
          score_batch_size: int = 64, log: Callable[[str], None] = print, layout=None):
  """Trains a reward model from the policy; returns `(scorer, history)`.

  `seq_len` is the longest `[bos] prompt completion eos` to train on and score (pairs longer than
  it are dropped and counted). `history` holds one dict per logged step. `layout` (the policy's
  `sharding.Layout`) puts the step counters on the policy's mesh.
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
  tx = make_optimizer(ml_collections.ConfigDict(dict(
      learning_rate=options.learning_rate, warmup_steps=options.warmup_steps, schedule="cosine",
      weight_decay=options.weight_decay, b1=0.9, b2=0.99, max_grad_norm=options.max_grad_norm)),
      options.steps)
  state = RMState(jnp.zeros((), jnp.int32), params, tx.init(params))
  if layout is not None:
    state = layout.replicate_unplaced(state)  # the counters: one compile of the step, not two
  step_fn = platform.jit(functools.partial(train_step, fns=fns, tx=tx), donate_argnums=0)

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

"""Supervised fine-tuning: the stage that makes the starting policy (and the RL reference).

No pretrained weights can be fetched offline, so the embedded experiments start from a small
policy trained here from scratch on the task's demonstrations. The result is cached in
`<workdir>/sft` with Orbax, so reruns (and the RL stage's restarts) reuse it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import time

from flax import struct
import jax
import jax.numpy as jnp
import ml_collections

from rloo_jax import config_utils, loss, platform
from rloo_jax.config_utils import sequence_length
from rloo_jax.data import pipeline
from rloo_jax.checkpoint import Checkpointer
from rloo_jax.optim import NonFiniteError, apply_if_finite, make_optimizer


@struct.dataclass
class SftState:
  step: jax.Array
  params: object
  opt_state: object


def sft_loss(fns, params, batch):
  """Mean next-token cross-entropy over the answer (+ eos) tokens, and token accuracy."""
  tokens = batch["tokens"]
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  logits = fns.forward(params, tokens, positions, batch["token_mask"])[:, :-1]
  targets, weights = tokens[:, 1:], batch["loss_mask"][:, 1:]
  logp = loss.token_logprobs(logits, targets, weights)
  correct = (jnp.argmax(logits, -1) == targets)
  return -loss.masked_mean(logp, weights), {"token_accuracy": loss.masked_mean(correct, weights)}


def sft_step(state: SftState, batch, *, fns, tx):
  (value, metrics), grads = jax.value_and_grad(
      functools.partial(sft_loss, fns), has_aux=True)(state.params, batch)
  params, opt_state, guard = apply_if_finite(tx, grads, state.opt_state, state.params, value)
  return SftState(state.step + 1, params, opt_state), dict(metrics, loss=value, **guard)


def train(config, workdir: str, fns, params, task, *, log=print, layout=None):
  """Runs, resumes or restores the SFT stage; returns the fine-tuned params.

  The stage checkpoints every `config.sft.checkpoint_every` steps into its cache directory, so
  a killed run resumes there; an unreadable checkpoint falls back to the previous one (or to a
  fresh start) as the RL checkpoints do. `layout` (the run's `sharding.Layout`) splits this
  process's rows into the global, batch-sharded array and puts the step counters on its mesh;
  without it batches are passed as host arrays (one process only).
  """
  c = config.sft
  directory = cache_dir(config, workdir)
  tx = make_optimizer(_sft_optim(c), c.steps)
  state = SftState(jnp.zeros((), jnp.int32), params, tx.init(params))
  if layout is not None:
    state = layout.replicate_unplaced(state)  # the counters: one compile of the step, not two
  abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
      state)
  ckpt = Checkpointer(directory, keep=2)
  try:
    restored = ckpt.restore(abstract) if ckpt.latest_step() is not None else None
    batches = pipeline.sft_batches(task.demonstrations, task.tokenizer,
                                   global_batch_size=c.batch_size,
                                   max_seq_len=sequence_length(config),
                                   seed=config.seed, process_index=jax.process_index(),
                                   process_count=jax.process_count())
    if restored is not None:
      step, state, meta = restored
      if step == c.steps:
        log(f"[sft] restored the cached SFT policy from {directory}")
        return state.params
      batches.set_state(meta["data"])
      log(f"[sft] resuming from step {step} in {directory}")
    elif jax.process_index() == 0:
      os.makedirs(os.path.dirname(directory), exist_ok=True)
      with open(directory + ".json", "w") as f:  # what this cache entry was trained with
        json.dump(_settings(config), f, indent=1, sort_keys=True)
    step_fn = platform.jit(functools.partial(sft_step, fns=fns, tx=tx), donate_argnums=0)
    start, skipped = time.time(), 0
    every = max(int(c.get("checkpoint_every", 0)) or c.steps, 1)
    for i in range(int(state.step), c.steps):
      batch = next(batches)
      batch = {k: batch[k] for k in ("tokens", "token_mask", "loss_mask")}
      if layout is not None:
        batch = {k: layout.shard_batch(v) for k, v in batch.items()}
      state, metrics = step_fn(state, batch)
      if (i + 1) % c.log_every == 0 or i + 1 == c.steps or (i + 1) % every == 0:
        m = jax.device_get(metrics)
        skipped = skipped + 1 if m["nonfinite_steps"] else 0
        if skipped >= config.train.max_nonfinite_steps:
          raise NonFiniteError(f"SFT step {i + 1}: {skipped} logged steps in a row had a "
                               "non-finite loss or gradient; lower config.sft.learning_rate")
        if (i + 1) % c.log_every == 0 or i + 1 == c.steps:
          log(f"[sft] step {i + 1}/{c.steps} loss {float(m['loss']):.4f} "
              f"token_accuracy {float(m['token_accuracy']):.3f} ({time.time() - start:.0f}s)")
      if (i + 1) % every == 0 or i + 1 == c.steps:
        ckpt.save(i + 1, state, {"data": batches.get_state()}, force=True)
    return state.params
  finally:
    ckpt.close()


def _settings(config) -> dict:
  # Settings that do not change the trained policy stay out of its cache key.
  sft_config = {k: v for k, v in config.sft.to_dict().items()
                if k not in ("cache_key", "log_every", "checkpoint_every")}
  # data.prompt_field at its default stays out too, so caches made before the key existed match.
  data = {k: v for k, v in config.data.to_dict().items()
          if not (k == "prompt_field" and v == "prompt")}
  return dict(task=config.task, seed=config.seed, sft=sft_config,
              model=config_utils.model_fingerprint(config), data=data,
              max_new_tokens=config.rloo.max_new_tokens)


def cache_dir(config, workdir: str) -> str:
  """`<workdir>/sft/<fingerprint>`: keyed on every setting the SFT policy depends on, so a changed
  config trains a new policy instead of silently reusing a stale one (and nothing is deleted)."""
  key = config.sft.get("cache_key", "")
  if not key:  # a sweep sets one key so that all its runs share one SFT policy
    key = hashlib.sha1(json.dumps(_settings(config), sort_keys=True, default=str).encode())
    key = key.hexdigest()[:12]
  return os.path.abspath(os.path.join(workdir, "sft", key))


def is_cached(config, workdir: str) -> bool:
  return os.path.isdir(os.path.join(cache_dir(config, workdir), str(config.sft.steps)))


def _sft_optim(c):
  """Cosine decay to zero: the SFT stage has a fixed budget and should end converged."""
  return ml_collections.ConfigDict(dict(
      learning_rate=c.learning_rate, warmup_steps=c.warmup_steps, schedule="cosine",
      weight_decay=c.weight_decay, b1=0.9, b2=0.99, max_grad_norm=1.0))

"""DPO: offline preference optimisation against a frozen reference (Rafailov et al., 2023).

    loss = -log sigmoid(beta * [(log pi(y_w|x) - log pi_ref(y_w|x))
                                - (log pi(y_l|x) - log pi_ref(y_l|x))])

with sequence log-probabilities summed over the completion and its eos. The reference is the SFT
policy, frozen; its log-probabilities are computed once per pair set (they never change).

Where the pairs come from (`config.dpo.pairs`):
- 'rlhf': the RLHF pipeline's preference pairs (SFT samples labelled by the hidden gold reward
  with Bradley-Terry noise), built and cached by `rloo_jax.preference_pairs.build_pairs`; needs
  `config.rlhf` (configs/summarize.py). The paper's setting: DPO sees the RM's preferences.
- 'reward': `samples_per_prompt` SFT samples per training prompt scored by `config.rewards` (the
  verifier on arithmetic): the best sample is chosen, the worst rejected, ties dropped.
- 'dataset': the task's own human preference data (`Task.preferences`: TL;DR's comparisons, HH's
  chosen / rejected dialogues), up to `num_pair_prompts` pairs: the paper's DPO row.

An iteration of the outer loop is one DPO step on `config.dpo.batch_size` pairs.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any, Mapping, Sequence

from flax import struct
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from rloo_jax import config_utils, loss, platform, rollout, sampling
from rloo_jax.config_utils import sequence_length
from rloo_jax.data import pipeline
from rloo_jax.models import transformer
from rloo_jax.optim import apply_if_finite, make_optimizer, with_learning_rate
from rloo_jax import preference_pairs
from rloo_jax.algorithms.base import AlgorithmBase

DPO_DEFAULTS = dict(
    beta=0.1,
    steps=200,
    batch_size=32,
    learning_rate=0.0,  # 0 = config.optim.learning_rate
    pairs="reward",  # 'reward' | 'rlhf' | 'dataset'
    num_pair_prompts=2048,
    samples_per_prompt=4,
    sample_temperature=1.0,
    sample_batch_size=256,
    eval_every=50,
)


def with_defaults(config) -> ml_collections.ConfigDict:
  """A copy of the config with a complete `config.dpo` section (missing fields get defaults)."""
  return config_utils.with_section_defaults(config, "dpo", DPO_DEFAULTS)


def validate(config) -> None:
  d = config.dpo
  if d.beta <= 0:
    raise ValueError(f"config.dpo.beta = {d.beta} must be > 0")
  if d.pairs not in ("reward", "rlhf", "dataset"):
    raise ValueError(f"config.dpo.pairs = {d.pairs!r}; choose 'reward', 'rlhf' or 'dataset'")
  if d.pairs == "rlhf" and "rlhf" not in config:
    raise ValueError("config.dpo.pairs = 'rlhf' needs a config.rlhf section (configs/summarize.py)")
  if d.samples_per_prompt < 2:
    raise ValueError(f"config.dpo.samples_per_prompt = {d.samples_per_prompt}: need >= 2")
  if d.steps < 0 or d.batch_size < 1:
    raise ValueError("config.dpo.steps must be >= 0 and batch_size >= 1")


# ----------------------------------------------------------------------------------------------
# Pure math


def dpo_loss(policy_chosen_b, policy_rejected_b, ref_chosen_b, ref_rejected_b, *, beta: float):
  """Mean DPO loss over pairs, and metrics (implicit-reward accuracy and margin)."""
  chosen = beta * (policy_chosen_b - ref_chosen_b)
  rejected = beta * (policy_rejected_b - ref_rejected_b)
  margin = chosen - rejected
  value = -jnp.mean(jax.nn.log_sigmoid(margin))
  return value, {"dpo_loss": value, "reward_accuracy": jnp.mean((margin > 0).astype(jnp.float32)),
                 "reward_margin": jnp.mean(margin), "chosen_reward": jnp.mean(chosen),
                 "rejected_reward": jnp.mean(rejected)}


def sequence_logprobs(fns, params, tokens_bs, token_mask_bs, loss_mask_bs, *, chunk_size: int):
  """Summed log-prob of the completion (+ eos) tokens of `[bos] prompt completion eos` rows,
  from hidden states in chunks of positions (no [B, S, V] logits)."""
  positions = jnp.broadcast_to(jnp.arange(tokens_bs.shape[1]), tokens_bs.shape)
  s = tokens_bs.shape[1] - 1
  hidden = fns.hidden(params, tokens_bs, positions, token_mask_bs, head_slice=(0, s))
  logp = loss.chunked_logprobs(fns.head, fns.head_params(params), hidden, tokens_bs[:, 1:],
                               loss_mask_bs[:, 1:], chunk_size=chunk_size)[0]
  return logp.sum(-1)


@struct.dataclass
class DPOState:
  step: jax.Array
  params: Any
  ref_params: Any  # the frozen SFT policy
  opt_state: Any


def train_step(state: DPOState, batch, *, fns, tx, beta: float, chunk_size: int):
  """One DPO step on `2B` rows (chosen then rejected) with precomputed reference log-probs."""
  b = batch["ref_logp"].shape[0] // 2

  def loss_fn(params):
    logp = sequence_logprobs(fns, params, batch["tokens"], batch["token_mask"],
                             batch["loss_mask"], chunk_size=chunk_size)
    return dpo_loss(logp[:b], logp[b:], batch["ref_logp"][:b], batch["ref_logp"][b:], beta=beta)

  (value, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  params, opt_state, guard = apply_if_finite(tx, grads, state.opt_state, state.params, value)
  return state.replace(step=state.step + 1, params=params, opt_state=opt_state), \
      dict(metrics, loss=value, **guard)


def pair_rows(pairs: Sequence[Mapping[str, Any]], tokenizer, seq_len: int) -> dict:
  """Chosen rows then rejected rows, `[bos] prompt completion eos` right-padded (numpy)."""
  prompts = [p["prompt"] for p in pairs]
  c = pipeline.make_sft_batch(prompts, [p["chosen"] for p in pairs], tokenizer, seq_len)
  r = pipeline.make_sft_batch(prompts, [p["rejected"] for p in pairs], tokenizer, seq_len)
  return {k: np.concatenate([c[k], r[k]]) for k in ("tokens", "token_mask", "loss_mask")}


# ----------------------------------------------------------------------------------------------
# Pairs


def reward_pairs(exp, params, records, rng, *, k: int, temperature: float, batch_size: int,
                 seed: int) -> tuple[list[dict], dict]:
  """Best vs worst of k SFT samples per prompt under the config's reward; ties are dropped."""
  samples = rollout.sample_records(exp, params, records, rng, k=k,
                                   method=sampling.Temperature(float(temperature)),
                                   batch_size=batch_size)
  keep = [i for i, s in enumerate(samples) if s]
  prompts = [records[i]["prompt"] for i in keep for _ in range(k)]
  texts = [t for i in keep for t in samples[i]]
  # The fields a rollout passes: the same stacking, repeated for the k samples of each prompt.
  fields = rollout.reward_fields(pipeline.record_fields([records[i] for i in keep]), k)
  scores, _ = exp.rewards(prompts, texts, fields)
  scores = np.asarray(scores, np.float64).reshape(len(keep), k)
  order = np.random.default_rng(seed)
  pairs, ties = [], 0
  for row, i in zip(scores, keep):
    ok = np.flatnonzero(np.isfinite(row))
    if len(ok) < 2 or np.ptp(row[ok]) == 0:
      ties += 1
      continue
    best = ok[np.flatnonzero(row[ok] == row[ok].max())]
    worst = ok[np.flatnonzero(row[ok] == row[ok].min())]
    w, l = int(order.choice(best)), int(order.choice(worst))
    pairs.append(dict(prompt=records[i]["prompt"], chosen=samples[i][w], rejected=samples[i][l],
                      reward_chosen=float(row[w]), reward_rejected=float(row[l])))
  return pairs, dict(num_prompts=len(records), no_preference=ties)


def build_pairs(config, exp, sft_params, workdir: str, *, log=print) -> list[dict]:
  d = config.dpo
  if d.pairs == "rlhf":
    pairs, _ = preference_pairs.build_pairs(config, exp, sft_params, workdir, log=log)
    return list(pairs["train"])
  if d.pairs == "dataset":
    return dataset_pairs(config, exp)
  path = os.path.join(workdir, "dpo_pairs.json")
  if os.path.exists(path):
    with open(path) as f:
      return json.load(f)["pairs"]
  train = exp.task.train
  n = min(d.num_pair_prompts, len(train))
  idx = np.random.default_rng(config.seed).permutation(len(train))[:n]
  records = [dict(train[int(i)]) for i in idx]
  pairs, counts = reward_pairs(exp, sft_params, records, jax.random.PRNGKey(config.seed + 11),
                               k=d.samples_per_prompt, temperature=d.sample_temperature,
                               batch_size=min(d.sample_batch_size, n), seed=config.seed)
  if len(pairs) < 2:
    raise ValueError(f"only {len(pairs)} preference pairs from {n} prompts: the SFT samples of "
                     f"{counts['no_preference']} prompts all scored the same; raise "
                     "config.dpo.samples_per_prompt or num_pair_prompts")
  preference_pairs.json_dump(dict(counts=counts, pairs=pairs), path)
  log(f"[dpo] {len(pairs)} pairs from {n} prompts ({counts['no_preference']} without a preference)")
  return pairs


def dataset_pairs(config, exp) -> list[dict]:
  """config.dpo.num_pair_prompts pairs of the task's preference data, a seeded random subset."""
  if exp.task.preferences is None:
    raise ValueError(f"config.dpo.pairs='dataset': task {exp.task.name!r} has no preference "
                     "data (tldr and hh have); use dpo.pairs='reward' or 'rlhf'")
  source = exp.task.preferences()
  n = min(int(config.dpo.num_pair_prompts), len(source))
  if n < 2:
    raise ValueError(f"config.dpo.pairs='dataset': {len(source)} preference pairs in the task's "
                     "data; DPO needs at least 2")
  idx = np.random.default_rng(config.seed).permutation(len(source))[:n]
  rows = [source[int(i)] for i in idx]
  return [dict(prompt=r["prompt"], chosen=r["chosen"], rejected=r["rejected"]) for r in rows]


def reference_logprobs(fns, ref_params, rows: dict, batch_size: int, chunk_size: int
                       ) -> np.ndarray:
  """Frozen reference log-probs of every row, in fixed-size batches (one compile)."""
  f = platform.jit(functools.partial(sequence_logprobs, fns, chunk_size=chunk_size))
  n = rows["tokens"].shape[0]
  out = []
  for s in range(0, n, batch_size):
    chunk = {k: v[s:s + batch_size] for k, v in rows.items()}
    pad = batch_size - chunk["tokens"].shape[0]
    if pad:
      chunk = {k: np.concatenate([v, np.zeros((pad,) + v.shape[1:], v.dtype)])
               for k, v in chunk.items()}
    out.append(np.asarray(f(ref_params, chunk["tokens"], chunk["token_mask"],
                            chunk["loss_mask"]))[:batch_size - pad])
  return np.concatenate(out)


class PairBatches:
  """Pair minibatches in shuffled passes; checkpointable like the prompt iterators."""

  num_dropped = 0  # every pair is kept

  def __init__(self, num_pairs: int, batch_size: int, seed: int):
    self.n, self.bs, self.seed = num_pairs, min(batch_size, num_pairs), seed
    self.num_records = num_pairs
    self.epoch, self.pos = 0, 0

  def _order(self):
    return np.random.default_rng([self.seed, self.epoch]).permutation(self.n)

  def __next__(self) -> np.ndarray:
    if self.pos + self.bs > self.n:
      self.epoch, self.pos = self.epoch + 1, 0
    idx = self._order()[self.pos:self.pos + self.bs]
    self.pos += self.bs
    return idx

  def get_state(self) -> dict:
    return dict(epoch=self.epoch, pos=self.pos)

  def set_state(self, state: Mapping[str, int]) -> None:
    self.epoch, self.pos = int(state["epoch"]), int(state["pos"])


class DPO(AlgorithmBase):
  """DPO as an algorithm of the outer loop: one iteration is one step on a pair batch."""

  name = "dpo"
  label = "DPO"

  def __init__(self, exp):
    super().__init__(exp)
    d = exp.config.dpo
    self.tx = make_optimizer(with_learning_rate(exp.config.optim, d.learning_rate), d.steps)
    self.step_fn = platform.jit(functools.partial(
        train_step, fns=exp.fns, tx=self.tx, beta=float(d.beta),
        chunk_size=int(exp.config.train.logprob_chunk_size)), donate_argnums=0)
    self.rows = self.ref_logp = None
    self.num_pairs = 0

  @property
  def num_iterations(self) -> int:
    return int(self.exp.config.dpo.steps)

  @property
  def eval_every(self) -> int:
    return int(self.exp.config.dpo.eval_every)

  def _init_state(self, params) -> DPOState:
    return DPOState(jnp.zeros((), jnp.int32), jax.tree.map(jnp.copy, params),
                    jax.tree.map(jnp.copy, params), self.tx.init(params))

  def init_state(self, params) -> DPOState:
    # The counters on the params' mesh: one compile of the step, not two.
    return self.exp.layout.replicate_unplaced(self._init_state(params))

  def abstract_state(self) -> DPOState:
    _, params = transformer.abstract(self.exp.model_config)
    return jax.eval_shape(self._init_state, params)

  def prepare(self, state: DPOState) -> None:
    """The pairs (cached in the workdir) and their frozen reference log-probs."""
    exp, d = self.exp, self.exp.config.dpo
    pairs = build_pairs(exp.config, exp, state.ref_params, exp.workdir)
    self.rows = pair_rows(pairs, exp.tokenizer, sequence_length(exp.config, with_eos=True))
    self.num_pairs = n = len(pairs)
    self.ref_logp = reference_logprobs(exp.fns, state.ref_params, self.rows,
                                       batch_size=min(2 * d.batch_size, 2 * n),
                                       chunk_size=int(exp.config.train.logprob_chunk_size))

  def batches(self) -> PairBatches:
    return PairBatches(self.num_pairs, self.exp.config.dpo.batch_size, self.exp.config.seed)

  def iteration(self, state: DPOState, idx: np.ndarray):
    rows_idx = np.concatenate([idx, idx + self.num_pairs])
    batch = {k: v[rows_idx] for k, v in self.rows.items()}
    batch["ref_logp"] = self.ref_logp[rows_idx]
    state, m = self.step_fn(state, batch)
    return state, {k: float(v) for k, v in jax.device_get(m).items()}

  def log_line(self, step: int, m: dict) -> str:
    return f"[dpo] step {step}: loss {m['loss']:.4f} accuracy {m['reward_accuracy']:.3f}"

  def summary_extra(self) -> dict:
    return {"num_pairs": self.num_pairs}

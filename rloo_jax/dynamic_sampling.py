"""Dynamic sampling (DAPO, Yu et al. 2025): `config.rloo.dynamic_sampling`.

A prompt whose usable samples all got the same reward has zero advantage under a group baseline
(RLOO, GRPO), so its k samples add nothing to the policy gradient but dilute the batch's
normaliser; late in training most groups are like that (all right). With dynamic sampling an
iteration rolls out further batches of `config.rloo.num_prompts` prompts, the next ones of the
data stream, until it holds num_prompts groups whose rewards differ, at most
`config.rloo.dynamic_sampling_max_rounds` rollouts in all, and trains on those groups. When the
bound comes first the batch is filled with equal-reward groups and the shortfall is counted
(`dynamic/equal_groups_kept`), never an error. "Equal" is judged on the reward the estimator
sees (after the NaN policy and overlong shaping, before the KL penalty). Every rollout has the
same shape, so no program compiles twice, and one rollout whose groups all differ trains
exactly as without dynamic sampling.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rloo_jax import advantage, platform, rollout, sampler


def check_config(config) -> None:
  """config.rloo.dynamic_sampling's settings; a ValueError naming the setting and its fix."""
  r = config.rloo
  if not r.get("dynamic_sampling", False):
    return
  if config.get("algorithm", "rloo") != "rloo":
    raise ValueError(f"config.rloo.dynamic_sampling drops groups of k samples, and "
                     f"config.algorithm={config.algorithm!r} draws none; set it False")
  est = advantage.spec(config.advantage.estimator)
  if r.k < 2 or not est.compares_samples:
    raise ValueError(f"config.rloo.dynamic_sampling drops groups whose k samples' rewards are "
                     f"equal, which needs a group baseline (k >= 2 and an estimator that compares "
                     f"samples, e.g. rloo or grpo); config.rloo.k = {r.k} with estimator "
                     f"{est.name!r}: set config.rloo.dynamic_sampling=False")
  rounds = r.get("dynamic_sampling_max_rounds", 0)
  if not isinstance(rounds, int) or rounds < 2:
    raise ValueError(f"config.rloo.dynamic_sampling_max_rounds = {rounds!r}: the most rollouts "
                     "an iteration makes to fill its batch must be an int >= 2 (the DAPO "
                     "recipe's max_num_gen_batches; e.g. 4)")


def informative(rewards_bk: np.ndarray, usable_bk: np.ndarray) -> np.ndarray:
  """bool [B]: groups with at least two usable samples whose usable rewards are not all equal."""
  lo = np.where(usable_bk, rewards_bk, np.inf).min(axis=1)
  hi = np.where(usable_bk, rewards_bk, -np.inf).max(axis=1)
  return (usable_bk.sum(axis=1) >= 2) & (hi > lo)


def choose(kept: np.ndarray, new: np.ndarray) -> np.ndarray:
  """Indices [B] into the B kept groups followed by the B new ones: the informative groups first
  (kept before new, each in order), then equal-reward ones in the same order."""
  both = np.concatenate([kept, new])
  order = np.concatenate([np.flatnonzero(both), np.flatnonzero(~both)])
  return order[:kept.shape[0]].astype(np.int32)


class Groups(NamedTuple):
  """A rollout's groups: the sample output on the devices, the rest global host arrays."""
  out: sampler.SampleOutput  # [B, k, ...] over the batch axes
  prompt_tokens: np.ndarray  # [B, P]
  prompt_lengths: np.ndarray  # [B]
  rewards_bk: np.ndarray
  usable_bk: np.ndarray
  parts: dict  # reward function name -> scores [B*k]
  informative: np.ndarray  # bool [B]


def _take(a, b, idx):
  """Rows `idx` of two rounds' arrays, concatenated."""
  return jax.tree.map(lambda x, y: jnp.concatenate([x, y])[idx], a, b)


class DynamicSampler:
  """Rolls out until the batch holds num_prompts informative groups, or the bound."""

  def __init__(self, exp, *, k: int, max_rounds: int):
    self.exp, self.k, self.max_rounds = exp, k, max_rounds
    self._take = platform.jit(_take, out_shardings=exp.layout.batch_sharding)

  def __call__(self, params, batch: dict, batches, rng):
    """(the trained groups' local data batch, SampleOutput, rewards_bk, usable_bk, non-finite
    count, parts, timings summed over the rounds, metrics under dynamic/). `batches` gives the
    next data batches (the run's prompt stream, whose checkpointed position they advance)."""
    exp, layout = self.exp, self.exp.layout
    kept, timings, drawn = None, {}, {"tokens": 0, "equal": 0, "reward": [], "nonfinite": 0}
    rounds = 0
    while rounds < self.max_rounds and (kept is None or not kept.informative.all()):
      data = batch if rounds == 0 else next(batches)
      key = rng if rounds == 0 else jax.random.fold_in(rng, 1_000_003 + rounds)
      out, rewards_bk, usable_bk, nonfinite, parts, t, _ = rollout.timed_rollout(
          exp, params, data, key, k=self.k)
      for name, v in t.items():
        timings[name] = timings.get(name, 0.0) + v
      new = Groups(out, layout.gather_rows(np.asarray(data["prompt_tokens"])),
                   layout.gather_rows(np.asarray(data["prompt_lengths"])), rewards_bk,
                   usable_bk, parts, informative(rewards_bk, usable_bk))
      drawn["tokens"] += int(layout.gather(out.lengths_bk).sum())
      drawn["equal"] += int((~new.informative).sum())
      drawn["reward"].append(rewards_bk[usable_bk])
      drawn["nonfinite"] += nonfinite
      kept = new if kept is None else self._merge(kept, new)
      rounds += 1
    b = kept.rewards_bk.shape[0]
    local = lambda x: layout.local_rows(layout.put_global_batch(x))  # noqa: E731
    trained = {"prompt_tokens": local(kept.prompt_tokens),
               "prompt_lengths": local(kept.prompt_lengths)}
    rewards = np.concatenate(drawn["reward"])
    metrics = {"dynamic/rounds": float(rounds), "dynamic/groups_sampled": float(rounds * b),
               "dynamic/frac_equal_sampled": drawn["equal"] / (rounds * b),
               "dynamic/equal_groups_kept": float((~kept.informative).sum()),
               "dynamic/reward_mean_sampled": float(rewards.mean()) if rewards.size
               else float("nan"),
               "rollout_tokens_per_s": drawn["tokens"] / max(timings["rollout_s"], 1e-9)}
    return (trained, kept.out, kept.rewards_bk, kept.usable_bk, drawn["nonfinite"], kept.parts,
            timings, metrics)

  def _merge(self, kept: Groups, new: Groups) -> Groups:
    idx = choose(kept.informative, new.informative)
    host = lambda a, b: np.concatenate([a, b])[idx]  # noqa: E731
    sample_idx = (idx[:, None] * self.k + np.arange(self.k)).reshape(-1)
    parts = {name: np.concatenate([kept.parts[name], new.parts[name]])[sample_idx]
             for name in kept.parts}
    return Groups(self._take(kept.out, new.out, jax.device_put(idx)),
                  *(host(a, b) for a, b in zip(kept[1:5], new[1:5])), parts,
                  host(kept.informative, new.informative))


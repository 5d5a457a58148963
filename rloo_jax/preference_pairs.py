"""Preference pairs from a policy's samples: SFT samples of training prompts, paired and
labelled by the hidden gold reward (config.rlhf.gold_reward) with Bradley-Terry noise, split by
prompt into train / held out. The RLHF pipeline trains its reward model on them and DPO
(`config.dpo.pairs='rlhf'`) trains on the same pairs."""

from __future__ import annotations

import json
import os
from typing import Callable, Sequence

import jax
import numpy as np

from rloo_jax import config_utils
from rloo_jax import rollout, sampling
from rloo_jax.rewards import registry
from rloo_jax.rewards.preferences import bradley_terry_prefer

PAIRS_VERSION = 1


def make_pairs(prompts: Sequence[str], samples: Sequence[Sequence[str]],
               gold_fn: Callable[..., np.ndarray], rng: np.random.Generator, *,
               bt_temperature: float, pairs_per_prompt: int = 1) -> tuple[list[dict], dict]:
  """Up to `pairs_per_prompt` disjoint pairs of *distinct* samples per prompt (identical texts
  carry no preference), labelled by the gold reward with Bradley-Terry noise.

  Returns (pairs in prompt order, counts); each pair is {prompt, chosen, rejected, gold_chosen,
  gold_rejected}."""
  if pairs_per_prompt < 1:
    raise ValueError(f"pairs_per_prompt={pairs_per_prompt} must be >= 1")
  firsts, seconds, kept_prompts = [], [], []
  no_pair = 0
  for p, s in zip(prompts, samples):
    distinct = list(dict.fromkeys(s))
    if len(distinct) < 2:
      no_pair += 1
      continue
    order = rng.permutation(len(distinct))
    for j in range(min(pairs_per_prompt, len(distinct) // 2)):
      kept_prompts.append(p)
      firsts.append(distinct[order[2 * j]])
      seconds.append(distinct[order[2 * j + 1]])
  if not kept_prompts:
    return [], dict(num_prompts=len(prompts), no_distinct_samples=no_pair, unscorable=0)
  ga = np.asarray(gold_fn(kept_prompts, firsts), np.float64)
  gb = np.asarray(gold_fn(kept_prompts, seconds), np.float64)
  ok = np.isfinite(ga) & np.isfinite(gb)
  prefer_a = bradley_terry_prefer(ga, gb, rng, temperature=bt_temperature)
  pairs = []
  for n in np.flatnonzero(ok):
    a, b, g_a, g_b = firsts[n], seconds[n], float(ga[n]), float(gb[n])
    if not prefer_a[n]:
      a, b, g_a, g_b = b, a, g_b, g_a
    pairs.append(dict(prompt=kept_prompts[n], chosen=a, rejected=b, gold_chosen=g_a,
                      gold_rejected=g_b))
  return pairs, dict(num_prompts=len(prompts), no_distinct_samples=no_pair,
                     unscorable=int((~ok).sum()))


def split_by_prompt(pairs: Sequence[dict], eval_fraction: float) -> tuple[list, list]:
  """The last ~eval_fraction of the prompts (with all their pairs) are held out, so no held-out
  pair shares a prompt with a training pair."""
  prompts = list(dict.fromkeys(p["prompt"] for p in pairs))
  held = set(prompts[len(prompts) - max(1, int(round(len(prompts) * eval_fraction))):])
  return [p for p in pairs if p["prompt"] not in held], [p for p in pairs if p["prompt"] in held]


def json_load(path):
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def json_dump(obj, path):
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=1)
  os.replace(tmp, path)  # atomic: a killed run never leaves a half-written cache file


def pairs_settings(config) -> dict:
  r = config.rlhf
  return dict(version=PAIRS_VERSION, seed=config.seed, sft=config.sft.to_dict(),
              model=config_utils.model_fingerprint(config), data=config.data.to_dict(),
              task=config.task,
              max_new_tokens=config.rloo.max_new_tokens, num_pair_prompts=r.num_pair_prompts,
              samples_per_prompt=r.samples_per_prompt, sample_temperature=r.sample_temperature,
              pairs_per_prompt=r.pairs_per_prompt,
              bt_temperature=r.bt_temperature, eval_pair_fraction=r.eval_pair_fraction,
              gold_reward=r.gold_reward)


def build_pairs(config, exp, sft_params, workdir: str, *, log=print) -> tuple[dict, bool]:
  """SFT samples on training prompts -> pairs labelled by config.rlhf.gold_reward, split by
  prompt into train / eval; cached in <workdir>/pairs/pairs.json with their settings."""
  gold_fn = registry.resolve(config.rlhf.gold_reward)
  path = os.path.join(workdir, "pairs", "pairs.json")
  settings = pairs_settings(config)
  cached = json_load(path)
  if cached is not None and cached.get("settings") == json.loads(json.dumps(settings)):
    log(f"[pairs] reusing {len(cached['train'])} + {len(cached['eval'])} pairs from {path}")
    return cached, True
  r = config.rlhf
  train = exp.task.train
  rng = np.random.default_rng(config.seed)
  n = min(r.num_pair_prompts, len(train))
  records = [train[int(i)] for i in rng.permutation(len(train))[:n]]
  samples = rollout.sample_records(exp, sft_params, records, jax.random.PRNGKey(config.seed + 7),
                               k=r.samples_per_prompt,
                               method=sampling.Temperature(float(r.sample_temperature)),
                               batch_size=min(r.sample_batch_size, n))
  prompts = [rec["prompt"] for rec in records]
  pairs, counts = make_pairs(prompts, samples, gold_fn, rng, bt_temperature=r.bt_temperature,
                             pairs_per_prompt=r.pairs_per_prompt)
  train_pairs, eval_pairs = split_by_prompt(pairs, r.eval_pair_fraction)
  if not train_pairs or not eval_pairs:
    raise ValueError(f"{len(pairs)} preference pairs from {n} prompts leave {len(train_pairs)} "
                     f"to train on and {len(eval_pairs)} held out: the SFT policy's "
                     f"{r.samples_per_prompt} samples were identical for "
                     f"{counts['no_distinct_samples']} prompts; raise config.rlhf.num_pair_prompts,"
                     " samples_per_prompt or sample_temperature")
  out = dict(settings=settings, counts=counts, train=train_pairs, eval=eval_pairs,
             sft_samples=[dict(prompt=p, completions=s) for p, s in zip(prompts, samples) if s])
  os.makedirs(os.path.dirname(path), exist_ok=True)
  json_dump(out, path)
  log(f"[pairs] {len(out['train'])} train + {len(out['eval'])} held-out pairs from {n} prompts "
      f"({counts['no_distinct_samples']} prompts had no two distinct samples) -> {path}")
  return out, False

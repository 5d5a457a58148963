"""The full RLHF pipeline: SFT -> SFT samples -> preference pairs -> reward model -> RLOO -> evaluation.

The RLOO paper's setting (TL;DR / HH): a policy is fine-tuned on demonstrations, a reward model is
trained on human preferences between policy samples, RLOO optimises the learned reward with a KL
penalty to the SFT policy, and the result is judged by win rate against the SFT policy. Here the
"human" is a hidden gold reward (`config.rlhf.gold_reward`), so the pipeline can also measure what
a real one cannot: how the proxy (learned) reward and the gold reward diverge as RL pushes on the
proxy (over-optimisation).

Stages and their cache in the workdir (a rerun reuses every finished stage whose settings match):

    data/                     the task's prepared dataset (tasks.make)
    sft/                      the SFT policy (rloo_jax.sft, via trainer.initial_params)
    pairs/pairs.json          SFT samples, the pairs drawn from them, and their settings
    reward_model/             the Bradley-Terry reward model + whitening stats (RewardModelScorer)
    rloo/checkpoints/         RLOO state + per-iteration history (resumes mid-run)
    rloo/metrics.jsonl        train/ and eval/ metrics (and tensorboard/)
    rlhf_summary.json, rlhf_table.md, gold_vs_proxy.png, reward_vs_kl.png, timings.json

Everything jitted lives in the modules it calls (sampler, trainer, reward_model); this file is the
outer loop: data movement between stages, caching, evaluation and reporting.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rloo_jax import rewards as rewards_lib
from rloo_jax import sampler, sampling, sft, trainer
from rloo_jax.checkpoint import Checkpointer
from rloo_jax.data import pipeline
from rloo_jax.metrics import MetricWriter, win_rate_stats
from rloo_jax.rewards import reward_model

PAIRS_VERSION = 1


# ----------------------------------------------------------------------------------------------
# Validation: everything that can fail on the config fails here, before data, SFT or any compile.


def validate(config) -> None:
  if "rlhf" not in config:
    raise ValueError("config has no `rlhf` section (pair, reward-model and evaluation settings); "
                     "start from configs/summarize.py")
  r = config.rlhf
  if jax.process_count() > 1:
    raise ValueError("the RLHF pipeline runs in one process (its stages pass host data between "
                     "them); run it without jax.distributed, on one or more local devices")
  trainer.validate_config(config)
  rewards_lib.resolve(r.gold_reward)  # names the module / attribute if the gold reward is wrong
  if r.samples_per_prompt < 2:
    raise ValueError(f"config.rlhf.samples_per_prompt = {r.samples_per_prompt}: a preference pair "
                     "needs at least 2 samples per prompt")
  if r.pairs_per_prompt < 1 or 2 * r.pairs_per_prompt > r.samples_per_prompt:
    raise ValueError(f"config.rlhf.pairs_per_prompt = {r.pairs_per_prompt}: need 1 <= "
                     f"pairs_per_prompt <= samples_per_prompt / 2 = {r.samples_per_prompt // 2} "
                     "(the pairs of a prompt are disjoint)")
  if r.num_pair_prompts < 2:
    raise ValueError(f"config.rlhf.num_pair_prompts = {r.num_pair_prompts}: need >= 2 prompts")
  if not 0.0 < r.eval_pair_fraction < 1.0:
    raise ValueError(f"config.rlhf.eval_pair_fraction = {r.eval_pair_fraction} must be in (0, 1)")
  if r.bt_temperature < 0:
    raise ValueError(f"config.rlhf.bt_temperature = {r.bt_temperature} must be >= 0 "
                     "(0 = noiseless labels)")
  if r.sample_temperature <= 0:
    raise ValueError(f"config.rlhf.sample_temperature = {r.sample_temperature} must be > 0: "
                     "greedy samples of one prompt are all equal and make no pairs")
  if r.rm_steps < 1 or r.rm_batch_size < 1 or r.score_batch_size < 1 or r.sample_batch_size < 1:
    raise ValueError("config.rlhf.rm_steps, rm_batch_size, score_batch_size and "
                     "sample_batch_size must be >= 1")
  if r.clip < 0:
    raise ValueError(f"config.rlhf.clip = {r.clip} must be >= 0 (0 = no clipping)")
  if r.eval_every < 0 or r.eval_prompts < 1:
    raise ValueError("config.rlhf.eval_every must be >= 0 and eval_prompts >= 1")
  need = rm_seq_len(config)
  if need > config.model.max_seq_len:
    raise ValueError(f"the reward model scores [prompt | completion | eos]: "
                     f"config.data.max_prompt_len ({config.data.max_prompt_len}) + "
                     f"config.rloo.max_new_tokens ({config.rloo.max_new_tokens}) + 1 = {need} "
                     f"exceeds config.model.max_seq_len = {config.model.max_seq_len}; raise it")


def rm_seq_len(config) -> int:
  # A completion that hit max_new_tokens without eos is re-tokenised with an eos appended.
  return config.data.max_prompt_len + config.rloo.max_new_tokens + 1


def with_rewards(config, fns: Sequence[Any], weights: Sequence[float]):
  """A copy of the config whose reward set is `fns` (the caller's config is left alone)."""
  c = copy.deepcopy(config)
  c.rewards.fns = list(fns)
  c.rewards.weights = [float(w) for w in weights]
  return c


# ----------------------------------------------------------------------------------------------
# Sampling and pairs


def sample_completions(exp: trainer.Experiment, params, records: Sequence[Mapping[str, Any]], rng,
                       *, k: int, method: sampling.Method, batch_size: int) -> list[list[str]]:
  """k completions (decoded text) per record, in record order, with one compiled batch shape.

  Records whose prompt exceeds config.data.max_prompt_len get an empty list."""
  c = exp.config
  out: list[list[str]] = [[] for _ in records]
  batches = pipeline.prompt_batches(list(records), exp.tokenizer, global_batch_size=batch_size,
                                    max_prompt_len=c.data.max_prompt_len, shuffle=False,
                                    num_epochs=1, drop_remainder=False, overlong="drop")
  # Rows placed as the trainer places them (split over the mesh's batch axes), so the sampler
  # compiled here is the one the RLOO rollouts reuse when the shapes agree.
  layout = getattr(exp, "layout", None)
  put = layout.shard_batch if layout is not None else jnp.asarray
  local = layout.local_rows if layout is not None else np.asarray
  extra = dict(batch_sharding=layout.batch_sharding) if layout is not None else {}
  for i, batch in enumerate(batches):
    res = sampler.sample(exp.fns, params, put(batch["prompt_tokens"]),
                         put(batch["prompt_lengths"]), jax.random.fold_in(rng, i), k=k,
                         max_new_tokens=c.rloo.max_new_tokens, method=method,
                         eos_id=exp.tokenizer.eos_id, pad_id=exp.tokenizer.pad_id,
                         mode=c.rloo.sampler_mode, max_seq_len=exp.model_config.max_seq_len,
                         **extra)
    b = batch["prompt_tokens"].shape[0]
    texts = trainer.decode_completions(exp.tokenizer, local(res.tokens_bkt).reshape(b * k, -1),
                                       local(res.lengths_bk).reshape(-1))
    for row, (index, valid) in enumerate(zip(batch["index"], batch["valid"])):
      if valid:
        out[int(index)] = texts[row * k:(row + 1) * k]
  return out


def make_pairs(prompts: Sequence[str], samples: Sequence[Sequence[str]],
               gold_fn: Callable[..., np.ndarray], rng: np.random.Generator, *,
               bt_temperature: float, pairs_per_prompt: int = 1) -> tuple[list[dict], dict]:
  """Up to `pairs_per_prompt` disjoint pairs of *distinct* samples per prompt (identical texts
  carry no preference), labelled by the gold reward with Bradley-Terry noise.

  Returns (pairs in prompt order, counts); each pair is {prompt, chosen, rejected, gold_chosen,
  gold_rejected}."""
  from rloo_jax.data.summarize import bradley_terry_prefer  # the labeller's noise model
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


class GoldTap:
  """The proxy reward, passed through unchanged, that also records the gold reward of the same
  rollouts: the trainer optimises the proxy and never sees gold, while the pipeline can log the
  gold-vs-proxy curve without any change to `trainer.rl_iteration`."""

  def __init__(self, proxy: Callable[..., Any], gold: Callable[..., Any]):
    self.proxy, self.gold = proxy, gold
    self.__name__ = getattr(proxy, "__name__", "proxy")
    self.last: dict[str, np.ndarray] = {}

  def __call__(self, prompts, completions, **fields):
    r = np.asarray(self.proxy(prompts, completions, **fields), np.float32)
    self.last = dict(proxy=r, gold=np.asarray(self.gold(prompts, completions, **fields),
                                              np.float32))
    return r


# ----------------------------------------------------------------------------------------------
# Stages


def _json_load(path):
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def _json_dump(obj, path):
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=1)
  os.replace(tmp, path)  # atomic: a killed run never leaves a half-written cache file


def _pairs_settings(config) -> dict:
  r = config.rlhf
  return dict(version=PAIRS_VERSION, seed=config.seed, sft=config.sft.to_dict(),
              model=config.model.to_dict(), data=config.data.to_dict(), task=config.task,
              max_new_tokens=config.rloo.max_new_tokens, num_pair_prompts=r.num_pair_prompts,
              samples_per_prompt=r.samples_per_prompt, sample_temperature=r.sample_temperature,
              pairs_per_prompt=r.pairs_per_prompt,
              bt_temperature=r.bt_temperature, eval_pair_fraction=r.eval_pair_fraction,
              gold_reward=r.gold_reward)


def _rm_settings(config) -> dict:
  r = config.rlhf
  return dict(pairs=_pairs_settings(config), steps=r.rm_steps, batch_size=r.rm_batch_size,
              learning_rate=r.rm_learning_rate, warmup_steps=r.rm_warmup_steps,
              weight_decay=r.rm_weight_decay, whiten=r.whiten, clip=r.clip,
              seq_len=rm_seq_len(config))


def build_pairs(config, exp, sft_params, gold_fn, workdir: str, *, log=print) -> tuple[dict, bool]:
  """SFT samples on training prompts -> labelled pairs, split by prompt into train / eval."""
  path = os.path.join(workdir, "pairs", "pairs.json")
  settings = _pairs_settings(config)
  cached = _json_load(path)
  if cached is not None and cached.get("settings") == json.loads(json.dumps(settings)):
    log(f"[pairs] reusing {len(cached['train'])} + {len(cached['eval'])} pairs from {path}")
    return cached, True
  r = config.rlhf
  train = exp.task.train
  rng = np.random.default_rng(config.seed)
  n = min(r.num_pair_prompts, len(train))
  records = [train[int(i)] for i in rng.permutation(len(train))[:n]]
  samples = sample_completions(exp, sft_params, records, jax.random.PRNGKey(config.seed + 7),
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
  _json_dump(out, path)
  log(f"[pairs] {len(out['train'])} train + {len(out['eval'])} held-out pairs from {n} prompts "
      f"({counts['no_distinct_samples']} prompts had no two distinct samples) -> {path}")
  return out, False


def build_reward_model(config, exp, sft_params, pairs: dict, workdir: str, *,
                       log=print) -> tuple[reward_model.RewardModelScorer, dict, bool]:
  """Trains (or restores) the RM from the SFT policy; whitening stats from the SFT samples."""
  r = config.rlhf
  directory = os.path.join(workdir, "reward_model")
  settings = json.loads(json.dumps(_rm_settings(config)))
  try:
    meta = reward_model.read_meta(directory)
  except (FileNotFoundError, ValueError):
    meta = None
  if meta is not None and meta["extra"].get("settings") == settings:
    scorer = reward_model.RewardModelScorer.load(directory, batch_size=r.score_batch_size)
    log(f"[rm] reusing the reward model in {directory}")
    return scorer, meta["extra"], True
  options = reward_model.TrainOptions(
      steps=r.rm_steps, batch_size=r.rm_batch_size, learning_rate=r.rm_learning_rate,
      warmup_steps=r.rm_warmup_steps, weight_decay=r.rm_weight_decay, log_every=r.rm_log_every,
      seed=config.seed)
  scorer, history = reward_model.train(
      exp.model_config, sft_params, exp.tokenizer, pairs["train"], seq_len=rm_seq_len(config),
      options=options, eval_pairs=pairs["eval"], score_batch_size=r.score_batch_size, log=log)
  # Whitening statistics from every SFT sample (not only the paired ones): the starting policy's
  # rewards are then ~N(0, 1), so beta and the clip range mean the same thing for any RM.
  prompts = [s["prompt"] for s in pairs["sft_samples"] for _ in s["completions"]]
  texts = [t for s in pairs["sft_samples"] for t in s["completions"]]
  scorer = scorer.calibrate(prompts, texts, whiten=bool(r.whiten))
  scorer = dataclasses.replace(scorer, clip=float(r.clip))
  extra = dict(settings=settings, history=history,
               eval=reward_model.evaluate_pairs(scorer, pairs["eval"]),
               train_eval=reward_model.evaluate_pairs(scorer, pairs["train"][:len(pairs["eval"])]))
  scorer.save(directory, step=r.rm_steps, extra=extra)
  log(f"[rm] saved to {directory}: held-out accuracy {extra['eval']['accuracy']:.3f}, whitening "
      f"mean {scorer.mean:.3f} std {scorer.std:.3f} over {scorer.stats_samples} SFT samples")
  return scorer, extra, False


def evaluate_policy(exp, params, records, scorer, gold_fn, sft_gold=None, *, batch_size: int,
                    method: sampling.Method = sampling.Greedy()):
  """One completion per held-out prompt (greedy by default) judged by gold (and by the proxy the
  policy saw). Sampled evaluations use one fixed key, so two policies are compared on common
  random numbers."""
  texts = [s[0] if s else "" for s in sample_completions(
      exp, params, records, jax.random.PRNGKey(0), k=1, method=method, batch_size=batch_size)]
  prompts = [r["prompt"] for r in records]
  gold = np.asarray(gold_fn(prompts, texts), np.float64)
  proxy = np.asarray(scorer(prompts, texts), np.float64)
  out = dict(gold_reward=float(np.nanmean(gold)), proxy_reward=float(np.nanmean(proxy)),
             length=float(np.mean([len(exp.tokenizer.encode(t)) for t in texts])))
  if sft_gold is not None:
    out.update(win_rate_stats(gold, sft_gold))
  return out, gold, texts


# ----------------------------------------------------------------------------------------------
# The pipeline


def _timings(workdir):
  return _json_load(os.path.join(workdir, "timings.json")) or {}


def run(config, workdir: str, *, log=print) -> dict:
  """Runs (or resumes) every stage and returns the summary (also written to the workdir)."""
  t_start = time.time()
  workdir = os.path.abspath(workdir)
  validate(config)
  os.makedirs(workdir, exist_ok=True)
  r = config.rlhf
  gold_fn = rewards_lib.resolve(r.gold_reward)
  timings = _timings(workdir)

  # 1. SFT. The gold reward stands in the reward slot only so `build` resolves something: nothing
  # in this stage computes a reward.
  t0 = time.time()
  exp = trainer.build(with_rewards(config, [r.gold_reward], [1.0]), workdir)
  task = exp.task
  sft_cached = sft.is_cached(config, workdir)
  sft_params = trainer.initial_params(exp, log=log)
  if not sft_cached:
    timings["sft_s"] = time.time() - t0

  # 2. Preference pairs from SFT samples.
  t0 = time.time()
  pairs, cached = build_pairs(config, exp, sft_params, gold_fn, workdir, log=log)
  if not cached:
    timings["pairs_s"] = time.time() - t0

  # 3. Reward model.
  t0 = time.time()
  scorer, rm_info, cached = build_reward_model(config, exp, sft_params, pairs, workdir, log=log)
  if not cached:
    timings["rm_s"] = time.time() - t0
  _json_dump(timings, os.path.join(workdir, "timings.json"))

  # 4. RLOO on the learned reward.
  t0 = time.time()
  tap = GoldTap(scorer, gold_fn)
  rl_exp = trainer.build(with_rewards(config, [tap], [1.0]), workdir, task=task)
  test = [task.test[i] for i in range(min(r.eval_prompts, len(task.test)))]
  eval_bs = min(config.train.eval_batch_size, len(test))
  sft_eval, sft_gold, sft_texts = evaluate_policy(rl_exp, sft_params, test, scorer, gold_fn,
                                                  batch_size=eval_bs)
  sft_eval.update(win_rate_stats(sft_gold, sft_gold))
  sft_sampled, sft_sampled_gold, _ = evaluate_policy(rl_exp, sft_params, test, scorer, gold_fn,
                                                     batch_size=eval_bs, method=rl_exp.method)
  rl_dir = os.path.join(workdir, "rloo")
  ckpt = Checkpointer(os.path.join(rl_dir, "checkpoints"), keep=2)
  data = pipeline.prompt_batches(task.train, rl_exp.tokenizer,
                                 global_batch_size=config.rloo.num_prompts,
                                 max_prompt_len=config.data.max_prompt_len, seed=config.seed,
                                 overlong=config.data.overlong)
  restored = ckpt.restore(trainer.abstract_state(rl_exp)) if ckpt.latest_step() is not None \
      else None
  if restored is not None:
    step, state, meta = restored
    data.set_state(meta["data"])
    history, evals = meta["history"], meta["evals"]
    log(f"[rloo] resumed from iteration {step} in {ckpt.directory}")
  else:
    # A copy: the policy's buffers are donated by the train step, the SFT params are still needed.
    state = trainer.init_state(rl_exp, jax.tree.map(jnp.copy, sft_params))
    history, evals = [], [dict(sft_eval, step=0)]
  writer = MetricWriter(rl_dir)
  n_iter = config.train.num_iterations
  for it in range(int(state.step), n_iter):
    state, m = trainer.rl_iteration(rl_exp, state, next(data))
    step = it + 1
    gold = tap.last["gold"]
    row = dict(step=step, proxy_reward=m["reward_mean"], gold_reward=float(np.nanmean(gold)),
               kl=m["kl"], penalised_reward=m["penalised_reward"],
               completion_length=m["completion_length"], iteration_s=m["iteration_s"])
    history.append(row)
    writer.write(step, dict(m, gold_reward=row["gold_reward"]), prefix="train/")
    if step % config.train.log_every == 0:
      log(f"[rloo] iteration {step}/{n_iter}: proxy {row['proxy_reward']:+.3f} gold "
          f"{row['gold_reward']:.3f} kl {row['kl']:.3f} ({row['iteration_s']:.2f}s)")
    if (r.eval_every and step % r.eval_every == 0) or step == n_iter:
      ev, _, _ = evaluate_policy(rl_exp, state.params, test, scorer, gold_fn, sft_gold,
                                 batch_size=eval_bs)
      evals.append(dict(ev, step=step))
      writer.write(step, ev, prefix="eval/")
      log(f"[eval] iteration {step}: held-out greedy gold {ev['gold_reward']:.3f} proxy "
          f"{ev['proxy_reward']:+.3f} win rate vs SFT {ev['win_rate']:.3f}")
    if step % config.train.checkpoint_every == 0 or step == n_iter:
      ckpt.save(step, state, dict(data=data.get_state(), history=history, evals=evals),
                force=True)
  ckpt.close()
  writer.close()
  if restored is None or int(restored[0]) < n_iter:  # some iterations ran in this process
    timings["rloo_s"] = (timings.get("rloo_s", 0.0) if restored is not None else 0.0) \
        + time.time() - t0

  # 5. Final evaluation and report.
  t0 = time.time()
  final, final_gold, final_texts = evaluate_policy(rl_exp, state.params, test, scorer, gold_fn,
                                                   sft_gold, batch_size=eval_bs)
  final_sampled, _, _ = evaluate_policy(rl_exp, state.params, test, scorer, gold_fn,
                                        sft_sampled_gold, batch_size=eval_bs, method=rl_exp.method)
  timings["eval_s"] = time.time() - t0
  timings["this_run_s"] = time.time() - t_start
  _json_dump(timings, os.path.join(workdir, "timings.json"))
  summary = dict(
      task=config.task, seed=config.seed, eval_prompts=len(test),
      sft_steps=config.sft.steps, rm_steps=r.rm_steps, rloo_iterations=int(state.step),
      k=config.rloo.k, beta=float(config.kl.beta),
      pairs=dict(train=len(pairs["train"]), eval=len(pairs["eval"]), **pairs["counts"]),
      reward_model=dict(eval=rm_info["eval"], train_eval=rm_info.get("train_eval"),
                        whiten=bool(scorer.whiten), mean=scorer.mean, std=scorer.std,
                        clip=scorer.clip),
      sft=sft_eval, rloo=final, sft_sampled=sft_sampled, rloo_sampled=final_sampled,
      sample_temperature=float(config.rloo.temperature), history=history, evals=evals, timings=timings,
      examples=[dict(prompt=test[i]["prompt"], sft=sft_texts[i], rloo=final_texts[i],
                     gold_sft=float(sft_gold[i]), gold_rloo=float(final_gold[i]))
                for i in range(min(5, len(test)))])
  _json_dump(summary, os.path.join(workdir, "rlhf_summary.json"))
  plot_curves(history, evals, workdir)
  table = format_table(summary)
  with open(os.path.join(workdir, "rlhf_table.md"), "w") as f:
    f.write(table + "\n")
  log(table)
  return dict(summary, state=state, scorer=scorer)


# ----------------------------------------------------------------------------------------------
# Report


def _smooth(x, window: int):
  x = np.asarray(x, np.float64)
  if len(x) < window or window < 2:
    return x
  kernel = np.ones(window) / window
  head = [x[:i + 1].mean() for i in range(window - 1)]
  return np.concatenate([head, np.convolve(x, kernel, mode="valid")])


def plot_curves(history: Sequence[Mapping[str, float]], evals: Sequence[Mapping[str, float]],
                workdir: str) -> list[str]:
  """gold_vs_proxy.png (rollouts and held-out greedy over iterations) and reward_vs_kl.png."""
  import matplotlib
  matplotlib.use("Agg")  # files only: no display on a training machine
  import matplotlib.pyplot as plt
  paths = []
  steps = [h["step"] for h in history]
  w = max(1, len(history) // 15)
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for ax, xs, gold, proxy, title in (
      (axes[0], steps, _smooth([h["gold_reward"] for h in history], w),
       _smooth([h["proxy_reward"] for h in history], w),
       f"RLOO rollouts (sampled; moving average of {w})"),
      (axes[1], [e["step"] for e in evals], [e["gold_reward"] for e in evals],
       [e["proxy_reward"] for e in evals], "held-out prompts (greedy)")):
    ax.plot(xs, gold, "o-" if ax is axes[1] else "-", color="tab:green", label="gold reward")
    ax.set_xlabel("RLOO iteration")
    ax.set_ylabel("gold reward", color="tab:green")
    twin = ax.twinx()
    twin.plot(xs, proxy, "s--" if ax is axes[1] else "--", color="tab:purple",
              label="proxy reward (RM, whitened)")
    twin.set_ylabel("proxy reward (reward model)", color="tab:purple")
    ax.set_title(title, fontsize=10)
    lines = ax.get_lines() + twin.get_lines()
    ax.legend(lines, [l.get_label() for l in lines], loc="lower right", fontsize=8)
  fig.suptitle("gold vs proxy reward while RLOO optimises the learned reward")
  fig.tight_layout()
  paths.append(os.path.join(workdir, "gold_vs_proxy.png"))
  fig.savefig(paths[-1], dpi=110)
  plt.close(fig)

  fig, ax = plt.subplots(figsize=(6, 4.2))
  kl = np.asarray([h["kl"] for h in history])
  sc = ax.scatter(kl, [h["gold_reward"] for h in history], c=steps, cmap="viridis", s=14,
                  label="gold reward")
  ax.plot(_smooth(kl, w), _smooth([h["gold_reward"] for h in history], w), color="tab:green")
  twin = ax.twinx()
  twin.plot(_smooth(kl, w), _smooth([h["proxy_reward"] for h in history], w), "--",
            color="tab:purple", label="proxy reward (moving average)")
  twin.set_ylabel("proxy reward (reward model)", color="tab:purple")
  ax.set_xlabel("KL(policy || SFT) per completion (k1, nats)")
  ax.set_ylabel("gold reward of rollouts", color="tab:green")
  fig.colorbar(sc, ax=twin, pad=0.12, label="iteration")
  ax.set_title("reward vs KL over RLOO training", fontsize=10)
  fig.tight_layout()
  paths.append(os.path.join(workdir, "reward_vs_kl.png"))
  fig.savefig(paths[-1], dpi=110)
  plt.close(fig)
  return paths


def format_table(s: Mapping[str, Any]) -> str:
  t, rm, p = s["timings"], s["reward_model"], s["pairs"]

  def sec(key):
    return f"{t[key]:.0f} s" if key in t else "-"

  ev = rm["eval"]
  lines = [
      f"\nRLHF pipeline on {s['task']} (seed {s['seed']}): SFT {s['sft_steps']} steps -> "
      f"{p['train']} + {p['eval']} preference pairs -> reward model {s['rm_steps']} steps -> "
      f"RLOO {s['rloo_iterations']} iterations (k={s['k']}, beta={s['beta']})",
      "",
      f"| {'stage':<13} | {'result':<66} | {'time':>7} |",
      f"|{'-' * 15}|{'-' * 68}|{'-' * 9}|",
      f"| {'SFT':<13} | {'held-out greedy gold reward %.3f' % s['sft']['gold_reward']:<66} | "
      f"{sec('sft_s'):>7} |",
      f"| {'pairs':<13} | {'%d train / %d held-out; %d prompts without 2 distinct samples' % (p['train'], p['eval'], p['no_distinct_samples']):<66} | "
      f"{sec('pairs_s'):>7} |",
      f"| {'reward model':<13} | "
      f"{'held-out pair accuracy %.3f (labels vs gold: %.3f), gold order %.3f' % (ev['accuracy'], ev.get('label_gold_agreement', float('nan')), ev.get('gold_agreement', float('nan'))):<66} | "
      f"{sec('rm_s'):>7} |",
      f"| {'RLOO':<13} | "
      f"{'final rollout KL %.3f, proxy %+.3f, gold %.3f' % (s['history'][-1]['kl'], s['history'][-1]['proxy_reward'], s['history'][-1]['gold_reward']) if s['history'] else 'no iterations':<66} | "
      f"{sec('rloo_s'):>7} |",
      "",
      f"held-out evaluation, greedy completions on {s['eval_prompts']} prompts (gold reward of the "
      "ideal summary: 1.1 on summarize)",
      "",
      f"| {'metric':<44} | {'SFT':>8} | {'RLOO':>8} |",
      f"|{'-' * 46}|{'-' * 10}|{'-' * 10}|"]
  a, b = s["sft"], s["rloo"]
  for label, key, fmt in (("gold reward (hidden labeller)", "gold_reward", "{:8.3f}"),
                          ("proxy reward (reward model, whitened)", "proxy_reward", "{:+8.3f}"),
                          ("completion length (tokens)", "length", "{:8.2f}"),
                          ("win rate vs SFT (gold judge, ties half)", "win_rate", "{:8.3f}")):
    lines.append(f"| {label:<44} | {fmt.format(a[key])} | {fmt.format(b[key])} |")
  sa, sb = s["sft_sampled"], s["rloo_sampled"]
  lines.append(f"| {'sampled (T=%g): gold reward' % s['sample_temperature']:<44} | "
               f"{sa['gold_reward']:8.3f} | {sb['gold_reward']:8.3f} |")
  lines.append(f"| {'sampled (T=%g): win rate vs SFT sample' % s['sample_temperature']:<44} | "
               f"{0.5:8.3f} | {sb['win_rate']:8.3f} |")
  lines.append(f"\nRLOO vs SFT (greedy): {b['wins']} wins, {b['ties']} ties, {b['losses']} losses; "
               f"this run took {t.get('this_run_s', 0):.0f} s (stage times above are from the run "
               "that computed them)")
  return "\n".join(lines)

"""The full RLHF pipeline: SFT -> SFT samples -> preference pairs -> reward model -> RLOO -> report.

The RLOO paper's setting (TL;DR / HH): a policy is fine-tuned on demonstrations, a reward model is
trained on human preferences between policy samples, RLOO optimises the learned reward with a KL
penalty to the SFT policy, and the result is judged by win rate against the SFT policy. Here the
"human" is a hidden gold reward (`config.rlhf.gold_reward`), so the pipeline can also measure what
a real one cannot: how the proxy (learned) reward and the gold reward diverge as RL pushes on the
proxy (over-optimisation).

Stages and their cache in the workdir (a rerun reuses every finished stage whose settings match):

    data/                     the task's prepared dataset (tasks.make)
    sft/                      the SFT policy (rloo_jax.sft, via policy_init.initial_params)
    pairs/pairs.json          SFT samples, the pairs drawn from them, and their settings
    reward_model/             the Bradley-Terry reward model + whitening stats (RewardModelScorer)
    rloo/                     the RL stage: the outer loop's workdir (checkpoints, metrics.jsonl,
                              summary.json); it trains on the proxy and logs gold beside it
    rlhf_summary.json, rlhf_table.md, gold_vs_proxy.png, reward_vs_kl.png, timings.json
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp

from rloo_jax import algorithms, experiment, loop, policy_init
from rloo_jax import workdir as workdir_lib
from rloo_jax.algorithms.rloo import RLOO
from rloo_jax.config_utils import sequence_length
from rloo_jax.metrics import read_jsonl
from rloo_jax.rewards import RewardSet, registry, reward_model
from rloo_jax.rlhf import report
from rloo_jax.preference_pairs import build_pairs, json_dump, json_load, pairs_settings


def validate(config) -> None:
  """Everything that can fail on the config fails here, before data, SFT or any compile."""
  if "rlhf" not in config:
    raise ValueError("config has no `rlhf` section (pair, reward-model and evaluation settings); "
                     "start from configs/summarize.py")
  r = config.rlhf
  if jax.process_count() > 1:
    raise ValueError("the RLHF pipeline runs in one process (its stages pass host data between "
                     "them); run it without jax.distributed, on one or more local devices")
  # The run's own checks (the pipeline brings its own reward sets, so config.rewards is not
  # resolved); every build below trusts them.
  algorithms.validate(config, with_rewards=False)
  registry.resolve(r.gold_reward)  # names the module / attribute if the gold reward is wrong
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
  need = sequence_length(config, with_eos=True)
  if need > config.model.max_seq_len:
    raise ValueError(f"the reward model scores [prompt | completion | eos]: "
                     f"config.data.max_prompt_len ({config.data.max_prompt_len}) + "
                     f"config.rloo.max_new_tokens ({config.rloo.max_new_tokens}) + 1 = {need} "
                     f"exceeds config.model.max_seq_len = {config.model.max_seq_len}; raise it")


def _rm_settings(config) -> dict:
  r = config.rlhf
  return dict(pairs=pairs_settings(config), steps=r.rm_steps, batch_size=r.rm_batch_size,
              learning_rate=r.rm_learning_rate, warmup_steps=r.rm_warmup_steps,
              weight_decay=r.rm_weight_decay, whiten=r.whiten, clip=r.clip,
              seq_len=sequence_length(config, with_eos=True))


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
      exp.model_config, sft_params, exp.tokenizer, pairs["train"],
      seq_len=sequence_length(config, with_eos=True), options=options, eval_pairs=pairs["eval"],
      score_batch_size=r.score_batch_size, log=log, layout=exp.layout)
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


def _policy_eval(ev: dict, prefix: str = "greedy") -> dict:
  """The pipeline's view of one `evaluation.Evaluator` result: judged by gold."""
  win = "" if prefix == "greedy" else "sampled_"
  return dict(gold_reward=ev[f"{prefix}_reward/gold"], proxy_reward=ev[f"{prefix}_reward/proxy"],
              length=ev[f"{prefix}_length"], win_rate=ev[f"{win}win_rate_vs_ref"],
              wins=ev[f"{win}wins_vs_ref"], ties=ev[f"{win}ties_vs_ref"],
              losses=ev[f"{win}losses_vs_ref"], n=ev[f"{win}n_vs_ref"])


def _curves(rl_dir: str) -> tuple[list[dict], list[dict]]:
  """Per-iteration rollout rows and held-out evaluations from the RL stage's metrics.jsonl
  (the last row of a step wins, so a resumed run's repeated steps count once)."""
  train, evals = {}, {}
  for row in read_jsonl(os.path.join(rl_dir, "metrics.jsonl")):
    if "train/reward/gold" in row:
      train[row["step"]] = dict(
          step=row["step"], proxy_reward=row["train/reward_mean"],
          gold_reward=row["train/reward/gold"], kl=row["train/kl"],
          penalised_reward=row["train/penalised_reward"],
          completion_length=row["train/completion_length"],
          iteration_s=row["train/iteration_s"])
    if "eval/greedy_reward/gold" in row:
      evals[row["step"]] = dict(step=row["step"], gold_reward=row["eval/greedy_reward/gold"],
                                proxy_reward=row["eval/greedy_reward/proxy"],
                                win_rate=row.get("eval/win_rate_vs_ref"))
  return [train[s] for s in sorted(train)], [evals[s] for s in sorted(evals)]


def run(config, workdir: str, *, log=print) -> dict:
  """Runs (or resumes) every stage and returns the summary (also written to the workdir)."""
  t_start = time.time()
  workdir = os.path.abspath(workdir)
  validate(config)
  os.makedirs(workdir, exist_ok=True)
  r = config.rlhf
  gold_fn = registry.resolve(r.gold_reward)
  timings = json_load(os.path.join(workdir, "timings.json")) or {}

  # 1. SFT. Nothing in this stage computes a reward: the gold reward stands in the reward slot.
  t0 = time.time()
  gold_only = RewardSet([gold_fn], [1.0], ["gold"])
  exp = experiment.build(config, workdir, rewards=gold_only)
  sft_cached = policy_init.is_cached(config, workdir)
  sft_params = policy_init.initial_params(exp, log=log)
  if not sft_cached:
    timings["sft_s"] = time.time() - t0

  # 2. Preference pairs from SFT samples.
  t0 = time.time()
  pairs, cached = build_pairs(config, exp, sft_params, workdir, log=log)
  if not cached:
    timings["pairs_s"] = time.time() - t0

  # 3. Reward model.
  t0 = time.time()
  scorer, rm_info, cached = build_reward_model(config, exp, sft_params, pairs, workdir, log=log)
  if not cached:
    timings["rm_s"] = time.time() - t0
  json_dump(timings, os.path.join(workdir, "timings.json"))

  # 4. RLOO on the learned reward, with the gold reward logged beside it (weight 0: the policy
  # never sees it) and judging every evaluation.
  t0 = time.time()
  rl_config = copy.deepcopy(config)
  rl_config.train.eval_every = r.eval_every
  rl_config.train.eval_prompts = r.eval_prompts
  rl_exp = experiment.build(
      rl_config, workdir, task=exp.task,
      rewards=RewardSet([scorer, gold_fn], [1.0, 0.0], ["proxy", "gold"]),
      eval_rewards=RewardSet([gold_fn, scorer], [1.0, 0.0], ["gold", "proxy"]))
  rl_dir = os.path.join(workdir, "rloo")
  workdir_lib.check_config(rl_dir, rl_config, log=log)
  # config.train.check_memory and microbatch_tokens='auto', before the loop compiles.
  rl_algo = RLOO(rl_exp).preflight(log=log)
  # A copy: the policy's buffers are donated by the train step, the SFT params are reused.
  result = loop.run(rl_algo, rl_dir, log=log, keep_checkpoints=2,
                    initial_params=jax.tree.map(jnp.copy, sft_params))
  timings["rloo_s"] = time.time() - t0
  timings["this_run_s"] = time.time() - t_start
  json_dump(timings, os.path.join(workdir, "timings.json"))

  # 5. Report.
  history, evals = _curves(rl_dir)
  before, after = result["before"], result["after"]
  summary = dict(
      task=config.task, seed=config.seed, eval_prompts=result["eval_prompts"],
      sft_steps=config.sft.steps, rm_steps=r.rm_steps, rloo_iterations=result["iterations"],
      k=config.rloo.k, beta=float(config.kl.beta),
      pairs=dict(train=len(pairs["train"]), eval=len(pairs["eval"]), **pairs["counts"]),
      reward_model=dict(eval=rm_info["eval"], train_eval=rm_info.get("train_eval"),
                        whiten=bool(scorer.whiten), mean=scorer.mean, std=scorer.std,
                        clip=scorer.clip),
      sft=_policy_eval(before), rloo=_policy_eval(after),
      sft_sampled=_policy_eval(before, "sampled"), rloo_sampled=_policy_eval(after, "sampled"),
      sample_temperature=float(config.rloo.temperature), history=history, evals=evals,
      timings=timings)
  json_dump(summary, os.path.join(workdir, "rlhf_summary.json"))
  report.plot_curves(history, evals, workdir)
  table = report.format_table(summary)
  with open(os.path.join(workdir, "rlhf_table.md"), "w") as f:
    f.write(table + "\n")
  log(table)
  return dict(summary, state=result["state"], scorer=scorer)


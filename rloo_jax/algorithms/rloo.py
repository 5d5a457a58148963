"""RLOO (and every estimator of the `advantage` registry: GRPO, RAFT, REINFORCE with a moving
baseline, vanilla PG) as an algorithm of the outer loop (`rloo_jax.loop`).

One iteration: rollout -> rewards -> reference log-probs -> KL -> R = r - beta * KL ->
advantages -> `num_epochs` x `num_minibatches` jitted, donated train steps.
"""

from __future__ import annotations

import functools
import time

import jax
import numpy as np

from rloo_jax import adapters, dynamic_sampling, packing, platform, rollout, update
from rloo_jax import experiment as experiment_lib
from rloo_jax import memory
from rloo_jax.algorithms.base import AlgorithmBase
from rloo_jax.memory import budget


def mean_step_metrics(step_metrics) -> dict:
  """The mean of each step metric over an iteration's update steps; `nonfinite_steps` summed
  and `update_steps` counted, for the loop's non-finite guard."""
  out = {name: float(np.mean([float(m[name]) for m in step_metrics])) for name in step_metrics[0]}
  if "nonfinite_steps" in out:
    out["nonfinite_steps"] = float(sum(float(m["nonfinite_steps"]) for m in step_metrics))
  out["update_steps"] = float(len(step_metrics))
  return out


def nanmean_or_nan(x) -> float:
  x = np.asarray(x, np.float64)
  return float(np.nanmean(x)) if np.isfinite(x).any() else float("nan")


def timed_updates(algo, state, rows, rng, timings: dict):
  """The epochs x minibatches of an on-policy algorithm's update, timed into
  timings['update_s']; the state's iteration counter advanced. Returns (state, step metrics)."""
  c = algo.exp.config.train
  t0 = time.perf_counter()
  state, step_metrics = update.minibatch_updates(
      algo.step_fn, algo.take_fn, state, rows, rng, num_epochs=c.num_epochs,
      num_minibatches=c.num_minibatches)
  jax.block_until_ready(state.params)
  timings["update_s"] = time.perf_counter() - t0
  return state.replace(step=state.step + 1), mean_step_metrics(step_metrics)


def rollout_rows(algo, batch, out):
  """The rollout's rows (`algo.rows_fn`, i.e. `sample_rows`) from this process's data batch and
  the global sample output, every array split over the batch axes."""
  layout = algo.exp.layout
  return algo.rows_fn(layout.shard_batch(batch["prompt_tokens"]),
                      layout.shard_batch(batch["prompt_lengths"]),
                      *(layout.reshard_batch(x) for x in (out.tokens_bkt, out.mask_bkt,
                                                           out.policy_logprobs_bkt)))


def sample_rows(prompt_tokens_bp, prompt_lengths_b, tokens_bkt, mask_bkt, logp_bkt, *, k: int,
                shared_prefix: bool):
  """`rollout.make_rows` of a sample output's [B, k, T] arrays, flattened to [B * k, T] inside
  the program: reshaped eagerly, each global array was a program of its own every rollout."""
  flat = lambda x: x.reshape(x.shape[0] * x.shape[1], -1)  # noqa: E731
  return rollout.make_rows(prompt_tokens_bp, prompt_lengths_b, flat(tokens_bkt), flat(mask_bkt),
                           flat(logp_bkt), k=k, shared_prefix=shared_prefix)


def trim_rollout(exp, out, aggregation: str, max_len=None):
  """The sample output cut past its longest completion (`rollout.trim_to_bucket` with
  config.rloo.trim_bucket), so the scoring pass and the update compute only the columns some
  sample reached. Not with the 'fixed_length' aggregation unless its normaliser `max_len` is
  fixed: by default it is the column count, which trimming would change (rescaling the loss)."""
  bucket = int(exp.config.rloo.get("trim_bucket", 0) or 0)
  if aggregation == "fixed_length" and max_len is None:
    bucket = 0
  return rollout.trim_to_bucket(exp.layout, out, bucket)


def rollout_metrics(exp, out, rewards_bk, usable_bk, num_nonfinite: int, parts: dict,
                    timings: dict) -> dict:
  """What every on-policy algorithm reports of its rollout: rewards (each function's own mean,
  before weighting, over the samples it could score), lengths, unscorable counts, speed."""
  r = rewards_bk[usable_bk]
  lengths = exp.layout.gather(out.lengths_bk)
  m = {f"reward/{name}": nanmean_or_nan(v) for name, v in parts.items()}
  m.update(reward_mean=float(r.mean()) if r.size else float("nan"),
           reward_std=float(r.std()) if r.size else float("nan"),
           completion_length=float(lengths.mean()),
           num_unscorable=float((~usable_bk).sum()), num_nonfinite=float(num_nonfinite),
           rollout_tokens_per_s=int(lengths.sum()) / max(timings["rollout_s"], 1e-9),
           **timings)
  return m


def packer_of(exp, *, per: str):
  """config.train.microbatch_tokens' `packing.Packer` (None: off) for a minibatch (the update) or
  the whole rollout (the reference pass): one packed row per batch shard a microbatch. First
  fit leaves at most one row less than half full, so a minibatch of N
  completions of up to P - 1 + T tokens each (prompt included) takes at most
  2 N (P - 1 + T) / budget + 1 rows (and never more than N)."""
  c = exp.config
  budget = c.train.get("microbatch_tokens", 0) or 0
  if budget == "auto":  # until `memory.budget.resolve` replaces it
    budget = packing.min_tokens(c.data.max_prompt_len, c.rloo.max_new_tokens)
  if not budget:
    return None
  budget = int(budget)
  shards = exp.layout.batch_parallelism
  n = c.rloo.num_prompts * c.rloo.k // (c.train.num_minibatches if per == "minibatch" else 1)
  most = min(n, 2 * n * packing.min_tokens(c.data.max_prompt_len, c.rloo.max_new_tokens)
             // budget + 1)
  return packing.Packer(k=int(c.rloo.k), budget=budget, rows_per_microbatch=shards,
                        max_microbatches=-(-most // shards),
                        rows_sharding=exp.layout.batch_sharding)


class RLOO(AlgorithmBase):
  """The algorithm object the loop drives: state, jitted programs and one iteration."""

  name = "rloo"
  label = "RLOO"

  def __init__(self, exp: experiment_lib.Experiment):
    super().__init__(exp)
    c = exp.config
    layout, state_sh = exp.layout, exp.state_shardings
    rows_sh, rep = layout.batch_sharding, layout.replicated
    self.k = int(c.rloo.k)
    chunk = int(c.train.logprob_chunk_size)
    self.step_fn = update.TrainStep(
        fns=exp.fns, tx=exp.tx, spec=exp.loss_spec, k=self.k, chunk_size=chunk,
        microbatches=update.microbatches(c, per="minibatch"), state_shardings=state_sh,
        rows_sharding=rows_sh, replicated=rep,
        fused_head=bool(c.train.get("fused_head_grad", True)),
        packer=packer_of(exp, per="minibatch"))
    # The scoring pass as two programs: the reference's log-probs (the heavy one, dispatched as
    # soon as the completions exist, so it runs while the host scores the rewards) and the KL,
    # penalised rewards and advantages (a few [B, k] operations once the rewards are in).
    self.reference_fn = update.ReferencePass(
        fns=exp.base_fns or exp.fns, k=self.k, chunk_size=chunk,
        microbatches=update.microbatches(c, per="rollout"), ref_sharding=state_sh.ref_params,
        rows_sharding=rows_sh, packer=packer_of(exp, per="rollout"))
    # config.loss.old_logprobs='recompute': the policy's own log-probs before the update, the
    # ratio's old policy (the sampler's stay the correction's behaviour policy).
    lora_base = getattr(state_sh, "lora", False)
    self.old_fn = update.ReferencePass(
        fns=exp.fns, k=self.k, chunk_size=chunk,
        microbatches=update.microbatches(c, per="rollout"), ref_sharding=state_sh.params,
        rows_sharding=rows_sh, packer=packer_of(exp, per="rollout"),
        frozen_sharding=state_sh.ref_params if lora_base else None,
    ) if c.loss.get("old_logprobs", "sampler") == "recompute" else None
    self.advantage_fn = platform.jit(functools.partial(
        update.advantages_of, beta=float(c.kl.beta), kl_estimator=c.kl.estimator,
        kl_reduction=c.kl.reduction, estimator=c.advantage.estimator,
        options=tuple(sorted(dict(c.advantage.options).items()))),
        in_shardings=(rows_sh, state_sh.adv_state, rows_sh, rows_sh, rows_sh),
        out_shardings=(rows_sh, state_sh.adv_state))
    self.rows_fn = platform.jit(functools.partial(sample_rows, k=self.k,
                                                  shared_prefix=bool(c.train.shared_prefix)),
                                in_shardings=(rows_sh,) * 5, out_shardings=rows_sh)
    self.take_fn = platform.jit(functools.partial(update.take_units, k=self.k),
                                out_shardings=rows_sh)
    self.dynamic = (dynamic_sampling.DynamicSampler(
        exp, k=self.k, max_rounds=int(c.rloo.dynamic_sampling_max_rounds))
        if c.rloo.get("dynamic_sampling", False) else None)
    self._batches = None  # the prompt stream, which dynamic sampling draws further batches from

  def batches(self):
    self._batches = super().batches()
    return self._batches

  def score_fn(self, ref_params, adv_state, rows, rewards_bk, usable_bk):
    """`update.score_rollout` as the iteration runs it: ({kl_bk, penalised_bk, advantages_bk,
    ref_logp_nt}, new estimator state)."""
    return self.advantage_fn(self.reference_fn(ref_params, rows), adv_state, rows, rewards_bk,
                             usable_bk)

  def abstract_state(self):
    """The restore target: a checkpoint's form of the state (`checkpoint_state`)."""
    return adapters.abstract_checkpoint(self.exp, experiment_lib.abstract_state(self.exp))

  def checkpoint_state(self, state):
    return adapters.checkpoint_state(state)

  def resume_state(self, state, base_params):
    """A restored state made whole: with LoRA, the base put back from `base_params()`."""
    if not state.lora:
      return state
    return adapters.resume_state(self.exp, state, base_params())

  def init_state(self, params):
    return experiment_lib.init_state(self.exp, params)

  def preflight(self, log=print):
    """config.train.microbatch_tokens='auto' resolved on the mesh (`memory.budget.resolve`),
    then, on an accelerator, the job planned against its devices' memory (`memory.check`, which
    raises DoesNotFit naming the settings to turn). Returns the algorithm to run."""
    algo, report = budget.resolve(self, log=log)
    memory.check(algo, log=log, report=report)
    return algo

  def eval_params(self, state):
    """With LoRA the policy is base + adapters, and the reference the base as the policy's
    model functions run it."""
    if state.lora:
      return state.policy_params, adapters.reference_as_policy(state)
    return state.params, state.ref_params

  def iteration(self, state, batch: dict):
    """rollout -> rewards -> reference -> advantages -> epochs x minibatches: (state, metrics)."""
    exp, c, k = self.exp, self.exp.config, self.k
    layout = exp.layout
    rng = jax.random.fold_in(state.rng, int(state.step))

    def reference(out, data):
      # Lengths (and so the rollout metrics) are unchanged by the trim; only columns go. The
      # reference pass is dispatched here, before the rewards, and runs while they are scored.
      out = trim_rollout(exp, out, exp.loss_spec.aggregation, exp.loss_spec.max_len)
      rows = rollout_rows(self, data, out)
      inputs = self.reference_fn.pack(rows)  # packed once for both passes (the same packer)
      ref_logp = self.reference_fn(state.ref_params, inputs)
      if self.old_fn is not None:
        old = self.old_fn(state.params, inputs, *((state.ref_params,) if state.lora else ()))
        rows = rows.replace(old_logp_nt=old, sampler_logp_nt=rows.old_logp_nt)
      return out, rows, ref_logp

    dynamic = {}
    if self.dynamic is None:
      _, rewards_bk, usable_bk, num_nonfinite, parts, timings, (out, rows, ref_logp) = (
          rollout.timed_rollout(exp, state.policy_params, batch, rng, k=k,
                                on_sampled=lambda out: reference(out, batch)))
    else:  # the groups to train on are known only once their rewards are
      if self._batches is None:
        self.batches()
      batch, out, rewards_bk, usable_bk, num_nonfinite, parts, timings, dynamic = self.dynamic(
          state.policy_params, batch, self._batches, rng)
      out, rows, ref_logp = reference(out, batch)
    t0 = time.perf_counter()
    b = rewards_bk.shape[0]  # the global batch
    n = b * k
    t = out.tokens_bkt.shape[2]
    scored, adv_state = self.advantage_fn(ref_logp, state.adv_state, rows,
                                          layout.put_global_batch(rewards_bk.astype(np.float32)),
                                          layout.put_global_batch(usable_bk))
    jax.block_until_ready(scored["advantages_bk"])
    # What of the reference pass the reward scoring did not hide, and the advantages.
    timings["reference_s"] = time.perf_counter() - t0
    state = state.replace(adv_state=adv_state)

    rows = rows.replace(advantages_n=scored["advantages_bk"].reshape(-1))
    state, m = timed_updates(self, state, rows, rng, timings)

    all_equal = np.array([np.ptp(row[u]) == 0 if u.sum() >= 2 else True
                          for row, u in zip(rewards_bk, usable_bk)])
    adv = layout.gather(scored["advantages_bk"])
    m.update(rollout_metrics(exp, out, rewards_bk, usable_bk, num_nonfinite, parts, timings))
    m.update(dynamic)
    m.update(
        kl=float(layout.gather(scored["kl_bk"]).mean()),
        penalised_reward=float(layout.gather(scored["penalised_bk"])[usable_bk].mean())
        if usable_bk.any() else 0.0,
        advantage_mean=float(adv.mean()), advantage_std=float(adv.std()),
        advantage_abs_max=float(np.abs(adv).max()),
        frac_groups_all_equal=float(all_equal.mean()),
        update_columns=float(t),
        # Tokens of the n [prompt | completion] rows trained on, however the prompt is shared:
        # the (trimmed) completion columns actually computed, not max_new_tokens.
        update_tokens_per_s=(c.train.num_epochs * n * (batch["prompt_tokens"].shape[1] + t))
        / max(timings["update_s"], 1e-9))
    m["iteration_s"] = sum(timings.values())
    return state, m

  def log_line(self, step: int, m: dict) -> str:
    return (f"[{self.name}] iteration {step}: reward {m['reward_mean']:.3f} kl {m['kl']:.3f} "
            f"({m['iteration_s']:.2f}s)")

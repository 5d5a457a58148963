"""The one outer loop every algorithm runs (RLOO and its estimators, PPO, DPO, the RLHF
pipeline's RL stage): the training prompts, the starting policy, resume, iterations, metrics,
the evaluation cadence, checkpoints, the progress bar, the summary, and every guard that keeps
work from being lost (docs/RELIABILITY.md). Side effects live here and only here; an
algorithm brings its state, its batches and one iteration through the protocol
`rloo_jax.algorithms.base.Algorithm`, every member of which the loop calls (exp, name, label,
num_iterations, eval_every, abstract_state, init_state, resume_state, checkpoint_state, prepare,
batches, iteration, eval_params, log_line, summary_extra) but `preflight`, the step before it.

The config reaching the loop was validated once, before anything was built
(`rloo_jax.algorithms.validate`), and an accelerator job's memory was planned before the loop
starts (`algo.preflight`, the step before `loop.run` in `algorithms.run`).
"""

from __future__ import annotations

import functools
import json
import os
import signal
import threading
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from rloo_jax import evaluation, policy_init, workdir as workdir_lib
from rloo_jax.checkpoint import Checkpointer
from rloo_jax.data import pipeline
from rloo_jax.metrics import MetricWriter
from rloo_jax.optim import NonFiniteError


class UnscorableError(RuntimeError):
  """The reward functions could score no sample, iteration after iteration."""


def prompt_batches(exp, *, seed: Optional[int] = None):
  """The training prompts, `config.rloo.num_prompts` a batch, this process's rows of each: the
  batches of an algorithm that brings none of its own (`AlgorithmBase.batches`)."""
  c = exp.config
  return pipeline.prompt_batches(exp.task.train, exp.tokenizer,
                                 global_batch_size=c.rloo.num_prompts,
                                 max_prompt_len=c.data.max_prompt_len,
                                 seed=c.seed if seed is None else seed, overlong=c.data.overlong,
                                 process_index=jax.process_index(),
                                 process_count=jax.process_count())


def _progress(total: int, initial: int, enabled: bool, desc: str):
  if not enabled:
    return None
  from tqdm import tqdm  # a display nicety, imported only when shown
  return tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True)


@jax.jit
def _all_finite(tree) -> jax.Array:
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
                            if jnp.issubdtype(x.dtype, jnp.inexact)] or [jnp.array(True)]))


class _Preemption:
  """SIGTERM / SIGINT set a flag that the loop reads between iterations (a second SIGINT
  interrupts at once). Multi-process: any process's signal stops every process at the same
  iteration (one tiny all-gather per iteration)."""

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self):
    self.signum = None
    self._previous = {}

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      for s in self.SIGNALS:
        self._previous[s] = signal.signal(s, self._handle)
    return self

  def _handle(self, signum, frame):
    del frame
    if self.signum == signal.SIGINT and signum == signal.SIGINT:
      raise KeyboardInterrupt
    self.signum = signum

  def requested(self) -> bool:
    local = self.signum is not None
    if jax.process_count() > 1:
      return bool(np.asarray(multihost_utils.process_allgather(np.int32(local))).any())
    return local

  def __exit__(self, *exc):
    for s, handler in self._previous.items():
      # None: a handler installed outside Python, which cannot be put back; the default is.
      signal.signal(s, signal.SIG_DFL if handler is None else handler)


def run(algo, workdir: str, *, log: Callable[[str], None] = print, initial_params=None,
        evaluator: Optional[evaluation.Evaluator] = None, keep_checkpoints: Optional[int] = None,
        eval_every: Optional[int] = None) -> dict:
  """Trains `algo` in `workdir` (resuming from its newest readable checkpoint) and returns the
  summary, also written to <workdir>/summary.json (by process 0), plus `state`, `last_metrics`
  and `preempted` (True when SIGTERM/SIGINT stopped the run after a synchronous save).

  The caller compared the config with the one the workdir was started with
  (`workdir.check_config`, before building anything: `algorithms.run`, the RLHF pipeline); the
  loop holds the workdir's lock while it runs. initial_params: the starting policy (default:
  `policy_init.initial_params`, i.e. config.model.init_from or the cached SFT stage).
  evaluator: the held-out evaluation (default: the task's test split,
  `Evaluator.from_config`)."""
  workdir = os.path.abspath(workdir)
  os.makedirs(workdir, exist_ok=True)
  with workdir_lib.Lock(workdir, log=log):
    try:
      return _run(algo, workdir, log=log, initial_params=initial_params, evaluator=evaluator,
                  keep_checkpoints=keep_checkpoints, eval_every=eval_every)
    except (NonFiniteError, UnscorableError):
      raise  # they name the checkpoint to go back to; resuming would meet the same state
    except Exception as e:
      # The CLI's one line says where a rerun of the same command picks up (`cli.error_line`).
      try:
        e.resume_from = resume_point(os.path.join(workdir, "checkpoints"))
      except AttributeError:  # an exception type without a __dict__: the line goes without it
        pass
      raise


def resume_point(directory: str) -> str:
  """Where a rerun resumes: the newest checkpoint step in `directory`, or the start."""
  steps = [int(d) for d in (os.listdir(directory) if os.path.isdir(directory) else ())
           if d.isdigit()]
  return (f"checkpoint {max(steps)} in {directory}" if steps
          else "the start (no checkpoint was saved)")


def _run(algo, workdir, *, log, initial_params, evaluator, keep_checkpoints, eval_every):
  exp = algo.exp
  c = exp.config
  t = c.train
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"),
                      keep=t.keep_checkpoints if keep_checkpoints is None else keep_checkpoints)
  writer = None
  try:
    evaluator = evaluator or evaluation.Evaluator.from_config(exp)
    if eval_every is None:
      eval_every = algo.eval_every
    total = algo.num_iterations
    def starting_policy():
      if initial_params is not None:
        return initial_params
      return policy_init.initial_params(exp, log=log)

    restored = ckpt.restore(algo.abstract_state()) if ckpt.latest_step() is not None else None
    if restored is not None:
      step, state, meta = restored
      before = meta.get("before")
      # LoRA: the base the checkpoints leave out is the starting policy, loaded only if asked.
      state = algo.resume_state(state, starting_policy)
      log(f"[{algo.name}] resumed from iteration {step} in {ckpt.directory}")
    else:
      state, meta, before = algo.init_state(starting_policy()), None, None
    algo.prepare(state)
    data = algo.batches()
    for what, n, of in (("training", data.num_dropped, data.num_records),
                        ("held-out", *evaluator.num_dropped())):
      if n:
        log(f"[data] {n} of {of} {what} prompts are longer than config.data.max_prompt_len="
            f"{c.data.max_prompt_len} tokens and are left out (config.data.overlong='error' "
            "refuses them instead)")
    if meta is not None:
      data.set_state(meta["data"])
    start = int(state.step)
    # Rows of iterations after the checkpoint are dropped: the resumed run writes them again.
    wandb_project = t.get("wandb_project", "")
    writer = MetricWriter(workdir, resume_step=start if restored is not None else None,
                          final_step=total, wandb_project=wandb_project,
                          wandb_config=workdir_lib.flat_config(c) if wandb_project else None)
    evaluate = functools.partial(_evaluate, evaluator, algo, writer)
    if before is None:
      before = evaluate(state)
      log(f"[eval] initial policy: {json.dumps(before)}")

    bar = _progress(total, start, t.progress_bar, algo.name)
    metrics: dict[str, Any] = {}
    nonfinite_run = unscorable_run = 0
    last_saved = start if restored is not None else None
    preempted = False
    with _Preemption() as preemption:
      for it in range(start, total):
        state, metrics = algo.iteration(state, next(data))
        step = it + 1
        nonfinite_run, unscorable_run = _guard(metrics, nonfinite_run, unscorable_run, step, c,
                                               exp, ckpt)
        if step % t.log_every == 0 or step == total:
          writer.write(step, metrics, prefix="train/")
        if bar is not None:
          bar.update(1)
          bar.set_postfix(**{key: f"{metrics[key]:.3f}" for key in ("reward_mean", "kl", "loss")
                             if key in metrics})
        elif step % t.log_every == 0:
          log(algo.log_line(step, metrics))
        if eval_every and step % eval_every == 0 and step != total:
          evaluate(state)
        stop = preemption.requested()
        if step % t.checkpoint_every == 0 or step == total or stop:
          _save(ckpt, step, algo, state, {"data": data.get_state(), "before": before},
                ckpt_wait=stop)
          last_saved = step
        if stop:
          preempted = True
          name = "SIGTERM" if preemption.signum == signal.SIGTERM else "SIGINT"
          log(f"[{algo.name}] {name}: stopped after iteration {step}; saved checkpoint "
              f"{last_saved} in {ckpt.directory}. Rerun the same command to resume.")
          break
    if bar is not None:
      bar.close()
    ckpt.wait()
    if preempted:
      return dict(preempted=True, iterations=int(state.step), state=state,
                  last_metrics=metrics)
    after = evaluate(state)
  finally:
    # An exception inside the loop still waits for the save in flight (no temp directory is
    # left behind) and flushes the metrics written so far.
    ckpt.close()
    if writer is not None:
      writer.close()
  summary = {"algorithm": algo.name, "before": before, "after": after,
             "iterations": int(state.step), "seed": c.seed,
             "eval_prompts": evaluator.num_prompts, "reward": evaluator.rewards.first,
             "initial_policy": "initial policy" if c.model.init_from else "SFT"}
  summary.update(algo.summary_extra())
  if jax.process_index() == 0:
    with open(os.path.join(workdir, "summary.json"), "w") as f:
      json.dump(summary, f, indent=2)
  log(evaluation.format_summary(summary, label=algo.label))
  log(f"\n[{algo.name}] wrote {workdir}: summary.json, metrics.jsonl (train/ and eval/ rows), "
      f"tensorboard/, checkpoints/ (newest: {int(state.step)}), {workdir_lib.CONFIG_FILE}")
  return dict(summary, state=state, last_metrics=metrics, preempted=False)


def _evaluate(evaluator, algo, writer: MetricWriter, state) -> dict:
  """The held-out evaluation of `state`'s policy, written as eval/ rows at its step."""
  result = evaluator(*algo.eval_params(state))
  writer.write(int(state.step), result, prefix="eval/")
  return result


def _save(ckpt: Checkpointer, step: int, algo, state, meta: dict, *, ckpt_wait: bool) -> None:
  """Saves only a finite state: a checkpoint rotation must never replace the last good one."""
  if not bool(_all_finite(state)):
    raise NonFiniteError(
        f"the train state at iteration {step} holds non-finite values, so it was not saved; "
        f"the newest finite checkpoint is {ckpt.latest_step()} in {ckpt.directory}. Lower "
        "config.optim.learning_rate (or config.optim.max_grad_norm) and resume.")
  ckpt.save(step, algo.checkpoint_state(state), meta, force=True, wait=ckpt_wait)


def _guard(m: dict, nonfinite_run: int, unscorable_run: int, step: int, c, exp, ckpt):
  """Counts skipped non-finite steps and all-unscorable batches in a row; raises past the
  configured limits (config.train.max_nonfinite_steps / max_unscorable_iterations)."""
  t = c.train
  skipped = int(round(m.get("nonfinite_steps", 0)))
  steps = int(round(m.get("update_steps", 1)))
  nonfinite_run = nonfinite_run + skipped if skipped == steps else 0
  if nonfinite_run >= t.max_nonfinite_steps:
    raise NonFiniteError(
        f"{nonfinite_run} update steps in a row had a non-finite loss or gradient (skipped, "
        f"the state unchanged) up to iteration {step}; the newest checkpoint is "
        f"{ckpt.latest_step()} in {ckpt.directory}. Check the rewards and lower "
        "config.optim.learning_rate; config.train.max_nonfinite_steps sets this limit.")
  batch = c.rloo.num_prompts * c.rloo.k
  if "num_unscorable" in m and m["num_unscorable"] >= batch:
    unscorable_run += 1
    if unscorable_run >= t.max_unscorable_iterations:
      bad = [name for name in exp.rewards.names
             if not np.isfinite(m.get(f"reward/{name}", np.nan))]
      raise UnscorableError(
          f"every sample of the last {unscorable_run} iterations was unscorable (NaN reward) "
          f"up to iteration {step}; reward functions that scored nothing: "
          f"{bad or exp.rewards.names} (config.rewards.fns). Fix the reward or the prompts' "
          "fields; config.train.max_unscorable_iterations sets this limit.")
  else:
    unscorable_run = 0
  return nonfinite_run, unscorable_run

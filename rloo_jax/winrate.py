r"""Greedy win rate against the dataset's reference completions, at the checkpoint with the best
held-out reward: the RLOO paper's evaluation (Ahmadian et al. 2024, Table 1).

    python -m rloo_jax.winrate --workdir=/tmp/rloo_tldr --judge=reward:reward_model:/tmp/rm
    python -m rloo_jax.winrate --workdir=/tmp/rloo_hh --judge=my_judges.py:gpt4_judge \
        --reference_field=chosen --num_prompts=500
    python -m rloo_jax.winrate --workdir=/tmp/rloo_arith --step=latest \
        --judge=reward:rloo_jax.rewards.verifiers:arithmetic_exact_match

For each held-out prompt (the first config.train.eval_prompts of the test split, or
--num_prompts) the policy's greedy completion is judged (`rloo_jax.judges`) against the record's
`--reference_field` ('answer' for TL;DR, 'chosen' for HH): P > 0.5 is a win, P == 0.5 a tie
(counted half); unjudgeable pairs (NaN, no reference) are counted in `n_unjudged`, prompts over
config.data.max_prompt_len in `n_overlong`.

--step: 'best' (default) is the kept checkpoint with the highest logged `eval/greedy_reward`
(ties: the earliest; step 0 is never checkpointed; if the best step was rotated away, the best
kept one is used and `note` says so), 'latest' the newest, an integer that checkpoint.

Prints a table, then one JSON line (step, its held-out reward, win_rate, wins, ties, losses, n,
n_unjudged, mean_p, ...). From Python: `winrate.evaluate(workdir, judge, ...)` returns the same
record plus the per-prompt texts and P.
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import numpy as np

from rloo_jax import judges, metrics, rollout
from rloo_jax import policy as policy_lib
from rloo_jax.checkpoint import Checkpointer
from rloo_jax.data import pipeline
from rloo_jax.evaluation import Evaluator

EVAL_KEY = "eval/greedy_reward"
Step = Union[str, int]


def logged_rewards(workdir: str, key: str = EVAL_KEY) -> dict[int, float]:
  """{step: the held-out greedy reward the run logged at that step} from metrics.jsonl; steps
  whose value was non-finite (logged as null) are left out. A resumed run rewrites its rows, so
  the last row of a step is the one kept."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{workdir} has no metrics.jsonl, so the best step is unknown; pass "
                            "--step=latest or --step=<int>")
  out: dict[int, float] = {}
  for row in metrics.read_jsonl(path):
    if key in row:
      v = row[key]
      if v is not None and math.isfinite(v):
        out[int(row["step"])] = float(v)
      else:
        out.pop(int(row["step"]), None)
  return out


def kept_steps(workdir: str) -> list[int]:
  ckpt_dir = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(ckpt_dir):
    raise FileNotFoundError(f"{workdir} has no checkpoints/ (the run saved none yet: see "
                            "config.train.checkpoint_every)")
  ckpt = Checkpointer(ckpt_dir)
  try:
    return ckpt.all_steps()
  finally:
    ckpt.close()


def parse_step(step: Step) -> Step:
  """'best', 'latest' or a checkpoint's integer step."""
  if isinstance(step, (int, np.integer)) and not isinstance(step, bool):
    return int(step)
  text = str(step).strip().lower()
  if text in ("best", "latest"):
    return text
  try:
    return int(text)
  except ValueError:
    raise ValueError(f"--step={step!r}: expected 'best', 'latest' or a checkpoint's step "
                     "(an integer)") from None


def choose_step(rewards: Mapping[int, float], kept: Sequence[int], step: Step = "best") -> dict:
  """The checkpoint to evaluate (see the module docstring): {step, rule, greedy_reward (logged
  at that step; None if it was not evaluated there), best_logged_step, best_logged_reward,
  note ('' unless the best logged reward's checkpoints were all rotated away)}."""
  kept = sorted(int(s) for s in kept)
  if not kept:
    raise FileNotFoundError("the workdir holds no checkpoint")
  step = parse_step(step)
  trained = {int(s): float(r) for s, r in rewards.items() if int(s) > 0}

  def rank(pool):
    # Highest reward first, then the earliest step: the least-trained policy reaching it.
    return max(pool, key=lambda s: (pool[s], -s))

  best = rank(trained) if trained else None
  record = dict(rule=str(step), best_logged_step=best,
                best_logged_reward=trained[best] if trained else None, note="")
  if step == "latest":
    chosen = kept[-1]
  elif step != "best":
    if step not in kept:
      raise ValueError(f"--step={step}: no checkpoint of that step; kept checkpoints: {kept}")
    chosen = step
  else:
    if not trained:
      raise ValueError("the run logged no held-out greedy reward for a trained step "
                       f"({EVAL_KEY} in metrics.jsonl), so the best step is unknown; pass "
                       "--step=latest or --step=<int>, or train with config.train.eval_every set")
    candidates = {s: trained[s] for s in kept if s in trained}
    if not candidates:
      raise ValueError(f"none of the kept checkpoints {kept} has a logged held-out reward "
                       f"(logged at steps {sorted(trained)}); pass --step=<int> or "
                       "--step=latest, or train with config.train.eval_every a multiple of "
                       "config.train.checkpoint_every")
    chosen = rank(candidates)
    if trained[chosen] < trained[best]:  # an equal reward is as good: nothing to say
      record["note"] = (
          f"the best held-out greedy reward ({trained[best]:.4f}) was logged at step {best}, "
          f"whose checkpoint was not kept (config.train.keep_checkpoints); using the best of the "
          f"kept checkpoints {kept} with a logged reward: step {chosen} ({trained[chosen]:.4f})")
  return dict(record, step=chosen, greedy_reward=rewards.get(chosen))


def win_rate_vs_references(judge: Callable[..., Any], records: Sequence[Mapping[str, Any]],
                           completions: Sequence[Optional[str]],
                           reference_field: str = "answer") -> dict:
  """Judges each completion against its record's `reference_field` (see the module docstring):
  the `judges.preference_stats` of the prompts that fit, plus n_overlong (completion None: left
  out), n_no_reference (counted as unjudged) and `p`, float64 [len(records)] (NaN where not
  judged)."""
  if len(records) != len(completions):
    raise ValueError(f"{len(records)} records but {len(completions)} completions")
  if records and not any(reference_field in r for r in records):
    fields = sorted({k for r in records for k in r})
    raise ValueError(f"the held-out records have no field {reference_field!r} (their fields: "
                     f"{', '.join(fields)}); pass --reference_field=answer for TL;DR prompts "
                     "(the reference summary), chosen for Anthropic HH")
  fit = [i for i, c in enumerate(completions) if c is not None]
  ref = [r.get(reference_field) for r in records]
  judged = [i for i in fit if isinstance(ref[i], str) and ref[i]]
  p = np.full((len(records),), np.nan)
  if judged:
    fields = rollout.reward_fields(pipeline.record_fields([records[i] for i in judged]), 1)
    p[judged] = judges.judge_pairs(judge, [records[i]["prompt"] for i in judged],
                                   [completions[i] for i in judged], [ref[i] for i in judged],
                                   fields)
  stats = judges.preference_stats(p[fit])
  return dict(stats, n_overlong=len(records) - len(fit), n_no_reference=len(fit) - len(judged),
              p=p)


def evaluate(workdir: str, judge, *, reference_field: str = "answer",
             num_prompts: Optional[int] = None, step: Step = "best",
             log: Callable[..., None] = print) -> dict:
  """The win rate of `workdir`'s policy at `step` against the references (module docstring).

  Returns the JSON record `main` prints plus `per_prompt` (prompt, completion, reference, p).
  The judge is resolved and the step chosen before the (slow) restore, so a bad spec fails fast.
  """
  workdir = os.path.abspath(os.path.expanduser(workdir))
  if not os.path.isfile(os.path.join(workdir, "run_config.json")):
    raise FileNotFoundError(f"--workdir={workdir} has no run_config.json; point it at a training "
                            "run's directory (the --workdir given to rloo_jax.train)")
  if num_prompts is not None and int(num_prompts) < 1:
    raise ValueError(f"--num_prompts={num_prompts}: judge at least one held-out prompt")
  judge_fn = judges.resolve_judge(judge)
  step = parse_step(step)
  rewards = logged_rewards(workdir) if step == "best" or os.path.isfile(
      os.path.join(workdir, "metrics.jsonl")) else {}
  choice = choose_step(rewards, kept_steps(workdir), step)
  if choice["note"]:
    log(f"[winrate] note: {choice['note']}")
  policy = policy_lib.load_policy(workdir, step=choice["step"])
  evaluator = Evaluator.from_config(policy.experiment, num_prompts=num_prompts)
  completions = evaluator.greedy_completions(policy.params)
  stats = win_rate_vs_references(judge_fn, evaluator.records, completions, reference_field)
  p = stats.pop("p")
  result = dict(workdir=workdir, step=choice["step"], step_rule=choice["rule"],
                greedy_reward=choice["greedy_reward"], initial_greedy_reward=rewards.get(0),
                best_logged_step=choice["best_logged_step"],
                best_logged_reward=choice["best_logged_reward"], note=choice["note"],
                judge=judges.judge_name(judge), reference_field=reference_field,
                num_prompts=evaluator.num_prompts, **stats)
  result["per_prompt"] = [dict(prompt=r["prompt"], completion=c, reference=r.get(reference_field),
                               p=None if not np.isfinite(v) else float(v))
                          for r, c, v in zip(evaluator.records, completions, p)]
  return result


def _json_safe(v):
  # json.dumps would write NaN, which is not JSON: a missing number is null.
  if isinstance(v, float) and not math.isfinite(v):
    return None
  return v


def json_line(result: Mapping[str, Any]) -> str:
  return json.dumps({k: _json_safe(v) for k, v in result.items() if k != "per_prompt"})


def format_table(result: Mapping[str, Any]) -> str:
  def num(v, fmt=".3f"):
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, fmt)

  how = {"best": "best held-out greedy reward", "latest": "newest checkpoint"}.get(
      result["step_rule"], "the requested checkpoint")
  rows = [("checkpoint step", f"{result['step']} ({how})"),
          ("held-out greedy reward at that step (logged)", num(result["greedy_reward"])),
          ("held-out greedy reward of the initial policy", num(result["initial_greedy_reward"])),
          (f"greedy win rate vs '{result['reference_field']}' (ties half)",
           num(result["win_rate"])),
          ("wins / ties / losses", f"{result['wins']} / {result['ties']} / {result['losses']}"),
          ("mean P(policy better)", num(result["mean_p"])),
          ("judged / unjudged / over max_prompt_len",
           f"{result['n']} / {result['n_unjudged']} / {result['n_overlong']}")]
  width = max(len(r[0]) for r in rows)
  vwidth = max(len(r[1]) for r in rows)
  lines = [f"\nwin rate against the references on {result['num_prompts']} held-out prompts of "
           f"{result['workdir']}, judge {result['judge']}",
           f"| {'metric':<{width}} | {'value':<{vwidth}} |",
           f"|{'-' * (width + 2)}|{'-' * (vwidth + 2)}|"]
  lines += [f"| {name:<{width}} | {value:<{vwidth}} |" for name, value in rows]
  if result.get("note"):
    lines.append(f"note: {result['note']}")
  return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
  """The command: parses argv (program name first), prints the table and the JSON line.
  Flags live in a private FlagValues, so importing this module (a notebook next to
  rloo_jax.train or rloo_jax.export, which define --workdir and --step too) registers none."""
  from absl import flags, logging

  fv = flags.FlagValues()
  flags.DEFINE_string("workdir", None, "a training run's directory (run_config.json)",
                      flag_values=fv)
  flags.DEFINE_string("judge", None, judges.SYNTAX, flag_values=fv)
  flags.DEFINE_string("reference_field", "answer", "the records' reference completion: answer "
                      "(TL;DR prompts), chosen (Anthropic HH)", flag_values=fv)
  flags.DEFINE_integer("num_prompts", None, "held-out prompts to judge (default: "
                       "config.train.eval_prompts, those of the logged held-out reward)",
                       flag_values=fv)
  flags.DEFINE_string("step", "best", "best | latest | <int>", flag_values=fv)
  if any(a in ("-h", "--help", "-help") for a in argv[1:]):
    print(f"{__doc__}\nflags:\n{fv.get_help()}")
    return 0
  try:
    rest = fv(list(argv))
  except flags.Error as e:
    print(f"rloo_jax.winrate: error: {e} (--help lists the flags)", file=sys.stderr)
    return 2
  missing = [name for name in ("workdir", "judge") if fv[name].value is None]
  if len(rest) > 1 or missing:
    what = f"unexpected arguments {rest[1:]}" if len(rest) > 1 else \
        f"--{' and --'.join(missing)} required"
    print(f"rloo_jax.winrate: error: {what}", file=sys.stderr)
    return 2
  # Orbax logs every file it reads at INFO, which would bury the table.
  logging.set_verbosity(logging.WARNING)
  try:
    result = evaluate(fv.workdir, fv.judge, reference_field=fv.reference_field,
                      num_prompts=fv.num_prompts, step=fv.step,
                      log=lambda *a: print(*a, file=sys.stderr))
  except (FileNotFoundError, ValueError) as e:
    # The messages carry the fix; a traceback would bury it.
    print(f"rloo_jax.winrate: error: {e}", file=sys.stderr)
    return 1
  print(format_table(result))
  print(json_line(result))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))

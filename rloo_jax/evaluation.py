"""Held-out evaluation, one for every algorithm (RLOO, PPO, DPO, the RLHF pipeline).

For each held-out prompt the policy writes one greedy and one sampled completion, scored by the
experiment's evaluation reward set (`Experiment.eval_rewards`, by default the training one):
`greedy_reward` / `sampled_reward` (the weighted sum; exact-match accuracy for a verifier),
each function on its own (`greedy_reward/<name>`), and mean completion lengths. Against a
reference policy (the SFT start) it also reports win rates, as the paper's Table 1 does: prompt
by prompt, the policy's completion is judged against the reference's by the FIRST evaluation
reward function on its own, ties counted half, prompts either cannot score left out
(`win_rate_vs_ref`, `wins_vs_ref`, `ties_vs_ref`, `losses_vs_ref`, `n_vs_ref`, and the same with
a `sampled_` prefix for sampled completions drawn with common random numbers). The reference's
scores are computed once per reference (keyed on its content), so the reference evaluated
against itself scores exactly 0.5.

With config.train.eval_samples = n > 1 it also draws n samples a prompt and reports pass@k and
maj@n with bootstrap intervals (`rloo_jax.passk`): a sample is correct when the first evaluation
reward scores it at least config.train.eval_correct_at; the vote is that reward's
`answer_ids(texts, k)` when it has one (math_answer's: its answers grouped by math-verify's
equality), else `answer_ids` below (the last \\boxed{}, else the last number, else the text).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rloo_jax import passk, rollout, sampler_args, sampling
from rloo_jax.data import gsm8k_answer, pipeline
from rloo_jax.rewards.answers import boxed_answer
from rloo_jax.rewards.preferences import win_rate_stats


def nanmean(x) -> float:
  x = np.asarray(x, np.float64)
  return float(np.nanmean(x)) if np.isfinite(x).any() else float("nan")


@jax.jit
def _fingerprint(params):
  """Per-leaf sum and sum of squares: a content key for the reference-score cache."""
  return jnp.stack([jnp.stack([jnp.sum(x.astype(jnp.float32)),
                               jnp.sum(jnp.square(x.astype(jnp.float32)))])
                    for x in jax.tree.leaves(params)])


class Evaluator:
  """Evaluates policies of one experiment on a fixed held-out set with fixed random numbers."""

  def __init__(self, exp, records: Sequence[Any], *, batch_size: int, rng, rewards=None):
    self.exp = exp
    self.records = list(records)
    self.batch_size = int(batch_size)
    self.rng = rng
    self.rewards = rewards or exp.eval_rewards
    self._reference: dict = {}

  @classmethod
  def from_config(cls, exp, source=None, rewards=None,
                  num_prompts: Optional[int] = None) -> "Evaluator":
    """config.train.eval_prompts prompts (or `num_prompts`) of the task's test split,
    eval_batch_size a batch."""
    c = exp.config
    source = exp.task.test if source is None else source
    n = min(c.train.eval_prompts if num_prompts is None else int(num_prompts), len(source))
    return cls(exp, [source[i] for i in range(n)], batch_size=c.train.eval_batch_size,
               rng=jax.random.PRNGKey(c.seed + 1), rewards=rewards)

  @property
  def num_prompts(self) -> int:
    return len(self.records)

  def num_dropped(self) -> tuple[int, int]:
    """(held-out prompts longer than config.data.max_prompt_len, all of them): the overlong
    ones are left out of every evaluation (or refused, with config.data.overlong='error')."""
    c = self.exp.config
    batches = pipeline.prompt_batches(self.records, self.exp.tokenizer,
                                      global_batch_size=self.batch_size,
                                      max_prompt_len=c.data.max_prompt_len, shuffle=False,
                                      num_epochs=1, drop_remainder=False,
                                      overlong=c.data.overlong)
    return batches.num_dropped, len(self.records)

  def completions(self, params, method, k: int = 1, answers: bool = False):
    """k completions per record (texts, in record order), the weighted reward [N*k], lengths
    [N*k] and each function's scores {name: [N*k]}, for this process's rows of every batch
    (the texts) or of all processes (the rest). answers=True adds [N*k] answer ids for maj@k:
    each sample's, the index in its group of the first sample giving the same final answer.
    More records than a batch stream through the rollout engine's batch * k slots in one call
    (`sampler_args.stream_slots`): greedy text as batch by batch, samples from fold_in(rng, 0)."""
    exp, c = self.exp, self.exp.config
    batches = list(pipeline.prompt_batches(self.records, exp.tokenizer,
                                           global_batch_size=self.batch_size,
                                           max_prompt_len=c.data.max_prompt_len, shuffle=False,
                                           num_epochs=1, drop_remainder=False,
                                           overlong=c.data.overlong,
                                           process_index=jax.process_index(),
                                           process_count=jax.process_count()))
    slots = sampler_args.stream_slots(c.rloo, c.rloo.sampler_mode, self.batch_size, k)
    if slots:  # the whole set streams through one batch's engine slots, one call
      batches = [{name: np.concatenate([b[name] for b in batches]) for name in batches[0]}]
    texts, scores, lengths, per_fn, ids = [], [], [], {}, []
    votes = getattr(self.rewards.fns[0], "answer_ids", None) or answer_ids  # the first's
    for i, batch in enumerate(batches):
      out, r_bk, local_texts, parts = rollout.rollout(
          exp, params, batch, jax.random.fold_in(self.rng, i), k=k, method=method,
          rewards=self.rewards, slots=slots)
      valid = exp.layout.gather_rows(batch["valid"])  # global rows, like r_bk
      scores.append(np.asarray(r_bk)[valid].reshape(-1))
      lengths.append(exp.layout.gather(out.lengths_bk)[valid].reshape(-1))
      local_valid = np.repeat(np.asarray(batch["valid"]), k)
      texts.extend(t for t, v in zip(local_texts, local_valid) if v)
      for name, v in parts.items():
        per_fn.setdefault(name, []).append(np.asarray(v).reshape(-1, k)[valid].reshape(-1))
      if answers:  # a group's texts are on one process; its ids gathered like its scores
        ids.append(exp.layout.gather_rows(_votes(votes, local_texts, k))[valid].reshape(-1))
    out = (texts, np.concatenate(scores), np.concatenate(lengths),
           {name: np.concatenate(chunks) for name, chunks in per_fn.items()})
    return out + (np.concatenate(ids),) if answers else out

  def greedy_completions(self, params) -> list[Optional[str]]:
    """Each record's greedy completion, unscored (None where its prompt is over
    config.data.max_prompt_len and left out): the texts `greedy_reward` scores, same batches,
    for judges that compare them with other texts (rloo_jax.winrate). One process."""
    texts = rollout.sample_records(self.exp, params, self.records, self.rng, k=1,
                                   method=sampling.Greedy(), batch_size=self.batch_size)
    return [t[0] if t else None for t in texts]

  def _reference_scores(self, ref_params, name: str, method) -> np.ndarray:
    fp = self.exp.layout.gather(_fingerprint(ref_params))
    key = (name, str(jax.tree.structure(ref_params)), fp.tobytes())
    if key not in self._reference:
      per_fn = self.completions(ref_params, method)[3]
      self._reference[key] = per_fn[self.rewards.first]
    return self._reference[key]

  def __call__(self, params, ref_params=None) -> dict:
    """The metrics of the module docstring for `params` (and against `ref_params`)."""
    results = {}
    for name, method in (("greedy", sampling.Greedy()), ("sampled", self.exp.method)):
      _, scores, lengths, per_fn = self.completions(params, method)
      results[f"{name}_reward"] = nanmean(scores)
      results[f"{name}_length"] = float(lengths.mean()) if lengths.size else float("nan")
      for fn_name, v in per_fn.items():
        results[f"{name}_reward/{fn_name}"] = nanmean(v)
      if ref_params is not None:
        stats = win_rate_stats(per_fn[self.rewards.first],
                               self._reference_scores(ref_params, name, method))
        prefix = "" if name == "greedy" else "sampled_"
        results.update({f"{prefix}win_rate_vs_ref": stats["win_rate"],
                        f"{prefix}wins_vs_ref": stats["wins"],
                        f"{prefix}ties_vs_ref": stats["ties"],
                        f"{prefix}losses_vs_ref": stats["losses"],
                        f"{prefix}n_vs_ref": stats["n"]})
    n = int(self.exp.config.train.get("eval_samples", 0) or 0)
    if n > 1:
      results.update(self.pass_at_k(params, n))
    return results

  def pass_at_k(self, params, n: int) -> dict:
    """pass@k (k = 1, 2, 4, ..., n) and maj@n of n sampled completions a prompt."""
    _, _, _, per_fn, ids = self.completions(params, self.exp.method, k=n, answers=True)
    at = float(self.exp.config.train.get("eval_correct_at", 1.0))
    correct = (np.nan_to_num(per_fn[self.rewards.first], nan=-np.inf) >= at).reshape(-1, n)
    votes = [[None if a < 0 else a for a in row] for row in ids.reshape(-1, n).tolist()]
    return passk.summarize(correct, votes)


def _final_answer(text: str) -> str:
  boxed = boxed_answer(text)
  if boxed is not None:
    return "boxed:" + boxed
  number = gsm8k_answer.extract_answer(text)
  return text.strip() if number is None else gsm8k_answer.normalize(number)  # 4.0 is 4


def answer_ids(texts, k: int) -> np.ndarray:
  """int32 [len(texts) / k, k]: for each group of k texts, the index of the first text in the
  group with the same answer (`passk.group_ids`), the answer being the last \\boxed{} without
  spaces, else the number a GSM8K-style completion ends on, else the stripped text."""
  return passk.group_ids([_final_answer(t) for t in texts], k)


def _votes(votes, texts, k: int) -> np.ndarray:
  ids = np.asarray(votes(texts, k))
  if ids.shape != (len(texts) // k, k):
    raise ValueError(f"the first evaluation reward's answer_ids returned shape {ids.shape} for "
                     f"{len(texts)} texts in groups of {k}: it must return int [{len(texts) // k}"
                     f", {k}] (rloo_jax.passk.group_ids makes one from an answer a text)")
  return ids.astype(np.int32)


def format_summary(summary: dict, *, label: Optional[str] = None) -> str:
  """The before/after table a run prints: the initial policy against the trained one."""
  b, a = summary["before"], summary["after"]
  label = label or summary.get("algorithm", "rloo").upper()
  judge = summary.get("reward", "reward")
  start = summary.get("initial_policy", "initial policy")
  rows = [(f"held-out greedy reward ({judge})", "greedy_reward"),
          ("held-out mean sampled reward", "sampled_reward"),
          ("mean completion length (greedy)", "greedy_length")]
  if "win_rate_vs_ref" in a:
    rows.append((f"greedy win rate vs {start} (ties half)", "win_rate_vs_ref"))
  rows += [(f"{key} (sampled)", key) for key in a if key.split("@")[0] in ("pass", "maj")
           and not key.endswith(("_lo", "_hi"))]
  width = max(40, max(len(r[0]) for r in rows))
  lines = [f"\nheld-out evaluation on {summary['eval_prompts']} prompts, seed {summary['seed']}, "
           f"{summary['iterations']} {label} iterations",
           f"| {'metric':<{width}} | {start[:16]:>16} | {label[:8]:>8} |",
           f"|{'-' * (width + 2)}|{'-' * 18}|{'-' * 10}|"]
  for name, key in rows:
    lines.append(f"| {name:<{width}} | {b.get(key, float('nan')):>16.3f} | "
                 f"{a.get(key, float('nan')):>8.3f} |")
  return "\n".join(lines)

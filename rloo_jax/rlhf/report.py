"""The RLHF pipeline's report: the gold-vs-proxy and reward-vs-KL plots and the stage table."""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import numpy as np


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
  last = s["history"][-1] if s["history"] else None
  pairs = (f"{p['train']} train / {p['eval']} held-out; {p['no_distinct_samples']} prompts "
           "without 2 distinct samples")
  accuracy = (f"held-out pair accuracy {ev['accuracy']:.3f} (labels vs gold: "
              f"{ev.get('label_gold_agreement', float('nan')):.3f}), gold order "
              f"{ev.get('gold_agreement', float('nan')):.3f}")
  rloo = (f"final rollout KL {last['kl']:.3f}, proxy {last['proxy_reward']:+.3f}, gold "
          f"{last['gold_reward']:.3f}" if last else "no iterations")
  lines = [
      f"\nRLHF pipeline on {s['task']} (seed {s['seed']}): SFT {s['sft_steps']} steps -> "
      f"{p['train']} + {p['eval']} preference pairs -> reward model {s['rm_steps']} steps -> "
      f"RLOO {s['rloo_iterations']} iterations (k={s['k']}, beta={s['beta']})",
      "",
      f"| {'stage':<13} | {'result':<66} | {'time':>7} |",
      f"|{'-' * 15}|{'-' * 68}|{'-' * 9}|",
      f"| {'SFT':<13} | {'held-out greedy gold reward %.3f' % s['sft']['gold_reward']:<66} | "
      f"{sec('sft_s'):>7} |",
      f"| {'pairs':<13} | {pairs:<66} | {sec('pairs_s'):>7} |",
      f"| {'reward model':<13} | {accuracy:<66} | {sec('rm_s'):>7} |",
      f"| {'RLOO':<13} | {rloo:<66} | {sec('rloo_s'):>7} |",
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

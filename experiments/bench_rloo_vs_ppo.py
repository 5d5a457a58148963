r"""The seed's hardware claims about RLOO vs PPO, measured side by side in one run at the default
arithmetic policy and one rollout batch (docs/RESULTS.md "RLOO vs PPO", rendered by
make_results.py from the JSON line this prints and writes to --out): `memory` (state and each
compiled program's XLA memory_analysis, on each algorithm's own rows), `speed` (median seconds
per iteration, interleaved), and `variance` (trace of the RLOO gradient estimate's covariance at
k = 2 and 4). The prompt's KV cache shared by its k streams: experiments/bench_sampler.py.

    python experiments/bench_rloo_vs_ppo.py --sft=/work/runs/table1_arithmetic/_shared
    # without --sft the policy is random (its rewards are all 0: the variance part is skipped)
"""
import argparse
import copy
import json
import os
import shutil
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from rloo_jax import advantage, algorithms, config_utils, loop, loss, policy_init, rollout
from rloo_jax.models import transformer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tree_bytes(tree) -> int:
  return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def memory_of(jitted, *args) -> dict:
  lowered = jitted.lower(*args)
  if isinstance(lowered, dict):  # RLOO's update.TrainStep: its gradient program, the larger
    lowered = lowered["update_gradients"]
  m = lowered.compile().memory_analysis()
  return dict(argument=int(m.argument_size_in_bytes), output=int(m.output_size_in_bytes),
              temp=int(m.temp_size_in_bytes), alias=int(m.alias_size_in_bytes))


def measure_memory(rloo, ppo, n, p, t):
  """Each algorithm's state and compiled scoring / update programs, on the rows each trains on
  (`rollout.make_rows` traced with its own layout; PPO's GAE targets from its own score_fn)."""
  k = rloo.exp.config.rloo.k
  b = n // k
  s = jax.ShapeDtypeStruct
  rloo_state, ppo_state = rloo.abstract_state(), ppo.abstract_state()
  # The rows' inputs: prompts [B, P], lengths [B], completions, mask, log-probs [N, T] (N = B k).
  inputs = (s((b, p), jnp.int32), s((b,), jnp.int32), s((n, t), jnp.int32), s((n, t), jnp.bool_),
            s((n, t), jnp.float32))
  rloo_rows = jax.eval_shape(lambda *a: rollout.make_rows(
      *a, k=k, shared_prefix=bool(rloo.exp.config.train.shared_prefix)), *inputs)
  seq_rows = jax.eval_shape(lambda *a: rollout.make_rows(*a, k=k, shared_prefix=False), *inputs)
  ppo_score_args = (ppo_state.ref_params, ppo_state.value_params, seq_rows, s((n,), jnp.float32),
                    s((n,), jnp.bool_))
  ppo_rows = jax.eval_shape(ppo.score_fn, *ppo_score_args)[0]
  out = {"rloo": dict(state_bytes=tree_bytes(rloo_state),
                      train_step=memory_of(rloo.step_fn, rloo_state, rloo_rows),
                      # The scoring pass's program of any size: the reference's log-probs.
                      score=memory_of(rloo.reference_fn, rloo_state.ref_params, rloo_rows)),
         "ppo": dict(state_bytes=tree_bytes(ppo_state),
                     train_step=memory_of(ppo.step_fn, ppo_state, ppo_rows),
                     score=memory_of(ppo.score_fn, *ppo_score_args))}
  policy = tree_bytes(rloo_state.params)
  for name, m in out.items():
    m["peak_estimate_bytes"] = m["state_bytes"] + max(m["train_step"]["temp"], m["score"]["temp"])
    # RLHF with a learned reward model of the policy's size: one more frozen model for both.
    m["peak_with_reward_model_bytes"] = m["peak_estimate_bytes"] + policy
    m["models_held"] = round(m["state_bytes"] / policy, 2)
  for key in ("state_bytes", "peak_estimate_bytes", "peak_with_reward_model_bytes"):
    out[f"rloo_over_ppo_{key}"] = round(out["rloo"][key] / out["ppo"][key], 3)
  out["policy_param_bytes"] = policy
  return out


def time_iterations(rloo, ppo, params, data, iterations: int):
  states = {"rloo": rloo.init_state(jax.tree.map(jnp.copy, params)),
            "ppo": ppo.init_state(jax.tree.map(jnp.copy, params))}
  algos = {"rloo": rloo, "ppo": ppo}
  times = {"rloo": [], "ppo": []}
  # The first two iterations compile, so are dropped (PPO's second compiles for its new state).
  warmup = 2
  for i in range(iterations + warmup):
    batch = next(data)
    for name in ("rloo", "ppo") if i % 2 == 0 else ("ppo", "rloo"):
      t0 = time.perf_counter()
      states[name], _ = algos[name].iteration(states[name], batch)
      jax.block_until_ready(states[name].params)
      if i >= warmup:
        times[name].append(time.perf_counter() - t0)
  med = {k: statistics.median(v) for k, v in times.items()}
  return dict(rloo_s=med["rloo"], ppo_s=med["ppo"], samples=iterations,
              ppo_over_rloo=round(med["ppo"] / med["rloo"], 3),
              all_s={k: [round(x, 3) for x in v] for k, v in times.items()})


def gradient_variance(exp, params, batch, repeats: int, ks=(2, 4)):
  """Trace of the covariance of the RLOO gradient estimate for one fixed prompt batch."""
  @jax.jit
  def grad_fn(params, rows):
    def f(params):
      logp = loss.token_logprobs(rows.logits(exp.fns, params), rows.completions_nt, rows.cmask_nt)
      return loss.reinforce_loss(logp, rows.cmask_nt, rows.advantages_n)[0]

    g = jax.grad(f)(params)
    return jnp.concatenate([x.reshape(-1) for x in jax.tree.leaves(g)])

  out = {}
  for k in ks:
    grads = []
    for r in range(repeats):
      o, rewards_bk, _, _ = rollout.rollout(exp, params, batch, jax.random.PRNGKey(1000 * k + r),
                                            k=k)
      b = rewards_bk.shape[0]
      rows = rollout.make_rows(jnp.asarray(batch["prompt_tokens"]),
                               jnp.asarray(batch["prompt_lengths"]),
                               o.tokens_bkt.reshape(b * k, -1), o.mask_bkt.reshape(b * k, -1),
                               o.policy_logprobs_bkt.reshape(b * k, -1), k=k, shared_prefix=False)
      adv = advantage.get("rloo")(jnp.asarray(np.asarray(rewards_bk, np.float32)))
      # The estimate of the per-prompt mean gradient: mean over the k samples (the loss's mean
      # over rows, times 1 since rows = prompts * k is fixed per k).
      rows = rows.replace(advantages_n=adv.reshape(-1))
      grads.append(np.asarray(grad_fn(params, rows), np.float64))
    g = np.stack(grads)
    var = float(((g - g.mean(0)) ** 2).sum(1).mean() * repeats / (repeats - 1))
    out[f"k{k}"] = dict(variance=var, variance_x_k=var * k,
                        mean_grad_norm=float(np.linalg.norm(g.mean(0))))
  return dict(out, k4_over_k2=round(out["k4"]["variance"] / out["k2"]["variance"], 3),
              k4_over_k2_per_sample=round(out["k4"]["variance_x_k"] / out["k2"]["variance_x_k"], 3),
              repeats=repeats, prompts=int(batch["prompt_tokens"].shape[0]))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--sft", default="", help="a workdir holding sft/<steps> (else random init)")
  parser.add_argument("--iterations", type=int, default=5)
  parser.add_argument("--repeats", type=int, default=16, help="gradient estimates per k")
  parser.add_argument("--workdir", default="/tmp/bench_rloo_vs_ppo")
  parser.add_argument("--out", default="")
  args = parser.parse_args()
  from absl import logging
  logging.set_verbosity(logging.WARNING)
  c = config_utils.load_config_file(os.path.join(REPO, "configs", "arithmetic.py"))
  c.train.update(num_iterations=args.iterations + 2, num_epochs=2, progress_bar=False)
  os.makedirs(args.workdir, exist_ok=True)
  if args.sft and not os.path.exists(os.path.join(args.workdir, "sft")):
    shutil.copytree(os.path.join(args.sft, "sft"), os.path.join(args.workdir, "sft"))
  t_start = time.time()
  rloo = algorithms.make(c, args.workdir)
  exp = rloo.exp
  ppo_config = copy.deepcopy(c)
  ppo_config.algorithm = "ppo"
  ppo = algorithms.make(ppo_config, args.workdir, task=exp.task)
  params = (policy_init.initial_params(exp, log=lambda *a: None) if args.sft
            else transformer.create(exp.model_config, seed=0)[1])
  n, p, t = c.rloo.num_prompts * c.rloo.k, c.data.max_prompt_len, c.rloo.max_new_tokens
  out = dict(config=dict(model=c.model.to_dict(), num_prompts=c.rloo.num_prompts, k=c.rloo.k,
                         max_new_tokens=t, num_epochs=c.train.num_epochs,
                         policy="sft" if args.sft else "random"))
  out["memory"] = measure_memory(rloo, ppo, n, p, t)
  data = loop.prompt_batches(exp, seed=0)
  out["speed"] = time_iterations(rloo, ppo, params, data, args.iterations)
  if args.sft:
    small = {k: v[:8] for k, v in next(data).items()}
    out["variance"] = gradient_variance(exp, params, small, args.repeats)
  out["seconds"] = round(time.time() - t_start, 1)
  print(json.dumps(out))
  if args.out:
    with open(args.out, "w") as f:
      f.write(json.dumps(out) + "\n")


if __name__ == "__main__":
  main()

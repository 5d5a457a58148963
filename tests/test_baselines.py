"""Baselines: PPO (GAE, per-token rewards, clipped value loss, one iteration), DPO (loss by hand,
gradient sign, one step), and the sweep configs against the registries."""
import glob
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import REPO, load_config
from rloo_jax import advantage, algorithms, loss, models
from rloo_jax.algorithms import dpo, ppo_math
from rloo_jax.algorithms.ppo import PPO
from rloo_jax.optim import make_optimizer

sys.path.insert(0, os.path.join(REPO, "experiments"))
import sweep  # noqa: E402  (experiments/sweep.py)


# ----------------------------------------------------------------------------------------------
# PPO math by hand


def test_gae_by_hand():
  rewards = jnp.array([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
  values = jnp.array([[0.5, 0.6, 0.7], [0.2, 0.4, 9.0]])
  mask = jnp.array([[True, True, True], [True, True, False]])
  adv, ret = ppo_math.gae(rewards, values, mask, gamma=1.0, lam=0.9)
  # Row 0: deltas 0.1, 0.1, 0.3 -> A2 = 0.3, A1 = 0.1 + 0.9 * 0.3, A0 = 0.1 + 0.9 * 0.37.
  # Row 1: the value 9.0 sits after the end and must not leak in: deltas 0.2, 0.6.
  np.testing.assert_allclose(adv, [[0.433, 0.37, 0.3], [0.74, 0.6, 0.0]], atol=1e-6)
  np.testing.assert_allclose(ret, [[0.933, 0.97, 1.0], [0.94, 1.0, 0.0]], atol=1e-6)
  # gamma = 0.5, lambda = 1: A_t = sum_l gamma^l delta_{t+l} = discounted return - V_t.
  adv, _ = ppo_math.gae(rewards[:1], values[:1], mask[:1], gamma=0.5, lam=1.0)
  np.testing.assert_allclose(adv[0], [0.25 - 0.5, 0.5 - 0.6, 1.0 - 0.7], atol=1e-6)


def test_token_rewards_kl_per_token_and_sequence_reward_at_the_last_token():
  kl = jnp.array([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]])
  mask = jnp.array([[True, True, False], [True, True, True]])
  r = ppo_math.token_rewards(jnp.array([2.0, -1.0]), kl, mask, beta=0.5)
  np.testing.assert_allclose(r, [[-0.05, -0.1 + 2.0, 0.0], [-0.2, -0.25, -0.3 - 1.0]], atol=1e-6)


def test_value_loss_clipping():
  ret = jnp.array([[1.0, 1.0]])
  old = jnp.array([[0.5, 0.5]])
  mask = jnp.array([[True, True]])
  # Token 0 moved 0.5 past the old value: the clipped prediction 0.7 is worse and counts.
  # Token 1 moved 0.1, inside the range: both terms agree.
  v = jnp.array([[1.0, 0.6]])
  value, metrics = ppo_math.value_loss(v, old, ret, mask, clip=0.2)
  np.testing.assert_allclose(value, (0.5 * 0.09 + 0.5 * 0.16) / 2, atol=1e-6)
  np.testing.assert_allclose(metrics["value_clip_fraction"], 0.5)
  grad = jax.grad(lambda x: ppo_math.value_loss(x, old, ret, mask, clip=0.2)[0])(v)
  np.testing.assert_allclose(grad[0, 0], 0.0, atol=1e-7)  # clipped branch: no gradient
  np.testing.assert_allclose(grad[0, 1], (0.6 - 1.0) / 2, atol=1e-6)
  unclipped, _ = ppo_math.value_loss(v, old, ret, mask, clip=0.0)
  np.testing.assert_allclose(unclipped, (0.0 + 0.5 * 0.16) / 2, atol=1e-6)


def test_token_level_clip_loss_with_per_token_advantages_counts_active_clips():
  logp = jnp.log(jnp.array([[1.5, 1.0, 0.5]]))  # ratios 1.5, 1.0, 0.5 against old = log 1
  old = jnp.zeros((1, 3))
  mask = jnp.ones((1, 3), bool)
  adv = jnp.array([[1.0, 1.0, -1.0]])
  value, m = loss.ppo_clip_loss(logp, old, mask, adv, clip_eps=0.2, ratio_level="token",
                                aggregation="token_mean")
  # min(1.5, 1.2) = 1.2; 1.0; min(-0.5, -0.8) = -0.8 -> loss = -(1.2 + 1.0 - 0.8) / 3.
  np.testing.assert_allclose(value, -(1.2 + 1.0 - 0.8) / 3, atol=1e-6)
  np.testing.assert_allclose(m["clip_fraction"], 2 / 3, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# DPO math by hand


def test_dpo_loss_by_hand_and_gradient_sign():
  args = [jnp.array([-1.0]), jnp.array([-2.0]), jnp.array([-1.5]), jnp.array([-1.5])]
  value, m = dpo.dpo_loss(*args, beta=0.1)
  margin = 0.1 * 0.5 - 0.1 * (-0.5)
  np.testing.assert_allclose(value, math.log1p(math.exp(-margin)), atol=1e-6)
  np.testing.assert_allclose(m["reward_accuracy"], 1.0)
  g = jax.grad(lambda c, r: dpo.dpo_loss(c, r, args[2], args[3], beta=0.1)[0],
               argnums=(0, 1))(args[0], args[1])
  assert float(g[0][0]) < 0 < float(g[1][0])  # raise the chosen, lower the rejected
  # At the reference the loss is log 2 whatever beta.
  np.testing.assert_allclose(dpo.dpo_loss(*[jnp.zeros(3)] * 4, beta=3.0)[0], math.log(2),
                             atol=1e-6)


# ----------------------------------------------------------------------------------------------
# One tiny PPO iteration and one DPO step


def tiny_config():
  c = load_config()
  c.data.update(num_train=64, num_test=8, max_prompt_len=8)
  c.model.update(hidden_size=16, num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=32,
                 max_seq_len=16)
  c.rloo.update(k=2, num_prompts=2, max_new_tokens=3)
  c.train.update(num_iterations=1, num_epochs=1)
  c.optim.warmup_steps = 0  # the warm-up's first step has learning rate 0
  return c


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("baselines")
  config = tiny_config()
  config.algorithm = "ppo"
  algo = algorithms.make(config, str(tmp))
  assert isinstance(algo, PPO)
  _, params = models.create(algo.exp.model_config, seed=0)
  return config, algo, params


def test_one_ppo_iteration(tiny):
  config, algo, params = tiny
  state = algo.init_state(jax.tree.map(jnp.copy, params))
  before = jax.tree.map(np.asarray, state.value_params)
  from rloo_jax.data import pipeline
  batch = next(pipeline.prompt_batches(algo.exp.task.train, algo.exp.tokenizer,
                                       global_batch_size=2, max_prompt_len=8, seed=0))
  state, m = algo.iteration(state, batch)
  assert int(state.step) == 1
  for key in ("policy_loss", "value_loss", "clip_fraction", "value_clip_fraction", "kl",
              "explained_variance", "reward_mean", "grad_norm", "value_grad_norm"):
    assert np.isfinite(m[key]), key
  changed = jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != b)), state.value_params, before)
  assert any(jax.tree.leaves(changed)), "the critic did not train"
  # The critic shares the policy's backbone shapes (same size) with a scalar head.
  assert algo.value_config.head == "scalar"
  assert algo.value_config.replace(head="lm") == algo.exp.model_config
  # with_defaults: PPO's advantages come from GAE, over full rows.
  assert algo.exp.config.advantage.estimator == "vanilla"
  assert not algo.exp.config.train.shared_prefix


def test_one_dpo_step_raises_the_margin(tiny):
  config, algo, params = tiny
  exp = algo.exp
  pairs = [dict(prompt="1+2=", chosen="3", rejected="4"),
           dict(prompt="5+5=", chosen="10", rejected="1")]
  rows = dpo.pair_rows(pairs, exp.tokenizer, seq_len=12)
  ref = dpo.reference_logprobs(exp.fns, params, rows, batch_size=4,
                              chunk_size=exp.config.train.logprob_chunk_size)
  c = dpo.with_defaults(config)
  c.optim.update(learning_rate=1e-2, warmup_steps=0)
  tx = make_optimizer(c.optim, 10)
  state = dpo.DPOState(jnp.zeros((), jnp.int32), jax.tree.map(jnp.copy, params),
                       jax.tree.map(jnp.copy, params), tx.init(params))
  batch = dict(rows, ref_logp=ref)
  state, m = dpo.train_step(state, batch, fns=exp.fns, tx=tx, beta=0.5,
                             chunk_size=exp.config.train.logprob_chunk_size)
  np.testing.assert_allclose(m["dpo_loss"], math.log(2), atol=1e-5)  # policy == reference
  _, m2 = dpo.train_step(state, batch, fns=exp.fns, tx=tx, beta=0.5,
                         chunk_size=exp.config.train.logprob_chunk_size)
  assert float(m2["reward_margin"]) > 0 and float(m2["dpo_loss"]) < math.log(2)


# ----------------------------------------------------------------------------------------------
# Sweep configs


SWEEPS = sorted(glob.glob(os.path.join(REPO, "configs", "sweeps", "*.py")))


@pytest.mark.parametrize("path", SWEEPS, ids=os.path.basename)
def test_sweep_configs_are_valid(path):
  module, runs = sweep.load_sweep(path)
  base = sweep.apply_overrides(sweep.load_config(module.CONFIG), getattr(module, "COMMON", {}))
  configs = [sweep.apply_overrides(base, dict(r, seed=0)) for r in runs]
  sweep.validate_all(configs)  # registry names, k, batch shapes, PPO / DPO sections
  for r, c in zip(runs, configs):
    assert c.get("algorithm", "rloo") in algorithms.names(), r["name"]
    assert c.advantage.estimator in advantage.names(), r["name"]
    for key in r:  # every override names an existing setting (no silent typos)
      if key in ("name", "algorithm") or key.startswith(("dpo.", "ppo.")):
        continue
      node = base
      for part in key.split("."):
        assert part in node, f"{os.path.basename(path)}:{r['name']}: unknown setting {key}"
        node = node[part]


def test_table1_has_every_row_of_the_paper():
  module, runs = sweep.load_sweep(os.path.join(REPO, "configs", "sweeps", "table1_arithmetic.py"))
  base = sweep.apply_overrides(sweep.load_config(module.CONFIG), module.COMMON)
  rows = set()
  for r in runs:
    c = sweep.apply_overrides(base, r)
    algo = c.get("algorithm", "rloo")
    rows.add(algo if algo != "rloo" else f"{c.advantage.estimator}_k{c.rloo.k}")
  for want in ("rloo_k4", "rloo_k2", "raft_k4", "raft_k2", "reinforce_ema_k1", "vanilla_k1",
               "ppo", "dpo", "grpo_k4"):
    assert want in rows, want

"""Dynamic sampling (config.rloo.dynamic_sampling, DAPO): an iteration trains on the first
num_prompts groups of the prompt stream whose rewards differ, rolling out further batches for them
up to a bound; one rollout whose groups all differ trains exactly as without it."""
import hashlib

import jax
import numpy as np
import pytest

from rloo_jax import dynamic_sampling, experiment, models
from rloo_jax.algorithms.rloo import RLOO
from rloo_jax.data import pipeline
from test_trim import tiny_config

K = 4


def by_position(prompts, completions, **fields):
  """Sample j of each group gets reward j: every group's rewards differ."""
  del prompts, fields
  return (np.arange(len(completions)) % K).astype(np.float32)


def _equal_prompt(prompt: str) -> bool:
  return hashlib.sha256(prompt.encode()).digest()[0] % 2 == 0


def half_equal(prompts, completions, **fields):
  """Reward j for sample j, except prompts of an even hash, whose samples all get 0."""
  del fields
  r = (np.arange(len(completions)) % K).astype(np.float32)
  return np.where([_equal_prompt(p) for p in prompts], 0.0, r).astype(np.float32)


def zero(prompts, completions, **fields):
  del prompts, fields
  return np.zeros(len(completions), np.float32)


def _algo(tmp_path, reward, *, dynamic=True, rounds=8):
  config = tiny_config()
  config.rloo.k = K
  config.rewards.fns = [f"{__file__}:{reward}"]
  config.rewards.weights = [1.0]
  config.rloo.dynamic_sampling = dynamic
  config.rloo.dynamic_sampling_max_rounds = rounds
  experiment.validate_config(config)
  algo = RLOO(experiment.build(config, str(tmp_path)))
  return algo, algo.init_state(models.create(algo.exp.model_config)[1])


def test_informative_groups_are_chosen_first_in_order_then_equal_ones():
  rewards = np.array([[1, 1, 1, 1], [0, 1, 0, 0], [2, 2, np.nan, 3], [5, 0, 0, 0]], np.float32)
  usable = np.isfinite(rewards) & np.array([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1],
                                             [1, 0, 0, 0]], bool)
  np.testing.assert_array_equal(dynamic_sampling.informative(rewards, usable),
                                [False, True, True, False])  # the last: one usable sample
  kept, new = np.array([True, False, True, False]), np.array([False, True, True, False])
  np.testing.assert_array_equal(dynamic_sampling.choose(kept, new), [0, 2, 5, 6])
  np.testing.assert_array_equal(dynamic_sampling.choose(kept, ~new), [0, 2, 4, 7])
  np.testing.assert_array_equal(dynamic_sampling.choose(~kept, ~kept & False), [1, 3, 0, 2])


def test_with_every_group_informative_it_trains_exactly_as_without(tmp_path):
  runs = []
  for dynamic in (False, True):
    algo, state = _algo(tmp_path / str(dynamic), "by_position", dynamic=dynamic)
    state, m = algo.iteration(state, next(algo.batches()))
    runs.append((state, m))
  (s0, m0), (s1, m1) = runs
  for a, b in zip(jax.tree.leaves(s0.params), jax.tree.leaves(s1.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert m1["dynamic/rounds"] == 1 and m1["dynamic/equal_groups_kept"] == 0
  assert m1["loss"] == m0["loss"] and m1["reward_mean"] == m0["reward_mean"]


def test_equal_reward_groups_are_dropped_and_refilled_from_the_next_prompts(tmp_path):
  algo, state = _algo(tmp_path, "half_equal")
  data = algo.batches()
  first = next(data)
  b = first["prompt_tokens"].shape[0]
  # The prompt stream as a fresh iterator with the same seed draws it.
  fresh = pipeline.prompt_batches(algo.exp.task.train, algo.exp.tokenizer, global_batch_size=b,
                                  max_prompt_len=algo.exp.config.data.max_prompt_len,
                                  seed=algo.exp.config.seed)
  stream = [next(fresh) for _ in range(8)]
  want, rounds = [], 0
  while len(want) < b:
    want += [row for row, p in zip(stream[rounds]["prompt_tokens"], stream[rounds]["prompt"])
             if not _equal_prompt(p)]
    rounds += 1
  assert rounds >= 2, "the seed's first batch should hold an equal-reward prompt"
  trained, *_, metrics = algo.dynamic(state.policy_params, first, data, jax.random.PRNGKey(0))
  np.testing.assert_array_equal(trained["prompt_tokens"], np.stack(want[:b]))
  assert metrics["dynamic/rounds"] == rounds
  assert metrics["dynamic/equal_groups_kept"] == 0
  drawn = [_equal_prompt(p) for s in stream[:rounds] for p in s["prompt"]]
  assert metrics["dynamic/frac_equal_sampled"] == pytest.approx(np.mean(drawn))
  # The extra rollouts consumed the stream: the next batch is the one after them.
  np.testing.assert_array_equal(next(data)["prompt_tokens"], stream[rounds]["prompt_tokens"])
  # A whole iteration trains on informative groups only.
  _, m = algo.iteration(state, next(data))
  assert m["frac_groups_all_equal"] == 0.0 and np.isfinite(m["loss"])


def test_the_bound_fills_the_batch_with_equal_groups_and_counts_them(tmp_path):
  algo, state = _algo(tmp_path, "zero", rounds=2)
  data = algo.batches()
  _, m = algo.iteration(state, next(data))
  b = algo.exp.config.rloo.num_prompts
  assert m["dynamic/rounds"] == 2 and m["dynamic/groups_sampled"] == 2 * b
  assert m["dynamic/equal_groups_kept"] == b and m["dynamic/frac_equal_sampled"] == 1.0
  assert m["advantage_abs_max"] < 1e-4 and np.isfinite(m["loss"])  # the KL term alone


@pytest.mark.parametrize("change, match", [
    ({"algorithm": "ppo"}, r"config.algorithm='ppo' draws none"),
    ({"rloo.k": 1, "advantage.estimator": "vanilla"}, r"needs a group baseline"),
    ({"rloo.dynamic_sampling_max_rounds": 1}, r"dynamic_sampling_max_rounds = 1"),
])
def test_settings_that_cannot_work_are_refused_by_name(change, match):
  config = tiny_config()
  config.rloo.dynamic_sampling = True
  config.update_from_flattened_dict(change)
  with pytest.raises(ValueError, match=match):
    dynamic_sampling.check_config(config)

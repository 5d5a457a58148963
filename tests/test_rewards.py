"""Rewards: the weighted RewardSet, metric names, the summarize gold labeller and preferences."""

import sys

import ml_collections
import numpy as np
import pytest

from rloo_jax import rewards
from rloo_jax.rewards import preferences, summarize_gold
from rloo_jax.rewards.reward_set import RewardSet, reward_name

PROMPTS = ["p0", "p1", "p2"]
COMPLETIONS = ["a", "bb", "ccc"]


def const(*values, name="const"):
  def fn(prompts, completions, **fields):
    del prompts, fields
    assert len(completions) == len(values)
    return np.array(values, np.float32)
  fn.__name__ = name
  return fn


def length(prompts, completions, **fields):
  del prompts, fields
  return np.array([len(c) for c in completions], np.float32)


def test_weighted_sum_matches_hand_computed():
  rs = RewardSet([length, const(1.0, -2.0, 0.5)], [2.0, -0.5], ["length", "const"])
  total, parts = rs(PROMPTS, COMPLETIONS, {})
  # 2 * [1, 2, 3] - 0.5 * [1, -2, 0.5]
  np.testing.assert_allclose(total, [1.5, 5.0, 5.75])
  assert total.dtype == np.float64
  np.testing.assert_array_equal(parts["length"], [1, 2, 3])
  np.testing.assert_array_equal(parts["const"], [1.0, -2.0, 0.5])
  assert rs.first == "length"


def test_fields_reach_every_function():
  seen = []

  def needs_answer(prompts, completions, *, answer, **fields):
    seen.append((list(prompts), list(answer), fields))
    return [float(c == a) for c, a in zip(completions, answer)]

  rs = RewardSet([needs_answer], [1.0], ["needs_answer"])
  total, _ = rs(PROMPTS, COMPLETIONS, {"answer": ["a", "x", "ccc"], "stop": None})
  np.testing.assert_array_equal(total, [1.0, 0.0, 1.0])
  assert seen == [(PROMPTS, ["a", "x", "ccc"], {"stop": None})]


def test_weight_zero_is_monitored_only_and_its_nan_masks_nothing():
  rs = RewardSet([length, const(np.nan, 7.0, None)], [1.0, 0.0], ["length", "monitor"])
  total, parts = rs(PROMPTS, COMPLETIONS, {})
  np.testing.assert_array_equal(total, [1.0, 2.0, 3.0])  # no NaN from the monitored function
  assert np.isnan(parts["monitor"][0]) and parts["monitor"][1] == 7.0
  assert np.isnan(parts["monitor"][2])  # None reads as NaN (unscorable)


def test_nan_in_a_weighted_function_makes_the_total_nan():
  rs = RewardSet([length, const(0.0, np.nan, None)], [1.0, 0.1], ["length", "sometimes"])
  total, parts = rs(PROMPTS, COMPLETIONS, {})
  assert total[0] == 1.0 and np.isnan(total[1]) and np.isnan(total[2])
  np.testing.assert_array_equal(parts["length"], [1.0, 2.0, 3.0])


def test_wrong_length_output_names_the_function_and_the_shape():
  def short(prompts, completions, **fields):
    del prompts, completions, fields
    return np.zeros(2, np.float32)

  rs = RewardSet([length, short], [1.0, 1.0], ["length", "short"])
  with pytest.raises(ValueError, match=r"reward function short returned shape \(2,\); "
                                       r"expected \(3,\)"):
    rs(PROMPTS, COMPLETIONS, {})
  scalar = RewardSet([lambda p, c, **f: 1.0], [1.0], ["scalar"])
  with pytest.raises(ValueError, match=r"reward function scalar returned shape \(\); "
                                       r"expected \(3,\)"):
    scalar(PROMPTS, COMPLETIONS, {})


def test_mismatched_lengths_and_duplicate_names_raise():
  with pytest.raises(ValueError, match="2 entries but config.rewards.weights has 1"):
    RewardSet([length, length], [1.0], ["a", "b"])
  with pytest.raises(ValueError, match="share a name"):
    RewardSet([length, const(1.0, 1.0, 1.0)], [1.0, 1.0], ["x", "x"])
  with pytest.raises(ValueError, match="config.rewards.fns is empty"):
    RewardSet([], [], [])


def test_from_config_resolves_names_and_checks_weights():
  c = ml_collections.ConfigDict(dict(
      fns=["rloo_jax.rewards.verifiers:arithmetic_exact_match", length], weights=[1, 0.5]))
  rs = RewardSet.from_config(c)
  assert rs.names == ["arithmetic_exact_match", "length"]
  assert rs.fns[0] is rewards.arithmetic_exact_match and rs.fns[1] is length
  assert rs.weights == [1.0, 0.5] and all(isinstance(w, float) for w in rs.weights)
  c.weights = [1.0]
  with pytest.raises(ValueError, match="2 entries but config.rewards.weights has 1"):
    RewardSet.from_config(c)
  c = ml_collections.ConfigDict(dict(  # one metric name for two entries
      fns=["rloo_jax.rewards.verifiers:arithmetic_exact_match",
           "rloo_jax.rewards:arithmetic_exact_match"], weights=[1.0, 1.0]))
  with pytest.raises(ValueError, match="share a name"):
    RewardSet.from_config(c)


def test_reward_name():
  assert reward_name("rloo_jax.rewards.verifiers:arithmetic_exact_match") == \
      "arithmetic_exact_match"
  assert reward_name("path/to/my_rewards.py:brevity") == "brevity"
  assert reward_name("reward_model:/x") == "reward_model"
  assert reward_name("reward_model:/runs/rm?whiten=false&clip=3") == "reward_model"
  assert reward_name(length) == "length"
  assert reward_name(const(1.0, name="custom")) == "custom"


def test_package_reexports():
  assert rewards.REWARD_MODEL_PREFIX == "reward_model:"
  assert rewards.resolve(length) is length
  assert rewards.resolve("rloo_jax.rewards.summarize_gold:gold_reward") is \
      summarize_gold.gold_reward
  assert rewards.RewardSet is RewardSet and rewards.reward_name is reward_name
  assert callable(rewards.load_reward_fn)


# --- the summarize task's hidden labeller ---------------------------------------------------------

def test_gold_reward_hand_cases():
  prompt = "doc: the storm was a river and storm then market tl;dr:"
  cases = {
      "storm river market": 1.1,          # all key words, in order
      "river storm market": 1.0,          # all, out of order
      "storm river": 2 / 3,               # recall 2/3
      "storm river market the": 0.9,      # one extra filler word
      "storm storm river market": 0.9,    # a repeat costs like an extra word
      "storm river market castle": 0.8,   # a word not in the document costs more
      "": 0.0,
  }
  got = summarize_gold.gold_reward([prompt] * len(cases), list(cases))
  np.testing.assert_allclose(got, list(cases.values()), atol=1e-6)
  assert np.isnan(summarize_gold.gold_reward(["not a prompt"], ["storm"])).all()
  assert np.isnan(summarize_gold.gold_reward(["doc: the a tl;dr:"], ["the"])).all()  # no keys
  with pytest.raises(ValueError, match="2 prompts but 1 completions"):
    summarize_gold.gold_reward([prompt, prompt], ["storm"])


def test_win_rate_and_preferences():
  assert preferences.win_rate_stats([1.0, 0.5, 0.2, np.nan], [0.5, 0.5, 0.9, 0.0]) == \
      dict(win_rate=0.5, wins=1, ties=1, losses=1, n=3)
  assert np.isnan(preferences.win_rate_stats([np.nan], [1.0])["win_rate"])
  rng = np.random.default_rng(0)
  assert preferences.bradley_terry_prefer([1.0, 0.0], [0.0, 1.0], rng,
                                          temperature=0).tolist() == [True, False]
  p = preferences.bradley_terry_prefer(np.full(4000, 0.1), np.zeros(4000), rng, temperature=0.1)
  assert p.mean() == pytest.approx(1 / (1 + np.exp(-1)), abs=0.03)


def test_a_reward_function_by_file_path_is_loaded_once_and_keeps_its_state(tmp_path):
  path = tmp_path / "my_reward.py"
  path.write_text("import numpy as np\ncalls = []\n"
                  "def length(prompts, completions, *, answer=None, **fields):\n"
                  "  calls.append(len(completions))\n"
                  "  return np.array([len(c) for c in completions], np.float32)\n")
  fn = rewards.resolve(f"{path}:length")
  np.testing.assert_array_equal(fn(["p", "q"], ["ab", "c"]), [2.0, 1.0])
  again = rewards.resolve(f"{path}:length")
  assert again is fn  # one module per file: a second resolve shares its state
  again(["p"], ["abc"])
  assert sys.modules[fn.__module__].calls == [2, 1]
  with pytest.raises(ValueError, match=r"no file .*missing\.py"):
    rewards.resolve(f"{tmp_path}/missing.py:length")
  with pytest.raises(ValueError, match=r"has no attribute 'nope'"):
    rewards.resolve(f"{path}:nope")


def test_a_reward_function_spec_takes_its_defaulted_parameters_as_typed_options(tmp_path):
  path = tmp_path / "scaled.py"
  path.write_text("import numpy as np\n"
                  "def scaled(prompts, completions, *, scale=1.0, n=1, flip=False, tag='a', "
                  "answer=None, **fields):\n"
                  "  return np.full(len(completions), scale * n * (-1 if flip else 1) "
                  "* len(tag), np.float32)\n")
  fn = rewards.resolve(f"{path}:scaled?scale=0.5&n=3&flip=true&tag=abcd")
  np.testing.assert_array_equal(fn(["p"], ["c"], answer=["x"]), [-6.0])
  with pytest.raises(ValueError, match=r"the records' field\(s\) \['n'\] have the name of an "
                                       r"option the spec sets; rename"):
    fn(["p"], ["c"], answer=["x"], n=[2])  # a record field `n` would have overridden n=3
  assert reward_name(f"{path}:scaled?scale=0.5") == "scaled"
  for option, message in (("size=2", r"unknown or valueless option 'size=2'; options are "
                                     r"\['flip', 'n', 'scale', 'tag'\]"),
                          ("scal=2", r"did you mean scale\?"),
                          ("n=2.5", r"option n='2.5' is not a int"),
                          ("flip=maybe", r"option flip='maybe' is not a bool")):
    with pytest.raises(ValueError, match=message):
      rewards.resolve(f"{path}:scaled?{option}")


def test_a_reward_that_never_returns_stops_at_its_deadline_naming_it():
  import time  # pylint: disable=import-outside-toplevel
  from rloo_jax.rewards import RewardTimeoutError  # pylint: disable=import-outside-toplevel

  def hangs(prompts, completions, **fields):
    time.sleep(60)
  rs = RewardSet([hangs], [1.0], ["hangs"], timeout_s=0.5)
  t0 = time.perf_counter()
  with pytest.raises(RewardTimeoutError, match=r"reward function hangs did not return within "
                                               r"config.rewards.timeout_s=0.5 s \(scoring a batch "
                                               r"of 2 completions\)"):
    rs(["p", "q"], ["a", "b"], {})
  assert time.perf_counter() - t0 < 0.5 + 1.0
  with pytest.raises(ValueError, match=r"config.rewards.timeout_s = -1.0 must be >= 0"):
    RewardSet([hangs], [1.0], ["hangs"], timeout_s=-1.0)


@pytest.mark.parametrize("value,message", [
    ("1.0", r"returned '1.0' \(str\) for completion 0; return a float"),
    (object(), r"returned <object object .*> \(object\) for completion 0"),
    (np.inf, r"returned inf for completion 0; return a finite score, or NaN"),
    (-np.inf, r"returned -inf for completion 0"),
])
def test_a_reward_returning_strings_objects_or_infinities_is_an_error_naming_it(value, message):
  from rloo_jax.rewards import RewardReturnError  # pylint: disable=import-outside-toplevel
  rs = RewardSet([lambda prompts, completions, **f: [value, 1.0]], [1.0], ["odd"])
  with pytest.raises(RewardReturnError, match=r"reward function odd " + message):
    rs(["p", "q"], ["a", "b"], {})
  # NaN and None stay 'cannot score'; numpy and Python numbers and bools are scores.
  ok = RewardSet([lambda prompts, completions, **f: [None, np.float32(2), True, np.nan]], [1.0],
                 ["ok"])
  np.testing.assert_array_equal(ok(["p"] * 4, ["a"] * 4, {})[1]["ok"], [np.nan, 2.0, 1.0, np.nan])
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  bf16 = RewardSet([lambda prompts, completions, **f: jnp.full(2, 0.5, jnp.bfloat16)], [1.0],
                   ["reward_model"])  # a reward model's scores may come back in bfloat16
  np.testing.assert_array_equal(bf16(["p"] * 2, ["a"] * 2, {})[1]["reward_model"], [0.5, 0.5])

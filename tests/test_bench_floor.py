"""experiments/bench_floor.py counts the work the planner counts and derives its floor from it."""
import math

import pytest

from rloo_jax.memory import flops as flops_lib
from test_experiments import run_json

import compare_peers  # noqa: E402  (experiments/, on the path via test_experiments)
import bench_floor  # noqa: E402


@pytest.fixture(scope="module")
def runs():
  return {remat: run_json("bench_floor.py", "--size", "t", "--remat", remat, "--repeats", 1,
                          "--peer_s", "trl=2.5,tunix=1.5", "--hf_generate_s", 0.5)
          for remat in ("none", "full")}


def test_the_counted_work_is_the_planners(runs):
  size = compare_peers.SIZES["t"]
  m = bench_floor.model_config(size)
  b, k, p, t = size["prompts"], size["k"], size["prompt_len"], size["new_tokens"]
  counted = flops_lib.model_flops_per_iteration(m, b, p, k, t, True)
  trunk, attention, _ = flops_lib.scoring_forward_flops(m, b, p, k, t, True)
  for remat, r in runs.items():
    assert r["params"] == m.num_params and r["decode_rows"] == b * k
    assert r["scored_rows"] == b * p + b * k * (t - 1)  # the prompt once per group
    recompute = flops_lib.remat_recompute_flops(m, b, p, k, t, True, 1, remat)
    assert r["gflop"]["rollout"] == round(counted["rollout"] / 1e9, 6)
    assert r["gflop"]["reference"] == round(counted["reference"] / 1e9, 6)
    assert r["gflop"]["update"] == round((counted["update"] + recompute) / 1e9, 6)
  # remat 'full' recomputes the trunk's forward, the rest of the work unchanged.
  full, none = runs["full"]["gflop"], runs["none"]["gflop"]
  assert full["update"] - none["update"] == pytest.approx((trunk + attention) / 1e9, abs=2e-6)
  assert full["rollout"] == none["rollout"] and full["reference"] == none["reference"]


def test_the_floor_and_the_ratios_follow_from_the_rates(runs):
  for r in runs.values():
    assert all(math.isfinite(g) and g > 0 for g in r["gflops"].values())
    assert all(s > 0 for s in r["floor_s"].values())
    total = sum(r["floor_s"].values())
    assert r["floor_iteration_s"] == pytest.approx(total, abs=3e-6)
    assert r["max_ratio"]["trl"] == pytest.approx(2.5 / r["floor_iteration_s"], rel=1e-3)
    assert r["max_ratio"]["tunix"] == pytest.approx(1.5 / r["floor_iteration_s"], rel=1e-3)
    assert r["max_rollout_ratio_hf"] == pytest.approx(0.5 / r["floor_s"]["rollout"], rel=1e-3)

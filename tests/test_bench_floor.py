"""experiments/bench_floor.py counts the work the planner counts and derives its floor from it."""
import math
import re

import numpy as np
import pytest

from rloo_jax.memory import flops as flops_lib
from test_experiments import run_json

import compare_peers  # noqa: E402  (experiments/, on the path via test_experiments)
import bench_floor  # noqa: E402


@pytest.fixture(scope="module")
def runs():
  out = {remat: run_json("bench_floor.py", "--size", "t", "--remat", remat, "--repeats", 1,
                         "--peer_s", "trl=2.5,tunix=1.5", "--hf_generate_s", 0.5)
         for remat in ("none", "full")}
  out["none, two-pass head"] = run_json("bench_floor.py", "--size", "t", "--remat", "none",
                                        "--fused_head", 0, "--repeats", 1, "--peer_s",
                                        "trl=2.5,tunix=1.5", "--hf_generate_s", 0.5)
  return out


def test_the_counted_work_is_the_planners(runs):
  size = compare_peers.SIZES["t"]
  m = bench_floor.model_config(size)
  b, k, p, t = size["prompts"], size["k"], size["prompt_len"], size["new_tokens"]
  counted = flops_lib.model_flops_per_iteration(m, b, p, k, t, True)
  trunk, attention, head = flops_lib.scoring_forward_flops(m, b, p, k, t, True)
  for r in runs.values():
    assert r["params"] == m.num_params and r["decode_rows"] == b * k
    assert r["scored_rows"] == b * p + b * k * (t - 1)  # the prompt once per group
    recompute = flops_lib.remat_recompute_flops(m, b, p, k, t, True, 1, r["remat"],
                                                fused_head=bool(r["fused_head"]))
    assert r["gflop"]["rollout"] == round(counted["rollout"] / 1e9, 6)
    assert r["gflop"]["reference"] == round(counted["reference"] / 1e9, 6)
    assert r["gflop"]["update"] == round((counted["update"] + recompute) / 1e9, 6)
  # remat 'full' recomputes the trunk's forward, the rest of the work unchanged.
  full, none = runs["full"]["gflop"], runs["none"]["gflop"]
  assert full["update"] - none["update"] == pytest.approx((trunk + attention) / 1e9, abs=2e-6)
  assert full["rollout"] == none["rollout"] and full["reference"] == none["reference"]
  # Autodiff's two passes recompute every log-prob chunk's head; the fused pass does not.
  two_pass = runs["none, two-pass head"]
  assert runs["none"]["fused_head"] == 1 and two_pass["fused_head"] == 0
  assert two_pass["gflop"]["update"] - none["update"] == pytest.approx(head / 1e9, abs=2e-6)


def test_the_floor_and_the_ratios_follow_from_the_rates(runs):
  for r in runs.values():
    assert all(math.isfinite(g) and g > 0 for g in r["gflops"].values())
    assert all(s > 0 for s in r["floor_s"].values())
    total = sum(r["floor_s"].values())
    assert r["floor_iteration_s"] == pytest.approx(total, rel=1e-5)
    assert r["max_ratio"]["trl"] == pytest.approx(2.5 / r["floor_iteration_s"], rel=1e-3)
    assert r["max_ratio"]["tunix"] == pytest.approx(1.5 / r["floor_iteration_s"], rel=1e-3)
    assert r["max_rollout_ratio_hf"] == pytest.approx(0.5 / r["floor_s"]["rollout"], rel=1e-3)


def _computations(hlo: str) -> dict:
  """{name: body text} of an HLO module's computations (ENTRY under the name 'ENTRY')."""
  out, name, lines = {}, None, []
  for line in hlo.splitlines():
    head = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
    if head and name is None:
      name, lines = ("ENTRY" if head.group(1) else head.group(2)), []
    elif line.startswith("}") and name is not None:
      out[name], name = "\n".join(lines), None
    elif name is not None:
      lines.append(line)
  return out


def _reachable(comps: dict, root: str) -> set:
  seen, todo = set(), [root]
  while todo:
    name = todo.pop()
    if name in seen or name not in comps:
      continue
    seen.add(name)
    todo += re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", comps[name])
  return seen


@pytest.mark.parametrize("left", [False, True])
def test_the_rate_loop_runs_every_product_inside_it(left):
  """rate() divides a call's time by PRODUCTS_PER_CALL, so each trip must compute its product:
  a product hoisted out of the loop as invariant (as with a barrier on unchanged activations)
  read 1,500 GFLOP/s on a 2-core CPU."""
  f, (w, x) = bench_floor.product_loop(8, 16, 32, left)
  got = np.asarray(f(w, x))
  scale, want = np.float32(1.0 + 2 ** -20), 0
  xs = np.asarray(x)
  for _ in range(bench_floor.PRODUCTS_PER_CALL):
    xs = xs * scale
    want = want + (np.asarray(w) @ xs if left else xs @ np.asarray(w))
  np.testing.assert_allclose(got, want, rtol=1e-5)
  comps = _computations(f.lower(w, x).compile().as_text())
  bodies = set(re.findall(r"\bbody=%?([\w.\-]+)", comps["ENTRY"]))
  assert len(bodies) == 1, comps["ENTRY"]
  in_loop = _reachable(comps, bodies.pop())
  with_dot = {name for name, text in comps.items() if re.search(r"\bdot\(", text)}
  assert with_dot and with_dot <= in_loop, (with_dot, in_loop)

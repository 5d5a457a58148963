"""experiments/ab_compiled.py runs a variant A/B end to end (tiny model, in a subprocess: a variant
monkeypatches rloo_jax) and reports that the variant computes the same tokens and gradients."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ab_compiled_runs_a_variant_and_checks_equal_results():
  out = subprocess.run(
      [sys.executable, os.path.join(REPO, "experiments", "ab_compiled.py"),
       os.path.join(REPO, "experiments", "variants", "unfused_decode_qkv.py"),
       "--hidden", "32", "--layers", "1", "--pairs", "2"],
      check=True, capture_output=True, text=True, cwd=REPO).stdout
  result = json.loads(out.strip().splitlines()[-1])
  assert result["variant"] == "unfused_decode_qkv.py" and result["pairs"] == 2
  # Three matmuls or one: the same tokens, and the scoring gradient is untouched.
  assert result["rollout_tokens_equal"] is True
  assert result["gradient_max_rel_diff"] == 0.0
  for program in ("rollout", "forward", "gradient"):
    assert result[program]["A_s"] > 0 and result[program]["B_s"] > 0
    assert result[program]["median_pair_ratio_B_over_A"] > 0
  # The variant reached the decode loop's compiled program, and only it: the scoring forwards
  # never used the fused projection.
  assert result["rollout"]["program_changed"] is True
  assert result["forward"]["program_changed"] is False
  assert result["gradient"]["program_changed"] is False


def test_ab_config_interleaves_iterations_of_both_settings():
  out = subprocess.run(
      [sys.executable, os.path.join(REPO, "experiments", "ab_config.py"),
       "--flag", "reuse_rollout_activations", "--hidden", "32", "--layers", "1", "--pairs", "2"],
      check=True, capture_output=True, text=True, cwd=REPO).stdout
  result = json.loads(out.strip().splitlines()[-1])
  assert result["flag"] == "reuse_rollout_activations" and result["pairs"] == 2
  for phase in ("rollout_s", "reference_s", "update_s", "iteration_s"):
    assert result[phase]["A_s"] > 0 and result[phase]["B_s"] > 0
    assert result[phase]["median_pair_ratio_B_over_A"] > 0

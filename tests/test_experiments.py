"""The benchmark and peer-comparison scripts of experiments/ run end to end at their smallest
settings, and what they print makes sense: not only positive timings, but the numbers each script
derives (tokens, rewards, losses, ratios of rounds) checked against what they must be. The
user-facing tools (sweep, make_results, gpu_check): test_experiments_tools.py."""
import json
import math
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPERIMENTS = os.path.join(REPO, "experiments")
sys.path.insert(0, EXPERIMENTS)


def run_json(script, *args, cwd=REPO):
  """The last JSON line `experiments/<script> args...` prints."""
  out = subprocess.run([sys.executable, os.path.join(EXPERIMENTS, script), *map(str, args)],
                       check=True, capture_output=True, text=True, cwd=cwd).stdout
  return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


def finite(*xs):
  return all(isinstance(x, (int, float)) and math.isfinite(x) for x in xs)


# ----------------------------------------------------------------------------------------------
# bench_step.py


BENCH_KEYS = {"framework", "jax", "devices", "config", "params", "median",
              "mean_completion_length", "mean_reward", "mean_kl", "mean_loss", "mean_advantage",
              "update_tokens_per_iteration", "generated_tokens_per_iteration",
              "model_gflop_per_iteration", "achieved_gflops", "update_gflops", "fraction_of_peak",
              "peak_rss_gb", "trainable_params"}
PHASES = ("rollout_s", "reward_s", "reference_s", "update_s", "iteration_s")


def test_bench_step_reports_a_consistent_iteration():
  hidden, layers, heads, vocab, prompts, prompt_len, k, new_tokens = 32, 1, 2, 256, 2, 4, 2, 4
  # One run, without the shared prefix: compare_peers' test runs this size's default (shared).
  shared = 0
  r = run_json("bench_step.py", "--hidden", hidden, "--layers", layers, "--heads", heads,
               "--prompts", prompts, "--prompt_len", prompt_len, "--k", k, "--new_tokens",
               new_tokens, "--iterations", 2, "--shared_prefix", shared)
  assert set(r) == BENCH_KEYS, set(r) ^ BENCH_KEYS
  assert r["framework"] == "rloo_jax"
  # The flags keep their names (compare_peers.py passes them).
  assert r["config"] == dict(hidden=hidden, layers=layers, heads=heads, vocab=vocab,
                             prompts=prompts, prompt_len=prompt_len, k=k,
                             new_tokens=new_tokens, iterations=2, dtype="float32",
                             shared_prefix=shared, peak_gflops=390.0, ref_dtype="bfloat16",
                             remat="full", microbatch_size=0, logprob_chunk_size=32,
                             lora_rank=0, reward_delay_ms=0.0, fixed_length=0)
  assert r["trainable_params"] == r["params"]  # full fine-tuning: every parameter trains
  # The process held at least its float32 params (and a python + jax runtime).
  assert 4 * r["params"] / 2**30 < r["peak_rss_gb"] < 8, r["peak_rss_gb"]
  # A Llama with untied head: embedding + head, 4 attention and 3 MLP matrices, 2 norms a
  # layer, the final norm.
  e, f = hidden, 4 * hidden
  assert r["params"] == 2 * vocab * e + layers * (4 * e * e + 3 * e * f + 2 * e) + e
  med = r["median"]
  assert set(med) == set(PHASES)
  assert all(med[p] > 0 for p in PHASES), med
  # iteration_s is each iteration's sum of phases, so its median bounds each phase's median.
  assert med["iteration_s"] >= max(med[p] for p in PHASES[:-1])
  # What was trained on: the synthetic reward is a fraction, RLOO's leave-one-out
  # advantages sum to zero over each group, and the loss and KL are finite.
  assert 1 <= r["mean_completion_length"] <= new_tokens
  assert 0.0 <= r["mean_reward"] <= 1.0
  assert finite(r["mean_kl"], r["mean_loss"]) and abs(r["mean_kl"]) < 1.0
  assert abs(r["mean_advantage"]) < 1e-5
  # The trainer's throughput metrics count every [prompt | completion] row's tokens once per
  # epoch, and the generated tokens of every sample.
  assert r["update_tokens_per_iteration"] == pytest.approx(
      prompts * k * (prompt_len + new_tokens), rel=1e-3)
  assert r["generated_tokens_per_iteration"] == pytest.approx(
      prompts * k * r["mean_completion_length"], rel=1e-3)
  assert r["model_gflop_per_iteration"] > 0 and r["achieved_gflops"] > 0
  assert r["update_gflops"] > 0
  assert r["fraction_of_peak"] * 390.0 == pytest.approx(r["achieved_gflops"], abs=0.05)


# ----------------------------------------------------------------------------------------------
# compare_peers.py

# A stand-in peer interpreter: its first run prints a bench line, every later one runs out of
# memory the way XLA or torch says so.
FAKE_PEER = """#!/bin/sh
if [ -e "$0.ran" ]; then
  echo "jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory allocating 1 bytes" >&2
  exit 1
fi
touch "$0.ran"
echo "$GLIBC_TUNABLES" > "$0.env"
echo '{"framework": "trl", "trl": "fake", "torch": "fake", "params": %d, "median_step_s": 0.25}'
"""


def test_compare_peers_rounds_ratios_and_peer_failures(tmp_path):
  """Our side runs every round; a peer's ratio is its seconds over ours in the same round; a
  peer that runs out of memory is reported and not run again; a missing peer is skipped with
  its reason, never silently."""
  hidden, layers, vocab = 32, 1, 256  # compare_peers' size 't'
  params = 2 * vocab * hidden + layers * (4 * hidden**2 + 3 * hidden * 4 * hidden + 2 * hidden) \
      + hidden
  fake = tmp_path / "fake_python"
  fake.write_text(FAKE_PEER % params)
  fake.chmod(0o755)
  out = subprocess.run(
      [sys.executable, os.path.join(EXPERIMENTS, "compare_peers.py"), "--sizes", "t",
       "--rounds", "3", "--iterations", "1", "--trl_python", str(fake),
       "--tunix_python", str(tmp_path / "no_venv" / "python")],
      check=True, capture_output=True, text=True, cwd=REPO).stdout
  size, summary = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
  assert size["size"] == "t" and size["hidden"] == hidden and size["params"] == params
  assert size["fixed_length"] is True and "warning" not in size
  # Every side runs with malloc madvising huge pages (the default --malloc_hugepages 1).
  tunables = size["env"]["GLIBC_TUNABLES"]
  assert tunables.split(":")[-1] == "glibc.malloc.hugetlb=1"
  assert size["trl_threads"] == 2 and size["trl_env"] == size["env"]
  assert (tmp_path / "fake_python.env").read_text().strip() == tunables
  rounds = size["per_round"]
  # The order rotates (ours, TRL, Tunix; TRL, Tunix, ours; Tunix, ours, TRL) less the peers
  # that do not run: Tunix is missing, and TRL ran out of memory in round 1.
  assert [r["order"] for r in rounds] == [["rloo_jax", "trl"], ["trl", "rloo_jax"], ["rloo_jax"]]
  assert all(r["rloo_jax_s"] > 0 and r["rloo_jax_split_s"]["iteration_s"] == r["rloo_jax_s"]
             for r in rounds)
  assert rounds[0]["trl_s"] == 0.25
  assert rounds[0]["vs_trl"] == pytest.approx(0.25 / rounds[0]["rloo_jax_s"], rel=1e-2)
  assert "vs_trl" not in rounds[1] and "vs_trl" not in rounds[2]
  assert size["median_vs_trl"] == pytest.approx(rounds[0]["vs_trl"])
  assert size["median_rloo_jax_iteration_s"] == pytest.approx(
      sorted(r["rloo_jax_s"] for r in rounds)[1], rel=1e-3)
  failed = size["trl_status"]["failed"]
  assert size["trl_status"]["round"] == 1
  assert failed["out_of_memory"] is True and failed["returncode"] == 1
  assert "RESOURCE_EXHAUSTED" in failed["output_tail"] and failed["mem_limit_gb"] == 20.0
  assert "no interpreter at" in size["tunix_status"]["skipped"]
  assert "setup_peer_venvs.sh tunix" in size["tunix_status"]["skipped"]
  assert size["median_tunix_step_s"] is None and size["median_vs_tunix"] is None
  assert size["versions"]["trl"] == "fake" and len(size["load_before"]) == 3
  # The summary line repeats each size's medians and says what became of each peer.
  assert summary["summary"] is True and summary["rounds"] == 3
  t = summary["sizes"]["t"]
  assert t["median_vs_trl"] == size["median_vs_trl"] and t["trl_status"] == "out of memory"
  assert t["tunix_status"].startswith("no interpreter at")


# ----------------------------------------------------------------------------------------------
# bench_sampler.py


# The smallest sampler benchmark: one layer of hidden 32, 2 prompts x k = 2, 4 + 4 tokens.
TINY_SAMPLER = ("--prompt_len", 4, "--new_tokens", 4, "--prompts", 2, "--k", 2, "--vocab", 64,
                "--hidden", 32, "--layers", 1, "--heads", 2, "--kv_heads", 2, "--intermediate", 64,
                "--repeats", 2)


def test_bench_sampler_modes_agree(capsys):
  modes = ["shared", "unshared", "unstacked"]
  prompts, k, new_tokens = 2, 2, 4
  r = run_json("bench_sampler.py", *TINY_SAMPLER, "--modes", ",".join(modes))
  assert set(r["all_times_s"]) == set(modes) and r["hf_generate_s"] is None
  for mode in modes:
    assert r[f"{mode}_s"] > 0
    assert r[f"{mode}_tokens_per_s"] == pytest.approx(prompts * k * new_tokens / r[f"{mode}_s"],
                                                      rel=0.01)
  # Every mode draws stream (b, j)'s tokens from the same keys: the same completions.
  lengths = r["mean_completion_len"]
  assert set(lengths) == set(modes) and 1 <= lengths["shared"] <= new_tokens
  assert len(set(lengths.values())) == 1, lengths
  # The programs were compiled by the warm-up call: no timed call is a compile.
  for mode in modes:
    assert max(r["all_times_s"][mode]) < r["compile_s"][mode], (mode, r["all_times_s"],
                                                                r["compile_s"])
  assert r["unstacked_over_shared"] == pytest.approx(r["unstacked_s"] / r["shared_s"], rel=0.01)
  assert r["shared_over_unshared"] == pytest.approx(r["shared_s"] / r["unshared_s"], rel=0.01)
  # An unknown mode: its flags parsed in this process (jax already imported), argparse's exit
  # status 2 and message; a process of its own spent its time importing.
  import bench_sampler  # noqa: E402  (experiments/, on the path above)
  with pytest.raises(SystemExit) as exit_:
    bench_sampler.parse_args(["--modes", "shared,left"])
  assert exit_.value.code == 2 and "unknown modes ['left']" in capsys.readouterr().err


def test_malloc_env_adds_the_huge_page_tunable_to_the_callers_or_nothing(monkeypatch):
  import compare_peers
  monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
  assert compare_peers.malloc_env(True) == {
      "GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"}
  assert compare_peers.malloc_env(False) == {}
  # Without it means without, even when the caller's environment asks for huge pages.
  monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1:glibc.malloc.arena_max=2")
  assert compare_peers.malloc_env(False) == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}
  assert compare_peers.malloc_env(True) == {
      "GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"}
  monkeypatch.delenv("GLIBC_TUNABLES")
  assert compare_peers.malloc_env(True) == {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}

"""The user-facing experiments/ tools run end to end at their smallest settings: sweep.py (dry
runs of every sweep file, and a tiny sweep of three algorithms trained, resumed and rendered by
make_results.py) and gpu_check.py (its CPU smoke size, the figures derived from its
measurements)."""
import json
import os
import subprocess
import sys

import pytest

from test_experiments import EXPERIMENTS, REPO, run_json

import sweep  # noqa: E402  (experiments/, on the path via test_experiments)


# ----------------------------------------------------------------------------------------------
# gpu_check.py


def test_gpu_check_figures_follow_from_their_measurements():
  # One layer of Pythia-160M's widths: the derived figures need no depth (595 s at 12 layers),
  # nor its 50k vocabulary (initialising its embeddings took half of this test).
  r = run_json("gpu_check.py", "--preset", "pythia-160m", "--num_layers", 1, "--vocab_size",
               2048, "--prompts", 2, "--prompt_len", 16, "--new_tokens", 8, "--iterations", 1,
               "--repeats", 1, "--microbatch_size", 0, "--checks", "decode,update,memory",
               cwd=EXPERIMENTS)
  u = r["update"]
  assert set(r["decode"]) == {"scanned", "unstacked"}
  for d in r["decode"].values():
    assert d["streams"] == 8 and d["decode_steps"] == 7
    assert d["weight_gb"] * 1e9 == 2 * u["num_params"]  # every parameter once, in bfloat16
    assert d["decode_tokens_per_s"] == pytest.approx(8 * 7 / d["decode_s"], rel=1e-3)
    step = (d["weight_gb"] + d["kv_cache_gb"]) * 1e9 / 4.8e12
    assert d["roofline_step_ms"] == pytest.approx(1e3 * step, rel=1e-3)
    assert d["roofline_over_measured"] == pytest.approx(
        d["roofline_tokens_per_s"] / d["decode_tokens_per_s"], rel=1e-2)
    assert 0 < d["kv_cache_gb"] < d["weight_gb"]
  # The per-layer KV buffers hold the same bytes as the stacked cache.
  assert r["decode"]["scanned"]["kv_cache_gb"] == r["decode"]["unstacked"]["kv_cache_gb"]
  assert u["update_mfu"] == pytest.approx(u["update_flops"] / u["update_s"] / 989e12, rel=0.02,
                                          abs=1e-4)
  assert u["update_flops"] > 6 * u["num_params"] * 2 * 4 * 8 * 0.5  # ~6 x params x tokens
  # The memory check plans the same model's job and runs it; a CPU has no device peak to read.
  mem = r["memory"]
  assert mem["num_params"] == u["num_params"]
  assert mem["planned_peak_gb"] == max(mem["planned_programs_gb"].values()) > 0
  assert mem["measured_peak_gb"] is None and mem["measured_over_planned"] is None
  assert 0 <= mem["reward_mean"] <= 1


def test_bench_attention_blockwise_equals_xla_in_less_memory():
  out = subprocess.run([sys.executable, os.path.join(EXPERIMENTS, "bench_attention.py"),
                        "--lengths", "2048", "--heads", "1,2", "--head_dim", "16", "--prompt",
                        "64", "--repeats", "1"], check=True, capture_output=True, text=True).stdout
  rows = [json.loads(line) for line in out.splitlines()]
  assert [(r["layout"], r["tokens"]) for r in rows] == [("causal", 2048), ("group", 2112)]
  for r in rows:  # at 2,048 tokens the [S, S] scores outweigh what either kernel holds besides
    assert r["blockwise"]["max_rel_err"] < 1e-5
    assert r["blockwise"]["temp_mib"] < 0.5 * r["xla"]["temp_mib"], r


def test_gpu_check_refuses_an_unknown_decode_layout_before_building_a_model(monkeypatch, capsys):
  # In this process (jax already imported): a process of its own spent its time importing.
  import gpu_check  # noqa: E402  (experiments/, on the path via test_experiments)
  monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--decode_layers", "scanned,unstaked"])
  built = []
  monkeypatch.setattr(gpu_check, "decode_check", lambda args: built.append(args))
  with pytest.raises(SystemExit) as exit_:
    gpu_check.main()
  assert exit_.value.code == 2 and not built
  assert ("--decode_layers 'scanned,unstaked': ['unstaked'] not among scanned, unstacked"
          in capsys.readouterr().err)


# ----------------------------------------------------------------------------------------------
# sweep.py


SWEEPS = sorted(os.path.join(REPO, "configs", "sweeps", f)
                for f in os.listdir(os.path.join(REPO, "configs", "sweeps")) if f.endswith(".py"))


@pytest.mark.parametrize("path", SWEEPS, ids=os.path.basename)
def test_sweep_dry_run_lists_every_run_and_seed(path, tmp_path, capsys):
  sweep.main(["--sweep", path, "--root", str(tmp_path), "--dry_run", "--seeds", "0,1"])
  lines = capsys.readouterr().out.strip().splitlines()
  _, runs = sweep.load_sweep(path)
  # Seed-major, every run at every seed, with exactly its overrides.
  assert lines == [f"{r['name']}/seed{s}: {json.dumps({k: v for k, v in r.items() if k != 'name'})}"
                   for s in (0, 1) for r in runs]
  assert not os.listdir(tmp_path)  # a dry run writes nothing


def test_sweep_config_arg_replaces_the_base_configs_argument(tmp_path):
  """--config_arg runs a sweep file's rows at another model size: it reaches get_config."""
  path = os.path.join(REPO, "configs", "sweeps", "table1_tldr.py")
  with pytest.raises(ValueError, match="unknown config argument 'bogus'"):
    sweep.main(["--sweep", path, "--root", str(tmp_path), "--dry_run",
                "--config_arg", "model=pythia-1b,bogus=1"])
  sweep.main(["--sweep", path, "--root", str(tmp_path), "--dry_run",
              "--config_arg", "model=pythia-1b"])


def test_sweep_rejects_an_unknown_algorithm():
  base = sweep.load_config("configs/arithmetic.py:smoke")
  with pytest.raises(ValueError, match="unknown config.algorithm"):
    sweep.validate_all([sweep.apply_overrides(base, {"algorithm": "a2c"})])


TINY_SWEEP = '''
CONFIG = "configs/arithmetic.py:smoke"
SEEDS = (0,)
COMMON = {"train.num_iterations": 1, "train.eval_every": 0, "train.eval_prompts": 8,
          "train.eval_batch_size": 8, "sft.steps": 4}
NOISY = {"rewards.fns": ["rloo_jax.rewards.verifiers:arithmetic_exact_match",
                         "rloo_jax.rewards.noise:standard_normal"], "rewards.weights": [1.0, 1.0]}


def get_sweep():
  return [dict(name="rloo_k2", **{"rloo.k": 2}),
          dict(name="ppo", algorithm="ppo", **{"rloo.k": 1}),
          # A 4-step SFT policy never answers right: noise breaks the ties so pairs exist.
          dict(name="dpo", algorithm="dpo", **NOISY, **{
              "dpo.steps": 1, "dpo.batch_size": 4, "dpo.num_pair_prompts": 8,
              "dpo.samples_per_prompt": 2, "dpo.sample_batch_size": 4, "dpo.eval_every": 0})]
'''


def test_sweep_trains_every_algorithm_from_one_sft_policy_and_resumes(tmp_path):
  path = tmp_path / "tiny_sweep.py"
  path.write_text(TINY_SWEEP)
  root = tmp_path / "root"
  cmd = [sys.executable, os.path.join(EXPERIMENTS, "sweep.py"), f"--sweep={path}",
         f"--root={root}", "--quiet"]
  subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=REPO)
  summaries = {}
  for name in ("rloo_k2", "ppo", "dpo"):
    workdir = root / name / "seed0"
    summaries[name] = json.loads((workdir / "summary.json").read_text())
    info = json.loads((workdir / "run.json").read_text())
    assert summaries[name]["algorithm"] == info["algorithm"] == (
        "rloo" if name == "rloo_k2" else name)
    assert summaries[name]["iterations"] == 1 and summaries[name]["initial_policy"] == "SFT"
    assert info["name"] == name and info["seed"] == 0 and info["wall_s"] > 0
    for ev in (summaries[name]["before"], summaries[name]["after"]):
      assert 0.0 <= ev["greedy_reward/arithmetic_exact_match"] <= 1.0
      assert 1 <= ev["greedy_length"] <= 5
  assert summaries["dpo"]["num_pairs"] > 0
  # One SFT policy for every method: the same held-out evaluation before training.
  before = {n: (s["before"]["greedy_length"], s["before"]["greedy_reward/arithmetic_exact_match"])
            for n, s in summaries.items()}
  assert len(set(before.values())) == 1, before
  # A finished run is skipped on a rerun.
  out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=REPO).stdout
  assert out.count("done, skipped") == 3, out
  # make_results renders those runs as Table 1's rows (the other sources missing, said so).
  results = tmp_path / "docs" / "RESULTS.md"
  results.parent.mkdir()
  # Only its generated sections are replaced; what is kept by hand around them stays.
  results.write_text("# Results\n\nby hand\n\n## Table 1 in miniature: arithmetic (old)\nold\n"
                     "## RLOO vs PPO: old\nold bench\n## Kept by hand\nkept\n")
  subprocess.run([sys.executable, os.path.join(EXPERIMENTS, "make_results.py"),
                  f"--table1={root}", f"--summarize={tmp_path / 'none'}",
                  f"--ablations={tmp_path / 'none'}", f"--bench={tmp_path / 'none.json'}",
                  f"--out={results}"], check=True, capture_output=True, text=True, cwd=REPO)
  md = results.read_text()
  for label, name in (("RLOO k=2", "rloo_k2"), ("PPO", "ppo"), ("DPO", "dpo")):
    row = next(line for line in md.splitlines() if line.startswith(f"| {label} | 0 |"))
    assert f"{summaries[name]['before']['greedy_reward']:.3f}" in row, row
  assert "| RLOO k=4 | - | - | not run |" in md
  assert "Not run (no benchmark JSON given)." in md
  assert md.startswith("# Results\n\nby hand\n") and md.endswith("## Kept by hand\nkept\n")
  assert "old bench" not in md and "\nold\n" not in md
  assert any(f.endswith(".png") for f in os.listdir(tmp_path / "docs" / "results"))


def test_padding_packs_long_tailed_lengths_under_a_tenth():
  """Issue 38's padding figure: log-normal completion lengths, today's trimmed grouped rows
  beside packed ones (rloo_jax.packing's plan) at each budget."""
  r = run_json("padding.py")  # 5 draws (seeded), the medians
  assert r["padding"]["trimmed"] > 0.5
  assert max(v for name, v in r["padding"].items() if name != "trimmed") <= 0.10

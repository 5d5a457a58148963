"""The RLOO paper's Table 1, HH rows, at Pythia-6.9B or the Llama-7B shape (configs/hh.py's setting).

Every row spends the same 512 completions per rollout batch: the k-sample methods (RLOO and
RAFT, k = 2 and 4) take 512 / k prompts, the single-sample ones (REINFORCE with a moving-average
baseline, Vanilla PG, PPO with its critic) 512 prompts x 1. DPO trains offline on the human
preferences (dpo.pairs='dataset': HH's chosen / rejected dialogues, as the paper's DPO did). All rows
start from the same SFT checkpoint and optimise the same reward model, given by --config_arg;
evaluate each run the paper's way with `python -m rloo_jax.winrate` (docs/EVALUATION.md).

    python experiments/sweep.py --sweep=configs/sweeps/table1_hh.py --root=/runs/table1_hh_6.9b \
        --config_arg=model=/ckpt/pythia-6.9b-hh-sft,rm=/ckpt/pythia-6.9b-hh-rm
    # Llama-7B: the same with its checkpoints; --dry_run lists the runs
"""
import importlib.util
import os

CONFIG = "configs/hh.py"
# The rows, budget and seeds are table1_tldr.py's: the two tables differ only in their config.
_spec = importlib.util.spec_from_file_location(
    "table1_tldr", os.path.join(os.path.dirname(os.path.abspath(__file__)), "table1_tldr.py"))
_tldr = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_tldr)
SEEDS, COMMON, get_sweep = _tldr.SEEDS, _tldr.COMMON, _tldr.get_sweep

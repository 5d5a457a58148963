r"""The RLOO paper's TL;DR summarisation setting (Ahmadian et al. 2024; Stiennon et al. 2020 data).

Planned for: 8 x 80 GB (H100 / A100 / H200) at Pythia-6.9B, fsdp over all 8, bf16 activations,
float32 master weights and Adam state; `python -m rloo_jax.plan` of `model=pythia-6.9b` fits
there (figures in docs/SCALE.md, "The paper's configs"). Pythia-1B and 2.8B fit the same mesh
with room to spare.

The paper's hyperparameters: beta 0.03 (KL in the reward, summed over tokens), 512 completions
per rollout batch in 2 optimizer steps of 256, one epoch, lr 1e-6 constant after a 3% warm-up,
k = 2 or 4, 600 iterations; prompts over 448 tokens are dropped (and counted) when the dataset is
prepared. Completions stop at 53 new tokens (the length TRL's TL;DR recipes use).

    # plan it (no weights, no data):
    python -m rloo_jax.plan --config=configs/tldr.py:model=pythia-6.9b --devices=8
    # train: the SFT policy and the reward model are local checkpoints (or hub ids)
    python -m rloo_jax.train --config=configs/tldr.py:model=/ckpt/pythia-6.9b-tldr-sft,k=4,rm=/ckpt/pythia-6.9b-tldr-rm \
        --workdir=/runs/tldr_rloo_k4
    # offline data: --config.data.source_dir=<dir with train.jsonl, valid.jsonl, test.jsonl>
    # CPU smoke run (tiny random GPT-NeoX checkpoint and TL;DR-format files from tests/fixtures):
    python -m rloo_jax.train --config=configs/tldr.py:smoke --workdir=/tmp/tldr_smoke

Evaluation the paper's way (greedy win rate against the reference summaries, at the checkpoint
with the best held-out reward): `python -m rloo_jax.winrate --workdir=... --judge=...`
(docs/EVALUATION.md). Table 1's rows: configs/sweeps/table1_tldr.py.
"""
from rloo_jax.config_utils import paper_rlhf_config


def get_config(arg=None):
  return paper_rlhf_config(arg, task="tldr", beta=0.03, max_prompt_len=448, max_new_tokens=53,
                           smoke_prompt_len=52,
                           # The human comparisons DPO trains on with dpo.pairs='dataset' ('' = all
                           # of them).
                           comparison_batches="", smoke_data=dict(comparison_batches="batch3"))

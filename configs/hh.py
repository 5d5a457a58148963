r"""The RLOO paper's Anthropic-HH dialogue setting (Ahmadian et al. 2024; Bai et al. 2022 data).

Planned for: 8 x 80 GB (H100 / A100 / H200) at Pythia-6.9B and at the Llama-7B shape
(`model=llama-2-7b`), fsdp over all 8, bf16 activations, float32 master weights and Adam state;
`python -m rloo_jax.plan` of either fits there (docs/SCALE.md, "The paper's configs").

The paper's hyperparameters: beta 0.10, 512 completions per rollout batch in 2 optimizer steps
of 256, one epoch, lr 1e-6 constant after a 3% warm-up, k = 2 or 4, 600 iterations; the prompt
is the conversation up to its last Assistant turn, prompts over 348 tokens dropped (and counted)
when the dataset is prepared. Completions stop at 128 new tokens.

    # plan it (no weights, no data):
    python -m rloo_jax.plan --config=configs/hh.py:model=pythia-6.9b --devices=8
    # train: the SFT policy and the reward model are local checkpoints (or hub ids)
    python -m rloo_jax.train --config=configs/hh.py:model=/ckpt/pythia-6.9b-hh-sft,k=4,rm=/ckpt/pythia-6.9b-hh-rm \
        --workdir=/runs/hh_rloo_k4
    # offline data: --config.data.source_dir=<dir with helpful-base/train.jsonl.gz, ...>
    # CPU smoke run (tiny random GPT-NeoX checkpoint and HH-format files from tests/fixtures):
    python -m rloo_jax.train --config=configs/hh.py:smoke --workdir=/tmp/hh_smoke

Evaluation the paper's way (greedy win rate against the chosen responses, at the checkpoint
with the best held-out reward): `python -m rloo_jax.winrate --workdir=... --judge=...`
(docs/EVALUATION.md). Table 1's rows: configs/sweeps/table1_hh.py.
"""
from rloo_jax.config_utils import paper_rlhf_config


def get_config(arg=None):
  return paper_rlhf_config(arg, task="hh", beta=0.10, max_prompt_len=348, max_new_tokens=128,
                           smoke_prompt_len=40,
                           # The four HH subsets the paper trains on (rloo_jax.data.hh.SUBSETS); a
                           # comma list narrows them.
                           hh_subsets="", smoke_data=dict(hh_subsets="helpful-base"))

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
import os

from rloo_jax.config_utils import FIXTURES, base_config, parse_arg, reward_model_spec, set_model

ROLLOUT_COMPLETIONS = 512  # per rollout batch, all methods (k samples of 512 / k prompts)
ITERATIONS = 600


def get_config(arg=None):
  arg = parse_arg(arg, model="pythia-6.9b", k=2, rm="", smoke=False, lora=0, seed=0)
  c = base_config()
  c.seed = arg.seed
  c.task = "tldr"
  set_model(c, arg.model)
  c.model.update(dtype="bfloat16", remat="full")
  c.model.lora.rank = arg.lora
  c.sft.steps = 0  # the policy starts from the SFT checkpoint of init_from
  # comparison_batches: the human comparisons DPO trains on with dpo.pairs='dataset' ('' = all).
  c.data.update(max_prompt_len=448, chat_template="", comparison_batches="")
  c.rloo.update(k=arg.k, num_prompts=ROLLOUT_COMPLETIONS // arg.k, max_new_tokens=53,
                temperature=1.0, trim_bucket=16)
  c.kl.update(beta=0.03, estimator="k1", reduction="sum")
  c.loss.update(type="reinforce")
  steps = ITERATIONS * 2  # 2 optimizer steps (minibatches of 256 completions) per iteration
  c.optim.update(learning_rate=1e-6, warmup_steps=int(0.03 * steps), schedule="constant",
                 max_grad_norm=1.0)
  c.train.update(num_iterations=ITERATIONS, num_epochs=1, num_minibatches=2,
                 microbatch_size=8, eval_every=50, eval_prompts=512, eval_batch_size=64,
                 checkpoint_every=50, keep_checkpoints=3)
  c.rewards.fns = [reward_model_spec(arg.rm)]
  c.rewards.weights = [1.0]
  c.mesh.update(data=1, fsdp=-1)

  if arg.smoke:  # tiny random checkpoint + TL;DR-format files: end to end on CPU in seconds
    if arg.model == "pythia-6.9b":
      set_model(c, os.path.join(FIXTURES, "hf", "gpt_neox"))
    c.rewards.fns = [reward_model_spec(arg.rm or os.path.join(FIXTURES, "hf_rm", "gpt_neox"),
                                       tokenizer=os.path.join(FIXTURES, "hf", "gpt_neox"),
                                       batch_size=4)]
    c.model.dtype = "float32"
    c.data.update(source_dir=os.path.join(FIXTURES, "tldr"), max_prompt_len=52,
                  comparison_batches="batch3")
    c.rloo.update(num_prompts=4, max_new_tokens=8, trim_bucket=8)
    c.optim.update(learning_rate=1e-4, warmup_steps=1)
    c.train.update(num_iterations=2, num_minibatches=2, microbatch_size=0, eval_every=1,
                   eval_prompts=8, eval_batch_size=4, checkpoint_every=1, progress_bar=False)
  return c

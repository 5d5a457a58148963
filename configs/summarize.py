r"""TL;DR in miniature: SFT -> preference pairs -> reward model -> RLOO, judged by a hidden gold reward.

The embedded summarisation task (`rloo_jax.data.summarize`; its gold reward is
`rloo_jax.rewards.summarize_gold`): a prompt is a short bag-of-words
"document", a good completion lists its key words once, in order. A small Llama-shaped policy is
fine-tuned on imperfect human-style summaries: a systematic habit (70% open with the filler word
"the", so even the SFT policy's greedy summaries carry it) plus random slips. Its samples, labelled
by the gold reward with Bradley-Terry noise, train a reward model initialised from the SFT policy
(as in the paper); RLOO then optimises that learned reward, and evaluation judges with the gold
reward.

The whole RLHF pipeline (one command, 4.5-7.5 minutes on a 2-core CPU, depending on its load):

    python experiments/rlhf_pipeline.py --config=configs/summarize.py --workdir=/tmp/rlhf
    python experiments/rlhf_pipeline.py --config=configs/summarize.py:smoke --workdir=/tmp/rlhf_s

RLOO directly on the gold reward (the oracle the learned reward approximates), with the trainer:

    python -m rloo_jax.train --config=configs/summarize.py --workdir=/tmp/sum_gold

Any override: `--config.kl.beta=0.1 --config.rlhf.bt_temperature=0.05`.
"""
import ml_collections

from rloo_jax.config_utils import base_config, parse_arg


def get_config(arg=None):
  arg = parse_arg(arg, smoke=False, k=4, seed=0)
  c = base_config()
  c.seed = arg.seed
  c.task = "summarize"
  # Documents are <= 16 words: a prompt is <= 19 word tokens with bos; summaries are ~1-6 words.
  # The demonstrator's habit and slips are SummarizeConfig defaults (rloo_jax/data/summarize.py);
  # the dataset directory is named by them, but the sft/ and pairs/ caches are not: after changing
  # them, use a fresh workdir.
  c.data.update(num_train=4000, num_test=256, min_keys=1, max_keys=3, max_prompt_len=20)
  c.model.update(max_seq_len=32)
  c.sft.update(steps=600, batch_size=64, learning_rate=3e-3, warmup_steps=50, log_every=100)
  c.rloo.update(k=arg.k, num_prompts=32, max_new_tokens=8)
  c.kl.beta = 0.1
  c.optim.update(learning_rate=3e-4, warmup_steps=5)
  c.train.update(num_iterations=60, num_epochs=2, eval_every=20, eval_prompts=256,
                 eval_batch_size=128, checkpoint_every=20)
  # `python -m rloo_jax.train` on this config optimises the gold reward itself; the RLHF pipeline
  # replaces this entry with the learned reward model's scorer.
  c.rewards.fns = ["rloo_jax.rewards.summarize_gold:gold_reward"]
  c.rewards.weights = [1.0]

  # The RLHF stages between SFT and RLOO (read by rloo_jax.rlhf, and by DPO with dpo.pairs='rlhf').
  c.rlhf = ml_collections.ConfigDict(dict(
      # The hidden labeller: judges pairs and the final evaluation, never seen by the policy.
      gold_reward="rloo_jax.rewards.summarize_gold:gold_reward",
      # Preference pairs: two distinct SFT samples per training prompt, labelled by the gold
      # reward with Bradley-Terry noise P(a > b) = sigmoid((gold_a - gold_b) / bt_temperature).
      # Up to pairs_per_prompt disjoint pairs of distinct samples per prompt.
      num_pair_prompts=3000, samples_per_prompt=4, pairs_per_prompt=2, sample_temperature=1.0,
      bt_temperature=0.1, eval_pair_fraction=0.1, sample_batch_size=256,
      # Reward model: the SFT backbone with a fresh scalar head, Bradley-Terry loss.
      rm_steps=400, rm_batch_size=32, rm_learning_rate=1e-3, rm_warmup_steps=20,
      rm_weight_decay=0.0, rm_log_every=100,
      # Scorer: whitening with mean/std of the RM's scores of SFT samples; clip after whitening
      # (0 = no clipping); fixed scoring batch so rollouts of any size reuse one compile.
      whiten=True, clip=5.0, score_batch_size=128,
      # Evaluation of the policy's greedy completions on held-out prompts, every eval_every RLOO
      # iterations (the gold-vs-proxy curve) and at the end.
      eval_prompts=256, eval_every=10))

  if arg.smoke:  # everything shrunk: the whole pipeline in well under a minute (tests use this)
    c.data.update(num_train=192, num_test=16)
    c.model.update(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                   intermediate_size=64)
    c.sft.update(steps=20, batch_size=16, log_every=10)
    c.rloo.update(num_prompts=4, max_new_tokens=8)
    c.train.update(num_iterations=2, eval_every=2, eval_prompts=16, eval_batch_size=16,
                   checkpoint_every=1, progress_bar=False)
    # Pair sampling with the rollouts' shapes and temperature reuses their compiled sampler.
    c.rlhf.update(num_pair_prompts=64, sample_batch_size=4, sample_temperature=1.0, rm_steps=10,
                  rm_batch_size=16, rm_log_every=5, score_batch_size=16, eval_prompts=16,
                  eval_every=1)
  return c

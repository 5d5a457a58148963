r"""GSM8K with a verifiable reward: veRL's RLOO example, and a single-device variant.

`get_config("model=...,single,colab,lora=16,k=5,smoke")`:

- default: veRL's `examples/rloo_trainer/run_qwen2-7b.sh`. Qwen2-7B-Instruct, 1024 prompts x
  k=5 x (512 prompt + 1024 response), mini-batch 256 prompts (4 optimizer steps per rollout, one
  epoch), lr 1e-6, KL 0.001 in the reward, gradient checkpointing. Planned for: 8 x 80 GB (H100 /
  H200), fsdp over all 8, bf16 activations, float32 master weights and Adam state, the rollout in
  chunks of 256 prompts, microbatches of 8 prompts (40 rows). Where veRL recomputes each layer,
  the update keeps the layers' matmul outputs (remat='dots'): 15% fewer FLOPs an iteration, and
  `python -m rloo_jax.plan` still fits it in 72 GiB of each device (docs/SCALE.md, "The paper's
  configs"), as it does the decode on layers gathered once a rollout instead of at every token
  (decode_layers='unstacked'). `single` and `colab` recompute whole layers (remat='full'): they
  need the room.
- `single`: Qwen2.5-0.5B-Instruct on ONE 80 GB device (H100 / H200), 128 prompts x k=5 x
  (512 + 1024), 2 optimizer steps per rollout; full fine-tuning, or LoRA with `lora=<rank>`.
- `colab`: `single`'s model at the shapes of the Colab notebook (notebooks/gsm8k.ipynb) on the
  free accelerator (a 15 GB T4, or a TPU): 32 prompts x k=4 x (256 + 256), 30 iterations of 2
  optimizer steps, microbatches of 8 prompts, 128 held-out prompts before and after. Planned,
  not run here (no network or accelerator on the machine this was written on).
- `k`: samples per prompt; 0 (default) takes the variant's own: 5 (veRL's), 4 with `colab`.

The reward is `rloo_jax.rewards.verifiers:gsm8k` (the final number, after '####' when present,
else the last number, against the reference's); `gsm8k_format` is a separate optional reward.
Instruct checkpoints get their chat template (data.chat_template='auto').

    python -m rloo_jax.plan --config=configs/gsm8k.py:model=qwen2-7b --devices=8 --device_memory_gb=72
    python -m rloo_jax.plan --config=configs/gsm8k.py:single,model=qwen2.5-0.5b --devices=1
    python -m rloo_jax.plan --config=configs/gsm8k.py:colab,model=qwen2.5-0.5b,lora=16 --devices=1 \
        --device_memory_gb=15 --config.model.dtype=float32   # a T4: no bfloat16 arithmetic
    python -m rloo_jax.train --config=configs/gsm8k.py:single,model=Qwen/Qwen2.5-0.5B-Instruct,lora=16 \
        --workdir=/runs/gsm8k_05b_lora
    # offline data: --config.data.source_dir=<dir with train.jsonl and test.jsonl>
    python -m rloo_jax.train --config=configs/gsm8k.py:smoke --workdir=/tmp/gsm8k_smoke
"""
import os

from rloo_jax.config_utils import FIXTURES, base_config, parse_arg, set_model


def get_config(arg=None):
  arg = parse_arg(arg, model="", single=False, colab=False, k=0, lora=0, smoke=False, seed=0)
  single = arg.single or arg.colab  # colab is single's job, shrunk
  c = base_config()
  c.seed = arg.seed
  c.task = "gsm8k"
  set_model(c, arg.model or ("Qwen/Qwen2.5-0.5B-Instruct" if single
                             else "Qwen/Qwen2-7B-Instruct"))
  c.model.update(dtype="bfloat16", remat="full")
  c.model.lora.rank = arg.lora
  c.sft.steps = 0  # an instruct checkpoint: RL from it directly
  c.data.update(max_prompt_len=512, chat_template="auto")
  c.rloo.update(k=arg.k or (4 if arg.colab else 5), num_prompts=1024, max_new_tokens=1024,
                temperature=1.0, trim_bucket=64, rollout_chunk_prompts=256)
  c.kl.update(beta=0.001, estimator="k1", reduction="sum")
  c.optim.update(learning_rate=1e-6, warmup_steps=0, schedule="constant")
  # veRL's run: 15 epochs of its 7473 training prompts at 1024 a batch.
  c.train.update(num_iterations=15 * 7473 // 1024, num_epochs=1, num_minibatches=4,
                 microbatch_size=8, eval_every=10, eval_prompts=1319, eval_batch_size=128,
                 checkpoint_every=10, keep_checkpoints=3)
  c.rewards.fns = ["rloo_jax.rewards.verifiers:gsm8k"]
  c.rewards.weights = [1.0]
  c.mesh.update(data=1, fsdp=-1)

  if not single:
    c.model.remat = "dots"
    if not arg.lora:  # every layer gathered once a rollout, not at every token
      c.rloo.decode_layers = "unstacked"
  if single:
    c.rloo.update(num_prompts=128, rollout_chunk_prompts=0)
    c.train.update(num_minibatches=2, microbatch_size=16,
                   num_iterations=2 * 7473 // 128)
    if arg.lora:
      c.optim.learning_rate = 1e-5  # adapters start at zero and take a larger step

  if arg.colab:
    # GSM8K questions are mostly under 100 tokens, the chat template adds about 30; any over
    # 256 are dropped (and counted in the log). 256 new tokens cut the longest worked answers,
    # which then score 0: the reward itself pushes towards answers that finish.
    c.data.max_prompt_len = 256
    c.rloo.update(num_prompts=32, max_new_tokens=256, trim_bucket=32)
    # Microbatches of 8 prompts (32 rows) divide over a TPU's 8 cores as well as one T4.
    c.train.update(num_iterations=30, num_minibatches=2, microbatch_size=8, eval_every=0,
                   eval_prompts=128, eval_batch_size=64, checkpoint_every=10,
                   keep_checkpoints=1)
    if arg.lora:
      # 30 iterations are 60 optimizer steps: 1e-5 would barely move rank-16 adapters from
      # zero in that many. Not tuned; LoRA RL is usually run 5-10x above full fine-tuning.
      c.optim.learning_rate = 5e-5

  if arg.smoke:  # tiny random Qwen2 checkpoint + GSM8K-format files: end to end on CPU
    if not arg.model:
      set_model(c, os.path.join(FIXTURES, "hf", "qwen2"))
    c.model.dtype = "float32"
    c.data.update(source_dir=os.path.join(FIXTURES, "gsm8k_tiny"), max_prompt_len=24,
                  chat_template="")
    c.rloo.update(num_prompts=4, max_new_tokens=8, trim_bucket=8, rollout_chunk_prompts=0,
                  decode_layers="auto")
    c.optim.update(learning_rate=1e-4)
    c.train.update(num_iterations=2, num_minibatches=1, microbatch_size=0, eval_every=1,
                   eval_prompts=8, eval_batch_size=4, checkpoint_every=1, progress_bar=False)
  return c

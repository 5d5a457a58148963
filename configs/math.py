r"""Competition math with long reasoning traces: DeepScaleR's first stage under RLOO, and a smoke
run.

`get_config("model=...,max_new_tokens=...,k=...,lora=...,smoke")`:

- default: DeepScaleR-1.5B-Preview's first, 8K-token stage (Luo et al. 2025, its veRL script):
  DeepSeek-R1-Distill-Qwen-1.5B, 128 problems x k = 8 x (1024 prompt + 8,192 response) sampled
  at temperature 0.6, 2 optimizer steps per rollout, lr 1e-6 constant. Here the update is RLOO's
  (REINFORCE, the leave-one-out baseline, KL 0.001 in the reward; `--config.loss.type=ppo_clip`
  for DeepScaleR's clipped ratio). bf16, remat full, fsdp over every device; packed updates
  (`train.microbatch_tokens='auto'`: the largest row budget each device holds, docs/SCALE.md
  "Long completions"), the rollout engine streaming the batch through 32 problems' slots, the
  decode on layers gathered once a rollout (decode_layers='unstacked', as `rloo_jax.plan`
  advises: fewer all-gathers, and it fits).
  `max_new_tokens=16384` / `24576` are DeepScaleR's later stages.
- The reward is `rloo_jax.rewards.math_answer:math_answer?think=true` (math-verify: the \boxed{}
  answer after the thoughts against the reference, equal as mathematics; 0 where the thoughts
  never close, as DeepScaleR's; `pip install 'rloo_jax[math]'`). Every 50
  iterations the first 64 test problems (AIME 2024's 30 whole) are sampled 16 times each:
  pass@1 as DeepScaleR reports it (the mean over the 16), pass@k and maj@16.
- Data: JSONL files of `{"prompt": ..., "answer": ...}` (docs/YOUR_TASK.md), the prompt holding
  the problem and its instruction; the model's chat template is applied. DeepScaleR's
  training set with its instruction, for example:

    python -c "import json; [print(json.dumps({'prompt': r['problem'] + \" Let's think step by \
step and output the final answer within \\\\boxed{}.\", 'answer': r['answer']})) for r in \
json.load(open('deepscaler.json'))]" > train.jsonl

- `smoke`: the tiny random Qwen2 checkpoint on tests/fixtures/math_tiny: end to end on CPU.

    python -m rloo_jax.plan --config=configs/math.py:model=deepseek-r1-distill-qwen-1.5b \
        --target=h100-8 --device_memory_gb=72
    python -m rloo_jax.train --config=configs/math.py --workdir=/runs/deepscaler_8k \
        --config.data.jsonl_train=train.jsonl --config.data.jsonl_test=aime24.jsonl
    python -m rloo_jax.train --config=configs/math.py:smoke --workdir=/tmp/math_smoke
"""
import os

from rloo_jax.config_utils import FIXTURES, base_config, parse_arg, set_model


def get_config(arg=None):
  arg = parse_arg(arg, model="", max_new_tokens=8192, k=8, lora=0, smoke=False, seed=0)
  c = base_config()
  c.seed = arg.seed
  c.task = "jsonl"
  set_model(c, arg.model or "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B")
  c.model.update(dtype="bfloat16", remat="full")
  c.model.lora.rank = arg.lora
  c.sft.steps = 0  # a reasoning checkpoint: RL from it directly
  c.data.update(max_prompt_len=1024, chat_template="auto")
  c.rloo.update(k=arg.k, num_prompts=128, max_new_tokens=arg.max_new_tokens, temperature=0.6,
                rollout_chunk_prompts=32)
  c.kl.update(beta=0.001, estimator="k1", reduction="sum")
  c.optim.update(learning_rate=1e-5 if arg.lora else 1e-6, warmup_steps=0,
                 schedule="constant")
  # Evaluation streams 16 problems x 16 samples through the engine: the rollout's 256 slots.
  c.train.update(num_iterations=1000, num_epochs=1, num_minibatches=2, microbatch_tokens="auto",
                 eval_every=50, eval_prompts=64, eval_batch_size=16, eval_samples=16,
                 checkpoint_every=10, keep_checkpoints=3)
  # DeepScaleR's rule: a completion that never closes its thoughts (cut at the cap) scores 0.
  c.rewards.fns = ["rloo_jax.rewards.math_answer:math_answer?think=true"]
  c.rewards.weights = [1.0]
  c.mesh.update(data=1, fsdp=-1)
  if not arg.lora:  # the plan's advice: every layer gathered once a rollout, not at every token
    c.rloo.decode_layers = "unstacked"

  if arg.smoke:  # tiny random Qwen2 checkpoint + a few fraction sums: end to end on CPU
    if not arg.model:
      set_model(c, os.path.join(FIXTURES, "hf", "qwen2"))
    c.model.dtype = "float32"
    data = os.path.join(FIXTURES, "math_tiny")
    c.data.update(jsonl_train=os.path.join(data, "train.jsonl"),
                  jsonl_test=os.path.join(data, "test.jsonl"), max_prompt_len=24,
                  chat_template="")
    c.rloo.update(k=4, num_prompts=4, max_new_tokens=8, rollout_chunk_prompts=2)
    c.optim.learning_rate = 1e-4
    c.train.update(num_iterations=2, num_minibatches=1, microbatch_tokens=64, eval_every=1,
                   eval_prompts=4, eval_batch_size=4, eval_samples=4, checkpoint_every=1,
                   progress_bar=False)
  return c

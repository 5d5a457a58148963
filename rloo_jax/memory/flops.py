"""Model FLOPs of one RLOO iteration, from the architecture and the batch shape alone.

Matmuls count 2 FLOPs per multiply-add; attention is QK^T and AV, causal (half the square) where
the model masks causally. Generated tokens are counted at full length (max_new_tokens: the worst
case before trimming). The update is forward + backward = 3 x a forward, once per epoch (its
minibatches partition the rows, so epochs x minibatches steps see every row `num_epochs` times);
what rematerialisation recomputes in the backward is counted apart (`remat_recompute_flops`), as
model-FLOP utilisation figures leave it out.
"""

from __future__ import annotations


def matrix_params(m):
  """(trunk, head) parameters that are matmul weights per token: the head's are vocab x hidden;
  the trunk's every other weight but the embedding lookup (norms and biases are negligible)."""
  head = m.vocab_size * m.hidden_size
  trunk = m.num_params - m.vocab_size * m.hidden_size - (0 if m.tie_embeddings else head)
  return trunk, head


def _attn(m, q: int, kv: int) -> int:
  """QK^T and AV of q queries against kv keys, every layer and head."""
  return 4 * m.num_layers * m.num_heads * m.head_dim * q * kv


def scoring_forward_flops(m, num_prompts, prompt_len, k, new_tokens, shared_prefix):
  """(trunk matmuls, attention, head) of one forward over the rollout's rows, as the reference
  pass and the update run it: each [prompt | completion] without its last token, the head on
  the completion's positions only; with shared_prefix each prompt fed once for its k samples."""
  trunk, head = matrix_params(m)
  n, u = num_prompts * k, new_tokens - 1
  if shared_prefix:
    fed = num_prompts * prompt_len + n * u
    attention = (num_prompts * _attn(m, prompt_len, prompt_len) / 2
                 + n * (_attn(m, u, prompt_len) + _attn(m, u, u) / 2))
  else:
    fed = n * (prompt_len + u)
    attention = n * _attn(m, prompt_len + u, prompt_len + u) / 2
  return 2 * trunk * fed, attention, 2 * head * n * new_tokens


def rollout_flops(m, num_prompts, prompt_len, k, new_tokens, mode: str = "shared") -> float:
  """The sampler's FLOPs (`rloo_jax.sampler`, by its mode). The prefill applies the head at each
  prompt's last position only (the first token's distribution); each of the new_tokens - 1
  decode steps feeds one token per stream through trunk and head."""
  trunk, head = matrix_params(m)
  n, t = num_prompts * k, new_tokens
  prefilled = num_prompts if mode == "shared" else n
  prefill = (2 * trunk * prefilled * prompt_len + 2 * head * prefilled
             + prefilled * _attn(m, prompt_len, prompt_len) / 2)
  # Step s (1..T-1) feeds token s - 1, which attends to the prompt and the s tokens so far.
  decode = (2 * (trunk + head) * n * (t - 1)
            + n * sum(_attn(m, 1, prompt_len + s) for s in range(1, t)))
  return prefill + decode


def model_flops_per_iteration(m, num_prompts, prompt_len, k, new_tokens, shared_prefix=True,
                              num_epochs: int = 1, mode: str = "shared",
                              recompute_old: bool = False) -> dict:
  """{'rollout', 'reference', 'recompute', 'update'} model FLOPs of one iteration of a model
  with TransformerConfig `m` (matmuls and attention; rematerialisation excluded). 'recompute':
  the policy's forward of config.loss.old_logprobs='recompute' (`recompute_old`), else 0."""
  trunk, attention, head = scoring_forward_flops(m, num_prompts, prompt_len, k, new_tokens,
                                                 shared_prefix)
  forward = trunk + attention + head
  # LoRA: the frozen weights get no gradient, so the weight matmuls' backward is the input
  # gradient alone (2 x their forward, not 3); the attention products keep both gradients. The
  # rank-r adapters' own products are left out (under 1% at rank 16 on an 8B model).
  update = 2 * (trunk + head) + 3 * attention if getattr(m, "lora_rank", 0) else 3 * forward
  return {"rollout": rollout_flops(m, num_prompts, prompt_len, k, new_tokens, mode),
          "reference": forward, "recompute": forward if recompute_old else 0.0,
          "update": num_epochs * update}


def remat_recompute_flops(m, num_prompts, prompt_len, k, new_tokens, shared_prefix=True,
                          num_epochs: int = 1, remat: str = "none",
                          fused_head: bool = False) -> float:
  """What the update's backward recomputes: the head of every log-prob chunk
  (`loss.chunked_logprobs` checkpoints each chunk) unless `fused_head` (its gradient computed in
  the log-prob pass, `head_loss`; `update.TrainStep.fused_head`), the whole trunk forward with
  remat='full', the attention products with 'dots' (they have batch dimensions, so its policy
  does not save them). 'names' is counted as 'full', an upper bound: what it recomputes
  depends on the names kept."""
  trunk, attention, head = scoring_forward_flops(m, num_prompts, prompt_len, k, new_tokens,
                                                 shared_prefix)
  body = {"none": 0.0, "dots": attention, "full": trunk + attention,
          "names": trunk + attention}[remat]
  return num_epochs * ((0.0 if fused_head else head) + body)

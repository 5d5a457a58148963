r"""TRL's RLOOTrainer on the same workload as experiments/bench_step.py, for a side-by-side figure
(docs/PERFORMANCE.md "Against TRL and Tunix"), in its own virtual environment (TRL needs torch):

    bash experiments/setup_peer_venvs.sh trl
    .venv-trl/bin/python experiments/bench_trl_rloo.py --hidden 64 --layers 2
One JSON line: the median seconds per training step, each step including its generation.
"""
import argparse
import json
import statistics
import tempfile
import time

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, TrainerCallback
import trl

from workload import add_workload_flags  # experiments/workload.py


def make_tokenizer(vocab):
  words = {"<pad>": 0, "<bos>": 1, "<eos>": 2}
  words.update({f"t{i}": i for i in range(3, vocab)})
  tok = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>",
                                 eos_token="<eos>")


COMPLETION_WORDS = []  # each completion's word count (specials dropped by the decode excepted)


def synthetic_reward(prompts, completions, **kwargs):
  out = []
  for text in completions:
    COMPLETION_WORDS.append(len(text.split()))
    ids = [int(w[1:]) for w in text.split() if w.startswith("t") and w[1:].isdigit()]
    out.append(sum(i % 2 == 0 for i in ids) / len(ids) if ids else 0.0)
  return out


class StepTimer(TrainerCallback):
  def __init__(self):
    self.times, self._start = [], None

  def on_step_begin(self, args, state, control, **kwargs):
    self._start = time.perf_counter()

  def on_step_end(self, args, state, control, **kwargs):
    self.times.append(time.perf_counter() - self._start)


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  add_workload_flags(p, steps_help="timed steps after 2 warm-up steps")
  p.add_argument("--threads", type=int, default=2)
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                 help="bfloat16: TRL's bf16 mixed precision (torch CPU autocast)")
  p.add_argument("--fixed_length", type=int, default=0, choices=(0, 1),
                 help="1: end token suppressed (min_new_tokens): every completion --new_tokens")
  args = p.parse_args()
  torch.manual_seed(0)
  torch.set_num_threads(args.threads)

  tokenizer = make_tokenizer(args.vocab)
  model = LlamaForCausalLM(LlamaConfig(
      vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
      num_hidden_layers=args.layers, num_attention_heads=args.heads,
      num_key_value_heads=args.heads, max_position_embeddings=args.prompt_len + args.new_tokens,
      pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False))
  g = torch.Generator().manual_seed(0)
  steps = args.iterations + 2
  prompts = [" ".join(f"t{int(i)}" for i in torch.randint(3, args.vocab, (args.prompt_len,),
                                                         generator=g))
             for _ in range(args.prompts * steps)]
  with tempfile.TemporaryDirectory() as out:
    # TRL loads its reference model from the policy's path, so the policy goes through disk.
    model.save_pretrained(f"{out}/policy")
    tokenizer.save_pretrained(f"{out}/policy")
    config = trl.RLOOConfig(
        output_dir=out, per_device_train_batch_size=args.prompts * args.k,
        num_generations=args.k, max_completion_length=args.new_tokens, beta=0.05,
        num_iterations=1, steps_per_generation=1, max_steps=steps, learning_rate=3e-4,
        logging_steps=1000, save_strategy="no", report_to="none", use_cpu=True,
        bf16=args.dtype == "bfloat16",
        shuffle_dataset=False, temperature=1.0, seed=0, dataloader_num_workers=0,
        model_init_kwargs={"dtype": torch.float32},
        generation_kwargs={"min_new_tokens": args.new_tokens} if args.fixed_length else None)
    timer = StepTimer()
    t = trl.RLOOTrainer(model=f"{out}/policy", reward_funcs=[synthetic_reward], args=config,
                        train_dataset=Dataset.from_dict({"prompt": prompts}),
                        processing_class=tokenizer, callbacks=[timer])
    t.train()
  timed = timer.times[2:]
  print(json.dumps({
      "framework": "trl", "trl": trl.__version__, "torch": torch.__version__,
      "threads": torch.get_num_threads(), "config": vars(args),
      "params": sum(p.numel() for p in model.parameters()),
      "median_step_s": round(statistics.median(timed), 5), "steps_timed": len(timed),
      "mean_completion_words": round(statistics.mean(COMPLETION_WORDS), 3)}))


if __name__ == "__main__":
  main()

r"""Export a training run's policy as a Hugging Face checkpoint (rloo_jax.models.hf_export).

    python -m rloo_jax.export --workdir=/tmp/rloo_run --out=/tmp/rloo_run_hf
    python -m rloo_jax.export --workdir=/tmp/rloo_run --step=50 --out=/tmp/hf50 --dtype=float32
    python -m rloo_jax.export --workdir=/tmp/rloo_lora --out=/tmp/rloo_lora_peft --adapter
    python -m rloo_jax.export --reward_model=/tmp/rlhf/reward_model --out=/tmp/rm_hf

The output loads with `transformers.AutoModelForCausalLM.from_pretrained(out)`, vLLM and lm-eval.
The tokenizer files come from the checkpoint the run started from (config.model.init_from); a
run trained from scratch has a task tokenizer with no Hugging Face form, so only the weights and
configs are written. A LoRA run (config.model.lora.rank > 0) is exported with its adapters
merged into the base; with --adapter only the adapters are written, as a PEFT directory
(adapter_config.json, adapter_model.safetensors) for `peft.PeftModel.from_pretrained`. Prints
the written paths, one a line.

With --reward_model (a `reward_model:` directory, `RewardModelScorer.save`) the reward model is
written as a *ForSequenceClassification checkpoint with its tokenizer, which
`hf_reward_model:<out>` scores exactly as `reward_model:<dir>` does
(rloo_jax.rewards.hf_reward.export_reward_model).
"""

from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

from absl import app, flags, logging

_WORKDIR = flags.DEFINE_string("workdir", None, "a training run's directory (run_config.json)")
_REWARD_MODEL = flags.DEFINE_string("reward_model", None, "instead of --workdir: a reward-model "
                                    "directory (reward_model:<dir>) to export")
_STEP = flags.DEFINE_integer("step", None, "the checkpoint's step (default: the newest)")
_OUT = flags.DEFINE_string("out", None, "an empty or new directory for the Hugging Face files")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32", "float16"],
                           "the stored dtype of the weights")
_MAX_SHARD = flags.DEFINE_integer("max_shard_bytes", None,
                                  "split the weights into files of at most this many bytes "
                                  "(default: transformers' 5 GB)")
_ADAPTER = flags.DEFINE_bool("adapter", False, "a LoRA run: write only its adapters, as a PEFT "
                             "directory (default: the base with the adapters merged)")


def export(workdir: str, out: str, *, step: Optional[int] = None, dtype: str = "bfloat16",
           max_shard_bytes: Optional[int] = None, adapter: bool = False,
           log=print) -> list[str]:
  """Exports the policy of `workdir`'s checkpoint `step` (newest when None) into `out`.
  Returns the written paths. Errors say what is missing and how to fix it."""
  # Imported here so `--help` and flag errors do not wait for jax.
  import rloo_jax
  from rloo_jax.models import hf_export, peft_export

  workdir = os.path.abspath(os.path.expanduser(workdir))
  if not os.path.isfile(os.path.join(workdir, "run_config.json")):
    raise FileNotFoundError(f"--workdir={workdir} has no run_config.json; point it at a training "
                            "run's directory (the --workdir given to rloo_jax.train)")
  if not os.path.isdir(os.path.join(workdir, "checkpoints")):
    raise FileNotFoundError(f"--workdir={workdir} has no checkpoints/: the run saved none yet "
                            "(config.train.checkpoint_every); train longer or lower it")
  hf_export.check_out_dir(out)  # before the (slow) restore
  policy = rloo_jax.load_policy(workdir, step=step)
  # Before anything is written: a family or head without a mapping names itself.
  hf_export.check_exportable(policy.model_config)
  init_from = policy.config.model.get("init_from", "") or None
  if adapter:
    # float32, as trained (--dtype is the merged weights'): the adapters are small.
    paths = peft_export.save_adapter(policy.params, policy.model_config, out,
                                     base_model=init_from or "")
    log(f"exported the LoRA adapters of {workdir} step {policy.step} to {out}:", file=sys.stderr)
    for p in paths:
      log(p)
    return paths
  tok = policy.tokenizer
  kw = {} if max_shard_bytes is None else dict(max_shard_bytes=int(max_shard_bytes))
  paths = hf_export.save_pretrained(
      policy.params, policy.model_config, out, dtype=dtype, tokenizer_dir=init_from,
      bos_id=getattr(tok, "bos_id", None), eos_id=getattr(tok, "eos_id", None),
      pad_id=getattr(tok, "pad_id", None), **kw)
  if init_from is None:
    log(f"note: {workdir} trained from scratch (config.model.init_from is empty); its "
        f"{type(tok).__name__} has no Hugging Face tokenizer files, so none were written",
        file=sys.stderr)
  log(f"exported {workdir} step {policy.step} ({policy.model_config.family}, {dtype}) to {out}:",
      file=sys.stderr)
  for p in paths:
    log(p)
  return paths


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    # Orbax logs every file it reads at INFO, which would bury the paths printed here.
    logging.set_verbosity(logging.WARNING)
  try:
    if (_WORKDIR.value is None) == (_REWARD_MODEL.value is None):
      raise ValueError("pass exactly one of --workdir (a policy) and --reward_model")
    if _REWARD_MODEL.value is not None:
      from rloo_jax.rewards import hf_reward  # here: --help does not wait for jax
      for p in hf_reward.export_reward_model(_REWARD_MODEL.value, _OUT.value, dtype=_DTYPE.value,
                                             max_shard_bytes=_MAX_SHARD.value):
        print(p)
      return
    export(_WORKDIR.value, _OUT.value, step=_STEP.value, dtype=_DTYPE.value,
           max_shard_bytes=_MAX_SHARD.value, adapter=_ADAPTER.value)
  except (FileNotFoundError, FileExistsError, ValueError) as e:
    # The messages carry the fix; a traceback would bury it.
    sys.exit(f"rloo_jax.export: error: {e}")


if __name__ == "__main__":
  flags.mark_flags_as_required(["out"])
  app.run(main)

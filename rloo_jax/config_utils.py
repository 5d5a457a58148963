"""The base experiment config and `parse_arg` for `get_config(arg)` files (big_vision style).

Config files in configs/ call `base_config()` and override what their task needs:

    python -m rloo_jax.train --config=configs/arithmetic.py:smoke --workdir=/tmp/run \
        --config.rloo.k=2 --config.kl.beta=0.1
"""

from __future__ import annotations

import copy
import importlib.util
import os

from absl import logging
import ml_collections
from ml_collections import config_dict


def parse_arg(arg: str | None, lazy: bool = False, **spec):
  """Parses 'a=1,b=x,flag' into a ConfigDict typed by the defaults in `spec`.

  A bare name sets a bool to True. Unknown names are an error unless `lazy`.
  """
  out = ml_collections.ConfigDict(dict(spec))
  for item in filter(None, (arg or "").split(",")):
    name, eq, value = item.partition("=")
    if name not in spec:
      if not lazy:
        raise ValueError(f"unknown config argument {name!r}; known: {sorted(spec)}")
      out[name] = value
      continue
    default = spec[name]
    if not eq:
      if not isinstance(default, bool):
        raise ValueError(f"config argument {name!r} needs a value ({name}=...)")
      out[name] = True
    elif isinstance(default, bool):
      out[name] = value.lower() in ("1", "true", "yes", "y")
    else:
      out[name] = type(default)(value)
  return out


def load_config_file(path: str, arg: str | None = None) -> ml_collections.ConfigDict:
  """`get_config(arg)` of a config file, as `--config=path[:arg]` loads it: the one loader the
  command line, the sweep runner, the tests and the notebook share."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"no config file {path!r}")
  name = "rloo_jax_config_" + os.path.splitext(os.path.basename(path))[0]
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg or None)


def with_section_defaults(config, section: str, defaults) -> ml_collections.ConfigDict:
  """A copy of the config whose `config.<section>` holds every field of `defaults` (the
  config's own values win): an algorithm's optional section, completed once."""
  c = copy.deepcopy(config)
  with c.unlocked():
    if section not in c:
      c[section] = ml_collections.ConfigDict()
    for name, value in defaults.items():
      if name not in c[section]:
        c[section][name] = value
  return c


def sequence_length(config, *, with_eos: bool = False) -> int:
  """Tokens of one [prompt | completion] row (SFT's [prompt | answer] rows too): the context
  every stage must fit, the one place this sum is written. with_eos: one more, for the rows a
  reward model or DPO scores, where a completion cut at max_new_tokens gets an eos appended."""
  return int(config.data.max_prompt_len) + int(config.rloo.max_new_tokens) + int(with_eos)


def base_config() -> ml_collections.ConfigDict:
  """Every knob of the trainer with the paper's defaults (k = 4, REINFORCE, 2 gradient steps)."""
  c = ml_collections.ConfigDict()
  c.seed = 0
  # rloo (any estimator of the advantage registry) | ppo | dpo: `rloo_jax.algorithms`.
  c.algorithm = "rloo"

  c.task = "arithmetic"  # arithmetic | summarize | jsonl
  c.data = ml_collections.ConfigDict(dict(
      min_digits=1, max_digits=2, num_train=4500, num_test=256, data_seed=0,
      jsonl_train="", jsonl_test="",  # task=jsonl: prompts with optional answers
      prompt_field="prompt",  # task=jsonl: the field holding the prompt (or a line's `messages`)
      max_prompt_len=16, overlong="drop",
      # task=tldr / hh / gsm8k: a directory holding the public files under their source names
      # (offline), or '' to download them.
      source_dir="",
      # '' (prompts as they are) | 'auto' (the tokenizer's own) | a .jinja path: each prompt is
      # rendered as one user turn with add_generation_prompt=True (rloo_jax.data.chat).
      chat_template=""))

  # The policy. `init_from`: a local Hugging Face checkpoint directory, or '' to train the task's
  # own small model from scratch with the SFT stage below.
  c.model = ml_collections.ConfigDict(dict(
      init_from="", family="llama", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
      head_dim=32, intermediate_size=384, max_seq_len=32, dtype="float32", param_dtype="float32",
      # A name of rloo_jax.models.presets.PRESETS: a real checkpoint's architecture (and vocab)
      # without its weights, so a job at that scale plans and compiles with no download. The
      # family/hidden_size/... above are then ignored; init_from and a preset exclude each other.
      preset="",
      # Recomputation of each layer in the backward (rloo_jax.models.config.REMAT_POLICIES):
      # 'full' keeps only each layer's input for the backward and recomputes the rest; 'names'
      # keeps the comma-separated remat_names (of rloo_jax.models.config.CHECKPOINT_NAMES).
      remat="full", remat_names="",
      # The attention kernel (rloo_jax.models.attention_ops.IMPLEMENTATIONS): 'xla', einsums with
      # [S, S] scores; 'blockwise', flash-style blocks in O(S) memory (long completions);
      # 'splash', TPU's Pallas flash kernel; 'cudnn', cuDNN's (GPU, bfloat16, no soft-cap); neither
      # for packed rows; 'auto', where a query reads 4096 keys or more (a row; a group's prompt +
      # one completion) the platform's kernel where it holds the rows, else blockwise; xla below.
      attention="auto",
      # The frozen reference's storage dtype. '' = the activation dtype above: the reference only
      # runs forward, where its weights are cast to that dtype anyway (so nothing changes and a
      # bfloat16 run stores it in half the bytes); 'bfloat16' also halves it under float32
      # activations, at the cost of rounding its weights.
      ref_dtype="",
      # LoRA (rloo_jax.adapters, docs/LORA.md): rank 0 = off. Only the adapters train; the
      # reference is the frozen base with them off, so the base weights exist once.
      lora=ml_collections.ConfigDict(dict(rank=0, alpha=16.0, targets="q,k,v,o,gate,up,down"))))

  c.sft = ml_collections.ConfigDict(dict(
      steps=1500, batch_size=64, learning_rate=3e-3, warmup_steps=100, weight_decay=0.0,
      # Fraction of demonstrations that are wrong in a systematic way (the arithmetic task drops
      # carries): an imperfect demonstrator, so SFT plateaus and reward-driven RL has headroom.
      demo_error_rate=0.0, log_every=100,
      # A checkpoint every this many steps (and at the end): a killed SFT stage resumes there.
      checkpoint_every=250,
      # The SFT policy is cached in <workdir>/sft/<key>; '' keys it on every setting it depends
      # on (a changed config trains a new one). Sweeps set one key to share a single policy.
      cache_key=""))

  c.rloo = ml_collections.ConfigDict(dict(
      k=4, num_prompts=32, max_new_tokens=8, temperature=1.0, top_k=0, top_p=1.0,
      sampler_mode="shared",
      # After the rollout, completions are cut to the batch's longest, rounded up to a multiple
      # of this (0 = keep max_new_tokens): short answers do not pay for the longest allowed.
      trim_bucket=32,
      # Prompts whose streams decode at once (0 = the whole batch): smaller bounds the KV cache.
      # With rollout_engine (and rollout_slots 0, a shared sampler), the engine takes the whole
      # batch through a chunk's rollout_chunk_prompts * k slots, refilling a slot as its stream
      # ends, its phases reading the longest live stream's KV (False: the static sampler, chunk
      # by chunk, each step reading the cap's KV).
      rollout_chunk_prompts=0, rollout_engine=True,
      # The decode loop's layer weights (rloo_jax.sampler_args.decode_unstacked): 'scanned' scans
      # the stacked layers, under FSDP gathering each at every token; 'unstacked' gathers every
      # layer once a rollout and holds the whole model gathered while decoding (the memory plan
      # names it for an FSDP job when that fits); 'auto': unstacked on an unsharded GPU mesh.
      decode_layers="auto",
      # The continuous-batching engine (rloo_jax.engine): this many streams decode at once, a
      # slot refilled as its stream ends (0: the static sampler, the batch until its longest
      # stream ends); rollout_prefix_rows prompts' KV held for them (0: 2 * slots / k).
      rollout_slots=0, rollout_prefix_rows=0,
      # Its stream KV paged: a pool of this many pages of rollout_page_size slots, a page taken
      # as a stream's length reaches it and freed when it ends (0: each slot owns
      # max_new_tokens slots). At least one stream at the cap; short of pages, the oldest
      # streams go first and the youngest start again (the same tokens).
      rollout_pages=0, rollout_page_size=64,
      # DAPO's dynamic sampling (rloo_jax.dynamic_sampling): train only on groups whose rewards
      # differ, rolling out further prompt batches for them, at most this many rollouts a step.
      dynamic_sampling=False, dynamic_sampling_max_rounds=4))
  c.advantage = ml_collections.ConfigDict(dict(estimator="rloo", options={}))
  c.kl = ml_collections.ConfigDict(dict(beta=0.05, estimator="k1", reduction="sum"))
  c.loss = ml_collections.ConfigDict(dict(
      type="reinforce",  # reinforce (the paper's default) | ppo_clip | gspo | cispo
      clip_eps=0.2, clip_eps_high=0.0,  # 0 = same as clip_eps
      ratio_level="sequence", aggregation="sequence_sum",
      # The sampler-trainer gap's correction (loss.is_weights): none | tis | seq_tis | seq_mask
      # | icepop, the ratio's cap, and icepop's lower bound. Metrics under mismatch/ either way.
      is_correction="none", is_cap=2.0, is_low=0.5,
      # What the ratio losses divide by: 'sampler' (its recorded log-probs) | 'recompute' (the
      # trainer's, one more forward before the update; the sampler's are then the correction's).
      old_logprobs="sampler"))
  # Rewards: weighted sum of any number of functions named by import path.
  c.rewards = ml_collections.ConfigDict(dict(
      fns=["rloo_jax.rewards.verifiers:arithmetic_exact_match"], weights=[1.0],
      nan_policy="mask",
      # Seconds each reward call may take before the run stops naming it; 0 = no deadline (a
      # function that relies on signals, which only the main thread receives).
      timeout_s=600.0,
      # DAPO's overlong shaping (rewards/overlong.py): 0 below max_new_tokens - buffer, then
      # down to -penalty at the cap; buffer 0 = off.
      overlong_buffer=0, overlong_penalty=1.0))

  c.optim = ml_collections.ConfigDict(dict(
      learning_rate=3e-4, warmup_steps=10, schedule="constant", weight_decay=0.0, b1=0.9,
      b2=0.95, max_grad_norm=1.0))
  c.train = ml_collections.ConfigDict(dict(
      num_iterations=100, num_epochs=2, num_minibatches=1,
      # The reference and policy forwards compute each prompt once for its k samples (equal up to
      # float rounding; minibatches then hold whole groups). False: k separate [prompt | y] rows.
      shared_prefix=True,
      # Rows (prompts, i.e. whole groups, with shared_prefix) per microbatch of gradient
      # accumulation, over the global batch; 0 = the whole minibatch in one pass. A step's
      # gradient is the sum over its microbatches: this trades memory for passes, not the
      # algorithm (num_minibatches still sets the optimizer steps per epoch).
      microbatch_size=0,
      # Packed updates (rloo_jax/packing.py): a minibatch's groups packed into rows of this many
      # tokens, one row per batch shard a microbatch, so no column past a completion's end is
      # computed; the same gradient. At least max_prompt_len - 1 + max_new_tokens (a group that
      # fits no row is split, its prompt again in each row); needs shared_prefix and excludes
      # microbatch_size. 0 = off; 'auto': the largest that fits the device (memory/budget.py).
      microbatch_tokens=config_dict.FieldReference(0, field_type=object),
      # Sequence positions per chunk of the log-prob computation: [N, chunk, V] logits live at
      # once instead of [N, T, V], the largest activation at a 150k vocab.
      logprob_chunk_size=32,
      # A loss linear in the log-probs (loss.type='reinforce'): the head's gradient computed in
      # the log-prob pass, one pass over the head and its [N, chunk, V] logits instead of two
      # (rloo_jax/head_loss.py). The same gradient; False: autodiff's two passes, for A/B runs.
      fused_head_grad=True,
      # On accelerators, compile the programs at start-up and refuse a job that does not fit,
      # before the first rollout rather than an out-of-memory error hours in.
      check_memory=True,
      # Compiled programs persist here between starts: 'auto' = $XDG_CACHE_HOME/rloo_jax/xla
      # (~/.cache/rloo_jax/xla), a path, or '' (off); env JAX_COMPILATION_CACHE_DIR wins.
      compilation_cache_dir="auto",
      log_every=1, eval_every=25, eval_prompts=256, eval_batch_size=128,
      # Evaluation's pass@k and maj@n from n sampled completions a prompt (0: off); a sample is
      # correct when the first evaluation reward scores it at least eval_correct_at.
      eval_samples=0, eval_correct_at=1.0,
      checkpoint_every=25, keep_checkpoints=3, progress_bar=True,
      # Guards (docs/RELIABILITY.md): this many update steps in a row with a non-finite loss or
      # gradient (each skipped, the state unchanged) stop the run; so do this many iterations
      # in a row in which no sample could be scored.
      max_nonfinite_steps=3, max_unscorable_iterations=3,
      # Also log to this Weights & Biases project ('' = off; needs `pip install wandb`).
      wandb_project=""))
  # Device mesh: -1 takes the remaining devices. Logical model axes -> mesh axes.
  c.mesh = ml_collections.ConfigDict(dict(
      data=-1, fsdp=1, tensor=1,
      rules=[("batch", ("data", "fsdp")), ("vocab", "tensor"), ("embed", "fsdp"),
             ("mlp", "tensor"), ("q_heads", "tensor"), ("kv_heads", "tensor"),
             ("head_dim", None), ("norm", None)]))
  return c


# config.model settings that change how the same model is computed or stored, not what it
# computes: left out of the fingerprints of cached SFT policies and preference pairs.
# LoRA trains adapters on the same SFT start, so it shares that cache.
_LAYOUT_ONLY_MODEL_KEYS = ("remat", "remat_names", "attention", "ref_dtype", "lora")


def model_fingerprint(config) -> dict:
  """config.model as a cache key: without the layout-only settings, and without an unset
  preset, so a cache written before those keys existed still matches."""
  out = {k: v for k, v in config.model.to_dict().items() if k not in _LAYOUT_ONLY_MODEL_KEYS}
  if not out.get("preset"):
    out.pop("preset", None)
  return out


# The tiny random checkpoints and source-format files the `:smoke` variants of the paper's
# configs run on (the test suite runs each end to end on CPU).
FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests",
                        "fixtures")


def set_model(c: ml_collections.ConfigDict, model: str) -> None:
  """`model=` of the paper's configs: a preset name (rloo_jax.models.presets: the architecture
  alone, for `rloo_jax.plan`; training it asks for init_from) or a Hugging Face checkpoint (a
  local directory or hub id) for config.model.init_from."""
  from rloo_jax.models import presets  # pylint: disable=import-outside-toplevel
  if model in presets.PRESETS:
    c.model.preset, c.model.init_from = model, ""
  else:
    c.model.preset, c.model.init_from = "", model


def reward_model_spec(path: str, **options) -> str:
  """The `hf_reward_model:` reward spec (rloo_jax.rewards.registry) of a sequence-classification
  checkpoint; '' leaves the path for --config.rewards.fns to give (the spec then says so)."""
  query = "&".join(f"{k}={v}" for k, v in options.items())
  return f"hf_reward_model:{path}" + (f"?{query}" if query else "")


def paper_rlhf_config(arg, *, task: str, beta: float, max_prompt_len: int, max_new_tokens: int,
                      smoke_prompt_len: int, smoke_data=None, **data
                      ) -> ml_collections.ConfigDict:
  """The RLOO paper's RLHF setting shared by configs/tldr.py and configs/hh.py (which give the
  task, beta, the prompt cut and the completion length): a checkpoint policy (`model=`, with no
  SFT stage of its own) optimising a reward model (`rm=`); 512 completions per rollout batch
  (512 / k prompts) in 2 optimizer steps of 256, one epoch, lr 1e-6 constant after a 3% warm-up,
  600 iterations; bf16, fsdp over every device. The update keeps the layers' matmul outputs
  (remat='dots') and takes each minibatch whole (no microbatches), so it runs the trunk forward
  once fewer than with remat='full'; the decode gathers every layer once a rollout, not at every
  token (decode_layers='unstacked'). Both fit a 6.9B-7B model on 8 x 80 GB in the memory plan
  (`python -m rloo_jax.plan` prints its peaks, and what a bigger model should turn back).
  `data`: the task's own config.data fields.
  `smoke`: a tiny random GPT-NeoX checkpoint and reward model from tests/fixtures and the task's
  source-format files there (with `smoke_data` for what those files hold), for CPU."""
  arg = parse_arg(arg, model="pythia-6.9b", k=2, rm="", smoke=False, lora=0, seed=0)
  c = base_config()
  c.seed, c.task = arg.seed, task
  set_model(c, arg.model)
  c.model.update(dtype="bfloat16", remat="dots")
  c.model.lora.rank = arg.lora
  c.sft.steps = 0  # the policy starts from the SFT checkpoint of init_from
  c.data.update(max_prompt_len=max_prompt_len, chat_template="", **data)
  c.rloo.update(k=arg.k, num_prompts=PAPER_ROLLOUT_COMPLETIONS // arg.k,
                max_new_tokens=max_new_tokens, temperature=1.0,
                trim_bucket=16 if max_new_tokens <= 64 else 32)
  c.kl.update(beta=beta, estimator="k1", reduction="sum")
  c.loss.update(type="reinforce")
  steps = PAPER_ITERATIONS * 2  # 2 optimizer steps (minibatches of 256 completions) each
  c.optim.update(learning_rate=1e-6, warmup_steps=int(0.03 * steps), schedule="constant",
                 max_grad_norm=1.0)
  c.train.update(num_iterations=PAPER_ITERATIONS, num_epochs=1, num_minibatches=2,
                 microbatch_size=0, eval_every=50, eval_prompts=512, eval_batch_size=64,
                 checkpoint_every=50, keep_checkpoints=3)
  c.rewards.fns = [reward_model_spec(arg.rm)]
  c.rewards.weights = [1.0]
  c.mesh.update(data=1, fsdp=-1)
  # The decode gathers each layer once a rollout, not at every token (`memory.speedups`, whose
  # compile of it fits every model here); LoRA runs scan, unplanned that way.
  c.rloo.decode_layers = "scanned" if arg.lora else "unstacked"
  if arg.smoke:  # end to end on CPU in seconds
    if arg.model == "pythia-6.9b":
      set_model(c, os.path.join(FIXTURES, "hf", "gpt_neox"))
    c.rewards.fns = [reward_model_spec(arg.rm or os.path.join(FIXTURES, "hf_rm", "gpt_neox"),
                                       tokenizer=os.path.join(FIXTURES, "hf", "gpt_neox"),
                                       batch_size=4)]
    c.model.dtype = "float32"
    c.data.update(source_dir=os.path.join(FIXTURES, task), max_prompt_len=smoke_prompt_len,
                  **(smoke_data or {}))
    c.rloo.update(num_prompts=4, max_new_tokens=8, trim_bucket=8, decode_layers="auto")
    c.optim.update(learning_rate=1e-4, warmup_steps=1)
    c.train.update(num_iterations=2, num_minibatches=2, microbatch_size=0, eval_every=1,
                   eval_prompts=8, eval_batch_size=4, checkpoint_every=1, progress_bar=False)
  return c


PAPER_ROLLOUT_COMPLETIONS = 512  # per rollout batch, every method (k samples of 512 / k prompts)
PAPER_ITERATIONS = 600


# Architecture settings of config.model that a checkpoint's own config.json (or a preset)
# decides.
_ARCHITECTURE_KEYS = ("family", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                      "head_dim", "intermediate_size", "max_seq_len")


def warn_overridden(model_cfg, mcfg) -> None:
  """Says which config.model settings config.model.init_from's checkpoint (or
  config.model.preset) overrides: those set away from their base_config default (a default the
  user never touched is no news)."""
  defaults = base_config().model
  preset = model_cfg.get("preset", "")
  source, has = ((f"config.model.preset={preset}", "the preset has") if preset else
                 (f"config.model.init_from={model_cfg.init_from}", "the checkpoint has"))
  ignored = [f"config.model.{k}={model_cfg[k]!r} ({has} {getattr(mcfg, k)!r})"
             for k in _ARCHITECTURE_KEYS if k in model_cfg and model_cfg[k] != getattr(mcfg, k)
             and model_cfg[k] != defaults.get(k)]
  if ignored:
    logging.warning("%s sets the architecture; ignored: %s", source, "; ".join(ignored))

"""A trained or imported policy as a Python object: generate text, score completions.

    policy = rloo_jax.load_policy("/tmp/rloo_arith")      # a training workdir: newest checkpoint
    policy = rloo_jax.load_policy("/tmp/rloo_arith", step=50)
    policy = rloo_jax.load_policy("Qwen/Qwen2.5-0.5B")     # an HF directory or hub id
    policy.generate(["12+34="])                            # greedy, one string per prompt
    policy.generate(["12+34="], k=4, method=sampling.Temperature(1.0))  # 4 strings per prompt
    policy.logprobs(["12+34="], ["46"])                    # summed float32 log p(completion)

Both run the functions training runs, on the model's ModelFns: `sampler.sample` (what rollouts
and evaluations call), and for scoring `rollout.make_rows` -> `rollout.completion_logits` ->
`loss.token_logprobs` (what the reference pass calls), so a number printed here is the number
the trainer would have computed. One process only (a multi-host run's checkpoint still loads:
Orbax restores it onto this process's devices).

`rloo_jax.load_policy` loads this module on first use (`rloo_jax/__init__.py`), so that
`from rloo_jax import advantage` stays cheap.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
from flax import traverse_util
import ml_collections
import numpy as np

from rloo_jax import algorithms, policy_init, rollout, sampler, sampler_args, sampling
from rloo_jax import workdir as workdir_lib
from rloo_jax.checkpoint import Checkpointer
from rloo_jax.data import chat, pipeline
from rloo_jax.models import hf, transformer
from rloo_jax.rewards import RewardSet

DEFAULT_BATCH_SIZE = 16  # prompts per compiled call for an HF checkpoint (a workdir: its eval size)


def _check_texts(name: str, texts) -> list[str]:
  # A bare string would otherwise be iterated character by character.
  if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
    raise TypeError(f"{name} must be a list of strings, got {type(texts).__name__}")
  return list(texts)


def _bucket(n: int, minimum: int = 8) -> int:
  """Next power of two >= n: buffer widths come from few values, so few programs compile."""
  return max(minimum, 1 << max(0, int(n) - 1).bit_length())


def _pad_rows(x: np.ndarray, b: int) -> np.ndarray:
  """Repeats row 0 up to b rows, so a short last batch reuses the compiled batch shape."""
  return x if len(x) == b else np.concatenate([x, np.repeat(x[:1], b - len(x), axis=0)])


# Positions per chunk of the chunked log-probs (as config.train.logprob_chunk_size's default).
LOGPROB_CHUNK = 32


@functools.partial(jax.jit, static_argnums=0)
def _summed_logprobs(fns, params, prompt_tokens_bp, prompt_lengths_b, completions_bt, cmask_bt):
  """[B] float32 sum of log p(completion token | prompt, earlier tokens): the rows and forward of
  the trainer's non-shared-prefix layout (one [left-padded prompt | completion] row each)."""
  rows = rollout.make_rows(prompt_tokens_bp, prompt_lengths_b, completions_bt, cmask_bt,
                           jnp.zeros(completions_bt.shape, jnp.float32), k=1, shared_prefix=False)
  logp_bt = rollout.logprobs(rows, fns, params, chunk_size=LOGPROB_CHUNK)[0]
  return jnp.sum(logp_bt, axis=-1)


class Policy:
  """A policy's parameters, model functions and tokenizer, with text in and text out.

  Attributes: `fns` (ModelFns), `params`, `tokenizer`, `model_config`, `max_seq_len`, and where it
  came from: `path`, `step` (the checkpoint's iteration; None for HF), `config` and `experiment`
  (the run's ml_collections config and `experiment.Experiment`; None for HF), `run_method` (the
  run's training sampling method; Greedy for HF).
  """

  def __init__(self, fns, params, tokenizer, *, max_new_tokens: int,
               max_prompt_len: Optional[int] = None, batch_size: int = DEFAULT_BATCH_SIZE,
               sampler_mode: str = "shared", path: str = "", step: Optional[int] = None,
               config=None, experiment=None, run_method=None):
    self.fns, self.params, self.tokenizer = fns, params, tokenizer
    self.model_config = fns.config
    self.max_seq_len = int(fns.config.max_seq_len)
    self.max_new_tokens = int(max_new_tokens)
    # A workdir's config.data.max_prompt_len: prompts that fit are padded to exactly the width
    # evaluations use, so greedy text matches the Evaluator's (longer ones still work, bucketed).
    self.max_prompt_len = max_prompt_len
    self.batch_size = int(batch_size)
    self.sampler_mode = sampler_mode
    self.path, self.step, self.config, self.experiment = path, step, config, experiment
    self.run_method = run_method or sampling.Greedy()
    # The sampler needs integer ids: a tokenizer without EOS never stops early (-1 matches no
    # token), and one without pad pads with 0 (padding is masked everywhere).
    self._stops = rollout.stop_ids(tokenizer)
    self._pad = 0 if tokenizer.pad_id is None else int(tokenizer.pad_id)
    # The decode layout the run trained with (config.rloo.decode_layers); an HF checkpoint's
    # scans, as 'auto' does.
    self._decode = ({} if experiment is None else sampler_args.decode_options(experiment))

  def __repr__(self) -> str:
    c = self.model_config
    at = "" if self.step is None else f", step={self.step}"
    return (f"Policy({self.path!r}{at}: {c.family}, {c.num_layers} layers, hidden "
            f"{c.hidden_size}, context {c.max_seq_len})")

  def _encode_prompts(self, prompts: list[str], room: int):
    """Right-padded (tokens [N, P], lengths [N]) with BOS first, as the data pipeline and so the
    trainer encode them. P: the run's max_prompt_len when every prompt fits it, else the next
    power of two (capped to leave `room` new tokens in the context when it can)."""
    longest = max(len(chat.prompt_ids(self.tokenizer, p, add_bos=True)) for p in prompts)
    if self.max_prompt_len and longest <= self.max_prompt_len:
      width = int(self.max_prompt_len)
    else:
      width = max(longest, min(_bucket(longest), self.max_seq_len - room))
    tokens, lengths = pipeline.encode_prompts(prompts, self.tokenizer, width)
    if (lengths < 1).any():  # no BOS and no text: nothing to predict the first token from
      raise ValueError(f"prompt {int(np.argmin(lengths))} is empty and the tokenizer has no BOS")
    return tokens, lengths

  def _batches(self, n: int):
    """(batch number, start, stop, compiled batch size) over n rows."""
    b = min(self.batch_size, n)
    return [(i, lo, min(n, lo + b), b) for i, lo in enumerate(range(0, n, b))]

  def generate(self, prompts: Sequence[str], k: int = 1, method: Optional[sampling.Method] = None,
               max_new_tokens: Optional[int] = None, *, seed: int = 0):
    """Completions of each prompt: list[str] when k == 1, else list[list[str]] (k per prompt).

    `method`: a rloo_jax.sampling method, default Greedy() (k greedy copies are identical; pass
    e.g. sampling.Temperature(1.0) or `policy.run_method` to sample). `max_new_tokens`: default the
    run's config.rloo.max_new_tokens (an HF checkpoint: 64, at most half its context). Text is
    decoded as rollouts decode it (stops at EOS, special tokens dropped). Deterministic: batch i
    samples with fold_in(PRNGKey(seed), i), so equal arguments give equal text. More prompts
    than `batch_size` stream through the rollout engine's batch_size * k slots in one call, a
    slot refilled as its stream ends (config.rloo.rollout_engine), sampling with
    fold_in(PRNGKey(seed), 0); greedy text is the batches' text."""
    prompts = _check_texts("prompts", prompts)
    if not prompts:
      return []
    method = sampling.Greedy() if method is None else method
    t = int(max_new_tokens or self.max_new_tokens)
    tokens, lengths = self._encode_prompts(prompts, room=t)
    texts: list[str] = []
    batches = self._batches(len(prompts))
    slots = sampler_args.stream_slots(None if self.config is None else self.config.rloo,
                                      self.sampler_mode, batches[0][3], k)
    decode = dict(self._decode, slots=slots) if slots else self._decode
    if slots:  # one engine call, padded to whole batches
      batches = [(0, 0, len(prompts), batches[0][3] * len(batches))]
    for i, lo, hi, b in batches:
      out = sampler.sample(self.fns, self.params, _pad_rows(tokens[lo:hi], b),
                           _pad_rows(lengths[lo:hi], b),
                           jax.random.fold_in(jax.random.PRNGKey(seed), i), k=k,
                           max_new_tokens=t, method=method, eos_id=self._stops, pad_id=self._pad,
                           mode=self.sampler_mode, max_seq_len=self.max_seq_len, **decode)
      n = hi - lo
      texts += rollout.decode_completions(self.tokenizer,
                                          np.asarray(out.tokens_bkt)[:n].reshape(n * k, -1),
                                          np.asarray(out.lengths_bk)[:n].reshape(-1))
    return texts if k == 1 else [texts[j * k:(j + 1) * k] for j in range(len(prompts))]

  def logprobs(self, prompts: Sequence[str], completions: Sequence[str], *,
               add_eos: bool = False) -> list[float]:
    """log pi(completion | prompt) per pair: the float32 sum over the completion's tokens.

    The prompt is encoded as for `generate` (BOS first); the completion on its own, with no
    special tokens, exactly as the trainer tokenises a completion after its prompt (so a
    completion `generate` returned scores its sampled tokens whenever its text re-encodes to
    them). No EOS is appended unless `add_eos=True`: the default scores the text as a prefix
    that may continue; add_eos scores it as a finished answer (what a rollout that stopped
    scores, since EOS is part of its masked tokens). An empty completion scores 0.0."""
    prompts = _check_texts("prompts", prompts)
    completions = _check_texts("completions", completions)
    if len(prompts) != len(completions):
      raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    if not prompts:
      return []
    if add_eos and self.tokenizer.eos_id is None:
      raise ValueError("add_eos=True, but this tokenizer has no eos token")
    ids = [list(self.tokenizer.encode(c)) + ([int(self.tokenizer.eos_id)] if add_eos else [])
           for c in completions]
    longest = max(1, max(len(x) for x in ids))
    tokens, lengths = self._encode_prompts(prompts, room=longest)
    for i, (n, x) in enumerate(zip(lengths, ids)):
      if n + len(x) > self.max_seq_len:
        raise ValueError(f"pair {i}: prompt ({n} tokens) + completion ({len(x)} tokens) exceeds "
                         f"the model context of {self.max_seq_len} tokens")
    t = max(longest, min(_bucket(longest, 4), self.max_seq_len - tokens.shape[1]))
    comp = np.full((len(ids), t), self._pad, np.int32)
    cmask = np.zeros((len(ids), t), bool)
    for i, x in enumerate(ids):
      comp[i, :len(x)], cmask[i, :len(x)] = x, True
    out: list[float] = []
    for _, lo, hi, b in self._batches(len(prompts)):
      logp = _summed_logprobs(self.fns, self.params, *(_pad_rows(a[lo:hi], b) for a in
                                                       (tokens, lengths, comp, cmask)))
      out += [float(v) for v in np.asarray(logp)[:hi - lo]]
    return out


def config_from_workdir(workdir: str):
  """The run's ml_collections config, rebuilt from <workdir>/run_config.json's flat
  {'section.key': value} record (rloo_jax.workdir.flat_config). Values the record kept only
  as a repr (callables in config.rewards.fns) stay strings; loading never calls them."""
  with open(os.path.join(workdir, workdir_lib.CONFIG_FILE), encoding="utf-8") as f:
    flat = json.load(f)["config"]
  return ml_collections.ConfigDict(traverse_util.unflatten_dict(flat, sep="."))


def _no_reward(prompts, completions, **fields):
  del prompts, fields
  return np.zeros(len(completions), np.float32)


def _load_workdir(workdir: str, step: Optional[int]) -> Policy:
  config = config_from_workdir(workdir)
  ckpt_dir = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(ckpt_dir):
    raise FileNotFoundError(f"{workdir} has no checkpoints/ (the run saved none yet: see "
                            "config.train.checkpoint_every)")
  # The algorithm object, because its state is the restore target (PPO's holds a critic, DPO's
  # no estimator state). A placeholder reward set: a policy scores nothing, and the run's reward
  # functions (a reward model, a file that has since moved) need not load for it.
  algo = algorithms.make(config, workdir, rewards=RewardSet([_no_reward], [1.0], ["none"]),
                         log=lambda *a, **k: None)
  ckpt = Checkpointer(ckpt_dir)
  try:
    steps = ckpt.all_steps()
    if not steps:
      raise FileNotFoundError(f"{ckpt_dir} holds no checkpoint")
    if step is not None and int(step) not in steps:
      raise ValueError(f"no checkpoint of step {step} in {ckpt_dir}; saved steps: {steps}")
    restored = ckpt.restore(algo.abstract_state(), step=step)
  finally:
    ckpt.close()
  if restored is None:
    raise FileNotFoundError(f"no readable checkpoint in {ckpt_dir} (unreadable ones were moved "
                            "to checkpoints_corrupt/)")
  got, state, _ = restored
  if step is not None and got != int(step):
    raise ValueError(f"checkpoint {step} in {ckpt_dir} is unreadable (moved to "
                     f"checkpoints_corrupt/); the newest readable one before it is step {got}")
  exp = algo.exp
  # LoRA: the base that checkpoints leave out, the run's starting policy.
  state = algo.resume_state(state, lambda: policy_init.initial_params(exp))
  return Policy(exp.fns, algo.eval_params(state)[0], exp.tokenizer,
                max_new_tokens=config.rloo.max_new_tokens,
                max_prompt_len=config.data.max_prompt_len,
                batch_size=config.train.eval_batch_size, sampler_mode=config.rloo.sampler_mode,
                path=workdir, step=int(got), config=config, experiment=exp,
                run_method=exp.method)


def _load_hf(path_or_id: str, chat_template: str) -> Policy:
  local = hf.resolve_path(path_or_id, what="load_policy path")
  mcfg, graphdef, params = hf.load_model(local)
  tokenizer = chat.attach(hf.load_tokenizer(local), chat_template)
  return Policy(transformer.model_fns(graphdef), params, tokenizer,
                max_new_tokens=min(64, max(1, mcfg.max_seq_len // 2)), path=local)


def load_policy(path: str, step: Optional[int] = None, chat_template: str = "") -> Policy:
  """A `Policy` from a training workdir (one holding run_config.json: its newest checkpoint, or
  `step`'s), or from a Hugging Face checkpoint (a local directory or a hub id 'org/name',
  fetched through the hub cache: rloo_jax.models.hf.resolve_path). `chat_template` (an HF
  checkpoint; a workdir uses its run's config.data.chat_template): '', 'auto' or a .jinja path,
  as config.data.chat_template, rendering each prompt `generate` / `logprobs` get."""
  path = os.path.expanduser(os.fspath(path))
  if os.path.isfile(os.path.join(path, "run_config.json")):  # rloo_jax.workdir.CONFIG_FILE
    return _load_workdir(os.path.abspath(path), step)
  if step is not None:
    raise ValueError(f"step={step} names a checkpoint of a training workdir, but {path!r} has no "
                     "run_config.json (an HF checkpoint has one set of weights)")
  if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
    raise FileNotFoundError(f"{path} holds neither run_config.json (a training workdir) nor "
                            "config.json (a Hugging Face checkpoint)")
  return _load_hf(path, chat_template)

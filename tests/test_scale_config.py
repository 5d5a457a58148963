"""Real-scale settings: the architecture presets (against the published parameter counts), the
config keys for memory (microbatches, log-prob chunks, remat, reference dtype, rollout chunks)
and their validation messages, and which of them a resumed run may change."""
import logging
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import load_config
from rloo_jax import config_utils, experiment, models, workdir
from rloo_jax.models import config as model_config
from rloo_jax.models import presets

# Total parameters as published: the Qwen2.5 model cards (0.49B, 1.54B, 3.09B, 7.61B), the
# parameter counts of the hub pages (Qwen2-7B's 7.62B: Qwen2.5-7B's shapes; Llama's 8.03B,
# 1.24B, 3.21B) and the Pythia model cards' exact counts (the "total params" table).
PUBLISHED = {
    "qwen2.5-0.5b": 0.49e9, "qwen2.5-1.5b": 1.54e9, "qwen2.5-3b": 3.09e9,
    "qwen2.5-7b": 7.61e9, "qwen2-7b": 7.62e9, "llama-3-8b": 8.03e9, "llama-3.2-1b": 1.24e9,
    "llama-3.2-3b": 3.21e9, "pythia-160m": 162_322_944, "pythia-410m": 405_334_016,
    "pythia-1b": 1_011_781_632, "pythia-2.8b": 2_775_208_960, "pythia-6.9b": 6_857_302_016,
    # Qwen3's model cards: 0.6B (596,049,920 exact), 1.7B, 4.0B, 8.2B with embeddings.
    "qwen3-0.6b": 596_049_920, "qwen3-1.7b": 1.72e9, "qwen3-4b": 4.02e9, "qwen3-8b": 8.19e9,
    # The Gemma checkpoints' exact counts (tied embeddings, sandwich norms).
    "gemma-2-2b": 2_614_341_888, "gemma-2-9b": 9_241_705_984, "gemma-3-1b": 999_885_952,
    # Llama-3.1-70B's hub page: 70.6B. Llama-2-7B's exact count (6,738,415,616).
    "llama-3-70b": 70.6e9, "llama-2-7b": 6_738_415_616,
    # DeepSeek-R1-Distill-Qwen-1.5B's hub page: 1.78B (Qwen2.5-1.5B's with an untied head).
    "deepseek-r1-distill-qwen-1.5b": 1.78e9,
}


def _get(name, **overrides):
  """presets.get, skipping exactly when the preset's family is not implemented yet."""
  family = presets.PRESETS[name]["family"]
  if family not in model_config.FAMILIES:
    pytest.skip(f"model family {family!r} not in rloo_jax.models.config.FAMILIES yet")
  return presets.get(name, **overrides)


def test_every_required_preset_is_there():
  assert set(PUBLISHED) == set(presets.PRESETS)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_parameter_count_matches_the_published_one(name):
  cfg = _get(name)
  assert abs(cfg.num_params / PUBLISHED[name] - 1) < 0.01, (cfg.num_params, PUBLISHED[name])
  # hidden_size = heads x head_dim, except Qwen3's and Gemma's (128 / 256 at every size).
  if cfg.family not in ("qwen3", "gemma2", "gemma3"):
    assert cfg.num_heads * cfg.head_dim == cfg.hidden_size
  assert cfg.num_heads % cfg.num_kv_heads == 0


def test_exact_counts_and_the_config_json_numbers():
  # The exact sizes of the safetensors on the hub.
  assert presets.get("qwen2.5-0.5b").num_params == 494_032_768
  assert presets.get("qwen2.5-1.5b").num_params == 1_543_714_304
  assert presets.get("qwen2.5-7b").num_params == 7_615_616_512
  assert presets.get("llama-3-8b").num_params == 8_030_261_248
  for name in ("gemma-2-2b", "gemma-2-9b", "gemma-3-1b"):
    assert presets.get(name).num_params == PUBLISHED[name]
  q = presets.get("qwen2.5-1.5b")
  assert (q.family, q.hidden_size, q.num_layers, q.num_heads, q.num_kv_heads, q.head_dim,
          q.intermediate_size, q.vocab_size) == ("qwen2", 1536, 28, 12, 2, 128, 8960, 151936)
  assert q.qkv_bias and q.tie_embeddings and q.rope_theta == 1e6 and q.norm_eps == 1e-6
  big = presets.get("qwen2.5-7b")
  assert (big.vocab_size, big.tie_embeddings, big.num_kv_heads) == (152064, False, 4)
  llama = presets.get("llama-3-8b")
  assert (llama.family, llama.vocab_size, llama.max_seq_len, llama.rope_theta, llama.norm_eps,
          llama.qkv_bias, llama.tie_embeddings) == ("llama", 128256, 8192, 5e5, 1e-5, False, False)
  assert presets.get("llama-3.2-1b").tie_embeddings and presets.get("llama-3.2-1b").head_dim == 64
  pythia = presets.PRESETS["pythia-1b"]
  assert (pythia["family"], pythia["rotary_pct"], pythia["parallel_residual"],
          pythia["tie_embeddings"], pythia["vocab_size"]) == ("gpt_neox", 0.25, True, False, 50304)
  assert presets.PRESETS["pythia-6.9b"]["vocab_size"] == 50432


def test_preset_overrides_and_errors(monkeypatch):
  cfg = presets.get("qwen2.5-0.5b", dtype="bfloat16", remat="dots")
  assert (cfg.dtype, cfg.remat, cfg.hidden_size) == ("bfloat16", "dots", 896)
  with pytest.raises(TypeError):  # read-only: a preset is never changed by a caller
    presets.PRESETS["qwen2.5-0.5b"] = {}
  with pytest.raises(ValueError, match=r"unknown preset 'qwen2\.5-1\.5' \(did you mean "
                                       r"'qwen2\.5-1\.5b'\?\); choose one of \('qwen2\.5-0\.5b'"):
    presets.get("qwen2.5-1.5")
  with pytest.raises(ValueError, match=r"did you mean 'llama-3-8b'"):
    presets.get("llama3-8b")
  # A family missing from this build of models/config is named (as the pythia presets were
  # before GPT-NeoX landed).
  monkeypatch.setattr(model_config, "FAMILIES", ("llama", "gpt2"))
  with pytest.raises(ValueError, match=r"preset 'qwen2\.5-0\.5b' needs the model family "
                                       r"'qwen2', which rloo_jax\.models\.config does not"):
    presets.get("qwen2.5-0.5b")
  assert not presets.available("qwen2.5-0.5b") and presets.available("llama-3-8b")


def test_from_experiment_config_with_and_without_a_preset():
  m = load_config().model
  m.update(preset="llama-3.2-1b", dtype="bfloat16", remat="dots")
  cfg = presets.from_experiment_config(m, vocab_size=40)
  # The preset's architecture and vocab (not the task's 40 tokens); the config's dtype / remat.
  assert cfg == presets.get("llama-3.2-1b", dtype="bfloat16", remat="dots")
  assert cfg.vocab_size == 128256
  with pytest.raises(ValueError, match=r"config\.model\.preset='llama-3\.2-1b' embeds 128256 "
                                       r"tokens, fewer than the task tokenizer's vocab_size "
                                       r"200000"):
    presets.from_experiment_config(m, vocab_size=200_000)
  m.preset = ""
  cfg = presets.from_experiment_config(m, vocab_size=40)
  assert (cfg.vocab_size, cfg.hidden_size, cfg.remat) == (40, m.hidden_size, "dots")
  # A run_config saved before preset / remat existed still loads, as it ran then.
  with m.unlocked():
    del m["preset"], m["remat"]
  assert presets.from_experiment_config(m, vocab_size=40).remat == "none"


def _validate(**flat):
  config = load_config()
  config.update_from_flattened_dict(flat)
  experiment.validate_config(config)
  return config


@pytest.mark.parametrize("flat, message", [
    ({"model.preset": "qwen-2.5-7b"},
     r"unknown config\.model\.preset 'qwen-2\.5-7b' \(did you mean 'qwen2\.5-7b'\?\)"),
    ({"model.preset": "qwen2.5-0.5b", "model.init_from": "/ckpt"},
     r"both set the architecture; set one of config\.model\.preset / config\.model\.init_from"),
    ({"rloo.sampler_mode": "recompute"},
     r"unknown config\.rloo\.sampler_mode 'recompute'; choose one of \('shared', 'unshared'\)"),
    ({"model.remat_names": "query"}, r"remat_names is read only with remat='names'"),
    ({"model.attention": "flash"}, r"unknown config\.model\.attention 'flash'; choose one of"),
    ({"model.remat": "some"},
     r"unknown config\.model\.remat 'some'; choose one of \('none', 'full', 'dots', 'names'\)"),
    ({"model.ref_dtype": "fp8"},
     r"unknown config\.model\.ref_dtype 'fp8'; choose one of \('', 'bfloat16', 'float32'"),
    ({"train.microbatch_size": -1}, r"config\.train\.microbatch_size = -1 must be >= 0"),
    # 4 prompts, one minibatch, shared_prefix: microbatches of whole groups.
    ({"train.microbatch_size": 3},
     r"config\.train\.microbatch_size = 3 does not divide the minibatch's groups .* = 4; set "
     r"--config\.train\.microbatch_size to one of \[1, 2, 4\] \(or 0: the whole minibatch"),
    ({"train.microbatch_size": 3, "train.shared_prefix": False},
     r"microbatch_size = 3 does not divide the minibatch's rows .* = 16; set "
     r"--config\.train\.microbatch_size to one of \[1, 2, 4, 8, 16\]"),
    ({"train.microbatch_size": 4, "train.num_minibatches": 2},
     r"microbatch_size = 4 does not divide the minibatch's groups .* = 2;"),
    ({"train.logprob_chunk_size": 0}, r"config\.train\.logprob_chunk_size = 0 must be >= 1"),
    ({"rloo.trim_bucket": -8}, r"config\.rloo\.trim_bucket = -8 must be >= 0"),
    ({"rloo.rollout_chunk_prompts": -1}, r"config\.rloo\.rollout_chunk_prompts = -1 must be >= 0"),
    ({"rloo.rollout_chunk_prompts": 2, "rloo.sampler_mode": "unshared"},  # the engine's default
     r"config\.rloo\.rollout_engine .* set config\.rloo\.sampler_mode='shared' \(or "
     r"config\.rloo\.rollout_engine=False"),
    ({"rloo.rollout_slots": 8, "rloo.sampler_mode": "unshared"},
     r"config\.rloo\.rollout_slots \(the rollout engine\) .* set config\.rloo\.sampler_mode"),
    ({"rloo.rollout_chunk_prompts": 3},
     r"config\.rloo\.rollout_chunk_prompts = 3 does not divide config\.rloo\.num_prompts = 4; "
     r"set --config\.rloo\.rollout_chunk_prompts to one of \[1, 2, 4\] \(or 0: the whole batch"),
    ({"model.preset": "llama-3-8b", "data.max_prompt_len": 8000, "rloo.max_new_tokens": 500},
     r"= 8500 exceeds the context of config\.model\.preset='llama-3-8b', 8192 tokens"),
])
def test_validation_messages(flat, message):
  with pytest.raises(ValueError, match=message):
    _validate(**flat)


def test_valid_settings_pass_and_a_preset_sets_the_context():
  _validate(**{"train.microbatch_size": 2, "rloo.rollout_chunk_prompts": 2,
               "rloo.trim_bucket": 0, "model.remat": "none", "model.ref_dtype": "bfloat16"})
  _validate(**{"train.microbatch_size": 8, "train.shared_prefix": False})
  # 16 + 40 tokens exceed the config's own max_seq_len = 32 but not the preset's 32768.
  with pytest.raises(ValueError, match=r"exceeds the model context config\.model\.max_seq_len"):
    _validate(**{"rloo.max_new_tokens": 40})
  _validate(**{"rloo.max_new_tokens": 40, "model.preset": "qwen2.5-0.5b"})


def _layout(ways):
  return types.SimpleNamespace(batch_parallelism=ways, batch_axes=("data",),
                               mesh=types.SimpleNamespace(shape={"data": ways}))


def test_layout_checks_microbatches_in_rows_and_rollout_chunks():
  base = {"rloo.num_prompts": 8, "sft.batch_size": 16, "train.eval_batch_size": 16}
  experiment.validate_layout(_validate(**base, **{"train.microbatch_size": 2}), _layout(8))
  # shared_prefix: 1 prompt x k=4 samples = 4 rows per microbatch, over 8 ways.
  config = _validate(**base, **{"train.microbatch_size": 1})
  with pytest.raises(ValueError, match=r"the microbatch \(config\.train\.microbatch_size \* "
                                       r"config\.rloo\.k, in rows\) = 4 is not divisible by the "
                                       r"batch parallelism 8"):
    experiment.validate_layout(config, _layout(8))
  config = _validate(**base, **{"train.microbatch_size": 4, "train.shared_prefix": False})
  with pytest.raises(ValueError, match=r"the microbatch \(config\.train\.microbatch_size\) = 4 "
                                       r"is not divisible by the batch parallelism 8"):
    experiment.validate_layout(config, _layout(8))
  config = _validate(**base, **{"rloo.rollout_chunk_prompts": 4})
  with pytest.raises(ValueError, match=r"the rollout chunk \(config\.rloo\.rollout_chunk_prompts\)"
                                       r" = 4 is not divisible by the batch parallelism 8"):
    experiment.validate_layout(config, _layout(8))


def test_memory_settings_may_change_on_resume_and_the_math_may_not():
  saved = workdir.flat_config(load_config())
  changed = load_config()
  changed.update_from_flattened_dict({
      "train.microbatch_size": 2, "train.logprob_chunk_size": 64, "train.check_memory": False,
      "model.remat": "dots", "rloo.rollout_chunk_prompts": 2})
  assert workdir.config_differences(saved, workdir.flat_config(changed)) == []
  changed.update_from_flattened_dict({"model.ref_dtype": "bfloat16", "rloo.trim_bucket": 8,
                                      "model.preset": "qwen2.5-0.5b"})
  assert workdir.config_differences(saved, workdir.flat_config(changed)) == [
      "model.preset", "model.ref_dtype", "rloo.trim_bucket"]


def test_a_reward_specs_workers_and_batch_size_may_change_on_resume_and_its_scoring_may_not():
  def differences(before, after):
    saved, changed = load_config(), load_config()
    saved.rewards.fns, changed.rewards.fns = before, after
    return workdir.config_differences(workdir.flat_config(saved), workdir.flat_config(changed))
  math = "rloo_jax.rewards.math_answer:math_answer"
  assert differences([math + "?think=true&timeout_s=9"], [math + "?timeout_s=9&think=true"]) == []
  assert differences([math + "?think=true"], [math + "?workers=16&think=true"]) == []
  assert differences(["hf_reward_model:/rm?batch_size=8&dtype=bfloat16", math + "?workers=2"],
                     ["hf_reward_model:/rm?dtype=bfloat16&batch_size=64", math]) == []
  # What a sample scores, or which rewards score it, is the run's own.
  assert differences([math], [math + "?think=true"]) == ["rewards.fns"]
  assert differences([math + "?workers=2"], [math + "?workers=2&timeout_s=20"]) == ["rewards.fns"]
  assert differences([math, math], [math]) == ["rewards.fns"]


def test_a_preset_builds_with_its_architecture_and_warns_what_it_ignores(tmp_path, caplog):
  config = load_config()
  config.model.update(preset="qwen2.5-0.5b", ref_dtype="bfloat16")
  with caplog.at_level(logging.WARNING):
    exp = experiment.build(config, str(tmp_path))
  assert exp.model_config == presets.get("qwen2.5-0.5b", remat=config.model.remat)
  assert "config.model.preset=qwen2.5-0.5b sets the architecture" in caplog.text
  assert "config.model.hidden_size=32 (the preset has 896)" in caplog.text
  assert "max_seq_len" not in caplog.text  # left at its default: nobody set it
  # Planned without a weight: the reference is stored in bfloat16, the policy in float32.
  abstract = experiment.abstract_state(exp)
  assert {x.dtype for x in jax.tree.leaves(abstract.ref_params)} == {jnp.dtype(jnp.bfloat16)}
  assert {x.dtype for x in jax.tree.leaves(abstract.params)} == {jnp.dtype(jnp.float32)}
  ref_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract.ref_params))
  assert ref_bytes == 2 * presets.get("qwen2.5-0.5b").num_params


def test_bfloat16_reference_in_init_state(tmp_path):
  config = load_config()
  config.model.ref_dtype = "bfloat16"
  exp = experiment.build(config, str(tmp_path))
  params = models.create(exp.model_config, seed=0)[1]
  state = experiment.init_state(exp, params)
  ref, pol = jax.tree.leaves(state.ref_params), jax.tree.leaves(state.params)
  assert {x.dtype for x in ref} == {jnp.dtype(jnp.bfloat16)}
  assert {x.dtype for x in pol} == {jnp.dtype(jnp.float32)}
  for r, p, p0 in zip(ref, pol, jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(p), np.asarray(p0))  # the policy is untouched
    np.testing.assert_array_equal(np.asarray(r), np.asarray(jnp.asarray(p0, jnp.bfloat16)))
  # The abstract state (the checkpoint restore target) agrees with the real one.
  abstract = experiment.abstract_state(exp)
  assert [x.dtype for x in jax.tree.leaves(abstract.ref_params)] == [x.dtype for x in ref]
  # The bfloat16 reference runs the float32 model: logits near the float32 policy's.
  tokens = jnp.arange(1, 9, dtype=jnp.int32)[None] % exp.model_config.vocab_size
  positions, mask = jnp.arange(8)[None], jnp.ones((1, 8), bool)
  ref_logits = exp.fns.forward(state.ref_params, tokens, positions, mask)
  pol_logits = exp.fns.forward(state.params, tokens, positions, mask)
  assert ref_logits.shape == pol_logits.shape and bool(jnp.isfinite(ref_logits).all())
  np.testing.assert_allclose(np.asarray(ref_logits, np.float32), np.asarray(pol_logits),
                             atol=0.05)
  # Default: the reference is a float32 copy in its own buffers.
  config.model.ref_dtype = ""
  exp = experiment.build(config, str(tmp_path))
  state = experiment.init_state(exp, params)
  for r, p in zip(jax.tree.leaves(state.ref_params), jax.tree.leaves(state.params)):
    assert r.dtype == jnp.float32
    assert r.unsafe_buffer_pointer() != p.unsafe_buffer_pointer()


def test_keys_missing_from_an_older_run_config_match_their_defaults():
  """A workdir written before a key existed resumes when the key keeps its default (which keeps
  the old behaviour), and refuses when it was set to something else."""
  current = workdir.flat_config(config_utils.base_config())
  saved = {k: v for k, v in current.items() if k not in ("model.ref_dtype", "rloo.trim_bucket")}
  assert workdir.config_differences(saved, current) == []
  current["model.ref_dtype"] = "bfloat16"
  assert workdir.config_differences(saved, current) == ["model.ref_dtype"]


def test_default_reference_takes_the_activation_dtype_and_changes_no_logit(tmp_path):
  """ref_dtype='' stores the reference in config.model.dtype: under bfloat16 activations half
  the bytes, and the same logits as the float32 weights give (they are cast to bfloat16 anyway)."""
  config = load_config()
  config.model.dtype = "bfloat16"
  exp = experiment.build(config, str(tmp_path))
  params = models.create(exp.model_config, seed=0)[1]
  state = experiment.init_state(exp, params)
  assert {x.dtype for x in jax.tree.leaves(state.ref_params)} == {jnp.dtype(jnp.bfloat16)}
  assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}
  tokens = jnp.arange(1, 9, dtype=jnp.int32)[None] % exp.model_config.vocab_size
  positions, mask = jnp.arange(8)[None], jnp.ones((1, 8), bool)
  np.testing.assert_array_equal(
      np.asarray(exp.fns.forward(state.ref_params, tokens, positions, mask)),
      np.asarray(exp.fns.forward(state.params, tokens, positions, mask)))


def test_layout_settings_keep_the_cached_sft_policy():
  """remat and ref_dtype change how the model is computed and stored, not the SFT policy: its
  cache key ignores them (and an unset preset), but not the architecture."""
  from rloo_jax import sft  # pylint: disable=import-outside-toplevel
  config = load_config()
  key = sft.cache_dir(config, "/w")
  config.model.update(remat="none", ref_dtype="bfloat16")
  assert sft.cache_dir(config, "/w") == key
  fingerprint = config_utils.model_fingerprint(config)
  assert not {"remat", "ref_dtype", "preset"} & set(fingerprint)
  config.model.hidden_size += 8
  assert sft.cache_dir(config, "/w") != key

"""rloo_jax.load_policy on a finished smoke run and on HF checkpoints, and hub ids
(rloo_jax.models.hf.resolve_path) read from a laid-out hub cache with HF_HUB_OFFLINE=1: no test
here touches the network."""

import os
import shutil

import jax
import numpy as np
import pytest

from conftest import load_config
import rloo_jax
from rloo_jax import algorithms, experiment, rollout, sampler, sampler_args, sampling
from rloo_jax.evaluation import Evaluator
from rloo_jax.models import hf

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf")
LLAMA = os.path.join(FIXTURES, "llama")


@pytest.fixture(scope="module")
def smoke_workdir(tmp_path_factory):
  """A finished smoke run: 2 RLOO iterations, checkpoints at steps 1 and 2."""
  workdir = str(tmp_path_factory.mktemp("policy_smoke"))
  algorithms.run(load_config("smoke"), workdir, log=lambda *a, **k: None)
  return workdir


@pytest.fixture(scope="module")
def smoke_policy(smoke_workdir):
  return rloo_jax.load_policy(smoke_workdir)


def test_workdir_generate_matches_the_evaluator(smoke_workdir, smoke_policy):
  policy = smoke_policy
  assert policy.step == 2 and policy.config.rloo.k == 4
  evaluator = Evaluator.from_config(policy.experiment)
  prompts = [r["prompt"] for r in evaluator.records]
  want = evaluator.completions(policy.params, sampling.Greedy())[0]
  got = policy.generate(prompts)
  assert got == want and all(isinstance(t, str) for t in got)
  assert policy.generate(prompts) == got  # deterministic
  # A short last batch (3 of 16 rows) reuses the compiled shape and keeps prompt order.
  assert policy.generate(prompts[:3]) == got[:3]
  sampled = policy.generate(prompts[:3], k=2, method=sampling.Temperature(1.0), seed=1)
  assert len(sampled) == 3 and all(len(s) == 2 and all(isinstance(t, str) for t in s)
                                   for s in sampled)
  assert policy.generate(prompts[:3], k=2, method=sampling.Temperature(1.0), seed=1) == sampled
  with pytest.raises(TypeError, match="list of strings"):
    policy.generate(prompts[0])


def test_more_prompts_than_a_batch_stream_through_the_engine(smoke_policy, monkeypatch):
  """16 prompts at batches of 4: one engine call with 4 * k slots (config.rloo.rollout_engine),
  the batches' greedy text; sampled text deterministic, one stream key a prompt and sample."""
  policy = smoke_policy
  prompts = [r["prompt"] for r in Evaluator.from_config(policy.experiment).records]
  assert len(prompts) == 16
  calls = []
  sample = sampler.sample
  monkeypatch.setattr(sampler, "sample", lambda *a, **kw: calls.append(kw) or sample(*a, **kw))
  monkeypatch.setattr(policy, "batch_size", 4)
  greedy = policy.generate(prompts)
  assert [kw["slots"] for kw in calls] == [4]
  with monkeypatch.context() as batch_by_batch:
    batch_by_batch.setattr(sampler_args, "stream_slots", lambda *a: 0)
    assert policy.generate(prompts) == greedy and len(calls) == 5  # four static batches
  method = sampling.Temperature(1.0)
  sampled = policy.generate(prompts, k=2, method=method, seed=1)
  assert calls[-1]["slots"] == 8 and len(sampled) == 16
  assert policy.generate(prompts, k=2, method=method, seed=1) == sampled


def test_an_evaluation_of_several_batches_streams_through_the_engine(smoke_policy, monkeypatch):
  """16 records at batches of 4: one rollout with 4 * k slots, the batch-by-batch greedy texts,
  rewards and lengths."""
  policy = smoke_policy
  source = Evaluator.from_config(policy.experiment).records
  evaluator = Evaluator(policy.experiment, source, batch_size=4, rng=jax.random.PRNGKey(0))
  calls = []
  run = rollout.rollout
  monkeypatch.setattr(rollout, "rollout", lambda *a, **kw: calls.append(kw) or run(*a, **kw))
  streamed = evaluator.completions(policy.params, sampling.Greedy())
  assert [kw["slots"] for kw in calls] == [4]
  monkeypatch.setattr(sampler_args, "stream_slots", lambda *a: 0)
  batched = evaluator.completions(policy.params, sampling.Greedy())
  assert [kw["slots"] for kw in calls[1:]] == [0] * 4
  assert streamed[0] == batched[0] and len(streamed[0]) == 16
  np.testing.assert_array_equal(streamed[1], batched[1])
  np.testing.assert_array_equal(streamed[2], batched[2])


def test_workdir_step_selection(smoke_workdir):
  assert rloo_jax.load_policy(smoke_workdir, step=1).step == 1
  with pytest.raises(ValueError, match=r"no checkpoint of step 7 .*saved steps: \[1, 2\]"):
    rloo_jax.load_policy(smoke_workdir, step=7)


def _hand_logprob(policy, prompt, completion, add_eos=False):
  """log p(completion | prompt) from one unpadded [bos prompt completion] row of the forward."""
  tok = policy.tokenizer
  prompt_ids = [tok.bos_id] + list(tok.encode(prompt))
  comp_ids = list(tok.encode(completion)) + ([tok.eos_id] if add_eos else [])
  ids = np.asarray(prompt_ids + comp_ids, np.int32)[None]
  s = ids.shape[1]
  logits = policy.fns.forward(policy.params, ids, np.arange(s, dtype=np.int32)[None],
                              np.ones((1, s), bool))
  logp = jax.nn.log_softmax(np.asarray(logits, np.float64)[0], axis=-1)
  p = len(prompt_ids)
  return sum(float(logp[p - 1 + i, t]) for i, t in enumerate(comp_ids))


def test_logprobs_match_a_hand_forward(smoke_policy):
  policy = smoke_policy
  records = policy.experiment.task.test
  prompts = [records[i]["prompt"] for i in range(3)]
  answers = [str(records[i]["answer"]) for i in range(3)]
  got = policy.logprobs(prompts, answers)
  assert len(got) == 3 and all(np.isfinite(got)) and all(v < 0 for v in got)
  np.testing.assert_allclose(got[0], _hand_logprob(policy, prompts[0], answers[0]), rtol=1e-5)
  with_eos = policy.logprobs(prompts[:1], answers[:1], add_eos=True)[0]
  np.testing.assert_allclose(with_eos, _hand_logprob(policy, prompts[0], answers[0], True),
                             rtol=1e-5)
  assert with_eos < got[0]  # the eos token's own log-prob is added
  assert policy.logprobs(prompts[:1], [""]) == [0.0]
  with pytest.raises(ValueError, match="2 prompts but 1 completions"):
    policy.logprobs(prompts[:2], answers[:1])


def _fixture_prompts_and_greedy():
  tok = hf.load_tokenizer(LLAMA)
  ref = np.load(os.path.join(LLAMA, "reference.npz"))
  prompts = [tok.decode(row[1:n]) for row, n in zip(ref["prompt_tokens"], ref["prompt_lengths"])]
  for row, n, text in zip(ref["prompt_tokens"], ref["prompt_lengths"], prompts):
    assert [tok.bos_id] + tok.encode(text) == row[:n].tolist()  # the text is those tokens
  return prompts, [tok.decode(row) for row in ref["greedy_tokens"]], ref["greedy_tokens"].shape[1]


def test_hf_checkpoint_policy_matches_transformers_greedy():
  policy = rloo_jax.load_policy(LLAMA)
  assert policy.step is None and policy.config is None
  prompts, want, new_tokens = _fixture_prompts_and_greedy()
  assert policy.generate(prompts, max_new_tokens=new_tokens) == want
  lp = policy.logprobs(prompts, want)
  assert all(np.isfinite(lp))
  with pytest.raises(ValueError, match="step=3 names a checkpoint of a training workdir"):
    rloo_jax.load_policy(LLAMA, step=3)


def _hub_cache(tmp_path, monkeypatch, repo="org/name"):
  """A hub cache holding `repo` as huggingface_hub lays it out, the env set offline.

  huggingface_hub.constants reads HF_HUB_CACHE / HF_HUB_OFFLINE once at import, so both the
  environment (read by resolve_path at call time) and the constants are patched."""
  from huggingface_hub import constants  # a lazy attribute of the package: import it by name

  cache = tmp_path / "hub"
  commit = "0123456789abcdef0123456789abcdef01234567"
  repo_dir = cache / ("models--" + repo.replace("/", "--"))
  snapshot = repo_dir / "snapshots" / commit
  shutil.copytree(LLAMA, snapshot, ignore=shutil.ignore_patterns("reference.npz"))
  (repo_dir / "refs").mkdir()
  (repo_dir / "refs" / "main").write_text(commit)
  monkeypatch.setenv("HF_HUB_CACHE", str(cache))
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
  monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
  return str(snapshot)


def test_hub_id_resolves_from_the_offline_cache(tmp_path, monkeypatch):
  snapshot = _hub_cache(tmp_path, monkeypatch)
  assert os.path.realpath(hf.resolve_path("org/name")) == os.path.realpath(snapshot)
  assert hf.resolve_path(LLAMA) == LLAMA  # a local directory passes through
  config, _, params = hf.load_model("org/name")
  want_config, want = hf.load_checkpoint(LLAMA)
  assert config == want_config
  jax.tree.map(np.testing.assert_array_equal, params, want)
  assert hf.load_tokenizer("org/name").encode("the fox") == hf.load_tokenizer(LLAMA).encode(
      "the fox")
  c = load_config("smoke")
  c.model.init_from = "org/name"
  experiment.validate_config(c)  # the init_from check resolves the id first


def test_uncached_hub_id_offline_is_a_clear_error(tmp_path, monkeypatch):
  _hub_cache(tmp_path, monkeypatch)
  with pytest.raises(FileNotFoundError,
                     match=r"config\.model\.init_from='org/missing' .*HF_HUB_OFFLINE is set"):
    hf.resolve_path("org/missing")
  c = load_config("smoke")
  c.model.init_from = "org/missing"
  with pytest.raises(FileNotFoundError, match=r"config\.model\.init_from='org/missing'"):
    experiment.validate_config(c)
  with pytest.raises(FileNotFoundError, match=r"load_policy path='org/missing'"):
    rloo_jax.load_policy("org/missing")
  # Not an id and not a directory: a path error, the hub never asked.
  with pytest.raises(FileNotFoundError, match=r"init_from='/no/such/dir' is not a directory"):
    hf.resolve_path("/no/such/dir")


def test_an_unreachable_hub_is_a_one_line_error(monkeypatch):
  import huggingface_hub
  monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
  monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
  monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)

  def no_network(*args, **kwargs):  # huggingface_hub's own message spans lines
    raise ConnectionError("Name or service not known\nAn error happened while trying to locate "
                          "the files on the Hub.")
  monkeypatch.setattr(huggingface_hub, "snapshot_download", no_network)
  with pytest.raises(FileNotFoundError) as e:
    hf.resolve_path("org/name")
  assert "\n" not in str(e.value) and "the hub could not serve it" in str(e.value)
  assert "Name or service not known An error happened" in str(e.value)

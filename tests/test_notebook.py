"""The notebooks run top to bottom at their tiny test sizes (nbclient, real kernel, no network)."""
import json
import os
import re
import time

import nbformat
import pytest

from conftest import load_config
from rloo_jax import algorithms

nbclient = pytest.importorskip("nbclient")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _execute(name, tmp_path, monkeypatch, **env):
  """Runs notebooks/<name> in a kernel started in tmp_path; (all printed text, seconds)."""
  # TMPDIR: the workdirs the notebooks make (tempfile.mkdtemp, kept for a Colab user to read)
  # go under tmp_path, which pytest removes, not into /tmp at every run.
  for key, value in dict(env, RLOO_JAX_DIR=REPO,  # the kernel runs away from the checkout
                         JAX_PLATFORMS="cpu", MPLBACKEND="Agg", TMPDIR=str(tmp_path)).items():
    monkeypatch.setenv(key, value)
  nb = nbformat.read(os.path.join(REPO, "notebooks", name), as_version=4)
  client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                   resources={"metadata": {"path": str(tmp_path)}})
  start = time.time()
  client.execute()
  seconds = time.time() - start
  return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                 for o in c.get("outputs", [])), seconds


def test_quickstart_notebook_executes(tmp_path, monkeypatch):
  outputs, _ = _execute("quickstart.ipynb", tmp_path, monkeypatch, RLOO_QUICKSTART_SIZE="test")
  assert "held-out evaluation on 16 prompts, seed 0, 2 RLOO iterations" in outputs  # the table
  assert "held-out greedy accuracy" in outputs
  assert "12+34= greedy" in outputs and "log p(greedy)" in outputs  # load_policy's cell
  assert "rewards: [" in outputs and "contains_keyword" in outputs  # the your-own-task cell
  assert outputs.count("held-out evaluation") == 2  # both runs finished


def test_gsm8k_notebook_executes_offline(tmp_path, monkeypatch):
  outputs, seconds = _execute("gsm8k.ipynb", tmp_path, monkeypatch, RLOO_GSM8K_OFFLINE="1")
  print(f"gsm8k notebook offline: {seconds:.1f} s")
  # The config cell: the smoke variant's fixtures, LoRA on.
  assert os.path.join("tests", "fixtures", "hf", "qwen2") in outputs
  assert "LoRA          rank 16" in outputs
  workdir = re.search(r"^workdir +(\S+)$", outputs, re.M).group(1)
  # The training cell's line, and it reports the run's own summary.
  m = re.search(r"held-out greedy accuracy on (\d+) prompts: (\d\.\d{3}) -> (\d\.\d{3})", outputs)
  assert m, outputs[-2000:]
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  assert int(m.group(1)) == summary["eval_prompts"] == 8
  assert float(m.group(2)) == round(summary["before"]["greedy_reward"], 3)
  assert float(m.group(3)) == round(summary["after"]["greedy_reward"], 3)
  assert summary["iterations"] == 2
  # The verifier cell: one verdict per shown question, against the test file's references, and
  # each verdict agrees with the number it says it read.
  verdicts = re.findall(r"read (\S+) \| reference (\S+) \| verdict: (\w+)", outputs)
  with open(os.path.join(REPO, "tests", "fixtures", "gsm8k_tiny", "test.jsonl")) as f:
    references = [json.loads(line)["answer"].rsplit("####", 1)[1].strip() for line in f][:4]
  assert [ref for _, ref, _ in verdicts] == references
  for read, ref, verdict in verdicts:
    assert verdict == ("correct" if read == ref else "wrong"), (read, ref, verdict)
  # The export cell: a PEFT directory with both files, listed with their sizes.
  peft_dir = os.path.join(workdir, "peft_adapter")
  assert sorted(os.listdir(peft_dir)) == ["adapter_config.json", "adapter_model.safetensors"]
  for name in os.listdir(peft_dir):
    size = os.path.getsize(os.path.join(peft_dir, name))
    assert re.search(rf"{re.escape(name)} +{size:,d} bytes", outputs), name
  assert "'r': 16" in outputs and "'lora_alpha': 16" in outputs


def test_gsm8k_colab_config(tmp_path):
  """The notebook's Colab job: its shapes, and a config the trainer accepts (the checkpoint is a
  hub id, so this checks the config with the tiny fixture's config.json in its place, given
  Qwen2.5-0.5B's context: no network)."""
  c = load_config("colab,lora=16", name="gsm8k")
  assert c.model.init_from == "Qwen/Qwen2.5-0.5B-Instruct" and c.model.lora.rank == 16
  assert (c.rloo.num_prompts, c.rloo.k, c.data.max_prompt_len, c.rloo.max_new_tokens) == (
      32, 4, 256, 256)
  assert c.train.num_iterations == 30 and c.optim.learning_rate == 5e-5
  # Microbatches that a TPU's 8 cores split evenly, as one GPU does.
  assert c.train.microbatch_size % 8 == 0 and c.train.eval_batch_size % 8 == 0
  assert load_config("colab,k=2", name="gsm8k").rloo.k == 2
  # The other variants keep veRL's k=5.
  assert load_config("single", name="gsm8k").rloo.k == load_config(None, name="gsm8k").rloo.k == 5
  # The fixture has no chat template: Qwen's is checked where the hub is reachable.
  fixture = load_config("smoke", name="gsm8k").model.init_from
  with open(os.path.join(fixture, "config.json")) as f:
    hf_config = dict(json.load(f), max_position_embeddings=32768)
  with open(tmp_path / "config.json", "w") as f:
    json.dump(hf_config, f)
  c.model.init_from, c.data.chat_template = str(tmp_path), ""
  algorithms.validate(c)
  c.train.microbatch_size = 6  # a check that can fail: 16 prompts a minibatch are not 6s
  with pytest.raises(ValueError, match="microbatch_size"):
    algorithms.validate(c)

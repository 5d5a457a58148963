"""The quickstart notebook runs top to bottom at its tiny test size (nbclient, real kernel)."""
import os

import nbformat
import pytest

nbclient = pytest.importorskip("nbclient")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quickstart_notebook_executes(tmp_path, monkeypatch):
  monkeypatch.setenv("RLOO_QUICKSTART_SIZE", "test")
  monkeypatch.setenv("RLOO_JAX_DIR", REPO)  # the kernel runs in tmp_path, away from the checkout
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.setenv("MPLBACKEND", "Agg")
  nb = nbformat.read(os.path.join(REPO, "notebooks", "quickstart.ipynb"), as_version=4)
  client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                   resources={"metadata": {"path": str(tmp_path)}})
  client.execute()
  outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                    for o in c.get("outputs", []))
  assert "held-out evaluation on 16 prompts, seed 0, 2 RLOO iterations" in outputs  # the table
  assert "held-out greedy accuracy" in outputs
  assert "12+34= greedy" in outputs and "log p(greedy)" in outputs  # load_policy's cell
  assert "rewards: [" in outputs and "contains_keyword" in outputs  # the your-own-task cell
  assert outputs.count("held-out evaluation") == 2  # both runs finished

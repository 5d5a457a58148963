"""Runs notebooks/quickstart.ipynb top to bottom at its full size (the README's default experiment,
then the example JSONL task) in a real kernel, and prints its tables and the seconds it took.

    python experiments/run_notebook.py            # RLOO_QUICKSTART_SIZE=test: the CI size
"""
import os
import time

import nbclient
import nbformat

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
  os.environ.setdefault("RLOO_JAX_DIR", REPO)
  os.environ.setdefault("MPLBACKEND", "Agg")
  nb = nbformat.read(os.path.join(REPO, "notebooks", "quickstart.ipynb"), as_version=4)
  start = time.time()
  nbclient.NotebookClient(nb, timeout=1800, kernel_name="python3",
                          resources={"metadata": {"path": REPO}}).execute()
  out = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                for o in c.get("outputs", []))
  print("\n".join(l for l in out.splitlines()
                  if "held-out" in l or "greedy" in l or "|" in l or "rewards:" in l))
  print(f"notebook seconds {time.time() - start:.0f}")


if __name__ == "__main__":
  main()

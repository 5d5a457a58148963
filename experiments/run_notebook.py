"""Runs a notebook of notebooks/ top to bottom in a real kernel and prints its result lines
(tables, accuracies, greedy answers, verdicts, exported files) and the seconds it took.

    python experiments/run_notebook.py              # quickstart.ipynb at full size
    RLOO_QUICKSTART_SIZE=test python experiments/run_notebook.py   # the CI size
    RLOO_GSM8K_OFFLINE=1 python experiments/run_notebook.py gsm8k  # gsm8k.ipynb's offline run
"""
import os
import sys
import time

import nbclient
import nbformat

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The printed lines worth keeping, by the notebooks' own wording.
_KEEP = ("held-out", "greedy", "|", "rewards:", "verdict:", " bytes", "'r':")


def main(argv):
  if len(argv) > 2:
    sys.exit(f"usage: {argv[0]} [NOTEBOOK]  (a name in notebooks/, default quickstart)")
  name = argv[1] if len(argv) == 2 else "quickstart"
  path = os.path.join(REPO, "notebooks", name if name.endswith(".ipynb") else name + ".ipynb")
  if not os.path.isfile(path):
    found = sorted(f[:-len(".ipynb")] for f in os.listdir(os.path.join(REPO, "notebooks"))
                   if f.endswith(".ipynb"))
    sys.exit(f"no notebook {path}; choose one of {found}")
  os.environ.setdefault("RLOO_JAX_DIR", REPO)
  os.environ.setdefault("MPLBACKEND", "Agg")
  nb = nbformat.read(path, as_version=4)
  start = time.time()
  nbclient.NotebookClient(nb, timeout=1800, kernel_name="python3",
                          resources={"metadata": {"path": REPO}}).execute()
  out = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                for o in c.get("outputs", []))
  print("\n".join(l for l in out.splitlines() if any(k in l for k in _KEEP)))
  print(f"notebook {os.path.basename(path)} seconds {time.time() - start:.0f}")


if __name__ == "__main__":
  main(sys.argv)

#!/usr/bin/env bash
# The virtual environment of experiments/bench_trl_rloo.py (compare_peers.py's TRL side): TRL
# 1.16.0 and torch 2.13.0 from PyPI (docs/PERFORMANCE.md's figures: torch 2.13.0+cpu).
#
#   bash experiments/setup_trl_venv.sh [VENV_DIR]       # default: .venv-trl at the repo root
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv-trl}"
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.13.0 trl==1.16.0
"$VENV/bin/python" -c "import torch, trl
print('trl', trl.__version__, 'torch', torch.__version__, 'at', '$VENV')"

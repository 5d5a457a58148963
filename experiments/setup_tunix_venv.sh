#!/usr/bin/env bash
# The virtual environment of experiments/bench_tunix_rloo.py (the Tunix side of compare_peers.py):
# google-tunix 0.1.7 with the versions it resolved to when compare_peers' figures were taken
# (pinned, so the figures stay reproducible; tunix itself asks for less). CPU jax.
#
#   bash experiments/setup_tunix_venv.sh [VENV_DIR]     # default: .venv-tunix, compare_peers' too
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv-tunix}"
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q \
  google-tunix==0.1.7 \
  "jax[cpu]==0.10.2" jaxlib==0.10.2 flax==0.12.8 optax==0.2.8 orbax-checkpoint==0.12.8 \
  qwix==0.1.8 google-metrax==0.2.4 grain==0.2.18 transformers==5.12.1 numpy==2.4.6
"$VENV/bin/python" -c "
import jax, flax, tunix
from tunix.rl import algo_core  # registers the 'rloo' advantage estimator
from tunix.rl import function_registry
function_registry.get_advantage_estimator('rloo')
print('tunix', tunix.__version__, 'jax', jax.__version__, 'flax', flax.__version__, 'at', '$VENV')"

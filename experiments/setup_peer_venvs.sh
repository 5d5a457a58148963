#!/usr/bin/env bash
# The virtual environments of compare_peers.py's peers, pinned to the versions its figures were
# taken with (docs/PERFORMANCE.md), at the repo root: .venv-trl (bench_trl_rloo.py: TRL 1.16.0,
# torch 2.13.0 CPU) and .venv-tunix (bench_tunix_rloo.py: google-tunix 0.1.7 and what it
# resolved to then, CPU jax; tunix itself asks for less).
#
#   bash experiments/setup_peer_venvs.sh [trl] [tunix]      # default: both
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
declare -A PINS=([trl]="torch==2.13.0 trl==1.16.0" [tunix]="google-tunix==0.1.7 jax[cpu]==0.10.2
  jaxlib==0.10.2 flax==0.12.8 optax==0.2.8 orbax-checkpoint==0.12.8 qwix==0.1.8
  google-metrax==0.2.4 grain==0.2.18 transformers==5.12.1 numpy==2.4.6")
# Tunix's check: its 'rloo' advantage estimator is registered (algo_core's import does it).
declare -A CHECK=(
  [trl]="import torch, trl; print('trl', trl.__version__, 'torch', torch.__version__)"
  [tunix]="import jax, tunix; from tunix.rl import algo_core, function_registry as f
f.get_advantage_estimator('rloo'); print('tunix', tunix.__version__, 'jax', jax.__version__)")
sides=("$@")
[[ $# -gt 0 ]] || sides=(trl tunix)
for side in "${sides[@]}"; do
  [[ -v "PINS[$side]" ]] || { echo "setup_peer_venvs.sh: $side is not trl or tunix" >&2; exit 2; }
  python3 -m venv "$ROOT/.venv-$side"
  read -ra pins <<< "${PINS[$side]//$'\n'/ }"  # split into words, no glob ('jax[cpu]')
  "$ROOT/.venv-$side/bin/pip" install -q "${pins[@]}"
  "$ROOT/.venv-$side/bin/python" -c "${CHECK[$side]}"
done

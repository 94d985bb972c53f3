#!/usr/bin/env bash
# Create the OpenFGL venv used by fedavg_vs_openfgl.py, from scratch: benchmarks/.venv-openfgl
# (or $OPENFGL_VENV). CPU torch goes in first and stays pinned: nothing here may pull a CUDA build.
#
#   bash benchmarks/setup_openfgl.sh            # create (or top up) the venv
#   FRESH=1 bash benchmarks/setup_openfgl.sh    # delete it and start over
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${OPENFGL_VENV:-$HERE/.venv-openfgl}"
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
TORCH="torch==2.13.0"          # resolves to the CPU wheel here (same as fglit's Makefile)
OPENFGL="openfgl-lib==1.1.0"

[[ "${FRESH:-0}" == 1 ]] && rm -rf "$VENV"
start=$(date +%s)
"$PYTHON" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }

# 1. CPU torch first.
pip install --quiet "$TORCH"
# 2. OpenFGL without its dependency resolution (its metadata only asks for requests, but keep pip from ever
#    re-resolving torch), then what its code imports for subgraph-FL FedAvg, with torch pinned on the same line.
pip install --quiet --no-deps "$OPENFGL"
pip install --quiet "$TORCH" torch-geometric scikit-network pymetis munkres numpy scipy scikit-learn networkx tqdm requests

# 3. Check: CPU torch, and OpenFGL's trainer imports.
TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 "$VENV/bin/python" - <<'EOF'
import sys, torch
assert torch.version.cuda is None, f"a CUDA torch got in: {torch.__version__}"
sys.argv = sys.argv[:1]
from openfgl.flcore.trainer import FGLTrainer  # noqa: F401
import torch_geometric, sknetwork
from importlib.metadata import version
print(f"OpenFGL venv ok: openfgl-lib {version('openfgl-lib')}, torch {torch.__version__}, "
      f"torch_geometric {torch_geometric.__version__}, scikit-network {sknetwork.__version__}")
EOF
echo "created $VENV in $(( $(date +%s) - start ))s"

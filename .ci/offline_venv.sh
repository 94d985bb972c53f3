#!/usr/bin/env bash
# Build fglit's .venv on a machine without a package registry (e.g. a GPU machine whose image has a CUDA torch):
# the venv sees the interpreter's own packages (torch, torch-geometric, ... as the image has them) through a .pth
# file, gets what is missing from a folder of wheels (pip download ... elsewhere), and fglit in editable mode.
# It then marks the venv as installed, so `make test-gpu` (and the other make targets) use it as it is.
#   bash .ci/offline_venv.sh WHEEL_DIR        (PYTHON=... picks the interpreter whose packages are reused)
set -euo pipefail
WHEELS=${1:?usage: offline_venv.sh WHEEL_DIR}
PY=${PYTHON:-python3}
BASE_SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$PY" -m venv .venv
VENV_SITE=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$BASE_SITE" > "$VENV_SITE/_base_interpreter_site.pth"
.venv/bin/python -m pip install --quiet --no-index --no-deps --no-compile --ignore-installed "$WHEELS"/*.whl
.venv/bin/python -m pip install --quiet --no-index --no-deps --no-build-isolation --use-pep517 -e .
.venv/bin/python -c "import torch, torch_geometric, fglit; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available(), '| torch_geometric', torch_geometric.__version__, '| fglit', fglit.__version__)"
touch .venv/bin/.installed

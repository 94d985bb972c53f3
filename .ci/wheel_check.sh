#!/usr/bin/env bash
# The package as a user gets it: build the sdist and the wheel (the wheel from the sdist), install the wheel into a
# fresh venv with nothing else of this checkout, and run fglit from outside the repository.
#   bash .ci/wheel_check.sh        (PYTHON=... picks the interpreter; FGLIT_DATA must point at the datasets)
set -euo pipefail
PY=${PYTHON:-python3}
repo=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
"$PY" -m venv "$tmp/tools" && "$tmp/tools/bin/python" -m pip install --quiet build
"$tmp/tools/bin/python" -m build --outdir "$tmp/dist" "$repo" > "$tmp/build.log" 2>&1 || { tail -20 "$tmp/build.log"; exit 1; }
ls "$tmp/dist"
"$PY" -m venv "$tmp/user"
"$tmp/user/bin/python" -m pip install --quiet torch==2.13.0          # the CPU build (a local wheel here)
"$tmp/user/bin/python" -m pip install --quiet "$tmp"/dist/fglit-*.whl
cd "$tmp"
"$tmp/user/bin/fglit" --version
"$tmp/user/bin/python" -c "import fglit, pathlib; assert '$repo' not in fglit.__file__, fglit.__file__; print('imported from', pathlib.Path(fglit.__file__).parent)"
OMP_NUM_THREADS=1 "$tmp/user/bin/fglit" run fedavg --dataset Cora --clients 3 --rounds 2 --quiet
out=$("$tmp/user/bin/fglit" flower local fedavg --dataset Cora --clients 3 --rounds 1 2>&1 || true)
grep -q "pip install 'fglit\[flower\]'" <<< "$out" || { echo "wheel-check: fglit flower without the extra said: $out"; exit 1; }
echo "wheel-check: without the flower extra, fglit flower names the extra to install"
echo "wheel-check: the wheel installs into a fresh venv and runs"

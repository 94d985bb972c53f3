#!/usr/bin/env bash
# One call on a lent GPU machine (no package registry there): unpack the datasets and wheels carried in .gpu/,
# build .venv over the image's CUDA torch (.ci/offline_venv.sh), then run make test-gpu's two commands with logs under
# $OUT. MODE=both runs the notebooks and pytest side by side (the quicker first look); MODE=make runs `make test-gpu`
# itself, pytest spread over processes through PYTEST_ADDOPTS. Prepare here first (see nbs/90_gpu.ipynb):
#   python3 .ci/download_wheels.py .gpu/whl && tar -cJf .gpu/ds.tar.xz -C "$FGLIT_DATA" --exclude=processed .
set -u
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 FGLIT_DATA=$PWD/.gpu/data
START=$SECONDS
mkdir -p .gpu/data && tar -xJf .gpu/ds.tar.xz -C .gpu/data
{ nvidia-smi; nproc; free -g; git rev-parse HEAD 2>/dev/null; date -u; } > "$OUT/machine.txt" 2>&1
PYTHON=/opt/torch/.venv/bin/python3 bash .ci/offline_venv.sh .gpu/whl > "$OUT/setup.log" 2>&1 || { tail -30 "$OUT/setup.log"; exit 1; }
tail -1 "$OUT/setup.log"; echo "setup took $((SECONDS - START)) s"
LIMIT=${LIMIT:-420}
case "${MODE:-both}" in
both)
  ( FGLIT_DEVICE=cuda timeout "$LIMIT" .venv/bin/nbdev_test --flags gpu --timing --n_workers 5 > "$OUT/notebooks.log" 2>&1
    echo "nbdev_test rc=$?" >> "$OUT/notebooks.log" ) &
  FGLIT_DEVICE=cuda timeout "$LIMIT" .venv/bin/python -m pytest tests -q --gpu -n 10 --timeout 300 -p no:cacheprovider \
      --durations=15 --junitxml="$OUT/pytest.xml" > "$OUT/pytest.log" 2>&1
  echo "pytest rc=$?" >> "$OUT/pytest.log"
  wait ;;
make)
  PYTEST_ADDOPTS="-n 12 --timeout 300 -p no:cacheprovider --durations=15 --junitxml=$OUT/pytest.xml" \
      timeout "$LIMIT" make test-gpu > "$OUT/make_test_gpu.log" 2>&1
  echo "make test-gpu rc=$?" >> "$OUT/make_test_gpu.log" ;;
esac
echo "total $((SECONDS - START)) s"
for f in "$OUT"/*.log; do echo "== $f"; grep -E "rc=|Error in|FAILED|passed|failed|Success" "$f" | grep -v PASSED | tail -40; done

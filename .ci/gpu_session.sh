#!/usr/bin/env bash
# One call on a lent GPU machine (no package registry there): unpack the datasets and wheels carried in .gpu/,
# build .venv over the image's CUDA torch (.ci/offline_venv.sh), then run make test-gpu's two commands with logs under
# $OUT. MODE=both runs the notebooks and pytest side by side (the quicker first look); MODE=make runs `make test-gpu`
# itself, pytest spread over processes through PYTEST_ADDOPTS; MODE=split runs each notebook on its own and logs every
# outcome as it comes (FGLIT_TEST_LOG), for calls that may be cut off. Prepare here first (see nbs/90_gpu.ipynb):
#   python3 .ci/download_wheels.py .gpu/whl && tar -cJf .gpu/ds.tar.xz -C "$FGLIT_DATA" --exclude=processed .
set -u
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 FGLIT_DATA=$PWD/.gpu/data
START=$SECONDS
mkdir -p .gpu/data && tar -xJf .gpu/ds.tar.xz -C .gpu/data
{ nvidia-smi; nproc; free -g; git rev-parse HEAD 2>/dev/null; date -u
  # runs 4-5 (2026-11-26) saw nproc 1 on a "16-core" machine: say where the limit comes from (affinity or cgroup quota)
  echo "cpu_count $(python3 -c 'import os; print(os.cpu_count(), len(os.sched_getaffinity(0)))') cpu.max $(cat /sys/fs/cgroup/cpu.max 2>/dev/null)"; } > "$OUT/machine.txt" 2>&1
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
split)
  # each notebook on its own (longest first, 5 at a time) and pytest over 11 processes, both writing outcomes as they
  # come (tests/conftest.py's FGLIT_TEST_LOG), so a call cut off by its time limit still says what failed and why
  export FGLIT_DEVICE=cuda FGLIT_TEST_LOG="$OUT/pytest_outcomes.log" NBOUT="$OUT"; mkdir -p /tmp/nb
  order="20_opfgl 13_pfl 30_gpfl 40_fedgls 17_adafgl 11_prototypes 31_gpfl 21_opfgl 12_compare 19_fedtad 51_fedpg"
  { for k in $order; do ls nbs/$k*.ipynb nbs/*/$k*.ipynb 2>/dev/null; done; ls nbs/*.ipynb nbs/*/*.ipynb; } | awk '!seen[$0]++' > /tmp/nb/list
  ( timeout "$LIMIT" xargs -P 5 -I{} bash -c 'log=/tmp/nb/$(basename {}).log; t=$SECONDS; .venv/bin/nbdev_test --path {} --flags gpu --n_workers 1 > $log 2>&1; rc=$?
        echo "{} rc=$rc $((SECONDS - t))s" >> $NBOUT/notebooks.log; [ $rc = 0 ] || flock $NBOUT/.lock -c "cat $log >> $NBOUT/notebooks_failed.log" || cat $log >> $NBOUT/notebooks_failed.log' < /tmp/nb/list ) &
  timeout "$LIMIT" .venv/bin/python -m pytest tests -q --gpu -n 11 --timeout 300 -p no:cacheprovider > "$OUT/pytest.log" 2>&1
  echo "pytest rc=$?" >> "$OUT/pytest.log"
  wait; rm -f "$OUT/.lock" ;;
make)
  PYTEST_ADDOPTS="-n 12 --timeout 300 -p no:cacheprovider --durations=15 --junitxml=$OUT/pytest.xml" \
      timeout "$LIMIT" make test-gpu > "$OUT/make_test_gpu.log" 2>&1
  echo "make test-gpu rc=$?" >> "$OUT/make_test_gpu.log" ;;
esac
echo "total $((SECONDS - START)) s"
for f in "$OUT"/*.log; do echo "== $f"; grep -E "rc=[^0]|Error in|FAILED|passed|failed|Success" "$f" | tail -25; done

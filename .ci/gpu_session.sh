#!/usr/bin/env bash
# One call on a lent GPU machine (no package registry there): unpack the datasets and wheels carried in .gpu/,
# build .venv over the image's CUDA torch (.ci/offline_venv.sh), then run make test-gpu's two commands with logs under
# $OUT. MODE=both runs the notebooks and pytest side by side (the quicker first look); MODE=none runs no tests (the benchmarks alone); MODE=make runs `make test-gpu`
# itself, pytest spread over processes through PYTEST_ADDOPTS; MODE=split runs each notebook on its own and logs every
# outcome as it comes (FGLIT_TEST_LOG), for calls that may be cut off. BENCH=suite (any BENCH but 0) runs benchmarks/suite.py
# first, on a quiet machine (--size short: one call's worth, on CUDA and the same machine's CPU; see the branch below), its
# CSVs under $OUT/bench. (Runs 6 to 9 used an earlier BENCH=1/quiet: client scaling and O-pFGL's engines alone, now in the suite.)
# NB_JOBS and PYTEST_JOBS set how many notebooks and pytest processes run at once; in MODE=split, NOTEBOOKS (name prefixes)
# and TESTS (a file of test files or node ids, one per line) run only those, in that order (PYTEST_MARKS: default "not long"), e.g. what a cut-off call did not reach. Prepare here first (see nbs/90_gpu.ipynb):
#   python3 .ci/download_wheels.py .gpu/whl && tar -cJf .gpu/ds.tar.xz -C "$FGLIT_DATA" --exclude=processed .
set -u
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 FGLIT_DATA=$PWD/.gpu/data
START=$SECONDS
DEV=${DEV:-cuda}   # the device under test (DEV=cpu tries this script on a machine without a GPU)
[ -d .gpu/data/Cora ] || { mkdir -p .gpu/data && tar -xJf .gpu/ds.tar.xz -C .gpu/data; }
{ nvidia-smi; nproc; free -g; git rev-parse HEAD 2>/dev/null; date -u
  # nproc honours OMP_NUM_THREADS (exported above), so it prints 1: the CPUs the processes may use are the line below
  echo "cpu_count $(python3 -c 'import os; print(os.cpu_count(), len(os.sched_getaffinity(0)))') cpu.max $(cat /sys/fs/cgroup/cpu.max 2>/dev/null)"; } > "$OUT/machine.txt" 2>&1
if [ -f .venv/bin/.installed ]; then echo "setup: .venv from an earlier call on this machine"   # a warm machine keeps it
else PYTHON=/opt/torch/.venv/bin/python3 bash .ci/offline_venv.sh .gpu/whl > "$OUT/setup.log" 2>&1 || { tail -30 "$OUT/setup.log"; exit 1; }
  tail -1 "$OUT/setup.log"; fi
echo "setup took $((SECONDS - START)) s"
LIMIT=${LIMIT:-420}
# pytest's per-test limit where pytest-timeout is installed (the GPU image has it; a DEV=cpu try on a machine without it runs without)
pytest_timeout=(); .venv/bin/python -c "import pytest_timeout" 2> /dev/null && pytest_timeout=(--timeout 300)
NB_JOBS=${NB_JOBS:-5}; PYTEST_JOBS=${PYTEST_JOBS:-11}
if [ "${BENCH:-0}" != 0 ]; then
  # benchmarks/suite.py at --size short (SUITE_SIZE) on $DEV and this machine's CPU, SUITE_JOBS at once, within BENCH_LIMIT;
  # the tests start after it (a quiet machine for the timings). OpenFGL's wheels carried in .gpu/openfgl (download_wheels.py
  # --openfgl) go into .venv, over the image's CUDA torch, for the side-by-side on CUDA. SUITE_ARGS: more suite options.
  eval "suite_args=(${SUITE_ARGS:-})"   # split as a shell would: --args 'NAME=ARGS' keeps its ARGS in one word
  mkdir -p "$OUT/bench"; BLIMIT=${BENCH_LIMIT:-$LIMIT}; devices=$DEV; [ "$DEV" = cpu ] || devices="$DEV cpu"; ofpy=()
  if ls .gpu/openfgl/*.whl > /dev/null 2>&1; then
    .venv/bin/python -m pip install -q --no-index --no-deps .gpu/openfgl/*.whl > "$OUT/bench/openfgl_setup.log" 2>&1 && ofpy=(--openfgl-python "$PWD/.venv/bin/python"); fi
  timeout $((BLIMIT + 30)) .venv/bin/python benchmarks/suite.py --size "${SUITE_SIZE:-short}" --devices $devices --jobs "${SUITE_JOBS:-6}" \
      --budget "$BLIMIT" --out-dir "$OUT/bench" --work /tmp/fglit-bench "${ofpy[@]}" "${suite_args[@]}" > "$OUT/bench/log_suite.txt" 2>&1
  echo "suite rc=$? after $((SECONDS - START)) s"; tail -20 "$OUT/bench/log_suite.txt"
fi
case "${MODE:-both}" in
both)
  ( FGLIT_DEVICE=$DEV timeout "$LIMIT" .venv/bin/nbdev_test --flags gpu --timing --n_workers 5 > "$OUT/notebooks.log" 2>&1
    echo "nbdev_test rc=$?" >> "$OUT/notebooks.log" ) &
  FGLIT_DEVICE=$DEV timeout "$LIMIT" .venv/bin/python -m pytest tests -q --gpu -n 10 "${pytest_timeout[@]}" -p no:cacheprovider \
      --durations=15 --junitxml="$OUT/pytest.xml" > "$OUT/pytest.log" 2>&1
  echo "pytest rc=$?" >> "$OUT/pytest.log"
  wait ;;
split)
  # each notebook on its own (longest first, 5 at a time) and pytest over 11 processes, both writing outcomes as they
  # come (tests/conftest.py's FGLIT_TEST_LOG), so a call cut off by its time limit still says what failed and why
  export FGLIT_DEVICE=$DEV FGLIT_TEST_LOG="$OUT/pytest_outcomes.log" NBOUT="$OUT"; mkdir -p /tmp/nb
  order="20_opfgl 13_pfl 30_gpfl 40_fedgls 20a_opfgl 11_prototypes 10_fedavg 07_stacked 17_adafgl 31_gpfl 21_opfgl 12_compare 19_fedtad 51_fedpg"
  { for k in ${NOTEBOOKS:-$order}; do ls nbs/$k*.ipynb nbs/*/$k*.ipynb 2>/dev/null; done; [ -n "${NOTEBOOKS:-}" ] || ls nbs/*.ipynb nbs/*/*.ipynb; } | awk '!seen[$0]++' > /tmp/nb/list
  ( timeout "$LIMIT" xargs -P "$NB_JOBS" -I{} bash -c 'log=/tmp/nb/$(basename {}).log; t=$SECONDS; .venv/bin/nbdev_test --path {} --flags gpu --n_workers 1 > $log 2>&1; rc=$?
        echo "{} rc=$rc $((SECONDS - t))s" >> $NBOUT/notebooks.log; [ $rc = 0 ] || flock $NBOUT/.lock -c "cat $log >> $NBOUT/notebooks_failed.log" || cat $log >> $NBOUT/notebooks_failed.log' < /tmp/nb/list ) &
  if [ -n "${TESTS:-}" ]; then mapfile -t ids < <(grep -v '^#' "$TESTS"); else ids=(tests); fi   # one id per line (# comments), spaces kept
  timeout "$LIMIT" .venv/bin/python -m pytest "${ids[@]}" -q --gpu -m "${PYTEST_MARKS:-not long}" -n "$PYTEST_JOBS" "${pytest_timeout[@]}" -p no:cacheprovider > "$OUT/pytest.log" 2>&1
  echo "pytest rc=$?" >> "$OUT/pytest.log"
  wait; rm -f "$OUT/.lock" ;;
make)
  PYTEST_ADDOPTS="-n 12 ${pytest_timeout[*]} -p no:cacheprovider --durations=15 --junitxml=$OUT/pytest.xml" \
      timeout "$LIMIT" make test-gpu > "$OUT/make_test_gpu.log" 2>&1
  echo "make test-gpu rc=$?" >> "$OUT/make_test_gpu.log" ;;
none) ;;
esac
[ -d "$OUT/bench" ] && tar -czf "$OUT/bench.tgz" -C "$OUT" bench && rm -rf "$OUT/bench"   # one file back (the tool returns at most 8)
echo "total $((SECONDS - START)) s"
for f in "$OUT"/*.log; do echo "== $f"; grep -E "rc=[^0]|Error in|FAILED|passed|failed|Success" "$f" | tail -25; done

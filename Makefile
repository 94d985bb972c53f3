# fglit: `make demo` sets up a local virtual environment and runs the main job;
# `make test` sets it up and runs every test. Both work from a fresh clone.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
# Datasets: $FGLIT_DATA if set, else ../shared/datasets when it exists, else fglit's per-user folder.
SHARED_DATA := $(abspath ../shared/datasets)
FGLIT_DATA ?= $(if $(wildcard $(SHARED_DATA)),$(SHARED_DATA),)
export FGLIT_DATA

.PHONY: setup demo test bench bench-tiny test-long test-gpu package-check check-sync docs-proc docs readme reproduce-baselines reproduce-opfgl reproduce-fedgls \
	reproduce-gpfl reproduce-fedpg reproduce-authors
JOBS ?= 2

# torch first, pinned to the CPU build (a local wheel here); the package's own range then installs nothing more.
$(BIN)/.installed: settings.ini setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $@

setup: $(BIN)/.installed

# The main job: FedAvg on Cora, Louvain split into 10 clients, 100 rounds; prints per-seed, per-client and byte counts.
demo: setup
	$(BIN)/fglit run fedavg --dataset Cora --partition louvain --clients 10 --rounds 100 --local-epochs 3 --seeds 0 1 2

# Every test: package/notebook sync, docs processing, the notebooks (nbdev_test), pytest. Both test runners use JOBS
# processes of one torch thread each (several threads per process on a small machine oversubscribe its cores).
test: setup check-sync docs-proc
	OMP_NUM_THREADS=1 $(BIN)/nbdev_test --timing --n_workers $(JOBS)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest tests -q -m "not long" -n $(JOBS) --durations=15

# The tests `make test` leaves out for time: O-pFGL deployed over real SuperNode processes on loopback.
test-long: setup
	$(BIN)/python -m pytest tests -q -m long

# The package as a user installs it: sdist and wheel built, the wheel in a fresh venv, fglit run from outside the repo.
package-check:
	PYTHON=$(PYTHON) bash .ci/wheel_check.sh

# Everything again on a CUDA device, GPU-only cells and tests included (needs a GPU machine).
test-gpu: setup
	FGLIT_DEVICE=cuda $(BIN)/nbdev_test --flags "gpu" --timing
	FGLIT_DEVICE=cuda $(BIN)/python -m pytest tests -q --gpu

# The exported package and README must match the notebooks, and the notebooks must be clean: no metadata noise
# (nbdev_clean) and no local folders in stored outputs (.ci/redact_outputs.py; the docs are built from them anywhere).
check-sync: setup
	@tmp=$$(mktemp -d) && cp -rL fglit nbs README.md $$tmp/ && \
	$(BIN)/nbdev_export && $(BIN)/nbdev_clean && $(BIN)/python .ci/redact_outputs.py && $(BIN)/python .ci/nb2readme.py && \
	if diff -r -x __pycache__ $$tmp/fglit fglit && diff -r $$tmp/nbs nbs && diff $$tmp/README.md README.md; then \
		echo "check-sync: fglit/, nbs/ and README.md are in sync with the notebooks"; rm -rf $$tmp; \
	else echo "check-sync: out of sync (the diff above); run nbdev_export, nbdev_clean, .ci/redact_outputs.py and .ci/nb2readme.py, then commit"; rm -rf $$tmp; exit 1; fi

# What `nbdev_proc_nbs` does, without its Quarto installer (Quarto cannot be installed offline); then every page
# rendered to _site/ without Quarto and checked (no leaked directives or Quarto attributes, no local paths, no
# warnings, every figure): .ci/render_docs.py. With Quarto installed, `nbdev_docs` renders _proc/ as usual.
docs-proc: setup
	$(BIN)/python .ci/proc_docs.py
	$(BIN)/python .ci/render_docs.py

docs: docs-proc

readme: setup
	$(BIN)/python .ci/nb2readme.py

# Issue #28's benchmark suite, one command: every benchmark at its committed size, rows appended under results/bench
# (hours on 2 cores; see benchmarks/README.md). `bench-tiny` runs each on a tiny size into benchmarks/work/tiny.
# BENCH_ARGS passes options on (e.g. --only NAME, --devices cuda cpu).
bench: setup
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/suite.py $(BENCH_ARGS)

bench-tiny: setup
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/suite.py --size tiny $(BENCH_ARGS)

# Long runs whose results are committed (not part of `make test`).
reproduce-baselines: setup
	$(BIN)/nbdev_test --flags slow --path nbs/12_compare.ipynb

# O-pFGL's tables and figures (3 seeds; resumes from results/opfgl/runs.csv; about 1.5 CPU-hours on 2 cores)
# and its speed benchmark (results/bench/opfgl_speed.json).
reproduce-opfgl: setup
	$(BIN)/fglit reproduce opfgl --tables 1 5 1b 4 7 --jobs 2
	$(BIN)/fglit reproduce opfgl --tables 17 18 --jobs 2
	$(BIN)/fglit reproduce opfgl --tables 11 22 25 --seeds 0 --jobs 2
	$(BIN)/fglit reproduce opfgl --tables fig3 fig7 fig9 fig8 fig10 --seeds 0 --jobs 2
	$(BIN)/nbdev_test --flags slow --path nbs/papers/21_opfgl_results.ipynb
	$(BIN)/python benchmarks/opfgl_speed.py

# fglit on the partitions the authors' code made (committed under results/<paper>/authors_partitions/; the authors'
# code itself is never run from here), then results/<paper>/authors_code.csv rebuilt beside the authors' own rows.
reproduce-authors: setup
	$(BIN)/fglit reproduce opfgl-authors --jobs $(JOBS)
	$(BIN)/fglit reproduce fedpg-authors --seeds 0 1 2 --jobs $(JOBS)
	$(BIN)/fglit reproduce gpfl-authors --seeds 0 1 2 --jobs $(JOBS)
	$(BIN)/python -c "import fglit.papers.opfgl as o, fglit.papers.fedpg as f, fglit.papers.gpfl as g; [m.write_authors_code() for m in (o, f, g)]"

reproduce-fedgls: setup
	$(BIN)/fglit reproduce fedgls --tables tune --seeds 0 1 --jobs 2
	$(BIN)/fglit reproduce fedgls --tables 1 --jobs 2
	$(BIN)/fglit reproduce fedgls --tables fig3 --datasets Cora --jobs 2
	$(BIN)/fglit reproduce fedgls --tables 2 3 ablation --jobs 2

# GPFL's Table 2 at the issue's minimum, fold 0 x 3 repeats of every method in all 18 settings; it resumes
# from results/gpfl/runs.csv, so only what is missing runs (nothing since 2026-11-22: all 594 runs are in).
# All five folds: add --folds 0 1 2 3 4. The figures' full-size calls are in nbs/papers/32_gpfl_analysis.
reproduce-gpfl: setup
	$(BIN)/fglit reproduce gpfl --seeds 0 1 2 --folds 0 --jobs $(JOBS)

# FedPG's Tables V-X and its figures at one seed (the paper ran 10: --seeds 0 1 2 3 4 5 6 7 8 9), resuming
# from results/fedpg/runs.csv and results/fedpg/figures.csv.
reproduce-fedpg: setup
	$(BIN)/fglit reproduce fedpg --seeds 0 --jobs $(JOBS)
	$(BIN)/fglit reproduce fedpg-figures --seeds 0 --jobs $(JOBS)

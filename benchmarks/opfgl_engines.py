"""O-pFGL end to end on Cora (Louvain+, 10 clients, the paper's settings) under both simulation engines, side by side,
per seed: the issue's target is <= 10 s per seed on 2 cores at the same accuracy (mean of 3 seeds within 1 point).

    .venv/bin/python benchmarks/opfgl_engines.py                 # seeds 0 1 2, sequential and stacked
    .venv/bin/python benchmarks/opfgl_engines.py --stage-workers 1 2   # and stacked with its stages in 2 processes
    .venv/bin/python benchmarks/opfgl_engines.py --stage-workers 1 2 --surrogate-kernels torch c   # and each with the surrogate graph in C
    .venv/bin/python benchmarks/opfgl_engines.py --engines stacked --stage-workers 1 2 --surrogate-kernels c --stage-kernels torch c   # the stages in C too
    .venv/bin/python benchmarks/opfgl_engines.py --flush-denormal off on --out results/bench/denormals_ab.csv   # denormals kept / flushed
    .venv/bin/python benchmarks/opfgl_engines.py --seeds 0 --out /tmp/o.csv --set surrogate_iters=50 stage1_iters=50 finetune_iters=50

Appends one row per (seed, engine) to results/bench/opfgl_engines.csv: simulation wall time (statistics, the server's
surrogate graph, both stages, scoring), the surrogate graph's and each stage's time, accuracy, machine, load, threads and commit.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="Cora")
    ap.add_argument("--partition", default="louvain+")
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--engines", nargs="+", default=["sequential", "stacked"], choices=["sequential", "stacked"])
    ap.add_argument("--stage-workers", type=int, nargs="+", default=[1], metavar="N",
                    help="the stacked engine once per N: its two stages shared by N forked processes (O-pFGL's stage_workers)")
    ap.add_argument("--surrogate-kernels", nargs="+", default=["torch"], choices=["torch", "c"],
                    help="the stacked engine once per kernel of the surrogate graph (O-pFGL's surrogate_kernel; 'c' compiles a small C routine and runs on the CPU only: left out on CUDA)")
    ap.add_argument("--stage-kernels", nargs="+", default=["torch"], choices=["torch", "c"],
                    help="the stacked engine once per kernel of the two stages (O-pFGL's stage_kernel; 'c' compiles a small C routine "
                         "for the CPU's 2-layer kipfgcn: where it does not cover the run, the torch path trains and the row says so)")
    ap.add_argument("--flush-denormal", nargs="+", default=["on"], choices=["on", "off"],
                    help="each run once per mode of the CPU's denormal floats (FGLIT_FLUSH_DENORMAL; 'on off' measures "
                         "both side by side, alternating within each seed)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="O-pFGL settings over the paper's (e.g. shorter schedules for a smoke run)")
    ap.add_argument("--out", type=Path, default=REPO / "results" / "bench" / "opfgl_engines.csv")
    o = ap.parse_args()
    import torch
    torch.set_num_threads(1)
    from fglit.data import load_dataset
    from fglit.federation import get_algorithm, git_commit, make_config, simulate
    from fglit.partition import partition
    from fglit.reproduction import append_row
    from benchmarks._common import device_name, opfgl_parts
    from fglit.cli import parse_settings          # the CLI's --set: numbers and booleans typed
    extra = parse_settings(o.set)
    from fglit.core import get_device
    from fglit.algorithms.opfgl_kernel import check_kernel_setting, device_reason
    algo, ds = get_algorithm("opfgl"), load_dataset(o.dataset)
    # what holds for every graph of this run (device, hops): where the C routine cannot run, a 'c' run would be a torch one
    why = check_kernel_setting(make_config(algo.config, {**algo.defaults_for(ds.name, o.partition), **extra}), True, get_device())
    if why and "c" in o.surrogate_kernels:
        print(f"surrogate kernel 'c' left out: {why}", file=sys.stderr)
        o.surrogate_kernels = [k for k in o.surrogate_kernels if k != "c"] or ["torch"]
    if device_reason(get_device()) and "c" in o.stage_kernels:      # (the stages' other limits: the row says what trained)
        print(f"stage kernel 'c' left out: {device_reason(get_device())}", file=sys.stderr)
        o.stage_kernels = [k for k in o.stage_kernels if k != "c"] or ["torch"]
    for seed in o.seeds:
        part = partition(ds, o.partition, o.clients, seed=seed)
        runs = [(e, w, k, sk) for e in o.engines for k in (o.surrogate_kernels if e == "stacked" else ["torch"])
                for sk in (o.stage_kernels if e == "stacked" else ["torch"]) for w in (o.stage_workers if e == "stacked" else [1])]
        for (engine, workers, kernel, stage_kernel), flush in ((run, f) for run in runs for f in o.flush_denormal):
            os.environ["FGLIT_FLUSH_DENORMAL"] = "1" if flush == "on" else "0"   # read by the loop's cpu_compute()
            config = make_config(algo.config, {**algo.defaults_for(ds.name, o.partition), **extra, "engine": engine,
                                               "stage_workers": workers, "surrogate_kernel": kernel, "stage_kernel": stage_kernel})
            box = {}
            t = time.perf_counter()
            r = simulate(algo, part.clients, ds.task, ds.num_features, ds.num_classes, config, seed=seed, progress=False,
                         callback=lambda rnd, server, clients: box.update(server=server, logs=[dict(c.log) for c in clients]))
            row = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), machine=platform.node(),
                       cpus=os.cpu_count(), load=round(os.getloadavg()[0], 2), threads=1, commit=git_commit()[:12],
                       dataset=ds.name, partition=o.partition, clients=o.clients, settings=" ".join(o.set), seed=seed, engine=engine, stage_workers=workers, device=device_name(),
                       flush_denormal=flush,
                       # the kernel that trained the stages ('c' asked for where it does not cover the run trains with torch)
                       stage_kernel=box["logs"][0].get("stage_kernel", "torch"),
                       simulate_s=time.perf_counter() - t,
                       # the kernel that built the graph ('c' asked for on a graph it does not cover is built, and written, as torch)
                       **opfgl_parts(box["server"], box["logs"], engine),
                       accuracy=float(r.scores()["accuracy"]), f1_macro=float(r.scores()["f1_macro"]))
            print(row, flush=True)
            append_row(o.out, row)
    return 0


if __name__ == "__main__":
    sys.exit(main())

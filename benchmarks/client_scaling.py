"""The client-scaling curve (issue #28): the same graph split into more and more clients, FedAvg on each split with the
sequential engine and the stacked engine (`engine="stacked"`, fglit.fl.stacked), side by side in one process per split.

    .venv/bin/python benchmarks/client_scaling.py            # a 200k-node synthetic graph, METIS, 10 100 1000 10000 clients
    .venv/bin/python benchmarks/client_scaling.py --clients 4 8 --rounds 1 --out /tmp/smoke.csv   # the tiny size CI runs

One row per (clients, engine) appended to results/bench/client_scaling.csv as each ends: wall time of the simulation
(`SeedRun.wall_time_s`: building the clients, every round's training and aggregation, and the scoring, by default once
after the last round: `--eval-every`), the partition's time,
the accuracy, and the machine, load, threads and commit. One torch thread (OMP_NUM_THREADS=1).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks._common import RowLog, run_stage, short_commit, stage_env  # noqa: E402

STAGE = r'''
import json, sys, time
import torch
from fglit.core import peak_rss_mb
torch.set_num_threads(1)
dataset, partition_name, k, rounds, epochs, engines, seed, eval_every = json.loads(sys.argv[1])
from benchmarks._common import bench_dataset, device_name
from fglit.federation import get_algorithm, simulate
from fglit.fl.config import make_config
from fglit.partition import partition
ds = bench_dataset(dataset)
t = time.perf_counter()
parts = partition(ds, partition_name, k, seed=seed, cache=False)
partition_s = time.perf_counter() - t
algo = get_algorithm("fedavg")
for engine in engines:
    cfg = make_config(algo.config, {"rounds": rounds, "local_epochs": epochs, "engine": engine, "eval_every": eval_every or rounds})
    r = simulate(algo, parts.clients, "node", ds.num_features, ds.num_classes, cfg, seed=seed, progress=False)
    print(json.dumps(dict(engine=engine, device=device_name(), partition_s=partition_s, simulate_s=r.wall_time_s,
                          test_accuracy=float(r.per_round().test_accuracy.iloc[-1]),
                          peak_rss_mb=peak_rss_mb())), flush=True)
'''

FIELDS = ["date", "machine", "cpus", "load", "threads", "commit", "dataset", "partition", "clients", "rounds", "local_epochs", "eval_every",
          "engine", "device", "partition_s", "simulate_s", "test_accuracy", "peak_rss_mb", "error"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="synthetic:100000:1000000:8:32",
                    help="a dataset name, or synthetic:NODES:EDGES:CLASSES:FEATURES (10000 clients need about 10 nodes each for three non-empty splits)")
    ap.add_argument("--partition", default="metis")
    ap.add_argument("--clients", type=int, nargs="+", default=[10, 100, 1000, 10000])
    ap.add_argument("--engines", nargs="+", default=["sequential", "stacked"], choices=["sequential", "stacked"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--local-epochs", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=0, help="score every this many rounds (default 0: once, after the last round, so that the "
                    "curve measures the engines' training; scoring the global model is one pooled pass either way)")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--out", type=Path, default=REPO / "results" / "bench" / "client_scaling.csv")
    o = ap.parse_args()
    env, log = stage_env(), RowLog(o.out, FIELDS)
    base = dict(machine=platform.node(), cpus=os.cpu_count(), load=round(os.getloadavg()[0], 2), commit=short_commit(),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), threads=1,
                dataset=o.dataset, partition=o.partition, rounds=o.rounds, local_epochs=o.local_epochs, eval_every=o.eval_every or o.rounds)
    for k in o.clients:
        rows, error = run_stage(STAGE, [o.dataset, o.partition, k, o.rounds, o.local_epochs, o.engines, o.seed, o.eval_every], env, o.timeout)
        if error:                                   # the engine that was running when it failed
            rows.append(dict(engine=o.engines[min(len(rows), len(o.engines) - 1)], error=error))
        for r in rows:
            log.write(dict(base, clients=k, load=round(os.getloadavg()[0], 2), **r))
    print(log.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())

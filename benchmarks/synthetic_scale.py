"""Synthetic graphs up to the papers' largest size (ogbn-products: 2.4M nodes, 62M edges, 100 features, 47 classes):
wall time and peak memory of each stage: generating the graph (fglit.synthetic), partitioning it (METIS, Louvain)
and a short FedAvg run on the partition.

    .venv/bin/python benchmarks/synthetic_scale.py [--sizes 100000:2500000 2449029:61859140] [--clients 10 100]
        [--partitions metis louvain] [--rounds 1] [--stages generate partition fedavg] [--out results/bench/synthetic_scale.csv]

Each (size, stage) runs in its own process, so its peak resident memory (ru_maxrss) is its own; a stage that runs past
--timeout seconds is recorded as such. One torch thread (OMP_NUM_THREADS=1), as every fglit timing. Rows are appended
with the machine, the load and the commit; `--sizes 2000:10000 --clients 2` is the tiny check CI can afford.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

STAGE = r'''
import json, resource, sys, time
import torch
torch.set_num_threads(1)
from fglit.synthetic import synthetic_graph
n, m, clients, method, rounds, stage = json.loads(sys.argv[1])
t = time.perf_counter()
g = synthetic_graph(n, m, 47, 100, homophily=0.8, feature_signal=0.5, seed=0)
out = {"generate_s": time.perf_counter() - t, "directed_edges": int(g.edge_index.size(1))}
if stage in ("partition", "fedavg"):
    from fglit.own_data import as_dataset
    from fglit.partition import partition
    ds = as_dataset(g, name=f"synthetic-{n}")
    t = time.perf_counter()
    p = partition(ds, method, clients, seed=0, cache=False)
    out["partition_s"] = time.perf_counter() - t
    if stage == "fedavg":
        from fglit.federation import run
        t = time.perf_counter()
        r = run("fedavg", ds, p, rounds=rounds, local_epochs=1, progress=False)
        out.update(fedavg_s=time.perf_counter() - t, accuracy=float(r.summary()["accuracy_mean"]))
out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(out))
'''


FIELDS = ["date", "machine", "cpus", "load", "threads", "commit", "nodes", "edges", "stage", "partition", "clients",
          "directed_edges", "generate_s", "partition_s", "fedavg_s", "accuracy", "peak_rss_mb", "error"]


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["100000:2500000", "1000000:25000000", "2449029:61859140"], metavar="NODES:EDGES")
    ap.add_argument("--clients", type=int, nargs="+", default=[10, 100])
    ap.add_argument("--partitions", nargs="+", default=["metis", "louvain"])
    ap.add_argument("--stages", nargs="+", default=["generate", "partition", "fedavg"])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--out", type=Path, default=REPO / "results" / "bench" / "synthetic_scale.csv")
    o = ap.parse_args()
    from fglit.reproduction import append_row
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    base = dict(machine=platform.node(), cpus=os.cpu_count(), load=round(os.getloadavg()[0], 2), commit=commit(),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), threads=1)
    jobs = [(size, "generate", None, None) for size in o.sizes if "generate" in o.stages]
    jobs += [(size, stage, method, k) for size in o.sizes for stage in ("partition", "fedavg") if stage in o.stages
             for method in o.partitions for k in o.clients]
    rows = []
    for size, stage, method, k in jobs:
        n, m = (int(v) for v in size.split(":"))
        args = json.dumps([n, m, k, method, o.rounds, stage])
        row = dict(base, nodes=n, edges=m, stage=stage, partition=method, clients=k)
        try:
            out = subprocess.run([sys.executable, "-c", STAGE, args], capture_output=True, text=True, env=env, timeout=o.timeout)
            row.update(json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else
                       dict(error=(out.stderr.strip().splitlines() or ["?"])[-1][:200]))
        except subprocess.TimeoutExpired:
            row.update(error=f"over {o.timeout:.0f} s")
        print(json.dumps(row), flush=True)
        append_row(o.out, {k: row.get(k) for k in FIELDS})        # each row as it ends: one whole line, torn rows repaired
        rows.append(row)
    print(f"appended {len(rows)} rows to {o.out.relative_to(REPO) if o.out.is_relative_to(REPO) else o.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

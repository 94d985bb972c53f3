"""Synthetic graphs up to the papers' largest size (ogbn-products: 2.4M nodes, 62M edges, 100 features, 47 classes):
wall time and peak memory of each stage: generating the graph (fglit.synthetic), partitioning it (METIS, Louvain),
a short FedAvg run on the partition, and O-pFGL on it (the surrogate graph and each training stage timed apart).

    .venv/bin/python benchmarks/synthetic_scale.py [--sizes 100000:2500000 2449029:61859140] [--clients 10 100]
        [--partitions metis louvain louvain:igraph louvain:sknetwork] [--rounds 1] [--stages generate partition fedavg opfgl]
        [--opfgl-set stage1_iters=100 finetune_iters=100 stage_workers=2] [--graph-cache DIR] [--out results/bench/synthetic_scale.csv]
    .venv/bin/python benchmarks/synthetic_scale.py --sizes 2449029:61859140 --clients 10 100 --stages edges --graph-cache DIR

Each (size, stage) runs in its own process, so its peak resident memory (ru_maxrss) is its own; a stage that runs past
--timeout seconds is recorded as such. One torch thread (OMP_NUM_THREADS=1), as every fglit timing. Rows are appended
with the machine, the load and the commit; `--sizes 2000:10000 --clients 2` is the tiny check CI can afford.

A partition `louvain:igraph` (or `louvain+:igraph`, `louvain:sknetwork`) is that partitioner with
`louvain_backend='igraph'` (the `igraph` extra; `sknetwork` the `sknetwork` extra); plain `louvain` is networkx's.
With --graph-cache DIR the partition and fedavg stages generate each graph once,
keep it in DIR (torch.save of x, edge_index, y; not committed) and load it (memory-mapped) in later stages: their rows
then have `graph=cache` and the load time in `load_s` instead of `generate_s` (peak memory still counts the graph);
a graph not in DIR yet is generated first by a generate stage of its own (its row is recorded).
The fedavg stage runs on fglit's device (FGLIT_DEVICE) with each of --engines on one partition, a row per engine: the
row names the engine and the device and, on CUDA, the peak of the GPU memory torch allocated for that engine
(`cuda_peak_mb`); its `peak_rss_mb` is the process's peak so far (the engines before it included). Generating and
partitioning run on the CPU.

The opfgl stage runs O-pFGL (the paper's settings, with --opfgl-set over them: a shorter schedule at this size; stage_workers applies to the stacked engine) once per
--engines on one partition, a row per engine, each engine in a process of its own: `opfgl_s` the whole run, `surrogate_s`, `stage1_s`, `stage2_s` its parts
(the stacked engine's stages are one shared computation; the sequential one's the clients' sum) and the settings used;
`peak_rss_mb` is the process's own peak and `worker_peak_rss_mb` the largest forked stage worker's (`stage_workers`; 0 without one):
a worker starts as a copy-on-write copy of the process, so the pages the two share count in both.
With --graph-cache, a partition stage also keeps its partition there as a partition file, and the fedavg and opfgl stages
load it when it is there (`partition_load_s`) instead of partitioning: their `peak_rss_mb` is then their own, not the
partitioner's (METIS at 2.4M nodes peaks at 21 GB); for the opfgl stage a partition not in the cache yet is made first by
a partition stage of its own (its row recorded).
Every row with a partition records `inside_edges`, the share of the graph's directed edges whose two ends are in one
client (the edges the clients' GNNs propagate over); the edges stage records only that, for a kept partition, in seconds.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks._common import RowLog, run_stage, short_commit, stage_env, stage_outcome  # noqa: E402

STAGE = r'''
import json, os, sys, time
import torch
from fglit.core import peak_rss_mb
torch.set_num_threads(1)
from fglit.synthetic import synthetic_graph
n, m, clients, method, rounds, stage, path, part_file, eval_every, engines, opfgl_settings, stack_rows = json.loads(sys.argv[1])
from pathlib import Path
path, part_file = (Path(f) if f else None for f in (path, part_file))      # the graph cache's files (None: no cache)
t = time.perf_counter()
if path is not None and path.exists() and stage != "generate":
    from torch_geometric.data import Data
    st = torch.load(path, mmap=True, weights_only=True)
    g = Data(x=st["x"], edge_index=st["edge_index"], y=st["y"], num_nodes=n)
    out = {"load_s": time.perf_counter() - t, "graph": "cache"}
else:
    g = synthetic_graph(n, m, 47, 100, homophily=0.8, feature_signal=0.5, seed=0)
    out = {"generate_s": time.perf_counter() - t, "graph": "generated"}
    if path is not None and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")      # its own name: two runs at once (the suite's --jobs) may both write
        torch.save({"x": g.x, "edge_index": g.edge_index, "y": g.y}, tmp)
        tmp.rename(path)
out["directed_edges"] = int(g.edge_index.size(1))
if stage in ("partition", "fedavg", "opfgl", "edges"):
    from fglit.own_data import as_dataset
    from fglit.partition import load_partition_file, partition, save_partition_file
    ds = as_dataset(g, name=f"synthetic-{n}")
    name, _, backend = method.partition(":")
    t = time.perf_counter()
    if stage in ("fedavg", "opfgl", "edges") and part_file is not None and part_file.exists():     # the partition stage's, kept in the cache
        p = load_partition_file(ds, part_file)
        out["partition_load_s"] = time.perf_counter() - t
    else:
        p = partition(ds, name, clients, seed=0, cache=False, **({"louvain_backend": backend} if backend else {}))
        out["partition_s"] = time.perf_counter() - t
        if stage == "partition" and part_file is not None:
            tmp = part_file.with_name(f"{part_file.stem}.{os.getpid()}.tmp.npz")
            save_partition_file(p, tmp); tmp.rename(part_file)
    sizes = torch.bincount(p.assignment[p.assignment >= 0], minlength=clients)
    out.update(covered=int(p.covered), min_client=int(sizes.min()), max_client=int(sizes.max()),
               communities=p.info.get("communities"))
    from fglit.partition_reports import edge_counts      # the share of the graph's (directed) edges with both ends in one client: the edges it trains on
    out["inside_edges"] = edge_counts(g.edge_index, p.assignment)[0] / max(1, g.edge_index.size(1))
    if stage == "fedavg":                      # each engine on the same partition, one row each
        from fglit.federation import run
        from benchmarks._common import device_name
        from fglit.fl.config import FedConfig
        for engine, rows in [(e, r) for e in engines for r in ((stack_rows or [FedConfig().stack_rows]) if e == "stacked" else [None])]:
            if torch.cuda.is_initialized():
                torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            r = run("fedavg", ds, p, rounds=rounds, local_epochs=1, progress=False,
                    settings={"eval_every": eval_every or rounds, "engine": engine, **({"stack_rows": rows} if rows is not None else {})})
            row = dict(out, engine=engine, stack_rows=rows, fedavg_s=time.perf_counter() - t, accuracy=float(r.summary()["accuracy_mean"]),
                       device=device_name(), peak_rss_mb=peak_rss_mb())
            if torch.cuda.is_initialized():
                row["cuda_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
            print(json.dumps(row), flush=True)
            del r
    if stage == "opfgl":                       # O-pFGL with each engine on the same partition, one row each
        from fglit.federation import run
        from benchmarks._common import device_name, opfgl_parts
        from fglit.algorithms.opfgl import OpFGLConfig
        for engine in engines:
            if torch.cuda.is_initialized():
                torch.cuda.reset_peak_memory_stats()
            box, settings = {}, {**opfgl_settings, "engine": engine}        # (engine_settings: what this engine runs with)
            t = time.perf_counter()
            r = run("opfgl", ds, p, progress=False, settings=settings,
                    callback=lambda rnd, server, clients: box.update(server=server, logs=[dict(c.log) for c in clients]))
            row = dict(out, engine=engine, stage_workers=settings.get("stage_workers", 1), opfgl_s=time.perf_counter() - t,
                       stack_rows=settings.get("stack_rows", OpFGLConfig().stack_rows) if engine == "stacked" else None,
                       **opfgl_parts(box["server"], box["logs"], engine),
                       accuracy=float(r.summary()["accuracy_mean"]), device=device_name(),
                       peak_rss_mb=peak_rss_mb())
            if torch.cuda.is_initialized():
                row["cuda_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
            print(json.dumps(row), flush=True)
            del r, box
if stage not in ("fedavg", "opfgl"):           # (those stages printed a row per engine)
    out["peak_rss_mb"] = peak_rss_mb()
    print(json.dumps(out))
'''


FIELDS = ["date", "machine", "cpus", "load", "threads", "commit", "nodes", "edges", "stage", "partition", "clients",
          "rounds", "eval_every", "directed_edges", "generate_s", "partition_s", "fedavg_s", "accuracy", "peak_rss_mb", "error", "graph", "load_s",
          "covered", "min_client", "max_client", "communities", "engine", "device", "cuda_peak_mb",
          "opfgl_s", "surrogate_s", "stage1_s", "stage2_s", "surrogate_kernel", "settings", "stage_workers", "stack_rows", "partition_load_s", "inside_edges",
          "worker_peak_rss_mb"]


def engine_settings(settings: dict, engine: str) -> dict:
    "The opfgl stage's settings as `engine` runs them: processes and stacks are the stacked engine's, so the sequential one runs without them."
    return {k: v for k, v in settings.items() if engine == "stacked" or k not in ("stage_workers", "stack_rows")}


def graph_file(cache: Path, size: str) -> Path:
    "Where the graph cache keeps the graph of `size` ('NODES:EDGES')."
    return cache / f"synthetic-{size.replace(':', '-')}-47c-100f-h0.8-s0.pt"


def partition_file(cache: Path, size: str, method: str | None, clients: int | None) -> Path:
    "Where the graph cache keeps that graph's partition by `method` into `clients` clients (a partition file, seed 0)."
    return graph_file(cache, size).with_name(f"{graph_file(cache, size).stem}-{str(method).replace(':', '-')}-k{clients}-s0.npz")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["100000:2500000", "1000000:25000000", "2449029:61859140"], metavar="NODES:EDGES")
    ap.add_argument("--clients", type=int, nargs="+", default=[10, 100])
    ap.add_argument("--partitions", nargs="+", default=["metis", "louvain"])
    ap.add_argument("--stages", nargs="+", default=["generate", "partition", "fedavg"], choices=["generate", "partition", "fedavg", "opfgl", "edges"])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--engines", nargs="+", default=["sequential"], choices=["sequential", "stacked"],
                    help="the fedavg and opfgl stages run each, in this order, on one partition (one row each)")
    ap.add_argument("--stack-rows", type=int, nargs="+", default=[],
                    help="the fedavg stage runs the stacked engine once per value of stack_rows (default: the engine's default)")
    ap.add_argument("--opfgl-set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="the opfgl stage's settings over the paper's (e.g. stage1_iters=100 finetune_iters=100 stage_workers=2)")
    ap.add_argument("--eval-every", type=int, default=0, help="the FedAvg stage scores every this many rounds (default 0: once, after the last "
                    "round: at 2.4M nodes x 47 classes, scoring every round, AUC included, took most of each round)")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--graph-cache", type=Path, default=None, help="keep each generated graph here; later stages load it")
    ap.add_argument("--out", type=Path, default=REPO / "results" / "bench" / "synthetic_scale.csv")
    o = ap.parse_args()
    env, log = stage_env(), RowLog(o.out, FIELDS)
    base = dict(machine=platform.node(), cpus=os.cpu_count(), commit=short_commit(), threads=1)
    cached = lambda size: o.graph_cache is not None and graph_file(o.graph_cache, size).exists()
    needs_graph = bool({"partition", "fedavg", "opfgl", "edges"} & set(o.stages)) and o.graph_cache is not None
    jobs = [(size, "generate", None, None, o.engines) for size in o.sizes if "generate" in o.stages or (needs_graph and not cached(size))]
    for size in o.sizes:
        for stage in ("partition", "fedavg", "opfgl", "edges"):
            if stage not in o.stages: continue
            for method in o.partitions:
                for k in o.clients:
                    if (stage == "opfgl" and o.graph_cache is not None and "partition" not in o.stages
                            and not partition_file(o.graph_cache, size, method, k).exists()):
                        jobs.append((size, "partition", method, k, o.engines))   # its partition file, made apart (its own peak memory)
                    # O-pFGL: a process per engine (the partition is loaded, not made again), so each row's peak memory is its own
                    jobs += [(size, stage, method, k, [e]) for e in o.engines] if stage == "opfgl" else [(size, stage, method, k, o.engines)]
    from fglit.cli import parse_settings      # the CLI's --set: numbers and booleans typed
    opfgl_settings = parse_settings(o.opfgl_set)
    for size, stage, method, k, engines in jobs:
        n, m = (int(v) for v in size.split(":"))
        used = engine_settings(opfgl_settings, engines[0]) if stage == "opfgl" else {}    # an opfgl job runs one engine
        row = dict(base, nodes=n, edges=m, stage=stage, partition=method, clients=k, rounds=o.rounds if stage == "fedavg" else None,
                   eval_every=(o.eval_every or o.rounds) if stage == "fedavg" else None,
                   settings=" ".join(f"{key}={v}" for key, v in used.items()) if stage == "opfgl" else None,   # what its engine ran with
                   load=round(os.getloadavg()[0], 2),
                   date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
        files = [str(graph_file(o.graph_cache, size)), str(partition_file(o.graph_cache, size, method, k))] if o.graph_cache else [None, None]
        results, error = run_stage(STAGE, [n, m, k, method, o.rounds, stage, *files, o.eval_every, engines, used, o.stack_rows], env, o.timeout)
        for result in results:                 # the fedavg stage: one result per engine
            log.write({**row, **result})
        if error or not results:               # and the error that ended it, after the results it printed first
            log.write({**row, **stage_outcome([], error)})
    print(log.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())

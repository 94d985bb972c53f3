"""Louvain community detection at scale: networkx against C/C++ implementations, on fglit.synthetic graphs.

    .venv/bin/python benchmarks/louvain_backends.py [--sizes 100000:2500000 1000000:25000000 2449029:61859140]
        [--backends networkx igraph sknetwork networkit] [--timeout 900] [--no-other-seed] [--graph-cache DIR]
        [--out results/bench/louvain_backends.csv]

The graphs are `synthetic_graph(nodes, edges, 47 classes, 4 features, homophily 0.8, feature_signal 0.5, seed 0)`:
the edges are drawn before the features, so they are the edges of the 100-feature graph synthetic_scale.py times.
Each graph is generated once in its own process and its edge_index kept in --cache (an .npy file, not committed),
or taken from synthetic_scale.py's --graph-cache DIR when that holds the graph (same edges);
each (size, backend) then runs in a fresh process, so its peak resident memory (ru_maxrss, edge_index loaded
included) is its own. A run: the Louvain step of the partitioner (`louvain_labels`: simple undirected edges,
the backend's graph, Louvain at resolution 1 with seed 0, canonical labels) timed once, then again with seed 0 (same
communities?) and once with seed 1 (differing communities are allowed; --no-other-seed leaves it out). `networkit` (PLM, one thread, refine=False,
seeded with networkit.engineering.setSeed) is measured here only; fglit has the networkx, igraph and sknetwork backends.
Modularity is computed the same way for every backend (numpy, resolution 1). A run past --timeout seconds or
out of memory (--max-rss-gb, an address-space limit) is recorded with its error.
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
sys.path.insert(0, str(REPO))
from benchmarks._common import RowLog, run_stage, short_commit, stage_env, stage_outcome  # noqa: E402

GENERATE = r'''
import json, sys, time, numpy as np
from pathlib import Path
n, m, path, graph_cache = json.loads(sys.argv[1])
t = time.perf_counter()
kept = Path(graph_cache) / f"synthetic-{n}-{m}-47c-100f-h0.8-s0.pt" if graph_cache else None
if kept is not None and kept.exists():
    import torch
    np.save(path, torch.load(kept, mmap=True, weights_only=True)["edge_index"].numpy())
    print(json.dumps({"copied_from": str(kept), "s": time.perf_counter() - t}))
else:
    from fglit.synthetic import synthetic_graph
    g = synthetic_graph(n, m, 47, 4, homophily=0.8, feature_signal=0.5, seed=0)
    np.save(path, g.edge_index.numpy())
    print(json.dumps({"generate_s": time.perf_counter() - t}))
'''

MEASURE = r'''
import json, resource, sys, time, numpy as np
n, path, backend, max_rss_gb, other_seed = json.loads(sys.argv[1])
if max_rss_gb:
    resource.setrlimit(resource.RLIMIT_AS, (int(max_rss_gb * 2**30), resource.RLIM_INFINITY))
from fglit.partition_community import louvain_labels, _simple_edges, _canonical
ei = np.load(path)

def networkit_labels(edge_index, num_nodes, seed):
    import networkit as nk
    nk.setNumberOfThreads(1)
    nk.engineering.setSeed(int(seed), False)
    u, v = _simple_edges(edge_index, num_nodes)
    G = nk.graph.Graph(num_nodes)
    G.addEdges((u, v))
    del u, v
    plm = nk.community.PLM(G, refine=False, gamma=1.0, par="none")
    plm.run()
    return _canonical(np.asarray(plm.getPartition().getVector(), dtype=np.int64))

def labels(seed):
    if backend == "networkit": return networkit_labels(ei, n, seed)
    return louvain_labels(ei, n, seed=seed, resolution=1.0, backend=backend)

def modularity(lab):
    a, b = ei[0], ei[1]
    keep = a < b                     # each undirected edge once (the graph is simple and symmetric)
    a, b = a[keep], b[keep]
    m = len(a)
    inside = np.bincount(lab[a][lab[a] == lab[b]], minlength=lab.max() + 1)
    deg = np.bincount(np.concatenate([a, b]), minlength=n)
    vol = np.bincount(lab, weights=deg, minlength=lab.max() + 1)
    return float(inside.sum() / m - ((vol / (2 * m)) ** 2).sum())

t = time.perf_counter()
first = labels(0)
out = {"louvain_s": time.perf_counter() - t, "rss_after_first_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
       "communities": int(first.max()) + 1, "largest_community": int(np.bincount(first).max()), "modularity": modularity(first)}
t = time.perf_counter()
again = labels(0)
out["repeat_s"] = time.perf_counter() - t
out["same_seed_same"] = bool(np.array_equal(first, again))
if other_seed:
    other = labels(1)
    out["seed1_same"] = bool(np.array_equal(first, other))
    out["seed1_modularity"] = modularity(other)
out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(out))
'''

FIELDS = ["date", "machine", "cpus", "load", "threads", "commit", "nodes", "edges", "backend", "version", "louvain_s",
          "repeat_s", "communities", "largest_community", "modularity", "same_seed_same", "seed1_same", "seed1_modularity",
          "rss_after_first_mb", "peak_rss_mb", "error"]


DISTRIBUTION = {"sknetwork": "scikit-network"}     # a backend's package on PyPI, where its name differs


def version(backend: str) -> str:
    from importlib.metadata import PackageNotFoundError, version as v
    try:
        return v(DISTRIBUTION.get(backend, backend))
    except PackageNotFoundError:
        return ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["100000:2500000", "1000000:25000000", "2449029:61859140"], metavar="NODES:EDGES")
    ap.add_argument("--backends", nargs="+", default=["networkx", "igraph", "sknetwork", "networkit"])
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--max-rss-gb", type=float, default=16.0, help="address-space limit of each run (0: none)")
    ap.add_argument("--other-seed", action=argparse.BooleanOptionalAction, default=True, help="also run seed 1")
    ap.add_argument("--graph-cache", type=Path, default=None, help="synthetic_scale.py's --graph-cache: take the edges from there")
    ap.add_argument("--cache", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "fglit-louvain-bench")
    ap.add_argument("--out", type=Path, default=REPO / "results" / "bench" / "louvain_backends.csv")
    o = ap.parse_args()
    env, log = stage_env(), RowLog(o.out, FIELDS)
    o.cache.mkdir(parents=True, exist_ok=True)
    base = dict(machine=platform.node(), cpus=os.cpu_count(), commit=short_commit(), threads=1)
    for size in o.sizes:
        n, m = (int(v) for v in size.split(":"))
        path = o.cache / f"synthetic-{n}-{m}-edge_index.npy"
        if not path.exists():
            out = subprocess.run([sys.executable, "-c", GENERATE, json.dumps([n, m, str(path), str(o.graph_cache) if o.graph_cache else None])], capture_output=True,
                                 text=True, env=env)
            if out.returncode != 0:
                print(out.stderr, file=sys.stderr)
                return 1
            print(f"edges of {n} nodes / {m} edges: {out.stdout.strip()}", flush=True)
        for backend in o.backends:
            row = dict(base, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       load=round(os.getloadavg()[0], 2), nodes=n, edges=m, backend=backend, version=version(backend))
            results, error = run_stage(MEASURE, [n, str(path), backend, o.max_rss_gb, o.other_seed], env, o.timeout)
            log.write({**row, **stage_outcome(results, error)})
    print(log.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())

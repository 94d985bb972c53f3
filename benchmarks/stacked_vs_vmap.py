"""The two ways issue #28 names to train many clients at once, measured side by side on the same splits (one torch thread):

- `block-diagonal` (fglit's stacked engine, fglit.fl.stacked): one padded block-diagonal sparse graph, stacked weights, batched
  dense products and one sparse product per layer;
- `vmap`: `torch.func.vmap` of `grad` of one client's loss over the client axis, each client's graph as a dense padded
  normalised adjacency `[n_max, n_max]` (vmap needs one shape for all clients, and sparse products do not batch under it).

Each row: one training step's forward and backward for every client (median of `--reps`), for a GCN of 2 layers x 64 on a
METIS split. vmap is skipped where its dense adjacencies would pass `--max-dense-gb`.

    .venv/bin/python benchmarks/stacked_vs_vmap.py                 # synthetic 100k nodes, 100 1000 10000 clients
    .venv/bin/python benchmarks/stacked_vs_vmap.py --clients 4 --dataset Cora --reps 1 --out /tmp/s.csv
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks._common import bench_dataset, device_name, short_commit  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="synthetic:100000:1000000:8:32", help="a dataset name or synthetic:NODES:EDGES:CLASSES:FEATURES")
    ap.add_argument("--clients", type=int, nargs="+", default=[100, 1000, 10000])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--max-dense-gb", type=float, default=4.0)
    ap.add_argument("--out", type=Path, default=REPO / "results" / "bench" / "stacked_vs_vmap.csv")
    o = ap.parse_args()
    import torch
    import torch.nn.functional as F
    from torch.func import grad, vmap
    torch.set_num_threads(1)
    from fglit.fl.config import make_config
    from fglit.fl.local_data import LocalData
    from fglit.fl.protocol import ModelSpec, flat_state
    from fglit.fl.stacked import StackedClients
    from fglit.graph_preprocessing import adjacency
    from fglit.partition import partition
    from fglit.reproduction import append_row
    from fglit.algorithms.fedavg import FedAvgConfig
    ds = bench_dataset(o.dataset)
    base = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), machine=platform.node(),
                cpus=os.cpu_count(), threads=1, commit=short_commit(), dataset=o.dataset, device=device_name())
    sync = torch.cuda.synchronize if "cuda" in base["device"] else (lambda: None)   # a CUDA step is timed to its end
    config = make_config(FedAvgConfig, {"dropout": 0.0})
    for k in o.clients:
        data = [LocalData(c, "node") for c in partition(ds, "metis", k, seed=0, cache=False).clients]
        spec = ModelSpec("gcn", ds.num_features, ds.num_classes, "node", 64, 2, 0.0)
        group = StackedClients(data, config, spec, [flat_state(spec.build())] * k)
        active = torch.ones(k, dtype=torch.bool)

        def block_step():
            group.params.zero_grad()
            _, logits = group.train_forward()              # the engine's training pass: the head on the training rows
            group.train_loss(logits, active).backward()

        s, n_max = group.stack, group.stack.n_max
        rows = {"block-diagonal": block_step}
        dense_gb = k * n_max * n_max * 4 / 1e9
        if dense_gb <= o.max_dense_gb:
            A = torch.zeros(k, n_max, n_max, device=s.x.device)
            for i, d in enumerate(data):               # set-up only, outside the timing
                n = d.graph.num_nodes
                A[i, :n, :n] = adjacency(d.graph.edge_index, n, "gcn").to_dense().to(A.device)
            X, Y = s.x.view(k, n_max, -1), s.y.view(k, n_max)
            M = s.masks["train"].view(k, n_max).float()
            params = {name: t.detach().clone() for name, t in group.params.as_dict().items()}

            def client_loss(p, x, a, y, mask):
                h = x
                for i in range(spec.layers):
                    h = F.relu(a @ (h @ p[f"encoder.convs.{i}.weight"]) + p[f"encoder.convs.{i}.bias"])
                logits = h @ p["head.1.weight"].T + p["head.1.bias"]
                return (F.cross_entropy(logits, y, reduction="none") * mask).sum() / mask.sum().clamp(min=1)

            per_client_grad = vmap(grad(client_loss))
            rows["vmap"] = lambda: per_client_grad(params, X, A, Y, M)
        for method, step in rows.items():
            step(); sync()                                  # warm-up
            times = []
            for _ in range(o.reps):
                t = time.perf_counter(); step(); sync(); times.append(time.perf_counter() - t)
            row = dict(base, load=round(os.getloadavg()[0], 2), clients=k, n_max=n_max, method=method, step_s=statistics.median(times),
                       dense_adjacency_gb=round(dense_gb, 3))
            print(row, flush=True)
            append_row(o.out, row)
        if "vmap" not in rows:
            append_row(o.out, dict(base, load=round(os.getloadavg()[0], 2), clients=k, n_max=n_max, method="vmap",
                                   dense_adjacency_gb=round(dense_gb, 3), skipped=f"dense adjacencies {dense_gb:.1f} GB > {o.max_dense_gb} GB"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

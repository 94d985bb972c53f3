"""Every registered algorithm on one device, for a CPU-vs-CUDA comparison at the same seed; plus timings.

    FGLIT_DEVICE=cpu  python benchmarks/device_compare.py algorithms --out work/cpu.csv
    FGLIT_DEVICE=cuda python benchmarks/device_compare.py algorithms --out work/cuda.csv
    python benchmarks/device_compare.py diff work/cpu.csv work/cuda.csv --out results/bench/device_compare.csv
    FGLIT_DEVICE=cuda python benchmarks/device_compare.py timings --out results/bench/timings_cuda.csv

`algorithms`: each algorithm for `--rounds` rounds on a node dataset and a graph dataset (one seed), with the
per-round validation and test accuracy; an algorithm that refuses a task is recorded with its refusal.
`diff`: one row per (algorithm, task): the final scores on both devices and the largest per-round difference.
`timings`: FedAvg on Cora as `make demo` runs it (100 rounds x 3 epochs, 10 Louvain clients), and the
client-scaling run (tolokers, METIS, FedAvg 5 rounds x 1 epoch at 10, 100 and 1000 clients).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import pandas as pd
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks._common import device_name  # noqa: E402

TASKS = {"node": ("Cora", "louvain", 5), "graph": ("PROTEINS", "dirichlet", 5)}


def _sync() -> None:
    from fglit.core import get_device
    if get_device().type == "cuda":
        torch.cuda.synchronize()


def algorithms(out: Path, rounds: int, only: list[str] | None, settings: dict | None = None) -> pd.DataFrame:
    from fglit.data import load_dataset
    from fglit.federation import ALGORITHMS, ConfigError, get_algorithm, run
    get_algorithm("fedavg")
    names = only or sorted(ALGORITHMS)
    rows = []
    for task, (dataset, partition, clients) in TASKS.items():
        ds = load_dataset(dataset)
        for name in names:
            row = dict(algorithm=name, task=task, dataset=dataset, partition=partition, clients=clients, rounds=rounds,
                       settings=json.dumps(settings or {}), device=device_name())
            start = time.perf_counter()
            try:
                try:
                    result = run(name, ds, partition, clients, rounds=rounds, seeds=[0], progress=False, settings=settings)
                except ConfigError as err:
                    if "rounds must be" not in str(err):
                        raise
                    result = run(name, ds, partition, clients, seeds=[0], progress=False, settings=settings)  # one-shot: its own rounds
                row["rounds"] = result.config["rounds"]
                _sync()
                seed_run = result.runs[0]
                per_round = seed_run.per_round()
                scores = seed_run.scores()
                row.update(status="ok", accuracy=scores["accuracy"], f1_macro=scores["f1_macro"], round=scores["round"],
                           val_curve=json.dumps([round(float(v), 6) for v in per_round["val_accuracy"]]),
                           test_curve=json.dumps([round(float(v), 6) for v in per_round["test_accuracy"]]),
                           sim_time_s=seed_run.wall_time_s)
            except ConfigError as err:
                row.update(status="refused", error=str(err).splitlines()[0])
            except Exception as err:  # recorded, so one failure does not hide the others
                row.update(status="error", error=f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}",
                           traceback=traceback.format_exc()[-2000:])
            row["total_time_s"] = time.perf_counter() - start
            print(f"{name:12s} {task:5s} {row['status']:7s} acc={row.get('accuracy', float('nan')):.4f} "
                  f"{row['total_time_s']:.1f}s {row.get('error', '')}", flush=True)
            rows.append(row)
    table = pd.DataFrame(rows)
    out.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(out, index=False)
    return table


def diff(cpu_csv: Path, cuda_csv: Path, out: Path) -> pd.DataFrame:
    a, b = pd.read_csv(cpu_csv), pd.read_csv(cuda_csv)
    for t in (a, b):
        if "settings" not in t:            # files written before --settings existed ran with none
            t["settings"] = "{}"
    merged = a.merge(b, on=["algorithm", "task", "dataset", "partition", "clients", "settings"], suffixes=("_cpu", "_cuda"))
    rows = []
    for _, r in merged.iterrows():
        row = dict(algorithm=r["algorithm"], task=r["task"], dataset=r["dataset"], rounds=r["rounds_cpu"], settings=r["settings"],
                   status_cpu=r["status_cpu"], status_cuda=r["status_cuda"],
                   accuracy_cpu=r.get("accuracy_cpu"), accuracy_cuda=r.get("accuracy_cuda"),
                   sim_time_s_cpu=r.get("sim_time_s_cpu"), sim_time_s_cuda=r.get("sim_time_s_cuda"),
                   device_cpu=r["device_cpu"], device_cuda=r["device_cuda"])
        if r["status_cpu"] == r["status_cuda"] == "ok":
            curves = [(json.loads(r[f"{k}_curve_cpu"]), json.loads(r[f"{k}_curve_cuda"])) for k in ("val", "test")]
            gaps = [abs(x - y) for c, g in curves for x, y in zip(c, g) if x == x and y == y]   # NaN: a split some runs lack
            row["max_round_diff"] = max(gaps) if gaps else float("nan")
            row["accuracy_diff"] = r["accuracy_cuda"] - r["accuracy_cpu"]
        else:
            row["error_cpu"], row["error_cuda"] = r.get("error_cpu"), r.get("error_cuda")
        rows.append(row)
    table = pd.DataFrame(rows)
    out.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(out, index=False)
    return table


def timings(out: Path, repeats: int) -> pd.DataFrame:
    from fglit.data import load_dataset
    from fglit.federation import run
    rows = []
    jobs = [("fedavg_cora_demo", "Cora", "louvain", 10, dict(rounds=100, local_epochs=3))]
    jobs += [(f"fedavg_tolokers_{k}", "tolokers", "metis", k, dict(rounds=5, local_epochs=1)) for k in (10, 100, 1000)]
    for label, dataset, partition, clients, kw in jobs:
        ds = load_dataset(dataset)
        run("fedavg", ds, partition, clients, seeds=[0], progress=False, **{**kw, "rounds": 1})   # warm-up: caches, kernels
        for rep in range(repeats):
            _sync()
            start = time.perf_counter()
            result = run("fedavg", ds, partition, clients, seeds=[0], progress=False, **kw)
            _sync()
            total = time.perf_counter() - start
            rows.append(dict(job=label, dataset=dataset, partition=partition, clients=clients, **kw, repeat=rep,
                             sim_time_s=result.runs[0].wall_time_s, total_time_s=total,
                             accuracy=result.runs[0].scores()["accuracy"], device=device_name()))
            print(rows[-1], flush=True)
    table = pd.DataFrame(rows)
    out.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(out, index=False)
    return table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    a = sub.add_parser("algorithms")
    a.add_argument("--rounds", type=int, default=5)
    a.add_argument("--only", nargs="*")
    a.add_argument("--settings", type=json.loads, default=None, help='JSON settings for every run, e.g. {"dropout": 0}')
    a.add_argument("--out", type=Path, required=True)
    d = sub.add_parser("diff")
    d.add_argument("cpu_csv", type=Path)
    d.add_argument("cuda_csv", type=Path)
    d.add_argument("--out", type=Path, required=True)
    t = sub.add_parser("timings")
    t.add_argument("--repeats", type=int, default=2)
    t.add_argument("--out", type=Path, required=True)
    o = ap.parse_args(argv)
    if o.command == "algorithms":
        algorithms(o.out, o.rounds, o.only, o.settings)
    elif o.command == "diff":
        print(diff(o.cpu_csv, o.cuda_csv, o.out).to_string())
    else:
        timings(o.out, o.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())

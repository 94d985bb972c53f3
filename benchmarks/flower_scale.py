"""Flower's simulation engine against fglit's in-process simulator at scale (issue #10): FedAvg on Cora, many clients.

Each backend runs in its own child process (a fresh interpreter, so neither inherits the other's memory). A sampler in
this process follows the child and all its descendants (for Flower: Ray's GCS server, raylet and worker processes) and
records the peak of the summed RSS (every 0.25 s) and of the summed PSS (every 2 s; PSS splits shared pages such as
torch's libraries among the processes that map them, so it does not count them once per process as RSS does).

    .venv/bin/python benchmarks/flower_scale.py                      # 100 clients, METIS, 5 rounds, both backends
    .venv/bin/python benchmarks/flower_scale.py --clients 20 --rounds 2 --out /tmp/smoke.csv

Writes one row per backend to results/flower/scale.csv (replacing the rows of the same setting).
"""
import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
torch.set_num_threads(1)
backend, clients, rounds, partition, num_cpus = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
if backend == "inprocess":
    from fglit.federation import run
    t1 = time.perf_counter()
    r = run("fedavg", "cora", partition, clients, rounds=rounds, seeds=(0,), progress=False)
else:
    from fglit.flower import run_flower_simulation
    t1 = time.perf_counter()
    r = run_flower_simulation("fedavg", "cora", partition, clients, rounds=rounds, seed=0, num_cpus=num_cpus)
s = r.summary()
print("RESULT " + json.dumps(dict(import_s=t1 - t0, run_s=time.perf_counter() - t1, accuracy=s["accuracy_mean"],
                                  bytes_up=s["bytes_up"], bytes_down=s["bytes_down"], dropped=len(s.get("dropped", [])))))
"""


class TreeSampler(threading.Thread):
    "Peak summed RSS and PSS (bytes) of a process and its descendants, and the most processes seen at once."
    def __init__(self, pid: int, every: float = 0.25, pss_every: float = 2.0):
        super().__init__(daemon=True)
        self.root, self.every, self.pss_every = psutil.Process(pid), every, pss_every
        self.peak_rss = self.peak_pss = self.peak_root_rss = self.most_procs = 0
        self.stop = threading.Event()

    def tree(self) -> list:
        try:
            return [self.root] + self.root.children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def run(self) -> None:
        last_pss = 0.0
        while not self.stop.is_set():
            procs, rss, pss = self.tree(), 0, 0
            want_pss = time.monotonic() - last_pss >= self.pss_every
            for p in procs:
                try:
                    rss += p.memory_info().rss
                    if want_pss: pss += p.memory_full_info().pss
                    if p.pid == self.root.pid: self.peak_root_rss = max(self.peak_root_rss, p.memory_info().rss)
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    pass
            if want_pss:
                last_pss = time.monotonic()
                self.peak_pss = max(self.peak_pss, pss)
            self.peak_rss, self.most_procs = max(self.peak_rss, rss), max(self.most_procs, len(procs))
            self.stop.wait(self.every)


def measure(backend: str, clients: int, rounds: int, partition: str, num_cpus: int, timeout: float) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", CHILD, backend, str(clients), str(rounds), partition, str(num_cpus)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    sampler = TreeSampler(proc.pid)
    sampler.start()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for p in sampler.tree()[::-1]:
            try: p.kill()
            except psutil.NoSuchProcess: pass
        out, err = proc.communicate()
        return dict(backend=backend, status=f"timed out after {timeout:.0f}s")
    finally:
        sampler.stop.set(); sampler.join()
    wall = time.perf_counter() - t0
    line = next((l for l in out.splitlines() if l.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        return dict(backend=backend, status=f"failed ({proc.returncode}): {err.strip().splitlines()[-1:] }")
    res = json.loads(line[len("RESULT "):])
    mb = 2**20
    return dict(backend=backend, status="ok", wall_s=round(wall, 1), run_s=round(res["run_s"], 1),
                peak_rss_tree_mb=round(sampler.peak_rss / mb), peak_pss_tree_mb=round(sampler.peak_pss / mb),
                peak_rss_main_mb=round(sampler.peak_root_rss / mb), processes=sampler.most_procs,
                accuracy=round(res["accuracy"], 4), bytes_up=res["bytes_up"], bytes_down=res["bytes_down"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--partition", default="metis")
    ap.add_argument("--num-cpus", type=int, default=2, help="CPUs Ray may use (one ClientApp per CPU)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per backend")
    ap.add_argument("--backends", nargs="+", default=["inprocess", "flower-sim"])
    ap.add_argument("--out", default=str(ROOT / "results" / "flower" / "scale.csv"))
    args = ap.parse_args(argv)
    import pandas as pd
    setting = dict(algorithm="fedavg", dataset="Cora", partition=args.partition, clients=args.clients, rounds=args.rounds,
                   ray_cpus=args.num_cpus, machine_cpus=psutil.cpu_count(), load_1min_before=round(os.getloadavg()[0], 2))
    rows = []
    for backend in args.backends:
        setting["load_1min_before"] = round(os.getloadavg()[0], 2)
        row = {**setting, **measure(backend, args.clients, args.rounds, args.partition, args.num_cpus, args.timeout)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    new = pd.DataFrame(rows)
    if out.exists():
        old = pd.read_csv(out)
        key = ["partition", "clients", "rounds", "ray_cpus", "backend"]
        keep = ~old.set_index(key).index.isin(new.set_index(key).index)
        new = pd.concat([old[keep], new], ignore_index=True)
    new.to_csv(out, index=False)
    print(f"wrote {out.resolve().relative_to(Path(__file__).resolve().parents[1]) if out.resolve().is_relative_to(Path(__file__).resolve().parents[1]) else out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

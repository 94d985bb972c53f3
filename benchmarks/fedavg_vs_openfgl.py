"""FedAvg on Cora, fglit vs OpenFGL, side by side in one run: wall time, accuracy and their ratio.

Setting (the issue's): Cora, Louvain partition packed into 10 clients, 100 rounds of 3 local epochs,
2-layer GCN with 64 hidden units, Adam lr 0.01, weight decay 5e-4, dropout 0.5 (OpenFGL's defaults),
full client participation, score = test accuracy at the round of best validation accuracy.

Run it with fglit's venv from the repository root (the OpenFGL side runs in its own venv, made by
benchmarks/setup_openfgl.sh, as a subprocess per seed):

    .venv/bin/python benchmarks/fedavg_vs_openfgl.py                  # 3 seeds, both evaluation protocols
    .venv/bin/python benchmarks/fedavg_vs_openfgl.py --seeds 0 --evaluation local

It prints a table and writes results/bench/fedavg_vs_openfgl.json. See benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
OPENFGL_PY = HERE / ".venv-openfgl" / "bin" / "python"
OPENFGL_SCRIPT = HERE / "_openfgl_fedavg.py"
WORK = HERE / "work"
sys.path.insert(0, str(REPO))
from benchmarks._common import fedavg_cora_settings, modified  # noqa: E402

# evaluation protocol -> OpenFGL's evaluation_mode / fglit's `evaluation` setting
PROTOCOLS = {
    "local": ("local_model_on_local_data", "local"),    # each client's model right after its local training (OpenFGL's default)
    "global": ("global_model_on_local_data", "global"),  # the aggregated global model on every client's split (fglit's default)
}
PROTOCOL_TEXT = {
    "local": "each client's own model after its local epochs, scored on its own split (OpenFGL's default)",
    "global": "the aggregated global model, scored on every client's split (fglit's default)",
}


def cli():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--evaluation", choices=["local", "global", "both"], default="both",
                   help="which evaluation protocol(s) to run on both sides (default: both)")
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--dropout", type=float, default=0.5)
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads on both sides (default 1: with 2 threads on a busy 2-core machine "
                        "OpenMP oversubscription slows either side by 10-30x; 0 leaves torch's default)")
    p.add_argument("--only", choices=["both", "openfgl", "fglit"], default="both")
    p.add_argument("--engine", choices=["sequential", "stacked"], default="sequential", help="fglit's simulation engine")
    p.add_argument("--local-kernel", choices=["torch", "c"], default="torch",
                   help="fglit's local_kernel with --engine stacked: c runs the clients' local steps in fglit.fl.gcn_kernel's C routine")
    p.add_argument("--model", choices=["kipfgcn", "gcn"], default="kipfgcn",
                   help="fglit's model. OpenFGL's 2-layer GCN is GCNConv(in, 64), ReLU, dropout, GCNConv(64, classes): two weight "
                        "matrices, two propagations. fglit's kipfgcn with layers=2 is that network (one 64-unit GCN layer, then the "
                        "linear class map with one more propagation; it also drops input features, as Kipf & Welling do). fglit's gcn "
                        "with layers=2 has two 64-unit GCN layers and then a linear head: one weight matrix more (the default "
                        "before issue #28's second round of measurements)")
    p.add_argument("--auc", choices=["on", "off"], default="off",
                   help="fglit's per-round ROC AUC (its config's auc). OpenFGL runs with --metrics accuracy, so 'off' (the default) "
                        "has both sides score the same per round: fglit still computes F1-macro beside accuracy. Runs before this "
                        "option existed scored AUC (their JSON has no settings.auc)")
    p.add_argument("--acc-tol", type=float, default=0.01,
                   help="'equal accuracy' for the target check: fglit >= OpenFGL - acc_tol (default 1 point)")
    p.add_argument("--target-ratio", type=float, default=0.5, help="the issue's target: fglit time <= this x OpenFGL's")
    p.add_argument("--data", default=None, help="datasets folder holding Cora/raw (default: $FGLIT_DATA, else ../shared/datasets)")
    p.add_argument("--openfgl-python", default=str(OPENFGL_PY))
    p.add_argument("--work", type=Path, default=WORK, help="scratch folder: OpenFGL's data and fglit's throwaway cache (one per concurrent run)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="both libraries on this device (fglit's FGLIT_DEVICE, OpenFGL's use_cuda); cuda needs an OpenFGL "
                        "installed over a CUDA torch (--openfgl-python), which setup_openfgl.sh does not make")
    p.add_argument("--out", default=str(REPO / "results" / "bench" / "fedavg_vs_openfgl.json"))
    return p.parse_args()


def data_root(arg: str | None) -> Path:
    "Same rule as the Makefile: $FGLIT_DATA if set, else ../shared/datasets next to the repository."
    if arg:
        return Path(arg).resolve()
    if os.environ.get("FGLIT_DATA"):
        return Path(os.environ["FGLIT_DATA"]).resolve()
    return (REPO.parent / "shared" / "datasets").resolve()


# ---------------------------------------------------------------------------------------------------- OpenFGL side
def run_openfgl(o, seed: int, protocol: str, raw: Path) -> dict:
    "One seed of OpenFGL's FedAvg in its own venv; returns the JSON line its runner prints."
    py = Path(o.openfgl_python)
    if not py.exists():
        return dict(ok=False, error=f"no OpenFGL venv at {py}: run `bash benchmarks/setup_openfgl.sh` first")
    cmd = [str(py), str(OPENFGL_SCRIPT), "--seed", str(seed), "--raw", str(raw),
           "--work", str(o.work / "openfgl-data" / protocol),
           "--clients", str(o.clients), "--rounds", str(o.rounds), "--epochs", str(o.epochs),
           "--hidden", str(o.hidden), "--lr", str(o.lr), "--weight-decay", str(o.weight_decay),
           "--dropout", str(o.dropout), "--evaluation-mode", PROTOCOLS[protocol][0], "--threads", str(o.threads),
           "--device", o.device]
    env = dict(os.environ, TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1", PYTHONNOUSERSITE="1")
    env.pop("PYTHONPATH", None)
    if o.threads:
        env.update(OMP_NUM_THREADS=str(o.threads), MKL_NUM_THREADS=str(o.threads))
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=str(REPO), env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    if proc.returncode != 0 or not lines:
        return dict(ok=False, error=f"OpenFGL runner exited {proc.returncode}", stderr=proc.stderr[-3000:])
    out = json.loads(lines[-1])
    out.update(ok=True, process_time_s=wall)
    return out


# ------------------------------------------------------------------------------------------------------ fglit side
def fglit_api():
    "fglit's `run` (and friends), or the reason it cannot be used yet."
    try:
        from fglit.federation import run
        from fglit.data import load_dataset
        from fglit.partition import partition
    except (ImportError, AttributeError) as err:
        return None, f"fglit.federation.run is not available ({type(err).__name__}: {err})"
    return (run, load_dataset, partition), None


def run_fglit(o, api, seed: int, protocol: str) -> dict:
    "One seed of fglit's FedAvg, in this process, from a cold fglit cache (dataset processing and partition timed)."
    import torch
    import fglit
    run, load_dataset, partition = api
    cache = Path(os.environ["FGLIT_CACHE"])
    shutil.rmtree(cache, ignore_errors=True)       # cold: no cached partition or processed dataset
    settings = fedavg_cora_settings(PROTOCOLS[protocol][1], o.engine, lr=o.lr, hidden=o.hidden, weight_decay=o.weight_decay,
                                    dropout=o.dropout, local_kernel=o.local_kernel, auc=o.auc == "on")
    try:
        t0 = time.perf_counter()
        ds = load_dataset("Cora")
        t1 = time.perf_counter()
        res = run("fedavg", dataset=ds, partition="louvain", clients=o.clients, rounds=o.rounds,
                  local_epochs=o.epochs, model=o.model, seeds=[seed], settings=settings, progress=False)
        t2 = time.perf_counter()
    except Exception as err:  # report, keep the OpenFGL numbers
        return dict(ok=False, error=f"{type(err).__name__}: {err}")
    # the whole command as a user types it (interpreter, imports, dataset, partition, run, printed results), cold cache,
    # against OpenFGL's whole runner process (process_time_s)
    shutil.rmtree(cache, ignore_errors=True)
    cmd = [str(Path(sys.executable).with_name("fglit")), "run", "fedavg", "--dataset", "Cora", "--partition", "louvain",
           "--clients", str(o.clients), "--rounds", str(o.rounds), "--local-epochs", str(o.epochs), "--model", o.model,
           "--seeds", str(seed), "--quiet", "--set", *[f"{k}={v}" for k, v in settings.items()]]
    t3 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=str(REPO), capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS=str(o.threads or 1)))
    process_time_s = time.perf_counter() - t3 if proc.returncode == 0 else None
    s = res.summary()
    sr = res.runs[0]
    per_round = sr.per_round()
    part = partition(ds, "louvain", o.clients, seed=seed, mode="pack")   # cache hit: the partition run() used
    clients = part.clients
    return dict(
        ok=True, library="fglit", fglit_version=getattr(fglit, "__version__", None), commit=s.get("commit"), seed=seed,
        accuracy=float(s["accuracy_mean"]),
        best_val_accuracy=float(sr.scores()["val_accuracy"]),
        best_round=int(s["selected_rounds"][0]) - 1,      # fglit counts rounds from 1, OpenFGL from 0: stored 0-based
        final_test_accuracy=float(per_round["test_accuracy"].iloc[-1]),
        final_val_accuracy=float(per_round["val_accuracy"].iloc[-1]),
        train_time_s=float(sr.wall_time_s),               # simulate(): clients, models, rounds, per-round evaluation
        setup_time_s=(t1 - t0) + (t2 - t1 - float(sr.wall_time_s)),  # dataset load + Louvain partition + split
        total_time_s=t2 - t0,
        process_time_s=process_time_s, process_error=None if proc.returncode == 0 else proc.stderr[-500:],
        engine=o.engine,
        evaluation=PROTOCOLS[protocol][1],
        history=[[int(r) - 1, round(float(v), 5), round(float(t), 5)] for r, v, t in
                 zip(per_round["round"], per_round["val_accuracy"], per_round["test_accuracy"])],
        partition=dict(
            client_nodes=[int(c.num_nodes) for c in clients],
            client_edges=[int(c.edge_index.shape[1]) // 2 for c in clients],
            train=[int(c.train_mask.sum()) for c in clients], val=[int(c.val_mask.sum()) for c in clients],
            test=[int(c.test_mask.sum()) for c in clients], nodes_covered=part.covered,
            edges_kept=sum(int(c.edge_index.shape[1]) // 2 for c in clients), info=_jsonable(part.info)),
        config=_jsonable(s["config"]), partition_params=_jsonable(s["partition_params"]),
        torch=torch.__version__, torch_threads=torch.get_num_threads(),
    )


def _jsonable(x):
    return json.loads(json.dumps(x, default=lambda v: v.item() if hasattr(v, "item") else str(v)))


# ---------------------------------------------------------------------------------------------------------- report
def mean_std(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return None, None
    return statistics.fmean(xs), (statistics.pstdev(xs) if len(xs) > 1 else 0.0)


def fmt(m, s, digits=4, unit=""):
    if m is None:
        return "n/a"
    return f"{m:.{digits}f}{unit}" + (f" ± {s:.{digits}f}" if s else "")


def summarise(rows: list[dict]) -> dict:
    ok = [r for r in rows if r.get("ok")]
    out = {"runs": len(ok)}
    for key in ("accuracy", "final_test_accuracy", "train_time_s", "setup_time_s", "total_time_s", "process_time_s"):
        m, s = mean_std([r.get(key) for r in ok])
        out[key] = dict(mean=m, std=s)
    return out


def machine_info() -> dict:
    import torch
    info = dict(cpu_count=os.cpu_count(), cpus_usable=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
                platform=platform.platform(), python=platform.python_version(), torch_fglit_venv=torch.__version__,
                cuda_available=torch.cuda.is_available())
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu_model"] = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), None)
        with open("/proc/meminfo") as f:
            info["mem_total_kb"] = int(next(l.split()[1] for l in f if l.startswith("MemTotal")))
    except OSError:
        pass
    return info


def main():
    o = cli()
    if o.threads:
        os.environ.setdefault("OMP_NUM_THREADS", str(o.threads))
    os.environ["FGLIT_CACHE"] = str(o.work / "fglit-cache")            # its own throwaway cache, emptied before each fglit run (never the user's)
    os.environ["FGLIT_DEVICE"] = o.device                             # the device OpenFGL runs on too (its use_cuda)
    data = data_root(o.data)
    os.environ.setdefault("FGLIT_DATA", str(data))
    raw = data / "Cora" / "raw"
    import torch
    if o.threads:
        torch.set_num_threads(o.threads)

    protocols = ["local", "global"] if o.evaluation == "both" else [o.evaluation]
    api, why_not = (None, "skipped (--only openfgl)") if o.only == "openfgl" else fglit_api()
    if api is None and o.only != "openfgl":
        print(f"!! fglit side skipped: {why_not}", file=sys.stderr)

    started = datetime.datetime.now(datetime.timezone.utc)
    load_before = os.getloadavg()
    results = {p: {"openfgl": [], "fglit": []} for p in protocols}
    i = 0
    for seed in o.seeds:
        for p in protocols:
            # alternate which library goes first, so slow drifts in machine load hit both alike
            order = ["openfgl", "fglit"] if i % 2 == 0 else ["fglit", "openfgl"]
            i += 1
            for lib in order:
                if lib == "openfgl" and o.only != "fglit":
                    r = run_openfgl(o, seed, p, raw)
                elif lib == "fglit" and api is not None:
                    r = run_fglit(o, api, seed, p)
                else:
                    continue
                results[p][lib].append(r)
                if r.get("ok"):
                    print(f"[{p:6s}] seed {seed} {lib:7s} acc {r['accuracy']:.4f} (best round {r['best_round']}) "
                          f"train {r['train_time_s']:.1f}s total {r['total_time_s']:.1f}s", file=sys.stderr, flush=True)
                else:
                    print(f"[{p:6s}] seed {seed} {lib:7s} FAILED: {r.get('error')}\n{r.get('stderr', '')}", file=sys.stderr, flush=True)
    finished = datetime.datetime.now(datetime.timezone.utc)

    # ---- table
    setting = (f"FedAvg | Cora | Louvain packed into {o.clients} clients | {o.rounds} rounds x {o.epochs} local epochs | "
               f"2-layer GCN, hidden {o.hidden} (fglit: {o.model}, AUC {o.auc}) | Adam lr {o.lr}, wd {o.weight_decay}, dropout {o.dropout} | seeds {o.seeds} | "
               f"torch threads {o.threads or 'default'} | {os.cpu_count()} cores | device {o.device}")
    print(setting)
    summary = {}
    for p in protocols:
        so, sf = summarise(results[p]["openfgl"]), summarise(results[p]["fglit"])
        ratio = lambda k: (sf[k]["mean"] / so[k]["mean"]) if so[k]["mean"] and sf[k]["mean"] is not None else None
        r_train, r_total, r_process = ratio("train_time_s"), ratio("total_time_s"), ratio("process_time_s")
        d_acc = (sf["accuracy"]["mean"] - so["accuracy"]["mean"]) if so["accuracy"]["mean"] is not None and sf["accuracy"]["mean"] is not None else None
        met = None if r_train is None or d_acc is None else bool(r_train <= o.target_ratio and d_acc >= -o.acc_tol)
        summary[p] = dict(openfgl=so, fglit=sf, ratio_train_time=r_train, ratio_total_time=r_total, ratio_process_time=r_process,
                          accuracy_difference=d_acc, target_met=met)
        print(f"\nevaluation '{p}': {PROTOCOL_TEXT[p]}; score = test accuracy at the best-validation round")
        print(f"{'':28s}{'OpenFGL':>22s}{'fglit':>22s}{'fglit / OpenFGL':>18s}")
        rows = [("accuracy (best val)", "accuracy", 4, ""), ("accuracy (last round)", "final_test_accuracy", 4, ""),
                ("train time (s)", "train_time_s", 2, ""), ("setup time (s)", "setup_time_s", 2, ""),
                ("total time (s)", "total_time_s", 2, ""), ("whole command (s)", "process_time_s", 2, "")]
        for label, key, dg, _ in rows:
            a, b = so[key], sf[key]
            if key.endswith("time_s"):
                rel = ratio(key)
                rel = f"{rel:.3f}x" if rel is not None else "n/a"
            else:
                rel = f"{(b['mean'] - a['mean']) * 100:+.2f} pts" if a["mean"] is not None and b["mean"] is not None else "n/a"
            print(f"{label:28s}{fmt(a['mean'], a['std'], dg):>22s}{fmt(b['mean'], b['std'], dg):>22s}{rel:>18s}")
        verdict = ("n/a (one side missing)" if met is None else
                   f"{'MET' if met else 'NOT met'} (train-time ratio {r_train:.3f} vs <= {o.target_ratio}; "
                   f"accuracy {d_acc * 100:+.2f} pts vs >= -{o.acc_tol * 100:.1f})")
        print(f"target fglit <= {o.target_ratio}x OpenFGL's time at equal accuracy: {verdict}")
    if api is None and o.only != "openfgl":
        print(f"\nfglit side not run: {why_not}")

    # ---- JSON
    of = next((r for p in protocols for r in results[p]["openfgl"] if r.get("ok")), {})
    report = dict(
        benchmark="fedavg_vs_openfgl",
        date=started.isoformat(timespec="seconds"), duration_s=(finished - started).total_seconds(),
        settings=dict(algorithm="fedavg", dataset="Cora", partition="louvain", louvain_packing="pack (all communities, capped at "
                      "N//K - 20 nodes, packed into K clients)", clients=o.clients, rounds=o.rounds, local_epochs=o.epochs,
                      model=o.model, openfgl_model="gcn", layers=2, hidden=o.hidden, lr=o.lr, weight_decay=o.weight_decay, dropout=o.dropout,
                      optimizer="adam", client_fraction=1.0, split="per-client stratified 0.2/0.4/0.4 train/val/test (both sides)",
                      selection="test accuracy at the round of best validation accuracy", protocols={p: PROTOCOL_TEXT[p] for p in protocols},
                      torch_threads=o.threads or "default", device=o.device, acc_tol=o.acc_tol, target_ratio=o.target_ratio,
                      engine=o.engine, local_kernel=o.local_kernel, auc=o.auc == "on",
                      per_round_metrics=dict(openfgl="accuracy (--metrics accuracy)",
                                             fglit="accuracy, F1-macro" + (", ROC AUC" if o.auc == "on" else ""))),
        seeds=o.seeds, seeds_note=(f"{len(o.seeds)} seed(s); OpenFGL's Louvain (scikit-network) is deterministic, so its seeds "
                                   "change the split and initialisation only; fglit's Louvain (networkx) is seeded, so its partition varies too"),
        timing_note=("train_time_s: OpenFGL trainer.train() / fglit simulate() (model building, every round's local training, "
                     "aggregation and per-round evaluation). setup_time_s: dataset processing from the raw Planetoid files + Louvain "
                     "partition + splits (OpenFGL: FGLTrainer(args), also builds the models; fglit: load_dataset + partition inside run(), "
                     "from an emptied cache). total_time_s = setup + train. Interpreter start-up and imports are not counted (OpenFGL's "
                     "import time is in each run's import_time_s)."),
        machine=dict(machine_info(), loadavg_before=load_before, loadavg_after=os.getloadavg()),
        versions=dict(torch_fglit=torch.__version__, torch_openfgl=of.get("torch"), torch_geometric_openfgl=of.get("torch_geometric"),
                      openfgl=of.get("openfgl_version"), fglit_commit=next((r.get("commit") for p in protocols for r in results[p]["fglit"] if r.get("ok")), None),
                      fglit_uncommitted_changes=modified("fglit")),
        fglit_available=api is not None, fglit_note=why_not,
        summary=summary, runs=results,
    )
    out = Path(o.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()

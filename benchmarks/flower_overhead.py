"""Where Flower's simulation of fglit spends its time (issue #28): FedAvg on Cora, in process and in Flower's simulation
engine, broken into stages, for this tree and (with --base) another commit, side by side in one run.

    .venv/bin/python benchmarks/flower_overhead.py                                  # 100 clients, METIS, 5 rounds, this tree
    .venv/bin/python benchmarks/flower_overhead.py --base main                      # and main's commit, before it
    .venv/bin/python benchmarks/flower_overhead.py --clients 4 --rounds 1 --out /tmp/smoke.csv   # the CI smoke size

Each variant (a tree: this one, or `--base`'s commit unpacked with `git archive`) runs in its own process with one torch
thread (OMP_NUM_THREADS=1). The timers are put in from outside, so the same instrumentation measures any commit: the
Flower App that `LocalSimulation.submit` writes gets a module (`fo_app.py`) whose ServerApp and ClientApp are fglit's,
with `fglit.flower_app`'s helpers wrapped in `time.perf_counter` timers. Every process (the ServerApp's, each Ray
worker's) appends its timings to a folder; this script adds them up.

Rows (group, stage): `flower` stages add up to the simulation's wall time (`flower/total`): starting the SuperLink,
launching the run (`flwr run`, the simulation process, Ray, up to the ServerApp's start), the exchanges as the ServerApp
waits on them (setup, train, evaluate), the ServerApp's own work between them (encoding messages into records, decoding
replies, counting wire bytes, the rest: aggregation and the round loop), handing the result back and tearing down.
`clientapp` stages are seconds of ClientApp work summed over all Ray workers (they overlap: `workers` run at once):
loading the node's client state, decoding the message, computing, encoding the reply, saving the state.
`exchange/flower_wait` is the exchanges' wall time the ClientApps' work (divided over the workers) does not explain:
Flower's scheduling, polling and Ray's transfers. `inprocess/run` is `fglit.federation.run` on the same setting.
`share` is seconds / the variant's `flower/total`.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# The Flower App module: fglit's apps, with fglit.flower_app's helpers timed. Runs in the ServerApp's process and in
# every Ray worker; each appends one JSON line per handled message (ClientApp) or per run (ServerApp).
FO_APP = r'''
import functools, json, os, threading, time
import fglit.flower_app as fa
from flwr.clientapp import ClientApp

_DIR = os.environ["FGLIT_FO_DIR"]
_t = threading.local()

def _write(row):
    with open(os.path.join(_DIR, f"{os.getpid()}.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")

def _timed(name, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        stages = getattr(_t, "stages", None)
        if stages is None or getattr(_t, "inside", False): return fn(*args, **kwargs)
        _t.inside = True
        t = time.perf_counter()
        try: return fn(*args, **kwargs)
        finally:
            stages[name] = stages.get(name, 0.0) + time.perf_counter() - t
            _t.inside = False
    return wrapper

for _name, _stage in [("_load_client", "load_state"), ("_save_client", "save_state"), ("get_message", "decode"),
                      ("put_message", "encode"), ("flower_nbytes", "wire_bytes"), ("wire_sizes", "wire_bytes"), ("_exchange", "exchange"),
                      ("wait_for_nodes", "wait_nodes")]:
    if hasattr(fa, _name): setattr(fa, _name, _timed(_stage, getattr(fa, _name)))

def _handle(kind, fn, message, context):
    _t.stages, t0, t = {}, time.time(), time.perf_counter()
    try: return fn(message, context)
    finally:
        _write(dict(side="client", kind=kind, pid=os.getpid(), start=t0, total=time.perf_counter() - t, stages=_t.stages))
        _t.stages = None

# module-level handlers: Ray pickles them by reference, and each worker imports this module (and so times fglit there)
def setup(message, context): return _handle("setup", fa._setup, message, context)
def uplink(message, context): return _handle("uplink", fa._uplink, message, context)
def train(message, context): return _handle("train", fa._train, message, context)
def evaluate(message, context): return _handle("evaluate", fa._evaluate, message, context)

client_app = ClientApp()
client_app.query("setup")(setup)
client_app.query("uplink")(uplink)
client_app.train()(train)
client_app.evaluate()(evaluate)

_serve = fa.serve
def _timed_serve(grid, run):
    _t.stages, t0, t = {}, time.time(), time.perf_counter()
    try: return _serve(grid, run)
    finally:
        _write(dict(side="server", pid=os.getpid(), start=t0, end=time.time(), total=time.perf_counter() - t, stages=_t.stages))
        _t.stages = None
fa.serve = _timed_serve
server_app = fa.make_server_app()
'''

CHILD = r'''
import json, os, sys, time
from pathlib import Path
import torch
torch.set_num_threads(1)
clients, rounds, partition, num_cpus, fo_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
import fglit, fglit.flower as ff
from fglit.federation import run
out = {"fglit": str(Path(fglit.__file__).parent)}
t = time.perf_counter()
local = run("fedavg", "cora", partition, clients, rounds=rounds, seeds=(0,), progress=False)
out["inprocess_s"] = time.perf_counter() - t
write_app = ff.write_flower_app
def instrumented_app(directory, spec):
    d = write_app(directory, spec)
    (d / "fo_app.py").write_text(os.environ["FGLIT_FO_APP"])
    text = (d / "pyproject.toml").read_text()
    (d / "pyproject.toml").write_text(text.replace('"fglit.flower:server_app"', '"fo_app:server_app"')
                                          .replace('"fglit.flower:client_app"', '"fo_app:client_app"'))
    return d
ff.write_flower_app = instrumented_app
spec = ff.FlowerRun("fedavg", "cora", partition, clients, 0, {"rounds": rounds}, os.environ.get("FGLIT_DATA", ""), timeout=1800)
t0 = time.time()
sim = ff.LocalSimulation(clients, Path(fo_dir) / "work", num_cpus=num_cpus, client_cpus=1,
                         env={"FGLIT_FO_DIR": fo_dir, "OMP_NUM_THREADS": "1"}, verbose=bool(os.environ.get("FGLIT_FO_VERBOSE")))
sim.__enter__()
try:
    out["entered"] = time.time()
    result = sim.submit(spec, timeout=1800)
    out["result"] = time.time()
finally:
    sim.close()
out.update(start=t0, closed=time.time(), exchanges=result.exchanges.to_dict(orient="list"),
           same_scores=bool((result.runs[0].history.sort_values(["round", "client", "split"]).accuracy.values
                             == local.runs[0].history.sort_values(["round", "client", "split"]).accuracy.values).all()),
           accuracy=float(result.summary()["accuracy_mean"]), accuracy_inprocess=float(local.summary()["accuracy_mean"]),
           wire_flower_bytes=int(result.wire.flower_bytes.sum()))
print("RESULT " + json.dumps(out))
'''

FIELDS = ["variant", "commit", "group", "stage", "seconds", "share", "clients", "rounds", "partition", "workers", "threads",
          "machine", "cpus", "python", "torch", "flwr", "load_1", "load_5", "load_15", "date", "accuracy", "same_scores"]


def git(*args, cwd=REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def tree_commit(tree: Path) -> str:
    "The short commit of this checkout, with `+` when its tracked files differ from it."
    try:
        sha = git("rev-parse", "--short", "HEAD", cwd=tree)
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "fglit", "benchmarks"], cwd=tree).returncode != 0
        return sha + ("+" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return ""


def breakdown(res: dict, timings: list[dict], workers: int) -> list[tuple[str, str, float]]:
    "(group, stage, seconds) rows of one variant from its child's result and its processes' timing lines."
    server = [t for t in timings if t["side"] == "server"]
    if len(server) != 1:
        raise RuntimeError(f"expected one ServerApp timing line, got {len(server)}")
    server = server[0]
    ex = res["exchanges"]
    by_what: dict[str, float] = {}
    for what, s in zip(ex["what"], ex["seconds"]):
        key = what.split(".")[0]
        by_what[key] = by_what.get(key, 0.0) + s
    st = server["stages"]
    exchange_wall = sum(by_what.values())
    rows = [("flower", "superlink_start", res["entered"] - res["start"]),
            ("flower", "launch_to_serverapp", server["start"] - res["entered"])]
    # the setup exchange, until the first ClientApp starts (Ray, its workers, their imports), and the rest
    clients = [t for t in timings if t["side"] == "client"]
    setup_start = server["start"] + st.get("wait_nodes", 0.0)
    first = min((t["start"] for t in clients), default=setup_start) - setup_start
    first = min(max(first, 0.0), by_what.get("setup", 0.0))
    rows.append(("flower", "setup_until_first_clientapp", first))
    rows += [("flower", f"exchange_{what}", s - (first if what == "setup" else 0.0)) for what, s in by_what.items()]
    own = {"wait_nodes": st.get("wait_nodes", 0.0), "encode": st.get("encode", 0.0), "decode": st.get("decode", 0.0), "wire_bytes": st.get("wire_bytes", 0.0)}
    rows += [("flower", f"serverapp_{k}", v) for k, v in own.items()]
    rows.append(("flower", "serverapp_other", server["total"] - exchange_wall - sum(own.values())))
    rows += [("flower", "result_handoff", res["result"] - server["end"]), ("flower", "teardown", res["closed"] - res["result"])]
    total = res["closed"] - res["start"]
    rows.append(("flower", "total", total))
    # the ClientApps' work, summed over the workers
    busy = 0.0
    for kind in ("setup", "train", "evaluate", "uplink"):
        lines = [t for t in clients if t["kind"] == kind]
        if not lines: continue
        stages: dict[str, float] = {}
        for t in lines:
            for k, v in t["stages"].items(): stages[k] = stages.get(k, 0.0) + v
        handled = sum(t["total"] for t in lines)
        busy += handled
        for k in ("load_state", "decode", "encode", "save_state"):
            if k in stages: rows.append(("clientapp", f"{kind}_{k}", stages[k]))
        rows.append(("clientapp", f"{kind}_compute", handled - sum(stages.values())))
    rows.append(("clientapp", "total", busy))
    rows.append(("exchange", "clientapp_work_per_worker", busy / workers))
    rows.append(("exchange", "flower_wait", exchange_wall - busy / workers))
    rows.append(("exchange", "processes", float(len({t["pid"] for t in clients}))))
    rows.append(("inprocess", "run", res["inprocess_s"]))
    rows.append(("ratio", "flower_total_over_inprocess", total / res["inprocess_s"]))
    return rows


def measure(tree: Path, args, workers: int) -> tuple[dict, list]:
    fo_dir = Path(tempfile.mkdtemp(prefix="fglit-fo-"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "FGLIT_FO_APP": FO_APP, "PYTHONUNBUFFERED": "1"}
    try:
        proc = subprocess.run([sys.executable, "-c", CHILD, str(args.clients), str(args.rounds), args.partition, str(workers),
                               str(fo_dir)], capture_output=True, text=True, env=env, cwd=tree, timeout=args.timeout)
        line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            raise RuntimeError(f"the {tree} run failed ({proc.returncode}): {proc.stderr[-3000:]}")
        res = json.loads(line[len("RESULT "):])
        if Path(res["fglit"]).resolve() != (tree / "fglit").resolve():
            raise RuntimeError(f"the child imported fglit from {res['fglit']}, not {tree}")
        timings = [json.loads(l) for f in fo_dir.glob("*.jsonl") for l in f.read_text().splitlines() if l.strip()]
        return res, breakdown(res, timings, workers)
    finally:
        shutil.rmtree(fo_dir, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--partition", default="metis")
    ap.add_argument("--num-cpus", type=int, default=2, help="CPUs Ray may use: one ClientApp worker per CPU")
    ap.add_argument("--base", default="", help="also measure this commit (e.g. main), before this tree")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per variant")
    ap.add_argument("--out", type=Path, default=REPO / "results" / "bench" / "flower_overhead.csv")
    args = ap.parse_args(argv)
    import flwr, pandas as pd, torch
    variants = []
    tmp = None
    try:
        if args.base:
            sha = git("rev-parse", "--short", args.base)
            tmp = Path(tempfile.mkdtemp(prefix=f"fglit-base-{sha}-"))
            archive = subprocess.run(["git", "archive", args.base, "fglit"], cwd=REPO, capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
            variants.append(("before", tmp, sha))
        variants.append(("after" if args.base else "this", REPO, tree_commit(REPO)))
        rows = []
        for name, tree, commit in variants:
            load = os.getloadavg()
            res, stages = measure(tree, args, args.num_cpus)
            total = next(s for g, n, s in stages if (g, n) == ("flower", "total"))
            base = dict(variant=name, commit=commit, clients=args.clients, rounds=args.rounds, partition=args.partition,
                        workers=args.num_cpus, threads=1, machine=platform.node(), cpus=os.cpu_count(),
                        python=platform.python_version(), torch=torch.__version__, flwr=flwr.__version__,
                        load_1=round(load[0], 2), load_5=round(load[1], 2), load_15=round(load[2], 2),
                        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                        accuracy=round(res["accuracy"], 6), same_scores=res["same_scores"])
            for group, stage, seconds in stages:
                share = seconds / total if group in ("flower", "clientapp", "exchange", "inprocess") and stage != "processes" else float("nan")
                rows.append({**base, "group": group, "stage": stage, "seconds": round(seconds, 4), "share": round(share, 4)})
            print(f"{name} ({commit}): Flower {total:.1f} s, in process {res['inprocess_s']:.1f} s, same scores: {res['same_scores']}",
                  flush=True)
    finally:
        if tmp is not None: shutil.rmtree(tmp, ignore_errors=True)
    frame = pd.DataFrame(rows)[FIELDS]
    from fglit.reproduction import append_row
    for row in frame.to_dict("records"):                # appended: earlier runs (a before/after pair) stay in the file
        append_row(args.out, row)
    wide = frame[frame.group != "ratio"].pivot_table(index=["group", "stage"], columns="variant", values="seconds", sort=False)
    print(wide.round(2).to_string())
    print(f"appended {len(frame)} rows to {args.out.relative_to(REPO) if args.out.is_relative_to(REPO) else args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Start-up time of the `fglit` command: `fglit --help`, `fglit run --help` and `fglit --version`.

    python benchmarks/startup.py                                          # this checkout only
    python benchmarks/startup.py --baseline-python-path /path/to/other/checkout --baseline-label main
    python benchmarks/startup.py --commands run --label deferred --baseline-python-path ../eager --baseline-label eager

`--commands run` times one round of the FedAvg run `fedavg_vs_openfgl.py` times whole instead (stacked engine, Cora,
10 Louvain clients): imports, the dataset and partition from fglit's cache (which the untimed warm-up run fills), one
round and the printed tables; needs FGLIT_DATA.

Each command runs as a subprocess (`python -c` doing what the console script does: `from fglit.cli import main`),
with `PYTHONPATH` set to the checkout, `--reps` times; the runs of the checkouts alternate, so a change in the
machine's load falls on both. A further run of each command records which heavy modules (`HEAVY`) it imported.
Appends one row per (checkout, command) to `results/bench/startup.csv`: median, min and max wall time, the heavy
modules, the checkout's git commit (`+modified` where its code differs from it), and the machine (CPU, cores, `OMP_NUM_THREADS`, load average before and after).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks._common import short_commit  # noqa: E402

COMMANDS = {"fglit --help": ["--help"], "fglit run --help": ["run", "--help"], "fglit --version": ["--version"]}
RUN_COMMANDS = {"fglit run fedavg (Cora, stacked, 1 round)": [   # benchmarks/fedavg_vs_openfgl.py's command, one round
    "run", "fedavg", "--dataset", "Cora", "--partition", "louvain", "--clients", "10", "--rounds", "1", "--local-epochs", "3",
    "--model", "kipfgcn", "--seeds", "0", "--quiet", "--set", "engine=stacked", "mode=pack", "auc=False"]}
COMMAND_SETS = {"help": COMMANDS, "run": RUN_COMMANDS}
HEAVY = ("torch", "torch._dynamo", "torch_geometric", "pandas", "numpy", "scipy", "sklearn", "networkx", "flwr", "matplotlib")
MAIN = "import sys\nfrom fglit.cli import main\nsys.argv[0] = 'fglit'\nsys.exit(main())\n"
PROBE = ("import atexit, json, sys\n"
         "heavy = json.loads(sys.argv.pop(1))\n"       # before main() parses sys.argv
         "atexit.register(lambda: sys.stderr.write('\\nHEAVY ' + json.dumps([m for m in heavy if m in sys.modules and type(sys.modules[m]).__name__ != 'DeferredModule']) + '\\n'))\n"
         + MAIN)


def cpu_model() -> str:
    try:
        return next(l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def env_for(checkout: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def time_once(python: str, checkout: Path, args: list[str]) -> float:
    start = time.perf_counter()
    done = subprocess.run([python, "-c", MAIN, *args], capture_output=True, text=True, env=env_for(checkout), cwd=checkout)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{checkout}: fglit {' '.join(args)} exited {done.returncode}: {done.stderr[-1000:]}")
    return elapsed


def heavy_modules(python: str, checkout: Path, args: list[str]) -> list[str]:
    done = subprocess.run([python, "-c", PROBE, json.dumps(HEAVY), *args], capture_output=True, text=True, env=env_for(checkout), cwd=checkout)
    line = next(l for l in reversed(done.stderr.splitlines()) if l.startswith("HEAVY "))
    return json.loads(line[len("HEAVY "):])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5, help="runs of each command per checkout (median reported)")
    ap.add_argument("--python", default=sys.executable, help="the interpreter (a venv with fglit's dependencies)")
    ap.add_argument("--label", default="this", help="this checkout's label in the CSV")
    ap.add_argument("--baseline-python-path", type=Path, help="another checkout (its root goes on PYTHONPATH) measured alongside")
    ap.add_argument("--baseline-label", default="baseline")
    ap.add_argument("--out", type=Path, default=REPO / "results" / "bench" / "startup.csv")
    ap.add_argument("--commands", choices=sorted(COMMAND_SETS), default="help",
                    help="help: --help, run --help, --version (default); run: a one-round FedAvg run on Cora")
    args = ap.parse_args(argv)
    commands = COMMAND_SETS[args.commands]
    checkouts = [(args.label, REPO)] + ([(args.baseline_label, args.baseline_python_path.resolve())] if args.baseline_python_path else [])
    load_before = os.getloadavg()
    times = {(label, cmd): [] for label, _ in checkouts for cmd in commands}
    for label, path in checkouts:                        # one untimed warm-up each (the file cache; a run's dataset and partition)
        for cmd_args in ([COMMANDS["fglit --version"]] if commands is COMMANDS else commands.values()):
            time_once(args.python, path, cmd_args)
    for _ in range(args.reps):
        for cmd, cmd_args in commands.items():
            for label, path in checkouts:                # alternating: load changes fall on both checkouts
                times[label, cmd].append(time_once(args.python, path, cmd_args))
    load_after = os.getloadavg()
    machine = dict(machine=f"{platform.machine()} {cpu_model()}".strip(), cpu_count=os.cpu_count(),
                   python=platform.python_version(), omp_num_threads=os.environ.get("OMP_NUM_THREADS", "1"),
                   loadavg_1m_before=round(load_before[0], 2), loadavg_1m_after=round(load_after[0], 2),
                   date=datetime.datetime.now().isoformat(timespec="seconds"))
    rows = []
    for label, path in checkouts:
        commit = short_commit(path) or "unknown"
        for cmd, cmd_args in commands.items():
            t = times[label, cmd]
            rows.append(dict(checkout=label, commit=commit, command=cmd, reps=len(t), median_s=round(statistics.median(t), 3),
                             min_s=round(min(t), 3), max_s=round(max(t), 3),
                             heavy_modules=" ".join(heavy_modules(args.python, path, cmd_args)) or "none", **machine))
    from fglit.reproduction import append_row
    for r in rows:                                      # appended: earlier runs (a before/after pair) stay in the file
        append_row(args.out, r)
    for r in rows:
        print(f"{r['checkout']:>10} {r['commit']:>18}  {r['command']:<18} median {r['median_s']:.3f}s "
              f"(min {r['min_s']:.3f}, max {r['max_s']:.3f})  heavy: {r['heavy_modules']}")
    print(f"appended {len(rows)} rows to {args.out} (load average {load_before[0]:.2f} -> {load_after[0]:.2f}, {os.cpu_count()} CPU(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())

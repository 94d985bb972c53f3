"""Issue #28's benchmark suite in one command: every benchmark at its committed size (or a tiny size), on one or more
devices, with one row per (benchmark, device) in <out-dir>/suite.csv saying what ran, how long it took and where its
results went, or why it did not run.

    .venv/bin/python benchmarks/suite.py                                    # all of it on the CPU, results in results/bench
    .venv/bin/python benchmarks/suite.py --size tiny                        # each benchmark on a tiny size (what CI checks)
    .venv/bin/python benchmarks/suite.py --devices cuda cpu --jobs 4        # a GPU machine: CUDA and the same machine's CPU
    .venv/bin/python benchmarks/suite.py --only opfgl_engines synthetic_scale --list   # the commands, without running them

Each benchmark is one of the scripts beside this one, run as its own process with one torch thread; its output goes to
<out-dir>/suite_logs/. A benchmark whose requirement is missing (OpenFGL's venv for the side-by-side, Ray for Flower's
simulation, a CUDA device) is not run, and its row says which. CSV results are appended to `<name>[_<tag>].csv` in
--out-dir (the tag names the GPU, e.g. `h100`, whenever CUDA is among --devices, so a GPU machine's CPU and CUDA rows
sit in one file with a `device` column, beside the CPU machine's file); JSON results are written to
`<name>_suite[_<tag>]_<device>.json`. `--size tiny` writes to benchmarks/work/tiny unless --out-dir says otherwise, so
it never touches committed results. `--size short` is sized for one call of a lent GPU machine: the 2.4M-node graph
with METIS only (both engines), on the first device only; the client-scaling curve's sequential engine up to 100 clients; O-pFGL's
sequential engine on seed 0 only. `--budget S` stops the suite S seconds after it starts: a running benchmark is
stopped there, and those not started are recorded as not run. `--args NAME=ARGS` runs a benchmark with other arguments
(its row's `size` is then `args`), e.g. one partition of the 2.4M-node graph where a call's time is short.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks._common import run_in_group, short_commit  # noqa: E402

HERE = Path(__file__).resolve().parent
OPENFGL_PY = HERE / ".venv-openfgl" / "bin" / "python"


@dataclass
class Benchmark:
    "One benchmark of the suite: its script, its argument lists at each size (one process per list) and what it needs."
    name: str
    script: str
    full: list[list[str]]
    tiny: list[list[str]]
    short: list[list[str]] | None = None        # --size short (one call of a lent GPU machine); None: as full
    short_first_device_only: bool = False       # --size short runs it on the first of --devices only
    output: str = "csv"                         # what its --out is: a CSV the rows are appended to, or a JSON report
    per_device: bool = True                     # False: the result does not depend on the compute device (run once, on cpu)
    needs: list[str] = field(default_factory=list)   # modules this interpreter must have
    about: str = ""


BENCHMARKS = [
    Benchmark("synthetic_scale", "synthetic_scale.py",
              full=[["--sizes", "2449029:61859140", "--clients", "100", "--partitions", "metis", "louvain:sknetwork",
                     "--stages", "fedavg", "--rounds", "10", "--graph-cache", "{work}/graph-cache"],
                    ["--sizes", "2449029:61859140", "--clients", "100", "--partitions", "metis", "--stages", "opfgl",
                     "--engines", "stacked", "--opfgl-set", "stage1_iters=100", "finetune_iters=100", "stage_workers=2",
                     "--graph-cache", "{work}/graph-cache"]],
              tiny=[["--sizes", "2000:10000", "--clients", "2", "--partitions", "metis", "--stages", "fedavg", "--rounds", "1",
                     "--graph-cache", "{work}/graph-cache"]],
              short=[["--sizes", "2449029:61859140", "--clients", "100", "--partitions", "metis", "--stages", "fedavg",
                      "--rounds", "10", "--engines", "stacked", "sequential", "--graph-cache", "{work}/graph-cache",
                      "--timeout", "400"]],    # its own stage limit, inside a GPU call's budget: a cut-off stage still writes the engines it finished
              short_first_device_only=True,
              about="the 2.4M-node graph: METIS and Louvain into 100 clients, 10 FedAvg rounds, O-pFGL (short schedule), peak memory"),
    Benchmark("fedavg_vs_openfgl", "fedavg_vs_openfgl.py", output="json",
              full=[["--engine", "stacked", "--target-ratio", "0.15"]],
              tiny=[["--seeds", "0", "--rounds", "2", "--evaluation", "local", "--engine", "stacked"]],
              about="FedAvg on Cora beside OpenFGL 1.1.0 (needs its venv: benchmarks/setup_openfgl.sh)"),
    Benchmark("client_scaling", "client_scaling.py",
              full=[["--clients", "10", "100", "1000", "10000", "--engines", "stacked"],
                    ["--clients", "10", "100", "1000", "--engines", "sequential"]],
              short=[["--clients", "10", "100", "1000", "10000", "--engines", "stacked"],
                     ["--clients", "10", "100", "--engines", "sequential"]],
              tiny=[["--dataset", "Cora", "--clients", "3", "6", "--rounds", "1"]],
              about="the same graph in 10 to 10000 clients, both engines"),
    Benchmark("opfgl_engines", "opfgl_engines.py",
              full=[["--seeds", "0", "1", "2", "--stage-workers", "1", "2", "--surrogate-kernels", "torch", "c", "--stage-kernels", "torch", "c"]],
              short=[["--seeds", "0", "1", "2", "--engines", "stacked", "--stage-workers", "1", "2", "--surrogate-kernels", "torch", "c",
                      "--stage-kernels", "torch", "c"],
                     ["--seeds", "0", "--engines", "sequential"]],
              tiny=[["--seeds", "0", "--engines", "stacked", "--set", "surrogate_iters=5", "stage1_iters=5", "finetune_iters=5"]],
              about="O-pFGL end to end on Cora: sequential and stacked engines, stages in 1 or 2 processes, surrogate graph and stages in torch or C"),
    Benchmark("stacked_vs_vmap", "stacked_vs_vmap.py",
              full=[[]], tiny=[["--clients", "4", "--dataset", "Cora", "--reps", "1"]],
              about="block-diagonal stacking against torch.func.vmap, one training step"),
    Benchmark("flower_overhead", "flower_overhead.py", needs=["flwr", "ray"],
              full=[[]], tiny=[["--clients", "4", "--rounds", "1"]],
              about="where Flower's simulation spends its time, beside the in-process run"),
    Benchmark("startup", "startup.py", per_device=False,
              full=[[]], tiny=[["--reps", "1"]],
              about="start-up time of the fglit command"),
]
NAMES = [b.name for b in BENCHMARKS]
FIELDS = ["date", "machine", "cpus", "threads", "load", "commit", "benchmark", "size", "device", "status", "wall_s", "reason", "output", "command"]


def gpu_tag(name: str | None = None) -> str:
    "A short name of a GPU for file names (`NVIDIA H100 80GB HBM3` -> `h100`); by default this machine's first, '' without CUDA."
    if name is None:
        import torch
        if not torch.cuda.is_available():
            return ""
        name = torch.cuda.get_device_name(0)
    model = re.search(r"\b([A-Z]{0,2}\d{1,4}[A-Za-z]?)\b", name)
    return (model.group(1) if model else re.sub(r"\W+", "", name)[:12]).lower()


def missing(bench: Benchmark, device: str, openfgl_python: Path) -> str | None:
    "Why `bench` cannot run on `device` here, or None."
    if device.startswith("cuda"):
        import torch
        if not torch.cuda.is_available():
            return "no CUDA device on this machine"
    lacking = [m for m in bench.needs if importlib.util.find_spec(m) is None]
    if lacking:
        return f"{', '.join(lacking)} not installed in {sys.executable}"
    if bench.name == "fedavg_vs_openfgl":
        if not openfgl_python.exists():
            return f"no OpenFGL interpreter at {openfgl_python} (bash benchmarks/setup_openfgl.sh, or --openfgl-python)"
        if device.startswith("cuda"):
            probe = subprocess.run([str(openfgl_python), "-c", "import torch, openfgl; print(torch.cuda.is_available())"],
                                   capture_output=True, text=True)
            if probe.stdout.strip() != "True":
                return f"OpenFGL's interpreter {openfgl_python} has no CUDA torch (setup_openfgl.sh installs the CPU build)"
    return None


def why_not(bench: Benchmark, device: str, o) -> str | None:
    "Why the suite leaves (`bench`, `device`) out: a missing requirement, or --size short's first device only."
    if o.size == "short" and bench.short_first_device_only and device != o.devices[0] and bench.name not in o.overrides:
        return f"--size short runs it on {o.devices[0]} only"
    return missing(bench, device, o.openfgl_python)


def out_path(bench: Benchmark, out_dir: Path, tag: str, device: str) -> Path:
    if bench.output == "json":
        return out_dir / f"{bench.name}_suite{'_' + tag if tag else ''}_{device.split(':')[0]}.json"
    return out_dir / f"{bench.name}{'_' + tag if tag else ''}.csv"


def commands(bench: Benchmark, size: str, out: Path, work: Path, device: str, openfgl_python: Path,
             overrides: dict | None = None) -> list[list[str]]:
    """The processes `bench` runs at `size` (or with the argument lists `overrides[bench.name]`): one argument list each,
    with its output file and, for OpenFGL, the device and interpreter."""
    extra = (["--openfgl-python", str(openfgl_python), "--device", device.split(":")[0],
              "--work", str(work / f"openfgl-{device.split(':')[0]}")]     # its data and throwaway cache: one per device (--jobs)
             if bench.name == "fedavg_vs_openfgl" else [])
    sized = {"full": bench.full, "short": bench.short or bench.full, "tiny": bench.tiny}[size]
    lists = (overrides or {}).get(bench.name) or sized
    return [[sys.executable, str(HERE / bench.script), *[a.format(work=work) for a in args], *extra, "--out", str(out)]
            for args in lists]


def parse_overrides(items: list[str]) -> dict[str, list[list[str]]]:
    "`NAME=ARGS` items (ARGS split as a shell would) into {name: [args, ...]}: each item one process of that benchmark."
    out: dict[str, list[list[str]]] = {}
    for item in items:
        name, sep, args = item.partition("=")
        if not sep or name not in NAMES:
            raise SystemExit(f"--args takes NAME=ARGS with NAME one of {', '.join(NAMES)}; got {item!r}")
        out.setdefault(name, []).append(shlex.split(args))
    return out


def run_one(bench, device, o, tag, deadline, log_dir) -> dict:
    "Run one (benchmark, device): its processes one after another, until the first failure or the deadline."
    out = out_path(bench, o.out_dir, tag, device)
    cmds = commands(bench, o.size, out, o.work, device, o.openfgl_python, o.overrides)
    row = dict(benchmark=bench.name, size="args" if bench.name in o.overrides else o.size, device=device, output=str(out.relative_to(REPO) if out.is_relative_to(REPO) else out),
               command=" && ".join(shlex.join(c[1:]) for c in cmds), load=round(os.getloadavg()[0], 2),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    why = why_not(bench, device, o)
    if why:
        return dict(row, status="skipped", reason=why)
    log = log_dir / f"{bench.name}_{device.split(':')[0]}.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FGLIT_DEVICE": device, "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    with open(log, "w") as fh:
        for cmd in cmds:
            left = deadline - time.monotonic()
            if left <= 1:
                return dict(row, status="stopped", wall_s=time.perf_counter() - start, reason="the suite's --budget ran out first")
            fh.write(f"$ {shlex.join(cmd)}\n"); fh.flush()
            try:
                rc = run_in_group(cmd, min(left, o.timeout), stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=REPO).returncode
            except subprocess.TimeoutExpired:
                reason = "the suite's --budget ran out" if left < o.timeout else f"over --timeout {o.timeout:.0f} s"
                return dict(row, status="stopped", wall_s=time.perf_counter() - start, reason=f"{reason} (log: {log.name})")
            if rc != 0:
                return dict(row, status="failed", wall_s=time.perf_counter() - start, reason=f"exit status {rc} (log: {log.name})")
    return dict(row, status="ok", wall_s=time.perf_counter() - start, reason="")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="benchmarks:\n" + "\n".join(f"  {b.name:18s} {b.about}" for b in BENCHMARKS))
    ap.add_argument("--size", choices=["full", "short", "tiny"], default="full",
                    help="full: the committed sizes; short: sized for one call of a lent GPU machine; tiny: seconds each")
    ap.add_argument("--only", nargs="+", choices=NAMES, default=NAMES, metavar="NAME", help=f"run these only (of: {', '.join(NAMES)})")
    ap.add_argument("--skip", nargs="+", choices=NAMES, default=[], metavar="NAME", help="leave these out")
    ap.add_argument("--devices", nargs="+", default=["cpu"], help="FGLIT_DEVICE of each run (e.g. cuda cpu)")
    ap.add_argument("--jobs", type=int, default=1, help="benchmarks running at once (each uses one thread; keep timings on a quiet machine)")
    ap.add_argument("--timeout", type=float, default=4 * 3600, help="seconds per (benchmark, device)")
    ap.add_argument("--budget", type=float, default=None, help="seconds for the whole suite")
    ap.add_argument("--out-dir", type=Path, default=None, help="default: results/bench (--size full), benchmarks/work/tiny (--size tiny)")
    ap.add_argument("--tag", default=None, help="suffix of the output files (default: the GPU's model when cuda is among --devices)")
    ap.add_argument("--work", type=Path, default=HERE / "work", help="scratch folder (the synthetic graph cache)")
    ap.add_argument("--openfgl-python", type=Path, default=Path(os.environ.get("OPENFGL_PYTHON", OPENFGL_PY)))
    ap.add_argument("--args", nargs="+", default=[], metavar="NAME=ARGS", help="run benchmark NAME with ARGS instead of its "
                    "--size arguments (repeat NAME for several processes), e.g. 'synthetic_scale=--sizes 2449029:61859140 --clients 100'")
    ap.add_argument("--list", action="store_true", help="print the commands and what would be skipped, run nothing")
    o = ap.parse_args(argv)
    o.overrides = parse_overrides(o.args)
    o.out_dir = (o.out_dir or (HERE / "work" / "tiny" if o.size == "tiny" else REPO / "results" / "bench")).resolve()
    o.work = o.work.resolve()
    tag = o.tag if o.tag is not None else (gpu_tag() if any(d.startswith("cuda") for d in o.devices) else "")
    chosen = [b for b in BENCHMARKS if b.name in o.only and b.name not in o.skip]
    jobs = [(b, d) for b in chosen for d in (o.devices if b.per_device else ["cpu"])]
    if o.list:
        for b, d in jobs:
            why = why_not(b, d, o)
            for cmd in commands(b, o.size, out_path(b, o.out_dir, tag, d), o.work, d, o.openfgl_python, o.overrides):
                print(f"[{b.name} on {d}]" + (f" SKIPPED: {why}" if why else ""), f"FGLIT_DEVICE={d}", shlex.join(cmd))
        return 0
    from fglit.reproduction import append_row
    o.out_dir.mkdir(parents=True, exist_ok=True)
    log_dir = o.out_dir / "suite_logs"
    log_dir.mkdir(exist_ok=True)
    base = dict(machine=platform.node(), cpus=os.cpu_count(), threads=1, commit=short_commit())   # each benchmark: OMP_NUM_THREADS=1
    deadline = time.monotonic() + (o.budget if o.budget else 10 ** 9)

    def one(job):
        row = {**base, **run_one(*job, o, tag, deadline, log_dir)}
        append_row(o.out_dir / "suite.csv", {f: row.get(f) for f in FIELDS})
        print(f"{row['benchmark']:18s} {row['device']:6s} {row['status']:8s} "
              f"{'' if row.get('wall_s') is None else format(row['wall_s'], '7.1f') + ' s'} {row['reason']}", flush=True)
        return row

    with ThreadPoolExecutor(max(1, o.jobs)) as pool:
        rows = list(pool.map(one, jobs))
    failed = [r for r in rows if r["status"] == "failed"]
    print(f"{sum(r['status'] == 'ok' for r in rows)} ran, {len(failed)} failed, "
          f"{sum(r['status'] in ('skipped', 'stopped') for r in rows)} skipped or stopped; rows in {o.out_dir / 'suite.csv'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

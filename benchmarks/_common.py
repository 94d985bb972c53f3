"""What the benchmark scripts share: the commit they ran at, the device in words, a stage run in a fresh interpreter, a dataset given by name or as a synthetic graph spec, and O-pFGL's parts of a run."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def short_commit(repo: Path | None = None) -> str:
    "The checkout `repo`'s HEAD (this one, `REPO`, by default) as a short sha, with '+modified' when code in its fglit/ or benchmarks/ differs from it ('' outside a git checkout)."
    repo = repo or REPO
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""
    return f"{sha}+modified" if sha and modified("fglit", "benchmarks", repo=repo) else sha


CODE_SUFFIXES = (".py", ".c", ".sh")      # what a measurement runs; a changed README does not make a row '+modified'


def modified(*paths: str, repo: Path | None = None) -> bool | None:
    "Whether code (`CODE_SUFFIXES`) under the checkout `repo`'s (default `REPO`) `paths` differs from HEAD (uncommitted changes); None when git cannot tell."
    repo = repo or REPO
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--", *paths], cwd=repo, capture_output=True, text=True, timeout=10)
        changed = [line[3:].split(" -> ")[-1].strip('"') for line in out.stdout.splitlines()]
        return any(name.endswith(CODE_SUFFIXES) for name in changed) if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def fedavg_cora_settings(evaluation: str, engine: str, lr: float = 0.01, hidden: int = 64, weight_decay: float = 5e-4,
                         dropout: float = 0.5, local_kernel: str = "torch", auc: bool = False) -> dict:
    "fglit's settings for FedAvg on Cora as OpenFGL's defaults run it (Adam, full participation, the best-validation round, no AUC), shared by the side-by-side (`fedavg_vs_openfgl.py`) and `commit_ab.py` so the two time the same run."
    return {"lr": lr, "hidden": hidden, "weight_decay": weight_decay, "dropout": dropout, "layers": 2, "optimizer": "adam",
            "client_fraction": 1.0, "selection": "best_val", "evaluation": evaluation, "mode": "pack", "engine": engine,
            **({"local_kernel": local_kernel} if local_kernel != "torch" else {}), "auc": auc}


def stage_env() -> dict:
    "The environment a benchmark stage runs in: one torch thread, and this checkout importable."
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def run_in_group(cmd: list[str], timeout: float, **popen) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, timeout=timeout, **popen)` in a process group of its own: past `timeout` the whole group is
    killed (the command's own children too: stage processes, O-pFGL's forked stage workers, Ray), which also closes the
    pipes they held, and `TimeoutExpired` is raised with what the command printed."""
    with subprocess.Popen(cmd, start_new_session=True, **popen) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_stage(code: str, args, env: dict, timeout: float, cwd: Path | None = None) -> tuple[list[dict], str | None]:
    """Run `code` in a fresh interpreter (`python -c code '<args as JSON>'`, so its peak memory is its own): the JSON lines
    it printed, each a result, and the error in one line (the last line of stderr, the signal that killed it, or the time
    limit), None when it ended well. Results printed before a failure are kept. `cwd`: the folder it runs in (`python -c`
    imports from there first)."""
    try:
        out = run_in_group([sys.executable, "-c", code, json.dumps(args)], timeout, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, env=env, cwd=cwd)
        stdout, rc, stderr = out.stdout, out.returncode, out.stderr
    except subprocess.TimeoutExpired as exc:
        stdout, rc, stderr = exc.stdout or "", None, ""
        stdout = stdout.decode() if isinstance(stdout, bytes) else stdout
    rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    if rc == 0:
        return rows, None
    if rc is None:
        return rows, f"over {timeout:.0f} s"
    if rc < 0:
        return rows, f"killed by signal {-rc}"
    return rows, (stderr.strip().splitlines() or [f"exit status {rc}"])[-1][:200]


def stage_outcome(results: list[dict], error: str | None) -> dict:
    "The columns a one-result stage adds to its row: its (last) result, or its error."
    return {"error": error} if error else (results[-1] if results else {})


class RowLog:
    "A benchmark's rows: each printed as JSON and appended to the CSV `out` (the columns `fields`) as it ends."
    def __init__(self, out: Path, fields: list[str]):
        self.out, self.fields, self.count = out, fields, 0

    def write(self, row: dict) -> None:
        from fglit.reproduction import append_row
        print(json.dumps(row), flush=True)
        append_row(self.out, {f: row.get(f) for f in self.fields})      # one whole line; torn rows repaired
        self.count += 1

    def summary(self) -> str:
        return f"appended {self.count} rows to {self.out.relative_to(REPO) if self.out.is_relative_to(REPO) else self.out}"


def device_name() -> str:
    "The device fglit computes on, in words: `cuda:<GPU name>`, or `cpu:<processor> (<n> thread(s))`."
    import platform
    import torch
    from fglit.core import get_device
    device = get_device()
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return f"cpu:{platform.processor() or platform.machine()} ({torch.get_num_threads()} thread(s))"


def bench_dataset(spec: str):
    "A dataset by name, or `synthetic:NODES:EDGES:CLASSES:FEATURES`: fglit.synthetic's graph (homophily 0.8, feature signal 0.5, seed 0)."
    if spec.startswith("synthetic:"):
        from fglit.own_data import as_dataset
        from fglit.synthetic import synthetic_graph
        n, m, c, f = (int(v) for v in spec.split(":")[1:])
        return as_dataset(synthetic_graph(n, m, c, f, homophily=0.8, feature_signal=0.5, seed=0), name=f"synthetic-{n}")
    from fglit.data import load_dataset
    return load_dataset(spec)


def opfgl_parts(server, logs: list[dict], engine: str) -> dict:
    """O-pFGL's parts of one run, from its server and its clients' logs (a `callback` keeps both): the surrogate graph's time
    and the kernel that built it ('none' without a graph), and each stage's wall time: the clients' one after another
    under the sequential engine; under the stacked one, a stack's clients share its stage time, a process's stacks run one
    after another and the processes (stage_workers) at once: the slowest process's sum over its stacks. `worker_peak_rss_mb`:
    the largest peak memory a forked stage worker logged (`stage_peak_rss_mb`; 0 without workers), its shared pages included."""
    graph = server.graph

    def wall(key: str) -> float:
        if engine != "stacked": return sum(log.get(key, 0.0) for log in logs)
        stacks: dict[tuple, float] = {}
        for log in logs:
            where = (log.get("stage_process", 0), log.get("stage_stack", 0))
            stacks[where] = max(stacks.get(where, 0.0), log.get(key, 0.0))
        processes: dict = {}
        for (process, _), seconds in stacks.items(): processes[process] = processes.get(process, 0.0) + seconds
        return max(processes.values(), default=0.0)
    return dict(surrogate_s=graph.seconds if graph is not None else 0.0, surrogate_kernel=graph.kernel if graph is not None else "none",
                stage1_s=wall("stage1_s"), stage2_s=wall("stage2_s"),
                worker_peak_rss_mb=max((log["stage_peak_rss_mb"] for log in logs if log.get("stage_process", 0) > 0
                                        and log.get("stage_peak_rss_mb") is not None), default=0.0))

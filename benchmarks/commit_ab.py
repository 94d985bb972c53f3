"""Two commits of fglit side by side: one FedAvg simulation timed at each, in alternating fresh interpreters, on the same machine in the same minutes.

The host's speed moves by 20-40% over an hour, more than most changes a commit makes, so a change is measured against
its parent in one run: `--repeats` rounds of (before, after), each a fresh interpreter at that commit (a git worktree
in a scratch folder; the after side is this checkout) that builds the run once untimed and then times `simulate` for
every seed. Rows go to results/bench/commit_ab.csv, one per (side, repeat, seed), under the invocation's start time
(`run`), with the accuracy, which a change
meant to be exact must leave as it was.

    .venv/bin/python benchmarks/commit_ab.py --before 0d1e81c                 # FedAvg on Cora, stacked kipfgcn, 5 x 2 runs
    .venv/bin/python benchmarks/commit_ab.py --before HEAD~1 --repeats 2 --rounds 5 --out /tmp/ab.csv
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, RowLog, fedavg_cora_settings, run_stage, short_commit  # noqa: E402

FIELDS = ["run", "date", "machine", "cpus", "load", "threads", "side", "commit", "repeat", "seed", "algorithm", "dataset", "partition",
          "clients", "rounds", "local_epochs", "model", "engine", "evaluation", "simulate_s", "accuracy", "error"]

# one side's interpreter: the run built once untimed (imports, dataset, partition, first calls), then every seed timed
STAGE = r"""
import json, os, sys, time, torch
a = json.loads(sys.argv[1])
torch.set_num_threads(1)
import fglit
if not os.path.realpath(fglit.__file__).startswith(os.path.realpath(a["tree"]) + os.sep):
    raise SystemExit(f"fglit was imported from {fglit.__file__}, not from the checkout {a['tree']}")
from fglit.data import load_dataset
from fglit.federation import run
ds = load_dataset(a["dataset"])
kw = dict(dataset=ds, partition=a["partition"], clients=a["clients"], rounds=a["rounds"], local_epochs=a["local_epochs"],
          model=a["model"], settings=a["settings"], progress=False)
run(a["algorithm"], seeds=[a["seeds"][0]], **kw)
for seed in a["seeds"]:
    r = run(a["algorithm"], seeds=[seed], **kw)
    print(json.dumps({"seed": seed, "simulate_s": r.runs[0].wall_time_s, "accuracy": float(r.summary()["accuracy_mean"])}), flush=True)
"""


def cli():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="the commit to measure against (any git revision)")
    p.add_argument("--repeats", type=int, default=5, help="rounds of (before, after) interpreters (default 5)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--algorithm", default="fedavg")
    p.add_argument("--dataset", default="Cora")
    p.add_argument("--partition", default="louvain")
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--local-epochs", type=int, default=3)
    p.add_argument("--model", default="kipfgcn")
    p.add_argument("--engine", choices=["sequential", "stacked"], default="stacked")
    p.add_argument("--evaluation", choices=["global", "local"], default="global")
    p.add_argument("--timeout", type=float, default=900, help="seconds per interpreter")
    p.add_argument("--out", type=Path, default=REPO / "results" / "bench" / "commit_ab.csv")
    return p.parse_args()


def worktree(rev: str, scratch: Path) -> tuple[Path, str]:
    "A checkout of `rev` under `scratch` (git worktree, detached), and its short sha."
    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=REPO, capture_output=True, text=True)
    if sha.returncode:
        raise SystemExit(f"commit_ab: git does not know the revision {rev!r}: {sha.stderr.strip()}")
    path = scratch / "before"
    subprocess.run(["git", "worktree", "add", "--detach", "-f", str(path), rev], cwd=REPO, check=True, capture_output=True)
    return path, sha.stdout.strip()


def main():
    o = cli()
    args = dict(seeds=o.seeds, algorithm=o.algorithm, dataset=o.dataset, partition=o.partition, clients=o.clients,
                rounds=o.rounds, local_epochs=o.local_epochs, model=o.model, engine=o.engine, evaluation=o.evaluation)
    settings = fedavg_cora_settings(o.evaluation, o.engine)      # the side-by-side's settings (fedavg_vs_openfgl.py), on both sides
    log = RowLog(o.out, FIELDS)
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")     # names this invocation's rows
    scratch = Path(tempfile.mkdtemp(prefix="fglit-ab-"))
    try:
        before, before_sha = worktree(o.before, scratch)
        sides = {"before": (before, before_sha), "after": (REPO, short_commit())}
        times = {side: [] for side in sides}
        for repeat in range(o.repeats):
            for side, (tree, sha) in sides.items():
                env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tree)}
                rows, error = run_stage(STAGE, dict(args, tree=str(tree), settings=settings), env, o.timeout, cwd=tree)   # (python -c imports from its folder first)
                base = dict(run=started, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), machine=platform.node(),
                            cpus=os.cpu_count(), load=round(os.getloadavg()[0], 2), threads=1, side=side, commit=sha, repeat=repeat,
                            **{k: v for k, v in args.items() if k != "seeds"})
                for r in rows:
                    log.write(dict(base, **r)); times[side].append(r["simulate_s"])
                if error: log.write(dict(base, error=error))
        med = {side: statistics.median(t) for side, t in times.items() if t}
        if len(med) == 2:
            print(f"median simulate: before ({before_sha}) {med['before']:.3f} s, after ({sides['after'][1]}) {med['after']:.3f} s, "
                  f"ratio {med['after'] / med['before']:.3f}")
        print(log.summary())
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(scratch / "before")], cwd=REPO, capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()

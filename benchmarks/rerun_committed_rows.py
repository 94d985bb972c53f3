"""Re-run committed reproduction rows with the fglit on PYTHONPATH / installed, to show a change left results unchanged.

    python benchmarks/rerun_committed_rows.py OUT.json [--rows results/checks/core_split_rows.csv]

Each row of the rows file names a committed row (paper, table, dataset, partition, clients, method, note, seed). The row's
experiment is looked up in its paper's registered reproduction grid and run with the paper module's own run function,
seed and settings. Writes {row key: {accuracy, f1_macro, commit}} as JSON; compare two such files with --compare A B OUT.csv.
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path

import pandas as pd

KEY = ["paper", "table", "dataset", "partition", "clients", "method", "note", "seed"]


def row_key(r) -> str:
    return "|".join(str(r[k]) for k in KEY)


def rerun(rows_file: str, out: str) -> None:
    import torch
    from fglit.reproduction import get_reproduction
    torch.set_num_threads(1)
    rows = pd.read_csv(rows_file, keep_default_na=False)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(sys.modules["fglit"].__file__).parent).stdout.strip()
    results = {}
    for _, r in rows.iterrows():
        repro = get_reproduction(r["paper"])
        want = (str(r["table"]), r["dataset"], r["partition"], int(r["clients"]), r["method"], str(r["note"]))
        exps = [e for e in repro.grid() if (str(e.table), e.dataset, e.partition, int(e.clients), e.method, str(e.note)) == want]
        if len(exps) != 1:
            results[row_key(r)] = {"error": f"{len(exps)} experiments match"}
            continue
        got = repro.run_one(exps[0], int(r["seed"]))
        results[row_key(r)] = {"accuracy": got["accuracy"], "f1_macro": got.get("f1_macro"), "commit": commit}
        print(row_key(r), results[row_key(r)], flush=True)
    Path(out).write_text(json.dumps(results, indent=1))


def compare(rows_file: str, before: str, after: str, out: str) -> pd.DataFrame:
    rows = pd.read_csv(rows_file, keep_default_na=False)[KEY + ["committed_accuracy", "committed_at"]]
    a, b = json.loads(Path(before).read_text()), json.loads(Path(after).read_text())
    ca, cb = next(iter(a.values()))["commit"], next(iter(b.values()))["commit"]
    keys = rows.apply(row_key, axis=1)
    rows[f"before_{ca}"] = [a[k].get("accuracy") for k in keys]
    rows[f"after_{cb}"] = [b[k].get("accuracy") for k in keys]
    rows["before_f1"] = [a[k].get("f1_macro") for k in keys]
    rows["after_f1"] = [b[k].get("f1_macro") for k in keys]
    rows["identical"] = [a[k].get("accuracy") == b[k].get("accuracy") and a[k].get("f1_macro") == b[k].get("f1_macro")
                         and "error" not in a[k] for k in keys]
    rows.to_csv(out, index=False)
    return rows


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--rows", default="results/checks/core_split_rows.csv")
    p.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    args = p.parse_args()
    if args.compare:
        print(compare(args.rows, *args.compare, args.out).to_string())
    else:
        rerun(args.rows, args.out)

"""Crash-safe run records (issue 58, part 5): `fglit run --out DIR` writes seed by seed, atomically, and resumes; a lock
refuses a second run on DIR; a folder holding another run is refused unless `--overwrite`; `--log-csv` is idempotent."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from fglit.cli import main
from fglit.fl.files import FileLock

TABLES = ("scores", "per_round", "per_client", "communication")


def _command(root, out, rounds=10, seeds=(0, 1, 2), extra=()):
    return ["run", "fedavg", "--dataset", "Cora", "--clients", "3", "--rounds", str(rounds), "--quiet", "--root", str(root),
            "--seeds", *map(str, seeds), "--out", str(out), *extra]


def _read_record(out: Path) -> dict:
    "Every file of a record, parsed (a torn file fails here)."
    rec = {name: pd.read_csv(out / f"{name}.csv") for name in TABLES}
    rec["summary"] = json.loads((out / "summary.json").read_text())
    rec["config"] = json.loads((out / "config.json").read_text())
    rec["seeds"] = {int(f.stem.split("_")[1]): json.loads(f.read_text()) for f in (out / "seeds").glob("seed_*.json")}
    return rec


def test_a_killed_run_keeps_its_finished_seeds_and_resumes_to_the_uninterrupted_result(shared_root, tmp_path, capsys):
    killed, whole, log = tmp_path / "killed", tmp_path / "whole", tmp_path / "rounds.csv"
    env = {**os.environ, "FGLIT_DATA": str(shared_root), "OMP_NUM_THREADS": "1"}
    cli = [sys.executable, "-c", "import sys; from fglit.cli import main; sys.exit(main())"]
    p = subprocess.Popen(cli + _command(shared_root, killed, extra=["--log-csv", str(log)]), env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and p.poll() is None and not (killed / "summary.json").exists():
        time.sleep(0.02)                      # the record shows a finished seed: kill during the next
    assert p.poll() is None, f"the run ended before it could be killed: {p.stderr.read().decode()[-500:]}"
    p.send_signal(signal.SIGKILL); p.wait()
    # what the kill left: whole files, the finished seeds in them, and the seed it cut short nowhere
    rec = _read_record(killed)
    finished = sorted(rec["seeds"])
    assert finished and finished != [0, 1, 2], finished
    assert set(rec["summary"]["seeds"]) <= set(finished) and set(rec["scores"].seed) <= set(finished) and len(rec["scores"])
    assert rec["config"]["seeds"] == [0, 1, 2]
    kept = {s: (killed / "seeds" / f"seed_{s}.json").stat().st_mtime_ns for s in finished}
    # run again: only the missing seeds run, and the record is the one an uninterrupted run writes
    capsys.readouterr()
    assert main(_command(shared_root, killed, extra=["--log-csv", str(log)])) == 0
    err = capsys.readouterr().err
    assert f"seed(s) {', '.join(map(str, finished))} of this run are there already" in err
    assert {s: (killed / "seeds" / f"seed_{s}.json").stat().st_mtime_ns for s in finished} == kept   # not run again
    assert main(_command(shared_root, whole)) == 0
    a, b = _read_record(killed), _read_record(whole)
    assert sorted(a["seeds"]) == [0, 1, 2] and a["config"] == b["config"]
    for name in TABLES:
        pd.testing.assert_frame_equal(a[name].drop(columns="wall_time_s", errors="ignore"),
                                      b[name].drop(columns="wall_time_s", errors="ignore"), check_exact=True)
    assert {k: v for k, v in a["summary"].items() if k != "wall_time_s"} == {k: v for k, v in b["summary"].items() if k != "wall_time_s"}
    # --log-csv: every (seed, round) once, the killed seed's partial rows replaced by its rerun's
    rows = pd.read_csv(log)
    assert not rows.duplicated(["seed", "round"]).any() and len(rows) == 3 * 10 and rows["run"].nunique() == 1
    assert sorted(p.name for p in killed.iterdir() if p.name.endswith(".tmp")) == []


def test_a_second_run_on_the_same_folder_is_refused_and_a_dead_runs_lock_blocks_nothing(shared_root, tmp_path, capsys):
    out = tmp_path / "rec"
    with FileLock(out / ".lock", out):            # a run holding the folder (this process, through another descriptor)
        assert main(_command(shared_root, out, rounds=1, seeds=[0])) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"fglit: error: another run is writing to {out} (process {os.getpid()}); wait for it, or write to another --out"
    assert not (out / "summary.json").exists()
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time\n"
                               f"fd = os.open({str(out / '.lock')!r}, os.O_RDWR | os.O_CREAT); fcntl.flock(fd, fcntl.LOCK_EX)\n"
                               "print('locked', flush=True); time.sleep(600)"], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    assert main(_command(shared_root, out, rounds=1, seeds=[0])) == 2          # held by a live process: refused
    assert f"another run is writing to {out}" in capsys.readouterr().err
    holder.send_signal(signal.SIGKILL); holder.wait()
    assert main(_command(shared_root, out, rounds=1, seeds=[0])) == 0          # its process is dead: the lock is gone
    assert json.loads((out / "summary.json").read_text())["seeds"] == [0]


def test_a_folder_holding_another_run_is_refused_unless_overwrite(shared_root, tmp_path, capsys):
    out = tmp_path / "rec"
    assert main(_command(shared_root, out, rounds=1, seeds=[0])) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    capsys.readouterr()
    assert main(_command(shared_root, out, rounds=2, seeds=[0])) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"fglit: error: {out} holds the record of another run (rounds: 1 there, 2 here)")
    assert "--overwrite" in err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before        # nothing overwritten
    assert main(_command(shared_root, out, rounds=2, seeds=[0], extra=["--overwrite"])) == 0
    assert json.loads((out / "config.json").read_text())["rounds"] == 2
    assert json.loads((out / "seeds" / "seed_0.json").read_text())["identity"]["config"]["rounds"] == 2
    (tmp_path / "file").write_text("x")
    assert main(_command(shared_root, tmp_path / "file", rounds=1, seeds=[0])) == 2          # a file, not a folder
    assert capsys.readouterr().err.startswith("fglit: error: ")


def test_log_csv_is_idempotent_when_a_run_is_repeated(shared_root, tmp_path, capsys):
    log = tmp_path / "rounds.csv"
    small = ["run", "fedavg", "--dataset", "Cora", "--clients", "3", "--quiet", "--root", str(shared_root), "--log-csv", str(log)]
    assert main(small + ["--rounds", "2", "--seeds", "0", "1"]) == 0
    first = pd.read_csv(log)
    assert main(small + ["--rounds", "2", "--seeds", "0", "1"]) == 0                       # the same run again
    again = pd.read_csv(log)
    assert len(first) == len(again) == 4 and not again.duplicated(["run", "seed", "round"]).any()
    pd.testing.assert_frame_equal(first.drop(columns="seconds"), again.drop(columns="seconds"))
    assert main(small + ["--rounds", "3", "--seeds", "0"]) == 0                            # another run: its own rows, kept apart
    both = pd.read_csv(log)
    assert len(both) == 4 + 3 and both["run"].nunique() == 2 and not both.duplicated(["run", "seed", "round"]).any()
    assert main(small + ["--rounds", "2", "--seeds", "1"]) == 0                            # the first run's seed 1 again
    last = pd.read_csv(log)
    assert len(last) == 7 and not last.duplicated(["run", "seed", "round"]).any()

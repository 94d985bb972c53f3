"""Result-CSV helpers of `fglit.reproduction`: `append_row` keeps every value under its own header when a grid's columns change; `completed`, `results_file`."""
from pathlib import Path

import pandas as pd

from fglit.reproduction import append_row


def test_rows_with_new_or_missing_columns_stay_aligned(tmp_path):
    out = tmp_path / "runs.csv"
    append_row(out, dict(method="A", seed=0, accuracy=0.5, time_s=3.0))
    append_row(out, dict(method="B", seed=0, accuracy=0.6, time_s=4.0))          # same columns: appended
    append_row(out, dict(method="C", seed=1, accuracy=0.7, auc=0.9))             # lost time_s, gained auc
    d = pd.read_csv(out)
    assert d.method.tolist() == ["A", "B", "C"]
    assert d.accuracy.tolist() == [0.5, 0.6, 0.7] and d.seed.tolist() == [0, 0, 1]
    assert d.time_s.iloc[:2].tolist() == [3.0, 4.0] and pd.isna(d.time_s.iloc[2])
    assert pd.isna(d.auc.iloc[0]) and d.auc.iloc[2] == 0.9


def test_a_row_missing_columns_is_appended_under_the_header(tmp_path):
    out = tmp_path / "runs.csv"
    append_row(out, dict(method="A", accuracy=0.5, time_s=3.0))
    append_row(out, dict(method="B", accuracy=0.6))
    assert open(out).read().splitlines() == ["method,accuracy,time_s", "A,0.5,3.0", "B,0.6,"]


def test_completed_keeps_only_rows_without_an_error():
    from fglit.reproduction import completed
    rows = pd.DataFrame({"seed": [0, 1, 2, 3], "error": [None, "", "RuntimeError: boom", float("nan")]})
    assert completed(rows).seed.tolist() == [0, 1, 3]
    no_error_column = pd.DataFrame({"seed": [0, 1]})
    assert completed(no_error_column).equals(no_error_column)


def test_results_file_is_found_from_the_root_nbs_or_nbs_papers(tmp_path, monkeypatch):
    from fglit.reproduction import results_file
    (tmp_path / "results").mkdir(); (tmp_path / "nbs" / "papers").mkdir(parents=True)
    csv = tmp_path / "results" / "runs.csv"
    csv.write_text("a\n1\n")
    monkeypatch.chdir(tmp_path)
    assert results_file("results/runs.csv") == Path("results/runs.csv")
    monkeypatch.chdir(tmp_path / "nbs")
    assert results_file("results/runs.csv") == Path("..") / "results/runs.csv"
    monkeypatch.chdir(tmp_path / "nbs" / "papers")                            # the reproduction notebooks' folder
    assert results_file("results/runs.csv") == Path("../..") / "results/runs.csv"
    assert results_file("results/other.csv") is None
    assert results_file("results/runs.csv", "elsewhere.csv") is None          # an explicit path is not searched for


def test_authors_variants_match_whole_note_parts():
    "A variant key labels the rows whose note has it as one '; '-separated part: a key that starts another part labels nothing there."
    from fglit.reproduction import fglit_authors_rows
    on_authors = pd.DataFrame(dict(method=["M", "M", "M"], table="1", note=[
        "authors' partition", "code's settings; authors' partition", "code's settings and more; authors' partition"]))
    runs = pd.DataFrame(dict(method=[], table=[], note=[]))
    rows = fglit_authors_rows(on_authors, runs, ("1",), ("M",), {"code's settings": "code's settings",
                                                                  "code's settings and more": "more"})
    assert rows.method.tolist() == ["M", "M [code's settings]", "M [more]"]


# -- crash-safe results files ------------------------------------------------------------------------------------------
import os
import signal
import subprocess
import sys
import time
import warnings as _warnings

import pytest

from fglit.reproduction import Experiment, ResultsFileBusy, ResultsLock, read_results, run_grid

from _grid_helpers import quick_run

TESTS = os.path.dirname(os.path.abspath(__file__))


def _grid(n: int = 3) -> list:
    return [Experiment("t", "Cora", "louvain", 3, f"m{i}", "fedavg") for i in range(n)]


def test_a_torn_last_row_is_dropped_and_redone(tmp_path):
    out = tmp_path / "runs.csv"
    run_grid(_grid(2), quick_run, seeds=(0,), out=out, progress=False)
    whole = out.read_text()
    out.write_text(whole + "t,Cora,louvain,3,m9,fed")              # a kill in the middle of a row
    with pytest.warns(UserWarning, match="incomplete"):
        rows = run_grid(_grid(3), quick_run, seeds=(0,), out=out, progress=False)
    assert len(rows) == 3 and out.read_text().startswith(whole)
    again = read_results(out)
    assert len(again) == 3 and again.method.tolist() == ["m0", "m1", "m2"] and (again.blob.str.len() == 4000).all()


def test_a_run_in_the_file_twice_counts_once(tmp_path):
    out = tmp_path / "runs.csv"
    run_grid(_grid(2), quick_run, seeds=(0,), out=out, progress=False)
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines + lines[1:2]))                   # two runs appended the same row
    with pytest.warns(UserWarning, match="repeat a run"):
        df = read_results(out)
    assert len(df) == 2


def test_a_second_run_on_the_same_file_is_refused(tmp_path):
    out = tmp_path / "runs.csv"
    with ResultsLock(out):
        with pytest.raises(ResultsFileBusy, match=f"process {os.getpid()}"):
            run_grid(_grid(1), quick_run, seeds=(0,), out=out, progress=False)
    run_grid(_grid(1), quick_run, seeds=(0,), out=out, progress=False)           # free again once the first is done


def _python(code: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([TESTS] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    return subprocess.Popen([sys.executable, "-c", code], env=env)


def test_killing_a_run_mid_write_leaves_a_readable_file(tmp_path):
    "SIGKILL a run that appends rows as fast as it can, at several moments: the file always reads back whole rows."
    out = tmp_path / "runs.csv"
    code = ("from fglit.reproduction import Experiment, run_grid; from _grid_helpers import quick_run\n"
            f"run_grid([Experiment('t', 'Cora', 'louvain', 3, f'm{{i}}', 'fedavg') for i in range(100000)], quick_run, "
            f"seeds=(0,), out={str(out)!r}, progress=False)")
    for delay in (0.0, 0.5, 1.2):
        size = out.stat().st_size if out.exists() else 0
        p = _python(code)
        deadline = time.monotonic() + 120      # start-up (torch, and CUDA's under make test-gpu) takes seconds on a busy machine:
        while time.monotonic() < deadline and p.poll() is None and (out.stat().st_size if out.exists() else 0) <= size:
            time.sleep(0.05)                   # kill only once this run has written, at several moments after
        time.sleep(delay)
        p.send_signal(signal.SIGKILL); p.wait()
        with _warnings.catch_warnings():
            _warnings.simplefilter("ignore")
            df = read_results(out)
        assert len(df) > 0 and (df.blob.str.len() == 4000).all() and not df.duplicated(["method", "seed"]).any()


def test_workers_end_when_their_parent_is_killed(tmp_path):
    psutil = pytest.importorskip("psutil")
    code = ("from fglit.reproduction import Experiment, run_grid; from _grid_helpers import slow_run\n"
            f"run_grid([Experiment('t', 'Cora', 'louvain', 3, f'm{{i}}', 'fedavg') for i in range(4)], slow_run, "
            f"seeds=(0,), out={str(tmp_path / 'runs.csv')!r}, jobs=2, progress=False)")
    p = _python(code)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(psutil.Process(p.pid).children(recursive=True)) < 2: time.sleep(0.2)
    workers = psutil.Process(p.pid).children(recursive=True)
    assert len(workers) >= 2
    p.send_signal(signal.SIGKILL); p.wait()
    gone, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, f"workers still running after their parent was killed: {[w.pid for w in alive]}"


def test_a_run_recorded_with_other_settings_is_named_not_silently_kept(tmp_path):
    "Resuming skips a run by its key; when the grid now gives that run other settings, rounds or epochs, the warning names it."
    from dataclasses import replace
    import warnings as _warnings
    from fglit.reproduction import changed_runs
    out = tmp_path / "runs.csv"
    old = [replace(e, settings='{"lr": 0.01}', rounds=50) for e in _grid(2)]
    run_grid(old, quick_run, seeds=(0, 1), out=out, progress=False)
    with _warnings.catch_warnings():
        _warnings.simplefilter("error")                                          # the same grid again: no warning
        run_grid(old, quick_run, seeds=(0, 1), out=out, progress=False)
    new = [replace(old[0], settings='{"lr": 0.005}'), replace(old[1], rounds=100)]
    with pytest.warns(UserWarning, match=r"2 recorded run\(s\).*m0/seed 0 \(settings\).*m1/seed 0 \(rounds\)") as caught:
        rows = run_grid(new, quick_run, seeds=(0,), out=out, progress=False)
    assert len(rows) == 2 and len(read_results(out)) == 4                        # kept, not rerun
    assert "seed 1" not in str(caught[0].message)                                # only the seeds asked for
    same_json = [replace(old[0], settings='{ "lr":0.01 }')]                      # the same settings, spelled otherwise
    assert changed_runs(read_results(out), {same_json[0].key(0): same_json[0]}) == []

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

"""`append_row`: result CSVs keep every value under its own header when a grid's columns change."""
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

"""benchmarks/flower_overhead.py (issue #28): its breakdown adds up, and the script runs end to end on a tiny size."""
import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("flower_overhead", REPO / "benchmarks" / "flower_overhead.py")
fo = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fo)


def _fake_run():
    "A child's result and its processes' timing lines, as a 2-client, 1-round run would write them."
    res = dict(start=100.0, entered=102.0, result=130.0, closed=131.5, inprocess_s=0.5,
               exchanges=dict(round=[0, 1, 1], what=["setup", "train", "evaluate"], messages=[2, 2, 2], seconds=[15.0, 2.0, 1.0]))
    server = dict(side="server", pid=1, start=110.0, end=129.0, total=19.0,
                  stages=dict(wait_nodes=0.5, exchange=18.0, encode=0.1, decode=0.05, wire_bytes=0.2))
    clients = [dict(side="client", kind=k, pid=p, start=120.0 + i, total=t, stages=s) for i, (k, p, t, s) in enumerate([
        ("setup", 2, 1.0, {"save_state": 0.1}), ("setup", 3, 1.2, {"save_state": 0.1}),
        ("train", 2, 0.5, {"load_state": 0.01, "decode": 0.01, "encode": 0.01, "save_state": 0.1}),
        ("train", 3, 0.6, {"load_state": 0.05, "decode": 0.01, "encode": 0.01, "save_state": 0.1}),
        ("evaluate", 2, 0.2, {"load_state": 0.0, "decode": 0.01}), ("evaluate", 3, 0.2, {"load_state": 0.04, "decode": 0.01})])]
    return res, [server] + clients


def test_flower_stages_add_up_to_the_wall_time():
    res, timings = _fake_run()
    rows = {(g, s): v for g, s, v in fo.breakdown(res, timings, workers=2)}
    flower = {s: v for (g, s), v in rows.items() if g == "flower" and s != "total"}
    assert math.isclose(sum(flower.values()), rows["flower", "total"]) and rows["flower", "total"] == 31.5
    assert rows["flower", "setup_until_first_clientapp"] == pytest.approx(120.0 - 110.5)       # first ClientApp - setup push
    assert rows["flower", "exchange_setup"] == pytest.approx(15.0 - 9.5)
    assert rows["clientapp", "total"] == pytest.approx(3.7)
    assert rows["clientapp", "train_compute"] == pytest.approx(1.1 - 0.3)
    assert rows["exchange", "flower_wait"] == pytest.approx(18.0 - 3.7 / 2) and rows["exchange", "processes"] == 2
    assert all(v >= 0 for v in flower.values())


@pytest.mark.slow
@pytest.mark.long
def test_overhead_benchmark_runs_on_a_tiny_size(shared_root, tmp_path):
    "4 clients, 1 round, this tree: about a minute (Ray's start), so `make test-long` runs it."
    out = tmp_path / "overhead.csv"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "flower_overhead.py"), "--clients", "4", "--rounds", "1",
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = pd.read_csv(out)
    assert list(rows.columns) == fo.FIELDS and set(rows.variant) == {"this"} and rows.same_scores.all()
    flower = rows[rows.group == "flower"].set_index("stage").seconds
    assert abs(flower.drop("total").sum() - flower["total"]) < 0.01 * flower["total"] + 0.01
    assert rows[(rows.group == "exchange") & (rows.stage == "processes")].seconds.iloc[0] >= 1
    assert {"train_save_state", "train_compute", "evaluate_compute"} <= set(rows[rows.group == "clientapp"].stage)

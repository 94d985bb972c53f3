"""The stacked engine from the outside (`engine="stacked"`, fglit.fl.stacked): through `run` (the CLI passes it as
`--set engine=stacked`), what it refuses,
and the client-scaling benchmark on a tiny size. (The two engines' per-round equality is checked in nbs/10_fedavg.)"""
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from fglit.federation import run
from fglit.fl.config import ConfigError
from fglit.fl.loop import stacked_algorithms

REPO = Path(__file__).resolve().parents[1]


def test_the_declared_algorithms_are_the_stacked_ones():
    assert stacked_algorithms() == ["fedavg", "fedavg_ft", "fedproto", "fedprox", "fedtgp", "moon", "opfgl", "scaffold", "standalone"]


def test_run_with_the_stacked_engine_matches_the_sequential_one_without_dropout():
    kw = dict(rounds=3, local_epochs=1, seeds=(0,), progress=False)
    seq = run("fedavg", "Cora", "metis", 6, settings={"dropout": 0.0}, **kw)
    stk = run("fedavg", "Cora", "metis", 6, settings={"dropout": 0.0, "engine": "stacked"}, **kw)
    a, b = seq.runs[0].per_round(), stk.runs[0].per_round()
    assert (a.test_accuracy - b.test_accuracy).abs().max() <= 1e-5
    assert seq.runs[0].communication.bytes.sum() == stk.runs[0].communication.bytes.sum()         # the same messages, the same bytes


def test_refusals_name_the_reason():
    with pytest.raises(ConfigError, match="node tasks"):
        run("fedavg", "MUTAG", "iid", 3, rounds=1, settings={"engine": "stacked"}, progress=False)
    with pytest.raises(ConfigError, match="no stacked form.*fedavg"):
        run("fedgta", "Cora", "metis", 3, rounds=1, settings={"engine": "stacked"}, progress=False)
    with pytest.raises(ConfigError, match="engine"):
        run("fedavg", "Cora", "metis", 3, rounds=1, settings={"engine": "vmap"}, progress=False)


def test_client_scaling_benchmark_runs_on_a_tiny_size(tmp_path):
    out = tmp_path / "scaling.csv"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "client_scaling.py"), "--dataset", "Cora", "--clients", "3", "6",
                           "--rounds", "1", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = pd.read_csv(out)
    assert rows[["clients", "engine"]].values.tolist() == [[3, "sequential"], [3, "stacked"], [6, "sequential"], [6, "stacked"]]
    assert rows.error.isna().all() and (rows.simulate_s > 0).all() and rows.test_accuracy.between(0, 1).all()


def test_opfgl_engines_benchmark_runs_on_a_tiny_size(tmp_path):
    out = tmp_path / "opfgl.csv"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "opfgl_engines.py"), "--seeds", "0", "--out", str(out), "--set",
                           "surrogate_iters=20", "stage1_iters=20", "finetune_iters=20"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = pd.read_csv(out)
    assert rows.engine.tolist() == ["sequential", "stacked"] and (rows.simulate_s > 0).all()
    assert rows.accuracy.iloc[0] == rows.accuracy.iloc[1]          # O-pFGL has no dropout: the engines agree


@pytest.mark.parametrize("privacy", [{"secure_aggregation": True}, {"dp_noise": 0.5, "dp_clip": 1.0, "dp_seeded_noise": True}])
def test_the_uplink_works_the_same_on_the_stacked_engine(privacy):
    "Each client still seals its own reply: secure aggregation and (seeded) DP noise give the sequential engine's results."
    kw = dict(rounds=2, local_epochs=1, seeds=(0,), progress=False)
    a = run("fedavg", "Cora", "metis", 4, settings={"dropout": 0.0, **privacy}, **kw).runs[0]
    b = run("fedavg", "Cora", "metis", 4, settings={"dropout": 0.0, "engine": "stacked", **privacy}, **kw).runs[0]
    assert (a.per_round().test_accuracy - b.per_round().test_accuracy).abs().max() <= 1e-5
    assert a.communication.bytes.sum() == b.communication.bytes.sum()

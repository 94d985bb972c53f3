"""fglit.synthetic at sizes a test affords, and the scale benchmark on a tiny size (CI runs only this size)."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import given, settings, strategies as st

from fglit.data import edge_homophily
from fglit.fl.config import ConfigError
from fglit.synthetic import synthetic_graph

REPO = Path(__file__).resolve().parents[1]


@settings(max_examples=15, deadline=None)
@given(st.integers(50, 400), st.integers(2, 6), st.floats(0.0, 1.0), st.integers(0, 1000))
def test_shape_labels_and_symmetry(n, classes, h, seed):
    g = synthetic_graph(n, 4 * n, classes, 3, h, seed=seed)
    assert g.num_nodes == n and g.x.shape == (n, 3) and g.x.dtype == torch.float32
    assert set(g.y.tolist()) == set(range(classes))
    ei = g.edge_index
    assert bool((ei[0] != ei[1]).all()) and ei.size(1) % 2 == 0
    pairs = ei[0] * n + ei[1]
    assert torch.equal(torch.sort(pairs).values, torch.sort(ei[1] * n + ei[0]).values)        # both directions
    assert len(torch.unique(pairs)) == ei.size(1)                                              # no repeated edge


@pytest.mark.parametrize("h", [0.0, 0.3, 1.0])
def test_edge_homophily_is_the_target(h):
    g = synthetic_graph(5000, 40_000, 4, 2, h, seed=2)
    assert abs(edge_homophily(g.edge_index, g.y) - h) < 0.01


def test_bad_arguments_are_config_errors():
    with pytest.raises(ConfigError, match="homophily"):
        synthetic_graph(10, 20, 2, 2, -0.1)
    with pytest.raises(ConfigError, match="exceeds num_nodes"):
        synthetic_graph(3, 20, 5, 2, 0.5)


def test_scale_benchmark_runs_on_a_tiny_size(tmp_path):
    out = tmp_path / "scale.csv"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "synthetic_scale.py"), "--sizes", "2000:10000", "--clients", "2",
                           "--partitions", "metis", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = pd.read_csv(out)
    assert rows.stage.tolist() == ["generate", "partition", "fedavg"] and rows.error.isna().all()
    assert (rows.peak_rss_mb > 0).all() and rows.fedavg_s.notna().iloc[-1] and 0 <= rows.accuracy.iloc[-1] <= 1


def test_scale_benchmark_runs_each_engine_on_one_partition(tmp_path):
    out = tmp_path / "scale.csv"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "synthetic_scale.py"), "--sizes", "2000:10000", "--clients", "3",
                           "--partitions", "metis", "--stages", "fedavg", "--engines", "sequential", "stacked", "--rounds", "2",
                           "--stack-rows", "0", "700", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = pd.read_csv(out)
    assert rows.stage.tolist() == ["fedavg"] * 3 and rows.engine.tolist() == ["sequential", "stacked", "stacked"]
    assert rows.stack_rows.isna().iloc[0] and rows.stack_rows.iloc[1:].tolist() == [0, 700]   # a stacked row per stack_rows
    assert rows.error.isna().all() and (rows.fedavg_s > 0).all() and rows.device.str.startswith(("cpu", "cuda")).all()
    assert rows.partition_s.nunique() == 1                      # one partition for both engines
    assert rows.inside_edges.nunique() == 1 and 0 < rows.inside_edges.iloc[0] < 1     # a 3-way METIS cut keeps some edges, cuts others
    assert (rows.accuracy - rows.accuracy.iloc[0]).abs().max() < 0.05   # the engines train the same model


def test_scale_benchmark_runs_opfgl_on_a_kept_partition(tmp_path):
    "The opfgl stage: with a graph cache, a partition stage of its own keeps the partition as a file and O-pFGL loads it; one row per engine, with the surrogate graph and both stages timed, and the settings used."
    out, cache = tmp_path / "scale.csv", tmp_path / "cache"
    args = [sys.executable, str(REPO / "benchmarks" / "synthetic_scale.py"), "--sizes", "2000:10000", "--clients", "3",
            "--partitions", "metis", "--stages", "opfgl", "--engines", "sequential", "stacked", "--graph-cache", str(cache),
            "--opfgl-set", "surrogate_iters=10", "stage1_iters=10", "finetune_iters=10", "stage_workers=2", "--out", str(out)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600, env={**os.environ, "FGLIT_CACHE": str(tmp_path / "fc")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = pd.read_csv(out)
    assert rows.stage.tolist() == ["generate", "partition", "opfgl", "opfgl"] and rows.error.isna().all()
    assert len(list(cache.glob("*-metis-k3-s0.npz"))) == 1                  # the partition stage kept its partition
    op = rows[rows.stage == "opfgl"]
    assert op.engine.tolist() == ["sequential", "stacked"] and op.stage_workers.tolist() == [1, 2]
    assert op.partition_load_s.notna().all() and op.partition_s.isna().all()   # loaded, not partitioned again
    assert (op[["opfgl_s", "surrogate_s", "stage1_s", "stage2_s", "peak_rss_mb"]] > 0).all().all()
    assert (op[["surrogate_s", "stage1_s", "stage2_s"]].sum(axis=1) < op.opfgl_s).all()
    assert op.worker_peak_rss_mb.iloc[0] == 0 and op.worker_peak_rss_mb.iloc[1] > 0     # the stacked engine's stages forked a worker
    # each row's settings are the ones its engine ran with: the sequential engine runs without processes or stacks
    assert op.settings.tolist() == ["surrogate_iters=10 stage1_iters=10 finetune_iters=10",
                                    "surrogate_iters=10 stage1_iters=10 finetune_iters=10 stage_workers=2"]
    assert op.stack_rows.isna().tolist() == [True, False]
    assert op.accuracy.between(0, 1).all() and op.accuracy.nunique() == 1      # O-pFGL has no dropout: the engines agree
    rerun = subprocess.run(args, capture_output=True, text=True, timeout=600, env={**os.environ, "FGLIT_CACHE": str(tmp_path / "fc")})
    assert rerun.returncode == 0 and pd.read_csv(out).stage.tolist()[4:] == ["opfgl", "opfgl"]   # graph and partition both kept
    # the edges stage: the kept partition's share of edges inside a client, the same the other stages recorded, as a direct count gives it
    edges = subprocess.run(args[:args.index("--stages") + 1] + ["edges", "--graph-cache", str(cache), "--out", str(out)],
                           capture_output=True, text=True, timeout=600, env={**os.environ, "FGLIT_CACHE": str(tmp_path / "fc")})
    assert edges.returncode == 0, edges.stderr[-2000:]
    rows = pd.read_csv(out)
    last = rows.iloc[-1]
    assert last.stage == "edges" and pd.notna(last.partition_load_s) and rows.inside_edges.iloc[1:].nunique() == 1
    g = torch.load(next(cache.glob("*.pt")), weights_only=True)
    node_client = torch.from_numpy(np.load(next(cache.glob("*-metis-k3-s0.npz")))["node_client"])
    a, b = node_client[g["edge_index"][0]], node_client[g["edge_index"][1]]
    assert last.inside_edges == pytest.approx(float(((a == b) & (a >= 0)).float().mean()))

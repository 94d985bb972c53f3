"""The `fglit` console script, run as a subprocess the way users run it."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


SCRIPT = Path(sys.executable).parent / "fglit"      # the console script pip installed beside this python


def fglit(*args, env=None):
    assert SCRIPT.is_file(), f"the fglit console script is not installed at {SCRIPT} (pip install -e .)"
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, env=full_env, timeout=600)


def test_datasets_lists_shared_as_present(shared_root):
    out = fglit("datasets", "--json", env={"FGLIT_DATA": str(shared_root)})
    assert out.returncode == 0, out.stderr
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    assert rows["Cora"]["present"] and rows["NCI1"]["present"] and rows["COLLAB"]["variant"] == "gin-text"
    assert not rows["ogbn-arxiv"]["present"] and rows["ogbn-arxiv"]["nodes"] == 169343
    assert {"name", "task", "source", "nodes", "graphs", "features", "classes", "present"} <= set(rows["Cora"])


def test_missing_dataset_exit_2_one_line(tmp_path):
    out = fglit("datasets", "--stats", "PubMed", "--root", str(tmp_path))
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert "'PubMed'" in lines[0] and str(tmp_path) in lines[0] and "raw/ind.pubmed.x" in lines[0]
    assert "Traceback" not in out.stderr


def test_unknown_dataset_exit_2_lists_known():
    out = fglit("datasets", "--stats", "NotADataset")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "known datasets:" in out.stderr and "ogbn-arxiv" in out.stderr


def test_stats_measures_a_dataset(shared_root):
    out = fglit("datasets", "--stats", "MUTAG", "--json", env={"FGLIT_DATA": str(shared_root)})
    assert out.returncode == 0, out.stderr
    (row,) = json.loads(out.stdout)
    assert row["graphs"] == 188 and row["classes"] == 2

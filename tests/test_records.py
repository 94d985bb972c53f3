"""Records of a run: `--out` writes config, summary and tables; `--config` (JSON or YAML) takes the same keys as `--set`
and reads a written config back to the same run; loggers and the callback see each round's metrics; away from a
terminal a run prints periodic log lines."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from fglit.cli import main

SMALL = ["--dataset", "Cora", "--clients", "3", "--rounds", "2", "--quiet"]


def test_out_writes_a_record_that_config_reads_back(shared_root, tmp_path, capsys):
    first, second = tmp_path / "first", tmp_path / "second"
    assert main(["run", "fedavg", *SMALL, "--root", str(shared_root), "--set", "lr=0.02", "--out", str(first),
                 "--log-csv", str(tmp_path / "rounds.csv")]) == 0
    assert {p.name for p in first.iterdir()} == {"config.json", "summary.json", "scores.csv", "per_round.csv",
                                                  "per_client.csv", "communication.csv", "seeds", ".lock"}   # seeds/: what a rerun resumes from
    assert [p.name for p in (first / "seeds").iterdir()] == ["seed_0.json"]
    config = json.loads((first / "config.json").read_text())
    assert (config["algorithm"], config["dataset"], config["clients"], config["seeds"], config["lr"]) == ("fedavg", "Cora", 3, [0], 0.02)
    assert main(["run", "fedavg", "--config", str(first / "config.json"), "--root", str(shared_root), "--quiet",
                 "--out", str(second)]) == 0
    a, b = (json.loads((d / "summary.json").read_text()) for d in (first, second))
    assert a["accuracy_mean"] == b["accuracy_mean"] and a["config"] == b["config"] and a["bytes_up"] == b["bytes_up"]
    assert json.loads((second / "config.json").read_text()) == config
    rounds = pd.read_csv(tmp_path / "rounds.csv")
    per_round = pd.read_csv(first / "per_round.csv")
    assert rounds["round"].tolist() == [1, 2] and (rounds.test_accuracy - per_round.test_accuracy).abs().max() < 1e-12


def test_run_out_in_python(shared_root, tmp_path):
    from fglit.federation import run
    r = run("fedavg", "Cora", "louvain", 3, rounds=1, root=shared_root, progress=False, out=tmp_path / "rec")
    assert json.loads((tmp_path / "rec" / "summary.json").read_text())["accuracy_mean"] == r.summary()["accuracy_mean"]


def test_yaml_config_and_flags_override_it(shared_root, tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("dataset: Cora\nclients: 3\nrounds: 1\nlr: 0.05\nseeds: [1]\n")
    assert main(["run", "fedavg", "--config", str(cfg), "--clients", "4", "--root", str(shared_root), "--quiet", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert (s["clients"], s["rounds"], s["seeds"], s["config"]["lr"]) == (4, 1, [1], 0.05)


@pytest.mark.parametrize("text,suffix,message", [
    ("[1, 2]", ".json", "expected a mapping"),
    ("{not json", ".json", "cannot be read"),
    ("a: [1, 2", ".yaml", "cannot be read"),
    ('{"algorithm": "fedprox", "dataset": "Cora"}', ".json", "is a config for fedprox, not fedavg"),
    ('{"rounds": 1}', ".json", "--dataset is required"),
    ('{"dataset": "Cora", "lrr": 0.1}', ".json", "unknown setting 'lrr'"),
])
def test_bad_config_files_are_one_line_errors(text, suffix, message, shared_root, tmp_path, capsys):
    cfg = tmp_path / f"bad{suffix}"
    cfg.write_text(text)
    assert main(["run", "fedavg", "--config", str(cfg), "--root", str(shared_root), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fglit: error:") and message in err[0], err


def test_missing_config_file_and_missing_dataset(capsys):
    assert main(["run", "fedavg", "--config", "/nonexistent/run.json"]) == 2
    assert "no file /nonexistent/run.json" in capsys.readouterr().err
    assert main(["run", "fedavg", "--rounds", "1"]) == 2
    assert "--dataset is required" in capsys.readouterr().err


def test_log_lines_away_from_a_terminal(shared_root):
    "stderr a pipe, progress left unset: a log line per round (FGLIT_LOG_EVERY=0), with the round and accuracies."
    env = {**os.environ, "FGLIT_DATA": str(shared_root), "FGLIT_LOG_EVERY": "0", "OMP_NUM_THREADS": "1"}
    code = "from fglit.federation import run; run('fedavg', 'Cora', 'louvain', 3, rounds=3)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-1500:]
    lines = [l for l in out.stderr.splitlines() if ": round " in l]
    assert [l.split(": round ")[1].split(",")[0] for l in lines] == ["1/3", "2/3", "3/3"], out.stderr[-1500:]
    assert all("val 0." in l and "test 0." in l for l in lines)
    quiet = subprocess.run([sys.executable, "-c", code.replace("rounds=3)", "rounds=3, progress=False)")],
                           capture_output=True, text=True, env=env, timeout=300)
    assert ": round " not in quiet.stderr


def test_tensorboard_logger_writes_scalars(shared_root, tmp_path):
    pytest.importorskip("tensorboard")
    assert main(["run", "fedavg", *SMALL, "--root", str(shared_root), "--log-tensorboard", str(tmp_path / "tb")]) == 0
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))

"""The `fglit` console script, run as a subprocess the way users run it."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
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


@pytest.mark.parametrize("dataset, method, extra, unit", [
    ("Cora", "louvain+", [], "nodes"),
    ("NCI1", "dirichlet", ["--set", "alpha=0.5"], "graphs"),
])
def test_partition_json_for_node_and_graph_datasets(dataset, method, extra, unit, shared_root):
    out = fglit("partition", "--dataset", dataset, "--method", method, "--clients", "5", "--seed", "0", "--json", *extra,
                env={"FGLIT_DATA": str(shared_root)})
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert [r["client"] for r in rows] == list(range(5))
    for key in ("client", "nodes", "edges", "label_counts", "train", "val", "test"):
        assert all(key in r for r in rows), key
    total = sum(r["graphs"] if unit == "graphs" else r["nodes"] for r in rows)
    assert total == (4110 if unit == "graphs" else 2708)          # both methods cover every item
    assert all(r["train"] + r["val"] + r["test"] == (r["graphs"] if unit == "graphs" else r["nodes"]) for r in rows)


def test_partition_bad_parameter_exit_2(shared_root):
    out = fglit("partition", "--dataset", "Cora", "--method", "dirichlet", "--clients", "5", "--set", "alpha=-1",
                env={"FGLIT_DATA": str(shared_root)})
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and "alpha" in out.stderr
    out = fglit("partition", "--dataset", "Cora", "--method", "spectral", "--clients", "5", env={"FGLIT_DATA": str(shared_root)})
    assert out.returncode == 2 and "spectral" in out.stderr


def test_run_gpfl_issue_command_with_partition_alias(shared_root):
    "The command of the GPFL issue (`dirichlet-soft` is an alias of `soft_dirichlet`), shortened to 1 round."
    out = fglit("run", "gpfl", "--dataset", "NCI1", "--partition", "dirichlet-soft", "--clients", "25", "--set", "alpha=0.5",
                "--rounds", "1", "--json", env={"FGLIT_DATA": str(shared_root)})
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["algorithm"] == "gpfl" and res["partition"] == "soft_dirichlet" and res["clients"] == 25
    assert res["partition_params"] == {"alpha": 0.5} and len(res["per_client"]) == 25
    assert 0.0 <= res["accuracy_mean"] <= 1.0 and res["bytes_up"] > 0


def test_run_prints_the_auc_of_its_json_summary(shared_root):
    args = ("run", "fedavg", "--dataset", "MUTAG", "--partition", "iid", "--clients", "2", "--rounds", "2")
    text, as_json = fglit(*args, env={"FGLIT_DATA": str(shared_root)}), fglit(*args, "--json", env={"FGLIT_DATA": str(shared_root)})
    assert text.returncode == 0 and as_json.returncode == 0, text.stderr + as_json.stderr
    line = next(l for l in text.stdout.splitlines() if l.startswith("accuracy "))
    auc = float(line.split("AUC ")[1].split(" ±")[0])
    assert auc == pytest.approx(100 * json.loads(as_json.stdout)["auc_mean"], abs=0.006) and 0 < auc <= 100


def test_run_with_auc_off_prints_no_auc(shared_root):
    out = fglit("run", "fedavg", "--dataset", "MUTAG", "--partition", "iid", "--clients", "2", "--rounds", "2", "--set", "auc=false",
                env={"FGLIT_DATA": str(shared_root)})
    assert out.returncode == 0, out.stderr
    header = next(l for l in out.stdout.splitlines() if l.split()[:2] == ["seed", "round"])
    assert "accuracy" in header.split() and "auc" not in header.split() and "AUC" not in out.stdout


def test_run_refuses_abbreviated_flags():
    "A typed flag beats a --config file's value, so `run` must know every flag typed: an abbreviation (`--round` for `--rounds`) is refused, not silently overridden."
    out = fglit("run", "fedavg", "--dataset", "Cora", "--round", "2")
    assert out.returncode == 2 and "unrecognized arguments: --round 2" in out.stderr


def test_only_run_takes_a_task_for_dataset_files():
    "`--task` says what a .pt file holds; the Flower commands load a dataset by name on each node, so they refuse it rather than ignore it."
    assert "--task" in fglit("run", "--help").stdout
    for sub in ("app", "local"):
        help_text = fglit("flower", sub, "--help")
        assert help_text.returncode == 0 and "--task" not in help_text.stdout and ".pt" not in help_text.stdout, help_text.stderr
        out = fglit("flower", sub, "fedavg", "--dataset", "Cora", "--task", "graph", *(["--out", "unused"] if sub == "app" else []))
        assert out.returncode == 2 and "unrecognized arguments: --task graph" in out.stderr


def test_run_help_lists_registered_algorithms_and_partition_aliases():
    out = fglit("run", "--help")
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    for name in ("gpfl", "gcfl+", "pfedgraph", "fedamp", "opfgl", "fedgls", "soft_dirichlet", "dirichlet-soft = soft_dirichlet"):
        assert name in text, name


def test_reproduce_gpfl_in_chunks(shared_root, tmp_path):
    "A chunk of GPFL's grid (one method, one setting, one fold, quick): resumable CSV and the side-by-side table."
    out = tmp_path / "runs.csv"
    args = ("reproduce", "gpfl", "--datasets", "PROTEINS", "--methods", "Self-train", "--settings", "15:0.5", "--folds", "1",
            "--seeds", "0", "--quick", "--quiet", "--json", "--out", str(out))
    res = fglit(*args, env={"FGLIT_DATA": str(shared_root)})
    assert res.returncode == 0, res.stderr
    rows = json.loads(res.stdout)
    assert len(rows) == 1 and rows[0]["method"] == "Self-train [alpha=0.5]" and rows[0]["clients"] == 15
    assert abs(rows[0]["paper"] - 79.27) < 1e-6                      # the paper's k=15 cell, not k=25's
    import pandas as pd
    runs = pd.read_csv(out)
    assert list(runs.note) == ["alpha=0.5 fold 1"] and runs.quick.all()
    bad = fglit("reproduce", "opfgl", "--methods", "O-pFGL", "--quick", "--out", str(tmp_path / "x.csv"))
    assert bad.returncode == 2 and "--methods does not apply" in bad.stderr
    bad = fglit("reproduce", "gpfl", "--settings", "25-0.5", "--quick", "--out", str(tmp_path / "y.csv"))
    assert bad.returncode == 2 and "CLIENTS:ALPHA" in bad.stderr


def test_flower_app_writes_the_run_and_the_connection(tmp_path):
    "`fglit flower app`: the app's run config is the run asked for, the flwr connection uses TLS with the CA given."
    import tomllib
    from fglit.flower import FlowerRun
    (tmp_path / "ca.crt").write_text("not a real certificate")
    out = fglit("flower", "app", "fedavg", "--dataset", "Cora", "--partition", "metis", "--clients", "4", "--rounds", "3",
                "--seed", "2", "--set", "lr=0.05", "--min-clients", "3", "--timeout", "90", "--out", str(tmp_path / "app"),
                "--superlink", "server.lab:9092", "--root-certificates", str(tmp_path / "ca.crt"),
                "--flwr-home", str(tmp_path / "flwr"))
    assert out.returncode == 0, out.stderr
    project = tomllib.loads((tmp_path / "app" / "pyproject.toml").read_text())
    assert project["tool"]["flwr"]["app"]["components"] == {"serverapp": "fglit.flower:server_app",
                                                             "clientapp": "fglit.flower:client_app"}
    run = FlowerRun.from_config(project["tool"]["flwr"]["app"]["config"])
    assert run == FlowerRun("fedavg", "Cora", "metis", 4, 2, {"lr": 0.05, "rounds": 3}, timeout=90.0, min_clients=3)
    conn = tomllib.loads((tmp_path / "flwr" / "config.toml").read_text())
    assert conn["superlink"]["default"] == "fglit"
    assert conn["superlink"]["fglit"] == {"address": "server.lab:9092", "insecure": False,
                                          "root-certificates": str(tmp_path / "ca.crt")}
    assert 'flower-supernode --superlink server.lab:9092 --root-certificates ca.crt' in out.stdout
    assert "num-partitions=4" in out.stdout and f"flwr run {tmp_path / 'app'} fglit" in out.stdout


def test_flower_refuses_bad_input_before_starting_anything(tmp_path, capsys):
    "Bad settings, a bad minimum, or a SuperLink without TLS or --insecure: exit 2, one line, nothing written or started."
    from fglit.cli import main          # in-process: four more interpreter starts would cost a minute on a busy machine
    for args, message in ((("app", "fedavg", "--dataset", "Cora", "--set", "lr=fast"), "lr"),
                          (("app", "fedavg", "--dataset", "Cora", "--clients", "4", "--min-clients", "5"), "--min-clients"),
                          (("app", "fedavg", "--dataset", "Cora", "--superlink", "h:1"), "--insecure"),
                          (("local", "fedavgg", "--dataset", "Cora", "--clients", "2"), "fedavgg")):
        extra = ("--out", str(tmp_path / "app")) if args[0] == "app" else ("--workdir", str(tmp_path / "work"))
        assert main(["flower", *args, *extra]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "app").exists() and not (tmp_path / "work").exists()


def test_reproduce_fedpg_quick_row_beside_the_paper(shared_root, tmp_path):
    "`fglit reproduce fedpg`: one quick row of Table X (FedPG on Cora) lands beside the paper's 86.5."
    out = tmp_path / "runs.csv"
    res = fglit("reproduce", "fedpg", "--tables", "10", "--datasets", "Cora", "--methods", "FedPG", "--seeds", "0", "--quick",
                "--quiet", "--json", "--out", str(out), env={"FGLIT_DATA": str(shared_root)})
    assert res.returncode == 0, res.stderr
    rows = json.loads(res.stdout)
    assert [(r["table"], r["dataset"], r["method"]) for r in rows] == [("10", "Cora", "FedPG")]
    assert rows[0]["paper"] == 86.5 and 0 < rows[0]["ours"] <= 100
    bad = fglit("reproduce", "fedpg", "--tables", "11", "--quick", "--out", str(tmp_path / "x.csv"))
    assert bad.returncode == 2 and "unknown table" in bad.stderr


def test_reproduce_fedpg_figures_quick(shared_root, tmp_path):
    "`fglit reproduce fedpg-figures`: Fig. 1's four convergence runs (quick) give one row each with a curve; bad input is refused."
    out = tmp_path / "figs.csv"
    res = fglit("reproduce", "fedpg-figures", "--tables", "fig1", "--seeds", "0", "--quick", "--quiet", "--json", "--out", str(out),
                env={"FGLIT_DATA": str(shared_root)})
    assert res.returncode == 0, res.stderr
    rows = json.loads(res.stdout)
    assert sorted(r["method"] for r in rows) == ["FedAvg", "FedPG", "FedProto", "FedTGP"]
    assert all(r["table"] == "fig1" and 0 < r["accuracy"] <= 100 and r["seeds"] == 1 for r in rows)
    saved = pd.read_csv(out)
    assert len(saved) == 4 and all(len(json.loads(c)) == 2 for c in saved.curve)
    bad = fglit("reproduce", "fedpg-figures", "--tables", "fig2", "--quick", "--out", str(tmp_path / "x.csv"))
    assert bad.returncode == 2 and "unknown figure" in bad.stderr
    assert fglit("reproduce", "fedpg-figures", "--methods", "FedPG", "--quick", "--out", str(tmp_path / "y.csv")).returncode == 2


def test_run_pool_trains_one_model_on_every_clients_nodes(shared_root):
    base = ["run", "standalone", "--dataset", "Cora", "--partition", "metis", "--clients", "3", "--rounds", "1",
            "--local-epochs", "1", "--quiet"]
    out = fglit(*base, "--pool", "centralised", "--json")
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout)
    assert s["pool"] == "centralised" and len(s["per_client"]) == 1
    fed = json.loads(fglit(*base, "--json").stdout)
    assert "pool" not in fed and len(fed["per_client"]) == 3
    assert s["per_client"][0]["n"] == sum(c["n"] for c in fed["per_client"])       # the same test nodes, in one client
    text = fglit(*base, "--pool", "pooled")
    assert text.returncode == 0 and "3 clients pooled into one client (pooled)" in text.stdout
    bad = fglit(*base, "--pool", "centralised", "--backend", "flower-sim")
    assert bad.returncode == 2 and "--pool" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def _one_line_error(capsys, argv) -> str:
    "Run `fglit ARGV`: it must exit 2 with one `fglit: error:` line on stderr and no traceback; that line."
    from fglit.cli import main
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fglit: error:") and "\n" not in err and "Traceback" not in err
    return err


def test_repeated_or_missing_seeds_are_refused(shared_root, capsys):
    from fglit.federation import ConfigError, run
    base = ["run", "fedavg", "--dataset", "Cora", "--clients", "3", "--rounds", "1", "--root", str(shared_root), "--quiet"]
    assert "repeat [0]" in _one_line_error(capsys, base + ["--seeds", "0", "0"])
    with pytest.raises(ConfigError, match="no seeds"):
        run("fedavg", "cora", "louvain", 3, rounds=1, seeds=[], root=shared_root, progress=False)


def test_secure_aggregation_abort_is_one_line(shared_root, capsys):
    err = _one_line_error(capsys, ["run", "fedavg", "--dataset", "Cora", "--clients", "4", "--rounds", "1", "--quiet",
                                   "--root", str(shared_root), "--secure-aggregation", "--secagg-dropout", "0.5"])
    assert "ThresholdError" in err and "threshold" in err


def test_default_partition_follows_the_task(shared_root, capsys):
    "`fglit run gpfl --dataset MUTAG` with no --partition: a graph task's default partitioner, not Louvain."
    from fglit.cli import main
    assert main(["run", "fedavg", "--dataset", "MUTAG", "--clients", "3", "--rounds", "1", "--local-epochs", "1", "--quiet",
                 "--json", "--root", str(shared_root)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["partition"] == "dirichlet"

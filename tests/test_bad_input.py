"""Issue #58, "zero is a value": input fglit cannot run correctly is refused in one line, before anything runs."""
import json
import shutil
import time

import numpy as np
import pytest
import torch
from torch_geometric.data import Data

from fglit.cli import load_run_config, main
from fglit.data import DatasetError, NonFiniteDataError
from fglit.fl.config import ConfigError, make_config
from fglit.own_data import as_dataset
from fglit.partition import PartitionFileError, load_partition_file, partition, save_partition_file

RING = torch.tensor([[0, 1, 2, 3, 4, 5], [1, 0, 3, 2, 5, 4]])


def _graph(x=None, **kw):
    return Data(**{"x": torch.randn(6, 3) if x is None else x, "edge_index": RING, "y": torch.tensor([0, 1, 0, 1, 0, 1]), **kw})


def one_error_line(capsys, argv) -> str:
    "Run `fglit ARGV`: exit status 2 and exactly one stderr line, `fglit: error: ...` (returned without the prefix)."
    code = main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("fglit: error: "), (code, lines)
    return lines[0].removeprefix("fglit: error: ")


def test_nan_and_inf_are_refused_naming_the_dataset_and_the_count(tmp_path):
    x = torch.randn(6, 3)
    x[0, 0], x[2, 1], x[5, 2] = float("nan"), float("inf"), float("-inf")
    with pytest.raises(NonFiniteDataError, match=r"dataset 'mine': 3 NaN or inf values \(3 in `x`\)"):
        as_dataset(_graph(x), name="mine")
    graphs = [_graph(edge_weight=torch.tensor([1.0, float("nan"), 1, 1, 1, 1]), y=torch.tensor([i % 2])) for i in range(3)]
    with pytest.raises(NonFiniteDataError, match=r"3 NaN or inf values \(3 in `edge_weight`\)"):
        as_dataset(graphs)
    torch.save(_graph(x), tmp_path / "bad.pt")
    with pytest.raises(NonFiniteDataError, match=r"dataset 'bad': 3 NaN"):
        as_dataset(str(tmp_path / "bad.pt"))
    assert as_dataset(_graph()).num_nodes == 6              # finite data passes


def test_nan_in_a_registered_dataset_is_refused(monkeypatch, tmp_path, shared_root):
    import fglit.data as fd
    real = fd.LOADERS["Planetoid"]
    def poisoned(root, spec, layout):
        pyg = real(root, spec, layout)
        pyg._data.x[:4, 0] = float("nan")
        return pyg
    monkeypatch.setitem(fd.LOADERS, "Planetoid", poisoned)
    with pytest.raises(NonFiniteDataError, match=r"dataset 'Cora': 4 NaN or inf values \(4 in `x`\)"):
        fd.load_dataset("Cora", shared_root)


def test_a_graph_with_no_nodes_is_refused_by_run():
    from fglit.federation import run
    empty = Data(x=torch.empty(0, 3), edge_index=torch.empty(2, 0, dtype=torch.long), y=torch.empty(0, dtype=torch.long))
    with pytest.raises(DatasetError, match="0 nodes"):
        run("fedavg", empty, rounds=1, progress=False)


def test_a_damaged_processed_file_names_itself_and_the_folder_to_delete(tmp_path, shared_root):
    from fglit.data import load_dataset
    shutil.copytree(shared_root / "Cora" / "raw", tmp_path / "Cora" / "raw")
    processed = tmp_path / "Cora" / "processed"
    processed.mkdir()
    (processed / "data.pt").write_bytes(b"PK\x03\x04 half a file")
    with pytest.raises(DatasetError) as err:
        load_dataset("Cora", tmp_path)
    message = str(err.value)
    assert len(message.splitlines()) == 1 and f"{processed / 'data.pt'} is damaged" in message and f"delete the folder {processed}" in message
    shutil.rmtree(processed)                                  # what the message says to do: the dataset is rebuilt
    assert load_dataset("Cora", tmp_path).num_nodes == 2708


@pytest.fixture(scope="module")
def cora_files(tmp_path_factory, shared_root):
    folder = tmp_path_factory.mktemp("partition")
    ds = as_dataset("Cora", root=shared_root)
    part = partition(ds, "louvain", 3, seed=0)
    return ds, save_partition_file(part, folder / "good.npz"), json.loads(save_partition_file(part, folder / "good.json").read_text())


@pytest.mark.parametrize("change, why", [
    ({"num_clients": 1e12}, "`num_clients` is 1000000000000, more than the 2708 nodes"),
    ({"num_clients": "abc"}, "`num_clients` must be a whole number, got 'abc'"),
    ({"num_clients": 2.5}, "`num_clients` must be a whole number, got 2.5"),
    ({"graphless": ["abc"]}, "`graphless` must be a whole number, got 'abc'"),
    ({"fold": ["abc"] * 2708}, "`fold` must hold one whole number per node"),
])
def test_a_partition_file_field_error_names_the_file_and_the_field(cora_files, tmp_path, change, why):
    ds, _, good = cora_files
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({**good, **change}))
    with pytest.raises(PartitionFileError, match=f"^{path}: {why}".replace("(", r"\(").replace(")", r"\)")):
        load_partition_file(ds, path)


def test_a_partition_file_that_is_not_one_is_refused_in_one_line(cora_files, tmp_path):
    ds, npz, _ = cora_files
    np.savez(tmp_path / "huge.npz", **{**dict(np.load(npz)), "num_clients": np.array(1e12)})
    np.savez(tmp_path / "empty.npz")
    (tmp_path / "zero.npz").write_bytes(b"")
    (tmp_path / "garbage.npz").write_bytes(b"no archive here\n" * 4)
    (tmp_path / "folder.npz").mkdir()
    cases = {"huge.npz": "`num_clients` is 1000000000000", "empty.npz": "an empty partition file",
             "zero.npz": "not a partition file fglit can read", "garbage.npz": "not a partition file fglit can read",
             "folder.npz": "is a folder, not a partition file"}
    for name, why in cases.items():
        with pytest.raises(PartitionFileError) as err:
            load_partition_file(ds, tmp_path / name)
        assert str(err.value).startswith(f"{tmp_path / name}: ") and why in str(err.value) and "\n" not in str(err.value)
        assert "allow_pickle" not in str(err.value)
    assert load_partition_file(ds, npz).num_clients == 3


R = ["run", "fedavg", "--dataset", "Cora", "--clients", "3", "--rounds", "1", "--quiet"]


@pytest.mark.parametrize("argv, why", [
    (R + ["--dp-noise", "1", "--dp-clip", "0"], "dp_clip must be > 0, got 0.0"),
    (R + ["--dp-noise", "1", "--dp-delta", "0"], "dp_delta must be > 0 and < 1, got 0.0"),
    (R + ["--secure-aggregation", "--secagg-threshold", "0"], "secagg_threshold must be >= 0.666667 and < 1, got 0.0"),
    (R + ["--dp-noise", "1", "--dp-fraction", "0"], "dp_fraction must be > 0 and <= 1, got 0.0"),
    (R + ["--dp-clip", "1"], "dp_clip does nothing without dp_noise > 0"),
    (R + ["--secagg-dropout", "0"], "secagg_dropout and secagg_dropout_before need secure_aggregation=True"),
    (R + ["--set", "lr=1e308"], "lr must be > 0 and <= 10, got 1e+308"),
    (R + ["--set", "hidden=100000000000"], "hidden must be >= 1 and <= 65536"),
    (R[:-3] + ["--rounds", "99999999999999999999"], "rounds must be >= 1 and <= 1000000"),
    (R + ["--seeds", "99999999999999999999999"], "seed 99999999999999999999999 is not an integer in 0..2**32-1"),
    (R + ["--seeds", "-1"], "seed -1 is not an integer in 0..2**32-1"),
    (["demo", "--epochs", "0"], "--epochs must be between 1 and 100,000, got 0"),
])
def test_zero_and_huge_values_are_refused_before_the_run(capsys, argv, why):
    start = time.perf_counter()
    assert one_error_line(capsys, argv).startswith(why)
    assert time.perf_counter() - start < 30          # validation, not training


def test_flower_sim_refuses_zero_clients_before_starting(capsys):
    start = time.perf_counter()
    assert "--clients must be between 1" in one_error_line(capsys, R[:4] + ["--clients", "0", "--backend", "flower-sim", "--quiet"])
    assert "has 2708 nodes" in one_error_line(capsys, R[:4] + ["--clients", "3000", "--backend", "flower-sim", "--quiet"])
    assert time.perf_counter() - start < 30


def test_path_errors_are_reported_before_the_run(capsys, tmp_path):
    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "folder").mkdir()
    cases = {("--out", "file.txt"): "is an existing file", ("--out", "file.txt/record"): "is a file, so no folder can be made",
             ("--log-csv", "folder"): "is a folder; --log-csv names a CSV file", ("--log-tensorboard", "file.txt"): "is an existing file",
             ("--partition-file", "folder"): "is a folder, not a partition file", ("--partition-file", "missing.npz"): "no such file"}
    for (flag, name), why in cases.items():
        start = time.perf_counter()
        message = one_error_line(capsys, R + [flag, str(tmp_path / name)])
        assert message.startswith(f"{flag} {tmp_path / name}: ") and why in message, message
        assert time.perf_counter() - start < 30
    assert not any((tmp_path / "folder").iterdir())             # nothing written


def test_an_existing_folder_is_a_valid_out(tmp_path):
    import argparse
    from fglit.cli import _check_paths
    (tmp_path / "record").mkdir()
    _check_paths(argparse.Namespace(out=str(tmp_path / "record"), log_csv=str(tmp_path / "new" / "log.csv"), partition_file=None))


@pytest.mark.parametrize("content, why", [
    ({"dataset": "Cora", "seeds": "0"}, "`seeds` must be a list of integers such as [0, 1, 2], got '0'"),
    ({"dataset": "Cora", "clients": "abc"}, "`clients` must be an integer, got 'abc'"),
    ({"dataset": "Cora", "clients": 3, "rounds": "abc"}, "setting 'rounds' must be int, got 'abc'"),
    ({"dataset": 7}, "`dataset` must be a name (a string), got 7"),
])
def test_a_config_file_error_names_the_file_and_the_field(capsys, tmp_path, content, why):
    path = tmp_path / "run.json"
    path.write_text(json.dumps(content))
    assert one_error_line(capsys, ["run", "fedavg", "--config", str(path), "--quiet"]) == f"--config {path}: {why}"


def test_a_privacy_setting_named_at_its_default_does_nothing_alone():
    from fglit.algorithms.fedavg import FedAvgConfig
    for settings, why in (({"dp_clip": 1.0}, "dp_clip does nothing without dp_noise"),
                          ({"privacy.dp_delta": 1e-5}, "dp_delta does nothing without dp_noise"),
                          ({"secagg_threshold": 2 / 3}, "secagg_threshold does nothing without secure_aggregation=True")):
        with pytest.raises(ConfigError, match=why):
            make_config(FedAvgConfig, settings)
    assert make_config(FedAvgConfig, {"dp_clip": 1.0, "dp_noise": 0.5}).privacy.dp_clip == 1.0


def test_a_record_with_every_privacy_setting_reads_back(tmp_path):
    "A record's config.json lists every privacy setting, chosen or not: those at their default are not counted as given."
    import dataclasses
    from fglit.algorithms.fedavg import FedAvgConfig
    from fglit.fl.config import PrivacyConfig
    record = {"algorithm": "fedavg", "dataset": "Cora", "lr": 0.02, **dataclasses.asdict(PrivacyConfig())}
    (tmp_path / "config.json").write_text(json.dumps(record))
    read = load_run_config(tmp_path / "config.json")
    assert "dp_clip" not in read and read["lr"] == 0.02
    make_config(FedAvgConfig, {k: v for k, v in read.items() if k not in ("algorithm", "dataset")})
    (tmp_path / "mine.json").write_text(json.dumps({"dataset": "Cora", "dp_clip": 1.0}))     # not a record: dp_clip was chosen
    assert load_run_config(tmp_path / "mine.json")["dp_clip"] == 1.0

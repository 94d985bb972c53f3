"""Bring your own graph (issue 27): a PyG Data, a list of Data, a PyG dataset object or a torch.save file through `run`, `partition` and the CLI."""
import pytest
import torch
from torch_geometric.data import Data
from torch_geometric.datasets import FakeDataset
from torch_geometric.utils import stochastic_blockmodel_graph

from fglit.cli import main
from fglit.data import DatasetNotFoundError, UnknownDatasetError, dataset_spec, edge_homophily, load_dataset
from fglit.federation import run
from fglit.own_data import HOMOPHILY_THRESHOLD, DataFormatError, as_dataset, defaults_profile
from fglit.partition import partition


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FGLIT_CACHE", str(tmp_path / "cache"))


def sbm(p_in: float, p_out: float, seed: int = 0, n: int = 40) -> Data:
    "Three blocks of `n` nodes, class = block, random features."
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    ei = stochastic_blockmodel_graph([n] * 3, [[p_in if i == j else p_out for j in range(3)] for i in range(3)])
    return Data(x=torch.randn(3 * n, 6, generator=g), edge_index=ei, y=torch.arange(3).repeat_interleave(n))


def graph_list(num: int = 36, features: int | None = 3) -> list[Data]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(num):
        n = 4 + i % 5
        ei = torch.stack([torch.arange(n), (torch.arange(n) + 1) % n])
        x = None if features is None else torch.randn(n, features, generator=g) + (i % 2)
        out.append(Data(x=x, edge_index=torch.cat([ei, ei.flip(0)], 1), y=torch.tensor([i % 2]), num_nodes=n))
    return out


def test_data_runs_as_a_node_task():
    data = sbm(0.3, 0.02)
    result = run("fedavg", data, clients=3, rounds=2, progress=False)
    s = result.summary()
    assert (result.dataset, s["rounds"], len(s["per_client"])) == ("custom", 2, 3)
    assert 0.0 <= s["accuracy_mean"] <= 1.0
    assert data.edge_index.size(1) == sbm(0.3, 0.02).edge_index.size(1)       # the object passed in is not changed


def test_defaults_follow_measured_homophily():
    for data in (sbm(0.3, 0.01), sbm(0.01, 0.2)):
        ds = as_dataset(data)
        h = edge_homophily(ds.data.edge_index, ds.data.y)
        short = {"surrogate_iters": 50, "stage1_iters": 50, "finetune_iters": 50, "eval_interval": 25}   # the defaults under test are untouched
        result = run("opfgl", data, clients=3, progress=False, settings=short)
        assert result.config["hre"] == (h >= HOMOPHILY_THRESHOLD)             # O-pFGL's refinement off on heterophilous graphs
        assert f"edge homophily {h:.3f}" in result.summary()["defaults_from"]
    assert defaults_profile(load_dataset("Cora")) == ("Cora", None)
    assert "defaults_from" not in run("fedavg", "Cora", clients=3, rounds=1, progress=False).summary()


def test_list_of_graphs_is_a_graph_task_and_partition_agrees_with_run():
    graphs = graph_list()
    ds = as_dataset(graphs)
    assert (ds.task, ds.num_graphs, ds.num_features, ds.num_classes) == ("graph", 36, 3, 2)
    p = partition(graphs, "dirichlet", 3, seed=0)
    result = run("fedavg", graphs, p, rounds=2, progress=False)              # a partition made from the same list
    assert result.clients == 3 and result.partition == "dirichlet"
    assert as_dataset(graph_list(features=None)).num_features == 3          # featureless: one-hot degree of rings (max degree 2)


def test_pyg_dataset_objects():
    fake = FakeDataset(num_graphs=40, avg_num_nodes=8, num_channels=3, num_classes=2, seed=0)
    result = run("fedavg", fake, clients=3, rounds=1, progress=False)
    assert result.dataset == "FakeDataset" and "graph task" in result.summary()["defaults_from"]
    one = FakeDataset(num_graphs=1, avg_num_nodes=60, num_channels=3, num_classes=3, seed=0)
    assert as_dataset(one).task == "node" and partition(one, "louvain", 3).task == "node"
    mutag = load_dataset("MUTAG").pyg                                      # a TUDataset object from the data root
    ds = as_dataset(mutag)
    assert (ds.name, ds.task, ds.num_graphs) == ("MUTAG", "graph", 188)
    assert defaults_profile(ds) == ("MUTAG", None)                        # its own name: the registry's defaults
    assert run("fedavg", mutag, clients=3, rounds=1, progress=False).clients == 3


def test_task_stated():
    data = sbm(0.3, 0.02)
    assert as_dataset([data], task="node").task == "node"
    with pytest.raises(DataFormatError, match="a graph task needs a list"):
        as_dataset(data, task="graph")
    with pytest.raises(DataFormatError, match="task='node' needs one graph"):
        run("fedavg", graph_list(), task="node", clients=3, rounds=1, progress=False)
    with pytest.raises(DataFormatError, match="task must be 'node' or 'graph'"):
        partition(data, "louvain", 3, task="edge")


def _node(**kw):
    base = dict(x=torch.ones(4, 2), edge_index=torch.tensor([[0, 1, 2], [1, 2, 3]]), y=torch.tensor([0, 1, 0, 1]))
    base.update(kw)
    return Data(**{k: v for k, v in base.items() if v is not None}, num_nodes=4)


@pytest.mark.parametrize("data, message", [
    (_node(y=None), "no labels"),
    (_node(x=None), "no node features `x`"),
    (_node(y=torch.tensor([0, 1, -1, 1])), "labels out of range: found -1"),
    (_node(y=torch.tensor([0.0, 1.0, 0.0, 1.5])), "must be integer classes"),
    (_node(y=torch.tensor([0, 1])), "one class per node (4)"),
    (_node(edge_index=torch.tensor([[0], [9]])), "outside 0..3"),
    ([Data(x=torch.ones(2, 3), edge_index=torch.tensor([[0], [1]]), y=torch.tensor([0])),
      Data(x=torch.ones(2, 5), edge_index=torch.tensor([[0], [1]]), y=torch.tensor([1]))], "graph 0 has 3 features, graph 1 has 5 features"),
    ([Data(x=torch.ones(2, 3), edge_index=torch.tensor([[0], [1]]), y=torch.tensor([0])),
      Data(edge_index=torch.tensor([[0], [1]]), y=torch.tensor([1]), num_nodes=2)], "graph 1 has no x"),
    ([Data(x=torch.ones(2, 3), edge_index=torch.tensor([[0], [1]]))] * 2, "graph 0: no labels"),
    ("not a thing at all", "unknown dataset"),
    (3.5, "cannot use a float as a dataset"),
])
def test_errors_are_one_line(data, message):
    with pytest.raises((DataFormatError, UnknownDatasetError)) as err:
        run("fedavg", data, clients=2, rounds=1, progress=False)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_pyg_names_resolve_under_the_root(tmp_path):
    assert dataset_spec("texas").source == "WebKB" and dataset_spec("COX2").task == "graph"
    for name, looked_for in (("texas", "texas/raw/out1_node_feature_label.txt"), ("COX2", "COX2/raw/COX2_A.txt")):
        with pytest.raises(DatasetNotFoundError, match=looked_for):
            load_dataset(name, tmp_path, download=False)
    # any TU name resolves once its files are under the root (here: MUTAG's files under another name, cleaned layout)
    src = load_dataset("MUTAG").location / "raw"
    dst = tmp_path / "MYTU" / "raw_cleaned"
    dst.mkdir(parents=True)
    for part in ("A", "graph_indicator", "graph_labels", "node_labels"):
        (dst / f"MYTU_{part}.txt").write_text((src / f"MUTAG_{part}.txt").read_text())
    ds = load_dataset("MYTU", tmp_path)
    assert (ds.task, ds.num_graphs, ds.variant) == ("graph", 188, "cleaned")


def test_cli_runs_a_pt_file(tmp_path, capsys):
    path = tmp_path / "blocks.pt"
    torch.save(sbm(0.01, 0.2), path)
    assert main(["run", "fedavg", "--dataset", str(path), "--rounds", "1", "--clients", "3", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("fedavg on blocks: louvain partition, 3 clients, 1 rounds")
    assert "per-dataset defaults: blocks is not in the registry; edge homophily" in out
    graphs = tmp_path / "graphs.pt"
    torch.save(graph_list(), graphs)
    assert main(["run", "fedavg", "--dataset", str(graphs), "--rounds", "1", "--clients", "3", "--quiet"]) == 0
    assert capsys.readouterr().out.startswith("fedavg on graphs: dirichlet partition, 3 clients")
    assert main(["partition", "--dataset", str(path), "--method", "louvain", "--clients", "3"]) == 0


@pytest.mark.parametrize("args, message", [
    (["--dataset", "missing.pt"], "no file missing.pt"),
    (["--dataset", "texas"], "dataset 'texas' (WebKB) is not under"),
    (["--dataset", "COX2"], "dataset 'COX2' (TU) is not under"),
    (["--dataset", "{bad}", "--task", "graph"], "a graph task needs a list"),
    (["--dataset", "{bad}", "--backend", "flower-sim"], "the Flower backends load a registered dataset by name"),
])
def test_cli_errors(tmp_path, capsys, args, message):
    path = tmp_path / "one.pt"
    torch.save(_node(), path)
    args = [a.replace("{bad}", str(path)) for a in args]
    assert main(["run", "fedavg", *args, "--rounds", "1", "--clients", "3", "--root", str(tmp_path), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fglit: error: ") and message in err and err.count("\n") == 1


def test_any_tu_collection_by_name_goes_to_pygs_download(tmp_path):
    "`tu:NAME` is a TU dataset for any NAME (PyG downloads it); offline here, that ends in the not-found error, not 'unknown'."
    assert dataset_spec("tu:Fingerprint", tmp_path).name == "Fingerprint"
    with pytest.raises(UnknownDatasetError, match="tu:NAME"):
        dataset_spec("Fingerprint", tmp_path)                 # a bare unlisted name with no files: unknown, not downloaded
    with pytest.raises(DatasetNotFoundError, match="Fingerprint"):
        load_dataset("tu:Fingerprint", tmp_path)

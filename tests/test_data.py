"""The data layer: real datasets load with their published sizes; missing, unknown, read-only
and downloaded datasets behave as documented. No test touches the network: downloads are
served from a loopback HTTP server."""
import contextlib
import functools
import gzip
import http.server
import io
import os
import socket
import stat
import threading
import zipfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings, strategies as st
import torch

from fglit import data as fd

# Published sizes of the datasets the offline folder holds (nodes for node tasks, graphs for graph tasks).
PUBLISHED = {"Cora": 2708, "CiteSeer": 3327, "Photo": 7650, "chameleon": 2277, "chameleon_filtered": 890,
             "squirrel": 5201, "squirrel_filtered": 2223, "minesweeper": 10000, "tolokers": 11758,
             "NCI1": 4110, "PROTEINS": 1113, "IMDB-BINARY": 1000, "IMDB-MULTI": 1500, "MUTAG": 188,
             "DD": 1178, "COLLAB": 5000, "ENZYMES": 595}  # ENZYMES: only the cleaned TU version is offline


def _size(ds):
    return ds.num_nodes if ds.task == "node" else ds.num_graphs


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_shared_dataset_loads_with_published_size(name, shared_root):
    if fd.dataset_spec(name).layout_present(shared_root) is None:
        pytest.skip(f"{name} is not under {shared_root}")
    ds = fd.load_dataset(name, shared_root)
    assert _size(ds) == PUBLISHED[name]
    if ds.task == "node":
        d = ds.data
        assert d.x.dtype == torch.float32 and d.y.dim() == 1 and d.x.size(0) == d.num_nodes
        assert d.edge_index.max() < d.num_nodes
        assert ds.num_classes == ds.spec.classes and ds.num_features == ds.spec.features
    else:
        g = ds.graphs[0]
        assert g.x is not None and g.x.size(1) == ds.num_features and g.y.numel() == 1
        assert ds.num_classes == ds.spec.classes


def test_every_shared_folder_is_registered_and_present(shared_root):
    folders = {p.name for p in shared_root.iterdir() if p.is_dir()}
    table = fd.datasets_table(shared_root).set_index("name")
    by_folder = {fd.dataset_spec(n).folder: n for n in table.index}
    assert folders <= set(by_folder), f"unregistered folders: {folders - set(by_folder)}"
    assert all(table.loc[by_folder[f], "present"] for f in folders)
    assert not table.loc["PubMed", "present"]          # not in the offline folder


def test_unknown_name_lists_known():
    with pytest.raises(fd.UnknownDatasetError, match="known datasets: Cora, CiteSeer"):
        fd.load_dataset("Coraa")
    assert fd.dataset_spec("ogbn_arxiv").name == "ogbn-arxiv" and fd.dataset_spec("cora").name == "Cora"


def test_missing_dataset_is_one_clear_error(tmp_path, fresh_cache):
    root = tmp_path / "root"; root.mkdir()
    with pytest.raises(fd.DatasetNotFoundError) as info:
        fd.load_dataset("Cora", root, download=False)
    msg = str(info.value)
    assert "'Cora'" in msg and str(root) in msg and "raw/ind.cora.x" in msg and "\n" not in msg
    assert list(root.iterdir()) == []


def _copy_raw(src: Path, dst: Path):
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())


def test_read_only_root_processes_into_cache(tmp_path, fresh_cache, shared_root):
    root = tmp_path / "ro"
    _copy_raw(shared_root / "Cora" / "raw", root / "Cora" / "raw")
    for p in (root / "Cora" / "raw", root / "Cora", root):
        p.chmod(0o555)
    try:
        ds = fd.load_dataset("Cora", root)
        assert ds.data.num_nodes == 2708
        assert sorted(p.name for p in (root / "Cora").iterdir()) == ["raw"]      # nothing written in the root
        assert list(fresh_cache.glob("mirrors/*/Cora/processed/*.pt"))
        assert fd.load_dataset("Cora", root).data.num_nodes == 2708              # second load: from the cache
    finally:
        for p in (root, root / "Cora", root / "Cora" / "raw"):
            p.chmod(0o755)


# ---------- OGB: a small stand-in written in OGB's raw layout ----------

def _write_csv_gz(path: Path, array):
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as f:
        pd.DataFrame(np.asarray(array)).to_csv(f, header=False, index=False)


def test_ogb_code_path_on_standin(tmp_path, fresh_cache):
    n, rng = 50, np.random.default_rng(0)
    edges = rng.integers(0, n, size=(120, 2))
    edges = edges[edges[:, 0] != edges[:, 1]]
    base = tmp_path / "ogbn_arxiv"
    _write_csv_gz(base / "raw" / "edge.csv.gz", edges)
    _write_csv_gz(base / "raw" / "node-feat.csv.gz", rng.normal(size=(n, 128)).round(4))
    _write_csv_gz(base / "raw" / "node-label.csv.gz", rng.integers(0, 40, size=(n, 1)))
    _write_csv_gz(base / "raw" / "node_year.csv.gz", rng.integers(2000, 2020, size=(n, 1)))
    _write_csv_gz(base / "raw" / "num-node-list.csv.gz", [[n]])
    _write_csv_gz(base / "raw" / "num-edge-list.csv.gz", [[len(edges)]])
    perm = rng.permutation(n)
    for part, idx in zip(("train", "valid", "test"), np.split(perm, [30, 40])):
        _write_csv_gz(base / "split" / "time" / f"{part}.csv.gz", idx[:, None])
    (base / "RELEASE_v1.txt").write_text("stand-in\n")
    assert fd.datasets_table(tmp_path).set_index("name").loc["ogbn-arxiv", "present"]
    ds = fd.load_dataset("ogbn-arxiv", tmp_path, download=False)
    d = ds.data
    assert d.num_nodes == n and d.x.shape == (n, 128) and d.y.shape == (n,)
    assert (d.train_mask.sum(), d.val_mask.sum(), d.test_mask.sum()) == (30, 10, 10)
    assert not (d.train_mask & d.test_mask).any()
    # directed citations are symmetrised: every input edge is present both ways
    pairs = set(map(tuple, d.edge_index.t().tolist()))
    assert all((a, b) in pairs and (b, a) in pairs for a, b in edges.tolist())


# ---------- downloads, served from loopback ----------

@contextlib.contextmanager
def _serve(directory: Path):
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(directory))
    handler.log_message = lambda *a, **k: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown(); server.server_close()


def _standin_npz(path: Path, n=40, classes=3, feats=5):
    rng = np.random.default_rng(1)
    edges = rng.integers(0, n, size=(80, 2))
    np.savez(path, node_features=rng.normal(size=(n, feats)).astype(np.float32), node_labels=rng.integers(0, classes, n),
             edges=edges[edges[:, 0] != edges[:, 1]], train_masks=rng.random((10, n)) < .5,
             val_masks=rng.random((10, n)) < .25, test_masks=rng.random((10, n)) < .25)


def test_download_path_urllib(tmp_path, fresh_cache, monkeypatch):
    from torch_geometric.datasets import HeterophilousGraphDataset
    served = tmp_path / "served"; served.mkdir()
    _standin_npz(served / "roman_empire.npz")
    root = tmp_path / "root"
    with _serve(served) as url:
        monkeypatch.setattr(HeterophilousGraphDataset, "url", url)
        ds = fd.load_dataset("roman-empire", root)
    assert (root / "roman_empire" / "raw" / "roman_empire.npz").is_file()
    assert ds.data.num_nodes == 40 and ds.data.train_mask.shape == (40, 10)


def test_download_path_fsspec_zip(tmp_path, fresh_cache, monkeypatch):
    from torch_geometric.datasets import TUDataset
    served = tmp_path / "served"; served.mkdir()
    # two triangles and a path: TU layout inside MUTAG.zip, as the TU site serves it
    files = {"MUTAG_A.txt": "1, 2\n2, 1\n2, 3\n3, 2\n1, 3\n3, 1\n4, 5\n5, 4\n5, 6\n6, 5\n",
             "MUTAG_graph_indicator.txt": "1\n1\n1\n2\n2\n2\n", "MUTAG_graph_labels.txt": "1\n-1\n",
             "MUTAG_node_labels.txt": "0\n1\n2\n0\n0\n1\n"}
    with zipfile.ZipFile(served / "MUTAG.zip", "w") as z:
        for name, text in files.items():
            z.writestr(f"MUTAG/{name}", text)
    root = tmp_path / "root"
    with _serve(served) as url:
        monkeypatch.setattr(TUDataset, "url", url)
        ds = fd.load_dataset("MUTAG", root)
    assert ds.num_graphs == 2 and ds.graphs[0].num_nodes == 3 and ds.graphs[1].num_edges == 4
    assert ds.num_features == 3 and sorted(ds.graphs.y.tolist()) == [0, 1]


def test_failed_download_is_one_error_and_leaves_no_folders(tmp_path, fresh_cache, monkeypatch):
    from torch_geometric.datasets import HeterophilousGraphDataset
    with socket.socket() as s:          # a loopback port with nobody listening
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    monkeypatch.setattr(HeterophilousGraphDataset, "url", f"http://127.0.0.1:{port}")
    root = tmp_path / "root"; root.mkdir()
    with pytest.raises(fd.DatasetNotFoundError) as info:
        fd.load_dataset("roman-empire", root)
    msg = str(info.value)
    assert "could not be downloaded" in msg and "roman_empire/raw/roman_empire.npz" in msg and "\n" not in msg
    assert list(root.iterdir()) == []


# ---------- COLLAB: the GIN text format ----------

GIN_TEXT = "2\n3 1\n0 2 1 2\n0 2 0 2\n0 2 0 1\n2 0\n0 1 1\n0 2 0 0\n"   # a triangle; an edge listed twice


def test_gin_text_conversion(tmp_path, fresh_cache):
    folder = tmp_path / "COLLAB" / "gin_format"; folder.mkdir(parents=True)
    with zipfile.ZipFile(folder / "COLLAB.zip", "w") as z:
        z.writestr("COLLAB/COLLAB.txt", GIN_TEXT)
    ds = fd.load_dataset("COLLAB", tmp_path, download=False)
    assert ds.variant == "gin-text" and ds.num_graphs == 2
    assert ds.graphs[0].num_nodes == 3 and ds.graphs[0].num_edges == 6      # triangle, both directions
    assert ds.graphs[1].num_nodes == 2 and ds.graphs[1].num_edges == 2      # duplicate neighbour dropped
    assert ds.graphs.y.tolist() == [1, 0]
    assert ds.graphs[0].x.shape == (3, 3)                                   # one-hot degree, max degree 2
    # converted once, into fglit's cache: the data root is left as it was (it may be shared), and a second load reads the cache
    assert not (tmp_path / "COLLAB" / "raw").exists() and not (tmp_path / "COLLAB" / "processed").exists()
    assert list(fresh_cache.rglob("COLLAB/processed/data.pt"))
    again = fd.load_dataset("COLLAB", tmp_path)
    assert again.num_graphs == 2 and again.variant == "gin-text"


@st.composite
def gin_texts(draw) -> str:
    "A GIN-format text: 2-5 graphs of 2-6 nodes (some isolated), each with an edge (PyG's TU reader drops trailing graphs without one), labels from a sparse set, tags that vary or not, self-loops and repeated neighbours."
    tag_pool = draw(st.sampled_from([[0], [0, 1, 2], [3, 5]]))
    graphs = []
    for _ in range(draw(st.integers(2, 5))):
        n = draw(st.integers(2, 6))
        lines = [f"{n} {draw(st.sampled_from([0, 2, 7]))}"]
        for v in range(n):
            nbrs = ([1] if v == 0 else []) + draw(st.lists(st.integers(0, n - 1), max_size=4))
            lines.append(" ".join(map(str, [draw(st.sampled_from(tag_pool)), len(nbrs), *nbrs])))
        graphs.append("\n".join(lines))
    return f"{len(graphs)}\n" + "\n".join(graphs) + "\n"


@settings(max_examples=25, deadline=None)
@given(text=gin_texts())
def test_gin_text_dataset_reads_what_tudataset_reads_from_the_tu_conversion(text, tmp_path_factory):
    from torch_geometric.datasets import TUDataset
    tmp = tmp_path_factory.mktemp("gin")
    (tmp / "src").mkdir()
    with zipfile.ZipFile(tmp / "src" / "G.zip", "w") as z:
        z.writestr("G/G.txt", text)
    direct = fd.GinTextDataset(str(tmp / "direct"), "G", tmp / "src" / "G.zip", log=False)
    fd.gin_text_to_tu(tmp / "src" / "G.zip", "G", tmp / "tu" / "G" / "raw")
    through_tu = TUDataset(str(tmp / "tu"), "G")
    assert len(through_tu) == len(direct)
    for a, b in zip(through_tu, direct):
        assert a.num_nodes == b.num_nodes and torch.equal(a.edge_index, b.edge_index) and torch.equal(a.y, b.y)
        assert (a.x is None) == (b.x is None) and (a.x is None or torch.equal(a.x, b.x))


def test_gin_text_dataset_keeps_graphs_without_edges(tmp_path):
    with zipfile.ZipFile(tmp_path / "G.zip", "w") as z:
        z.writestr("G/G.txt", "3\n1 5\n0 0\n2 5\n0 1 1\n0 1 0\n2 6\n0 1 0\n0 0\n")      # one node; an edge; a self-loop only
    ds = fd.GinTextDataset(str(tmp_path / "out"), "G", tmp_path / "G.zip", log=False)
    assert [g.num_nodes for g in ds] == [1, 2, 2] and [g.num_edges for g in ds] == [0, 2, 0] and ds.y.tolist() == [0, 0, 1]


def test_edge_homophily():
    ei = torch.tensor([[0, 1, 1, 2], [1, 0, 2, 1]])
    assert fd.edge_homophily(ei, torch.tensor([0, 0, 1])) == 0.5
    assert np.isnan(fd.edge_homophily(torch.empty(2, 0, dtype=torch.long), torch.tensor([0])))

"""Louvain backends (`louvain_backend`): networkx (the default), igraph's C implementation (the `igraph` extra) and
scikit-network's Cython one (the `sknetwork` extra): seeded, validated, a valid partition, and each recovers planted
blocks."""
import numpy as np
import pytest
import torch
from torch_geometric.data import Data

from fglit.partition import community_graph, louvain, louvain_labels, louvain_plus, partition, partition_path
from fglit.partition_community import LOUVAIN_BACKENDS

@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FGLIT_CACHE", str(tmp_path / "cache"))


@pytest.fixture(params=["networkx", "igraph", "sknetwork"])
def backend(request):
    if request.param != "networkx":           # the extras: their module has the backend's name
        pytest.importorskip(request.param, reason=f"the {request.param} extra: pip install 'fglit[{request.param}]'")
    return request.param


def blocks(num_blocks=4, size=30, p_in=0.5, p_out=0.005, seed=0) -> tuple[Data, np.ndarray]:
    "A graph of dense blocks joined by a few random edges, and each node's block."
    rng = np.random.default_rng(seed)
    n = num_blocks * size
    block = np.repeat(np.arange(num_blocks), size)
    u, v = np.triu_indices(n, 1)
    p = np.where(block[u] == block[v], p_in, p_out)
    keep = rng.random(len(u)) < p
    u, v = u[keep], v[keep]
    ei = torch.from_numpy(np.stack([np.concatenate([u, v]), np.concatenate([v, u])]))
    return Data(x=torch.zeros(n, 2), edge_index=ei, y=torch.from_numpy(block % 2), num_nodes=n), block


def test_backends_are_named():
    assert LOUVAIN_BACKENDS == ("networkx", "igraph", "sknetwork")


def test_unknown_backend_is_refused_with_the_choices():
    g = community_graph(60, 240, 3, seed=0)
    for call in (lambda: louvain_labels(g.edge_index, 60, backend="leiden"),
                 lambda: louvain(g, 3, louvain_backend="leiden"),
                 lambda: louvain_plus(g, 2, num_parts=6, louvain_backend="Igraph"),
                 lambda: partition(g, "louvain", 3, louvain_backend=None)):
        with pytest.raises(ValueError, match=r"louvain_backend must be one of \['networkx', 'igraph', 'sknetwork'\]"):
            call()


def test_blocks_are_recovered(backend):
    g, block = blocks()
    labels = louvain_labels(g.edge_index, g.num_nodes, seed=0, backend=backend)
    assert labels.max() + 1 == 4
    for b in range(4):                       # each block is one community, and different blocks different ones
        assert len(np.unique(labels[block == b])) == 1
    assert len(np.unique(labels[np.arange(0, 120, 30)])) == 4


def test_same_seed_same_partition(backend):
    g = community_graph(400, 2400, 8, p_in=0.5, seed=1)         # weak communities: the visiting order matters
    a = louvain_labels(g.edge_index, 400, seed=3, backend=backend)
    np.testing.assert_array_equal(a, louvain_labels(g.edge_index, 400, seed=3, backend=backend))
    p, q = (louvain(g, 5, seed=3, louvain_backend=backend) for _ in range(2))
    assert torch.equal(p.assignment, q.assignment) and torch.equal(p.split_codes, q.split_codes)
    others = [louvain_labels(g.edge_index, 400, seed=s, backend=backend) for s in range(4, 8)]
    assert any(not np.array_equal(a, o) for o in others), "four other seeds all gave the same communities"


@pytest.mark.parametrize("mode", ["pack", "largest"])
def test_valid_partition(backend, mode):
    g = community_graph(300, 1500, 12, seed=0)
    p = louvain(g, 4, seed=0, mode=mode, louvain_backend=backend)
    a = p.assignment.numpy()
    assert a.shape == (300,) and a.min() >= -1 and a.max() == 3
    ids = np.concatenate([c.global_id.numpy() for c in p.clients])
    assert len(ids) == len(np.unique(ids)) == p.covered                  # no node in two clients
    np.testing.assert_array_equal(np.sort(ids), np.flatnonzero(a >= 0))
    if mode == "pack":
        assert p.covered == 300                                          # every node in exactly one client
    q = louvain_plus(g, 3, seed=0, num_parts=10, delta=0, louvain_backend=backend)
    assert q.covered == 300 and len(q.clients) == 3


def test_the_default_keeps_its_cache_key_and_params(backend):
    g = community_graph(120, 600, 4, seed=0)
    default = partition_path(g, "louvain", 3)
    assert partition_path(g, "louvain", 3, louvain_backend="networkx") == default
    p = partition(g, "louvain", 3, louvain_backend=backend)
    if backend == "networkx":
        assert "louvain_backend" not in p.params
    else:
        assert p.params["louvain_backend"] == backend and partition_path(g, "louvain", 3, louvain_backend=backend) != default


@pytest.mark.parametrize("name", ["igraph", "sknetwork"])
def test_a_missing_backend_names_its_extra(monkeypatch, name):
    import sys
    for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        monkeypatch.delitem(sys.modules, module)
    monkeypatch.setitem(sys.modules, name, None)          # as if not installed: importing it fails
    g, _ = blocks()
    with pytest.raises(ModuleNotFoundError, match=rf"pip install 'fglit\[{name}\]'"):
        louvain_labels(g.edge_index, g.num_nodes, backend=name)


def test_networkx_on_a_large_graph_points_to_the_fast_backend(monkeypatch):
    import fglit.partition_community as pc
    monkeypatch.setattr(pc, "SLOW_NETWORKX_NODES", 100)          # the blocks graph (120 nodes) counts as large
    g, _ = blocks()
    with pytest.warns(UserWarning, match="louvain_backend='sknetwork'"):
        louvain_labels(g.edge_index, g.num_nodes, backend="networkx")
    pytest.importorskip("sknetwork")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        louvain_labels(g.edge_index, g.num_nodes, backend="sknetwork")

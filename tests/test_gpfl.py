"""Tests for GPFL (graph classification via client network learning, TMLR 2025; `fglit.algorithms.gpfl`, from nbs/30_gpfl.ipynb)."""
import math

import networkx as nx
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch_geometric.data import Batch, Data

from fglit.algorithms import gpfl
from fglit.algorithms.gpfl import (PROPERTY_NAMES, ClientNetworkGAE, GPFLConfig, cosine_network, dataset_graph_properties,
                                   discretise, erdos_renyi_graphs, gae_loss, graph_properties, marginal_features,
                                   mixing_matrix, personalised_update, property_network, row_normalize, select_properties)
from fglit.federation import ConfigError, get_algorithm, make_config, simulate
from fglit.partition import GraphClient


# -- graph properties --------------------------------------------------------------------------
def reference_properties(n: int, edges: list[tuple[int, int]]) -> list[float]:
    "The six properties from networkx and numpy, written from their definitions."
    G = nx.Graph(); G.add_nodes_from(range(n)); G.add_edges_from((u, v) for u, v in edges if u != v)
    d = np.array([G.degree(v) for v in range(n)], dtype=float)
    E = d.sum()
    mean_d = d.mean() if n else 0.0
    entropy = float(np.mean([x * math.log(x) if x > 0 else 0.0 for x in d]) / E) if E > 0 else 0.0
    density = E / (n * (n - 1)) if n > 1 else 0.0
    var = float((d ** 2).mean() - mean_d ** 2) if n else 0.0
    sf = -(1 / mean_d + 2) if mean_d > 0 else -2.0
    close = float(np.mean(list(nx.closeness_centrality(G).values()))) if n > 1 else 0.0
    return [entropy, density, mean_d, var, sf, close]


graph_strategy = st.integers(1, 12).flatmap(
    lambda n: st.tuples(st.just(n), st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=3 * n)))


@settings(max_examples=40, deadline=None)
@given(graphs=st.lists(graph_strategy, min_size=1, max_size=6))
def test_properties_match_networkx_on_any_graphs(graphs):
    # random simple/multi graphs with self loops, duplicates, isolated nodes and disconnected parts, batched together
    data = [Data(edge_index=torch.tensor(e, dtype=torch.long).reshape(-1, 2).T, num_nodes=n) for n, e in graphs]
    b = Batch.from_data_list(data)
    got = graph_properties(b.edge_index, b.ptr.diff())
    want = torch.tensor([reference_properties(n, e) for n, e in graphs], dtype=torch.float64)
    assert got.shape == (len(graphs), len(PROPERTY_NAMES))
    assert torch.isfinite(got).all()
    assert torch.allclose(got, want, atol=1e-9)


def test_properties_of_degenerate_graphs_are_defined():
    empty = torch.empty(2, 0, dtype=torch.long)
    p = graph_properties(empty, torch.tensor([1, 4, 0]))            # one node, four isolated nodes, zero nodes
    assert torch.isfinite(p).all()
    expected = torch.tensor([0.0, 0.0, 0.0, 0.0, -2.0, 0.0], dtype=torch.float64)
    assert torch.equal(p, expected.expand(3, -1))
    # a path 0-1-2: closeness (2/3, 1, 2/3), mean 7/9; density 2*2/(3*2)
    p = graph_properties(torch.tensor([[0, 1], [1, 2]]), torch.tensor([3]))[0]
    assert p[1].item() == pytest.approx(2 / 3) and p[5].item() == pytest.approx(7 / 9) and p[4].item() == pytest.approx(-(1 / (4 / 3) + 2))


def test_closeness_chunks_agree_with_one_chunk():
    g = torch.Generator().manual_seed(0)
    data = [Data(edge_index=torch.randint(0, n, (2, 2 * n), generator=g), num_nodes=n) for n in (3, 9, 17, 30, 5, 41)]
    b = Batch.from_data_list(data)
    node_graph = b.batch
    ei = gpfl._simple_undirected(b.edge_index, b.num_nodes)
    whole = gpfl._closeness(ei, node_graph, b.ptr, b.ptr.diff(), budget=1 << 30)
    tiny = gpfl._closeness(ei, node_graph, b.ptr, b.ptr.diff(), budget=1)          # one graph per chunk
    assert torch.allclose(whole, tiny)


def test_dataset_properties_are_cached_and_follow_index_selection(shared_root, fresh_cache):
    from fglit.data import load_dataset
    graphs = load_dataset("MUTAG", shared_root).graphs
    gpfl._PROPERTY_MEMO.clear()
    full = dataset_graph_properties(graphs)
    files = list((fresh_cache / "graph_properties").glob("*.pt"))
    assert full.shape == (len(graphs), 6) and len(files) == 1 and torch.isfinite(full).all()
    gpfl._PROPERTY_MEMO.clear()                                        # the second read comes from disk
    assert torch.equal(dataset_graph_properties(graphs), full)
    view = graphs.index_select(torch.tensor([5, 0, 17])).index_select(torch.tensor([2, 0]))     # graphs 17, 5
    assert torch.equal(dataset_graph_properties(view), full[[17, 5]])
    assert torch.allclose(dataset_graph_properties([graphs[17], graphs[5]]), full[[17, 5]])        # plain list path
    assert torch.equal(dataset_graph_properties(graphs, cache=False), full)
    files[0].write_bytes(b"not a tensor file")                          # a broken cache is recomputed, not fatal
    gpfl._PROPERTY_MEMO.clear()
    assert torch.equal(dataset_graph_properties(graphs), full)


# -- networks and aggregation ---------------------------------------------------------------------
matrices = st.integers(1, 7).flatmap(lambda k: st.tuples(
    st.just(k), st.integers(1, 9), st.integers(0, 10_000), st.floats(0, 1), st.sampled_from(["self", "network"])))


@settings(max_examples=60, deadline=None)
@given(case=matrices)
def test_aggregation_properties(case):
    k, F, seed, gamma, gamma_on = case
    g = torch.Generator().manual_seed(seed)
    theta, d = torch.randn(k, F, generator=g, dtype=torch.float64), torch.randn(k, F, generator=g, dtype=torch.float64)
    A = torch.rand(k, k, generator=g, dtype=torch.float64) * (torch.rand(k, k, generator=g) > 0.5)
    W = mixing_matrix(A, gamma, gamma_on)
    assert (W >= 0).all() and torch.allclose(W.sum(1), torch.ones(k, dtype=torch.float64))
    assert torch.allclose(personalised_update(theta, d, W, sparse=True), personalised_update(theta, d, W, sparse=False))
    # uniform network with all weight on it: every client gets FedAvg's (uniform) mean update
    fedavg = mixing_matrix(torch.ones(k, k, dtype=torch.float64), 0.0 if gamma_on == "self" else 1.0, gamma_on)
    assert torch.allclose(personalised_update(theta, d, fedavg), theta + d.mean(0))
    # identity network (any gamma), or all weight on self: local training
    assert torch.allclose(personalised_update(theta, d, mixing_matrix(torch.eye(k, dtype=torch.float64), gamma, gamma_on)), theta + d)
    self_only = mixing_matrix(A, 1.0 if gamma_on == "self" else 0.0, gamma_on)
    assert torch.allclose(personalised_update(theta, d, self_only), theta + d)
    # gamma_on swaps which term gets gamma
    assert torch.allclose(mixing_matrix(A, gamma, "self"), mixing_matrix(A, 1 - gamma, "network"))


def test_row_normalize_and_discretise_never_leave_an_empty_row():
    A = torch.tensor([[0.0, 2.0, 2.0], [0.0, 0.0, 0.0], [float("nan"), 0.0, 0.0]])
    R = row_normalize(A)
    assert torch.equal(R, torch.tensor([[0.0, 0.5, 0.5], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]))
    assert discretise(torch.randn(1, 8), 0.1).tolist() == [[1.0]]           # k = 1: the client alone
    Z = torch.randn(6, 4, generator=torch.Generator().manual_seed(3))
    for dense in (False, True):
        D = discretise(Z, 0.1, dense=dense)
        assert torch.allclose(D.sum(1), torch.ones(6)) and (D >= 0).all()
    # each kept entry passes softmax > h; the discrete rows are uniform over their kept entries
    P = torch.softmax(Z @ Z.T, 1)
    D = discretise(Z, 0.1)
    assert torch.equal(D > 0, P > 0.1 / 6)
    assert torch.allclose(discretise(Z, 0.1, dense=True), P)
    assert torch.equal(discretise(Z, 1e9), torch.eye(6))                   # nothing passes: each keeps itself


def test_cosine_and_property_networks():
    x = torch.tensor([[1.0, 0.0], [2.0, 0.1], [-1.0, 0.0], [0.0, 0.0]])
    A = cosine_network(x)
    assert (A >= 0).all() and torch.allclose(A, A.T)
    assert A[0, 2] == 0                                                      # opposite after centring: clipped
    assert cosine_network(torch.randn(1, 5)).tolist() == [[0.0]]            # one client: no similarity to measure
    props = torch.rand(5, 6, dtype=torch.float64) * torch.tensor([1, 1, 100, 100, 1, 1], dtype=torch.float64)
    assert torch.allclose(property_network(props, [2, 3]), cosine_network(props[:, [2, 3]]).float())
    std = property_network(props, None, "standardize")
    assert torch.allclose(std, property_network(props * 1000 + 7, None, "standardize"), atol=1e-5)   # unit-free


def test_property_selection_finds_the_informative_properties_and_stops():
    g = torch.Generator().manual_seed(0)
    props = torch.rand(8, 6, generator=g, dtype=torch.float64)
    target = property_network(props, [1, 4])                               # A_E built from two properties only
    kept, trace = select_properties(props, target, min_properties=2)
    assert sorted(kept) == [1, 4] and trace[-1]["distance"] < 1e-6
    assert all(a["distance"] > b["distance"] for a, b in zip(trace, trace[1:]))      # every drop helped
    kept3, _ = select_properties(props, target, min_properties=3)
    assert len(kept3) == 3 and {1, 4} <= set(kept3)
    # all properties already match: no drop helps, all kept
    kept_all, trace_all = select_properties(props, property_network(props), min_properties=2)
    assert kept_all == list(range(6)) and len(trace_all) == 1


def test_marginal_features_and_random_graphs():
    theta = torch.randn(5, 1234)
    X = marginal_features(theta, 100)
    assert X.shape == (5, 100) and torch.allclose(X.norm(dim=1), torch.ones(5), atol=1e-5)
    assert torch.allclose(marginal_features(theta + 3.0, 100), X, atol=1e-5)              # only differences matter
    assert marginal_features(theta[:1], 100).abs().max() == 0                            # one client: zero features
    R1, R2 = erdos_renyi_graphs(20, 30, 0.1, 37, seed=0), erdos_renyi_graphs(20, 30, 0.1, 37, seed=0)
    assert torch.equal(R1.edge_index, R2.edge_index) and R1.x.shape == (600, 37)
    deg = torch.bincount(R1.edge_index[0].cpu(), minlength=600)
    assert torch.equal(R1.x.argmax(1).cpu()[deg < 37], deg[deg < 37]) and torch.equal(R1.x.sum(1).cpu(), torch.ones(600))
    assert erdos_renyi_graphs(3, 10, 1.0, 4).x.sum() == 0                              # degree 9 >= 4 features: truncated
    assert not torch.equal(erdos_renyi_graphs(20, 30, 0.1, 37, seed=1).edge_index, R1.edge_index)


def test_gae_loss_and_shape():
    assert gae_loss(torch.zeros(4, 3)).item() == pytest.approx(2 * math.log(2))
    assert torch.isfinite(gae_loss(torch.full((4, 3), 100.0)))
    gae = ClientNetworkGAE(10, 16, 8, norm="both")
    Z = gae(torch.randn(4, 10), row_normalize(torch.rand(4, 4)))
    assert Z.shape == (4, 8) and torch.allclose(Z.mean(1), torch.zeros(4), atol=1e-5)     # output LayerNorm
    with pytest.raises(ValueError):
        ClientNetworkGAE(10, norm="bogus")


def test_config_validation():
    assert make_config(GPFLConfig).gamma == 0.95
    for bad in (dict(gamma_on="both"), dict(network_init="zeros"), dict(aggregation="sparse"), dict(gamma=1.5),
                dict(client_fraction=0.5), dict(min_properties=0), dict(gae_norm="batch"), dict(threshold=-1.0)):
        with pytest.raises(ConfigError):
            make_config(GPFLConfig, bad)


# -- end to end on small synthetic data ------------------------------------------------------------
def synthetic_clients(sizes_labels, seed=0, features=4):
    "GraphClients of random graphs (some with no edges, some with one node); `sizes_labels` = per client a list of labels."
    g = torch.Generator().manual_seed(seed)
    clients, gid = [], 0
    for labels in sizes_labels:
        graphs = []
        for i, y in enumerate(labels):
            n = 1 if i % 5 == 3 else int(torch.randint(2, 9, (1,), generator=g))
            ei = torch.empty(2, 0, dtype=torch.long) if i % 5 == 1 else torch.randint(0, n, (2, 2 * n), generator=g)
            x = torch.nn.functional.one_hot(torch.randint(0, features, (n,), generator=g), features).float()
            graphs.append(Data(x=x, edge_index=ei, y=torch.tensor([y])))
        m = len(graphs)
        train = torch.arange(m) < m - 2
        clients.append(GraphClient(torch.arange(gid, gid + m), torch.tensor(labels), train, torch.zeros(m, dtype=torch.bool),
                                   ~train, None, graphs))
        gid += m
    return clients


def run_synthetic(clients, rounds=2, **settings):
    algo = get_algorithm("gpfl")
    config = make_config(GPFLConfig, dict(rounds=rounds, hidden=8, layers=2, batch_size=8, gae_iters=5, **settings))
    servers = []
    res = simulate(algo, clients, "graph", 4, 2, config, seed=0, progress=False,
                   callback=lambda rnd, server, cl: servers.append(server))
    return res, servers[-1]


def test_gpfl_end_to_end_with_a_single_class_client_and_degenerate_graphs():
    clients = synthetic_clients([[0] * 12, [0, 1] * 6, [1] * 10 + [0, 1]])    # client 0 holds one class only
    res, server = run_synthetic(clients, rounds=3)
    assert len(server.history) == 3 and server.properties.shape == (3, 6) and torch.isfinite(server.properties).all()
    assert torch.isfinite(server.theta).all() and not torch.equal(server.theta[0], server.theta[1])   # personalised
    for h in server.history:
        assert torch.allclose(h["A"].sum(1), torch.ones(3)) and torch.isfinite(h["A_t"]).all()
    assert len(server.selected) >= 2
    comm = res.communication
    up = comm[comm.direction == "up"].groupby("round")["floats"].sum()
    P = server.theta.size(1)
    assert up[1] == 3 * (P + 6) and up[2] == 3 * P                      # properties travel in round 1 only
    assert res.history["accuracy"].notna().any()


def test_gpfl_with_one_client_is_local_training():
    res, server = run_synthetic(synthetic_clients([[0, 1] * 6]), rounds=2)
    assert all(h["A"].tolist() == [[1.0]] for h in server.history)
    assert server.selected == list(range(6))
    assert torch.isfinite(server.theta).all()


@pytest.mark.parametrize("settings", [dict(network_init="random"), dict(learn_network=False), dict(aggregation="dense"),
                                      dict(gamma_on="network", evaluation="global")])
def test_gpfl_variants_run(settings):
    res, server = run_synthetic(synthetic_clients([[0] * 10, [0, 1] * 5, [1] * 10]), rounds=2, **settings)
    assert len(server.history) == 2 and torch.isfinite(server.theta).all()
    if settings.get("learn_network") is False:
        assert torch.equal(server.history[0]["A"], server.history[1]["A"])        # the fixed initial network
    if settings.get("network_init") == "random":
        assert server.properties is None
    if settings.get("aggregation") == "dense":
        assert (server.history[-1]["A"] > 0).all()


def test_gpfl_refuses_mixed_models():
    from fglit.federation import ClientInfo, ModelSpec
    spec = ModelSpec("gin", 4, 2, "graph", 8, 2, 0.5)
    with pytest.raises(ConfigError):
        gpfl.GPFLServer(make_config(GPFLConfig), [ClientInfo(0, 5, 5), ClientInfo(1, 5, 5, spec.replace(name="mlp"))], spec)


def test_gpfl_on_nci1(shared_root):
    from fglit.federation import run
    res = run("gpfl", "NCI1", "soft_dirichlet", 3, rounds=2, settings=dict(alpha=0.5, gae_iters=10), root=shared_root, progress=False)
    s = res.summary()
    assert 0 < s["accuracy_mean"] <= 1 and s["rounds"] == 2 and res.config["gamma"] == 0.95
    assert get_algorithm("gpfl").sums_only is False


def test_uncached_view_computes_only_its_own_graphs(shared_root, monkeypatch):
    from fglit.data import load_dataset
    graphs = load_dataset("MUTAG", shared_root).graphs
    full = dataset_graph_properties(graphs, cache=False)
    view = graphs.index_select(torch.tensor([17, 5]))
    def whole_storage(_):
        raise AssertionError("an uncached view must not compute the whole dataset")
    monkeypatch.setattr(gpfl, "_all_graph_properties", whole_storage)
    assert torch.allclose(dataset_graph_properties(view, cache=False), full[[17, 5]])

"""Tests for FedStar (`fglit.algorithms.fedstar`, from nbs/14_fedstar.ipynb): structure embeddings, the decoupled model, and structure-only sharing."""
import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch_geometric.data import Batch as GraphBatch, Data

import fglit.algorithms.fedstar as fedstar
from fglit.algorithms.fedstar import FedStarClient, FedStarConfig, FedStarGIN, FedStarServer, fedstar_model
from fglit.algorithms.structure import degree_embedding, random_walk_embedding, structure_embedding, with_structure_embeddings
from fglit.core import get_device
from fglit.federation import (ALGORITHM_MODULES, ClientInfo, ConfigError, LocalData, ModelSpec, flat_state, get_algorithm,
                              make_config, run, simulate)
from fglit.partition import GraphClient

PATH = torch.tensor([[0, 1, 1, 2], [1, 0, 2, 1]])
TRIANGLE = torch.tensor([[0, 1, 1, 2, 2, 0], [1, 0, 2, 1, 0, 2]])
NO_EDGES = torch.zeros(2, 0, dtype=torch.long)
GIN_SETUP = {"model": "gin", "hidden": 64, "layers": 3, "lr": 1e-3, "weight_decay": 5e-4, "batch_size": 128,
             "selection": "last", "weighting": "plain", "folds": 5}


def dense_return_probabilities(edge_index, n, k):
    "diag(P^i), i = 1..k, with dense matrix powers of P = D^-1 A (A binary; zero rows for nodes without out-edges)."
    A = torch.zeros(n, n, dtype=torch.float64)
    if edge_index.numel():
        A[edge_index[0], edge_index[1]] = 1
    d = A.sum(1, keepdim=True)
    P = torch.where(d > 0, A / d.clamp_min(1), torch.zeros_like(A))
    if k == 0:
        return torch.zeros(n, 0, dtype=torch.float64)
    return torch.stack([torch.linalg.matrix_power(P, i).diagonal() for i in range(1, k + 1)], 1)


def toy_graph_clients(n, graphs_per_client=10):
    "`n` `GraphClient`s of small random graphs (5 features, 2 classes); graph 0 of each client is a single node without edges."
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        graphs = []
        for i in range(graphs_per_client):
            k = 1 if i == 0 else int(torch.randint(2, 7, (1,), generator=g))
            ei = torch.randint(0, k, (2, 2 * k), generator=g) if k > 1 else NO_EDGES
            graphs.append(Data(x=torch.randn(k, 5, generator=g), edge_index=torch.cat([ei, ei.flip(0)], 1), y=torch.tensor([i % 2])))
        y = torch.tensor([i % 2 for i in range(graphs_per_client)])
        split = torch.tensor([0] * (graphs_per_client - 4) + [1] * 2 + [2] * 2)
        out.append(GraphClient(torch.arange(graphs_per_client), y, split == 0, split == 1, split == 2, graphs=graphs))
    return out


def toy_clients(n, graphs_per_client=10):
    "The clients of `toy_graph_clients` as `LocalData`."
    return [LocalData(c, "graph", batch_size=4) for c in toy_graph_clients(n, graphs_per_client)]


def federation(n=3, **settings):
    algo = get_algorithm("fedstar")
    config = make_config(algo.config, {"hidden": 8, "layers": 2, "batch_size": 4, **settings})
    spec = ModelSpec("gin", 5, 2, "graph", config.hidden, config.layers, config.dropout)
    datas = toy_clients(n)
    server = algo.server(config, [ClientInfo(i, d.num_train, sum(d.counts.values())) for i, d in enumerate(datas)], spec)
    return server, [algo.client(i, d, config, spec) for i, d in enumerate(datas)]


def feature_side(model):
    "Every parameter outside the structure encoder, as one vector."
    return torch.cat([p.detach().reshape(-1) for n, p in model.named_parameters() if not n.startswith("encoder.structure.")])


# -- structure embeddings -------------------------------------------------------------------------
def test_random_walk_return_probabilities_by_hand():
    assert torch.allclose(random_walk_embedding(PATH, 3, 4), torch.tensor([[0, .5, 0, .5], [0, 1, 0, 1], [0, .5, 0, .5]]))
    assert torch.allclose(random_walk_embedding(TRIANGLE, 3, 3), torch.tensor([[0, .5, .25]] * 3))
    star = torch.tensor([[0, 1, 0, 2, 0, 3], [1, 0, 2, 0, 3, 0]])       # hub 0 and three leaves
    rw = random_walk_embedding(star, 4, 2)
    assert torch.allclose(rw, torch.tensor([[0, 1.0], [0, 1 / 3], [0, 1 / 3], [0, 1 / 3]]))


def test_degree_one_hot_uses_the_authors_buckets():
    star = torch.tensor([[0, 1, 0, 2, 0, 3], [1, 0, 2, 0, 3, 0]])
    assert torch.equal(degree_embedding(star, 5, 2), torch.tensor([[0., 1], [1, 0], [1, 0], [1, 0], [1, 0]]))   # 3 -> last slot, 0 -> slot 0
    dup = torch.tensor([[0, 0, 1], [1, 1, 0]])                           # a duplicated edge counts once
    assert torch.equal(degree_embedding(dup, 2, 3).argmax(1), torch.tensor([0, 0]))


def test_one_node_and_edgeless_graphs_have_a_defined_embedding():
    s = structure_embedding(NO_EDGES, 1, 16, 16)
    assert s.shape == (1, 32) and s[0, :16].abs().sum() == 0 and s[0, 16] == 1 and s.sum() == 1
    assert structure_embedding(NO_EDGES, 4, 3, 2).tolist() == [[0, 0, 0, 1, 0]] * 4
    assert structure_embedding(PATH, 3, 0, 2).shape == (3, 2) and structure_embedding(PATH, 3, 2, 0).shape == (3, 2)
    with pytest.raises(ValueError, match="nodes"):
        random_walk_embedding(PATH, 2, 3)


@st.composite
def graph_lists(draw):
    graphs = []
    for _ in range(draw(st.integers(1, 4))):
        n = draw(st.integers(1, 7))
        m = draw(st.integers(0, 3 * n))
        src = draw(st.lists(st.integers(0, n - 1), min_size=m, max_size=m))
        dst = draw(st.lists(st.integers(0, n - 1), min_size=m, max_size=m))
        ei = torch.tensor([src, dst], dtype=torch.long).view(2, -1)
        if draw(st.booleans()):
            ei = torch.cat([ei, ei.flip(0)], 1)                           # undirected
        graphs.append(Data(x=torch.zeros(n, 1), edge_index=ei, y=torch.tensor([0])))
    return graphs


@settings(max_examples=60, deadline=None)
@given(graph_lists(), st.integers(0, 6), st.integers(1, 5))
def test_structure_embedding_properties(graphs, k, dim):
    b = GraphBatch.from_data_list(graphs)
    s = structure_embedding(b.edge_index, b.num_nodes, k, dim)
    rw, dg = s[:, :k], s[:, k:]
    assert s.shape == (b.num_nodes, k + dim)
    assert ((rw >= 0) & (rw <= 1)).all()                                  # each entry a probability
    assert torch.equal(dg.sum(1), torch.ones(b.num_nodes)) and set(dg.unique().tolist()) <= {0.0, 1.0}
    # the union gives each graph exactly its own embedding, equal to dense matrix powers
    for i, g in enumerate(graphs):
        nodes = slice(int(b.ptr[i]), int(b.ptr[i + 1]))
        assert torch.allclose(s[nodes], structure_embedding(g.edge_index, g.num_nodes, k, dim))
        assert torch.allclose(rw[nodes].double(), dense_return_probabilities(g.edge_index, g.num_nodes, k), atol=1e-6)
    aug = with_structure_embeddings(graphs, k, dim, device="cpu")
    assert [a.num_nodes for a in aug] == [g.num_nodes for g in graphs]
    assert all(torch.equal(a.edge_index, g.edge_index) and torch.equal(a.x[:, 1:], s[int(b.ptr[i]):int(b.ptr[i + 1])])
               for i, (a, g) in enumerate(zip(aug, graphs)))


# -- model ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("conv", ["gcn", "gin"])
def test_model_runs_on_a_batch_with_a_one_node_graph(conv):
    graphs = [Data(x=torch.randn(3, 2), edge_index=PATH, y=torch.tensor([0])),
              Data(x=torch.randn(1, 2), edge_index=NO_EDGES, y=torch.tensor([1]))]
    b = GraphBatch.from_data_list(with_structure_embeddings(graphs, 4, 3)).to(get_device())
    model = FedStarGIN(2, 3, hidden=8, layers=2, rw_dim=4, degree_dim=3, structure_conv=conv).to(get_device())
    out = model(b.x, b.edge_index, b.batch)
    assert out.shape == (2, 3) and torch.isfinite(out).all()
    out.sum().backward()
    assert all(p.grad is not None for p in model.structure.parameters())
    with pytest.raises(ValueError, match="structure embedding"):
        model(b.x[:, :2], b.edge_index, b.batch)


def test_structure_encoder_is_a_strict_part_of_the_model():
    cfg = FedStarConfig()
    model = fedstar_model(ModelSpec("gin", 37, 2, "graph", 64, 3, 0.5), cfg)
    n_struct = flat_state(model.structure).numel()
    assert n_struct == (32 * 64 + 64) + 3 * (64 * 64 + 64)               # W_s, b_s and three GCN layers
    assert n_struct < flat_state(model).numel()


# -- config and task ------------------------------------------------------------------------------
@pytest.mark.parametrize("bad, match", [({"rw_dim": -1}, "rw_dim"), ({"degree_dim": -2}, "degree_dim"),
                                        ({"rw_dim": 0, "degree_dim": 0}, "structure embedding"),
                                        ({"structure_conv": "gat"}, "structure_conv"), ({"model": "gcn"}, "GIN"),
                                        ({"client_fraction": 0.5}, "client_fraction"), ({"rw_dim": 1.5}, "rw_dim")])
def test_bad_settings_are_config_errors(bad, match):
    with pytest.raises(ConfigError, match=match):
        make_config(get_algorithm("fedstar").config, bad)


def test_node_classification_is_rejected():
    algo = get_algorithm("fedstar")
    data = Data(x=torch.randn(6, 3), edge_index=torch.tensor([[0, 1], [1, 0]]), y=torch.tensor([0, 1] * 3),
                train_mask=torch.ones(6, dtype=torch.bool), val_mask=torch.zeros(6, dtype=torch.bool),
                test_mask=torch.zeros(6, dtype=torch.bool))
    with pytest.raises(ConfigError, match="graph-classification"):
        simulate(algo, [data], "node", 3, 2, make_config(algo.config, {"rounds": 1}), progress=False)


def test_registered_and_sums_only():
    algo = get_algorithm("FedStar")
    assert algo.client is FedStarClient and algo.server is FedStarServer and algo.config is FedStarConfig
    assert algo.sums_only and "fglit.algorithms.fedstar" in ALGORITHM_MODULES
    cfg = FedStarConfig()
    assert (cfg.rw_dim, cfg.degree_dim, cfg.hidden, cfg.layers, cfg.lr, cfg.batch_size, cfg.local_epochs) == (16, 16, 64, 3, 1e-3, 128, 1)


# -- protocol -------------------------------------------------------------------------------------
def test_only_the_structure_encoder_travels_and_is_averaged():
    server, clients = federation(3)
    n_struct = flat_state(clients[0].model.structure).numel()
    down = server.broadcast(1, [0, 1, 2])
    replies = {i: c.local_step(down[i], 1) for i, c in enumerate(clients)}
    for msg in [*down.values(), *replies.values()]:
        assert set(msg) <= {"params", "weight"}
        assert msg["params"].shape == (n_struct,) and n_struct < flat_state(clients[0].model).numel()
    # round 1 starts every client from the server's one structure encoder
    server.aggregate(1, replies)
    w = torch.tensor([r["weight"] for r in replies.values()])
    want = sum(r["params"] * wi for r, wi in zip(replies.values(), w)) / w.sum()
    assert torch.allclose(server.params, want)
    for i, c in enumerate(clients):
        c.receive(server.broadcast(2, [i])[i])
    S = [flat_state(c.model.structure) for c in clients]
    assert all(torch.equal(S[0], s) for s in S[1:]) and torch.equal(S[0], server.params)
    Fe = [feature_side(c.model) for c in clients]
    assert not torch.allclose(Fe[0], Fe[1]) and not torch.allclose(Fe[0], Fe[2])


def test_global_evaluation_swaps_in_the_average_and_leaves_the_client_alone():
    server, clients = federation(2)
    c = clients[0]
    c.local_step(server.broadcast(1, [0])[0], 1)
    before = flat_state(c.model).clone()
    avg = server.params + 0.25
    m = c.evaluation_model({"params": avg})
    assert m is not c.model and torch.equal(flat_state(m.structure), avg)
    assert torch.equal(feature_side(m), feature_side(c.model)) and torch.equal(flat_state(c.model), before)
    assert c.evaluation_model(None) is c.model


def test_structure_embeddings_are_computed_once_per_client(monkeypatch):
    calls = []
    import fglit.algorithms.structure as structure        # with_structure_embeddings calls it there
    real = structure.structure_embedding
    monkeypatch.setattr(structure, "structure_embedding", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    algo = get_algorithm("fedstar")
    config = make_config(algo.config, {"hidden": 8, "layers": 2, "batch_size": 4, "rounds": 3})
    seed_run = simulate(algo, toy_graph_clients(2), "graph", 5, 2, config, progress=False)
    assert len(calls) == 2 and seed_run.history["round"].max() == 3              # two clients, three rounds


def test_lower_level_clients_reject_node_data():
    data = LocalData(Data(x=torch.randn(4, 3), edge_index=NO_EDGES, y=torch.zeros(4, dtype=torch.long),
                          train_mask=torch.ones(4, dtype=torch.bool), val_mask=torch.zeros(4, dtype=torch.bool),
                          test_mask=torch.zeros(4, dtype=torch.bool)), "node")
    with pytest.raises(ConfigError, match="graph-classification"):
        FedStarClient(0, data, FedStarConfig(), ModelSpec("gin", 3, 2, "node", 8, 2, 0.0))
    with pytest.raises(ConfigError, match="graph-classification"):
        FedStarServer(FedStarConfig(), [ClientInfo(0, 4, 4)], ModelSpec("gin", 3, 2, "node", 8, 2, 0.0))


# -- real data ------------------------------------------------------------------------------------
def test_runs_through_run_on_mutag_and_learns(shared_root):
    result = run("fedstar", "MUTAG", "soft_dirichlet", 4, rounds=10, seeds=[0], root=shared_root, progress=False,
                 settings={**GIN_SETUP, "alpha": 0.5, "fold": 0})
    acc = result.per_round()["test_accuracy"]
    assert acc.iloc[-1] > acc.iloc[0] + 0.05 and acc.iloc[-1] > 0.7
    comm = result.communication()
    n_struct = (32 * 64 + 64) + 3 * (64 * 64 + 64)
    assert (comm["floats"] == n_struct).all() and len(comm) == 10 * 4 * 2        # every message: the structure encoder


@pytest.mark.gpu
def test_fedstar_runs_on_cuda():
    assert get_device().type == "cuda"
    server, clients = federation(2)
    assert next(clients[0].model.parameters()).is_cuda and server.params.is_cuda
    replies = {i: c.local_step(server.broadcast(1, [i])[i], 1) for i, c in enumerate(clients)}
    server.aggregate(1, replies)
    assert clients[0].data.items["train"][0].x.is_cuda

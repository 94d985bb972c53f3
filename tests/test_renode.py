"""Tests of fglit.algorithms.renode: the weights' properties, the conflict scores against the dense PageRank formula,
the client's weighted loss, and runs on Cora under both protocols."""
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from _device import same_run

from fglit.algorithms.renode import ReNodeClient, ReNodeConfig, ReNodeServer, conflict_scores, renode_weights
from fglit.federation import ClientInfo, ConfigError, LocalData, ModelSpec, make_config, run

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True)

pytestmark = pytest.mark.usefixtures("module_cache")     # a private fglit cache for this module


# -- the weights ---------------------------------------------------------------------------------------------------

@SETTINGS
@given(st.lists(st.integers(-5, 5), min_size=2, max_size=40), st.floats(0.0, 2.0), st.floats(0.0, 2.0))
def test_weights_lie_in_range_fall_with_the_conflict_rank_and_the_most_conflicting_gets_w_min(scores, a, b):
    w_min, w_max = min(a, b), max(a, b)
    t = torch.tensor(scores, dtype=torch.float32) / 3            # integers / 3: ties happen
    w = renode_weights(t, w_min, w_max)
    eps = 1e-5
    assert w.shape == t.shape and bool(((w >= w_min - eps) & (w <= w_max + eps)).all())
    order = torch.argsort(t, stable=True)                         # rank order: by score, ties by position
    assert bool((w[order][1:] <= w[order][:-1] + eps).all())      # monotone: a higher rank never weighs more
    assert bool((w[t < t.max()] >= w[t == t.max()].min() - eps).all())
    most = order[-1]                                              # the highest conflict (last of a tie)
    assert t[most] == t.max() and math.isclose(float(w[most]), w_min, abs_tol=eps)
    assert math.isclose(float(w[order[0]]), w_max, abs_tol=eps)


def test_weights_follow_the_cosine_by_hand():
    w = renode_weights(torch.tensor([3.0, 1.0, 2.0]), 0.2, 1.0)  # ranks 2, 0, 1
    assert torch.allclose(w, torch.tensor([0.2, 1.0, 0.6]))


# -- the conflict scores -------------------------------------------------------------------------------------------

def dense_scores(edge_index, n, labelled, labels, C, restart, form):
    "T_v from the dense PPR inverse on the undirected graph with self loops (the paper's definition)."
    A = torch.zeros(n, n, dtype=torch.float64)
    A[edge_index[0], edge_index[1]] = 1
    A = ((A + A.T) > 0).double() + torch.eye(n, dtype=torch.float64)
    d = A.sum(1).rsqrt()
    P = restart * torch.linalg.inv(torch.eye(n, dtype=torch.float64) - (1 - restart) * d[:, None] * A * d[None, :])
    counts = torch.bincount(labels, minlength=C).double()
    S = torch.zeros(n, C, dtype=torch.float64)
    S[labelled, labels] = 1 / counts[labels]
    H = (P @ P.T @ S)[labelled]
    own = H.gather(1, labels[:, None]).squeeze(1)
    k = int((counts > 0).sum())
    return H.sum(1) - own if form == "code" else (H.sum(1) - own) / max(k - 1, 1) - own


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("form", ["paper", "code"])
def test_conflict_scores_match_the_dense_pagerank(seed, form):
    g = torch.Generator().manual_seed(seed)
    n, C = 30, 4
    edge_index = torch.randint(0, n, (2, 45), generator=g)
    edge_index = edge_index[:, edge_index[0] != edge_index[1]]
    labelled = torch.randperm(n, generator=g)[:12].sort().values
    labels = torch.randint(0, 3, (12,), generator=g)           # class 3 has no labelled node
    got = conflict_scores(edge_index, n, labelled, labels, C, restart=0.2, iterations=200, form=form)
    assert torch.allclose(got.double(), dense_scores(edge_index, n, labelled, labels, C, 0.2, form), atol=1e-5)


def test_a_node_next_to_another_class_conflicts_more():
    # a star: hub 0 labelled A, leaves 1-3 labelled A, leaf 4 labelled B, and leaf 5 of A hanging off leaf 1
    edge_index = torch.tensor([[0, 0, 0, 0, 1], [1, 2, 3, 4, 5]])
    labelled, labels = torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0, 0, 0, 1, 0])
    t = conflict_scores(edge_index, 6, labelled, labels, 2)
    assert t[labelled.tolist().index(5)] < t[labelled.tolist().index(2)]     # node 5 is two hops further from class B


# -- the client ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def client0(cora_parts):
    ds, part = cora_parts
    cfg = make_config(ReNodeConfig, {"local_epochs": 1, "hidden": 16})
    spec = ModelSpec("gcn", ds.num_features, ds.num_classes, "node", cfg.hidden, cfg.layers, cfg.dropout)
    torch.manual_seed(0)
    server = ReNodeServer(cfg, [ClientInfo(0, int(part.clients[0].train_mask.sum()), part.clients[0].num_nodes)], spec)
    return server, ReNodeClient(0, LocalData(part.clients[0], "node"), cfg, spec)


def test_the_loss_is_the_weighted_mean_cross_entropy_and_the_weights_are_computed_once(client0):
    server, client = client0
    w = client.node_weights
    assert len(w) == client.data.num_train and float(w.min()) == 0.5 and float(w.max()) == 1.5
    b = client.data.train_batches()[0]
    _, logits = client.embed(client.model, b)
    ce = F.cross_entropy(logits, b.y, reduction="none")
    assert torch.allclose(F.cross_entropy(logits, b.y) + client.extra_loss(b, None, logits), (w * ce).mean(), atol=1e-6)
    reply = client.local_step(server.broadcast(1, [0])[0], 1)
    assert set(reply) == {"params", "weight"} and client.node_weights is w


def test_config_checks():
    with pytest.raises(ConfigError, match="w_min"):
        make_config(ReNodeConfig, {"w_min": 2.0, "w_max": 1.0})
    with pytest.raises(ConfigError, match="rounds > federated_rounds"):
        make_config(ReNodeConfig, {"rounds": 1})
    assert make_config(ReNodeConfig, {"rounds": 1, "protocol": "standalone"}).rounds == 1


# -- end to end ----------------------------------------------------------------------------------------------------

def test_on_cora_both_protocols_learn_and_repeat(cora_parts):
    ds, _ = cora_parts
    kw = dict(rounds=4, local_epochs=3, seeds=[0], progress=False)
    a = run("renode", ds, "louvain", 3, **kw)
    assert a.summary()["accuracy_mean"] > 0.5                        # 7 classes; the majority class is 30%
    assert same_run(a.runs[0].history, run("renode", ds, "louvain", 3, **kw).runs[0].history)
    local = run("renode", ds, "louvain", 3, settings={"protocol": "standalone"}, **kw).summary()
    assert local["bytes_up"] == 0 and local["bytes_down"] == 0 and local["accuracy_mean"] > 0.5


def test_with_unit_weights_renode_is_fedavg_ft(cora_parts):
    ds, _ = cora_parts
    kw = dict(rounds=3, local_epochs=1, seeds=[0], progress=False)
    plain = run("renode", ds, "louvain", 3, settings={"w_min": 1.0, "w_max": 1.0}, **kw).runs[0].history
    assert same_run(plain, run("fedavg_ft", ds, "louvain", 3, **kw).runs[0].history)
    assert not plain.equals(run("renode", ds, "louvain", 3, **kw).runs[0].history)

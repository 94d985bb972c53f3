"""Tests for AdaFGL (`fglit.algorithms.adafgl`, from nbs/17_adafgl.ipynb)."""
import math
import os
import subprocess

import pytest
import torch
from hypothesis import given, settings, strategies as st

from fglit.algorithms.adafgl import (AdaFGLClient, AdaFGLConfig, AdaFGLPersonal, AdaFGLServer, HopLinear, homophily_confidence,
                                     knowledge_adjacency, knowledge_edges, personal_epochs_in_round, propagated_features,
                                     signed_propagation, sparse_operand)
from fglit.federation import (ClientInfo, ConfigError, LocalData, ModelSpec, get_algorithm, make_config,
                              run)
from fglit.models import adjacency

from _node_pfl import SCRIPT, cli_run_json


pytestmark = pytest.mark.usefixtures("simulator_threads")     # conftest: the simulator's CPU thread count, as `run` uses


# -- registration and configuration ---------------------------------------------------------------
def test_registered_as_a_sums_only_node_method():
    algo = get_algorithm("adafgl")
    assert algo.client is AdaFGLClient and algo.server is AdaFGLServer and algo.config is AdaFGLConfig
    assert algo.sums_only and "ICDE 2024" in algo.paper
    c = make_config(AdaFGLConfig)
    assert (c.rounds, c.federated_rounds, c.personal_epochs, c.prop_steps, c.alpha, c.beta, c.knowledge_threshold) == (
        100, 50, 200, 3, 0.05, 0.2, 0.999)
    assert (c.lp_steps, c.lp_alpha, c.homo_layers, c.hete_layers, c.fusion, c.hidden, c.layers) == (10, 0.5, 2, 3, "hcs", 64, 2)


@pytest.mark.parametrize("bad, match", [
    ({"rounds": 1}, "federated_rounds"), ({"rounds": 10, "federated_rounds": 10}, "federated_rounds"),
    ({"federated_rounds": 0}, "federated_rounds"), ({"alpha": -0.1}, "alpha"), ({"beta": 2.0}, "beta"),
    ({"knowledge_threshold": float("nan")}, "knowledge_threshold"), ({"lp_alpha": 1.5}, "lp_alpha"),
    ({"personal_epochs": -1}, "personal_epochs"), ({"prop_steps": -1}, "prop_steps"), ({"hcs_splits": 0}, "hcs_splits"),
    ({"homo_layers": 0}, "homo_layers"), ({"personal_lr": 0.0}, "personal_lr"), ({"knowledge_weight": float("inf")}, "knowledge_weight"),
    ({"fusion": "mean"}, "fusion"), ({"max_dense_nodes": 0}, "max_dense_nodes"), ({"federated_rounds": "five"}, "federated_rounds"),
    ({"temperature": 1.0}, "unknown setting")])
def test_config_errors_name_the_setting(bad, match):
    with pytest.raises(ConfigError, match=match):
        make_config(AdaFGLConfig, bad)


def test_federated_rounds_default_to_half_and_are_recorded():
    assert make_config(AdaFGLConfig, {"rounds": 10}).federated_rounds == 5
    assert make_config(AdaFGLConfig, {"rounds": 3}).federated_rounds == 1
    assert make_config(AdaFGLConfig, {"rounds": 10, "federated_rounds": None}).federated_rounds == 5
    assert make_config(AdaFGLConfig, {"rounds": 10, "federated_rounds": 9}).federated_rounds == 9


@settings(max_examples=80, deadline=None)
@given(rounds=st.integers(2, 60), share=st.floats(0, 1), epochs=st.integers(0, 500))
def test_personal_epochs_are_spread_evenly_over_step_two(rounds, share, epochs):
    F = min(rounds - 1, max(1, int(share * rounds)))
    c = make_config(AdaFGLConfig, {"rounds": rounds, "federated_rounds": F, "personal_epochs": epochs})
    per = [personal_epochs_in_round(c, r) for r in range(1, rounds + 1)]
    assert sum(per) == epochs and all(e == 0 for e in per[:F])
    assert max(per[F:]) - min(per[F:]) <= 1 and per[F:] == sorted(per[F:], reverse=True)


# -- knowledge topology -----------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 40), C=st.integers(2, 5), block=st.integers(1, 50), threshold=st.floats(0.5, 0.9999), seed=st.integers(0, 999))
def test_knowledge_edges_match_the_dense_rule(n, C, block, threshold, seed):
    g = torch.Generator().manual_seed(seed)
    P = torch.softmax(3 * torch.randn(n, C, generator=g), 1)
    P[: n // 2] = P[0]                                         # some identical rows: similarity 1
    K = knowledge_edges(P, threshold, block_rows=block)
    Q = torch.nn.functional.normalize(P, dim=1)
    S = Q @ Q.T
    expected = (S > threshold) & ~torch.eye(n, dtype=torch.bool)
    got = torch.zeros(n, n, dtype=torch.bool)
    got[K[0], K[1]] = True
    assert torch.equal(got, expected) and K.size(1) == int(expected.sum())      # no duplicates, no self loops
    assert torch.equal(got, got.T)


def test_knowledge_adjacency_weights_and_limits():
    ei = torch.tensor([[0, 1, 2, 3], [1, 0, 3, 2]])
    K = torch.tensor([[0, 2], [2, 0]])
    assert torch.allclose(knowledge_adjacency(ei, 4, K[:, :0], 1.0).to_dense(), adjacency(ei, 4, "gcn").to_dense())
    A = knowledge_adjacency(ei, 4, K, 0.25).to_dense()
    assert torch.allclose(A, A.T) and A[0, 2] > A[0, 1] > 0 and A[1, 3] == 0
    W = knowledge_adjacency(ei, 4, K, 0.0).to_dense()
    assert W[0, 1] == 0 and W[0, 2] > 0                       # alpha = 0: the local topology is gone


# -- homophily confidence score ---------------------------------------------------------------------
def two_cliques(n=20, bipartite=False):
    "Two classes of n nodes: complete inside each class (homophilous), or complete across classes only (heterophilous)."
    y = torch.arange(2 * n) // n
    i, j = torch.meshgrid(torch.arange(2 * n), torch.arange(2 * n), indexing="ij")
    keep = (y[i] != y[j]) if bipartite else ((y[i] == y[j]) & (i != j))
    return torch.stack([i[keep], j[keep]]), y


def test_hcs_separates_homophily_from_heterophily():
    train = torch.ones(40, dtype=torch.bool)
    ei, y = two_cliques()
    assert homophily_confidence(ei, y, train, 2, splits=4, generator=torch.Generator().manual_seed(0)) == 1.0
    ei, y = two_cliques(bipartite=True)
    assert homophily_confidence(ei, y, train, 2, splits=4, generator=torch.Generator().manual_seed(0)) < 0.1
    assert homophily_confidence(ei[:, :0], y, train, 2, splits=4) == 0.0          # no edges: nothing propagates
    assert homophily_confidence(ei, y, torch.arange(40) == 3, 2) == 0.5           # one training node: no evidence
    assert homophily_confidence(ei, y, torch.zeros(40, dtype=torch.bool), 2) == 0.5


@settings(max_examples=30, deadline=None)
@given(n=st.integers(2, 60), C=st.integers(1, 5), splits=st.integers(1, 4), seed=st.integers(0, 999))
def test_hcs_is_a_fraction_and_seeded(n, C, splits, seed):
    g = torch.Generator().manual_seed(seed)
    ei = torch.randint(0, n, (2, 3 * n), generator=g)
    y = torch.randint(0, C, (n,), generator=g)
    train = torch.rand(n, generator=g) < 0.5
    a = homophily_confidence(ei, y, train, C, splits=splits, generator=torch.Generator().manual_seed(seed))
    b = homophily_confidence(ei, y, train, C, splits=splits, generator=torch.Generator().manual_seed(seed))
    assert 0.0 <= a <= 1.0 and a == b


# -- signed propagation and hop-linear layers -------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 25), seed=st.integers(0, 999))
def test_signed_propagation_rows_and_permutation_equivariance(n, seed):
    g = torch.Generator().manual_seed(seed)
    R = torch.rand(n, n, generator=g, dtype=torch.float64)
    R = (R + R.T) / 2
    pos, neg = signed_propagation(R)
    assert (pos >= 0).all() and (neg >= 0).all() and torch.allclose(pos.sum(1), torch.ones(n, dtype=torch.float64))
    assert (pos.diagonal() > 0).all() and (neg.diagonal() == 0).all()
    assert ((pos > 0) & (neg > 0)).sum() == 0                                   # a pair is one or the other
    rows = neg.sum(1)
    assert torch.allclose(rows[rows > 0], torch.ones_like(rows[rows > 0]))
    perm = torch.randperm(n, generator=g)
    p2, n2 = signed_propagation(R[perm][:, perm])
    assert torch.allclose(p2, pos[perm][:, perm]) and torch.allclose(n2, neg[perm][:, perm])


def test_signed_propagation_on_a_constant_matrix_keeps_only_self_messages():
    pos, neg = signed_propagation(torch.full((4, 4), 0.3))
    assert torch.allclose(pos, torch.eye(4)) and torch.equal(neg, torch.zeros(4, 4))
    assert torch.isfinite(signed_propagation(torch.zeros(1, 1))[0]).all()


@settings(max_examples=20, deadline=None)
@given(n=st.integers(2, 30), d=st.integers(1, 12), h=st.integers(1, 6), steps=st.integers(0, 4), dense=st.booleans(),
       seed=st.integers(0, 999))
def test_hop_linear_is_linear_on_the_concatenated_hops(n, d, h, steps, dense, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, d, generator=g) * (torch.rand(n, d, generator=g) < (0.9 if dense else 0.05))
    A = adjacency(torch.randint(0, n, (2, 3 * n), generator=g), n, "gcn")
    layer = HopLinear(d, h, steps)
    want = propagated_features(x, A, steps) @ layer.dense_weight() + layer.bias
    got = layer(sparse_operand(x), sparse_operand(A))
    assert got.shape == (n, h) and torch.allclose(got, want, atol=1e-5)
    gw, = torch.autograd.grad(got.sum(), layer.weight)
    ww, = torch.autograd.grad(want.sum(), layer.weight)
    assert torch.allclose(gw, ww, atol=1e-4)


def personal_model(n=30, d=8, C=3, fusion="hcs", hcs=0.7, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, d, generator=g)
    A = adjacency(torch.randint(0, n, (2, 4 * n), generator=g), n, "gcn")
    P = torch.softmax(torch.randn(n, C, generator=g), 1)
    links = (torch.rand(n, n, generator=g) < 0.1).float()
    return AdaFGLPersonal(x, A, P, links, hcs, 2, 16, 0.0, 2, 3, 0.2, fusion), torch.randint(0, C, (n,), generator=g)


@pytest.mark.parametrize("fusion, keys", [("hcs", {"homo", "local", "smooth", "prop"}), ("homo", {"homo"}),
                                          ("hete", {"local", "smooth", "prop"})])
def test_personal_model_branches_and_fusion(fusion, keys):
    m, y = personal_model(fusion=fusion)
    out = m()
    assert set(out) == keys and all(v.shape == (30, 3) for v in out.values())
    prob = m.probabilities(out)
    assert torch.allclose(prob.sum(1), torch.ones(30), atol=1e-5)
    loss = m.loss(out, y, torch.arange(10))
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in m.parameters())
    if fusion == "hcs":
        y_ho = (torch.softmax(out["homo"], 1) + m.knowledge) / 2
        y_he = sum(torch.softmax(out[k], 1) for k in ("local", "smooth", "prop")) / 3
        assert torch.allclose(prob, 0.7 * y_ho + 0.3 * y_he, atol=1e-6)


# -- client and server ------------------------------------------------------------------------------
# cora_parts (conftest): Cora and its 3-client Louvain partition, seed 0


def make_parties(ds, clients_data, **settings):
    cfg = make_config(AdaFGLConfig, {"rounds": 4, "federated_rounds": 2, "personal_epochs": 6, "hidden": 16, "local_epochs": 1,
                                     **settings})
    spec = ModelSpec("gcn", ds.num_features, ds.num_classes, "node", cfg.hidden, cfg.layers, cfg.dropout)
    info = [ClientInfo(i, int(c.train_mask.sum()), c.num_nodes) for i, c in enumerate(clients_data)]
    return cfg, spec, AdaFGLServer(cfg, info, spec), [AdaFGLClient(i, LocalData(c, "node"), cfg, spec) for i, c in enumerate(clients_data)]


def test_messages_of_both_steps(cora_parts):
    ds, part = cora_parts
    cfg, spec, server, clients = make_parties(ds, part.clients)
    seen = []
    for rnd in range(1, 5):
        down = server.broadcast(rnd, [0, 1, 2])
        up = {i: clients[i].local_step(down[i], rnd) for i in range(3)}
        server.aggregate(rnd, up)
        seen.append((sorted(down[0]), sorted(up[0])))
    assert seen == [(["params"], ["params", "weight"])] * 2 + [(["params"], []), ([], [])]
    assert all(c.personal is not None and 0 <= c.stats["hcs"] <= 1 for c in clients)
    assert server.shared_evaluation_message() is None and server.evaluation_message(1) == {}
    assert clients[0].evaluation_model(None) is clients[0].personal


def test_late_selected_client_still_gets_the_global_model(cora_parts):
    ds, part = cora_parts
    cfg, spec, server, clients = make_parties(ds, part.clients)
    for rnd in (1, 2):
        server.aggregate(rnd, {i: clients[i].local_step(server.broadcast(rnd, [0, 1, 2])[i], rnd) for i in range(3)})
    assert set(server.broadcast(3, [0])[0]) == {"params"}
    late = server.broadcast(4, [0, 1])
    assert late[0] == {} and set(late[1]) == {"params"} and torch.equal(late[1]["params"], server.params)


def test_bad_clients_run_without_errors(cora_parts):
    ds, part = cora_parts
    base = part.clients[0]
    no_edges = base.clone(); no_edges.edge_index = base.edge_index[:, :0]
    missing = int(base.y[base.train_mask].mode().values)
    no_class = base.clone(); no_class.train_mask = base.train_mask & (base.y != missing)
    no_train = base.clone(); no_train.train_mask = torch.zeros_like(base.train_mask)
    cfg, spec, server, clients = make_parties(ds, [no_edges, no_class, no_train], rounds=2, federated_rounds=1)
    for rnd in (1, 2):
        server.aggregate(rnd, {i: clients[i].local_step(server.broadcast(rnd, [0, 1, 2])[i], rnd) for i in range(3)})
    assert clients[0].stats["hcs"] == 0.0 and clients[0].stats["edges"] == 0
    assert clients[2].stats["train"] == 0 and clients[2].stats["hcs"] == 0.5
    for c in clients:
        with torch.no_grad():
            prob = c.node_logits(c.personal.eval())
        assert torch.isfinite(prob).all() and torch.allclose(prob.sum(1).cpu(), torch.ones(prob.size(0)), atol=1e-5)
        assert set(c.predict(c.evaluation_model(None))) == {"val", "test"}
        _, proba = c.predict_proba(c.evaluation_model(None), ("test",))["test"]       # already probabilities: not softmaxed again
        assert torch.allclose(proba, prob[c.data.masks["test"]])


def test_refuses_graph_tasks_and_oversized_clients(cora_parts):
    ds, part = cora_parts
    cfg = make_config(AdaFGLConfig)
    with pytest.raises(ConfigError, match="node-classification"):
        AdaFGLServer(cfg, [ClientInfo(0, 5, 5)], ModelSpec("gin", 5, 2, "graph", 8, 2, 0.0))
    spec = ModelSpec("gcn", ds.num_features, ds.num_classes, "node", 16, 2, 0.5)
    with pytest.raises(ConfigError, match="max_dense_nodes"):
        AdaFGLClient(0, LocalData(part.clients[0], "node"), make_config(AdaFGLConfig, {"max_dense_nodes": 10}), spec)


# -- end to end -------------------------------------------------------------------------------------
def test_short_cora_run_beats_the_majority_class(shared_root):
    r = run("adafgl", "Cora", "louvain", 3, rounds=6, seeds=[0], settings={"personal_epochs": 60}, root=shared_root, progress=False)
    s = r.summary()
    assert s["accuracy_mean"] > 0.6                                   # Cora's majority class: 30 %
    p = r.per_round().set_index("round")["test_accuracy"]
    assert p.loc[4:].max() > 0.6 and p.loc[4:].max() > p.loc[1] + 0.2  # the personalised rounds learnt
    comm = r.communication()
    assert (comm[(comm.direction == "up") & (comm["round"] > 3)].bytes == 0).all()
    assert (comm[(comm.direction == "down") & (comm["round"] == 4)].bytes > 0).all()
    assert (comm[(comm.direction == "down") & (comm["round"] > 4)].bytes == 0).all()
    assert s["communication_rounds"] == 3 and r.config["federated_rounds"] == 3


def test_runs_under_secure_aggregation_and_partial_participation(shared_root):
    r = run("adafgl", "Cora", "louvain", 3, rounds=3, seeds=[0], root=shared_root, progress=False,
            settings={"personal_epochs": 4, "hidden": 16, "secure_aggregation": True})
    assert math.isfinite(r.summary()["accuracy_mean"]) and r.summary()["privacy"]
    r = run("adafgl", "Cora", "louvain", 4, rounds=4, seeds=[0], root=shared_root, progress=False,
            settings={"personal_epochs": 4, "hidden": 16, "client_fraction": 0.5})
    assert math.isfinite(r.summary()["accuracy_mean"]) and len(r.per_client()) == 4


def test_cli_run_adafgl_json(shared_root):
    s = cli_run_json(shared_root, "adafgl", "--dataset", "Cora", "--partition", "louvain", "--clients", "5", "--rounds", "2",
                     "--set", "personal_epochs=20")         # (the default 200 of dense N x N steps: most of a minute, for a CLI check)
    assert s["algorithm"] == "adafgl" and s["rounds"] == 2 and s["config"]["federated_rounds"] == 1 and s["config"]["personal_epochs"] == 20
    assert len(s["per_client"]) == 5 and 0 < s["accuracy_mean"] <= 1 and s["bytes_up"] > 0


def test_cli_bad_setting_is_one_line_exit_2(shared_root):
    out = subprocess.run([str(SCRIPT), "run", "adafgl", "--dataset", "Cora", "--rounds", "1", "--quiet"], capture_output=True,
                         text=True, env={**os.environ, "FGLIT_DATA": str(shared_root)}, timeout=300)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and "federated_rounds" in out.stderr, out.stderr


@pytest.mark.gpu
def test_cuda_run(shared_root, monkeypatch):
    monkeypatch.setenv("FGLIT_DEVICE", "cuda")
    r = run("adafgl", "Cora", "louvain", 3, rounds=4, seeds=[0], root=shared_root, progress=False, settings={"personal_epochs": 40})
    assert r.summary()["accuracy_mean"] > 0.5

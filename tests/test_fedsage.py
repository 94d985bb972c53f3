"""Tests for FedSage+ (`fglit.algorithms.fedsage`, from nbs/18_fedsage.ipynb)."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.nn.utils import parameters_to_vector

from fglit.algorithms.fedsage import (FedSageClient, FedSageConfig, FedSageServer, NeighGen, feature_matching_loss,
                                      impair_graph, mend_graph, neighgen_losses, predicted_counts)
from fglit.federation import (ClientInfo, ConfigError, LocalData, ModelSpec, get_algorithm, make_config,
                              message_nbytes, run)

from _device import same_run
from _node_pfl import cli_run_json


pytestmark = pytest.mark.usefixtures("simulator_threads")     # conftest: the simulator's CPU thread count, as `run` uses


# -- registration and configuration ---------------------------------------------------------------
def test_registered_with_graphsage_and_the_paper_defaults():
    algo = get_algorithm("fedsage")
    assert algo.client is FedSageClient and algo.server is FedSageServer and algo.config is FedSageConfig
    assert not algo.sums_only and "NeurIPS 2021" in algo.paper
    c = make_config(FedSageConfig)
    assert (c.model, c.rounds, c.gen_rounds, c.num_pred, c.hide_portion, c.cross_weight) == ("graphsage", 100, 20, 5, 0.5, 1.0)
    assert make_config(FedSageConfig, {"rounds": 4}).gen_rounds == 1


@pytest.mark.parametrize("bad, match", [
    ({"num_pred": 0}, "num_pred"), ({"rounds": 1}, "gen_rounds"), ({"rounds": 5, "gen_rounds": 5}, "gen_rounds"),
    ({"gen_rounds": 0}, "gen_rounds"), ({"hide_portion": 1.0}, "hide_portion"), ({"hide_portion": -0.1}, "hide_portion"),
    ({"hide_portion": float("nan")}, "hide_portion"), ({"latent_dim": 0}, "latent_dim"), ({"gen_epochs": -1}, "gen_epochs"),
    ({"cross_weight": -1.0}, "cross_weight"), ({"feature_weight": float("inf")}, "feature_weight"), ({"mu": 1.0}, "unknown setting")])
def test_config_errors_name_the_setting(bad, match):
    with pytest.raises(ConfigError, match=match):
        make_config(FedSageConfig, bad)


# -- impaired graphs, feature matching, mending ---------------------------------------------------
def random_graph(n, e, d, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, d, generator=g), torch.randint(0, n, (2, e), generator=g), g


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 30), e=st.integers(0, 80), p=st.floats(0, 0.95), seed=st.integers(0, 999))
def test_impaired_graph_matches_the_dense_definition(n, e, p, seed):
    x, ei, g = random_graph(n, e, 3, seed)
    imp = impair_graph(x, ei, p, generator=g)
    kept = imp.kept
    assert kept.numel() == n - int(p * n) and torch.equal(imp.x, x[kept])
    A = torch.zeros(n, n, dtype=torch.bool)
    A[ei[0], ei[1]] = True
    A = (A | A.T) & ~torch.eye(n, dtype=torch.bool)                      # undirected, no self loops
    hidden = torch.ones(n, dtype=torch.bool); hidden[kept] = False
    assert torch.equal(imp.missing_degree, A[kept][:, hidden].sum(1).float())
    inner = torch.zeros(kept.numel(), kept.numel(), dtype=torch.bool)
    inner[imp.edge_index[0], imp.edge_index[1]] = True
    assert torch.equal(inner, A[kept][:, kept])
    v, u = imp.missing_pairs
    assert bool(hidden[u].all()) and bool(A[kept[v], u].all()) and imp.missing_pairs.size(1) == int(imp.missing_degree.sum())


def brute_force_matching(gen, x, pairs, counts):
    total = 0.0
    for v in range(gen.size(0)):
        targets = pairs[1][pairs[0] == v]
        for p in range(min(int(counts[v]), gen.size(1))):
            total += min(float((gen[v, p] - x[u]).square().mean()) for u in targets)
    return total / gen.size(0)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 12), P=st.integers(1, 4), seed=st.integers(0, 999))
def test_feature_matching_is_the_greedy_nearest_missing_neighbour(n, P, seed):
    x, ei, g = random_graph(n, 3 * n, 4, seed)
    imp = impair_graph(x, ei, 0.5, generator=g)
    gen = torch.rand(imp.kept.numel(), P, 4, generator=g, requires_grad=True)
    counts = imp.missing_degree.long()
    loss = feature_matching_loss(gen, x, imp.missing_pairs, counts)
    assert math.isclose(float(loss.detach()), brute_force_matching(gen.detach(), x, imp.missing_pairs, counts), rel_tol=1e-5, abs_tol=1e-7)
    loss.backward()
    assert torch.isfinite(gen.grad).all()
    active = torch.arange(P) < counts.clamp(max=P).unsqueeze(1)
    assert (gen.grad[~active] == 0).all()                                # slots beyond the true count pay nothing


def test_feature_matching_hand_example():
    x = torch.tensor([[0.0, 0.0], [1.0, 1.0], [0.0, 2.0]])
    pairs = torch.tensor([[0, 0], [1, 2]])                                # node 0 misses neighbours 1 and 2
    gen = torch.tensor([[[1.0, 1.0], [0.0, 2.0], [5.0, 5.0]]])
    assert float(feature_matching_loss(gen, x, pairs, torch.tensor([2]))) == 0.0   # each slot hits a true neighbour
    assert float(feature_matching_loss(gen, x, pairs, torch.tensor([7]))) == pytest.approx(((4 ** 2 + 4 ** 2) / 2))  # capped at P
    assert float(feature_matching_loss(gen, x, pairs[:, :0], torch.tensor([0]))) == 0.0


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 25), e=st.integers(0, 60), P=st.integers(1, 6), seed=st.integers(0, 999))
def test_mending_keeps_every_edge_and_adds_exactly_the_capped_count(n, e, P, seed):
    x, ei, g = random_graph(n, e, 3, seed)
    degree = torch.randn(n, generator=g) * 4                              # dGen output: any real, negative included
    generated = torch.rand(n, P, 3, generator=g)
    counts = predicted_counts(degree, P)
    assert torch.equal(counts, degree.round().clamp(0, P).long())
    xm, eim = mend_graph(x, ei, generated, counts)
    added = int(counts.sum())
    assert xm.shape == (n + added, 3) and torch.equal(xm[:n], x) and torch.equal(eim[:, : ei.size(1)], ei)
    new = eim[:, ei.size(1):]
    assert new.size(1) == 2 * added
    into_old = new[:, new[1] < n]                                          # generated -> original
    assert torch.equal(torch.bincount(into_old[1], minlength=n), counts)
    assert bool((into_old[0] >= n).all()) and torch.equal(torch.bincount(new[0][new[0] >= n] - n, minlength=added), torch.ones(added, dtype=torch.long))
    owner = into_old[1][torch.argsort(into_old[0])]
    slot = torch.arange(added) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    assert torch.equal(xm[n:], generated[owner, slot])                     # node v's first counts[v] generated features


# -- NeighGen ---------------------------------------------------------------------------------------
def two_class_graph(n=60, seed=0):
    "Two feature clusters; edges only inside a cluster."
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 2
    x = (torch.rand(n, 16, generator=g) < torch.where(y[:, None] == 0, 0.7, 0.1)).float()
    src = torch.randint(0, n, (4 * n,), generator=g)
    dst = (src + 2 * torch.randint(1, n // 2, (4 * n,), generator=g)) % n   # same parity = same class
    return x, torch.stack([src, dst]), y


def test_generator_losses_decrease_on_a_toy_graph():
    torch.manual_seed(0)
    x, ei, y = two_class_graph()
    imp = impair_graph(x, ei, 0.3, generator=torch.Generator().manual_seed(0))
    gen = NeighGen(16, latent_dim=16, gen_hidden=32, num_pred=3, dropout=0.0, noise=0.1)
    opt = torch.optim.Adam(gen.parameters(), lr=0.01)
    history = []
    for _ in range(150):
        opt.zero_grad()
        losses = neighgen_losses(gen, imp, x)
        (losses["degree"] + losses["feature"]).backward()
        opt.step()
        history.append({k: float(v.detach()) for k, v in losses.items()})
    assert history[-1]["degree"] < 0.5 * history[0]["degree"]
    assert history[-1]["feature"] < 0.5 * history[0]["feature"]
    with torch.no_grad():
        _, generated = gen.eval()(x, ei)
    # generated neighbours resemble the node's own class (the true neighbours are all same-class)
    means = torch.stack([x[y == 0].mean(0), x[y == 1].mean(0)])
    nearest = torch.cdist(generated.mean(1), means).argmin(1)
    assert (nearest == y).float().mean() > 0.9


# -- clients and server -----------------------------------------------------------------------------
# cora_parts (conftest): Cora and its 3-client Louvain partition, seed 0


def make_parties(ds, clients_data, **settings):
    cfg = make_config(FedSageConfig, {"rounds": 5, "gen_rounds": 3, "gen_epochs": 2, "hidden": 16, "latent_dim": 16,
                                      "gen_hidden": 32, "local_epochs": 1, **settings})
    spec = ModelSpec(cfg.model, ds.num_features, ds.num_classes, "node", cfg.hidden, cfg.layers, cfg.dropout)
    info = [ClientInfo(i, int(c.train_mask.sum()), c.num_nodes) for i, c in enumerate(clients_data)]
    return cfg, spec, FedSageServer(cfg, info, spec), [FedSageClient(i, LocalData(c, "node"), cfg, spec) for i, c in enumerate(clients_data)]


def play(server, clients, rounds):
    "Run full-participation rounds by hand; returns, per round, every client's (down message, up message)."
    seen = []
    for rnd in rounds:
        down = server.broadcast(rnd, list(range(len(clients))))
        up = {i: c.local_step(down[i], rnd) for i, c in enumerate(clients)}
        server.aggregate(rnd, up)
        seen.append([(down[i], up[i]) for i in range(len(clients))])
    return seen


def keys(pair):
    return sorted(pair[0]), sorted(pair[1])


def test_messages_of_both_phases_carry_parameters_and_gradients_only(cora_parts):
    torch.manual_seed(0)
    ds, part = cora_parts
    cfg, spec, server, clients = make_parties(ds, part.clients)
    seen = play(server, clients, range(1, 6))
    n_gen = parameters_to_vector(clients[0].neighgen.parameters()).numel()
    assert keys(seen[0][0]) == ([], ["neighgen"])                                    # round 1: no peers to help yet
    assert keys(seen[1][0]) == (["neighgen_1", "neighgen_2"], ["cross_grad_1", "cross_grad_2", "neighgen"])
    assert keys(seen[2][1]) == (["cross_grad"], ["neighgen"])                        # last NeighGen round: nothing for peers
    assert keys(seen[3][2]) == (["params"], ["params", "weight"]) == keys(seen[4][0])
    # every uploaded tensor of the NeighGen rounds is a parameter or gradient vector of NeighGen's size, whatever
    # the client's number of nodes: no feature row, embedding or generated feature leaves a client
    assert len({c.num_nodes for c in part.clients}) > 1
    for rnd in seen[:3]:
        for _, up in rnd:
            assert all(t.dim() == 1 and t.numel() == n_gen for t in up.values())
    assert len({message_nbytes(up) for _, up in seen[1]}) == 1
    assert all(c.mended for c in clients)


def test_server_routes_the_mean_cross_gradient_to_its_owner(cora_parts):
    torch.manual_seed(0)
    ds, part = cora_parts
    cfg, spec, server, clients = make_parties(ds, part.clients, rounds=6, gen_rounds=4)
    play(server, clients, [1])
    down = server.broadcast(2, [0, 1, 2])
    up = {i: clients[i].local_step(down[i], 2) for i in range(3)}
    direct = clients[2].cross_gradient(down[2]["neighgen_0"])    # client 2's gradient for client 0's parameters (noise reseeded)
    assert direct.shape == up[2]["cross_grad_0"].shape
    server.aggregate(2, up)
    routed = server.broadcast(3, [0])[0]["cross_grad"]
    assert torch.allclose(routed, (up[1]["cross_grad_0"] + up[2]["cross_grad_0"]) / 2)
    assert 0 not in server.pending and set(server.pending) == {1, 2}      # delivered once, the others still wait


def test_alpha_zero_exchanges_nothing_between_clients(cora_parts):
    ds, part = cora_parts
    cfg, spec, server, clients = make_parties(ds, part.clients, cross_weight=0.0)
    seen = play(server, clients, range(1, 4))
    assert all(keys(pair) == ([], ["neighgen"]) for rnd in seen for pair in rnd)


def test_mended_graph_keeps_the_client_and_scores_only_real_nodes(cora_parts):
    torch.manual_seed(0)
    ds, part = cora_parts
    cfg, spec, server, clients = make_parties(ds, part.clients[:1])
    play(server, clients, range(1, 5))
    c, orig = clients[0], part.clients[0]
    g = c.data.graph
    extra = c.mend_stats["generated"]
    assert g.num_nodes == orig.num_nodes + extra and extra <= cfg.num_pred * orig.num_nodes
    assert torch.equal(g.edge_index[:, : orig.edge_index.size(1)].cpu(), orig.edge_index)
    assert g.edge_index.size(1) == orig.edge_index.size(1) + 2 * extra
    for s in ("train", "val", "test"):
        assert int(c.data.masks[s].sum()) == int(getattr(orig, f"{s}_mask").sum()) and not c.data.masks[s][orig.num_nodes:].any()
    y, pred = c.predict(c.evaluation_model(server.evaluation_message(0)))["test"]
    assert y.numel() == int(orig.test_mask.sum())


def test_bad_clients_have_defined_behaviour(cora_parts):
    torch.manual_seed(0)
    ds, part = cora_parts
    base = part.clients[0]
    no_edges = base.clone(); no_edges.edge_index = base.edge_index[:, :0]
    no_train = base.clone(); no_train.train_mask = torch.zeros_like(base.train_mask)
    single = base.subgraph(torch.tensor([0]))
    cfg, spec, server, clients = make_parties(ds, [no_edges, no_train, single])
    play(server, clients, range(1, 6))
    assert clients[0].impaired.missing_pairs.size(1) == 0 and clients[0].losses[-1]["feature"] == 0.0
    assert "class" not in clients[1].losses[-1]                            # nothing to classify: no L_c
    assert clients[2].impaired.kept.numel() == 1                           # floor(0.5 * 1) = 0 nodes hidden
    for c in clients:
        assert c.mended and all(math.isfinite(v) for v in c.losses[-1].values())
    cfg, spec, server, clients = make_parties(ds, [base], hide_portion=0.0)   # 0 hidden nodes: L_f = 0, dGen learns 0
    play(server, clients, range(1, 4))
    assert clients[0].impaired.kept.numel() == base.num_nodes and clients[0].losses[-1]["feature"] == 0.0


def test_refuses_graph_tasks_and_secure_aggregation(cora_parts, shared_root):
    with pytest.raises(ConfigError, match="node-classification"):
        FedSageServer(make_config(FedSageConfig), [ClientInfo(0, 5, 5)], ModelSpec("gin", 5, 2, "graph", 8, 2, 0.0))
    with pytest.raises(ConfigError, match="sums_only"):
        run("fedsage", "Cora", "louvain", 3, rounds=2, root=shared_root, progress=False, settings={"secure_aggregation": True})


# -- end to end -------------------------------------------------------------------------------------
def test_short_cora_run_learns_and_is_reproducible(shared_root):
    kw = dict(rounds=5, seeds=[0], root=shared_root, progress=False,
              settings={"gen_rounds": 2, "hidden": 32, "latent_dim": 16, "gen_hidden": 32})
    a = run("fedsage", "Cora", "metis", 3, **kw)
    b = run("fedsage", "Cora", "metis", 3, **kw)
    s = a.summary()
    assert s["accuracy_mean"] > 0.5                                        # random guessing: 1/7; majority class 0.3
    assert same_run(a.per_round(), b.per_round())
    comm = a.communication()
    up1 = comm[(comm.direction == "up") & (comm["round"] == 1)].bytes
    assert (up1 > 0).all() and up1.nunique() == 1                           # NeighGen vectors: one size for all clients
    assert a.config["model"] == "graphsage" and s["communication_rounds"] == 5


def test_cli_run_fedsage_json(shared_root):
    s = cli_run_json(shared_root, "fedsage", "--dataset", "Cora", "--partition", "metis", "--clients", "3", "--rounds", "2")
    assert s["algorithm"] == "fedsage" and s["rounds"] == 2 and s["config"]["gen_rounds"] == 1
    assert len(s["per_client"]) == 3 and 0 < s["accuracy_mean"] <= 1 and s["bytes_up"] > 0


@pytest.mark.gpu
def test_cuda_run(shared_root, monkeypatch):
    monkeypatch.setenv("FGLIT_DEVICE", "cuda")
    r = run("fedsage", "Cora", "metis", 3, rounds=6, seeds=[0], root=shared_root, progress=False, settings={"gen_rounds": 2})
    assert r.summary()["accuracy_mean"] > 0.5

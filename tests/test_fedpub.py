"""Tests for Fed-PUB (`fglit.algorithms.fedpub`, from nbs/15_fedpub.ipynb)."""
import math

import pytest
import torch
import _node_pfl as node_pfl
from hypothesis import given, settings, strategies as st

from fglit.algorithms.fedpub import (FedPUBClient, FedPUBConfig, FedPUBServer, MaskedModel, fedpub_defaults,
                                     functional_embedding, personalise, random_graph, sbm_graph, similarity_weights)
from fglit.core import get_device
from fglit.federation import (ClientInfo, ConfigError, ModelSpec, flat_state, get_algorithm, load_flat_state,
                              make_config, run)

GIN = ModelSpec("gin", 5, 2, "graph", 8, 2, 0.0)
GCN = ModelSpec("gcn", 6, 3, "node", 8, 2, 0.0)
GPFL_GRID = {"alpha": 0.5, "fold": 0, "folds": 5, "model": "gin", "hidden": 64, "layers": 3, "lr": 1e-3, "weight_decay": 5e-4,
             "batch_size": 128, "selection": "last", "weighting": "plain", "local_epochs": 1}


def infos(sizes):
    return [ClientInfo(i, n, n) for i, n in enumerate(sizes)]


def toy_inputs(n=10, features=6, graphs=2):
    dev = get_device()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, features, generator=g).to(dev)
    ei = torch.randint(0, n, (2, 3 * n), generator=g).to(dev)
    return x, ei, (torch.arange(n) * graphs // n).to(dev)


# -- registration and configuration ---------------------------------------------------------------
def test_registered_needing_individual_messages():
    algo = get_algorithm("fedpub")
    assert algo.sums_only is False and algo.config is FedPUBConfig
    c = make_config(FedPUBConfig)
    assert (c.tau, c.lambda1, c.lambda2, c.hidden, c.mask, c.embedding_on, c.l1_update) == (
        10.0, 1e-3, 1e-3, 128, "weights", "client", "proximal")


def test_graph_datasets_get_the_gpfl_gin_setup():
    d = fedpub_defaults("PROTEINS", "soft_dirichlet")
    assert d["model"] == "gin" and (d["layers"], d["hidden"], d["lr"], d["batch_size"], d["local_epochs"]) == (3, 64, 1e-3, 128, 1)
    assert d["selection"] == "last" and d["weighting"] == "plain"
    assert fedpub_defaults("Cora", "louvain") == {} and fedpub_defaults("no-such-dataset", "x") == {}


@pytest.mark.parametrize("bad, match", [({"tau": -1.0}, "tau"), ({"tau": float("inf")}, "tau"), ({"lambda1": -1e-3}, "lambda1"),
                                        ({"lambda2": float("nan")}, "lambda2"), ({"mask": "bias"}, "mask"),
                                        ({"embedding_on": "both"}, "embedding_on"), ({"l1_update": "adam"}, "l1_update"), ({"random_graph_blocks": 0}, "random_graph_blocks"),
                                        ({"random_graph_p_out": -0.1}, "random_graph_p_out"), ({"graphless_model": "mlp"}, "graphless_model"),
                                        ({"temperature": 1.0}, "unknown setting")])
def test_config_errors_name_the_setting(bad, match):
    with pytest.raises(ConfigError, match=match):
        make_config(FedPUBConfig, bad)


def test_mixed_models_are_refused():
    with pytest.raises(ConfigError, match="same model"):
        FedPUBServer(make_config(FedPUBConfig), [ClientInfo(0, 5, 5), ClientInfo(1, 5, 5, GCN.replace(name="mlp", layers=1))], GCN)


# -- personalised weights -------------------------------------------------------------------------
embeddings = st.integers(1, 7).flatmap(lambda k: st.lists(
    st.lists(st.floats(-5, 5, allow_nan=False, width=32), min_size=3, max_size=3), min_size=k, max_size=k))


@settings(max_examples=60, deadline=None)
@given(H=embeddings, tau=st.floats(0, 50), seed=st.integers(0, 10_000), sized=st.booleans())
def test_weights_are_convex_and_permutation_equivariant(H, tau, seed, sized):
    H = torch.tensor(H)
    k = H.size(0)
    sizes = torch.randint(1, 100, (k,), generator=torch.Generator().manual_seed(seed)).double() if sized else None
    A = similarity_weights(H, tau, sizes)
    assert A.shape == (k, k) and A.dtype == torch.float64
    assert (A >= 0).all() and torch.allclose(A.sum(1), torch.ones(k, dtype=torch.float64))
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    B = similarity_weights(H[perm], tau, None if sizes is None else sizes[perm])
    assert torch.allclose(B, A[perm][:, perm], atol=1e-9)
    states = torch.randn(k, 4, generator=torch.Generator().manual_seed(seed + 1))
    P = personalise(A, states)
    assert (P >= states.min(0).values - 1e-5).all() and (P <= states.max(0).values + 1e-5).all()   # convex combinations


def test_weights_favour_similar_clients():
    H = torch.tensor([[1.0, 0, 0], [0.9, 0.1, 0], [0, 0, 1.0], [0, 0.1, 0.9]])
    A = similarity_weights(H, 10.0)
    assert (A[:2, :2].sum(1) > 0.99).all() and (A[2:, 2:].sum(1) > 0.99).all()
    assert (A.diagonal() >= A.max(1).values - 1e-12).all()               # a client's own model weighs most
    assert (similarity_weights(H, 20.0).diagonal() > A.diagonal()).all()  # larger tau: more self weight


def test_tau_zero_is_the_plain_mean_and_with_sizes_fedavg():
    H, states = torch.randn(5, 3), torch.randn(5, 11)
    assert torch.allclose(similarity_weights(H, 0.0), torch.full((5, 5), 0.2, dtype=torch.float64))
    assert torch.allclose(personalise(similarity_weights(H, 0.0), states), states.mean(0).expand(5, 11), atol=1e-6)
    n = torch.tensor([1.0, 2, 3, 4, 10])
    fedavg = (n[:, None] * states).sum(0) / n.sum()
    assert torch.allclose(personalise(similarity_weights(H, 0.0, n), states), fedavg.expand(5, 11), atol=1e-6)
    with pytest.raises(ValueError, match="sizes"):
        similarity_weights(H, 1.0, torch.tensor([1.0, 0, 1, 1, 1]))


def test_identical_and_zero_embeddings_give_uniform_weights():
    assert torch.allclose(similarity_weights(torch.ones(4, 3), 10.0), torch.full((4, 4), 0.25, dtype=torch.float64))
    A = similarity_weights(torch.zeros(3, 3), 10.0)
    assert torch.isfinite(A).all() and torch.allclose(A, torch.full((3, 3), 1 / 3, dtype=torch.float64))


# -- random graph and functional embedding -------------------------------------------------------
def test_sbm_graph_is_seeded_undirected_and_blockwise():
    g = sbm_graph([30, 20, 10], 0.3, 0.0, 4, seed=3, device="cpu")
    src, dst = g.edge_index
    assert g.num_nodes == 60 and g.x.shape == (60, 4) and g.batch.tolist() == [0] * 30 + [1] * 20 + [2] * 10
    assert (src != dst).all() and (g.batch[src] == g.batch[dst]).all()
    pairs = set(zip(src.tolist(), dst.tolist()))
    assert all((v, u) in pairs for u, v in pairs) and len(pairs) == src.numel()
    h = sbm_graph([30, 20, 10], 0.3, 0.0, 4, seed=3, device="cpu")
    assert torch.equal(h.edge_index, g.edge_index) and torch.equal(h.x, g.x)
    assert sbm_graph([5, 5], 1.0, 1.0, 2, device="cpu").edge_index.size(1) == 10 * 9      # complete graph
    with pytest.raises(ValueError, match="block sizes"):
        sbm_graph([3, 0], 0.5, 0.0, 2)


@pytest.mark.parametrize("spec", [GCN, GIN])
def test_functional_embedding_is_the_mean_embedding_and_keeps_the_mode(spec):
    model = spec.build().train()
    graph = random_graph(make_config(FedPUBConfig, {"random_graph_blocks": 3, "random_graph_block_size": 20}), spec.in_dim)
    h = functional_embedding(model, graph)
    assert h.shape == (spec.hidden,) and model.training
    model.eval()
    with torch.no_grad():
        assert torch.allclose(h, model.encode(graph.x, graph.edge_index, graph.batch).mean(0))


# -- masks ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", [GCN, GIN])
def test_masked_model_starts_as_the_plain_model(spec):
    model = spec.build().eval()
    keys = list(model.state_dict())
    mm = MaskedModel(model)
    x, ei, batch = toy_inputs(features=spec.in_dim)
    assert torch.equal(mm.mask_vector(), torch.ones_like(mm.mask_vector()))
    assert torch.allclose(mm(x, ei, batch), model(x, ei, batch))
    assert torch.allclose(mm.encode(x, ei, batch), model.encode(x, ei, batch))
    assert list(model.state_dict()) == keys                                   # no mask in the model's state
    assert all(dict(model.named_parameters())[n].dim() >= 2 for n in mm.names) and "head.1.weight" in mm.names
    (mm(x, ei, batch).square().sum() + mm.mask_l1()).backward()
    assert all(m.grad is not None for m in mm.masks) and all(p.grad is not None for p in model.parameters())


def test_mask_modes_and_zero_masks():
    model = GCN.build().eval()
    assert MaskedModel(model, "none").names == [] and float(MaskedModel(model, "none").mask_l1()) == 0.0
    assert MaskedModel(model, "all").names == [n for n, _ in model.named_parameters()]
    mm = MaskedModel(model)
    x, ei, _ = toy_inputs()
    with torch.no_grad():
        mm.masks[-1].zero_()
    assert torch.allclose(mm(x, ei), model.head[-1].bias.expand(10, 3))
    shared = mm.with_model(GCN.build())
    assert shared.masks[-1] is mm.masks[-1]
    with pytest.raises(ValueError, match="mask must be"):
        MaskedModel(model, "bias")


# -- client and server ----------------------------------------------------------------------------
# cora_parts (conftest): Cora and its 3-client Louvain partition, seed 0


def make_clients(ds, part, **settings):
    return node_pfl.make_clients(FedPUBConfig, FedPUBServer, FedPUBClient, ds, part, **settings)


def test_only_needed_keys_travel(cora_parts):
    ds, part = cora_parts
    cfg, spec, server, clients = make_clients(ds, part)
    down = server.broadcast(1, [0, 1, 2])
    up = {i: clients[i].local_step(down[i], 1) for i in range(3)}
    assert all(set(m) == {"params"} for m in down.values())
    assert all(set(m) == {"params", "embedding"} for m in up.values())
    assert up[0]["params"].numel() == flat_state(spec.build()).numel() and up[0]["embedding"].shape == (16,)
    server.aggregate(1, up)
    assert torch.allclose(server.weights.sum(1).cpu(), torch.ones(3, dtype=torch.float64))
    _, _, server_s, clients_s = make_clients(ds, part, embedding_on="server")
    up_s = {i: clients_s[i].local_step(server_s.broadcast(1, [i])[i], 1) for i in range(3)}
    assert all(set(m) == {"params"} for m in up_s.values())
    server_s.aggregate(1, up_s)
    assert server_s.embeddings.shape == (3, 16)


def test_l1_term_shrinks_masks_and_anchor_from_round_two(cora_parts):
    ds, part = cora_parts
    _, _, server, clients = make_clients(ds, part, lambda1=5.0, lr=0.01)
    c = clients[0]
    opt = torch.optim.Adam(c.masked.masks, lr=0.01)                          # the L1 gradient alone, through Adam
    for _ in range(3):
        opt.zero_grad(); c.masked.mask_l1().backward(); opt.step()
    assert torch.allclose(c.masked.mask_vector(), torch.full_like(c.masked.mask_vector(), 0.97), atol=1e-4)
    with torch.no_grad():
        for m in c.masked.masks: m.fill_(1.0)
        c.masked.masks[0].view(-1)[:2] = torch.tensor([0.03, -0.02])
    c.shrink_masks()                                                          # proximal step: soft threshold by lr * lambda1
    assert c.masked.masks[0].view(-1)[:2].tolist() == [0.0, 0.0] and math.isclose(c.masked.masks[1].max().item(), 0.95, rel_tol=1e-6)
    c.local_step(server.broadcast(1, [0])[0], 1)
    assert c.masked.mask_vector().max() < 0.95                                # 1 local epoch: shrink 0.05 > Adam's CE step 0.01
    assert c.anchor is None
    c.local_step(server.broadcast(2, [0])[0], 2)
    assert c.anchor is not None and torch.allclose(torch.cat([a.reshape(-1) for a in c.anchor]),
                                                   server.params[0][server.mask])


def test_single_client_and_identical_models(cora_parts):
    ds, part = cora_parts
    cfg, spec, server, clients = make_clients(ds, part)
    single = FedPUBServer(cfg, [server.clients[0]], spec)
    r = clients[0].local_step(single.broadcast(1, [0])[0], 1)
    single.aggregate(1, {0: r})
    assert single.weights.item() == 1.0 and torch.equal(single.params[0], r["params"])
    server.aggregate(1, {i: r for i in range(3)})
    assert torch.allclose(server.weights.cpu(), torch.full((3, 3), 1 / 3, dtype=torch.float64))
    assert torch.allclose(server.params, r["params"].expand(3, -1), atol=1e-6)


def test_unselected_clients_keep_their_model(cora_parts):
    ds, part = cora_parts
    _, _, server, clients = make_clients(ds, part)
    node_pfl.check_unselected_clients_keep_their_model(server, clients)


def test_global_evaluation_uses_the_clients_mask(cora_parts):
    ds, part = cora_parts
    _, _, server, clients = make_clients(ds, part, evaluation="global")
    c = clients[0]
    c.local_step(server.broadcast(1, [0])[0], 1)
    m = c.evaluation_model(server.evaluation_message(0))
    assert isinstance(m, MaskedModel) and m.masks[0] is c.masked.masks[0] and m.model is not c.model
    assert torch.equal(flat_state(m.model), server.params[0])


# -- short runs -----------------------------------------------------------------------------------
def test_short_cora_run_learns(shared_root):
    r = run("fedpub", "Cora", "louvain", 3, rounds=6, seeds=[0], settings={"hidden": 32}, root=shared_root, progress=False)
    pr = r.per_round()["test_accuracy"]
    assert pr.iloc[-1] > pr.iloc[0] + 0.05
    comm = r.communication()
    assert (comm[comm.direction == "up"].bytes > 0).all()


def test_proteins_runs_under_gpfl_grid_settings(shared_root):
    r = run("fedpub", "PROTEINS", "soft_dirichlet", 15, seeds=[0], settings={**GPFL_GRID, "rounds": 2}, root=shared_root,
            progress=False)
    assert r.config["model"] == "gin" and r.config["layers"] == 3 and r.config["rounds"] == 2
    assert 0 <= r.summary()["accuracy_mean"] <= 1 and len(r.per_client()) == 15


def test_partial_participation_and_single_client_runs(shared_root):
    r = run("fedpub", "Cora", "louvain", 4, rounds=2, seeds=[0], settings={"hidden": 16, "client_fraction": 0.5},
            root=shared_root, progress=False)
    assert r.communication().groupby("round").client.nunique().eq(2).all()
    r1 = run("fedpub", "Cora", "louvain", 1, rounds=2, seeds=[0], settings={"hidden": 16}, root=shared_root, progress=False)
    assert math.isfinite(r1.summary()["accuracy_mean"])

"""Tests for FedLoG (`fglit.algorithms.fedlog`, from nbs/11k_fedlog.ipynb)."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from fglit.algorithms.fedlog import (FedLoGClient, FedLoGConfig, FedLoGModel, FedLoGServer, class_weights, global_synthetic,
                                     head_weight, neighbour_mean)
from fglit.federation import ClientInfo, ConfigError, ModelSpec, flat_state, get_algorithm, make_config

from _device import DEV
from _node_pfl import make_clients

TINY = {"pretrain_epochs": 10, "prompt_epochs": 3, "prompt_models": 1, "prompt_hidden": 16, "synthetic_per_class": 5,
        "lr": 0.01}


def test_registered_with_the_authors_defaults_and_restrictions():
    algo = get_algorithm("fedlog")
    assert (algo.client, algo.server, algo.config) == (FedLoGClient, FedLoGServer, FedLoGConfig)
    assert "ICLR 2025" in algo.paper and not algo.takes_sums()
    c = make_config(FedLoGConfig)
    assert (c.rounds, c.local_epochs, c.lr, c.pretrain_epochs, c.prompt_epochs, c.prompt_models, c.synthetic_per_class,
            c.node_batch_size, c.head_degree, c.evaluation) == (100, 1, 1e-3, 100, 100, 20, 20, 64, 3, "global")
    assert FedLoGConfig.node_task_only and FedLoGConfig.one_model_only
    for bad in ({"head_degree": -1}, {"global_weight": -0.5}, {"model_weighting": "max"}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            make_config(FedLoGConfig, bad)
    with pytest.raises(ConfigError, match="node"):
        FedLoGServer(c, [ClientInfo(0, 5, 5)], ModelSpec("gin", 6, 3, "graph", 8, 2, 0.0))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from([0.0, 0.1, 0.5, 1.0]), min_size=6, max_size=6), st.integers(0, 2**31 - 1))
def test_property_class_weights_and_global_nodes_are_convex_mixes(shares, seed):
    s = torch.tensor(shares).view(2, 3)
    w = class_weights(s)
    assert torch.allclose(w.sum(0), torch.ones(3)) and (w >= 0).all()
    # client A's class-c nodes all equal a_c, client B's b_c: every global node of class c is w_A a_c + w_B b_c
    a, b = torch.tensor([1., 2., 3.]), torch.tensor([-4., 0., 8.])
    syn = torch.stack([a.view(3, 1, 1).expand(3, 4, 2), b.view(3, 1, 1).expand(3, 4, 2)])
    x, y = global_synthetic(syn, s, torch.Generator().manual_seed(seed))
    assert torch.allclose(x, (w[0] * a + w[1] * b)[y].unsqueeze(1).expand(-1, 2)) and y.tolist() == [0] * 4 + [1] * 4 + [2] * 4


def test_scores_mix_the_two_branches_by_degree():
    torch.manual_seed(0)
    spec = ModelSpec("gcn", 5, 3, "node", 8, 2, 0.0)
    net = FedLoGModel(spec.build(), 3, 2, 5, 1).eval()
    x, ei = torch.randn(4, 5).to(DEV), torch.tensor([[0, 1, 1, 2], [1, 0, 2, 1]], device=DEV)     # on the model's device
    alpha = head_weight(ei, 4, 0)
    with torch.no_grad():
        scores = net(x, ei, alpha)
        h = net.gnn.encode(x, ei)
        lh, lt = net.branch_log_probs(h, neighbour_mean(h, ei), net.supports())
    assert torch.allclose(scores.exp().sum(1), torch.ones(4, device=DEV), atol=1e-5)
    assert torch.allclose(scores.exp(), alpha[:, None] * lh.exp() + (1 - alpha[:, None]) * lt.exp(), atol=1e-6)


def test_prompt_generators_go_to_each_client_once():
    spec = ModelSpec("gcn", 4, 2, "node", 8, 2, 0.0)
    cfg = make_config(FedLoGConfig, {"synthetic_per_class": 2, "prompt_hidden": 4})
    server = FedLoGServer(cfg, [ClientInfo(i, 5, 5) for i in range(2)], spec)
    assert server.broadcast(1, [0, 1]) == {0: {}, 1: {}}
    gen_size = 4 * 4 + 4 + 4 * 8 + 8 + 8 * 4 + 4
    reply = lambda share, gen: {"params": torch.zeros(3), "weight": 1.0, "synthetic": torch.ones(4, 4), "shares": share,
                                "prompt": torch.full((gen_size,), gen)}
    server.aggregate(1, {0: reply(torch.tensor([1.0, 0.0]), 2.0), 1: reply(torch.tensor([0.5, 0.5]), 4.0)})
    assert torch.allclose(server.prompts[:, 0], torch.tensor([2 * 2 / 3 + 4 / 3, 4.0]))    # r^0 = (2/3, 1/3), r^1 = (0, 1)
    down = server.broadcast(2, [0, 1])
    assert all("prompts" in m and m["version"] == 1 for m in down.values())
    assert not any("prompts" in m for m in server.broadcast(3, [0, 1]).values())
    assert "prompts" in server.evaluation_message(0)


def test_one_round_learns_and_scoring_a_download_changes_nothing(cora_parts, simulator_threads):
    ds, part = cora_parts
    torch.manual_seed(0)
    cfg, spec, server, clients = make_clients(FedLoGConfig, FedLoGServer, FedLoGClient, ds, part, **TINY)
    server.aggregate(1, {c.cid: c.local_step(server.broadcast(1, [c.cid])[c.cid], 1) for c in clients})
    before = [flat_state(c.net).clone() for c in clients]
    rng, acc = torch.get_rng_state(), []
    for c in clients:
        model = c.evaluation_model(server.evaluation_message(c.cid))
        assert model is not c.net and c.evaluation_model(server.evaluation_message(c.cid)) is model   # cached per version
        acc.append(c.evaluate(model, ds.num_classes)["test"]["accuracy"])
        assert c.evaluation_model(None) is c.net
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(flat_state(c.net), b) for c, b in zip(clients, before))
    assert sum(acc) / 3 > 0.5                                                                  # 7 classes: chance ~0.3
    c = clients[0]                           # later rounds: the prompt generators come once, then the kept ones serve
    c.local_step(server.broadcast(2, [0])[0], 2)
    assert c.prompts is not None and "prompts" not in server.broadcast(3, [0])[0]
    c.local_step(server.broadcast(3, [0])[0], 3)
    assert not torch.equal(flat_state(c.net), before[0])

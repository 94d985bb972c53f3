"""Tests for GHOST (`fglit.algorithms.ghost`, from nbs/11i_ghost.ipynb)."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from fglit.algorithms.ghost import (GhostClient, GhostConfig, GhostServer, ProxyGenerator, RetentionPenalty, dense_adjacency,
                                    feature_loss, fgw_loss, fgw_plan, flat_parameters, scale_importance, sinkhorn,
                                    topology_importance)
from fglit.algorithms.datafree import synthetic_graph
from _device import DEV, same_run
from fglit.algorithms.oneshot import OneShotClient, OneShotServer
from fglit.federation import ClientInfo, ConfigError, ModelSpec, flat_state, get_algorithm, make_config, run

QUICK = {"proxy_epochs": 4, "hidden": 16, "fgw_iters": 3, "pseudo_graphs": 2, "server_steps": 2}


def test_registered_one_shot_node_only_with_the_codes_defaults():
    algo = get_algorithm("ghost")
    assert algo.client is GhostClient and algo.server is GhostServer and algo.config is GhostConfig and algo.sums_only is False
    assert issubclass(GhostClient, OneShotClient) and issubclass(GhostServer, OneShotServer) and "ICML 2025" in algo.paper
    assert GhostConfig.node_task_only and GhostConfig.one_model_only
    c = make_config(GhostConfig)
    assert (c.rounds, c.local_epochs, c.proxy_epochs, c.proxy_lr, c.noise_dim, c.kl_weight, c.fgw_weight, c.fgw_alpha) == (1, 0, 100, 5e-3, 64, 0.05, 0.1, 0.5)
    assert (c.knn, c.pseudo_graphs, c.server_steps, c.server_lr, c.retention_weight, c.weight_decay) == (5, 3, 5, 0.01, 1.0, 4e-4)
    assert (c.pseudo_labels, c.importance_at, c.importance_scale) == ("uniform", "before", "max")


@pytest.mark.parametrize("bad, match", [({"knn": 0}, "knn"), ({"fgw_alpha": 1.1}, "fgw_alpha"), ({"fgw_epsilon": 0.0}, "fgw_epsilon"),
                                        ({"proxy_dropout": 1.0}, "proxy_dropout"), ({"importance_scale": "sum"}, "importance_scale"),
                                        ({"pseudo_labels": "x"}, "pseudo_labels"), ({"importance_at": "during"}, "importance_at"),
                                        ({"finetune_epochs": 2, "rounds": 3}, "evaluation")])
def test_config_errors_name_the_setting(bad, match):
    with pytest.raises(ConfigError, match=match):
        make_config(GhostConfig, bad)


def test_server_refuses_graph_tasks():
    with pytest.raises(ConfigError, match="node"):
        GhostServer(make_config(GhostConfig), [ClientInfo(0, 5, 5)], ModelSpec("gin", 6, 3, "graph", 8, 2, 0.0))


@settings(max_examples=15, deadline=None)
@given(st.permutations(list(range(6))), st.integers(0, 2**16))
def test_property_fgw_matches_a_relabelled_copy_and_costs_nothing(perm, seed):
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(6, 3, generator=g)
    adj = torch.triu((torch.rand(6, 6, generator=g) < 0.5).float(), 1)
    adj = adj + adj.T
    perm = torch.tensor(perm)
    plan = fgw_plan(adj, adj[perm][:, perm], torch.cdist(feats, feats[perm]) ** 2, 0.5, epsilon=0.005, iters=10)
    assert torch.equal(plan.argmax(1), torch.argsort(perm))                 # node a of the original is node perm^-1(a) of the copy
    assert fgw_loss(adj, adj[perm][:, perm], feats, feats[perm], 0.5, epsilon=0.005) < 1e-2
    assert torch.allclose(plan.sum(0), torch.full((6,), 1 / 6), atol=1e-4)


def test_sinkhorn_marginals_and_feature_loss_hand_values():
    cost = torch.rand(5, 3, generator=torch.Generator().manual_seed(0)) * 1e4     # large costs: the row-shifted kernel keeps it finite
    plan = sinkhorn(cost, 0.05 * float(cost.mean()))                                # the scale fgw_plan uses
    assert torch.isfinite(plan).all() and torch.allclose(plan.sum(1), torch.full((5,), 0.2), atol=1e-4)
    assert torch.allclose(plan.sum(0), torch.full((3,), 1 / 3), atol=1e-5)
    x = torch.tensor([[1., 2.], [3., 0.]])
    assert feature_loss(x, x, 1.0).abs() < 1e-6 and torch.isclose(feature_loss(-x, x, 0.0), torch.tensor(2.0))
    a = dense_adjacency(torch.tensor([[0, 1, 3], [1, 0, 2]]), 4, torch.tensor([0, 1, 2]))   # edge 3->2 leaves with node 3
    assert a.tolist() == [[0., 1., 0.], [1., 0., 0.], [0., 0., 0.]]


def test_retention_penalty_is_the_sum_over_anchors_and_its_gradient():
    torch.manual_seed(1)
    omegas, anchors = torch.rand(4, 7), torch.randn(4, 7)
    pen = RetentionPenalty(7)
    for o, a in zip(omegas, anchors): pen.add(o, a)
    theta = torch.randn(7, requires_grad=True)
    direct = (omegas * (theta - anchors) ** 2).sum()
    assert torch.isclose(pen(theta), direct, rtol=1e-5)
    g, = torch.autograd.grad(pen(theta), theta)
    assert torch.allclose(g, (2 * omegas * (theta - anchors)).sum(0).detach(), atol=1e-5)


def test_importance_leaves_the_head_free_and_scales():
    torch.manual_seed(0)
    model = ModelSpec("gcn", 6, 3, "node", 5, 2, 0.0).build()
    x = torch.randn(12, 6).to(DEV)                                  # on the model's device
    imp = topology_importance(model, x, synthetic_graph(x, 3))
    head = sum(p.numel() for p in model.head.parameters())
    assert imp.numel() == flat_parameters(model).numel() and (imp >= 0).all() and imp[-head:].sum() == 0 and imp[:-head].sum() > 0
    assert scale_importance(imp, "max").max() == 1 and abs(float(scale_importance(imp, "mean").mean()) - 1.0) < 1e-6
    assert torch.equal(scale_importance(imp, "raw"), imp)


def test_short_cora_run_uploads_a_proxy_learns_and_repeats(shared_root):
    seen = []
    kw = dict(rounds=2, seeds=[0], root=shared_root, progress=False,
              settings={**QUICK, "finetune_epochs": 2, "evaluation": "local"})
    a = run("ghost", "Cora", "louvain", 3, callback=lambda rnd, srv, cl: seen.append((list(srv.history), [c.proxy_history for c in cl])), **kw)
    b = run("ghost", "Cora", "louvain", 3, **kw)
    assert same_run(a.runs[0].history, b.runs[0].history)
    s = a.summary()
    # chance is 1/7; seeds 0-7 on the CPU gave 0.30 to 0.51 at these settings (CUDA draws other numbers: another seed, in effect)
    assert math.isfinite(s["accuracy_mean"]) and s["accuracy_mean"] > 0.25 and s["communication_rounds"] == 1
    proxy = flat_state(ProxyGenerator(64, 7, 1433)).numel()
    comm = a.communication()
    up, down = comm[comm.direction == "up"], comm[comm.direction == "down"]
    assert up[up["round"] == 1].floats.eq(proxy + 7).all() and up[up["round"] == 2].floats.eq(0).all()
    params = flat_state(ModelSpec("gcn", 1433, 7, "node", 16, 2, 0.5).build()).numel()
    assert down[down["round"] == 2].floats.eq(params).all() and down[down["round"] == 1].floats.eq(0).all()
    history, proxies = seen[-1]
    assert [h["client"] for h in history] == [0, 0, 1, 1, 2, 2] and all(len(p) == 4 for p in proxies)

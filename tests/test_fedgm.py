"""Tests for FedGM (`fglit.algorithms.fedgm`, from nbs/11n_fedgm.ipynb)."""
import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings, strategies as st

from fglit.algorithms.fedgm import (FedGMClient, FedGMConfig, FedGMServer, class_gradients, gradient_distance, initial_features,
                                    matching_loss, synthetic_class_sizes)
from _device import DEV, same_run
from fglit.algorithms.oneshot import OneShotClient, OneShotServer
from fglit.federation import ClientInfo, ConfigError, ModelSpec, flat_state, get_algorithm, make_config, run

QUICK = {"condense_steps": 3, "server_epochs": 30, "hidden": 16}


def test_registered_one_shot_node_only_with_the_codes_defaults():
    algo = get_algorithm("fedgm")
    assert algo.client is FedGMClient and algo.server is FedGMServer and algo.config is FedGMConfig and algo.sums_only is False
    assert issubclass(FedGMClient, OneShotClient) and issubclass(FedGMServer, OneShotServer) and "IJCAI 2025" in algo.paper
    assert FedGMConfig.node_task_only and FedGMConfig.one_model_only
    c = make_config(FedGMConfig)
    assert (c.rounds, c.local_epochs, c.reduction_rate, c.condense_steps, c.feature_lr, c.distance, c.knn, c.keep, c.server_epochs) == (
        1, 0, 0.84, 1000, 0.01, "mse", 3, "best", 600)


@pytest.mark.parametrize("bad, match", [({"reduction_rate": 0.0}, "reduction_rate"), ({"reduction_rate": 1.01}, "reduction_rate"),
                                        ({"distance": "l2"}, "distance"), ({"knn": -1}, "knn"), ({"keep": "x"}, "keep"),
                                        ({"condense_steps": -1}, "condense_steps"), ({"finetune_epochs": 1}, "rounds")])
def test_config_errors_name_the_setting(bad, match):
    with pytest.raises(ConfigError, match=match):
        make_config(FedGMConfig, bad)


def test_server_refuses_graph_tasks():
    with pytest.raises(ConfigError, match="node"):
        FedGMServer(make_config(FedGMConfig), [ClientInfo(0, 5, 5)], ModelSpec("gin", 6, 3, "graph", 8, 2, 0.0))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=8), st.floats(0.01, 1.0))
def test_property_class_sizes_keep_the_total_and_the_classes(counts, rate):
    counts = torch.tensor(counts)
    sizes = synthetic_class_sizes(counts, rate)
    assert int(sizes.sum()) == math.floor(float(torch.tensor(float(counts.sum()), dtype=torch.float64) * rate))
    assert (sizes >= 0).all() and (sizes[counts == 0] == 0).all()
    assert ((sizes - torch.floor(counts.double() * rate).long()) != 0).sum() <= 1     # only the largest class takes the remainder


def test_initial_features_copy_training_nodes_of_the_same_class():
    torch.manual_seed(0)
    y = torch.tensor([0, 1, 0, 1, 2, 2, 0, 1])
    train = torch.tensor([True, True, True, False, True, True, False, True])
    x = torch.arange(8.).view(8, 1)
    xs, ys = initial_features(x, y, train, torch.tensor([3, 1, 2]))
    src = xs.view(-1).long()
    assert ys.tolist() == [0, 0, 0, 1, 2, 2] and torch.equal(y[src], ys) and train[src].all()
    assert len(set(src[ys == 2].tolist())) == 2                            # distinct while the class has enough nodes


def test_matching_loss_is_zero_for_the_real_training_set_and_grows_when_moved():
    torch.manual_seed(0)
    model = ModelSpec("gcn", 5, 3, "node", 4, 2, 0.5).build()
    x, y = torch.randn(9, 5).to(DEV), torch.tensor([0, 1, 2] * 3, device=DEV)            # on the model's device
    no_edges, train, classes = torch.empty(2, 0, dtype=torch.long, device=DEV), torch.tensor([True] * 6 + [False] * 3, device=DEV), torch.tensor([0, 1, 2], device=DEV)
    real = SimpleNamespace(x=x, edge_index=no_edges, y=y)
    w = torch.ones(3, device=DEV)
    for kind in ("mse", "cos"):
        assert matching_loss(model, real, train, x[train].clone(), y[train], no_edges, classes, w, kind).abs() < 1e-6
        moved = x[train].clone().requires_grad_()
        loss = matching_loss(model, real, train, moved + torch.tensor([1.0, 0, 0, 0, 0], device=DEV), y[train], no_edges, classes, w, kind)
        g, = torch.autograd.grad(loss, moved)
        assert loss > 1e-6 and g.abs().sum() > 0                          # differentiable in the synthetic features
    assert class_gradients(model, x, no_edges, y, train, classes).shape == (3, sum(p.numel() for p in model.parameters()))
    assert torch.allclose(gradient_distance(torch.tensor([[3., 4.]]), torch.zeros(1, 2)), torch.tensor([25.]))


def test_short_cora_run_uploads_condensed_graphs_learns_and_repeats(shared_root):
    seen = []
    kw = dict(rounds=2, seeds=[0], root=shared_root, progress=False, settings={**QUICK, "finetune_epochs": 2, "evaluation": "local"})
    a = run("fedgm", "Cora", "louvain", 3, callback=lambda rnd, srv, cl: seen.append((list(srv.history), [c.condense_history for c in cl])), **kw)
    b = run("fedgm", "Cora", "louvain", 3, **kw)
    assert same_run(a.runs[0].history, b.runs[0].history)
    s = a.summary()
    assert math.isfinite(s["accuracy_mean"]) and s["accuracy_mean"] > 0.5 and s["communication_rounds"] == 1   # chance: 1/7
    comm = a.communication()
    up, down = comm[comm.direction == "up"], comm[comm.direction == "down"]
    assert (up[up["round"] == 1].floats % 1433 == 0).all() and up[up["round"] == 1].floats.sum() == 1433 * seen[-1][0][0]["nodes"]
    params = flat_state(ModelSpec("gcn", 1433, 7, "node", 16, 2, 0.5).build()).numel()
    assert down[down["round"] == 2].floats.eq(params).all() and up[up["round"] == 2].floats.eq(0).all()
    history, condensing = seen[-1]
    assert history[0]["nodes"] == sum(int(0.84 * 181) for _ in range(3)) and all(len(h) == 3 for h in condensing)

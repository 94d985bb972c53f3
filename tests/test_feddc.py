"""Tests for FedDC (`fglit.algorithms.feddc`, from nbs/10a_feddc.ipynb): the drift penalty, the drift and upload,
the server's aggregation (also from summed replies, as secure aggregation delivers them), end-to-end runs."""
import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch_geometric.data import Data

from _device import DEV, same_run

from fglit.algorithms.fedavg import ScaffoldClient, ScaffoldServer
from fglit.algorithms.feddc import FedDCClient, FedDCConfig, FedDCServer, drift_penalty, parameter_slots
from fglit.federation import ClientInfo, ConfigError, LocalData, ModelSpec, flat_state, get_algorithm, make_config, run

F64 = torch.float64


def toy_graph(n=12, features=3, seed=0):
    "A ring of `n` nodes, two classes, 8 training nodes."
    g = torch.Generator().manual_seed(seed)
    ring = torch.arange(n)
    edges = torch.cat([torch.stack([ring, (ring + 1) % n]), torch.stack([(ring + 1) % n, ring])], 1)
    return Data(x=torch.randn(n, features, generator=g), edge_index=edges, y=ring % 2, train_mask=ring < 8,
                val_mask=(ring >= 8) & (ring < 10), test_mask=ring >= 10)


def params_of(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


# -- registration and configuration ---------------------------------------------------------------
def test_registered_as_scaffold_with_a_drift_and_the_papers_alpha():
    algo = get_algorithm("feddc")
    assert algo.client is FedDCClient and algo.server is FedDCServer and algo.config is FedDCConfig and "CVPR 2022" in algo.paper
    assert issubclass(FedDCClient, ScaffoldClient) and issubclass(FedDCServer, ScaffoldServer)
    assert algo.takes_sums() and algo.sums.weighted == ("params",) and algo.sums.weight == "weight"
    c = make_config(FedDCConfig)
    assert (c.alpha, c.control_update, c.optimizer, c.lr, c.local_epochs) == (0.01, "gradient", "adam", 0.01, 3)
    assert FedDCConfig.one_model_only and FedDCConfig.logits_only and not FedDCConfig.node_task_only
    assert vars(FedDCClient).get("stacked") is None            # no stacked form: it must not inherit SCAFFOLD's


@pytest.mark.parametrize("bad, match", [({"alpha": -0.1}, "alpha"), ({"alpha": float("nan")}, "alpha"),
                                        ({"control_update": "momentum"}, "control_update"), ({"global_lr": 1.0}, "unknown setting"),
                                        ({"graphless_model": "mlp"}, "same model")])
def test_config_errors_name_the_setting(bad, match):
    with pytest.raises(ConfigError, match=match):
        make_config(FedDCConfig, bad)


# -- the penalty and the parameter slots ----------------------------------------------------------
@settings(max_examples=40, deadline=None, derandomize=True)
@given(shapes=st.lists(st.lists(st.integers(1, 4), min_size=1, max_size=3), min_size=1, max_size=4),
       alpha=st.floats(0.0, 2.0), seed=st.integers(0, 2**16))
def test_penalty_value_and_gradient(shapes, alpha, seed):
    "(alpha/2) sum ||theta + h - w||^2 and its gradient alpha (theta + h - w), for any list of parameter shapes; 0 when theta + h = w."
    g = torch.Generator().manual_seed(seed)
    theta = [torch.randn(s, generator=g, dtype=F64, requires_grad=True) for s in shapes]
    h = [torch.randn(s, generator=g, dtype=F64) for s in shapes]
    w = [torch.randn(s, generator=g, dtype=F64) for s in shapes]
    value = drift_penalty(theta, h, w, alpha)
    value.backward()
    gap = [t.detach() + d - a for t, d, a in zip(theta, h, w)]
    assert torch.isclose(value.detach(), torch.tensor(alpha / 2 * sum(float((x ** 2).sum()) for x in gap), dtype=F64))
    for t, x in zip(theta, gap):
        assert torch.allclose(t.grad, alpha * x)
    assert drift_penalty([a - d for a, d in zip(w, h)], h, w, alpha) < 1e-25


@pytest.mark.parametrize("name, layers", [("gcn", 2), ("gin", 2), ("gamlp", 2), ("mlp", 1)])
def test_parameter_slots_pick_the_parameters_out_of_the_flat_state(name, layers):
    model = ModelSpec(name, 5, 3, "node", 8, layers, 0.0).build()
    slots, flat = parameter_slots(model), flat_state(model)
    assert torch.equal(flat[slots], params_of(model)) and slots.unique().numel() == slots.numel()
    buffers = sum(t.numel() for k, t in model.state_dict().items() if t.is_floating_point()) - sum(p.numel() for p in model.parameters())
    assert flat.numel() - slots.numel() == buffers and (buffers > 0) == (name == "gin")     # GIN's batch norms hold buffers


# -- client and server ------------------------------------------------------------------------------
def test_two_rounds_of_one_client_follow_the_equations():
    "h = theta - w after round 1; the upload is theta + h on the parameters, the buffers as trained; round 2's penalty gradient at w is alpha h."
    torch.manual_seed(0)
    spec = ModelSpec("gin", 3, 2, "node", 4, 1, 0.0)
    cfg = make_config(FedDCConfig, {"alpha": 0.3, "local_epochs": 2})
    client, server = FedDCClient(0, LocalData(toy_graph(), "node"), cfg, spec), FedDCServer(cfg, [ClientInfo(0, 8, 12)], spec)
    w = server.params.clone()
    up = client.local_step(server.broadcast(1, [0])[0], 1)
    assert set(up) == {"params", "delta_control", "weight"}
    theta = params_of(client.model)
    assert torch.allclose(client.drift, theta - w[client.slots])
    assert torch.allclose(up["params"][client.slots], 2 * theta - w[client.slots])          # round 1: theta + (theta - w)
    rest = torch.ones_like(up["params"], dtype=torch.bool); rest[client.slots] = False
    assert torch.equal(up["params"][rest], flat_state(client.model)[rest])
    server.aggregate(1, {0: up})
    client.receive(server.broadcast(2, [0])[0])
    client.model.zero_grad()
    client.extra_loss(None, None, None).backward()
    assert torch.allclose(torch.cat([p.grad.reshape(-1) for p in client.model.parameters()]), 0.3 * client.drift, atol=1e-6)
    assert make_config(FedDCConfig, {"alpha": 0.0}).alpha == 0 and \
        FedDCClient(1, LocalData(toy_graph(), "node"), make_config(FedDCConfig, {"alpha": 0.0}), spec).extra_loss(None, None, None) is None


def test_drift_accumulates_over_rounds_and_the_correction_is_scaffolds():
    "h after R rounds is the sum of the R local updates; the gradient correction the client applies is c - c_k."
    torch.manual_seed(1)
    spec = ModelSpec("gcn", 3, 2, "node", 4, 2, 0.0)
    cfg = make_config(FedDCConfig, {"local_epochs": 1})
    client, server = FedDCClient(0, LocalData(toy_graph(), "node"), cfg, spec), FedDCServer(cfg, [ClientInfo(0, 8, 12), ClientInfo(1, 8, 12)], spec)
    total = torch.zeros_like(client.drift)
    for rnd in (1, 2, 3):
        message = server.broadcast(rnd, [0])[0]
        old_control = client.control.clone()
        up = client.local_step(message, rnd)
        assert torch.allclose(torch.cat([c.reshape(-1) for c in client.corrections]), message["control"] - old_control)
        total += params_of(client.model) - message["params"][client.slots]
        server.aggregate(rnd, {0: up})
        assert torch.allclose(server.control, client.control / 2)                          # c moves by sum(delta c_k) / N, N = 2
    assert torch.allclose(client.drift, total, atol=1e-6)


def test_server_averages_the_uploads_and_accepts_their_sum():
    "w = training-size-weighted mean of theta_k + h_k; c += sum(delta c_k)/N; the same from one summed reply (secure aggregation)."
    spec = ModelSpec("gcn", 3, 2, "node", 4, 2, 0.0)
    cfg = make_config(FedDCConfig)
    infos = [ClientInfo(i, n, n) for i, n in enumerate((2, 6, 4))]
    a, b = FedDCServer(cfg, infos, spec), FedDCServer(cfg, infos, spec)
    g = torch.Generator().manual_seed(3)
    P = a.params.numel()
    replies = {i: {"params": torch.randn(P, generator=g).to(DEV), "delta_control": torch.randn(a.control.numel(), generator=g).to(DEV),
                   "weight": float(n)} for i, n in ((0, 2), (2, 4))}                        # on the servers' device                        # client 1 sat this round out
    a.aggregate(1, replies)
    expected = (2 * replies[0]["params"] + 4 * replies[2]["params"]) / 6
    assert torch.allclose(a.params, expected) and torch.allclose(a.control, (replies[0]["delta_control"] + replies[2]["delta_control"]) / 3)
    summed = {"params": expected, "delta_control": replies[0]["delta_control"] + replies[2]["delta_control"], "weight": 6.0}
    b.aggregate(1, {0: summed})
    assert torch.allclose(b.params, a.params) and torch.allclose(b.control, a.control)


# -- end to end ---------------------------------------------------------------------------------------
def test_cora_learns_and_repeats(cora_parts):
    ds, parts = cora_parts
    kw = dict(rounds=2, local_epochs=2, seeds=[0], progress=False, settings={"hidden": 16})
    first = run("feddc", ds, parts, **kw)
    assert first.summary()["accuracy_mean"] > 2 / ds.num_classes                    # well above chance (1/7)
    again = run("feddc", ds, parts, **kw)
    assert same_run(first.runs[0].history, again.runs[0].history)
    other = run("feddc", ds, parts, **{**kw, "settings": {"hidden": 16, "alpha": 1.0}})
    assert not first.runs[0].history.equals(other.runs[0].history)                  # alpha reaches the training


def test_option_two_with_sgd_runs_and_the_upload_is_twice_fedavgs_bytes(cora_parts):
    ds, parts = cora_parts
    kw = dict(rounds=1, local_epochs=1, seeds=[0], progress=False)
    dc = run("feddc", ds, parts, settings={"hidden": 16, "optimizer": "sgd", "lr": 0.1, "control_update": "difference"}, **kw)
    avg = run("fedavg", ds, parts, settings={"hidden": 16}, **kw)
    up = lambda r: r.communication().query("direction == 'up'")["floats"].sum()
    assert up(dc) == 2 * up(avg)                                                    # weights and a control-variate change
    assert 0 <= dc.summary()["accuracy_mean"] <= 1

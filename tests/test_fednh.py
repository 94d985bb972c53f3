"""Tests of fglit.algorithms.fednh: the cosine prototype head, the uniform initialisation, the smoothing update,
the client's upload, the server's sums and end-to-end runs on Cora."""
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch import nn

from _device import DEV, same_run

from fglit.algorithms.fednh import (CosinePrototypeHead, FedNHClient, FedNHConfig, FedNHServer, PrototypeHeadModel,
                                    max_pairwise_cosine, orthogonal_prototypes, prototype_head_model, smooth_prototypes,
                                    uniform_prototypes)
from fglit.federation import ClientInfo, LocalData, ModelSpec, flat_state, make_config, run
from fglit.own_model import ModuleAdapter

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True)


pytestmark = pytest.mark.usefixtures("module_cache")     # a private fglit cache for this module


# -- the head ------------------------------------------------------------------------------------------------------

def test_head_is_scaled_cosine_and_only_the_body_travels():
    config = FedNHConfig(scale_init=3.0)
    model = prototype_head_model(ModelSpec("gcn", 6, 4, "node", 5, 2, 0.5), config)
    protos = F.normalize(torch.randn(4, 5), dim=1).to(DEV)
    model.head.prototypes.copy_(protos)
    emb = torch.randn(8, 5, device=DEV)
    model.eval()
    assert torch.allclose(model.head(emb), 3.0 * F.normalize(emb, dim=1) @ protos.T, atol=1e-6)
    assert model.head.dropout.p == 0.5                                  # the standard head's dropout is kept
    state = model.state_dict()
    assert "head.prototypes" not in state and not any(k.startswith("model.head") for k in state)
    assert flat_state(model).numel() == sum(p.numel() for p in model.model.encoder.parameters()) + 1      # + s
    fixed = prototype_head_model(ModelSpec("gcn", 6, 4, "node", 5, 2, 0.5), FedNHConfig(learn_scale=False, scale_init=30.0))
    assert "head.scale" not in fixed.state_dict() and float(fixed.head.scale) == 30.0


def test_head_replacement_works_for_a_model_of_your_own():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.out = nn.Linear(6, 5), nn.Linear(5, 3)
        def forward(self, x, edge_index):
            return self.out(torch.relu(self.body(x)))
    torch.manual_seed(0)
    net = Net()
    adapter = ModuleAdapter(net, "node")
    x, ei = torch.randn(4, 6), torch.zeros(2, 0, dtype=torch.long)
    expected = torch.relu(net.body(x))
    model = PrototypeHeadModel(adapter, CosinePrototypeHead(3, adapter.embedding_dim))
    assert model.embedding_dim == 5 and torch.allclose(model.encode(x, ei), expected)
    model.head.prototypes.copy_(torch.eye(3, 5))
    assert torch.allclose(model(x, ei), F.normalize(expected, dim=1)[:, :3])
    assert not any("out" in k for k in model.state_dict())              # the old head is gone


# -- initialisation and smoothing ----------------------------------------------------------------------------------

@pytest.mark.parametrize("C, d", [(7, 64), (7, 16), (3, 2), (10, 3), (40, 16)])
def test_uniform_prototypes_are_spread_and_seeded(C, d):
    u = uniform_prototypes(C, d, seed=4)
    random = F.normalize(torch.randn(C, d, generator=torch.Generator().manual_seed(4)), dim=1)
    assert torch.allclose(u.norm(dim=1), torch.ones(C), atol=1e-6)
    assert max_pairwise_cosine(u) < max_pairwise_cosine(random) - 0.1
    if C <= d + 1:
        assert max_pairwise_cosine(u) == pytest.approx(-1 / (C - 1), abs=0.02)    # the regular simplex
    assert torch.equal(u, uniform_prototypes(C, d, seed=4)) and not torch.equal(u, uniform_prototypes(C, d, seed=5))
    o = orthogonal_prototypes(C, d, seed=1)
    assert torch.allclose(o.norm(dim=1), torch.ones(C), atol=1e-6)
    if C <= d:
        assert max_pairwise_cosine(o) == pytest.approx(0.0, abs=1e-5)


def test_smoothing_by_hand():
    w = torch.tensor([[1., 0.], [0., 1.]])
    new = smooth_prototypes(w, torch.tensor([[0., 5.], [3., 4.]]), torch.tensor([True, True]), 0.9)
    assert torch.allclose(new[0], torch.tensor([0.9, 0.1]) / math.sqrt(0.82))
    v = torch.tensor([0.1 * 0.6, 0.9 + 0.1 * 0.8])                      # 0.9 (0, 1) + 0.1 (0.6, 0.8)
    assert torch.allclose(new[1], v / v.norm())


@SETTINGS
@given(st.integers(1, 6), st.integers(2, 6), st.floats(0.0, 1.0), st.integers(0, 2**31 - 1))
def test_smoothing_properties(C, d, rho, seed):
    g = torch.Generator().manual_seed(seed)
    w = F.normalize(torch.randn(C, d, generator=g, dtype=torch.float64), dim=1)
    means = torch.randn(C, d, generator=g, dtype=torch.float64) * 3
    seen = torch.rand(C, generator=g) > 0.3
    new = smooth_prototypes(w, means, seen, rho)
    assert torch.allclose(new.norm(dim=1), torch.ones(C, dtype=torch.float64))
    assert torch.equal(new[~seen], w[~seen])                            # classes nobody held keep their prototype
    target = F.normalize(means, dim=1)
    before, after = (w * target).sum(1), (new * target).sum(1)
    assert bool((after[seen] >= before[seen] - 1e-9).all())             # seen prototypes move towards their class mean
    if rho == 1.0: assert torch.allclose(new, w)


# -- client and server ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cora(shared_root):
    from fglit.data import load_dataset
    from fglit.partition import partition
    ds = load_dataset("Cora", shared_root)
    return ds, partition(ds, "louvain", 3, seed=0)


def test_client_keeps_the_prototypes_fixed_and_uploads_normalised_sums(cora):
    ds, part = cora
    config = make_config(FedNHConfig, {"model": "gcn", "local_epochs": 2})
    spec = ModelSpec("gcn", ds.num_features, ds.num_classes, "node", config.hidden, config.layers, config.dropout)
    torch.manual_seed(0)
    server = FedNHServer(config, [ClientInfo(0, 1, 1)], spec)
    client = FedNHClient(0, LocalData(part.clients[0], "node"), config, spec)
    down = server.broadcast(1, [0])[0]
    msg = client.local_step(down, 1)
    assert set(msg) == {"params", "weight", "sums", "counts"} and msg["params"].shape == server.params.shape
    assert torch.equal(client.model.head.prototypes, server.protos)     # local training leaves the prototypes alone
    assert not torch.equal(msg["params"], down["params"])               # ... and moves the body
    data = part.clients[0].clone().to(DEV)
    client.model.eval()
    with torch.no_grad():
        emb = F.normalize(client.model.encode(data.x, data.edge_index)[data.train_mask], dim=1)
    y = data.y[data.train_mask]
    assert torch.equal(msg["counts"], torch.bincount(y, minlength=ds.num_classes).float())
    assert torch.allclose(msg["sums"], torch.zeros_like(msg["sums"]).index_add_(0, y, emb), atol=1e-4)
    # the official code's variant: each class mean normalised, times the count
    client.config.client_prototypes = "normalised"
    alt = client.reply()
    keep = alt["counts"] > 0
    assert torch.allclose(alt["sums"][keep].norm(dim=1), alt["counts"][keep], rtol=1e-5)


def test_server_smooths_towards_the_count_weighted_mean_of_sums():
    spec, config = ModelSpec("mlp", 5, 3, "node", 4, 2, 0.0), FedNHConfig(smoothing=0.8, init_steps=50)
    server = FedNHServer(config, [ClientInfo(i, 1, 1) for i in range(2)], spec)
    start = server.protos.clone()
    g = torch.Generator().manual_seed(0)
    sums = [torch.randn(3, 4, generator=g).to(DEV) for _ in range(2)]
    counts = [torch.tensor([2., 0., 0.], device=DEV), torch.tensor([1., 3., 0.], device=DEV)]
    params = [server.params + 1, server.params + 4]
    server.aggregate(1, {i: {"params": params[i], "weight": w, "sums": sums[i], "counts": counts[i]} for i, w in enumerate([1.0, 3.0])})
    assert torch.allclose(server.params, params[0] * 0.25 + params[1] * 0.75)                     # FedAvg's mean
    mean = (sums[0] + sums[1]) / torch.tensor([3., 3., 1.], device=DEV).unsqueeze(1)
    expected = F.normalize(0.8 * start + 0.2 * F.normalize(mean, dim=1), dim=1)
    assert torch.allclose(server.protos[:2], expected[:2], atol=1e-6) and torch.equal(server.protos[2], start[2])
    # what secure aggregation delivers (one summed reply) gives the same prototypes
    again = FedNHServer(config, [ClientInfo(i, 1, 1) for i in range(2)], spec)
    again.aggregate(1, {0: {"params": params[0] * 0.25 + params[1] * 0.75, "weight": 4.0, "sums": sums[0] + sums[1], "counts": counts[0] + counts[1]}})
    assert torch.allclose(again.protos, server.protos, atol=1e-6)


# -- end to end ----------------------------------------------------------------------------------------------------

def test_two_rounds_on_cora_learn_and_repeat(cora):
    ds, _ = cora
    kw = dict(rounds=2, local_epochs=3, seeds=[0], progress=False)
    a = run("fednh", ds, "louvain", 3, **kw)
    assert a.summary()["accuracy_mean"] > 0.5                           # 7 classes; the majority class is 30%
    assert same_run(a.runs[0].history, run("fednh", ds, "louvain", 3, **kw).runs[0].history)


def test_secure_aggregation_gives_the_same_run(cora):
    ds, _ = cora
    kw = dict(rounds=2, local_epochs=1, seeds=[0], progress=False)
    clear = run("fednh", ds, "louvain", 3, **kw).runs[0].per_round()
    secure = run("fednh", ds, "louvain", 3, settings={"secure_aggregation": True}, **kw).runs[0].per_round()
    assert (clear.test_accuracy - secure.test_accuracy).abs().max() < 1e-6

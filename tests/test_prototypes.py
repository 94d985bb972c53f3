"""Tests of fglit.algorithms.prototypes: FedProto's sum aggregation and upload, FedTGP's margin and loss, end-to-end runs."""
import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from _device import DEV, same_bytes, same_run

from fglit.algorithms.prototypes import (FedProtoClient, FedProtoConfig, FedProtoServer, FedTGPClient, FedTGPConfig,
                                         FedTGPServer, adaptive_margin, aggregate_prototypes, margin_contrastive_loss,
                                         prototype_loss)
from fglit.federation import (ClientInfo, LocalData, ModelSpec, encode_message, get_algorithm, make_config,
                              message_floats, message_nbytes, run)

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True)
CORA = dict(partition="louvain", clients=10, settings={"mode": "pack"})
MUTAG = dict(partition="dirichlet", clients=3, settings={"alpha": 1.0})


pytestmark = pytest.mark.usefixtures("module_cache")     # a private fglit cache for this module


@pytest.fixture(scope="module")
def cora(shared_root):
    from fglit.data import load_dataset
    from fglit.partition import partition
    ds = load_dataset("Cora", shared_root)
    return ds, partition(ds, "louvain", 10, seed=0, mode="pack")


def small_spec(num_classes=3, dim=4):
    return ModelSpec("mlp", 5, num_classes, "node", dim, 2, 0.0)


def run_on(algo, dataset, case, root, rounds=2, seed=0, **extra):
    return run(algo, dataset, case["partition"], case["clients"], rounds=rounds, local_epochs=1, seeds=[seed],
               settings={**case["settings"], **extra}, root=root, progress=False)


# -- FedProto: aggregation ---------------------------------------------------------------------------------------

@st.composite
def client_statistics(draw):
    "Per-client prototypes and integer counts; some classes missing at some clients (count 0), some at all."
    k, c, d = draw(st.integers(1, 5)), draw(st.integers(1, 6)), draw(st.integers(1, 8))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    protos = rng.normal(0, 3, (k, c, d))
    counts = rng.integers(1, 50, (k, c)) * (rng.random((k, c)) > draw(st.sampled_from([0.0, 0.3, 0.7])))
    return protos, counts


@SETTINGS
@given(client_statistics())
def test_aggregation_is_count_weighted_mean(stats):
    protos, counts = stats
    k, c, d = protos.shape
    sums = [torch.tensor(p * n[:, None], dtype=torch.float32) for p, n in zip(protos, counts)]
    cnts = [torch.tensor(n, dtype=torch.float32) for n in counts]
    server = FedProtoServer(FedProtoConfig(), [ClientInfo(i, 1, 1) for i in range(k)], small_spec(c, d))
    server.aggregate(1, {i: {"sums": s, "counts": n} for i, (s, n) in enumerate(zip(sums, cnts))})
    total = counts.sum(0)
    for cls in range(c):
        assert bool(server.mask[cls]) == (total[cls] > 0)
        if total[cls] > 0:
            expected = sum(counts[i, cls] * protos[i, cls] for i in range(k)) / total[cls]
            assert np.allclose(server.protos[cls].numpy(), expected, rtol=1e-4, atol=1e-4)
        else:
            assert torch.all(server.protos[cls] == 0)
    # the server needs only the sums: aggregating the summed statistics of all clients gives the same result
    one, mask = aggregate_prototypes([torch.stack(sums).sum(0)], [torch.stack(cnts).sum(0)])
    assert torch.allclose(one, server.protos) and torch.equal(mask, server.mask)


def test_prototype_loss_is_masked_mean_squared_error():
    emb = torch.tensor([[1., 2.], [3., 4.], [0., 0.]])
    y = torch.tensor([0, 1, 2])
    protos = torch.tensor([[0., 0.], [3., 2.], [5., 5.]])
    mask = torch.tensor([True, True, False])
    # items 0 and 1 have a prototype: squared distances 5 and 4, over 2 items x 2 dimensions
    assert math.isclose(float(prototype_loss(emb, y, protos, mask)), (5 + 4) / 4)
    assert prototype_loss(emb, y, protos, torch.zeros(3, dtype=torch.bool)) is None


# -- FedProto and FedTGP: what a client uploads -------------------------------------------------------------------

def make_client(cls, config_cls, cora, cid=0, **settings):
    ds, part = cora
    config = make_config(config_cls, {"model": "gcn", "local_epochs": 1, **settings})
    spec = ModelSpec("gcn", ds.num_features, ds.num_classes, "node", config.hidden, config.layers, config.dropout)
    torch.manual_seed(0)
    return cls(cid, LocalData(part.clients[cid], "node"), config, spec), spec, config


def test_fedproto_upload_is_only_class_sums_and_counts(cora):
    ds, part = cora
    client, spec, config = make_client(FedProtoClient, FedProtoConfig, cora)
    server = FedProtoServer(config, [ClientInfo(0, client.data.num_train, 1)], spec)
    msg = client.local_step(server.broadcast(1, [0])[0], 1)
    C, d = ds.num_classes, config.hidden
    assert set(msg) == {"sums", "counts"}
    assert msg["sums"].shape == (C, d) and msg["counts"].shape == (C,)
    # the statistics are those of the trained model, in eval mode, over the client's training nodes
    data = part.clients[0].clone().to(DEV)     # a copy: PyG's Data.to moves in place
    client.model.eval()
    with torch.no_grad():
        emb = client.model.encode(data.x, data.edge_index)[data.train_mask]
    y = data.y[data.train_mask]
    assert torch.equal(msg["counts"], torch.bincount(y, minlength=C).float())
    assert torch.allclose(msg["sums"], torch.zeros(C, d, device=DEV).index_add_(0, y, emb), atol=1e-4)
    # bytes: C x d sums and C counts as float32, after an 8-byte length and a small JSON header
    buf = encode_message(msg)
    head = int.from_bytes(buf[:8], "little")
    assert set(json.loads(buf[8:8 + head])) == {"sums", "counts"}
    assert message_nbytes(msg) == len(buf) == 8 + head + (C * d + C) * 4 and head < 200
    assert message_floats(msg) == C * d + C


def test_fedtgp_uploads_means_of_the_same_statistics(cora):
    proto_client, *_ = make_client(FedProtoClient, FedProtoConfig, cora)
    tgp_client, _, config = make_client(FedTGPClient, FedTGPConfig, cora)
    empty = {"protos": torch.zeros(7, config.hidden, device=DEV), "mask": torch.zeros(7, dtype=torch.bool, device=DEV)}
    torch.manual_seed(5); a = proto_client.local_step(empty, 1)
    torch.manual_seed(5); b = tgp_client.local_step(empty, 1)
    assert set(b) == {"protos", "mask"} and b["mask"].dtype == torch.bool
    assert torch.equal(b["mask"], a["counts"] > 0)
    m = b["mask"]
    assert torch.allclose(b["protos"][m], a["sums"][m] / a["counts"][m].unsqueeze(1))
    assert torch.all(b["protos"][~m] == 0)


def test_client_adds_the_prototype_term_only_with_prototypes(cora):
    client, spec, config = make_client(FedProtoClient, FedProtoConfig, cora, lam=2.5)
    b = client.data.train_batches()[0]
    emb, logits = client.embed(client.model, b)
    client.receive({"protos": torch.zeros(7, config.hidden, device=DEV), "mask": torch.zeros(7, dtype=torch.bool, device=DEV)})
    assert client.extra_loss(b, emb, logits) is None
    protos = torch.randn(7, config.hidden).to(DEV)
    mask = torch.tensor([True, False, True, True, False, True, True], device=DEV)
    client.receive({"protos": protos, "mask": mask})
    keep = mask[b.y]
    expected = 2.5 * ((emb[keep] - protos[b.y[keep]]) ** 2).sum() / (keep.sum() * config.hidden)
    assert torch.allclose(client.extra_loss(b, emb, logits), expected)


# -- FedTGP: margin and loss --------------------------------------------------------------------------------------

def brute_force_margin(protos, mask, tau):
    centres = {}
    for c in range(protos.shape[1]):
        rows = [protos[k, c] for k in range(protos.shape[0]) if mask[k, c]]
        if rows:
            centres[c] = np.mean(rows, axis=0)
    if len(centres) < 2:
        return tau
    nearest = [min(np.linalg.norm(centres[a] - centres[b]) for b in centres if b != a) for a in centres]
    return min(max(nearest), tau)


def test_margin_is_largest_nearest_centre_distance_capped():
    line = torch.tensor([[[0., 0.], [1., 0.], [10., 0.]]])
    full = torch.ones(1, 3, dtype=torch.bool)
    assert adaptive_margin(line, full, 100.0) == pytest.approx(9.0)      # not 10, the largest pairwise distance
    assert adaptive_margin(line, full, 4.0) == 4.0
    assert adaptive_margin(line, torch.tensor([[True, False, False]]), 7.0) == 7.0


@SETTINGS
@given(client_statistics(), st.sampled_from([0.5, 3.0, 100.0]))
def test_margin_matches_brute_force(stats, tau):
    protos, counts = stats
    mask = counts > 0
    got = adaptive_margin(torch.tensor(protos, dtype=torch.float64), torch.tensor(mask), tau)
    assert got == pytest.approx(brute_force_margin(protos, mask, tau), rel=1e-9, abs=1e-9)


def test_fedtgp_server_uses_the_margin_and_trains_prototypes():
    torch.manual_seed(0)
    spec, config = small_spec(3, 4), FedTGPConfig(server_epochs=30, margin_threshold=100.0)
    server = FedTGPServer(config, [ClientInfo(i, 1, 1) for i in range(2)], spec)
    protos = (torch.randn(2, 3, 4) * 3).to(DEV)
    mask = torch.tensor([[True, True, False], [True, False, False]], device=DEV)
    before = server.generator().detach()
    server.aggregate(1, {0: {"protos": protos[0], "mask": mask[0]}, 1: {"protos": protos[1], "mask": mask[1]}})
    assert server.margin == pytest.approx(brute_force_margin(protos.cpu().numpy(), mask.cpu().numpy(), 100.0), rel=1e-5)
    assert server.mask.tolist() == [True, True, False]
    assert not torch.allclose(server.protos, before) and torch.equal(server.protos, server.generator().detach())
    assert not server.protos.requires_grad


def test_margin_contrastive_loss_formula():
    torch.manual_seed(1)
    points, gp, labels, delta = torch.randn(5, 3), torch.randn(4, 3), torch.tensor([0, 3, 1, 1, 2]), 0.7
    total = 0.0
    for p, c in zip(points, labels):
        d = torch.linalg.norm(gp - p, dim=1)
        pos = torch.exp(-(d[c] + delta))
        total += -torch.log(pos / (pos + torch.exp(-d).sum() - torch.exp(-d[c])))
    assert torch.allclose(margin_contrastive_loss(points, labels, gp, delta), total / 5, atol=1e-5)


# -- end to end -----------------------------------------------------------------------------------------------------

def test_registered():
    assert get_algorithm("fedproto").sums_only and not get_algorithm("fedtgp").sums_only
    assert get_algorithm("FedTGP").config is FedTGPConfig


@pytest.mark.parametrize("algo", ["fedproto", "fedtgp"])
@pytest.mark.parametrize("dataset,case", [("Cora", CORA), ("MUTAG", MUTAG)])
def test_two_rounds_end_to_end(algo, dataset, case, shared_root):
    r = run_on(algo, dataset, case, shared_root)
    s = r.summary()
    assert 0.0 <= s["accuracy_mean"] <= 1.0 and r.per_round()["round"].tolist() == [1, 2]
    comm = r.communication()
    up = comm[comm.direction == "up"]
    assert len(up) == 2 * case["clients"] and (up["bytes"] > 0).all()
    # every upload has the same size: C x d floats (+ C counts or a C-byte mask) and a small header
    C, d = (7, 64) if dataset == "Cora" else (2, 64)
    tensors = (C * d + C) * 4 if algo == "fedproto" else C * d * 4 + C
    assert up["bytes"].nunique() == 1 and tensors < up["bytes"].iloc[0] < tensors + 200
    assert s["bytes_down"] == 2 * case["clients"] * comm[comm.direction == "down"]["bytes"].iloc[0]


@pytest.mark.parametrize("algo", ["fedproto", "fedtgp"])
def test_cora_learns(algo, shared_root):
    # majority class of each client's training nodes scores 0.53 on this partition; chance is 1/7
    r = run_on(algo, "Cora", CORA, shared_root, rounds=20)
    assert r.summary()["accuracy_mean"] > 0.7


@pytest.mark.parametrize("algo", ["fedproto", "fedtgp"])
def test_same_seed_same_result(algo, shared_root):
    a, b = (run_on(algo, "MUTAG", MUTAG, shared_root, rounds=3) for _ in range(2))
    assert same_run(a.runs[0].history, b.runs[0].history) and same_bytes(a.communication(), b.communication())
    c = run_on(algo, "MUTAG", MUTAG, shared_root, rounds=3, seed=1)
    assert not a.per_round().equals(c.per_round())


def test_fedtgp_shares_fedproto_client(shared_root):
    # identical first round (no prototypes yet, same initial client models), different afterwards
    p, t = (run_on(a, "Cora", CORA, shared_root, rounds=2) for a in ("fedproto", "fedtgp"))
    pp, tt = p.per_round().set_index("round"), t.per_round().set_index("round")
    assert pp.loc[1].equals(tt.loc[1]) and not pp.loc[2].equals(tt.loc[2])


def test_nearest_prototype_inference(shared_root):
    head = run_on("fedproto", "Cora", CORA, shared_root, rounds=3)
    proto = run_on("fedproto", "Cora", CORA, shared_root, rounds=3, inference="prototype")
    h, p = head.per_round().set_index("round"), proto.per_round().set_index("round")
    assert h.loc[1].equals(p.loc[1])                      # no prototypes yet: the head decides
    assert not h.loc[3].equals(p.loc[3]) and p.loc[3, "test_accuracy"] > 0.5

"""Tests of fglit.algorithms.feddistill: per-label average logits from sums (the paper's equal-weight, leave-one-out form and the
count-weighted option), the distillation term, the client's upload and end-to-end runs (secure aggregation included)."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from _device import DEV, same_run

from fglit.algorithms.feddistill import (FedDistillClient, FedDistillConfig, FedDistillServer, distillation_loss,
                                         distillation_targets)
from fglit.federation import ClientInfo, LocalData, ModelSpec, class_sums, get_algorithm, make_config, run
from fglit.fl.messages import SumSpec

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True)
QUICK = dict(local_epochs=1, seeds=[0], progress=False)


def spec_of(C):
    return ModelSpec("mlp", 5, C, "node", 8, 2, 0.0)


@st.composite
def items_split_into_clients(draw):
    "Logits and labels of n items, each item assigned to one of K clients (some clients may hold no item or miss labels)."
    n, C, K = draw(st.integers(1, 40)), draw(st.integers(2, 6)), draw(st.integers(1, 5))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    logits = torch.tensor(rng.normal(0, 3, (n, C)), dtype=torch.float64)
    labels = torch.tensor(rng.integers(0, C, n))
    owner = torch.tensor(rng.integers(0, K, n))
    return logits, labels, owner, C, K


ITEMS = FedDistillConfig(aggregation="items")


def aggregate(logits, labels, owner, C, K, config=FedDistillConfig()):
    "Each client's upload (its local averages and held labels, or under `items` its sums and counts, as `reply` makes them), summed by the server."
    server = FedDistillServer(config, [ClientInfo(k, 1, 1) for k in range(K)], spec_of(C))
    uploads = {}
    for k in range(K):
        s, n = class_sums(logits[owner == k], labels[owner == k], C)
        if config.aggregation == "clients":
            s, n = distillation_targets(s, n)
            n = n.to(s.dtype)
        uploads[k] = {"logit_sums": s.to(DEV), "counts": n.to(DEV)}
    server.aggregate(1, uploads)
    return server, uploads


@SETTINGS
@given(items_split_into_clients())
def test_items_average_is_the_mean_over_all_items_whatever_the_split(case):
    logits, labels, owner, C, K = case
    server, _ = aggregate(logits, labels, owner, C, K, ITEMS)
    targets, mask = server.global_logits
    for y in range(C):
        held = labels == y
        assert bool(mask[y]) == bool(held.any())
        expected = logits[held].mean(0) if held.any() else torch.zeros(C, dtype=torch.float64)
        assert np.allclose(targets[y].double().cpu().numpy(), expected.numpy(), atol=1e-4)
    # one client holding everything gives the same averages
    one, _ = aggregate(logits, labels, torch.zeros_like(owner), C, 1, ITEMS)
    assert torch.allclose(one.global_logits[0], targets, atol=1e-4) and torch.equal(one.global_logits[1], mask)


@SETTINGS
@given(items_split_into_clients())
def test_items_leave_one_out_is_the_mean_over_the_other_clients_items(case):
    logits, labels, owner, C, K = case
    server, uploads = aggregate(logits, labels, owner, C, K, ITEMS)
    for k in range(K):
        t, m = distillation_targets(server.logit_sums, server.counts, uploads[k]["logit_sums"], uploads[k]["counts"])
        for y in range(C):
            held = (labels == y) & (owner != k)
            assert bool(m[y]) == bool(held.any())
            if held.any():
                assert np.allclose(t[y].double().cpu().numpy(), logits[held].mean(0).numpy(), atol=1e-4)


@SETTINGS
@given(items_split_into_clients())
def test_default_is_the_equal_weight_mean_of_local_means(case):
    logits, labels, owner, C, K = case
    server, _ = aggregate(logits, labels, owner, C, K)
    targets, mask = server.global_logits
    for y in range(C):
        means = [logits[(owner == k) & (labels == y)].mean(0) for k in range(K) if bool(((owner == k) & (labels == y)).any())]
        assert bool(mask[y]) == bool(means)
        if means:
            assert np.allclose(targets[y].double().cpu().numpy(), torch.stack(means).mean(0).numpy(), atol=1e-4)


@SETTINGS
@given(items_split_into_clients())
def test_default_leave_one_out_is_the_equal_weight_mean_of_the_other_clients_means(case):
    # the paper's (sum_j F_j - F_i) / (M - 1), over the clients holding the label; client i subtracts its own upload
    logits, labels, owner, C, K = case
    server, uploads = aggregate(logits, labels, owner, C, K)
    for k in range(K):
        t, m = distillation_targets(server.logit_sums, server.counts, uploads[k]["logit_sums"], uploads[k]["counts"])
        for y in range(C):
            others = [logits[(owner == j) & (labels == y)].mean(0) for j in range(K) if j != k and bool(((owner == j) & (labels == y)).any())]
            assert bool(m[y]) == bool(others)
            if others:
                assert np.allclose(t[y].double().cpu().numpy(), torch.stack(others).mean(0).numpy(), atol=1e-4)


def test_distillation_loss_by_hand():
    s, y = torch.tensor([[0., 0.], [5., -5.]]), torch.tensor([0, 1])
    t, m = torch.tensor([[math.log(3), 0.], [0., 0.]]), torch.tensor([True, False])
    assert distillation_loss(s, y, t, m).item() == pytest.approx(0.75 * math.log(1.5) + 0.25 * math.log(0.5), rel=1e-6)
    assert distillation_loss(s, y, t, m, "mse").item() == pytest.approx(math.log(3) ** 2 / 2, rel=1e-6)
    assert distillation_loss(s, y, t, torch.tensor([False, False])) is None
    with pytest.raises(ValueError, match="distill_loss"):
        distillation_loss(s, y, t, m, "l1")


@SETTINGS
@given(st.integers(2, 6), st.integers(1, 8), st.sampled_from([0.5, 1.0, 3.0]), st.integers(0, 2**31 - 1))
def test_kl_term_has_the_cross_entropy_gradient(C, n, T, seed):
    # the paper's term is the cross-entropy to softmax(target); the KL differs by the target's entropy only
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(n, C, generator=g, dtype=torch.float64, requires_grad=True)
    t, y = torch.randn(C, C, generator=g, dtype=torch.float64), torch.randint(0, C, (n,), generator=g)
    kl = distillation_loss(s, y, t, torch.ones(C, dtype=torch.bool), temperature=T)
    p = torch.softmax(t[y] / T, -1)
    ce = -(p * torch.log_softmax(s / T, -1)).sum(-1).mean() * T * T
    entropy = -(p * torch.log(p)).sum(-1).mean() * T * T
    assert torch.allclose(kl, ce - entropy)
    (g_kl,), (g_ce,) = torch.autograd.grad(kl, s), torch.autograd.grad(ce, s)
    assert torch.allclose(g_kl, g_ce) and kl.item() >= -1e-12


# -- the client ----------------------------------------------------------------------------------------------------

def make_client(cora_parts, cid=0, **settings):
    ds, parts = cora_parts
    config = make_config(FedDistillConfig, {"local_epochs": 1, "hidden": 16, **settings})
    spec = ModelSpec("gcn", ds.num_features, ds.num_classes, "node", config.hidden, config.layers, config.dropout)
    torch.manual_seed(0)
    return FedDistillClient(cid, LocalData(parts.clients[cid], "node"), config, spec), config, spec


def test_trained_items_upload_is_the_trained_models_logit_sums_and_counts(cora_parts):
    client, config, spec = make_client(cora_parts, statistics="trained", aggregation="items")
    msg = client.local_step({}, 1)
    assert set(msg) == {"logit_sums", "counts"} and msg["logit_sums"].shape == (7, 7) and msg["counts"].shape == (7,)
    g, train = client.data.graph, client.data.masks["train"]
    client.model.eval()
    with torch.no_grad():
        logits = client.model(g.x, g.edge_index)[train]
    assert torch.equal(msg["counts"], torch.bincount(g.y[train], minlength=7).float())
    assert torch.allclose(msg["logit_sums"], torch.zeros(7, 7, device=DEV).index_add_(0, g.y[train], logits), atol=1e-4)


def recorded_round(client):
    "One local step of `client` in round 1, with the logits and labels of each training step it took."
    seen, original = [], client.extra_loss
    client.extra_loss = lambda b, emb, logits: (seen.append((logits.detach().clone(), b.y)), original(b, emb, logits))[1]
    return client.local_step({}, 1), seen


def test_default_upload_is_the_mean_of_every_training_steps_logits_and_the_labels_held(cora_parts):
    client, *_ = make_client(cora_parts, local_epochs=3)            # dropout on: each step's logits differ
    msg, seen = recorded_round(client)
    L, Y = torch.cat([l for l, _ in seen]), torch.cat([y for _, y in seen])
    held = torch.bincount(Y, minlength=7) > 0
    means = torch.stack([L[Y == y].mean(0) if held[y] else L.new_zeros(7) for y in range(7)])
    assert set(msg) == {"logit_sums", "counts"} and len(seen) == 3
    assert torch.equal(msg["counts"], held.float()) and torch.allclose(msg["logit_sums"], means, atol=1e-4)
    assert not torch.allclose(seen[0][0], seen[1][0])                 # the training steps' own logits, not one model's
    assert client.sent[2] == 1 and torch.equal(client.sent[0], msg["logit_sums"]) and client.running is None


def test_training_statistics_sum_every_step_under_items(cora_parts):
    client, *_ = make_client(cora_parts, local_epochs=3, aggregation="items", dropout=0.0)
    msg, seen = recorded_round(client)
    sums = sum(class_sums(l, y, 7)[0] for l, y in seen)
    assert len(seen) == 3 and torch.allclose(msg["logit_sums"], sums, atol=1e-4)
    assert torch.equal(msg["counts"], 3 * torch.bincount(seen[0][1], minlength=7).float())


@pytest.mark.parametrize("aggregation", ["clients", "items"])
def test_client_term_and_leave_one_out_subtraction(cora_parts, aggregation):
    client, config, _ = make_client(cora_parts, distill_weight=2.5, aggregation=aggregation)
    b = client.data.train_batches()[0]
    emb, logits = client.embed(client.model, b)
    client.receive({})
    assert client.extra_loss(b, emb, logits) is None                     # round 1: nothing to distil towards
    own_sums, own_counts = torch.randn(7, 7, device=DEV), torch.tensor([3., 0., 2., 1., 0., 4., 1.], device=DEV)
    totals = {"logit_sums": own_sums + 2 * torch.ones(7, 7, device=DEV), "counts": own_counts + torch.tensor([2., 2., 0., 2., 0., 2., 2.], device=DEV)}
    client.sent, client.rnd = (own_sums, own_counts, 4), 5
    client.receive({**totals, "round": 4})                                # totals it contributed to: its upload comes out
    assert client.target_mask.tolist() == [True, True, False, True, False, True, True]
    assert torch.allclose(client.targets[client.target_mask], torch.ones(5, 7, device=DEV))
    expected = 2.5 * distillation_loss(logits, b.y, client.targets, client.target_mask)
    assert torch.allclose(client.extra_loss(b, emb, logits), expected)
    client.receive({**totals, "round": 3})                                # older totals: nothing to subtract
    assert client.target_mask.tolist() == [True, True, True, True, False, True, True]


def test_without_leave_one_out_the_target_includes_the_client(cora_parts):
    client, *_ = make_client(cora_parts, leave_one_out=False)
    own_sums, own_counts = torch.randn(7, 7, device=DEV), torch.tensor([1., 0., 1., 1., 0., 1., 1.], device=DEV)
    totals = {"logit_sums": own_sums + 1, "counts": own_counts + 1, "round": 4}
    client.sent, client.rnd = (own_sums, own_counts, 4), 5
    client.receive(totals)
    assert client.target_mask.all() and torch.allclose(client.targets, (own_sums + 1) / (own_counts + 1).unsqueeze(1))


# -- end to end ----------------------------------------------------------------------------------------------------

def test_registered_as_a_sums_only_algorithm():
    algo = get_algorithm("feddistill")
    assert algo.sums_only is True and algo.sums == SumSpec() and algo.config is FedDistillConfig and "Jeong" in algo.paper
    c = make_config(FedDistillConfig)
    assert (c.distill_weight, c.distill_loss, c.temperature, c.aggregation, c.leave_one_out, c.statistics, c.evaluation) == \
        (1.0, "kl", 1.0, "clients", True, "training", "local")          # the paper's Algorithm 1


def test_cora_learns_and_repeats(shared_root):
    kw = dict(rounds=3, root=shared_root, **{**QUICK, "local_epochs": 3})
    a, b = run("feddistill", "Cora", "louvain", 3, **kw), run("feddistill", "Cora", "louvain", 3, **kw)
    assert a.summary()["accuracy_mean"] > 0.6 and same_run(a.runs[0].history, b.runs[0].history)      # chance is 1/7
    up = a.communication().query("direction == 'up'")
    assert (up["bytes"] < 56 * 4 + 200).all() and (up["floats"] == 56).all()


def test_weight_zero_is_standalone_and_weight_changes_it(shared_root):
    kw = dict(rounds=2, root=shared_root, **QUICK)
    alone = run("standalone", "Cora", "louvain", 3, **kw).runs[0].history
    silent = run("feddistill", "Cora", "louvain", 3, settings={"distill_weight": 0.0}, **kw).runs[0].history
    mse = run("feddistill", "Cora", "louvain", 3, settings={"distill_loss": "mse"}, **kw).runs[0].history
    silent_items = run("feddistill", "Cora", "louvain", 3, **kw,
                       settings={"distill_weight": 0.0, "aggregation": "items", "leave_one_out": False, "statistics": "trained"}).runs[0].history
    assert same_run(silent, alone) and same_run(silent_items, alone) and not mse.equals(alone)


@pytest.mark.parametrize("settings", [{}, {"aggregation": "items", "leave_one_out": False, "statistics": "trained"}])
def test_secure_aggregation_gives_the_same_scores(shared_root, settings):
    # the server needs only sums; each client takes its own upload out of the unmasked totals itself
    kw = dict(rounds=3, root=shared_root, **QUICK)
    plain = run("feddistill", "Cora", "louvain", 3, settings=settings, **kw).runs[0].history
    secure = run("feddistill", "Cora", "louvain", 3, settings={**settings, "secure_aggregation": True}, **kw).runs[0].history
    num = plain.select_dtypes("number").columns
    assert np.allclose(plain[num].to_numpy(float), secure[num].to_numpy(float), atol=1e-3)

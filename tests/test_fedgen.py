"""Tests of fglit.algorithms.fedgen: FedAvg plus a server-fitted latent generator that regularises the clients' heads."""
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from _device import DEV, same_run
from _node_pfl import make_clients

from fglit.algorithms.fedgen import (FedGenClient, FedGenConfig, FedGenServer, build_generator, decayed_weight)
from fglit.algorithms.generator import sample_labels, sample_noise
from fglit.federation import ClientInfo, LocalData, ModelSpec, flat_state, get_algorithm, make_config, run, weighted_mean

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True)
QUICK = dict(local_epochs=1, seeds=[0], progress=False)


def test_registered_with_the_authors_defaults():
    algo = get_algorithm("fedgen")
    assert algo.sums_only is False and algo.config is FedGenConfig and "ICML 2021" in algo.paper
    c = make_config(FedGenConfig)
    assert (c.generator_hidden, c.noise_dim, c.label_embedding, c.noise, c.generator_steps, c.generator_batch_size) == \
        (256, 32, False, "gaussian", 50, 32)
    assert (c.generator_lr, c.generator_weight_decay, c.generator_lr_decay, c.diversity_weight, c.ensemble, c.label_sampling) == \
        (3e-4, 1e-2, 0.98, 1.0, "logits", "prior")
    assert (c.regulariser_weight, c.regulariser_decay, c.regulariser_batch_size, c.latent_weight, c.evaluation, c.heterogeneous_models) == \
        (10.0, 0.98, 32, 0.0, "global", False)


@pytest.mark.parametrize("bad", [{"generator_batch_size": 1}, {"generator_lr_decay": 1.5}, {"ensemble": "votes"},
                                 {"noise": "laplace"}, {"regulariser_weight": -1.0}, {"graphless_model": "mlp"}])
def test_bad_settings_are_refused(bad):
    from fglit.federation import ConfigError
    with pytest.raises(ConfigError):
        make_config(FedGenConfig, bad)


@SETTINGS
@given(st.floats(0.0, 100.0), st.floats(0.5, 1.0), st.integers(1, 500))
def test_decayed_weight(weight, decay, rnd):
    w = decayed_weight(weight, decay, rnd)
    if weight == 0:
        assert w == 0.0
    else:
        assert w == pytest.approx(max(1e-4, weight * decay ** (rnd - 1))) and w >= 1e-4
        assert decayed_weight(weight, decay, rnd + 1) <= w and decayed_weight(weight, decay, 1) == max(1e-4, weight)


# -- the server ----------------------------------------------------------------------------------------------------

def small_server(K, C, **settings):
    config = make_config(FedGenConfig, {"generator_steps": 2, "generator_hidden": 8, "noise_dim": 4, "hidden": 6, **settings})
    spec = ModelSpec("mlp", 5, C, "node", config.hidden, config.layers, 0.0)
    torch.manual_seed(0)
    return FedGenServer(config, [ClientInfo(k, 1, 1) for k in range(K)], spec), spec


@SETTINGS
@given(st.integers(1, 4), st.integers(2, 5), st.sampled_from(["prior", "uniform"]), st.integers(0, 2**31 - 1))
def test_server_fits_and_broadcasts_the_label_distribution(K, C, sampling, seed):
    server, spec = small_server(K, C, label_sampling=sampling)
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 6, (K, C), generator=g).float() * (torch.rand(K, C, generator=g) > 0.3)
    models = [spec.build() for _ in range(K)]
    replies = {k: {"params": flat_state(m), "weight": 1.0, "label_counts": counts[k].to(DEV)} for k, m in enumerate(models)}
    before = flat_state(server.generator).clone()
    server.aggregate(1, replies)
    total = counts.sum(0)
    message = server.broadcast(2, [0])[0]
    if total.sum() == 0:                                      # nobody holds a label: nothing to fit, nothing sent
        assert set(message) == {"params"} and torch.equal(before, flat_state(server.generator))
        return
    expected = total / total.sum() if sampling == "prior" else (total > 0).float() / (total > 0).sum()
    assert set(message) == {"params", "generator", "label_distribution"}
    assert torch.allclose(message["label_distribution"].cpu(), expected) and not torch.equal(before, message["generator"])
    assert server.history[-1]["round"] == 1 and server.history[-1]["clients"] == K


def test_generator_and_teachers_leave_the_global_stream_alone():
    from fglit.algorithms.fedavg import FedAvgServer
    config = make_config(FedGenConfig, {"generator_hidden": 8, "noise_dim": 4, "hidden": 6})
    spec = ModelSpec("mlp", 5, 3, "node", 6, 2, 0.0)
    infos = [ClientInfo(k, 1, 1) for k in range(2)]
    torch.manual_seed(3); FedAvgServer(config, infos, spec); after_fedavg = torch.rand(3)
    torch.manual_seed(3)
    server = FedGenServer(config, infos, spec)
    server.teachers([server.params, server.params]); after_fedgen = torch.rand(3)
    torch.manual_seed(3); untouched = torch.rand(3)
    # FedAvg's own model build draws from the stream; FedGen's generator and teachers add no draw
    assert torch.equal(after_fedavg, after_fedgen) and not torch.equal(untouched, after_fedavg)


# -- the client ----------------------------------------------------------------------------------------------------

def cora_client(cora_parts, **settings):
    torch.manual_seed(0)
    config, _, server, clients = make_clients(FedGenConfig, FedGenServer, FedGenClient, *cora_parts, **settings)
    return clients, server, config


def test_upload_and_round_two_regulariser(cora_parts):
    clients, server, config = cora_client(cora_parts)
    first = server.broadcast(1, [0, 1, 2])
    assert all(set(m) == {"params"} for m in first.values())
    replies = {c.cid: c.local_step(first[c.cid], 1) for c in clients}
    for c in clients:
        y = c.data.graph.y[c.data.masks["train"]]
        assert set(replies[c.cid]) == {"params", "weight", "label_counts"}
        assert torch.equal(replies[c.cid]["label_counts"], torch.bincount(y, minlength=7).float())
    server.aggregate(1, replies)
    c = clients[0]
    c.receive(server.broadcast(2, [0])[0]); c.alpha = decayed_weight(10.0, 0.98, 2)
    b = c.data.train_batches()[0]
    c.model.eval()
    emb, logits = c.embed(c.model, b)
    torch.manual_seed(7); term = c.extra_loss(b, emb, logits)
    torch.manual_seed(7)
    labels = sample_labels(c.label_distribution, 32)
    with torch.no_grad():
        z = c.generator(sample_noise(32, 32, device=DEV), labels)
    assert torch.allclose(term, 9.8 * F.cross_entropy(c.model.head(z), labels), rtol=1e-5)
    # only the head receives the term's gradient
    c.model.zero_grad(); term.backward()
    assert all(p.grad is not None for p in c.model.head.parameters())
    assert all(p.grad is None or float(p.grad.abs().sum()) == 0 for p in c.model.encoder.parameters())


def test_latent_term_is_the_codes_kl(cora_parts):
    clients, server, _ = cora_client(cora_parts, regulariser_weight=0.0, latent_weight=10.0)
    replies = {c.cid: c.local_step(server.broadcast(1, [c.cid])[c.cid], 1) for c in clients}
    server.aggregate(1, replies)
    c = clients[1]
    c.receive(server.broadcast(2, [1])[1]); c.alpha, c.beta = 0.0, decayed_weight(10.0, 0.98, 3)
    b = c.data.train_batches()[0]
    c.model.eval()
    emb, logits = c.embed(c.model, b)
    torch.manual_seed(1); term = c.extra_loss(b, emb, logits)
    torch.manual_seed(1)
    with torch.no_grad():
        target = torch.softmax(c.model.head(c.generator(sample_noise(len(b.y), 32, device=DEV), b.y)), -1)
    kl = (target * (target.log() - torch.log_softmax(logits, -1))).sum(-1).mean()
    assert torch.allclose(term, c.beta * kl, rtol=1e-4)


def test_graph_clients_count_their_training_graphs(shared_root):
    from fglit.data import load_dataset
    from fglit.partition import partition
    ds = load_dataset("MUTAG", shared_root)
    part = partition(ds, "dirichlet", 3, seed=0, alpha=1.0, min_size=5)
    config = make_config(FedGenConfig, {"model": "gin", "hidden": 16})
    spec = ModelSpec("gin", ds.num_features, ds.num_classes, "graph", 16, config.layers, config.dropout)
    client = FedGenClient(0, LocalData(part.clients[0], "graph"), config, spec)
    y = torch.tensor([int(g.y) for g in part.clients[0].subset("train")])
    assert torch.equal(client.label_counts.cpu(), torch.bincount(y, minlength=2).float())


# -- end to end ----------------------------------------------------------------------------------------------------

def test_without_generator_steps_it_is_fedavg(shared_root):
    kw = dict(rounds=2, root=shared_root, **QUICK)
    fedavg = run("fedavg", "Cora", "louvain", 3, **kw).runs[0].history
    idle = run("fedgen", "Cora", "louvain", 3, settings={"generator_steps": 0}, **kw).runs[0].history
    active = run("fedgen", "Cora", "louvain", 3, **{**kw, "rounds": 3}).runs[0].history
    assert same_run(idle, fedavg) and not active.query("round == 3").equals(
        run("fedavg", "Cora", "louvain", 3, **{**kw, "rounds": 3}).runs[0].history.query("round == 3"))


def test_cora_learns_repeats_and_the_generator_fits(shared_root):
    seen = {}
    kw = dict(rounds=5, root=shared_root, **{**QUICK, "local_epochs": 3})
    a = run("fedgen", "Cora", "louvain", 3, callback=lambda rnd, server, clients: seen.update(h=list(server.history)), **kw)
    b = run("fedgen", "Cora", "louvain", 3, **kw)
    assert a.summary()["accuracy_mean"] > 0.5 and same_run(a.runs[0].history, b.runs[0].history)      # chance is 1/7
    assert [h["round"] for h in seen["h"]] == [1, 2, 3, 4, 5] and seen["h"][-1]["accuracy"] > seen["h"][0]["accuracy"] + 0.2
    down = a.communication().query("direction == 'down'").groupby("round")["floats"].first()
    gen = flat_state(build_generator(make_config(FedGenConfig), 7, 64)).numel()
    assert down[2] - down[1] == gen + 7          # from round 2: the generator and the label distribution


# -- heterogeneous client models (fglit's setting): only the heads are averaged ------------------------------------------

def test_heterogeneous_models_average_the_heads_by_count(shared_root):
    from fglit.data import load_dataset
    from fglit.partition import partition
    ds = load_dataset("Cora", shared_root)
    parts = partition(ds, "louvain", 5, seed=0)
    config = make_config(FedGenConfig, {"local_epochs": 1, "hidden": 16, "heterogeneous_models": True, "generator_steps": 5})
    spec = ModelSpec("gcn", ds.num_features, ds.num_classes, "node", 16, config.layers, config.dropout)
    torch.manual_seed(0)
    clients = [FedGenClient(i, LocalData(c, "node"), config, spec) for i, c in enumerate(parts.clients)]
    server = FedGenServer(config, [ClientInfo(i, c.data.num_train, 1) for i, c in enumerate(clients)], spec)
    assert len({c.spec.name for c in clients}) >= 3                              # different backbones, one head shape
    for rnd in (1, 2):
        down = server.broadcast(rnd, list(range(5)))
        assert all(m == {} for m in down.values()) if rnd == 1 else all(set(m) == {"head", "generator", "label_distribution"} for m in down.values())
        replies = {c.cid: c.local_step(down[c.cid], rnd) for c in clients}
        assert all(set(r) == {"head", "weight", "label_counts"} and r["head"].shape == (7 * 16 + 7,) for r in replies.values())
        server.aggregate(rnd, replies)
        counts = [float(c.data.num_train) for c in clients]
        assert torch.allclose(server.head, weighted_mean([replies[i]["head"] for i in range(5)], counts), atol=1e-6)
        assert not torch.allclose(server.head, replies[0]["head"])
        assert server.history[-1] == {**server.history[-1], "round": rnd, "clients": 5}
    clients[2].receive(server.broadcast(3, [2])[2])
    assert torch.equal(flat_state(clients[2].model.head), server.head)            # the averaged head on the client's own body
    assert server.evaluation_message(2) is None and server.shared_evaluation_message() is None


def test_heterogeneous_two_round_run_on_cora(shared_root):
    seen = {}
    def keep(rnd, server, clients):
        seen[rnd] = (server.head.clone(), [flat_state(c.model.head) for c in clients], [float(c.data.num_train) for c in clients],
                     [c.spec.name for c in clients])
    kw = dict(rounds=2, root=shared_root, settings={"heterogeneous_models": True, "hidden": 16}, **QUICK)
    a = run("fedgen", "Cora", "louvain", 5, callback=keep, **kw)
    assert len(set(seen[2][3])) >= 3 and math.isfinite(a.summary()["accuracy_mean"]) and len(a.summary()["per_client"]) == 5
    head, uploaded, counts, _ = seen[2]                       # after training, each client's head is the one it uploaded
    assert torch.allclose(head, weighted_mean(uploaded, counts), atol=1e-6)
    up = a.communication().query("direction == 'up'")
    assert (up["floats"] == 7 * 16 + 7 + 7).all()              # head and label counts: no backbone travels
    assert same_run(a.runs[0].history, run("fedgen", "Cora", "louvain", 5, **kw).runs[0].history)

"""Tests of fglit.algorithms.fggp: the prototype alignment loss and the kNN vote against their formulas, the client's
view, terms and upload, the server's clusters, and runs on Cora (heterogeneous models, shared weights, GAMLP)."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from _device import DEV, same_run

from fglit.algorithms.fggp import (FGGPClient, FGGPConfig, FGGPServer, PrototypeKNN, augmented_edges, confident_labels,
                                   knn_class_scores, prototype_alignment_loss, weighted_prototypes)
from fglit.algorithms.fpl import fpl_prototypes
from fglit.algorithms.prototype_clusters import class_clusters, cluster_contrastive_loss, finch
from fglit.federation import ClientInfo, ConfigError, LocalData, ModelSpec, make_config, run

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True)

pytestmark = pytest.mark.usefixtures("module_cache")     # a private fglit cache for this module


# -- the maths -----------------------------------------------------------------------------------------------------

@SETTINGS
@given(st.integers(1, 6), st.integers(2, 5), st.floats(0.1, 2.0), st.integers(0, 2**31))
def test_alignment_loss_matches_its_formula(m, d, tau, seed):
    g = torch.Generator().manual_seed(seed)
    a, o = torch.randn(m, d, generator=g, dtype=torch.float64), torch.randn(m, d, generator=g, dtype=torch.float64)
    cos = lambda u, v: torch.exp(F.cosine_similarity(u, v, dim=0) / tau)
    ref = torch.stack([-torch.log(cos(a[c], o[c]) / (cos(a[c], o[c]) + sum(cos(a[c], a[j]) + cos(a[c], o[j]) for j in range(m) if j != c)))
                       for c in range(m)]).mean()
    assert torch.allclose(prototype_alignment_loss(a, o, tau), ref)


@SETTINGS
@given(st.integers(1, 30), st.integers(1, 8), st.integers(1, 10), st.integers(0, 2**31))
def test_knn_vote_is_a_distribution_over_the_k_nearest_clusters_classes(n, M, k, seed):
    g = torch.Generator().manual_seed(seed)
    emb, clusters = torch.randn(n, 3, generator=g), torch.randn(M, 3, generator=g)
    classes = torch.randint(0, 4, (M,), generator=g)
    s = knn_class_scores(emb, clusters, classes, 4, k, 0.1)
    assert torch.allclose(s.sum(1), torch.ones(n), atol=1e-5) and bool((s >= 0).all())
    near = (F.normalize(emb, dim=1) @ F.normalize(clusters, dim=1).T).topk(min(k, M), 1).indices
    allowed = torch.zeros(n, 4, dtype=torch.bool).scatter(1, classes[near], True)
    assert bool((s[~allowed] == 0).all())
    one = knn_class_scores(emb, clusters, classes, 4, 1, 0.1)          # k = 1: the nearest cluster's class
    assert torch.equal(one.argmax(1), classes[near[:, 0]])


@SETTINGS
@given(st.integers(1, 12), st.integers(1, 4), st.integers(0, 2**31))
def test_clusters_are_the_means_of_finchs_last_partition_as_fpls(K, C, seed):
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(3, C, 4, generator=g)
    protos = centres[torch.randint(0, 3, (K,), generator=g)] + 0.3 * torch.randn(K, C, 4, generator=g)
    mask = torch.rand(K, C, generator=g) < 0.7
    clusters, classes = class_clusters(protos, mask)
    ref = fpl_prototypes(protos, mask)
    assert torch.equal(clusters, ref[0]) and torch.equal(classes, ref[1])
    # cluster by cluster: each class's FINCH clusters in the order of their smallest member, as plain means
    expected = []
    for c in range(C):
        points = protos[mask[:, c], c]
        if len(points):
            labels = finch(points)[-1]
            expected += [(c, points[labels == j].mean(0)) for j in range(int(labels.max()) + 1)]
    assert classes.tolist() == [c for c, _ in expected]
    if expected:
        assert torch.allclose(clusters, torch.stack([m for _, m in expected]), atol=1e-6)


def test_weighted_prototypes_and_confident_labels_by_hand():
    labels, conf = confident_labels(torch.tensor([[0., 1.], [3., 0.], [0., 0.]]), torch.tensor([True, False, False]), torch.tensor([0]))
    assert labels.tolist() == [0, 0, 0] and conf[0] == 1 and conf[2] == 0.5
    p, m = weighted_prototypes(torch.tensor([[2., 0.], [0., 4.], [1., 1.]]), torch.tensor([1, 1, 0]), torch.tensor([1., 3., 2.]), 3)
    assert torch.allclose(p, torch.tensor([[1., 1.], [0.5, 3.], [0., 0.]])) and m.tolist() == [True, True, False]


# -- client and server ---------------------------------------------------------------------------------------------

def parts(ds, part, **settings):
    cfg = make_config(FGGPConfig, {"local_epochs": 1, "hidden": 16, **settings})
    spec = ModelSpec("gcn", ds.num_features, ds.num_classes, "node", cfg.hidden, cfg.layers, cfg.dropout)
    torch.manual_seed(0)
    info = [ClientInfo(i, int(c.train_mask.sum()), c.num_nodes) for i, c in enumerate(part.clients)]
    return cfg, FGGPServer(cfg, info, spec), [FGGPClient(i, LocalData(c, "node"), cfg, spec) for i, c in enumerate(part.clients)]


def test_a_round_uploads_pseudo_prototypes_and_the_server_clusters_them(cora_parts):
    ds, part = cora_parts
    cfg, server, clients = parts(ds, part)
    down = server.broadcast(1, [0, 1, 2])
    assert set(down[0]) == {"clusters", "cluster_classes"} and len(down[0]["clusters"]) == 0
    replies = {i: c.local_step(down[i], 1) for i, c in enumerate(clients)}
    c0, r0 = clients[0], replies[0]
    assert set(r0) == {"protos", "mask"}
    g, train = c0.data.graph, c0.data.masks["train"]
    # the view: the graph's edges plus the kNN edges, each edge once
    edges = set(map(tuple, c0.view_edges.T.tolist()))
    assert set(map(tuple, g.edge_index.T.tolist())) <= edges and len(edges) == c0.view_edges.size(1) > g.edge_index.size(1)
    c0.model.eval()
    with torch.no_grad():
        z = c0.model.encode(g.x, g.edge_index); probs = torch.softmax(c0.model(g.x, g.edge_index), -1)
    lab, w = probs.argmax(1), probs.max(1).values
    lab[train], w[train] = g.y[train], 1.0
    for c in range(ds.num_classes):
        assert bool(r0["mask"][c]) == bool((lab == c).any())
        if r0["mask"][c]:
            assert torch.allclose(r0["protos"][c], (z[lab == c] * w[lab == c, None]).sum(0) / w[lab == c].sum(), atol=1e-5)
    server.aggregate(1, replies)
    ref = class_clusters(torch.stack([r["protos"] for r in replies.values()]), torch.stack([r["mask"] for r in replies.values()]))
    assert torch.equal(server.clusters, ref[0]) and torch.equal(server.cluster_classes, ref[1])
    # before any cluster arrives a client is scored by its head, afterwards by the vote of the clusters
    assert not isinstance(c0.evaluation_model(None), PrototypeKNN)
    c0.receive(server.broadcast(2, [0])[0])
    assert isinstance(c0.evaluation_model(None), PrototypeKNN)


def test_extra_loss_is_the_weighted_sum_of_its_terms(cora_parts):
    ds, part = cora_parts
    cfg, server, clients = parts(ds, part, cluster_weight=2.0, aug_weight=3.0, align_weight=5.0, dropout=0.0)
    c = clients[1]
    g = c.data.graph
    c.view_edges = augmented_edges(c.model, g.x, g.edge_index, 3)
    clusters = torch.randn(4, cfg.hidden, device=DEV)
    classes = torch.tensor([0, 0, 2, 5], device=DEV)
    c.receive({"clusters": clusters, "cluster_classes": classes})
    b = c.data.train_batches()[0]
    c.model.train()
    emb, logits = c.embed(c.model, b)
    got = c.extra_loss(b, emb, logits)
    keep = torch.isin(b.y, classes)
    full, view = c.model.encode(g.x, g.edge_index), c.model.encode(g.x, c.view_edges)
    lab, w = confident_labels(c.model(g.x, g.edge_index), b.select, b.y)
    p1, present = weighted_prototypes(full, lab, w, ds.num_classes)
    p2, _ = weighted_prototypes(view, lab, w, ds.num_classes)
    expected = (2.0 * cluster_contrastive_loss(emb[keep], b.y[keep], clusters, classes, cfg.cluster_temperature).mean()
                + 3.0 * F.cross_entropy(c.model.head(view[b.select]), b.y)
                + 5.0 * prototype_alignment_loss(p2[present], p1[present], cfg.align_temperature))
    assert torch.allclose(got, expected, atol=1e-5)


def test_shared_weights_and_their_limits(cora_parts):
    ds, part = cora_parts
    with pytest.raises(ConfigError, match="heterogeneous_models"):
        make_config(FGGPConfig, {"share_weights": True, "heterogeneous_models": True})
    cfg, server, clients = parts(ds, part, share_weights=True, aug_weight=0.0, align_weight=0.0)
    down = server.broadcast(1, [0, 1, 2])
    assert {"params", "clusters", "cluster_classes"} <= set(down[0]) and clients[0].view_edges is None
    replies = {i: c.local_step(down[i], 1) for i, c in enumerate(clients)}
    assert set(replies[0]) == {"params", "weight", "protos", "mask"} and clients[0].view_edges is None
    before = server.fedavg.params.clone()
    server.aggregate(1, replies)
    assert not torch.equal(server.fedavg.params, before) and len(server.clusters) >= ds.num_classes - 1


# -- end to end ----------------------------------------------------------------------------------------------------

def test_on_cora_it_learns_and_repeats(cora_parts):
    ds, _ = cora_parts
    kw = dict(rounds=3, local_epochs=2, seeds=[0], progress=False)
    a = run("fggp", ds, "louvain", 3, **kw)
    assert a.summary()["accuracy_mean"] > 0.5                        # 7 classes; the majority class is 30%
    assert same_run(a.runs[0].history, run("fggp", ds, "louvain", 3, **kw).runs[0].history)


def test_heterogeneous_models_and_gamlp_run(cora_parts):
    ds, _ = cora_parts
    seen = {}
    r = run("fggp", ds, "louvain", 3, rounds=2, local_epochs=1, seeds=[0], progress=False, settings={"heterogeneous_models": True},
            callback=lambda rnd, server, clients: seen.update(names={c.spec.name for c in clients}))
    assert len(seen["names"]) == 3 and 0 < r.summary()["accuracy_mean"] <= 1
    g = run("fggp", ds, "louvain", 3, rounds=1, local_epochs=1, model="gamlp", seeds=[0], progress=False)
    assert g.summary()["config"]["model"] == "gamlp" and 0 < g.summary()["accuracy_mean"] <= 1


def test_without_its_terms_and_with_its_head_fggp_is_fedproto_without_regulariser(cora_parts):
    ds, _ = cora_parts
    kw = dict(rounds=2, local_epochs=1, seeds=[0], progress=False)
    off = {"cluster_weight": 0.0, "aug_weight": 0.0, "align_weight": 0.0, "inference": "head"}
    plain = run("fggp", ds, "louvain", 3, settings=off, **kw).runs[0].history
    assert same_run(plain, run("fedproto", ds, "louvain", 3, settings={"lam": 0.0}, **kw).runs[0].history)
    assert not plain.equals(run("fggp", ds, "louvain", 3, settings={**off, "aug_weight": 1.0}, **kw).runs[0].history)

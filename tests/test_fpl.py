"""Tests of fglit.algorithms.fpl: FINCH against its definition and its invariances, the server's cluster and unbiased
prototypes, the client's loss terms and upload, and end-to-end runs on Cora."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components

from _device import DEV, same_run

from fglit.algorithms.fpl import FPLClient, FPLConfig, FPLServer, fpl_prototypes
from fglit.algorithms.prototype_clusters import cluster_contrastive_loss, finch, first_neighbours
from fglit.federation import ClientInfo, LocalData, ModelSpec, make_config, run

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True)


pytestmark = pytest.mark.usefixtures("module_cache")     # a private fglit cache for this module


# -- FINCH ---------------------------------------------------------------------------------------------------------

def reference_step(x: np.ndarray) -> np.ndarray:
    "One FINCH step from the paper's rule: i ~ j if j = k_i, k_j = i or k_i = k_j (k: cosine first neighbour); components."
    z = x / np.linalg.norm(x, axis=1, keepdims=True)
    sim = z @ z.T
    np.fill_diagonal(sim, -np.inf)
    k = sim.argmax(1)
    n = len(x)
    links = [(i, j) for i in range(n) for j in range(n) if i != j and (j == k[i] or k[j] == i or k[i] == k[j])]
    rows, cols = zip(*links) if links else ((), ())
    _, labels = connected_components(coo_matrix((np.ones(len(rows)), (rows, cols)), shape=(n, n)), directed=False)
    return labels


def reference_finch(x: np.ndarray) -> list[np.ndarray]:
    "FINCH's hierarchy (recursion on the means of the original points; a step leaving one cluster or merging nothing is dropped)."
    if len(x) < 2: return [np.zeros(len(x), dtype=int)]
    labels = reference_step(x)
    out = [labels]
    while labels.max() + 1 > 1:
        k = labels.max() + 1
        means = np.stack([x[labels == c].mean(0) for c in range(k)])
        merged = reference_step(means)
        if merged.max() + 1 in (1, k): break
        labels = merged[labels]
        out.append(labels)
    return out


def same_partition(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return bool(((a[:, None] == a[None, :]) == (b[:, None] == b[None, :])).all())


@st.composite
def point_sets(draw):
    n, d = draw(st.integers(1, 14)), draw(st.integers(2, 5))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    centres = rng.normal(size=(draw(st.integers(1, 4)), d))
    x = centres[rng.integers(0, len(centres), n)] + rng.normal(scale=draw(st.sampled_from([0.05, 0.3, 1.0])), size=(n, d))
    return x * rng.uniform(0.2, 5.0, size=(n, 1))               # lengths do not matter to cosines


@SETTINGS
@given(point_sets())
def test_finch_matches_its_definition(x):
    got = finch(torch.tensor(x))
    ref = reference_finch(x)
    assert len(got) == len(ref) and all(same_partition(g.numpy(), r) for g, r in zip(got, ref))


@SETTINGS
@given(point_sets())
def test_finch_labels_cover_every_point_and_coarsen(x):
    parts = finch(torch.tensor(x))
    for p in parts:
        assert p.shape == (len(x),) and p.dtype == torch.long
        assert sorted(set(p.tolist())) == list(range(int(p.max()) + 1))          # every point has a cluster, labels 0..k-1
    for fine, coarse in zip(parts, parts[1:]):
        assert coarse.max() < fine.max()                                         # each step merges
        assert all(len(set(coarse[fine == c].tolist())) == 1 for c in fine.unique())   # clusters are unions of finer ones
    if len(x) >= 2:
        assert int(parts[0].max()) + 1 <= len(x) // 2                            # every point is linked to its first neighbour
        assert len(parts) == 1 or int(parts[-1].max()) + 1 >= 2


@SETTINGS
@given(point_sets(), st.integers(0, 2**32 - 1))
def test_finch_is_invariant_to_permuting_the_points(x, seed):
    perm = np.random.default_rng(seed).permutation(len(x))
    a, b = finch(torch.tensor(x)), finch(torch.tensor(x[perm]))
    assert len(a) == len(b)
    assert all(same_partition(pa.numpy()[perm], pb.numpy()) for pa, pb in zip(a, b))


@SETTINGS
@given(point_sets(), st.integers(0, 2**32 - 1), st.floats(0.1, 10.0))
def test_duplicated_points_share_a_cluster(x, seed, scale):
    rng = np.random.default_rng(seed)
    i = int(rng.integers(len(x)))
    y = np.concatenate([x, x[i:i + 1], x[i:i + 1] * scale])                     # an exact copy and a scaled one
    for p in finch(torch.tensor(y)):
        assert p[i] == p[-2] == p[-1]


def test_finch_on_hand_placed_points():
    angles = torch.tensor([0., 1., 3., 10., 11., 90., 91., 100., 101.]) * math.pi / 180
    pts = torch.stack([angles.cos(), angles.sin()], 1) * torch.tensor([1., 3., 0.5, 2., 1., 1., 4., 2., 0.3]).unsqueeze(1)
    assert first_neighbours(pts).tolist() == [1, 0, 1, 4, 3, 6, 5, 8, 7]
    assert [p.tolist() for p in finch(pts)] == [[0, 0, 0, 1, 1, 2, 2, 3, 3], [0, 0, 0, 0, 0, 1, 1, 1, 1]]
    assert finch(pts[[0, 5, 7]])[-1].tolist() == [0, 0, 0] and finch(pts[:0])[0].numel() == 0


# -- the server's prototypes ---------------------------------------------------------------------------------------

def test_cluster_and_unbiased_prototypes_by_hand():
    p = torch.zeros(5, 3, 2)
    p[:, 0] = torch.tensor([[2., 0.], [4., 1.], [3., 0.2], [0., 6.], [1., 5.]])
    p[4, 1] = torch.tensor([1., 1.])
    m = torch.tensor([[True, False, False]] * 4 + [[True, True, False]])
    clusters, classes, unbiased, has = fpl_prototypes(p, m)
    assert classes.tolist() == [0, 0, 1] and has.tolist() == [True, True, False]
    assert torch.allclose(clusters, torch.tensor([[3., 0.4], [0.5, 5.5], [1., 1.]]))
    assert torch.allclose(unbiased, torch.tensor([[1.75, 2.95], [1., 1.], [0., 0.]]))
    # nine clients whose prototypes FINCH first splits into four groups, then two: FPL keeps the last partition
    angles = torch.tensor([0., 1., 3., 10., 11., 90., 91., 100., 101.]) * math.pi / 180
    nine = torch.stack([angles.cos(), angles.sin()], 1).unsqueeze(1)
    two, _, _, _ = fpl_prototypes(nine, torch.ones(9, 1, dtype=torch.bool))
    assert torch.allclose(two, torch.stack([nine[:5, 0].mean(0), nine[5:, 0].mean(0)]))
    empty = fpl_prototypes(p, torch.zeros_like(m))
    assert empty[0].shape == (0, 2) and empty[1].numel() == 0 and not empty[3].any()


@SETTINGS
@given(st.integers(1, 8), st.integers(1, 4), st.integers(0, 2**32 - 1))
def test_unbiased_prototype_is_the_mean_of_the_class_clusters(K, C, seed):
    rng = np.random.default_rng(seed)
    protos = torch.tensor(rng.normal(size=(K, C, 3)))
    mask = torch.tensor(rng.random((K, C)) < 0.7)
    clusters, classes, unbiased, has = fpl_prototypes(protos, mask)
    assert has.tolist() == mask.any(0).tolist()
    for c in range(C):
        mine = clusters[classes == c]
        if mask[:, c].any():
            assert torch.allclose(unbiased[c], mine.mean(0))
            assert len(mine) == int(finch(protos[mask[:, c], c])[-1].max()) + 1
        else:
            assert len(mine) == 0


# -- the client's loss ---------------------------------------------------------------------------------------------

def test_contrastive_loss_matches_its_formula():
    g = torch.Generator().manual_seed(0)
    emb, clusters = torch.randn(6, 4, generator=g), torch.randn(5, 4, generator=g)
    classes, y = torch.tensor([0, 0, 1, 2, 2]), torch.tensor([0, 1, 2, 0, 1, 2])
    got = cluster_contrastive_loss(emb, y, clusters, classes, 0.3)
    for i in range(6):
        cos = torch.tensor([F.cosine_similarity(emb[i], c, dim=0) for c in clusters]) / 0.3
        expected = -torch.log(cos.exp()[classes == y[i]].sum() / cos.exp().sum())
        assert torch.allclose(got[i], expected, atol=1e-5)


@pytest.fixture(scope="module")
def cora(shared_root):
    from fglit.data import load_dataset
    from fglit.partition import partition
    ds = load_dataset("Cora", shared_root)
    return ds, partition(ds, "louvain", 3, seed=0)


def test_client_loss_terms_and_upload(cora):
    ds, part = cora
    config = make_config(FPLConfig, {"model": "gcn", "local_epochs": 1, "temperature": 0.5, "cpcl_weight": 2.0, "upcr_weight": 3.0})
    spec = ModelSpec("gcn", ds.num_features, ds.num_classes, "node", config.hidden, config.layers, config.dropout)
    torch.manual_seed(0)
    server = FPLServer(config, [ClientInfo(0, 1, 1)], spec)
    client = FPLClient(0, LocalData(part.clients[0], "node"), config, spec)
    down = server.broadcast(1, [0])[0]
    assert down["clusters"].shape == (0, config.hidden)
    msg = client.local_step(down, 1)
    assert set(msg) == {"params", "weight", "protos", "mask"} and msg["mask"].dtype == torch.bool
    data = part.clients[0].clone().to(DEV)
    client.model.eval()
    with torch.no_grad():
        emb = client.model.encode(data.x, data.edge_index)[data.train_mask]
    y = data.y[data.train_mask]
    present = torch.bincount(y, minlength=ds.num_classes) > 0
    assert torch.equal(msg["mask"], present)
    assert torch.allclose(msg["protos"][present], torch.stack([emb[y == c].mean(0) for c in range(ds.num_classes) if present[c]]), atol=1e-4)
    # the extra loss with prototypes for classes 0 and 2 only
    clusters = torch.randn(3, config.hidden, device=DEV)
    classes, unbiased = torch.tensor([0, 0, 2], device=DEV), torch.randn(ds.num_classes, config.hidden, device=DEV)
    mask = torch.zeros(ds.num_classes, dtype=torch.bool, device=DEV); mask[[0, 2]] = True
    client.receive({"params": server.params, "clusters": clusters, "cluster_classes": classes,
                    "unbiased": unbiased, "mask": mask})
    b = client.data.train_batches()[0]
    z, logits = client.embed(client.model, b)
    keep = mask[b.y]
    expected = (2.0 * cluster_contrastive_loss(z[keep], b.y[keep], clusters, classes, 0.5)
                + 3.0 * ((z[keep] - unbiased[b.y[keep]]) ** 2).mean(1)).sum() / len(b.y)
    assert torch.allclose(client.extra_loss(b, z, logits), expected)


# -- end to end ----------------------------------------------------------------------------------------------------

def test_six_rounds_on_cora_learn_and_repeat(cora):
    ds, _ = cora
    kw = dict(rounds=6, local_epochs=3, seeds=[0], progress=False)
    a = run("fpl", ds, "louvain", 3, **kw)
    assert a.summary()["accuracy_mean"] > 0.5                           # 7 classes; the majority class is 30% (FedAvg: 0.81)
    assert same_run(a.runs[0].history, run("fpl", ds, "louvain", 3, **kw).runs[0].history)


def test_without_its_terms_fpl_is_fedavg(cora):
    ds, _ = cora
    kw = dict(rounds=2, local_epochs=1, seeds=[0], progress=False)
    plain = run("fpl", ds, "louvain", 3, settings={"cpcl_weight": 0.0, "upcr_weight": 0.0}, **kw).runs[0].history
    assert same_run(plain, run("fedavg", ds, "louvain", 3, **kw).runs[0].history)
    assert not plain.equals(run("fpl", ds, "louvain", 3, **kw).runs[0].history)

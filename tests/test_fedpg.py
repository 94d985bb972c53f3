"""FedPG (nb 50): Eq. 2 against a brute-force loop, fusion properties, edge cases, upload size, the CLI."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

from fglit.algorithms.fedpg import (HETEROGENEOUS_MODELS, FedPGConfig, FedPGServer, alignment_loss, class_operand,
                                    client_similarity, cosine_margin, heterogeneous_spec, hop_pairs, model_depth,
                                    personalised_prototypes, topology_prototypes)
from fglit.federation import ClientInfo, ConfigError, ModelSpec, get_algorithm, make_config

SCRIPT = Path(sys.executable).parent / "fglit"


def brute_force(emb, labels, edge_index, hops, num_classes, scores, mode):
    n = emb.size(0)
    nbrs = {i: set() for i in range(n)}
    for a, b in edge_index.t().tolist():
        if a != b: nbrs[a].add(b); nbrs[b].add(a)
    P = torch.zeros(num_classes, hops + 1, emb.size(1), dtype=emb.dtype)
    N = torch.zeros(num_classes, hops + 1, dtype=torch.long)
    for i in range(n):
        c = int(labels[i])
        if c < 0: continue
        dist, frontier = {i: 0}, [i]
        while frontier:
            nxt = []
            for u in frontier:
                for v in nbrs[u]:
                    if v not in dist: dist[v] = dist[u] + 1; nxt.append(v)
            frontier = nxt
        for h in range(hops + 1):
            hood = [j for j, d in dist.items() if (d <= h if mode == "within" else d == h) and int(labels[j]) == c]
            if hood:
                w = torch.softmax(scores[hood], 0)
                P[c, h] += (w.unsqueeze(1) * emb[hood]).sum(0); N[c, h] += 1
    return P / N.clamp_min(1).unsqueeze(-1), N


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 12), st.integers(0, 30), st.integers(0, 3), st.sampled_from(["within", "exact"]), st.integers(0, 2**16))
def test_eq2_matches_brute_force(n, m, hops, mode, seed):
    g = torch.Generator().manual_seed(seed)
    ei = torch.randint(0, n, (2, m), generator=g)
    emb = torch.randn(n, 3, generator=g, dtype=torch.float64)
    labels = torch.randint(-1, 3, (n,), generator=g)
    scores = torch.randn(n, generator=g, dtype=torch.float64)
    ops = [class_operand(p, labels, n) for p in hop_pairs(ei, n, hops, mode)]
    ops = [type(o)(o.matrix.to(torch.float64)) for o in ops]
    P, N = topology_prototypes(emb, labels, ops, 4, scores)
    Pb, Nb = brute_force(emb, labels, ei, hops, 4, scores, mode)
    assert torch.equal(N, Nb) and torch.allclose(P, Pb, atol=1e-9)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 15), st.integers(0, 40), st.integers(0, 3), st.sampled_from(["within", "exact"]), st.integers(0, 2**16))
def test_class_operand_is_symmetric_and_backpropagates_like_a_dense_matrix(n, m, hops, mode, seed):
    "class_operand builds its CSR straight from hop_pairs' sorted pairs and reuses it as its transpose: check both against dense maths."
    from fglit.models import spmm
    g = torch.Generator().manual_seed(seed)
    ei = torch.randint(0, n, (2, m), generator=g)
    labels = torch.randint(-1, 3, (n,), generator=g)
    x = torch.randn(n, 2, generator=g, requires_grad=True)
    w = torch.randn(n, 2, generator=g)
    for pairs in hop_pairs(ei, n, hops, mode):
        op = class_operand(pairs, labels, n)
        d = op.matrix.to_dense()
        i, j = pairs
        ref = torch.zeros(n, n)
        keep = (labels[i] >= 0) & (labels[i] == labels[j])
        ref[i[keep], j[keep]] = 1.0
        assert torch.equal(d, ref) and torch.equal(d, d.T) and torch.equal(op.T.to_dense(), d.T)
        (grad,) = torch.autograd.grad((spmm(op, x) * w).sum(), x)
        assert torch.allclose(grad, d.T @ w, atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5), st.integers(1, 3), st.integers(1, 3), st.floats(0, 1), st.floats(-1.0, 1.5), st.integers(0, 2**16))
def test_fusion_convex_and_permutation_equivariant(K, C, H, alpha, lam, seed):
    g = torch.Generator().manual_seed(seed)
    P = torch.randn(K, C, H, 3, generator=g, dtype=torch.float64)
    n = torch.randint(0, 3, (K, C, H), generator=g)
    U = torch.randn(C, H, 3, generator=g, dtype=torch.float64)
    out = personalised_prototypes(P, n, U, alpha, lam)
    have = n.unsqueeze(-1) > 0
    lo = torch.minimum(U, torch.where(have, P, U).min(0).values)
    hi = torch.maximum(U, torch.where(have, P, U).max(0).values)
    assert bool(((out >= lo - 1e-9) & (out <= hi + 1e-9)).all())
    perm = torch.randperm(K, generator=g)
    assert torch.allclose(personalised_prototypes(P[perm], n[perm], U, alpha, lam), out[perm])
    sim = client_similarity(P, n > 0)
    assert torch.allclose(sim, sim.t()) and bool((sim.abs() <= 1 + 1e-9).all())


def test_alpha_one_returns_generator_prototypes():
    P, n, U = torch.rand(3, 2, 2, 4), torch.randint(0, 3, (3, 2, 2)), torch.randn(2, 2, 4)
    assert torch.equal(personalised_prototypes(P, n, U, 1.0, 0.0), U.expand(3, 2, 2, 4))


def test_absent_class_is_masked_not_pulled_to_zero():
    P = torch.randn(3, 2, 4); counts = torch.tensor([[5, 5], [0, 0], [2, 2]])
    T = torch.randn(3, 2, 4)
    for kind in ("euclidean", "cosine"):
        full = alignment_loss(P, counts > 0, T, torch.ones(3, 2, dtype=torch.bool), kind)
        kept = alignment_loss(P[[0, 2]], torch.ones(2, 2, dtype=torch.bool), T[[0, 2]], torch.ones(2, 2, dtype=torch.bool), kind)
        assert torch.allclose(full, kept)
    assert alignment_loss(P, torch.zeros(3, 2, dtype=torch.bool), T, torch.ones(3, 2, dtype=torch.bool)) is None


def test_one_class_annotations_and_margin():
    n = 6
    ei = torch.tensor([[0, 1, 2, 3, 4], [1, 2, 3, 4, 5]])
    labels = torch.zeros(n, dtype=torch.long)
    ops = [class_operand(p, labels, n) for p in hop_pairs(ei, n, 2)]
    P, N = topology_prototypes(torch.rand(n, 4), labels, ops, 3)
    assert (N[0] == n).all() and (N[1:] == 0).all() and torch.isfinite(P).all()
    assert cosine_margin(P.unsqueeze(0), (N > 0).unsqueeze(0), 0.5).tolist() == [0.0, 0.0, 0.0]


def test_hops_beyond_smallest_depth_is_a_config_error():
    spec = ModelSpec("gcn", 8, 3, "node", 16, 2, 0.5)
    infos = [ClientInfo(0, 5, 10), ClientInfo(1, 5, 10, spec.replace(layers=1))]
    with pytest.raises(ConfigError, match="smallest model depth 1"):
        FedPGServer(FedPGConfig(hops=2), infos, spec)
    assert FedPGServer(FedPGConfig(), infos, spec).hops == 1
    with pytest.raises(ConfigError):
        make_config(FedPGConfig, {"hops": -2})
    with pytest.raises(ConfigError, match="align_level must be one of prototype, node"):
        make_config(FedPGConfig, {"align_level": "graph"})


def test_node_level_alignment_trains_on_a_real_split(shared_root):
    "align_level='node': a 3-round run on Cora goes through, and its loss term differs from the prototype level's."
    from fglit.federation import run
    accs = {lvl: run("fedpg", "Cora", "metis", 3, rounds=3, local_epochs=1, model="gcn", seeds=[0], root=shared_root, progress=False,
                     settings={"align_level": lvl, "mu": 5.0}).summary()["accuracy_mean"] for lvl in ("node", "prototype")}
    assert all(0 < a <= 1 for a in accs.values()) and accs["node"] != accs["prototype"]


def test_prototype_labels_train_val_gives_val_nodes_their_labels(shared_root):
    "prototype_labels='train+val' (the authors' code): validation nodes carry their true class in the prototypes; 'train' (Alg. 1) pseudo-labels them."
    from fglit.federation import run
    with pytest.raises(ConfigError, match="prototype_labels must be one of train, train\\+val"):
        make_config(FedPGConfig, {"prototype_labels": "all"})
    box = {}
    for choice in ("train", "train+val"):
        run("fedpg", "Cora", "metis", 3, rounds=1, local_epochs=1, model="gcn", seeds=[0], root=shared_root, progress=False,
            settings={"prototype_labels": choice, "pseudo_labels": False},
            callback=lambda rnd, server, clients, choice=choice: box.update({choice: clients[0]}))
    for choice, c in box.items():
        _, labels = c.annotate_nodes()
        val, y = c.data.masks["val"], c.data.graph.y
        expected = y[val] if choice == "train+val" else torch.full_like(y[val], -1)     # no pseudo-labels: 'train' leaves them out
        assert val.any() and torch.equal(labels[val], expected)


def test_heterogeneous_assignment_is_equal_and_seeded():
    spec = ModelSpec("gcn", 8, 3, "node", 16, 2, 0.5)
    for seed in range(5):
        names = [heterogeneous_spec(spec, c, seed).name for c in range(20)]
        assert sorted(names) == sorted(list(HETEROGENEOUS_MODELS) * 4)
    assert {model_depth(heterogeneous_spec(spec, c, 0).build()) for c in range(5)} == {2}


def test_upload_is_classes_times_hops_times_p(shared_root):
    from fglit.data import load_dataset
    from fglit.federation import simulate
    from fglit.partition import partition
    ds = load_dataset("Cora", shared_root)
    part = partition(ds, "metis", 3, seed=0)
    cfg = make_config(FedPGConfig, {"rounds": 2, "model": "gcn", "dp_fraction": 0.1, "dp_noise": 0.01, "dp_clip": 10.0})
    res = simulate(get_algorithm("fedpg"), part.clients, "node", ds.num_features, ds.num_classes, cfg, seed=0, progress=False)
    up = res.communication.query("direction == 'up'")
    assert (up["floats"] == ds.num_classes * 3 * 64).all()


def fglit(*args, env=None):
    assert SCRIPT.is_file(), f"the fglit console script is not installed at {SCRIPT}"
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=600)


@pytest.mark.parametrize("extra", [[], ["--set", "heterogeneous_models=true"]])
def test_cli_run_fedpg(extra, shared_root):
    out = fglit("run", "fedpg", "--dataset", "Cora", "--partition", "metis", "--clients", "10", "--rounds", "3", "--json", *extra,
                env={"FGLIT_DATA": str(shared_root)})
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout)
    assert s["algorithm"] == "fedpg" and s["rounds"] == 3 and 0 < s["accuracy_mean"] <= 1
    assert s["floats_up"] == 3 * 10 * 7 * 3 * 64            # rounds x clients x |C| x (L+1) x p
    assert s["config"]["heterogeneous_models"] is (bool(extra))


def test_graph_fl_variant_runs_on_knn_neighbourhoods(shared_root):
    from fglit.federation import run
    r = run("fedpg", "MUTAG", "dirichlet", 3, rounds=2, seeds=[0], settings={"alpha": 0.5, "graph_knn": 3}, root=shared_root,
            progress=False)
    up = r.communication().query("direction == 'up'")
    assert (up["floats"] == 2 * 3 * 64).all()           # 2 classes x (L+1 = 3, GIN's 2 layers) x p
    assert 0 <= r.summary()["accuracy_mean"] <= 1

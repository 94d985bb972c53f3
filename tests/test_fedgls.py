"""Tests for FedGLS's pieces (`fglit.algorithms.fedgls`, from nbs/40_fedgls.ipynb) and the kNN graph utilities."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from fglit.algorithms.fedgls import (AttentiveEncoder, GraphLearner, contrastive_loss, distillation_loss, gcn_edges,
                                     gcn_forward, propagate)
from fglit.models import adjacency, build_model, knn_graph, knn_indices


@settings(max_examples=30, deadline=None)
@given(n=st.integers(2, 30), k=st.integers(1, 8), block=st.integers(1, 7), seed=st.integers(0, 1000))
def test_knn_indices_match_dense_topk_in_any_block_size(n, k, block, seed):
    x = torch.randn(n, 5, generator=torch.Generator().manual_seed(seed))
    idx = knn_indices(x, k, block_rows=block)
    kk = min(k, n - 1)
    assert idx.shape == (n, kk)
    xn = F.normalize(x, dim=1); sim = xn @ xn.T; sim.fill_diagonal_(-float("inf"))
    want = sim.topk(kk, dim=1).values
    got = sim.gather(1, idx)
    assert torch.allclose(got, want, atol=1e-5)                     # same similarities (ties may pick other indices)
    assert not (idx == torch.arange(n).unsqueeze(1)).any()           # never itself


def test_knn_graph_is_symmetric_simple():
    x = torch.randn(40, 6, generator=torch.Generator().manual_seed(0))
    ei = knn_graph(x, 4)
    pairs = set(map(tuple, ei.T.tolist()))
    assert all((j, i) in pairs for i, j in pairs) and all(i != j for i, j in pairs)
    assert len(pairs) == ei.size(1)                                  # no duplicates
    assert torch.bincount(ei[0], minlength=40).min() >= 4            # everyone keeps its own k


def test_propagate_equals_the_gcn_adjacency():
    g = torch.Generator().manual_seed(1)
    ei = torch.randint(0, 10, (2, 30), generator=g)
    ei = torch.cat([ei, ei.flip(0)], 1)
    h = torch.randn(10, 3, generator=g)
    assert torch.allclose(propagate(h, *gcn_edges(ei, 10)), adjacency(ei, 10, "gcn") @ h, atol=1e-5)


def test_gcn_forward_equals_the_model_on_a_graph():
    g = torch.Generator().manual_seed(2)
    ei = torch.randint(0, 12, (2, 40), generator=g); ei = torch.cat([ei, ei.flip(0)], 1)
    x = torch.randn(12, 7, generator=g)
    for name in ("gcn", "kipfgcn"):
        model = build_model(name, 7, 3, hidden=16).eval()
        _, logits = gcn_forward(model, x, *gcn_edges(ei, 12))
        assert torch.allclose(logits, model(x, ei), atol=1e-5)


def test_learned_graph_is_symmetric_normalised_and_differentiable():
    torch.manual_seed(0)
    x = torch.rand(15, 6)
    learner = GraphLearner(6, k=4)
    ei, w = learner(x)
    S = torch.zeros(15, 15); S[ei[1], ei[0]] = w
    assert torch.allclose(S, S.T, atol=1e-6) and (w >= 0).all()
    # the first graph is the cosine kNN graph of the features (attentive weights start at one)
    knn = set(map(tuple, knn_graph(x, 4).T.tolist())) | {(i, i) for i in range(15)}
    assert set(map(tuple, ei.T.tolist())) == knn
    propagate(torch.randn(15, 2), ei, w).sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in learner.parameters())


def test_contrastive_and_distillation_losses():
    z = torch.randn(8, 4)
    assert contrastive_loss(z, z.clone()) < contrastive_loss(z, torch.randn(8, 4))     # aligned views score better
    logits = torch.randn(5, 3)
    assert distillation_loss(logits, logits) == pytest.approx(0.0, abs=1e-6)
    assert distillation_loss(logits, torch.randn(5, 3)) > 0
    assert AttentiveEncoder(3)(torch.ones(2, 3)).eq(1).all()                         # identity at initialisation


def test_fedgls_runs_and_graphless_knn_option(shared_root):
    from fglit.federation import run
    base = dict(mode="largest", graphless_ratio=0.5, split="fedgls")
    res = run("fedgls", "Cora", "louvain", 4, rounds=3, local_epochs=1, seeds=[0], settings=base, progress=False)
    assert res.summary()["accuracy_mean"] > 0 and res.config["k"] == 10
    knn = run("fedavg", "Cora", "louvain", 4, rounds=2, local_epochs=1, seeds=[0], settings={**base, "graphless_knn": 5},
              progress=False)
    assert knn.config["graphless_knn"] == 5 and knn.summary()["accuracy_mean"] > 0


@pytest.mark.parametrize("ratio, message", [(0.0, "no client is graphless"), (1.0, "every client is graphless")])
def test_fedgls_with_no_or_all_graphless_clients(shared_root, ratio, message):
    from fglit.federation import run
    with pytest.warns(UserWarning, match=message):
        res = run("fedgls", "Cora", "louvain", 4, rounds=2, local_epochs=1, seeds=[0],
                  settings=dict(mode="largest", graphless_ratio=ratio, split="fedgls"), progress=False)
    assert res.per_round().test_accuracy.notna().all()


def test_fedgls_refuses_other_graphless_treatments(shared_root):
    from fglit.federation import ConfigError, run
    for extra in ({"graphless_model": "mlp"}, {"graphless_knn": 5}):
        with pytest.raises(ConfigError, match="learns the graphless clients' graphs itself"):
            run("fedgls", "Cora", "louvain", 4, rounds=1, seeds=[0], settings=dict(graphless_ratio=0.5, **extra), progress=False)


def test_graph_learner_keeps_a_self_loop_for_an_all_zero_feature_row():
    x = torch.rand(6, 4); x[2] = 0                                     # an all-zero row: cosine similarity 0 to everything
    ei, w = GraphLearner(4, k=2)(x)
    self_loop = (ei[0] == 2) & (ei[1] == 2)
    assert self_loop.sum() == 1 and w[self_loop].item() > 0 and torch.isfinite(w).all()


def test_graph_learner_on_a_client_smaller_than_k():
    ei, w = GraphLearner(4, k=10)(torch.rand(3, 4))                  # k is clamped to n - 1
    assert ei.size(1) == 9 and torch.isfinite(w).all()                # a complete graph with self loops
    ei, w = GraphLearner(4, k=10)(torch.rand(1, 4))                   # a single node keeps its self loop
    assert ei.tolist() == [[0], [0]] and torch.isfinite(w).all()


def test_cli_run_fedgls_json(shared_root):
    import json, os, subprocess, sys
    from pathlib import Path
    script = Path(sys.executable).parent / "fglit"
    out = subprocess.run([str(script), "run", "fedgls", "--dataset", "Cora", "--partition", "louvain", "--clients", "8",
                          "--rounds", "2", "--json", "--set", "graphless_ratio=0.5"], capture_output=True, text=True,
                         env={**os.environ, "FGLIT_DATA": str(shared_root)}, timeout=600)
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout)
    assert s["algorithm"] == "fedgls" and len(s["per_client"]) == 8 and 0 < s["accuracy_mean"] <= 1


def test_fedgls_with_zero_local_epochs(shared_root):
    from fglit.federation import run
    res = run("fedgls", "Cora", "louvain", 4, rounds=1, local_epochs=0, seeds=[0],
              settings=dict(mode="largest", graphless_ratio=0.5, split="fedgls"), progress=False)
    assert res.per_round().test_accuracy.notna().all()


@settings(max_examples=15, deadline=None)
@given(st.integers(2, 40), st.integers(1, 8), st.integers(1, 64), st.integers(0, 1000))
def test_kept_similarities_and_their_gradients_equal_the_plain_products(n, k, block, seed):
    import torch.nn.functional as F
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 6, generator=g, dtype=torch.float64)
    learner = GraphLearner(6, k).double()
    with torch.no_grad():
        for w in learner.encoder.weights: w.uniform_(0.5, 1.5, generator=g)
    emb = F.normalize(learner.encoder(x), dim=1)
    sims, cols = learner.kept_similarities(emb, block_rows=block)
    kk = min(k, n - 1)
    assert sims.shape == (n, kk + 1) and (cols[:, 0] == torch.arange(n)).all()
    plain = (emb.unsqueeze(1) * emb[cols]).sum(-1)
    assert torch.allclose(sims[:, 1:], plain[:, 1:])
    dense = emb @ emb.T; dense.fill_diagonal_(-float("inf"))
    assert torch.allclose(sims[:, 1:].sort(1).values, dense.topk(kk, 1).values.sort(1).values)   # the top k, in any block size
    weights = torch.rand(n, kk + 1, generator=g, dtype=torch.float64)
    ours = torch.autograd.grad((sims * weights).sum(), learner.encoder.weights[0], retain_graph=True)[0]
    ref = torch.autograd.grad((plain[:, 1:] * weights[:, 1:]).sum(), learner.encoder.weights[0])[0]
    assert torch.allclose(ours, ref)


def test_isolated_nodes_on_a_graph_client_keep_their_own_features():
    ei = torch.tensor([[0, 1], [1, 0]])                               # node 2 is isolated
    e, w = gcn_edges(ei, 3)
    loops = (e[0] == 2) & (e[1] == 2)
    assert loops.sum() == 1 and torch.isclose(w[loops], torch.tensor(1.0)).all()   # D^-1/2 (A+I) D^-1/2 = 1 there
    assert ((e[0] == 2) | (e[1] == 2)).sum() == 1                    # and no other edge touches it
    h = torch.rand(3, 4)
    assert torch.allclose(propagate(h, e, w)[2], h[2])

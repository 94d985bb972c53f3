"""Tests for the personalised graph-classification baselines GCFL, GCFL+, FedAMP and pFedGraph (`fglit.algorithms.pfl`, from nbs/13_pfl.ipynb)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from _device import DEV

from fglit.algorithms.pfl import (GCFLServer, GCFLPlusServer, FedAMPClient, FedAMPServer, PFedGraphClient, PFedGraphServer,
                                  bipartition, collaboration_graph, cosine_matrix, dtw_distances, fedamp_weights, gcfl_similarity,
                                  heur_fedamp_weights, parameter_mask, parameter_views, project_simplex, split_wanted,
                                  update_norms)
from fglit.federation import (ClientInfo, ConfigError, LocalData, ModelSpec, flat_state, get_algorithm, make_config, run,
                              weighted_mean)

PFL = ("gcfl", "gcfl+", "fedamp", "pfedgraph")
SPEC = ModelSpec("gin", 5, 2, "graph", 8, 2, 0.0)


def infos(sizes):
    return [ClientInfo(i, n, n) for i, n in enumerate(sizes)]


def server(name, sizes, **settings):
    algo = get_algorithm(name)
    return algo.server(make_config(algo.config, settings), infos(sizes), SPEC)


def unit(v):
    return v / v.norm()


# -- shared ---------------------------------------------------------------------------------------
def test_registered_as_personalised_servers_needing_individual_messages():
    for name in PFL:
        algo = get_algorithm(name)
        assert algo.sums_only is False, name
        with pytest.raises(ConfigError, match="client_fraction"):
            make_config(algo.config, {"client_fraction": 0.5})
        with pytest.raises(ConfigError, match="graphless_model"):
            make_config(algo.config, {"graphless_model": "mlp"})


def test_parameter_mask_and_views_follow_model_parameters():
    model = SPEC.build()
    vec = flat_state(model)
    mask = parameter_mask(model)
    params = list(model.parameters())
    assert mask.sum() == sum(p.numel() for p in params) < vec.numel()       # GIN has batch-norm buffers too
    assert torch.equal(vec[mask], torch.cat([p.detach().reshape(-1) for p in params]))
    views = parameter_views(model, vec * 2)
    assert all(torch.equal(v, 2 * p.detach()) for v, p in zip(views, params))


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 6), d=st.integers(1, 8), seed=st.integers(0, 10_000))
def test_cosine_matrix_is_pairwise_cosine(n, d, seed):
    X = torch.randn(n, d, generator=torch.Generator().manual_seed(seed))
    want = F.cosine_similarity(X[:, None], X[None], dim=-1).double()
    assert torch.allclose(cosine_matrix(X), want, atol=1e-6)


def test_personalised_server_sends_each_client_its_row():
    s = server("pfedgraph", [3, 4])
    s.params[1] += 1
    down = s.broadcast(1, [0, 1])
    assert torch.equal(down[0]["params"], s.initial) and torch.equal(down[1]["params"], s.initial + 1)
    assert torch.equal(s.evaluation_message(1)["params"], s.initial + 1)
    with pytest.raises(ValueError, match="every client"):
        s.aggregate(1, {0: {"params": s.initial}})


# -- GCFL ----------------------------------------------------------------------------------------
@settings(max_examples=50, deadline=None)
@given(n=st.integers(1, 8), seed=st.integers(0, 10_000), eps2=st.floats(1e-3, 10), eps1=st.floats(0, 10),
       scale=st.floats(0, 1))
def test_gcfl_never_splits_when_every_update_is_small(n, seed, eps2, eps1, scale):
    g = torch.Generator().manual_seed(seed)
    U = torch.randn(n, 20, generator=g, dtype=torch.float64)
    U = U / U.norm(dim=1, keepdim=True) * eps2 * scale * torch.rand(n, 1, generator=g, dtype=torch.float64)
    assert not split_wanted(U, torch.rand(n, generator=g, dtype=torch.float64) + 0.1, eps1, eps2)


def test_update_norms_weighted_mean_and_max():
    U = torch.tensor([[3.0, 0.0], [0.0, 4.0], [-3.0, 0.0]])
    mean_norm, max_norm = update_norms(U, torch.tensor([1.0, 0.0, 1.0]))
    assert mean_norm == pytest.approx(0.0) and max_norm == pytest.approx(4.0)
    assert split_wanted(U, torch.tensor([1.0, 0.0, 1.0]), eps1=0.1, eps2=3.5)
    assert not split_wanted(U, torch.tensor([1.0, 1.0, 1.0]), eps1=0.1, eps2=3.5)      # mean (0, 4/3) is not small


@settings(max_examples=40, deadline=None)
@given(a=st.integers(1, 6), b=st.integers(1, 6), seed=st.integers(0, 10_000), noise=st.floats(0, 0.3))
def test_min_cut_separates_two_opposite_groups(a, b, seed, noise):
    g = torch.Generator().manual_seed(seed)
    v = unit(torch.randn(30, generator=g, dtype=torch.float64))
    signs = torch.tensor([1.0] * a + [-1.0] * b, dtype=torch.float64)
    perm = torch.randperm(a + b, generator=g)
    U = (signs[:, None] * v + noise * unit(torch.randn(a + b, 30, generator=g, dtype=torch.float64)) / 2)[perm]
    if a + b < 2:
        return
    c1, c2 = bipartition(gcfl_similarity(U))
    groups = {frozenset(perm.argsort()[:a].tolist()), frozenset(perm.argsort()[a:].tolist())}
    if min(a, b) >= 2 or a + b == 2:
        assert {frozenset(c1), frozenset(c2)} == groups
    assert sorted(c1 + c2) == list(range(a + b)) and 0 in c1 and c1 and c2


def gcfl_round(s, rnd, deltas):
    s.aggregate(rnd, {i: {"delta": d, "weight": float(s.clients[i].num_train)} for i, d in enumerate(deltas)})


def opposite_updates(P, signs, scale, seed=0):
    "Update vectors of length P: `scale` * sign * v on the trainable parameters (zero on buffers)."
    g = torch.Generator().manual_seed(seed)
    mask = parameter_mask(SPEC.build())
    v = torch.zeros(P); v[mask] = unit(torch.randn(int(mask.sum()), generator=g))
    return [(scale * s * v + 0.01 * scale * torch.randn(P, generator=g) * mask).to(DEV) for s in signs]


def test_gcfl_server_splits_opposite_groups_after_warmup_and_aggregates_within_clusters():
    sizes = [10, 20, 30, 10, 20, 30]
    s = server("gcfl", sizes, eps1=0.5, eps2=1.0, warmup_rounds=2)
    P = s.initial.numel()
    signs = [1, -1, 1, -1, 1, -1]
    for rnd in (1, 2):                                    # warm-up: one cluster, FedAvg of everybody
        before = s.params[0].clone()
        deltas = opposite_updates(P, signs, 2.0, seed=rnd)
        gcfl_round(s, rnd, deltas)
        assert s.clusters == [list(range(6))]
        assert torch.allclose(s.params, (before + weighted_mean(deltas, sizes)).expand(6, -1), atol=1e-6)
    before = s.params[0].clone()
    deltas = opposite_updates(P, signs, 2.0, seed=3)
    gcfl_round(s, 3, deltas)
    assert s.clusters == [[0, 2, 4], [1, 3, 5]]
    assert s.history[-1]["split"] == [True] and s.history[-1]["clusters"] == s.clusters
    for c in s.clusters:
        want = before + weighted_mean([deltas[i] for i in c], [sizes[i] for i in c])
        assert torch.allclose(s.params[c], want.expand(len(c), -1), atol=1e-6)
    # inside each new cluster the updates now agree: the mean norm is large and nothing splits
    gcfl_round(s, 4, opposite_updates(P, signs, 2.0, seed=4))
    assert s.clusters == [[0, 2, 4], [1, 3, 5]] and s.history[-1]["split"] == [False, False]


def test_gcfl_small_or_two_client_clusters_do_not_split():
    s = server("gcfl", [5, 5], eps1=0.5, eps2=1.0, warmup_rounds=0)
    gcfl_round(s, 1, opposite_updates(s.initial.numel(), [1, -1], 2.0))
    assert s.clusters == [[0, 1]]
    s = server("gcfl", [5, 5, 5, 5], eps1=0.5, eps2=10.0, warmup_rounds=0)      # max norm 2 < eps2
    gcfl_round(s, 1, opposite_updates(s.initial.numel(), [1, -1, 1, -1], 2.0))
    assert s.clusters == [[0, 1, 2, 3]]


def test_gcfl_dataset_defaults():
    algo = get_algorithm("gcfl")
    assert algo.defaults_for("NCI1", "soft_dirichlet") == dict(eps1=0.04, eps2=0.08, seq_length=5)
    assert algo.defaults_for("PROTEINS", "dirichlet")["seq_length"] == 10
    assert algo.defaults_for("MUTAG", "dirichlet") == {}


# -- GCFL+ ---------------------------------------------------------------------------------------
def dtw_reference(x, y):
    "Textbook DTW with squared differences, square root at the end."
    INF = float("inf")
    D = [[INF] * (len(y) + 1) for _ in range(len(x) + 1)]
    D[0][0] = 0.0
    for i in range(1, len(x) + 1):
        for j in range(1, len(y) + 1):
            D[i][j] = (x[i - 1] - y[j - 1]) ** 2 + min(D[i - 1][j], D[i][j - 1], D[i - 1][j - 1])
    return D[-1][-1] ** 0.5


@settings(max_examples=40, deadline=None)
@given(seqs=st.integers(1, 8).flatmap(lambda T: st.lists(st.lists(st.floats(-5, 5), min_size=T, max_size=T), min_size=1, max_size=5)))
def test_dtw_matches_the_textbook_recursion(seqs):
    X = torch.tensor(seqs, dtype=torch.float64)
    D = dtw_distances(X)
    want = torch.tensor([[dtw_reference(a, b) for b in seqs] for a in seqs], dtype=torch.float64)
    assert torch.allclose(D, want, atol=1e-9)
    assert torch.allclose(D, D.T) and torch.all(D.diagonal() == 0)
    assert torch.all(D <= torch.cdist(X, X) + 1e-9)                    # the diagonal alignment is one candidate


def test_dtw_forgives_a_time_shift():
    x = torch.tensor([0.0, 0, 1, 2, 1, 0, 0])
    shifted = torch.roll(x, 1)
    D = dtw_distances(torch.stack([x, shifted]))
    assert D[0, 1] < 1e-9 < torch.dist(x, shifted)


def test_gcfl_plus_waits_for_sequences_and_splits_by_their_shapes():
    sizes = [5] * 6
    s = server("gcfl+", sizes, eps1=10.0, eps2=0.1, warmup_rounds=0, seq_length=3)
    P = s.initial.numel()
    rising, falling = [0.5, 1.0, 1.5], [1.5, 1.0, 0.5]
    group = [0, 1, 0, 1, 0, 1]                                           # same directions: cosines cannot tell them apart
    g = torch.Generator().manual_seed(0)
    v = torch.zeros(P); mask = parameter_mask(SPEC.build()); v[mask] = unit(torch.randn(int(mask.sum()), generator=g))
    v = v.to(DEV)
    for rnd in range(3):
        deltas = [v * (rising if k == 0 else falling)[rnd] for k in group]
        gcfl_round(s, rnd + 1, deltas)
        if rnd < 2:
            assert s.clusters == [list(range(6))]                      # fewer than seq_length norms so far
    assert s.clusters == [[0, 2, 4], [1, 3, 5]]
    assert all(s.sequences[i] == [] for i in range(6))                 # split clusters restart their sequences


# -- FedAMP --------------------------------------------------------------------------------------
amp_case = st.tuples(st.integers(1, 7), st.integers(0, 10_000), st.floats(1e-2, 1e3), st.floats(0.01, 1.0), st.floats(0.01, 10))


@settings(max_examples=50, deadline=None)
@given(case=amp_case)
def test_fedamp_weights_are_convex_combinations(case):
    K, seed, sigma, frac, spread = case
    W = spread * torch.randn(K, 12, generator=torch.Generator().manual_seed(seed))
    xi = fedamp_weights(W, sigma, frac * sigma / max(K - 1, 1))        # any step with alpha_k (K-1) <= sigma
    assert torch.all(xi >= -1e-12) and torch.allclose(xi.sum(1), torch.ones(K, dtype=torch.float64))
    U = xi @ W.double()
    lo, hi = W.double().min(0).values, W.double().max(0).values
    assert torch.all(U >= lo - 1e-9) and torch.all(U <= hi + 1e-9)     # cloud models lie in the box of the models


@settings(max_examples=50, deadline=None)
@given(case=amp_case, self_weight=st.floats(0, 1))
def test_heur_fedamp_weights_are_convex_with_the_self_weight(case, self_weight):
    K, seed, _, _, scale = case
    xi = heur_fedamp_weights(torch.randn(K, 12, generator=torch.Generator().manual_seed(seed)), self_weight, scale)
    assert torch.all(xi >= 0) and torch.allclose(xi.sum(1), torch.ones(K, dtype=torch.float64))
    if K > 1:
        assert torch.allclose(xi.diagonal(), torch.full((K,), self_weight, dtype=torch.float64))


@settings(max_examples=30, deadline=None)
@given(K=st.integers(1, 7), seed=st.integers(0, 10_000))
def test_fedamp_reproduces_fedavg_for_identical_clients(K, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(1, 12, generator=g, dtype=torch.float64)
    xi = fedamp_weights(w.expand(K, -1), 1.0, 1.0 / K)                 # identical models, the default alpha_k = sigma / K
    assert torch.allclose(xi, torch.full((K, K), 1.0 / K, dtype=torch.float64))
    W = torch.randn(K, 12, generator=g, dtype=torch.float64)           # models far below the distance scale: uniform attention
    xi = fedamp_weights(W, 1e9, 1e9 / K)
    assert torch.allclose(xi @ W, weighted_mean(list(W), [1.0] * K).expand(K, -1), atol=1e-6)


def test_fedamp_attends_more_to_closer_models():
    W = torch.tensor([[0.0], [0.5], [2.0]])
    xi = fedamp_weights(W, sigma=1.0, alpha_k=0.5)
    assert xi[0, 1] > xi[0, 2] and xi[2, 1] > xi[2, 0]
    assert xi[0, 1] == pytest.approx(0.5 * np.exp(-0.25))


def test_fedamp_server_checks_the_step_and_aggregates_cloud_models():
    with pytest.raises(ConfigError, match="alpha_k"):
        server("fedamp", [5, 5, 5], sigma=1.0, alpha_k=0.6)             # 0.6 * 2 > 1
    s = server("fedamp", [5, 5, 5], sigma=2.0)
    assert s.alpha_k == pytest.approx(2.0 / 3)
    W = (torch.randn(3, s.initial.numel()) * 0.1).to(DEV)
    s.aggregate(1, {i: {"params": W[i], "weight": 5.0} for i in range(3)})
    xi = fedamp_weights(W[:, s.mask], 2.0, 2.0 / 3)                    # attention on the trainable parameters
    assert torch.allclose(s.xi, xi) and torch.allclose(s.params, (xi @ W.double()).float(), atol=1e-6)
    h = server("fedamp", [5, 5, 5], attention="cosine", self_weight=0.3)
    h.aggregate(1, {i: {"params": W[i], "weight": 5.0} for i in range(3)})
    assert torch.allclose(h.xi.diagonal().cpu(), torch.full((3,), 0.3, dtype=torch.float64))


def tiny_clients(n):
    "Local data of `n` small graph clients (random graphs, labels 0/1)."
    from torch_geometric.data import Data
    from fglit.partition import GraphClient
    g = torch.Generator().manual_seed(0)
    graphs = [Data(x=torch.randn(4, 5, generator=g), edge_index=torch.tensor([[0, 1, 2], [1, 2, 3]]), y=torch.tensor([i % 2]))
              for i in range(12)]
    y = torch.tensor([i % 2 for i in range(12)])
    split = torch.tensor([0] * 8 + [1] * 2 + [2] * 2)
    client = GraphClient(torch.arange(12), y, split == 0, split == 1, split == 2, graphs=graphs)
    return [LocalData(client, "graph", batch_size=4) for _ in range(n)]


def test_fedamp_client_is_fedprox_towards_the_cloud_model_and_can_keep_its_own_weights():
    config = make_config(get_algorithm("fedamp").config, {"lam": 2.0, "start": "local"})
    c = FedAMPClient(0, tiny_clients(1)[0], config, SPEC)
    first = flat_state(SPEC.build())
    c.local_step({"params": first}, 1)
    trained = flat_state(c.model)
    u = first + 0.5
    c.receive({"params": u})                                           # start="local": the weights stay, the anchor moves
    assert torch.equal(flat_state(c.model), trained)
    mask = parameter_mask(c.model)
    want = 1.0 * ((trained - u)[mask] ** 2).sum()                      # lam / 2 ||w - u||^2 over the parameters
    assert c.extra_loss(None, None, None).item() == pytest.approx(want.item(), rel=1e-5)
    cloud = FedAMPClient(0, tiny_clients(1)[0], make_config(get_algorithm("fedamp").config, {}), SPEC)
    cloud.receive({"params": u})
    assert torch.equal(flat_state(cloud.model), u) and cloud.extra_loss(None, None, None).item() == 0


# -- pFedGraph ----------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 8), seed=st.integers(0, 10_000), scale=st.floats(0.01, 10))
def test_project_simplex_is_the_closest_point_of_the_simplex(n, seed, scale):
    g = torch.Generator().manual_seed(seed)
    V = scale * torch.randn(3, n, generator=g, dtype=torch.float64)
    X = project_simplex(V)
    assert torch.all(X >= 0) and torch.allclose(X.sum(1), torch.ones(3, dtype=torch.float64))
    Q = torch.distributions.Dirichlet(torch.ones(n, dtype=torch.float64)).sample((200,)) if n > 1 else torch.ones(200, 1, dtype=torch.float64)
    for v, x in zip(V, X):
        assert ((v - x) ** 2).sum() <= ((v - Q) ** 2).sum(1).min() + 1e-12


@settings(max_examples=50, deadline=None)
@given(n=st.integers(1, 8), seed=st.integers(0, 10_000), alpha=st.floats(0.01, 10))
def test_collaboration_graph_rows_are_on_the_simplex_and_optimal(n, seed, alpha):
    g = torch.Generator().manual_seed(seed)
    S = cosine_matrix(torch.randn(n, 6, generator=g))
    sizes = torch.rand(n, generator=g, dtype=torch.float64) + 0.1
    A = collaboration_graph(S, sizes, alpha)
    assert torch.all(A >= 0) and torch.allclose(A.sum(1), torch.ones(n, dtype=torch.float64))
    p = sizes / sizes.sum()
    objective = lambda a, i: -(a * S[i]).sum(-1) + alpha * ((a - p) ** 2).sum(-1)
    Q = torch.distributions.Dirichlet(torch.ones(n, dtype=torch.float64)).sample((300,)) if n > 1 else torch.ones(300, 1, dtype=torch.float64)
    for i in range(n):
        assert objective(A[i], i) <= objective(Q, i).min() + 1e-12


def test_collaboration_graph_falls_back_to_data_sizes_and_follows_similarity():
    sizes = torch.tensor([1.0, 3.0])
    assert torch.allclose(collaboration_graph(torch.zeros(2, 2, dtype=torch.float64), sizes, 0.8),
                          torch.tensor([[0.25, 0.75], [0.25, 0.75]], dtype=torch.float64))
    S = torch.tensor([[1.0, -1.0, 1.0], [-1.0, 1.0, -1.0], [1.0, -1.0, 1.0]], dtype=torch.float64)
    A = collaboration_graph(S, torch.ones(3), 0.8)
    assert A[0, 1] == 0 and A[1, 0] == 0 and A[0, 2] > 0.4 and A[1, 1] == 1


def test_pfedgraph_server_and_client_regulariser():
    s = server("pfedgraph", [5, 10, 5])
    W = s.initial + 0.1 * torch.randn(3, s.initial.numel(), generator=torch.Generator().manual_seed(0)).to(DEV)
    s.aggregate(1, {i: {"params": W[i], "weight": 1.0} for i in range(3)})
    assert torch.allclose(s.graph.sum(1).cpu(), torch.ones(3, dtype=torch.float64))
    assert torch.allclose(s.params, (s.graph @ W.double()).float(), atol=1e-6)
    msg = s.broadcast(2, [1])[1]
    c = PFedGraphClient(1, tiny_clients(1)[0], s.config, SPEC)
    c.receive(msg)
    assert torch.equal(flat_state(c.model), s.params[1])
    theta = torch.cat([p.reshape(-1) for p in c.model.parameters()])
    want = -0.01 * sum(s.graph[1, j] * F.cosine_similarity(theta, W[j][s.mask], dim=0) for j in range(3))
    assert c.extra_loss(None, None, None).item() == pytest.approx(want.item(), rel=1e-4)


# -- end to end ----------------------------------------------------------------------------------
SMALL = {"alpha": 0.5, "hidden": 16, "layers": 2, "batch_size": 256}


@pytest.mark.parametrize("name", PFL)
def test_runs_on_nci1(name, shared_root):
    seen = []
    extra = {"warmup_rounds": 0, "eps1": 1e9, "eps2": 0.0, "min_split_size": 2} if name.startswith("gcfl") else {}
    if name == "gcfl+": extra["seq_length"] = 1
    result = run(name, "NCI1", "soft_dirichlet", 4, rounds=2, settings={**SMALL, **extra}, root=shared_root, progress=False,
                 callback=lambda rnd, server, clients: seen.append(server))
    s = result.summary()
    assert s["algorithm"] == name and s["rounds"] == 2 and 0 <= s["accuracy_mean"] <= 1
    assert len(result.per_round()) == 2 and s["bytes_up"] > 0
    srv = seen[-1]
    if name.startswith("gcfl"):
        assert result.config["eps1"] == 1e9 and len(srv.history) == 2
        assert len(srv.clusters) >= 2                                  # forced splits happened
    if name == "fedamp":
        assert torch.allclose(srv.xi.sum(1).cpu(), torch.ones(4, dtype=torch.float64))
    if name == "pfedgraph":
        assert torch.all(srv.graph >= 0) and torch.allclose(srv.graph.sum(1).cpu(), torch.ones(4, dtype=torch.float64))


def test_gcfl_on_nci1_uses_the_papers_thresholds(shared_root):
    result = run("gcfl", "NCI1", "soft_dirichlet", 3, rounds=1, settings=SMALL, root=shared_root, progress=False)
    assert (result.config["eps1"], result.config["eps2"]) == (0.04, 0.08) and result.config["evaluation"] == "global"


def test_cli_run_json(shared_root):
    script = Path(sys.executable).parent / "fglit"
    out = subprocess.run([str(script), "run", "pfedgraph", "--dataset", "NCI1", "--partition", "soft_dirichlet", "--clients", "3",
                          "--rounds", "1", "--set", "alpha=0.5", "hidden=16", "graph_alpha=0.5", "--json", "--quiet"],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "FGLIT_DATA": str(shared_root)})
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["algorithm"] == "pfedgraph" and summary["config"]["graph_alpha"] == 0.5
    assert summary["partition_params"] == {"alpha": 0.5} and 0 <= summary["accuracy_mean"] <= 1


@pytest.mark.parametrize("similarity", ["cumulative", "update"])
def test_pfedgraph_similarity_compares_changes_since_the_right_start(similarity):
    s = server("pfedgraph", [5, 5, 5], similarity=similarity)
    g = torch.Generator().manual_seed(1)
    s.params = s.initial + torch.randn(3, s.initial.numel(), generator=g).to(DEV)   # what each client started this round from
    start = (s.initial if similarity == "cumulative" else s.params).clone()
    W = s.params + 0.1 * torch.randn(3, s.initial.numel(), generator=g).to(DEV)
    s.aggregate(2, {i: {"params": W[i], "weight": 5.0} for i in range(3)})
    want = collaboration_graph(cosine_matrix((W - start)[:, s.mask]), torch.full((3,), 5.0, device=DEV), 0.8)
    assert torch.allclose(s.graph, want)

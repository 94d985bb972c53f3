"""Tests for the GNN model zoo (`fglit.models`, generated from nbs/02_models.ipynb)."""
import copy
import io
from pathlib import Path

import pytest
import torch

from fglit.core import seed_everything
from fglit.models import (MODEL_NAMES, GraphCache, GraphModel, adjacency, build_model, dropout,
                          train_node_classifier)

N, F_IN, C, G = 24, 12, 3, 3                      # nodes, features, classes, graphs in the batch
PRECOMPUTED = ["SGC", "SSGC", "SIGN", "GAMLP"]
# small hyper-parameters keep the file fast; defaults are exercised by the factory tests
SMALL = dict(hidden=16)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    "The graphs here are tiny: intra-op threads only add synchronisation (badly so on a busy machine)."
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def small_kwargs(name):
    kw = dict(SMALL)
    if name == "GAT": kw["heads"] = 4
    if name == "GCNII": kw["layers"] = 4
    if name == "SSGC": kw["K"] = 4
    return kw


def random_graph(seed=0, n=N, f=F_IN, sparse=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, f, generator=g)
    if sparse: x = x * (torch.rand(n, f, generator=g) < 0.05)
    ei = torch.randint(0, n, (2, 4 * n), generator=g)
    ei = torch.cat([ei, ei.flip(0)], 1)           # undirected
    batch = torch.arange(G).repeat_interleave(n // G)
    return x, ei, batch


def make(name, task="node", seed=0, **kw):
    seed_everything(seed)
    return build_model(name, F_IN, C, task=task, **{**small_kwargs(name), **kw})


# ---------------------------------------------------------------- shapes and the encoder/head split
@pytest.mark.parametrize("task", ["node", "graph"])
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_shapes_and_split(name, task):
    x, ei, batch = random_graph()
    m = make(name, task).eval()
    assert isinstance(m, GraphModel) and m.task == task
    h = m.encode(x, ei, batch)
    out = m(x, ei, batch)
    rows = N if task == "node" else G
    assert h.shape == (rows, m.embedding_dim) and m.embedding_dim == 16
    assert out.shape == (rows, C)
    assert torch.isfinite(out).all()
    assert torch.equal(out, m.head(m.encode(x, ei, batch)))
    assert torch.equal(m.encoder(x, ei), m.encode(x, ei)) if task == "node" else True
    # the head never sees the graph: it is a plain module on embeddings
    assert torch.equal(m.head(h), out)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_graph_pooling_matches_readout(name):
    x, ei, batch = random_graph()
    for pool, reduce in [("mean", "mean"), ("sum", "sum"), ("max", "amax")]:
        m = make(name, "graph", pool=pool).eval()
        h_nodes = m.encoder(x, ei)
        expected = torch.stack([getattr(h_nodes[batch == b], reduce)(0) if reduce != "amax"
                                else h_nodes[batch == b].amax(0) for b in range(G)])
        assert torch.allclose(m.encode(x, ei, batch), expected, atol=1e-5), (name, pool)


def test_gin_defaults_to_sum_pooling_and_others_to_mean():
    assert build_model("GIN", F_IN, C, task="graph").pool == "sum"
    assert build_model("GCN", F_IN, C, task="graph").pool == "mean"
    # without a batch vector all nodes form one graph
    x, ei, _ = random_graph()
    m = make("GIN", "graph").eval()
    assert m(x, ei).shape == (1, C)
    assert torch.allclose(m.encode(x, ei), m.encoder(x, ei).sum(0, keepdim=True), atol=1e-4)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_every_parameter_gets_a_gradient(name):
    x, ei, _ = random_graph()
    m = make(name).train()
    y = torch.randint(0, C, (N,))
    torch.nn.functional.cross_entropy(m(x, ei), y).backward()
    missing = [n for n, p in m.named_parameters() if p.requires_grad and (p.grad is None or not torch.isfinite(p.grad).all())]
    assert not missing, missing
    assert any(p.grad.abs().sum() > 0 for p in m.encoder.parameters())


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_graph_without_edges(name):
    x, _, batch = random_graph()
    ei = torch.empty(2, 0, dtype=torch.long)
    for task in ("node", "graph"):
        out = make(name, task).eval()(x, ei, batch)
        assert torch.isfinite(out).all() and out.shape[1] == C


# ---------------------------------------------------------------- determinism
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_seeding(name):
    x, ei, _ = random_graph()
    a, b, c = make(name, seed=1), make(name, seed=1), make(name, seed=2)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa if sa[k].is_floating_point())
    a.eval(); b.eval()
    assert torch.equal(a(x, ei), b(x, ei))
    # dropout masks are seeded too
    a.train(); b.train()
    seed_everything(5); oa = a(x, ei)
    seed_everything(5); ob = b(x, ei)
    assert torch.equal(oa, ob)


def test_dropout_is_inverted_and_sparse_aware():
    seed_everything(0)
    x = torch.ones(200, 50)
    y = dropout(x, 0.5, True)
    assert set(y.unique().tolist()) <= {0.0, 2.0} and 0.4 < (y == 0).float().mean() < 0.6
    assert dropout(x, 0.5, False) is x and dropout(x, 0.0, True) is x
    xs = torch.eye(50).to_sparse_csr()
    ys = dropout(xs, 0.5, True)
    assert ys.layout == torch.sparse_csr and ys._nnz() == 50               # zeros stay structural zeros
    assert set(ys.values().unique().tolist()) <= {0.0, 2.0}


# ---------------------------------------------------------------- precomputation happens once per graph
@pytest.mark.parametrize("name", PRECOMPUTED)
def test_precomputation_is_cached(name):
    x, ei, _ = random_graph()
    m = make(name).eval()
    calls = []
    original = m.encoder.precompute
    m.encoder.precompute = lambda *a: calls.append(1) or original(*a)
    out1 = m(x, ei)
    m.train(); m(x, ei); m.eval()
    out2 = m(x, ei)
    assert len(calls) == 1 and torch.equal(out1, out2)
    m(x, ei.clone())                                # a new graph tensor
    assert len(calls) == 2
    x2 = x.clone(); m(x2, ei)                       # new features
    assert len(calls) == 3
    before = m(x2, ei)
    x2.mul_(3.0)                                    # in-place write bumps the version counter
    after = m(x2, ei)
    assert len(calls) == 4 and not torch.allclose(before, after)
    fresh = make(name).eval()
    fresh.load_state_dict(m.state_dict())
    assert torch.allclose(fresh(x2, ei), after, atol=1e-6)   # cached result equals a fresh computation


@pytest.mark.parametrize("name", PRECOMPUTED)
def test_precomputed_features_are_not_recomputed_during_training(name):
    x, ei, _ = random_graph()
    y = torch.randint(0, C, (N,))
    m = make(name)
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    for _ in range(5):
        opt.zero_grad(); torch.nn.functional.cross_entropy(m(x, ei), y).backward(); opt.step()
    assert m.encoder.cache.misses == 1 and m.encoder.cache.hits == 4
    if name in ("SGC", "SSGC"):                   # the linear layers' sparsity probe of the features: once too
        assert m.encoder.mlp.cache.misses == 1


def test_sgc_propagation_matches_pyg_and_ssgc_formula():
    from torch_geometric.nn import SGConv
    x, ei, _ = random_graph()
    sgc = make("SGC", K=3)
    ref = SGConv(F_IN, 5, K=3, bias=False)
    assert torch.allclose(ref(x, ei), sgc.encoder.precompute(x, ei) @ ref.lin.weight.T, atol=1e-5)
    ssgc = make("SSGC", K=3, alpha=0.2)
    a = adjacency(ei, N).to_dense()
    powers = [torch.linalg.matrix_power(a, k) @ x for k in (1, 2, 3)]
    expected = sum(0.8 * p + 0.2 * x for p in powers) / 3
    assert torch.allclose(ssgc.encoder.precompute(x, ei), expected, atol=1e-5)


def test_features_requiring_grad_bypass_the_cache():
    x, ei, _ = random_graph()
    x.requires_grad_(True)
    m = make("SGC")
    m(x, ei).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0 and len(m.encoder.cache) == 0


def test_cache_is_shared_by_deepcopies_and_dropped_by_pickling():
    x, ei, _ = random_graph()
    m = make("SIGN").eval()
    out = m(x, ei)
    clone = copy.deepcopy(m)
    assert clone.encoder.cache is m.encoder.cache
    clone(x, ei)
    assert m.encoder.cache.misses == 1
    buf = io.BytesIO(); torch.save(m, buf); buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert len(loaded.encoder.cache) == 0 and torch.allclose(loaded(x, ei), out)


def test_graph_cache_lru():
    cache = GraphCache(maxsize=2)
    ts = [torch.randn(3) for _ in range(3)]
    for t in ts: cache.get((t,), lambda: object())
    assert len(cache) == 2 and cache.misses == 3
    cache.get((ts[0],), lambda: object())          # evicted: recomputed
    assert cache.misses == 4
    with pytest.raises(ValueError): GraphCache(0)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_message_passing_models_cache_adjacency(name):
    x, ei, _ = random_graph()
    m = make(name).eval()
    m(x, ei); misses = getattr(getattr(m.encoder, "cache", None), "misses", 0)
    m(x, ei); m(x, ei)
    assert getattr(getattr(m.encoder, "cache", None), "misses", 0) == misses


# ---------------------------------------------------------------- sparse inputs give the dense result
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_sparse_input_path_matches_dense(name):
    x, ei, batch = random_graph(sparse=True)
    a = make(name).eval()
    b = make(name).eval()
    first = a.encoder.mlp if name == "APPNP" else a.encoder
    if name in ("GCN", "GraphSAGE", "GAT", "GIN", "GCNII", "MLP", "APPNP"):
        assert first.input_view(x).layout == torch.sparse_csr          # the sparse path is really taken
    for mod in b.modules():
        if hasattr(mod, "sparse_input"): mod.sparse_input = False
    assert torch.allclose(a(x, ei), b(x, ei), atol=1e-5)
    a.train(); b.train()
    ga = torch.autograd.grad(a(x, ei).sum(), list(a.parameters()), allow_unused=True)
    assert all(g is None or torch.isfinite(g).all() for g in ga)


def test_adjacency_kinds():
    ei = torch.tensor([[0, 1, 1, 2, 0], [1, 0, 2, 1, 2]])
    s = adjacency(ei, 4, "sum").to_dense()
    assert s[2, 0] == 1 and s[0, 2] == 0 and s[3].sum() == 0          # rows are targets; node 3 isolated
    mean = adjacency(ei, 4, "mean").to_dense()
    assert torch.allclose(mean[:3].sum(1), torch.ones(3)) and mean[3].sum() == 0
    from torch_geometric.nn import GCNConv
    conv = GCNConv(2, 2, bias=False)
    x = torch.randn(4, 2)
    assert torch.allclose(conv(x, ei), adjacency(ei, 4, "gcn") @ conv.lin(x), atol=1e-6)
    with pytest.raises(ValueError): adjacency(ei, 4, "sym")


# ---------------------------------------------------------------- factory
def test_factory_names_and_errors():
    assert len(MODEL_NAMES) == 13 and len(set(MODEL_NAMES)) == 13
    for name in MODEL_NAMES:
        for spelled in (name, name.lower(), name.upper()):
            assert type(build_model(spelled, F_IN, C)).__name__ == name
    assert type(build_model("sage", F_IN, C)).__name__ == "GraphSAGE"
    with pytest.raises(ValueError) as e:
        build_model("transformer", F_IN, C)
    assert all(n in str(e.value) for n in MODEL_NAMES)
    for bad in [dict(in_dim=0), dict(in_dim=-3), dict(in_dim=2.5), dict(in_dim=True), dict(num_classes=0),
                dict(num_classes=None)]:
        with pytest.raises(ValueError):
            build_model("GCN", **{**dict(in_dim=F_IN, num_classes=C), **bad})
    with pytest.raises(ValueError): build_model("GCN", F_IN, C, task="edge")
    with pytest.raises(ValueError): build_model("GCN", F_IN, C, task="graph", pool="median")
    with pytest.raises(ValueError): build_model("GCN", F_IN, C, hidden=0)
    with pytest.raises(ValueError): build_model("GCN", F_IN, C, layers=0)
    with pytest.raises(ValueError): build_model("GCN", F_IN, C, dropout=1.0)
    with pytest.raises(ValueError): build_model("GAT", F_IN, C, hidden=30, heads=8)
    with pytest.raises(ValueError): build_model("APPNP", F_IN, C, alpha=0.0)
    with pytest.raises(TypeError): build_model("GCN", F_IN, C, no_such_option=1)


def test_factory_defaults_and_overrides():
    gcn = build_model("GCN", F_IN, C)
    assert gcn.embedding_dim == 64 and len(gcn.encoder.convs) == 2
    assert build_model("GCN", F_IN, C, hidden=32, layers=3).embedding_dim == 32
    assert len(build_model("GCN", F_IN, C, layers=3).encoder.convs) == 3
    assert len(build_model("GCNII", F_IN, C).encoder.convs) == 16
    appnp = build_model("APPNP", F_IN, C).encoder.prop
    assert (appnp.K, appnp.alpha) == (10, 0.1)
    assert build_model("SGC", F_IN, C).encoder.K == 2
    ssgc = build_model("SSGC", F_IN, C).encoder
    assert (ssgc.K, ssgc.alpha) == (16, 0.05)
    gcnii = build_model("GCNII", F_IN, C).encoder.convs[0]
    assert gcnii.alpha == 0.1 and gcnii.beta == pytest.approx(torch.log(torch.tensor(0.5 / 1 + 1)).item())
    assert build_model("SIGN", F_IN, C, K=2).encoder.K == 2 and len(build_model("SIGN", F_IN, C, K=2).encoder.inception) == 3
    assert build_model("GAT", F_IN, C).encoder.convs[0].heads == 8


# ---------------------------------------------------------------- training helper
def test_train_node_classifier_learns_a_separable_task():
    from torch_geometric.data import Data
    seed_everything(0)
    n = 120
    y = torch.arange(n) % 2
    x = torch.randn(n, 8) + 2.0 * torch.nn.functional.one_hot(y, 8).float()
    src = torch.randint(0, n, (600,))
    dst = (src + 2 * torch.randint(1, n // 2, (600,))) % n      # even offset: edges stay inside a class
    ei = torch.stack([src, dst])
    mask = torch.zeros(n, dtype=torch.bool)
    data = Data(x=x, edge_index=ei, y=y, train_mask=mask.clone(), val_mask=mask.clone(), test_mask=mask.clone())
    data.train_mask[:40] = True; data.val_mask[40:80] = True; data.test_mask[80:] = True
    for name in ("GCN", "SGC", "MLP"):
        seed_everything(0)
        res = train_node_classifier(build_model(name, 8, 2, hidden=16), data, epochs=30)
        assert {"train_acc", "val_acc", "test_acc", "val_loss", "epoch", "seconds"} <= set(res)
        assert 1 <= res["epoch"] <= 30 and res["test_acc"] > 0.9, (name, res)
    with pytest.raises(ValueError): train_node_classifier(build_model("MLP", 8, 2), data, epochs=0)


# ---------------------------------------------------------------- SparseOperand / spmm / GCNLayer
from hypothesis import given, settings, strategies as st

from fglit.models import GCNLayer, SparseOperand, spmm


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 12), m=st.integers(1, 12), density=st.floats(0.0, 1.0), seed=st.integers(0, 10_000))
def test_sparse_operand_transpose_and_gradient(n, m, density, seed):
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(n, m, generator=g) * (torch.rand(n, m, generator=g) < density)
    op = SparseOperand(dense.to_sparse_csr())
    assert torch.equal(op.T.to_dense(), dense.T)                         # the stored transpose is the transpose
    new_values = torch.randn(op.matrix.values().shape, generator=g)
    op2 = op.with_values(new_values)                                     # same pattern, new values, same structure
    assert torch.equal(op2.T.to_dense(), op2.matrix.to_dense().T)
    b = torch.randn(m, 3, generator=g, requires_grad=True)
    out = spmm(op2, b)
    assert torch.allclose(out, op2.matrix.to_dense() @ b, atol=1e-5)
    w = torch.randn(n, 3, generator=g)
    grad, = torch.autograd.grad((out * w).sum(), b)
    assert torch.allclose(grad, op2.matrix.to_dense().T @ w, atol=1e-5)


def test_sparse_operand_rejects_dense():
    with pytest.raises(ValueError):
        SparseOperand(torch.eye(3))


@pytest.mark.parametrize("sparse", [True, False])
def test_gcn_layer_equals_pyg_gcnconv(sparse):
    from torch_geometric.nn import GCNConv
    from fglit.models import CachedEncoder
    seed_everything(0)
    x, ei, _ = random_graph(sparse=sparse)
    layer, ref = GCNLayer(x.size(1), 5), GCNConv(x.size(1), 5)
    with torch.no_grad():
        ref.lin.weight.copy_(layer.weight.T); layer.bias.copy_(torch.randn(5)); ref.bias.copy_(layer.bias)
    enc = CachedEncoder()
    xin = enc.input_operand(x)
    assert isinstance(xin, SparseOperand) == sparse
    out, out_ref = layer(xin, enc.adjacency_operand(x, ei)), ref(x, ei)
    assert torch.allclose(out, out_ref, atol=1e-5)
    g = torch.autograd.grad(out.square().sum(), [layer.weight, layer.bias])
    g_ref = torch.autograd.grad(out_ref.square().sum(), [ref.lin.weight, ref.bias])
    assert torch.allclose(g[0], g_ref[0].T, atol=1e-4) and torch.allclose(g[1], g_ref[1], atol=1e-4)


# ---------------------------------------------------------------- weighted edges
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_edge_weights(name):
    x, ei, _ = random_graph()
    m = make(name).eval()
    if name == "GAT":
        with pytest.raises(NotImplementedError):
            m(x, ei, edge_weight=torch.ones(ei.size(1)))
        return
    assert torch.allclose(m(x, ei), m(x, ei, edge_weight=torch.ones(ei.size(1))), atol=1e-5)   # unit weights = no weights
    w = torch.rand(ei.size(1), generator=torch.Generator().manual_seed(1)) + 0.1
    if name != "MLP":
        assert not torch.allclose(m(x, ei), m(x, ei, edge_weight=w), atol=1e-4)               # the weights are used


def test_weighted_gcn_adjacency_matches_dense_formula():
    x, ei, _ = random_graph()
    ei = ei[:, ei[0] != ei[1]]
    w = torch.rand(ei.size(1), generator=torch.Generator().manual_seed(2))
    A = torch.zeros(N, N).index_put_((ei[1], ei[0]), w, accumulate=True) + torch.eye(N)
    d = A.sum(1).rsqrt()
    assert torch.allclose(adjacency(ei, N, "gcn", edge_weight=w).to_dense(), d[:, None] * A * d[None, :], atol=1e-6)


def test_kipf_gcn_is_the_papers_formula():
    x, ei, _ = random_graph()
    m = make("KipfGCN", dropout=0.0).eval()
    A = adjacency(ei, N, "gcn").to_dense()
    c = m.encoder.convs[0]
    h = torch.relu(A @ (x @ c.weight) + c.bias)
    assert len(m.encoder.convs) == 1
    assert torch.allclose(m(x, ei), A @ (h @ m.head[1].weight.T) + m.head[1].bias, atol=1e-5)
    with pytest.raises(ValueError):
        build_model("KipfGCN", F_IN, C, layers=1)


# ---------------------------------------------------------------- GIN's sparse first layer must not leak (torch 2.13 CSR x CSR did)
@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads the resident set size from /proc")
def test_gin_sparse_input_does_not_leak():
    from fglit.models import SparseGINConv, _gin_mlp, adjacency, _to_csr
    def rss_mb(): return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**20
    g = torch.Generator().manual_seed(0)
    n = 4000
    A = adjacency(torch.randint(0, n, (2, 4 * n), generator=g), n, "sum", torch.float32, None)
    x = _to_csr((torch.rand(n, 37, generator=g) < 0.03).float())
    conv = SparseGINConv(_gin_mlp(37, 64))
    for _ in range(50): conv(x, A).sum().backward()            # warm up the allocator
    before = rss_mb()
    for _ in range(400): conv(x, A).sum().backward()
    assert rss_mb() - before < 30, f"resident memory grew {rss_mb() - before:.0f} MB over 400 steps"   # the leak: ~110 MB

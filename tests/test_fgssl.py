"""Tests for FGSSL (`fglit.algorithms.fgssl`, from nbs/10b_fgssl.ipynb): the segment softmax over neighbours, the
structure distillation and the semantic contrast against dense references, the client, end-to-end runs."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch_geometric.data import Data

from _device import same_run

from fglit.algorithms.fedavg import FedAvgClient, FedAvgServer
from fglit.algorithms.fgssl import (FGSSLClient, FGSSLConfig, neighbour_edges, neighbour_log_distribution, segment_log_softmax,
                                    semantic_contrast_loss, structure_distillation_loss)
from fglit.federation import ClientInfo, ConfigError, LocalData, ModelSpec, flat_state, get_algorithm, make_config, run

SETTINGS = settings(max_examples=50, deadline=None, derandomize=True)
F64 = torch.float64


@st.composite
def random_graphs(draw):
    "A random directed graph on n nodes (duplicate edges and self-loops allowed, some nodes without in-edges) with embeddings."
    n, e, d = draw(st.integers(1, 12)), draw(st.integers(0, 40)), draw(st.integers(1, 5))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    edges = torch.randint(0, n, (2, e), generator=g)
    return n, edges, torch.randn(n, d, generator=g, dtype=F64), torch.randn(n, d, generator=g, dtype=F64)


# -- registration and configuration ---------------------------------------------------------------
def test_registered_as_fedavg_with_a_calibrated_client_for_node_tasks_only():
    algo = get_algorithm("fgssl")
    assert algo.client is FGSSLClient and algo.server is FedAvgServer and algo.config is FGSSLConfig and "IJCAI 2023" in algo.paper
    assert issubclass(FGSSLClient, FedAvgClient) and algo.takes_sums() and vars(FGSSLClient).get("stacked") is None
    c = make_config(FGSSLConfig)
    assert (c.contrast_weight, c.contrast_temperature, c.positives, c.structure_weight, c.structure_temperature) == (1.0, 0.1, "sum", 1.0, 0.1)
    assert FGSSLConfig.node_task_only and not FGSSLConfig.logits_only and not FGSSLConfig.one_model_only
    spec = ModelSpec("gin", 5, 2, "graph", 8, 2, 0.0)
    with pytest.raises(ConfigError, match="node-classification method"):
        FedAvgServer(c, [ClientInfo(0, 4, 4)], spec)


@pytest.mark.parametrize("bad, match", [({"contrast_temperature": 0.0}, "contrast_temperature"),
                                        ({"structure_temperature": -1.0}, "structure_temperature"),
                                        ({"contrast_weight": -0.5}, "contrast_weight"), ({"structure_weight": float("inf")}, "structure_weight"),
                                        ({"positives": "max"}, "positives"), ({"tau": 0.1}, "unknown setting")])
def test_config_errors_name_the_setting(bad, match):
    with pytest.raises(ConfigError, match=match):
        make_config(FGSSLConfig, bad)


# -- structure: segment softmax and distillation ----------------------------------------------------
@SETTINGS
@given(random_graphs(), st.floats(0.05, 5.0))
def test_neighbour_distributions_sum_to_one_and_match_a_dense_softmax(graph, temperature):
    "Around every node with a neighbour the probabilities sum to 1 and equal the softmax over its in-edges; self-loops are dropped."
    n, edges, z, _ = graph
    edges = neighbour_edges(edges)
    assert bool((edges[0] != edges[1]).all())
    logp = neighbour_log_distribution(z, edges, temperature)
    assert logp.shape == (edges.size(1),) and bool((logp <= 1e-12).all())
    sums = torch.zeros(n, dtype=F64).index_add_(0, edges[1], logp.exp())
    has = torch.zeros(n, dtype=torch.bool); has[edges[1]] = True
    assert torch.allclose(sums[has], torch.ones(int(has.sum()), dtype=F64)) and bool((sums[~has] == 0).all())
    for i in has.nonzero().flatten().tolist():          # the reference, one node at a time
        mine = (edges[1] == i).nonzero().flatten()
        sims = F.cosine_similarity(z[i].expand(len(mine), -1), z[edges[0, mine]], dim=-1) / temperature
        assert torch.allclose(logp[mine], sims.log_softmax(0), atol=1e-10)


@SETTINGS
@given(st.lists(st.floats(-30, 30), min_size=1, max_size=20), st.integers(1, 5), st.integers(0, 2**16))
def test_segment_log_softmax_is_stable_and_normalised(scores, segments, seed):
    s = torch.tensor(scores, dtype=F64) * 50                                  # up to +-1500: exp overflows without the shift
    index = torch.randint(0, segments, (len(scores),), generator=torch.Generator().manual_seed(seed))
    out = segment_log_softmax(s, index, segments)
    assert bool(torch.isfinite(out).all())
    totals = torch.zeros(segments, dtype=F64).index_add_(0, index, out.exp())
    assert torch.allclose(totals[index.unique()], torch.ones(index.unique().numel(), dtype=F64))


@SETTINGS
@given(random_graphs(), st.floats(0.05, 5.0))
def test_structure_kl_is_zero_for_the_global_embeddings_and_positive_otherwise(graph, temperature):
    n, edges, z_global, z_other = graph
    edges = neighbour_edges(edges)
    logp = neighbour_log_distribution(z_global, edges, temperature)
    assert structure_distillation_loss(z_global, logp, edges, temperature).abs() < 1e-10
    assert structure_distillation_loss(2.5 * z_global, logp, edges, temperature).abs() < 1e-10       # cosines: scale-free
    kl = structure_distillation_loss(z_other, logp, edges, temperature)
    dense = sum(F.kl_div(neighbour_log_distribution(z_other, edges, temperature)[edges[1] == i], logp[edges[1] == i],
                         reduction="sum", log_target=True) for i in edges[1].unique().tolist()) / max(edges[1].unique().numel(), 1)
    assert kl >= -1e-12 and torch.isclose(kl, torch.as_tensor(dense, dtype=F64), atol=1e-9)
    local = neighbour_log_distribution(z_other, edges, temperature)
    if not torch.allclose(local.exp(), logp.exp(), atol=1e-6):
        assert kl > 0


# -- semantics: the supervised contrast -------------------------------------------------------------
@SETTINGS
@given(st.integers(1, 8), st.integers(1, 8), st.integers(1, 4), st.integers(1, 4), st.floats(0.05, 2.0),
       st.sampled_from(["sum", "mean"]), st.integers(0, 2**16))
def test_semantic_contrast_matches_its_formula(n, m, d, classes, tau, positives, seed):
    g = torch.Generator().manual_seed(seed)
    z, zg = torch.randn(n, d, generator=g, dtype=F64), torch.randn(m, d, generator=g, dtype=F64)
    y, yg = torch.randint(0, classes, (n,), generator=g), torch.randint(0, classes, (m,), generator=g)
    losses = []
    for i in range(n):
        sims = torch.stack([F.cosine_similarity(z[i], zg[j], dim=0) for j in range(m)]) / tau
        pos = yg == y[i]
        if not bool(pos.any()): continue
        if positives == "sum":
            losses.append(-(sims[pos].exp().sum() / sims.exp().sum()).log())
        else:
            losses.append(-(sims[pos] - sims.logsumexp(0)).mean())
    got = semantic_contrast_loss(z, y, zg, yg, tau, positives)
    want = torch.stack(losses).mean() if losses else torch.zeros((), dtype=F64)
    assert torch.isclose(got, want, atol=1e-9)


def test_semantic_contrast_is_lower_next_to_the_own_class():
    zg, yg = torch.tensor([[1.0, 0.0], [0.9, 0.1], [-1.0, 0.0]]), torch.tensor([0, 0, 1])
    near, far = torch.tensor([[1.0, 0.05]]), torch.tensor([[-1.0, 0.05]])
    for form in ("sum", "mean"):
        assert semantic_contrast_loss(near, torch.tensor([0]), zg, yg, 0.1, form) < semantic_contrast_loss(far, torch.tensor([0]), zg, yg, 0.1, form)


# -- the client -------------------------------------------------------------------------------------
def ring_client(settings=None, n=24):
    ring = torch.arange(n)
    g = torch.Generator().manual_seed(0)
    data = Data(x=torch.randn(n, 5, generator=g), edge_index=torch.cat([torch.stack([ring, (ring + 1) % n]), torch.stack([(ring + 1) % n, ring]),
                                                                       torch.stack([ring, ring])], 1),          # self-loops included
                y=ring % 3, train_mask=ring < 12, val_mask=(ring >= 12) & (ring < 18), test_mask=ring >= 18)
    spec = ModelSpec("gcn", 5, 3, "node", 8, 2, 0.0)
    return FGSSLClient(0, LocalData(data, "node"), make_config(FGSSLConfig, settings or {}), spec), spec


def test_client_keeps_every_node_embedding_and_drops_self_loops():
    torch.manual_seed(0)
    client, spec = ring_client()
    assert client.edges.size(1) == 48 and bool((client.edges[0] != client.edges[1]).all())
    w = flat_state(spec.build())
    client.receive({"params": w})
    assert client.global_train.shape == (12, 8) and client.global_log_p.shape == (48,)
    b = client.data.train_batches()[0]
    emb, logits = client.embed(client.model, b)
    assert client.local_nodes.shape == (24, 8) and torch.equal(client.local_nodes[b.select], emb)
    loss = client.extra_loss(b, emb, logits)                        # the local model is the global one: only the contrast is left
    assert client.local_nodes is None
    expected = semantic_contrast_loss(emb, b.y, client.global_train, client.global_y, 0.1, "sum")
    assert torch.isclose(loss, expected, atol=1e-6)


@pytest.mark.parametrize("settings, zero", [({"contrast_weight": 0.0, "structure_weight": 0.0}, True), ({"structure_weight": 0.0}, False),
                                             ({"contrast_weight": 0.0}, False)])
def test_weights_switch_the_terms(settings, zero):
    torch.manual_seed(0)
    client, spec = ring_client(settings)
    client.receive({"params": flat_state(spec.build())})
    b = client.data.train_batches()[0]
    with torch.no_grad():
        for p in client.model.parameters(): p.add_(0.3 * torch.randn_like(p))   # local model away from the global one
    emb, logits = client.embed(client.model, b)
    loss = client.extra_loss(b, emb, logits)
    assert (float(loss.detach()) == 0.0) == zero


# -- end to end ---------------------------------------------------------------------------------------
def test_cora_learns_repeats_and_sends_fedavgs_bytes(cora_parts):
    ds, parts = cora_parts
    kw = dict(rounds=4, local_epochs=8, seeds=[0], progress=False, settings={"hidden": 16})
    first = run("fgssl", ds, parts, **kw)
    assert first.summary()["accuracy_mean"] > 2.5 / ds.num_classes                  # well above chance (1/7)
    again = run("fgssl", ds, parts, **kw)
    assert same_run(first.runs[0].history, again.runs[0].history)
    avg = run("fedavg", ds, parts, **kw)
    assert first.summary()["bytes_up"] == avg.summary()["bytes_up"] and first.summary()["bytes_down"] == avg.summary()["bytes_down"]
    assert not first.runs[0].history.equals(avg.runs[0].history)                    # the terms change the training
    gamlp = run("fgssl", ds, parts, **{**kw, "rounds": 1, "local_epochs": 1, "settings": {"hidden": 16, "model": "gamlp"}})
    assert 0 <= gamlp.summary()["accuracy_mean"] <= 1

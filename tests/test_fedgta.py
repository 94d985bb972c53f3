"""Tests for FedGTA (`fglit.algorithms.fedgta`, from nbs/16_fedgta.ipynb)."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import _node_pfl as node_pfl
from hypothesis import given, settings, strategies as st
from torch_geometric.data import Data

import fglit.algorithms.fedgta  # registers "fedgta"
from fglit.algorithms.fedgta import (FedGTAClient, FedGTAConfig, FedGTAServer, accepted_sets, aggregation_weights,
                                     mixed_moments, node_degrees, propagate_labels, propagation_matrix, seed_labels,
                                     smoothing_confidence, topology_statistics)
from fglit.algorithms.pfl import cosine_matrix
from fglit.federation import ALGORITHM_MODULES, ClientInfo, ConfigError, ModelSpec, get_algorithm, make_config, run

F64 = torch.float64
SCRIPT = Path(sys.executable).parent / "fglit"


def random_graph(n, C, seed, density=0.3, train_share=0.4):
    "A random undirected graph (no self loops) with softmax class probabilities, labels and a training mask, all on the CPU."
    g = torch.Generator().manual_seed(seed)
    upper = torch.triu(torch.rand(n, n, generator=g) < density, diagonal=1)
    u, v = upper.nonzero(as_tuple=True)
    edge_index = torch.stack([torch.cat([u, v]), torch.cat([v, u])])
    probs = torch.softmax(3 * torch.randn(n, C, generator=g), 1)
    y = torch.randint(0, C, (n,), generator=g)
    train = torch.rand(n, generator=g) < train_share
    return probs, edge_index, y, train


def dense(edge_index, n, r):
    src, dst, w = propagation_matrix(edge_index, n, r)
    return torch.zeros(n, n, dtype=F64).index_put_((dst, src), w, accumulate=True)


# -- registration and configuration ---------------------------------------------------------------
def test_registered_needing_individual_messages_with_the_authors_defaults():
    algo = get_algorithm("fedgta")
    assert algo.sums_only is False and algo.config is FedGTAConfig
    assert algo.client is FedGTAClient and algo.server is FedGTAServer and "VLDB" in algo.paper
    c = make_config(FedGTAConfig)
    assert (c.lp_steps, c.lp_alpha, c.lp_r, c.temperature, c.num_moments, c.moment_type, c.accept_threshold, c.degree_offset) == (
        5, 0.5, 0.5, 20.0, 10, "hybrid", 0.5, 0.0)
    assert (c.model, c.layers, c.hidden, c.evaluation, c.local_epochs, c.lr) == (None, 2, 64, "global", 3, 0.01)


@pytest.mark.parametrize("bad, match", [({"lp_steps": -1}, "lp_steps"), ({"lp_alpha": 1.5}, "lp_alpha"), ({"lp_alpha": float("nan")}, "lp_alpha"),
                                        ({"lp_r": -0.1}, "lp_r"), ({"temperature": 0.0}, "temperature"),
                                        ({"temperature": float("inf")}, "temperature"), ({"num_moments": 0}, "num_moments"),
                                        ({"moment_type": "skew"}, "moment_type"), ({"accept_threshold": 1.01}, "accept_threshold"),
                                        ({"accept_threshold": float("nan")}, "accept_threshold"), ({"degree_offset": -1.0}, "degree_offset"),
                                        ({"graphless_model": "mlp"}, "graphless_model"), ({"tau": 1.0}, "unknown setting"),
                                        ({"num_moments": 2.5}, "num_moments")])
def test_config_errors_name_the_setting(bad, match):
    with pytest.raises(ConfigError, match=match):
        make_config(FedGTAConfig, bad)


def test_graph_tasks_and_mixed_models_are_refused():
    spec = ModelSpec("gcn", 6, 3, "node", 8, 2, 0.0)
    cfg = make_config(FedGTAConfig)
    with pytest.raises(ConfigError, match="node-classification"):
        FedGTAServer(cfg, [ClientInfo(0, 5, 5)], spec.replace(name="gin", task="graph"))
    with pytest.raises(ConfigError, match="same model"):
        FedGTAServer(cfg, [ClientInfo(0, 5, 5), ClientInfo(1, 5, 5, spec.replace(name="mlp", layers=1))], spec)


# -- statistics -----------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 14), C=st.integers(2, 5), seed=st.integers(0, 10_000), density=st.floats(0, 1),
       moment_type=st.sampled_from(["raw", "central", "hybrid"]), steps=st.integers(0, 6))
def test_statistics_are_invariant_to_node_relabelling(n, C, seed, density, moment_type, steps):
    probs, ei, y, train = random_graph(n, C, seed, density)
    cfg = make_config(FedGTAConfig, {"moment_type": moment_type, "lp_steps": steps, "num_moments": 4})
    a = topology_statistics(probs, ei, y, train, cfg)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 1))    # new id of old node i is perm[i]
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(n)
    b = topology_statistics(probs[inv], perm[ei], y[inv], train[inv], cfg)
    assert a.moments.shape == ((2 if moment_type == "hybrid" else 1) * 4, C) and a.confidence.dim() == 0
    assert torch.allclose(b.propagated, a.propagated[inv], rtol=1e-9, atol=1e-12)
    assert torch.allclose(b.moments, a.moments, rtol=1e-9, atol=1e-12)
    assert math.isclose(b.confidence.item(), a.confidence.item(), rel_tol=1e-9, abs_tol=1e-9)
    degree = node_degrees(ei, n)
    assert -1e-9 <= a.confidence.item() <= C / math.e * degree.sum().item() + 1e-9


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 12), seed=st.integers(0, 10_000), density=st.floats(0, 1), alpha=st.floats(0, 1), steps=st.integers(0, 8))
def test_propagation_operator(n, seed, density, alpha, steps):
    probs, ei, y, train = random_graph(n, 3, seed, density)
    A_sym, A_row = dense(ei, n, 0.5), dense(ei, n, 0.0)
    assert torch.allclose(A_sym, A_sym.T) and torch.allclose(A_row.sum(1), torch.ones(n, dtype=F64))
    assert (A_sym.diagonal() > 0).all()                                  # one self loop per node
    q = torch.tensor([0.2, 0.3, 0.5]).expand(n, 3)
    assert torch.allclose(propagate_labels(q, ei, steps, alpha, r=0.0), q.double())   # a row-stochastic A keeps a constant distribution
    y0 = seed_labels(probs, y, train)
    expected = y0.clone()
    for _ in range(steps):
        expected = alpha * A_sym @ expected + (1 - alpha) * y0
    assert torch.allclose(propagate_labels(y0, ei, steps, alpha), expected, atol=1e-12)


def test_seeds_use_training_labels_only_and_isolated_nodes_keep_them():
    probs = torch.tensor([[0.2, 0.8], [0.6, 0.4], [0.5, 0.5]])
    y, train = torch.tensor([0, 0, 1]), torch.tensor([True, False, False])
    s = seed_labels(probs, y, train)
    assert torch.allclose(s, torch.tensor([[1.0, 0.0], [0.6, 0.4], [0.5, 0.5]], dtype=F64))   # node 1's true label 0 is not used
    no_edges = torch.empty(2, 0, dtype=torch.long)
    assert torch.allclose(propagate_labels(s, no_edges, 5, 0.7), s)
    self_loops_only = torch.tensor([[0, 1], [0, 1]])                                            # self loops are replaced, not doubled
    assert torch.allclose(propagate_labels(s, self_loops_only, 5, 0.7), s)
    stats = topology_statistics(probs, no_edges, y, train, make_config(FedGTAConfig))
    assert stats.confidence.item() == 0.0                                                       # no neighbours, no confidence
    with_self = topology_statistics(probs, no_edges, y, train, make_config(FedGTAConfig, {"degree_offset": 1.0}))
    assert with_self.confidence.item() > 0


def test_confidence_values():
    C = 4
    assert math.isclose(smoothing_confidence(torch.eye(C, dtype=F64), torch.ones(C)).item(), C * C / math.e)
    uniform = torch.full((2, C), 1 / C, dtype=F64)
    assert math.isclose(smoothing_confidence(uniform, torch.tensor([1.0, 3.0])).item(), 4 * (C / math.e - math.log(C)), rel_tol=1e-12)
    sharp, flat = torch.tensor([[0.9, 0.1]]), torch.tensor([[0.6, 0.4]])
    assert smoothing_confidence(sharp, torch.ones(1)) > smoothing_confidence(flat, torch.ones(1)) > 0   # lower entropy, more confidence


def test_mixed_moments():
    p = torch.tensor([[1.0, 0.0], [0.5, 0.5], [0.0, 1.0], [0.5, 0.5]])
    M = mixed_moments(p, 3)
    assert M.shape == (6, 2) and M.dtype == F64
    assert torch.allclose(M[0], p.double().mean(0)) and torch.allclose(M[1], (p.double() ** 2).mean(0))
    assert torch.allclose(M[3], torch.zeros(2, dtype=F64)) and torch.allclose(M[4], p.double().var(0, unbiased=False))
    assert torch.equal(mixed_moments(p, 3, "raw"), M[:3]) and torch.equal(mixed_moments(p, 3, "central"), M[3:])
    assert torch.equal(mixed_moments(torch.empty(0, 2), 3), torch.zeros(6, 2, dtype=F64))
    with pytest.raises(ValueError, match="moment_type"):
        mixed_moments(p, 3, "skew")


# -- server weights -------------------------------------------------------------------------------
clients_moments = st.integers(1, 7).flatmap(lambda k: st.tuples(
    st.lists(st.lists(st.floats(-5, 5, allow_nan=False, width=32), min_size=4, max_size=4), min_size=k, max_size=k),
    st.lists(st.one_of(st.just(0.0), st.floats(0, 1e4)), min_size=k, max_size=k)))


@settings(max_examples=80, deadline=None)
@given(data=clients_moments, threshold=st.floats(-1, 1), seed=st.integers(0, 10_000))
def test_weights_are_row_stochastic_and_permutation_equivariant(data, threshold, seed):
    M, w = torch.tensor(data[0]), torch.tensor(data[1], dtype=F64)
    k = M.size(0)
    S = cosine_matrix(M)
    W = aggregation_weights(S, w, threshold)
    assert W.shape == (k, k) and W.dtype == F64 and (W >= 0).all()
    assert torch.allclose(W.sum(1), torch.ones(k, dtype=F64))
    accepted = (S > threshold) | torch.eye(k, dtype=torch.bool)
    assert torch.equal(accepted_sets(S, threshold), accepted)
    assert (W[~accepted] == 0).all()                                            # only accepted clients contribute
    for i in range(k):
        if w[accepted[i]].sum() > 0:
            assert torch.allclose(W[i][accepted[i]], w[accepted[i]] / w[accepted[i]].sum())
        else:
            assert torch.allclose(W[i][accepted[i]], torch.full((int(accepted[i].sum()),), 1 / accepted[i].sum().item(), dtype=F64))
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    assert torch.allclose(aggregation_weights(cosine_matrix(M[perm]), w[perm], threshold), W[perm][:, perm], atol=1e-12)


def test_thresholds_at_the_ends_and_bad_confidences():
    M, w = torch.randn(4, 6), torch.tensor([1.0, 2.0, 3.0, 4.0])
    S = cosine_matrix(M)
    assert torch.equal(aggregation_weights(S, w, 1.0), torch.eye(4, dtype=F64))
    assert torch.equal(accepted_sets(torch.zeros(3, 3, dtype=F64), 0.0), torch.eye(3, dtype=torch.bool))   # zero moments: only itself
    assert torch.allclose(aggregation_weights(S.clamp_min(-0.999), w, -1.0), (w / w.sum()).double().expand(4, 4))
    tiny = aggregation_weights(torch.zeros(3, 3, dtype=F64), torch.tensor([0.0, 0.0, 2e-313], dtype=F64), -1.0)   # subnormal: still a proper average
    assert torch.equal(tiny, torch.tensor([[0.0, 0.0, 1.0]] * 3, dtype=F64))
    with pytest.raises(ValueError, match="confidences"):
        aggregation_weights(S, torch.tensor([1.0, -1.0, 1.0, 1.0]), 0.5)
    with pytest.raises(ValueError, match="confidences"):
        aggregation_weights(S, torch.tensor([1.0, float("nan"), 1.0, 1.0]), 0.5)


# -- client and server ----------------------------------------------------------------------------
# cora_parts (conftest): Cora and its 3-client Louvain partition, seed 0


def make_clients(ds, part, datas=None, **settings):
    return node_pfl.make_clients(FedGTAConfig, FedGTAServer, FedGTAClient, ds, part, datas, **settings)


def test_one_round_messages_and_personalised_models(cora_parts):
    ds, part = cora_parts
    cfg, spec, server, clients = make_clients(ds, part)
    down = server.broadcast(1, [0, 1, 2])
    assert all(set(m) == {"params"} for m in down.values()) and all(torch.equal(down[i]["params"], down[0]["params"]) for i in (1, 2))
    up = {i: clients[i].local_step(down[i], 1) for i in range(3)}
    assert all(set(m) == {"params", "moments", "confidence"} for m in up.values())
    assert up[0]["moments"].shape == (2 * cfg.num_moments * ds.num_classes,) and isinstance(up[0]["confidence"], float)
    server.aggregate(1, up)
    W = server.weights
    assert torch.allclose(W.sum(1), torch.ones(3, dtype=F64, device=W.device)) and (W.diagonal() > 0).all()
    thetas = torch.stack([up[i]["params"] for i in range(3)])
    assert torch.allclose(server.params, (W @ thetas.double()).float(), atol=1e-6)
    assert torch.equal(server.evaluation_message(1)["params"], server.params[1])


def test_unselected_clients_keep_their_model(cora_parts):
    ds, part = cora_parts
    _, _, server, clients = make_clients(ds, part)
    node_pfl.check_unselected_clients_keep_their_model(server, clients)


def test_threshold_one_gives_every_client_its_own_model(cora_parts):
    ds, part = cora_parts
    _, _, server, clients = make_clients(ds, part, accept_threshold=1.0)
    up = {i: clients[i].local_step(server.broadcast(1, [i])[i], 1) for i in range(3)}
    server.aggregate(1, up)
    assert torch.allclose(server.params, torch.stack([up[i]["params"] for i in range(3)]))


def test_missing_class_and_edgeless_clients(cora_parts):
    ds, part = cora_parts
    c0, c1 = part.clients[0], part.clients[1]
    missing = c0.subgraph(c0.y != int(torch.bincount(c0.y).argmax()))            # drop the client's largest class
    bare = Data(x=c1.x, y=c1.y, edge_index=torch.empty(2, 0, dtype=torch.long), num_nodes=c1.num_nodes,
                train_mask=c1.train_mask, val_mask=c1.val_mask, test_mask=c1.test_mask)
    cfg, _, server, clients = make_clients(ds, part, datas=[missing, bare, part.clients[2]])
    up = {i: clients[i].local_step(server.broadcast(1, [i])[i], 1) for i in range(3)}
    assert up[0]["moments"].shape == up[2]["moments"].shape and torch.isfinite(up[0]["moments"]).all()
    assert up[1]["confidence"] == 0.0 and up[0]["confidence"] > 0
    server.aggregate(1, up)
    W = server.weights
    assert torch.allclose(W.sum(1), torch.ones(3, dtype=F64, device=W.device)) and (W[[0, 2], 1] == 0).all()


# -- runs -----------------------------------------------------------------------------------------
def test_short_cora_run_beats_the_majority_class(shared_root):
    r = run("fedgta", "Cora", "louvain", 3, rounds=10, seeds=[0], root=shared_root, progress=False)
    from fglit.data import load_dataset
    y = load_dataset("Cora", shared_root).data.y
    majority = float(torch.bincount(y).max()) / y.numel()
    pr = r.per_round()["test_accuracy"]
    assert r.summary()["accuracy_mean"] > majority + 0.3 and pr.iloc[-1] > pr.iloc[0] + 0.1
    comm = r.communication()
    up, down = comm[comm.direction == "up"], comm[comm.direction == "down"]
    assert (up.floats.to_numpy() - down.floats.to_numpy() == 2 * 10 * 7).all()    # the moments ride beside the weights


def test_partial_participation_and_a_single_client(shared_root):
    r = run("fedgta", "Cora", "louvain", 4, rounds=2, seeds=[0], settings={"hidden": 16, "client_fraction": 0.5},
            root=shared_root, progress=False)
    assert r.communication().groupby("round").client.nunique().eq(2).all()
    r1 = run("fedgta", "Cora", "louvain", 1, rounds=2, seeds=[0], settings={"hidden": 16}, root=shared_root, progress=False)
    assert math.isfinite(r1.summary()["accuracy_mean"])


def test_graph_datasets_are_refused_before_training(shared_root):
    with pytest.raises(ConfigError, match="node-classification"):
        run("fedgta", "MUTAG", "dirichlet", 2, rounds=1, seeds=[0], settings={"alpha": 0.5}, root=shared_root, progress=False)


CLI_ARGS = ["run", "fedgta", "--dataset", "Cora", "--partition", "louvain", "--clients", "5", "--rounds", "2", "--json", "--quiet"]


def check_cli_output(out):
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout)
    assert s["algorithm"] == "fedgta" and s["rounds"] == 2 and s["clients"] == 5 and 0 < s["accuracy_mean"] <= 1
    assert s["config"]["accept_threshold"] == 0.5 and s["floats_up"] - s["floats_down"] == 2 * 5 * 2 * 10 * 7


def test_cli_run_fedgta(shared_root):
    "`fglit run fedgta ...` through the CLI's entry point, in a fresh interpreter that imports the module first."
    code = "import sys, fglit.algorithms.fedgta; from fglit.cli import main; sys.exit(main(sys.argv[1:]))"
    out = subprocess.run([sys.executable, "-c", code, *CLI_ARGS], capture_output=True, text=True,
                         env={**os.environ, "FGLIT_DATA": str(shared_root)}, timeout=600)
    check_cli_output(out)


def test_console_script_run_fedgta(shared_root):
    assert SCRIPT.is_file(), f"the fglit console script is not installed at {SCRIPT}"
    out = subprocess.run([str(SCRIPT), *CLI_ARGS], capture_output=True, text=True, env={**os.environ, "FGLIT_DATA": str(shared_root)},
                         timeout=600)
    check_cli_output(out)

"""Tests for O-pFGL (`fglit.algorithms.opfgl`, from nbs/20_opfgl.ipynb), `fedavg_ft` and the reproduction harness."""
import json
import os
import subprocess
import shutil
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from hypothesis import given, settings, strategies as st

from fglit.algorithms.opfgl import (HETERO_MODELS, LinkPredictor, OpFGLConfig, class_alignment, class_homophily, class_mean_std,
                                    class_moment_sums,
                                    distillation_weights, generate_surrogate, label_propagation, node_homophily,
                                    pooled_statistics, reliable_nodes, soft_labels, sum_messages, surrogate_class_sizes)
from fglit.federation import ConfigError, make_config, run

from _device import cpu_routine


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


# ---------------------------------------------------------------- step B: sums only, exact pooling
@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 40), d=st.integers(1, 4), classes=st.integers(1, 4), clients=st.integers(1, 5),
       seed=st.integers(0, 10_000))
def test_pooled_statistics_equal_the_union(n, d, classes, clients, seed):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, d, generator=g), torch.randint(0, classes, (n,), generator=g)
    owner = torch.randint(0, clients, (n,), generator=g)
    replies = {k: class_moment_sums(x, y, owner == k, classes, min_count=1) for k in range(clients)}
    sums = sum_messages(replies, ("count", "sum", "sum_sq"))
    mean, var = pooled_statistics(sums["count"], sums["sum"], sums["sum_sq"])
    for c in range(classes):
        xc = x[y == c].double()
        assert sums["count"][c] == len(xc)
        if len(xc):
            assert torch.allclose(mean[c], xc.mean(0), atol=1e-9)
        if len(xc) > 1:
            assert torch.allclose(var[c], xc.var(0), atol=1e-9)          # unbiased, over the union
        else:
            assert torch.all(var[c] == 0)


def test_min_class_count_zeroes_small_classes():
    x, y = torch.randn(5, 3), torch.tensor([0, 0, 1, 2, 2])
    s = class_moment_sums(x, y, torch.ones(5, dtype=torch.bool), 3, min_count=2)
    assert s["count"].tolist() == [2, 0, 2] and torch.all(s["sum"][1] == 0) and torch.all(s["sum_sq"][1] == 0)


def test_server_output_depends_only_on_the_sums():
    "What secure aggregation needs: merging two clients' messages into one (and a zero message) changes nothing."
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 6, generator=g), torch.randint(0, 3, (40,), generator=g)
    owner = torch.randint(0, 3, (40,), generator=g)
    keys = ("count", "sum", "sum_sq")
    replies = {k: class_moment_sums(x, y, owner == k, 3) for k in range(3)}
    merged = {0: {k: replies[0][k] + replies[1][k] for k in keys}, 1: {k: torch.zeros_like(replies[2][k]) for k in keys},
              2: replies[2]}
    config = make_config(OpFGLConfig, dict(surrogate_iters=20))
    graphs = []
    for r in (replies, merged):
        s = sum_messages(r, keys)
        mean, var = pooled_statistics(s["count"], s["sum"], s["sum_sq"])
        graphs.append(generate_surrogate(mean, var, s["count"], s["count"], 3, config, seed=3))   # stats of F=3, L=1
    assert torch.equal(graphs[0].x, graphs[1].x) and torch.equal(graphs[0].edge_weight, graphs[1].edge_weight)


# ---------------------------------------------------------------- step A: label propagation, homophily, HRE
def test_label_propagation_and_soft_labels():
    ei = torch.tensor([[0, 1, 1, 2, 2, 3], [1, 0, 2, 1, 3, 2]])          # path 0-1-2-3
    y, labeled = torch.tensor([0, 0, 1, 1]), torch.tensor([True, False, False, True])
    lp = label_propagation(ei, 4, y, labeled, 2, iters=1, alpha=0.9)
    # one step from Y0: node 1 hears node 0 (class 0) with weight 1/sqrt(1*2), node 2 hears node 3 (class 1)
    assert torch.allclose(lp[1], torch.tensor([0.9 / 2 ** 0.5, 0.0])) and torch.allclose(lp[2], torch.tensor([0.0, 0.9 / 2 ** 0.5]))
    assert lp.max() <= 1 and lp.min() >= 0
    soft, has = soft_labels(torch.tensor([[2.0, 2.0], [0.0, 0.0]]))
    assert torch.allclose(soft, torch.full((2, 2), 0.5)) and has.tolist() == [True, False]


def test_node_and_class_homophily():
    # star: 0 (class 0) linked to 1 (class 0), 2 (class 1), 3 (unlabeled)
    ei = torch.tensor([[0, 1, 0, 2, 0, 3], [1, 0, 2, 0, 3, 0]])
    y, labeled = torch.tensor([0, 0, 1, 1]), torch.tensor([True, True, True, False])
    h = node_homophily(ei, y, labeled)
    assert h.tolist() == [0.5, 1.0, 0.0, 0.0]                           # node 3 is unlabeled
    assert class_homophily(h, y, labeled, 2).tolist() == [1.5, 0.0]     # a sum over the class's labeled nodes


def test_reliable_node_criteria():
    soft = torch.tensor([[1.0, 0.0], [0.96, 0.04], [0.5, 0.5], [0.0, 1.0], [1.0, 0.0]])
    has = torch.ones(5, dtype=torch.bool)
    degree = torch.tensor([5, 5, 5, 5, 1])
    labeled = torch.tensor([True, False, False, False, False])
    class_h = torch.tensor([3.0, 1.0])                                  # class 0 is the top-1 homophilic class
    full = reliable_nodes(soft, has, degree, labeled, class_h, tau=3, delta=0.95, top_k=1)
    assert full.tolist() == [False, True, False, False, False]          # 3 fails C3, 4 fails C1, 2 fails C2, 0 labeled
    no_c1 = reliable_nodes(soft, has, degree, labeled, class_h, 3, 0.95, 1, ("confidence", "homophily"))
    assert no_c1.tolist() == [False, True, False, False, True]
    none = reliable_nodes(soft, has, degree, labeled, class_h, 3, 0.95, 1, ())
    assert none.tolist() == [False, True, True, True, True]


# ---------------------------------------------------------------- step C and stage 2 pieces
def test_link_predictor_is_symmetric():
    torch.manual_seed(0)
    g = LinkPredictor(5, 8)
    logits = g(torch.randn(6, 5))
    assert torch.allclose(logits, logits.T)


def test_surrogate_sizes_and_graph():
    config = make_config(OpFGLConfig, dict(surrogate_iters=150, surrogate_max_nodes=5))
    sizes = surrogate_class_sizes(torch.tensor([10., 0., 4.]), torch.tensor([True, False, True]), config)
    assert sizes.tolist() == [1, 0, 1]
    ratio = make_config(OpFGLConfig, dict(surrogate_ratio=0.5, surrogate_max_nodes=6))
    assert surrogate_class_sizes(torch.tensor([10., 3., 4.]), torch.ones(3, dtype=torch.bool), ratio).sum() == 6   # capped
    g = torch.Generator().manual_seed(0)
    mean = torch.randn(3, 8, generator=g).double()
    count = torch.tensor([5., 5., 0.])
    graph = generate_surrogate(mean, torch.ones(3, 8).double(), count, count, 4, make_config(OpFGLConfig, dict(surrogate_iters=150)))
    assert graph.y.tolist() == [0, 1] and graph.x.shape == (2, 4)       # one node per present class; hops=1 -> 2F stats
    assert (graph.edge_index[0] != graph.edge_index[1]).all() and (graph.edge_weight >= 0.01).all()
    assert graph.history[-1]["align"] < graph.history[0]["align"]


def test_distillation_weights():
    soft = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]])
    lam = distillation_weights(soft, torch.tensor([0.0, 10.0]), alpha=0.2)
    assert lam[0] == pytest.approx(0.2) and lam[1] < lam[0]             # homophilic class 1 distils less
    assert lam[2] == pytest.approx((lam[0] + lam[1]) / 2)
    assert distillation_weights(soft, torch.zeros(2), 0.2, hi=0.1).max() == pytest.approx(0.1)


def test_config_errors():
    for bad in [dict(rounds=3), dict(hre_criteria="degree,height"), dict(lambda_mode="soft"), dict(min_class_count=0),
                dict(model_pool="zoo"), dict(surrogate_edge_steps=60), dict(finetune_lr=0.0), dict(lambda_labels="normalised")]:
        with pytest.raises(ConfigError):
            make_config(OpFGLConfig, bad)


def test_cli_rejects_bad_opfgl_setting(shared_root):
    script = Path(sys.executable).parent / "fglit"
    out = subprocess.run([str(script), "run", "opfgl", "--dataset", "Cora", "--set", "rounds=5"], capture_output=True, text=True,
                         env={**os.environ, "FGLIT_DATA": str(shared_root)})
    assert out.returncode == 2 and "one-shot" in out.stderr and out.stderr.count("\n") == 1


# ---------------------------------------------------------------- end to end on Cora (shortened schedules)
QUICK = dict(surrogate_iters=60, stage1_iters=200, finetune_iters=200, eval_interval=50)


@pytest.fixture(scope="module")
def cora_runs_servers(shared_root):
    "The plain and server-efficient runs, and each one's server."
    servers = {}
    def keep(name):
        return lambda rnd, server, clients: servers.__setitem__(name, server)
    plain = run("opfgl", "Cora", "louvain+", 4, seeds=[0], settings=QUICK, progress=False, callback=keep("plain"))
    efficient = run("opfgl", "Cora", "louvain+", 4, seeds=[0], settings={**QUICK, "server_efficient": True}, progress=False,
                    callback=keep("efficient"))
    return (plain, efficient), servers


@pytest.fixture(scope="module")
def cora_runs(cora_runs_servers):
    return cora_runs_servers[0]


def test_opfgl_one_upload_one_download(cora_runs):
    plain, _ = cora_runs
    comm = plain.communication()
    sent = comm[comm.bytes > 0]
    assert sorted(map(tuple, sent[["round", "direction"]].drop_duplicates().values.tolist())) == [(1, "up"), (2, "down")]
    assert (sent.groupby(["client", "direction"]).size() == 1).all() and sent.client.nunique() == 4
    assert plain.summary()["accuracy_mean"] > 0.5
    assert (plain.config["hre_degree"], plain.config["hre_confidence"]) == (20, 1.0)   # Cora-Louvain defaults applied by run


def test_server_efficient_variant_is_the_same_run(cora_runs):
    plain, efficient = cora_runs
    assert plain.per_client().accuracy.tolist() == efficient.per_client().accuracy.tolist()
    assert efficient.summary()["bytes_down"] != plain.summary()["bytes_down"]        # it downloads statistics instead


def test_server_efficient_clients_build_the_servers_graph(cora_runs_servers):
    "What a client builds from the server-efficient download is the graph the plain server built, bit for bit (on the CPU)."
    from fglit.algorithms.opfgl import surrogate_from_sums
    _, servers = cora_runs_servers
    plain, efficient = servers["plain"], servers["efficient"]
    message = efficient.broadcast(2, [0])[0]
    assert message["sum"].dtype == message["sum_sq"].dtype == torch.float64      # the sums as the server holds them
    built = surrogate_from_sums(message, plain.spec.in_dim, efficient.config, int(message["graph_seed"]))
    if built.x.device.type == "cpu":
        for name in ("x", "edge_index", "edge_weight", "y"):
            a, b = getattr(built, name), getattr(plain.graph, name)
            assert a.shape == b.shape and torch.equal(a, b), name
    else:      # CUDA's atomic adds sum in a varying order, so two builds of one graph differ a little: the same nodes, features within 5%
        assert torch.equal(built.y, plain.graph.y)
        assert (built.x - plain.graph.x).norm() <= 0.05 * plain.graph.x.norm()


def test_heterogeneous_models(shared_root):
    from fglit.algorithms.opfgl import OpFGLClient
    from fglit.data import load_dataset
    from fglit.federation import LocalData, ModelSpec
    from fglit.partition import partition
    ds = load_dataset("Cora")
    part = partition(ds, "louvain+", 10, seed=0)
    config = make_config(OpFGLConfig, dict(model_pool="hetero"))
    spec = ModelSpec("gcn", ds.num_features, ds.num_classes, "node", 64, 2, 0.0)
    for cid in (0, 3, 8, 9):
        client = OpFGLClient(cid, LocalData(part.clients[cid], "node"), config, spec)
        want = HETERO_MODELS[cid]
        assert type(client.model).__name__.lower() == want["name"]
        assert client.spec.hidden == want["hidden"] and client.spec.layers == want["layers"]
        if "K" in want:
            assert client.model.encoder.K == want["K"]


def test_fedavg_finetune_sends_once_each_way_then_nothing(shared_root):
    res = run("fedavg_ft", "Cora", "metis+", 3, rounds=4, local_epochs=1, seeds=[0], progress=False)
    comm = res.communication()
    sent = comm[comm.bytes > 0][["round", "direction"]].drop_duplicates().values.tolist()
    assert sorted(map(tuple, sent)) == [(1, "down"), (1, "up"), (2, "down")]
    assert res.config["evaluation"] == "local"
    with pytest.raises(ConfigError):
        run("fedavg_ft", "Cora", "metis+", 3, rounds=1, seeds=[0], progress=False)


# ---------------------------------------------------------------- the reproduction harness
def test_paper_numbers_hold_the_printed_cells():
    from fglit.papers.opfgl import paper_numbers
    p = paper_numbers()
    cell = p.query("table == '1' and dataset == 'Cora' and method == 'O-pFGL' and metric == 'accuracy'").iloc[0]
    assert (cell["mean"], cell["std"]) == (76.43, 1.24)
    cell = p.query("table == '5' and dataset == 'CiteSeer' and method == 'O-pFGL' and metric == 'f1_macro'").iloc[0]
    assert (cell["mean"], cell["std"]) == (50.94, 0.80)
    assert p.query("note == 'OOM'")["mean"].isna().all()


def test_side_by_side_joins_and_differences():
    from fglit.papers.opfgl import Experiment, side_by_side
    from dataclasses import asdict
    e = Experiment("1", "Cora", "louvain+", 10, "O-pFGL", "opfgl", paper_table="1", paper_method="O-pFGL")
    rows = pd.DataFrame([dict(**asdict(e), seed=s, accuracy=a, f1_macro=0.5, f1_macro_present=0.6) for s, a in [(0, 0.70), (1, 0.80)]])
    t = side_by_side(rows).set_index("metric")
    assert t.loc["accuracy", "ours"] == pytest.approx(75.0) and t.loc["accuracy", "paper"] == 76.43
    assert t.loc["accuracy", "diff"] == pytest.approx(75.0 - 76.43) and t.loc["accuracy", "seeds"] == 2
    assert t.loc["f1_macro_present", "ours"] == pytest.approx(60.0) and t.loc["f1_macro_present", "paper"] == 61.58


def test_reproduce_resumes(tmp_path, shared_root):
    from fglit.papers.opfgl import opfgl_experiments, reproduce
    exps = [e for e in opfgl_experiments(tables=("4",), datasets=("Cora",)) if e.method == "Standalone"]
    out = tmp_path / "runs.csv"
    first = reproduce(exps, seeds=(0,), out=out, quick=True, progress=False)
    assert len(first) == 1 and out.exists()
    second = reproduce(exps, seeds=(0,), out=out, quick=True, progress=False)
    assert len(second) == 1 and len(pd.read_csv(out)) == 1            # nothing re-run, nothing appended
    assert len(reproduce([], seeds=(0,), out=out, progress=False)) == 0   # only the rows asked for come back
    with pytest.raises(ValueError):
        opfgl_experiments(tables=("99",))


def test_grid_rows_of_the_pfgl_baselines_and_the_fedgta_epochs():
    "FedTAD, Fed-PUB and FedGTA in every one-shot table (one round; FedTAD then fine-tuned); gta-epochs varies only FedGTA's local epochs, against the paper's Table 1 cell."
    from fglit.papers.opfgl import FEDGTA_EPOCHS, ONE_SHOT_TABLES, opfgl_experiments
    grid = opfgl_experiments(tables=tuple(ONE_SHOT_TABLES), datasets=("Cora",))
    by = {(e.table, e.method): e for e in grid}
    for t in ONE_SHOT_TABLES:
        tad, pub, gta = by[(t, "FedTAD")], by[(t, "FedPUB")], by[(t, "FedGTA")]
        assert json.loads(tad.settings)["federated_rounds"] == 1 and tad.rounds == 100
        assert pub.rounds == gta.rounds == 1 and pub.local_epochs == gta.local_epochs == 300 and json.loads(pub.settings)["hidden"] == 64
        assert {tad.paper_method, pub.paper_method, gta.paper_method} == {"FedTAD", "FedPUB", "FedGTA"} and tad.paper_table == t
    sens = opfgl_experiments(tables=("gta-epochs",), datasets=("Cora", "CiteSeer"))
    assert sorted((e.dataset, e.local_epochs) for e in sens) == sorted((d, n) for d in ("Cora", "CiteSeer") for n in FEDGTA_EPOCHS)
    assert {(e.method, e.rounds, e.paper_table, e.settings) for e in sens} == {("FedGTA", 1, "1", by[("1", "FedGTA")].settings)}


# ---------------------------------------------------------------- bad input: never a NaN, never a crash
def _client(n, classes_labeled, edges=True, seed=0, num_features=6):
    from torch_geometric.data import Data
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 3
    x = torch.randn(n, num_features, generator=g) + y.unsqueeze(1).float()
    ei = torch.randint(0, n, (2, 3 * n), generator=g) if edges else torch.empty(2, 0, dtype=torch.long)
    ei = torch.cat([ei, ei.flip(0)], 1)
    train = torch.zeros(n, dtype=torch.bool)
    for c, k in classes_labeled.items():
        train[(y == c).nonzero().view(-1)[:k]] = True
    rest = (~train).nonzero().view(-1)
    val = torch.zeros(n, dtype=torch.bool); val[rest[::2]] = True
    test = ~train & ~val
    return Data(x=x, edge_index=ei, y=y, train_mask=train, val_mask=val, test_mask=test, num_nodes=n)


def _simulate(clients, num_classes=4, **settings):
    from fglit.federation import get_algorithm, simulate
    box = {}
    cfg = make_config(OpFGLConfig, {**QUICK, **settings})
    seed_run = simulate(get_algorithm("opfgl"), clients, "node", 6, num_classes, cfg, seed=0, progress=False,
                        callback=lambda rnd, server, cl: box.update(server=server, clients=cl))
    return seed_run, box


def test_missing_classes_graphless_client_and_one_node_per_class():
    clients = [_client(30, {0: 4, 1: 4, 2: 4}),                  # a normal client
               _client(30, {0: 4, 1: 4}, edges=False, seed=1),  # no edges; class 2 has no labeled node
               _client(30, {0: 1, 1: 1, 2: 1}, seed=2)]         # one labeled node per class (below min_class_count)
    seed_run, box = _simulate(clients, hre=False)                # class 3 is on no client at all
    sums = box["server"].sums
    assert all(torch.isfinite(v).all() for v in sums.values())
    assert sums["count"].tolist() == [8, 8, 4, 0]                # client 3's classes skipped, class 3 absent
    mean, var = pooled_statistics(sums["count"], sums["sum"], sums["sum_sq"])
    assert torch.isfinite(mean).all() and torch.isfinite(var).all() and (var[3] == 0).all()
    assert 3 not in box["server"].graph.y.tolist()               # no surrogate node for a class nobody has
    h = seed_run.history
    assert h.accuracy.notna().all() and len(h) == 6              # 3 clients x (val, test), one evaluated round
    graphless = box["clients"][1]
    assert not graphless.has_mass[~graphless.train_mask].any()   # no edges: label propagation reaches nobody


def test_no_statistics_anywhere_falls_back_to_local_training():
    clients = [_client(30, {0: 1, 1: 1, 2: 1}, seed=s) for s in range(3)]
    with pytest.warns(UserWarning, match="fewer than two classes"):
        seed_run, box = _simulate(clients, num_classes=3, hre=False)
    assert box["server"].graph is None and all(c.log["surrogate"] == "none" for c in box["clients"])
    assert seed_run.history.accuracy.notna().all()


def test_lambda_labels_raw_is_the_codes_lp_scores():
    "lambda_labels='raw' (the authors' code) weighs the clamped LP scores, 'soft' (the paper) their row-normalised form."
    clients = [_client(30, {0: 4, 1: 4, 2: 4}), _client(30, {0: 4, 1: 4}, seed=1)]
    _, soft_box = _simulate(clients, hre=False)
    _, raw_box = _simulate(clients, hre=False, lambda_labels="raw")
    c = raw_box["clients"][0]
    assert c.log["lambda_mean"] < soft_box["clients"][0].log["lambda_mean"]      # on this graph the raw scores sum to < 1
    mass = c.lp_scores.sum(1, keepdim=True)
    assert torch.allclose(c.lp_scores[c.has_mass] / mass[c.has_mass], c.soft[c.has_mass])     # same direction, raw scale
    assert not torch.allclose(c.lp_scores, c.soft)
    assert torch.equal(c.lp_scores[~c.has_mass], c.soft[~c.has_mass])                         # empty rows: uniform in both


def test_client_without_labels_only_distils():
    clients = [_client(30, {0: 4, 1: 4, 2: 4}), _client(30, {}, seed=1)]
    seed_run, box = _simulate(clients, num_classes=3)
    assert seed_run.history.accuracy.notna().all()
    assert box["clients"][1].log["classes_sent"] == 0 and box["clients"][1].log["stage2_iters"] > 0


def test_cli_run_opfgl_json(shared_root):
    script = Path(sys.executable).parent / "fglit"
    out = subprocess.run([str(script), "run", "opfgl", "--dataset", "Cora", "--partition", "louvain+", "--clients", "10", "--json",
                          "--set", "surrogate_iters=50", "stage1_iters=100", "finetune_iters=100", "eval_interval=50"],
                         capture_output=True, text=True, env={**os.environ, "FGLIT_DATA": str(shared_root)}, timeout=600)
    assert out.returncode == 0, out.stderr
    s = __import__("json").loads(out.stdout)
    assert s["algorithm"] == "opfgl" and s["communication_rounds"] == 1 and len(s["per_client"]) == 10
    assert 0 < s["accuracy_mean"] <= 1 and s["bytes_up"] > 0 and s["bytes_down"] > 0


def test_reproduce_survives_a_failing_run(tmp_path, shared_root):
    from fglit.papers.opfgl import Experiment, reproduce
    bad = Experiment("x", "Cora", "louvain+", 10_000, "Standalone", "standalone", rounds=1, local_epochs=1)   # more clients than nodes
    good = Experiment("x", "Cora", "metis+", 3, "Standalone", "standalone", rounds=1, local_epochs=1)
    out = tmp_path / "runs.csv"
    with pytest.warns(UserWarning, match="1 run"):
        rows = reproduce([bad, good], seeds=(0,), out=out, progress=False)
    assert len(rows) == 1 and len(pd.read_csv(out)) == 1 and rows.clients.tolist() == [3]


# ---------------------------------------------------------------- the authors' code's behaviours as named options
def test_early_stopping_ties_and_strict():
    "'ties' keeps the last of equal best scores; 'strict' the first, and leaves a model never above 0 as trained."
    from fglit.algorithms.opfgl import EarlyStopping
    model = torch.nn.Linear(1, 1, bias=False)
    kept = {}
    for strict in (False, True):
        stop = EarlyStopping(model, patience=2, strict=strict)
        for step, score in enumerate([0.5, 0.5, 0.4, 0.3]):
            model.weight.data.fill_(step)
            if stop.check(score): break
        kept[strict] = stop.restore().weight.item()
        assert step == (2 if strict else 3)                      # stops after two checks without progress: a tie is none when strict
    assert kept == {False: 1.0, True: 0.0}
    stop = EarlyStopping(model, patience=5, strict=True)
    model.weight.data.fill_(7.0); stop.check(0.0)
    assert stop.restore().weight.item() == 7.0 and stop.state is None


def test_shared_init_sends_one_initial_model_and_clients_load_it(monkeypatch):
    from fglit.algorithms.opfgl import OpFGLClient
    from fglit.federation import flat_state
    clients = [_client(30, {0: 4, 1: 4, 2: 4}), _client(30, {0: 4, 1: 4}, seed=1)]
    stage1, seen = OpFGLClient.stage1, []
    def spy(self, graph):          # each client's model as stage 1 starts
        seen.append(flat_state(self.model).clone())
        return stage1(self, graph)
    monkeypatch.setattr(OpFGLClient, "stage1", spy)
    states = {}
    for init in ("client", "shared"):
        seen.clear()
        seed_run, box = _simulate(clients, hre=False, model_init=init)
        states[init] = list(seen)
        if init == "shared":
            assert torch.equal(seen[0], box["server"].init_state) and torch.equal(seen[1], seen[0])
            assert seed_run.history.accuracy.notna().all()
    assert not torch.equal(states["client"][0], states["client"][1])      # by default each client draws its own
    with pytest.raises(ConfigError, match="model_init"):
        make_config(OpFGLConfig, dict(model_init="shared", model_pool="hetero"))


def test_smoothness_forms_differ_by_sign_and_a_constant():
    from fglit.algorithms.opfgl import smoothness_loss
    x, adj = torch.randn(5, 3), torch.rand(5, 5)
    pen, sim = smoothness_loss(x, adj), smoothness_loss(x, adj, "similarity")
    assert torch.allclose(pen + sim, torch.tensor(1.0))
    with pytest.raises(ConfigError, match="smoothness"):
        make_config(OpFGLConfig, dict(smoothness="kernel"))


def test_link_init_concat_draws_as_one_linear_on_the_pairs():
    "'concat' bounds the split first layer by 1/sqrt(2F), as one Linear(2F, h); 'split' by 1/sqrt(F)."
    import math
    F_ = 200
    torch.manual_seed(0)
    split, concat = LinkPredictor(F_, 64), LinkPredictor(F_, 64, init="concat")
    for lp, bound in ((split, 1 / math.sqrt(F_)), (concat, 1 / math.sqrt(2 * F_))):
        for p in (lp.a.weight, lp.b.weight, lp.a.bias):
            assert p.abs().max() <= bound and p.abs().max() > 0.9 * bound
    with pytest.raises(ConfigError, match="link_init"):
        make_config(OpFGLConfig, dict(link_init="wide"))


@settings(max_examples=25, deadline=None)
@given(C=st.integers(2, 6), D=st.integers(1, 9), absent=st.integers(0, 5), seed=st.integers(0, 10_000))
def test_class_alignment_without_std_terms_is_exactly_the_full_formula(C, D, absent, seed):
    "One node per class (the surrogate's default): skipping the std terms (`multi=None`) gives bit for bit the value and the gradient of the full formula, whose std terms are all multiplied by 0."
    g = torch.Generator().manual_seed(seed)
    labels = torch.tensor([c for c in range(C) if c != absent % C])          # one node per present class, one class absent
    target_mean, target_std = torch.randn(C, D, generator=g), torch.rand(C, D, generator=g)
    feats = torch.randn(len(labels), D, generator=g)
    fast_x, full_x = feats.clone().requires_grad_(True), feats.clone().requires_grad_(True)
    fast = class_alignment(fast_x, labels, C, target_mean, target_std, None)
    m, s, count = class_mean_std(full_x, labels, C)
    full = (m - target_mean).pow(2).mean(1) + (s - target_std).pow(2).mean(1) * (count > 1)
    assert torch.equal(fast, full)
    weights = torch.rand(C, generator=g)
    (fast * weights).sum().backward(); (full * weights).sum().backward()
    assert torch.equal(fast_x.grad, full_x.grad)
    two = torch.cat([labels, labels[:1]])                                     # a class with two nodes keeps its std term
    x2 = torch.randn(len(two), D, generator=g)
    m2, s2, c2 = class_mean_std(x2, two, C)
    assert torch.equal(class_alignment(x2, two, C, target_mean, target_std, c2 > 1),
                       (m2 - target_mean).pow(2).mean(1) + (s2 - target_std).pow(2).mean(1) * (c2 > 1))


@given(n=st.integers(1, 8), D=st.integers(1, 12), scale=st.floats(0.1, 3.0), seed=st.integers(0, 10_000))
@settings(max_examples=40, deadline=None)
def test_pair_similarity_matches_the_direct_formula_and_its_autograd_gradient(n, D, scale, seed):
    "The closed-form backward of `pair_similarity` gives the value and the gradient autograd gets from the direct formula, for any downstream weights (not only symmetric ones)."
    from fglit.algorithms.opfgl import pair_similarity
    g = torch.Generator().manual_seed(seed)
    x = (scale * torch.randn(n, D, generator=g, dtype=torch.float64)).requires_grad_(True)
    w = torch.randn(n, n, generator=g, dtype=torch.float64)          # an arbitrary, asymmetric upstream gradient
    direct = torch.exp(-0.5 * (x.unsqueeze(1) - x.unsqueeze(0)).pow(2)).mean(-1)
    (grad_direct,) = torch.autograd.grad((w * direct).sum(), x)
    fast = pair_similarity(x)
    (grad_fast,) = torch.autograd.grad((w * fast).sum(), x)
    torch.testing.assert_close(fast, direct, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad_fast, grad_direct, rtol=1e-10, atol=1e-12)
    assert torch.autograd.gradcheck(pair_similarity, (x.detach().clone().requires_grad_(True),))


def test_stage_workers_need_the_stacked_engine_and_split_clients_by_size():
    "stage_workers shares the stacked engine's stages: the sequential engine refuses it; the groups cover every client once, balanced by node count."
    import types
    from fglit.algorithms.opfgl_stacked import StackedOpFGL
    from fglit.federation import ConfigError
    with pytest.raises(ConfigError, match="engine='stacked'"):
        OpFGLConfig(stage_workers=2).validate()
    OpFGLConfig(stage_workers=2, engine="stacked").validate()
    sizes = [50, 10, 40, 30, 20, 5]
    fake = types.SimpleNamespace(config=types.SimpleNamespace(stage_workers=2),
                                 data=[types.SimpleNamespace(graph=types.SimpleNamespace(num_nodes=n, x=torch.zeros(1))) for n in sizes])
    groups = StackedOpFGL.worker_groups(fake, list(range(6)))
    assert sorted(k for g in groups for k in g) == list(range(6)) and all(g == sorted(g) for g in groups)
    loads = [sum(sizes[k] for k in g) for g in groups]
    assert len(groups) == 2 and max(loads) - min(loads) <= max(sizes[k] for k in range(6) if sizes[k] > 0) and sum(loads) == sum(sizes)
    fake.config.stage_workers = 9                       # more workers than clients: one client each
    assert sorted(map(len, StackedOpFGL.worker_groups(fake, [0, 1, 2]))) == [1, 1, 1]
    fake.config.stage_workers = 1
    assert StackedOpFGL.worker_groups(fake, [0, 1, 2]) == [[0, 1, 2]]


def test_stage_workers_stay_in_one_process_where_autograd_refuses_forked_copies(monkeypatch):
    "Where a forked copy could not run autograd (a CUDA machine's process that has trained), the stages stay here, with a warning; the probe itself says yes in a process that may fork."
    import types
    import fglit.algorithms.opfgl_stacked as stacked
    fake = types.SimpleNamespace(config=types.SimpleNamespace(stage_workers=2),
                                 data=[types.SimpleNamespace(graph=types.SimpleNamespace(num_nodes=n, x=torch.zeros(1))) for n in (5, 4, 3)])
    assert len(stacked.StackedOpFGL.worker_groups(fake, [0, 1, 2])) == 2
    monkeypatch.setattr(stacked, "autograd_can_fork", lambda: False)
    with pytest.warns(RuntimeWarning, match="refuses to run in a copy forked"):
        assert stacked.StackedOpFGL.worker_groups(fake, [0, 1, 2]) == [[0, 1, 2]]
    monkeypatch.undo()
    torch.ones(2, requires_grad=True).sum().backward()          # this process has trained: without CUDA, a forked copy still may
    assert stacked.autograd_can_fork(always_probe=True) or torch.cuda.is_available()


@given(n=st.integers(2, 6), F_=st.integers(1, 9), hidden=st.integers(1, 8), seed=st.integers(0, 10_000))
@settings(max_examples=30, deadline=None)
def test_link_predictor_forward_is_its_modules_bit_for_bit(n, F_, hidden, seed):
    "The functional forward (no nn.Module calls) gives the logits and gradients of the layers called as modules."
    torch.manual_seed(seed)
    g = LinkPredictor(F_, hidden)
    x = torch.randn(n, F_, requires_grad=True)
    pairs = (g.a(x).unsqueeze(1) + g.b(x).unsqueeze(0)).reshape(n * n, -1)
    ref = g.rest(pairs).view(n, n)
    ref = (ref + ref.T) / 2
    (gx_ref,) = torch.autograd.grad(ref.sin().sum(), x)
    out = g(x)
    (gx,) = torch.autograd.grad(out.sin().sum(), x)
    assert torch.equal(out, ref) and torch.equal(gx, gx_ref)


@given(C=st.integers(2, 7), D=st.integers(1, 9), seed=st.integers(0, 10_000))
def test_one_node_per_class_alignment_is_the_class_mean_formula_bit_for_bit(C, D, seed):
    "With node c the only node of class c (the surrogate graph's default), its own row is its class mean: the per-class term the surrogate takes directly equals class_alignment's, value and gradient."
    g = torch.Generator().manual_seed(seed)
    target_mean, target_std = torch.randn(C, D, generator=g), torch.rand(C, D, generator=g)
    feats = torch.randn(C, D, generator=g)
    a, b = feats.clone().requires_grad_(True), feats.clone().requires_grad_(True)
    direct = (a - target_mean).pow(2).mean(1)
    general = class_alignment(b, torch.arange(C), C, target_mean, target_std, None)
    assert torch.equal(direct, general)
    w = torch.rand(C, generator=g)
    (w * direct).sum().backward(); (w * general).sum().backward()
    assert torch.equal(a.grad, b.grad)


def _cora_class_statistics():
    "Cora's per-class statistics of [X || ÂX] over every node, pooled as the server pools the clients' sums."
    from fglit.algorithms.opfgl import class_moment_sums, pooled_statistics, propagated_features
    from fglit.data import load_dataset
    g = load_dataset("Cora").data
    sums = class_moment_sums(propagated_features(g.x, g.edge_index, 1), g.y, torch.ones(g.num_nodes, dtype=torch.bool), int(g.y.max()) + 1)
    mean, var = pooled_statistics(sums["count"], sums["sum"], sums["sum_sq"])
    return mean, var, sums["count"], g.x.size(1)


needs_cc = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="surrogate_kernel='c' needs a C compiler")


@needs_cc
def test_surrogate_kernel_c_follows_the_torch_path(tmp_path, monkeypatch):
    "The C routine's surrogate graph follows the torch path's: the same losses along 300 steps (to float rounding, which the two sum in different orders)."
    from fglit.algorithms.opfgl import OpFGLConfig, generate_surrogate
    monkeypatch.setenv("FGLIT_CACHE", str(tmp_path))
    mean, var, count, d = _cora_class_statistics()
    runs = {k: generate_surrogate(mean, var, count, count, d, OpFGLConfig(surrogate_iters=300, surrogate_kernel=k), seed=0, log_every=10)
            for k in ("torch", "c")}
    t, c = (pd.DataFrame(runs[k].history) for k in ("torch", "c"))
    assert len(t) == len(c) == 31 and t.iteration.equals(c.iteration)
    for col in ("align", "smooth", "loss"):
        assert ((t[col] - c[col]).abs() <= 1e-4 * t[col].abs() + 1e-9).all(), col
    assert torch.allclose(runs["torch"].x, runs["c"].x, atol=1e-4)
    assert runs["torch"].kernel == "torch" and runs["c"].kernel == "c"      # each graph says which kernel built it


@needs_cc
def test_surrogate_kernel_c_hands_what_it_does_not_cover_to_torch(tmp_path, monkeypatch):
    "Two nodes per class are not the routine's: a warning says so and the torch path builds the graph (the same graph as asking for torch)."
    from fglit.algorithms.opfgl import OpFGLConfig, generate_surrogate
    monkeypatch.setenv("FGLIT_CACHE", str(tmp_path))
    mean, var, count, d = _cora_class_statistics()
    with pytest.warns(UserWarning, match="surrogate_kernel='c' does not cover"):
        c = generate_surrogate(mean, var, count, count, d, OpFGLConfig(surrogate_iters=20, surrogate_nodes_per_class=2, surrogate_kernel="c"), seed=0)
    t = generate_surrogate(mean, var, count, count, d, OpFGLConfig(surrogate_iters=20, surrogate_nodes_per_class=2), seed=0)
    assert torch.equal(c.x, t.x) and torch.equal(c.edge_weight, t.edge_weight)
    assert c.kernel == t.kernel == "torch"          # asked for 'c', built by torch: the graph records torch


def test_surrogate_kernel_c_without_a_compiler_says_so(tmp_path, monkeypatch):
    "With no C compiler to be found, asking for the C routine ends in one clear error naming what is missing."
    import fglit.algorithms.opfgl_kernel as K
    from fglit.federation import ConfigError
    monkeypatch.setenv("FGLIT_CACHE", str(tmp_path))
    monkeypatch.setattr(K, "_LIB", None)
    monkeypatch.setattr("shutil.which", lambda name: None)        # fglit.fl.gcn_kernel.build_library looks the compiler up
    with pytest.raises(ConfigError, match="needs a C compiler"):
        K.load_kernel()


@needs_cc
def test_loading_the_surrogate_kernel_leaves_floats_as_they_are(tmp_path):
    "Loading the compiled routine must not switch the process to flushing denormal floats to zero (a library linked with -ffast-math would, and every other test's numbers would change)."
    code = ("import torch, fglit.algorithms.opfgl_kernel as K; before = torch.tensor(1e-40).item(); K.load_kernel(); "
            "after = torch.tensor(1e-40).item(); assert before == after > 0, (before, after); print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "FGLIT_CACHE": str(tmp_path)}, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]


_OOM_PROBE = r'''
import ctypes, resource, torch
import fglit.algorithms.opfgl_kernel as K
lib = K.load_kernel()
ctypes.CDLL(None).mallopt(-3, 128 * 1024)   # M_MMAP_THRESHOLD, fixed: each large buffer is a mapping of its own, unmapped when freed
n, h, F = 300, 64, 8                          # each n*n*h buffer is 23 MB
ins = [torch.rand(*s) for s in ((n, F), (n, h), (n, h), (h,), (h,), (h, h), (h,), (h,), (h,), (h,), (1,), (n, 2 * F), (n,))]
outs = [torch.zeros(3), torch.zeros(n, h), torch.zeros(n, h), torch.zeros(n, F)]
mapped = lambda: int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
before = mapped()
resource.setrlimit(resource.RLIMIT_AS, (before + (64 << 20), resource.RLIM_INFINITY))
rcs = [lib.surrogate_step(n, h, F, *map(K._ptr, ins), ctypes.c_float(0.5), ctypes.c_float(1.0), ctypes.c_float(1.0), 0, 1, 0, None,
                          *map(K._ptr, outs), *([None] * 8)) for _ in range(3)]
print("rcs", rcs, "grew", mapped() - before)
'''


@needs_cc
@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads the process's mapped size from Linux's /proc")
def test_surrogate_kernel_short_of_memory_returns_an_error_and_frees_what_it_took(tmp_path):
    "Under an address-space limit that lets the routine have only some of its buffers, each call returns 1 (no crash) and gives back the buffers it did get (the routine before this check kept them: 49 MB a call)."
    done = subprocess.run([sys.executable, "-c", _OOM_PROBE], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "FGLIT_CACHE": str(tmp_path), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    rcs, grew = done.stdout.split("rcs ")[1].split(" grew ")
    assert rcs == "[1, 1, 1]" and int(grew) < (1 << 20), done.stdout


# ---------------------------------------------------------------- the two stages in C (stage_kernel='c', 20b)
def _stage_logs(shared_root, **settings):
    "O-pFGL on Cora (Louvain+, 4 clients, the quick schedules), stacked: its result and its clients' logs."
    box = {}
    r = run("opfgl", "Cora", "louvain+", 4, seeds=[0], settings={**QUICK, "engine": "stacked", **settings}, progress=False,
            callback=lambda rnd, server, clients: box.update(logs=pd.DataFrame([dict(c.log) for c in clients])))
    return r, box["logs"]


def test_stage_kernel_c_needs_the_stacked_engine():
    OpFGLConfig(stage_kernel="c", engine="stacked").validate()
    with pytest.raises(ConfigError, match="stage_kernel='c'.*engine='stacked'"):
        OpFGLConfig(stage_kernel="c").validate()


@needs_cc
@cpu_routine
def test_stage_kernel_c_follows_the_torch_path(shared_root, tmp_path, monkeypatch):
    "The stages in C train the same clients as the torch path to float rounding: the same early stops or a check apart, validation and test accuracy within 2 points per client; the logs say which kernel trained."
    monkeypatch.setenv("FGLIT_CACHE", str(tmp_path))
    (t, t_logs), (c, c_logs) = (_stage_logs(shared_root, stage_kernel=k) for k in ("torch", "c"))
    assert t_logs.stage_kernel.eq("torch").all() and c_logs.stage_kernel.eq("c").all()
    for col in ("stage1_iters", "stage2_iters"):
        assert ((t_logs[col] - c_logs[col]).abs() <= QUICK["eval_interval"]).all(), col
    for col in ("stage1_val", "stage2_val"):
        assert ((t_logs[col] - c_logs[col]).abs() <= 0.02).all(), col
    assert ((t.per_client().accuracy - c.per_client().accuracy).abs() <= 0.02).all()


@needs_cc
@cpu_routine
def test_stage_kernel_c_hands_what_it_does_not_cover_to_torch(shared_root, tmp_path, monkeypatch):
    "Dropout is not the routine's: a warning says so, the torch path trains (the same run as asking for torch) and the logs say torch."
    monkeypatch.setenv("FGLIT_CACHE", str(tmp_path))
    with pytest.warns(UserWarning, match="stage_kernel='c' does not cover this run"):
        c, c_logs = _stage_logs(shared_root, stage_kernel="c", dropout=0.3)
    t, t_logs = _stage_logs(shared_root, dropout=0.3)
    assert c_logs.stage_kernel.eq("torch").all()
    assert c.per_client().accuracy.tolist() == t.per_client().accuracy.tolist()


@needs_cc
@cpu_routine
def test_stage_kernel_steps_in_chunks_are_its_steps_one_by_one_and_leave_the_others_alone(shared_root, tmp_path, monkeypatch):
    "n steps in one call are n calls of one step, bit for bit; a client outside `active` keeps its weights, moments and step count."
    from fglit.algorithms.opfgl_kernel import StageKernel
    from fglit.algorithms.opfgl_stacked import StackedOpFGL
    from fglit.data import load_dataset
    from fglit.fl.local_data import clients_data
    from fglit.fl.protocol import ModelSpec
    from fglit.partition import partition
    monkeypatch.setenv("FGLIT_CACHE", str(tmp_path))
    cora = load_dataset("Cora", root=shared_root)
    cfg = make_config(OpFGLConfig, {"engine": "stacked"})
    spec = ModelSpec("kipfgcn", cora.num_features, cora.num_classes, "node", cfg.hidden, cfg.layers, 0.0)
    data = clients_data(partition(cora, "louvain+", 4, seed=0).clients, "node")
    runs = [(torch.manual_seed(0), StackedOpFGL(data, cfg, spec, None))[1] for _ in range(2)]
    active = torch.tensor([True, False, True, True])
    kernels = []
    for r in runs:
        r.params.reset_optimizer(1e-3)
        train = r.stack.masks["train"]
        ce = torch.zeros(train.numel()); ce[train] = 1.0 / r.stack.num_train[r.stack.client[train]].float()
        kernels.append(StageKernel(r.params, r.stack, ce))
    before = runs[0].params.flat().clone()
    kernels[0].steps(active, 7)
    for _ in range(7): kernels[1].steps(active, 1)
    a, b = runs[0].params, runs[1].params
    assert torch.equal(a.flat(), b.flat()) and all(torch.equal(x, y) for x, y in zip(a.m + a.v, b.m + b.v))
    assert a.steps.tolist() == b.steps.tolist() == [7, 0, 7, 7]
    assert torch.equal(a.flat()[1], before[1]) and not torch.equal(a.flat()[0], before[0])
    assert all(float(m[1].abs().max()) == 0.0 for m in a.m + a.v)


def test_stage_kernel_c_without_a_compiler_says_so(tmp_path, monkeypatch):
    import fglit.algorithms.opfgl_kernel as K
    import fglit.fl.gcn_kernel as G                       # the routine the stages share with FedAvg's local_kernel
    monkeypatch.setenv("FGLIT_CACHE", str(tmp_path))
    monkeypatch.setattr(G, "_LIB", None)
    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(ConfigError, match="stage_kernel='c' compiles a small C routine and needs a C compiler"):
        K.load_stage_kernel()


@settings(max_examples=20, deadline=None)
@given(shapes=st.lists(st.tuples(st.integers(1, 9), st.integers(1, 70)), min_size=1, max_size=3), lr=st.sampled_from([1e-3, 5e-3, 0.05]),
       wd=st.sampled_from([0.0, 5e-4]), steps=st.integers(1, 12), seed=st.integers(0, 10_000))
def test_step_adam_is_torchs_fused_adam_bit_for_bit(shapes, lr, wd, steps, seed):
    "StepAdam (the surrogate graph's optimizer on the CPU) gives torch.optim.Adam(fused=True)'s weights and moments bit for bit, step after step."
    from fglit.fl.protocol import StepAdam
    g = torch.Generator().manual_seed(seed)
    mine = [torch.randn(*s, generator=g).requires_grad_() for s in shapes]
    theirs = [p.detach().clone().requires_grad_() for p in mine]
    a, b = StepAdam(mine, lr, weight_decay=wd), torch.optim.Adam(theirs, lr=lr, weight_decay=wd, fused=True)
    for _ in range(steps):
        for p, q in zip(mine, theirs):
            p.grad = torch.randn(p.shape, generator=g) * 10 ** float(torch.randint(-6, 1, (1,), generator=g))
            q.grad = p.grad.clone()
        a.step(); b.step()
    for i, (p, q) in enumerate(zip(mine, theirs)):
        assert torch.equal(p, q)
        assert torch.equal(a.exp_avg[i], b.state[q]["exp_avg"]) and torch.equal(a.exp_avg_sq[i], b.state[q]["exp_avg_sq"])

"""The federation core: wire format and byte counts, configs, aggregation, the simulator's
guarantees (FedAvg with one client is centralised training; seeds repeat), and the baselines."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from fglit.core import cpu_compute, get_device, seed_everything
from fglit.data import load_dataset
from fglit.federation import (POOLS, ConfigError, FedConfig, decode_message, encode_message, flat_state, get_algorithm,
                              make_config, make_optimizer, message_floats, message_nbytes, round_seed, run, simulate, weighted_mean)
from fglit.models import build_model

from _device import same_run

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8, torch.bool]


@st.composite
def messages(draw):
    out = {}
    for i in range(draw(st.integers(0, 5))):
        key = f"f{i}_" + draw(st.text("abcxyz", max_size=4))
        if draw(st.booleans()):
            shape = draw(st.lists(st.integers(0, 4), max_size=3))
            dtype = draw(st.sampled_from(DTYPES))
            t = (torch.randn(shape) * 10).to(dtype) if dtype.is_floating_point else torch.randint(0, 2 if dtype == torch.bool else 100, shape).to(dtype)
            out[key] = t
        else:
            out[key] = draw(st.one_of(st.none(), st.booleans(), st.integers(-10**9, 10**9), st.floats(allow_nan=False), st.text(max_size=5)))
    return out


@settings(max_examples=60, deadline=None)
@given(messages())
def test_wire_format_roundtrips_and_sizes_exactly(msg):
    buf = encode_message(msg) if msg else b""
    assert message_nbytes(msg) == len(buf)
    if msg:
        back = decode_message(buf)
        assert back.keys() == msg.keys()
        for k, v in msg.items():
            if isinstance(v, torch.Tensor):
                assert back[k].dtype == v.dtype and back[k].shape == v.shape and torch.equal(back[k], v)
            else:
                assert back[k] == v
    assert message_floats(msg) == sum(v.numel() for v in msg.values() if isinstance(v, torch.Tensor) and v.is_floating_point())


def test_only_tensors_and_scalars_travel():
    with pytest.raises(TypeError, match="only tensors, arrays and scalars"):
        message_nbytes({"model": torch.nn.Linear(2, 2)})


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 6), st.integers(1, 20), st.data())
def test_weighted_mean_matches_numpy(k, d, data):
    vecs = [torch.tensor(data.draw(st.lists(st.floats(-100, 100), min_size=d, max_size=d)), dtype=torch.float64) for _ in range(k)]
    weights = data.draw(st.lists(st.floats(0.5, 1000), min_size=k, max_size=k))
    expected = np.average(np.stack([v.numpy() for v in vecs]), axis=0, weights=weights)
    assert np.allclose(weighted_mean(vecs, weights).numpy(), expected)
    assert torch.equal(weighted_mean(vecs[:1], weights[:1]), vecs[0])      # one client: bit for bit


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 300), st.integers(1, 20000), st.integers(0, 2**31 - 1))
def test_weighted_mean_into_its_buffer_is_the_plain_products_sum(k, d, seed):
    "weighted_mean writes the product into a buffer kept for its shape (MEAN_SCRATCH_FLOATS): the same floats as the plain product, call after call, and a result the next call does not overwrite."
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(k, d, generator=g)
    vecs = list(base.unbind(0)) if seed % 2 else [v.clone() for v in base.unbind(0)]   # rows of one tensor, or apart
    weights = (torch.rand(k, generator=g) * 100 + 0.5).tolist()
    w = torch.tensor(weights)
    plain = (torch.stack(vecs) * (w / w.sum()).unsqueeze(1)).sum(0)
    first = weighted_mean(vecs, weights)
    again = weighted_mean([v * 2 for v in vecs], weights)
    assert torch.equal(first, plain) and torch.equal(again, (torch.stack(vecs) * 2 * (w / w.sum()).unsqueeze(1)).sum(0))   # (first read after the second call)


def test_config_conversion_and_errors():
    cfg = make_config(FedConfig, {"rounds": 3.0, "lr": 1, "model": "gin", "client_fraction": 0.5})
    assert cfg.rounds == 3 and isinstance(cfg.rounds, int) and cfg.lr == 1.0
    for bad, match in [({"rnds": 1}, "unknown setting 'rnds'.*allowed: rounds"), ({"rounds": "x"}, "must be int"),
                       ({"rounds": 2.5}, "must be int"), ({"rounds": 0}, "rounds must be >= 1"),
                       ({"client_fraction": 1.5}, "client_fraction"), ({"evaluation": "both"}, "evaluation must be one of")]:
        with pytest.raises(ConfigError, match=match):
            make_config(FedConfig, bad)


@pytest.fixture(scope="module")
def cora(shared_root):
    return load_dataset("Cora", shared_root)


def test_fedavg_one_client_is_centralised_training(cora):
    data, rounds, seed = cora.data, 4, 3
    recorded = []
    config = make_config(get_algorithm("fedavg").config, {"rounds": rounds, "local_epochs": 1, "model": "gcn"})
    simulate(get_algorithm("fedavg"), [data], "node", cora.num_features, cora.num_classes, config,
             seed=seed, progress=False, callback=lambda r, server, clients: recorded.append(server.params.clone()))
    seed_everything(seed)
    dev = get_device()
    d = data.clone().to(dev)          # a copy: PyG's Data.to moves in place, and `cora` is shared by the module
    model = build_model("gcn", cora.num_features, cora.num_classes, hidden=64, layers=2, dropout=0.5).to(dev)
    opt = make_optimizer(model, config)
    for step in range(1, rounds + 1):
        torch.manual_seed(round_seed(seed, step, 0))
        model.train(); opt.zero_grad()
        with cpu_compute():          # the simulator's CPU settings: float sums in the same order, denormals flushed alike
            F.cross_entropy(model(d.x, d.edge_index)[d.train_mask], d.y[d.train_mask]).backward()
            opt.step()
        if dev.type == "cpu":
            assert torch.equal(flat_state(model), recorded[step - 1]), f"diverged at step {step}"
        else:
            assert torch.allclose(flat_state(model), recorded[step - 1], atol=1e-5)


def test_fedavg_cora_louvain_reaches_078(cora):
    """The issue's bar: Cora, louvain (packed), 10 clients, 100 rounds, 3 local epochs, GCN 64, lr 0.01."""
    result = run("fedavg", cora, "louvain", 10, rounds=100, local_epochs=3, model="gcn", seeds=[0],
                 settings={"hidden": 64, "lr": 0.01, "mode": "pack"}, progress=False)
    assert result.summary()["accuracy_mean"] >= 0.78


def test_bytes_are_counted_per_message(cora):
    from fglit.partition import partition
    r = run("fedavg", cora, "louvain", 4, rounds=2, local_epochs=1, seeds=[0], progress=False)
    comm = r.communication()
    n_params = flat_state(build_model("gcn", cora.num_features, cora.num_classes, hidden=64, layers=2)).numel()
    train = [int(c.train_mask.sum()) for c in partition(cora, "louvain", 4, seed=0).clients]
    up = {k: message_nbytes({"params": torch.zeros(n_params), "weight": float(n)}) for k, n in enumerate(train)}
    down = message_nbytes({"params": torch.zeros(n_params)})
    ups = comm[comm.direction == "up"]
    assert (ups.bytes == ups.client.map(up)).all() and (comm[comm.direction == "down"].bytes == down).all()
    s = r.summary()
    assert s["bytes_up"] == 2 * sum(up.values()) and s["bytes_down"] == 2 * 4 * down and s["floats_up"] == 2 * 4 * n_params
    alone = run("standalone", cora, "louvain", 4, rounds=2, local_epochs=1, seeds=[0], progress=False).summary()
    assert alone["bytes_up"] == alone["bytes_down"] == 0


def test_client_fraction_and_seeds(cora):
    kw = dict(rounds=3, local_epochs=1, settings={"client_fraction": 0.5}, progress=False)
    r = run("fedavg", cora, "louvain", 6, seeds=[0, 1], **kw)
    for one in r.runs:
        c = one.communication
        assert (c[c.direction == "up"].groupby("round").size() == 3).all()
    again = run("fedavg", cora, "louvain", 6, seeds=[0], **kw)   # a seed repeated within one run is refused: a second run
    h = [run_.history for run_ in r.runs] + [again.runs[0].history]
    assert same_run(h[0], h[2])                               # same seed: identical, bit for bit on the CPU
    assert not h[0][["accuracy"]].equals(h[1][["accuracy"]])  # another seed: another run


BASELINES = ["standalone", "fedavg", "fedprox", "scaffold", "moon"]


@pytest.mark.parametrize("algorithm", BASELINES)
def test_baselines_run_on_node_and_graph_tasks(algorithm, cora, shared_root):
    node = run(algorithm, cora, "louvain", 3, rounds=3, local_epochs=1, seeds=[0], progress=False).summary()
    mutag = load_dataset("MUTAG", shared_root)
    graph = run(algorithm, mutag, "dirichlet", 3, rounds=3, local_epochs=1, seeds=[0], settings={"alpha": 1.0, "min_size": 5}, progress=False).summary()
    for s in (node, graph):
        assert 0.0 <= s["accuracy_mean"] <= 1.0 and len(s["per_client"]) == 3
    assert node["accuracy_mean"] > 1 / cora.num_classes        # better than chance after 3 rounds


def test_selection_last_and_best_val(cora):
    best = run("fedavg", cora, "louvain", 3, rounds=6, local_epochs=1, seeds=[0], progress=False)
    last = run("fedavg", cora, "louvain", 3, rounds=6, local_epochs=1, seeds=[0], settings={"selection": "last"}, progress=False)
    per_round = best.runs[0].per_round()
    assert best.runs[0].selected_round == int(per_round.loc[per_round.val_accuracy.idxmax(), "round"])
    assert last.runs[0].selected_round == 6


SCRIPT = Path(sys.executable).parent / "fglit"


def test_cli_run_json(shared_root):
    out = subprocess.run([str(SCRIPT), "run", "fedavg", "--dataset", "Cora", "--partition", "louvain", "--clients", "3",
                          "--rounds", "2", "--local-epochs", "1", "--seeds", "0", "1", "--json"],
                         capture_output=True, text=True, env={**os.environ, "FGLIT_DATA": str(shared_root)}, timeout=600)
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout)
    for key in ("algorithm", "dataset", "partition", "clients", "rounds", "seeds", "accuracy_mean", "accuracy_std",
                "f1_macro_mean", "f1_macro_std", "bytes_up", "bytes_down", "wall_time_s", "per_client"):
        assert key in s, key
    assert s["seeds"] == [0, 1] and 0 <= s["accuracy_mean"] <= 1 and s["bytes_up"] > 0 and len(s["per_client"]) == 3


@pytest.mark.parametrize("args, message", [
    (["run", "fedavgg", "--dataset", "Cora"], "unknown algorithm 'fedavgg'; allowed: "),
    (["run", "fedavg", "--dataset", "Cora", "--model", "gcnn"], "unknown model 'gcnn'; known models: GCN"),
    (["run", "fedavg", "--dataset", "Cora", "--set", "lr=fast"], "setting 'lr' must be float"),
    (["run", "fedavg", "--dataset", "Cora", "--set", "colour=red"], "unknown setting 'colour'"),
])
def test_cli_run_bad_input_exit_2(args, message, shared_root):
    out = subprocess.run([str(SCRIPT), *args, "--quiet"], capture_output=True, text=True,
                         env={**os.environ, "FGLIT_DATA": str(shared_root)}, timeout=300)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and message in out.stderr, out.stderr


def test_union_evaluation_equals_per_client_evaluation(cora):
    """Scoring the global model on the clients' union graph gives each client's own scores."""
    from fglit.federation import LocalData, NodeUnion, ModelSpec
    from fglit.metrics import classification_scores
    from fglit.partition import partition
    clients = partition(cora, "louvain", 5, seed=0).clients
    data = [LocalData(c, "node") for c in clients]
    spec = ModelSpec("gcn", cora.num_features, cora.num_classes, "node", 64, 2, 0.5)
    seed_everything(0)
    model = spec.build()
    union = NodeUnion(data).score(model, cora.num_classes)
    model.eval()
    for cid, d in enumerate(data):
        with torch.no_grad():
            pred = model(d.graph.x, d.graph.edge_index).argmax(-1)
        for split in ("val", "test"):
            ref = classification_scores(d.graph.y[d.masks[split]], pred[d.masks[split]], cora.num_classes)
            assert union[split][cid] == pytest.approx(ref)


def test_a_union_of_one_client_is_its_own_graph(cora):
    "A client scored alone (larger than `UNION_ROWS`) is scored on its graph's own tensors, not on copies."
    from fglit.federation import LocalData, NodeUnion
    from fglit.partition import partition
    d = LocalData(partition(cora, "louvain", 5, seed=0).clients[0], "node")
    u = NodeUnion([d])
    assert u.x is d.graph.x and u.edge_index is d.graph.edge_index and u.y is d.graph.y
    assert all(u.masks[s] is d.masks[s] for s in d.masks) and u.num_clients == 1 and (u.client == 0).all()


@pytest.mark.parametrize("union_rows", [1, 700])
def test_pooled_scores_do_not_depend_on_how_the_clients_are_grouped(cora, monkeypatch, union_rows):
    "The sequential engine's pooled scoring in unions of at most `UNION_ROWS` nodes (1: every client alone; 700: a few together) gives the one-union scores."
    import fglit.fl.loop as loop
    from fglit.partition import partition
    part = partition(cora, "metis", 8, seed=0)
    kw = dict(rounds=2, local_epochs=1, seeds=(0,), progress=False)
    one = run("fedavg", cora, part, **kw).runs[0].history
    monkeypatch.setattr(loop, "UNION_ROWS", union_rows)
    built = []
    original = loop.NodeUnion.__init__
    def counting(self, data):
        built.append(len(data)); original(self, data)
    monkeypatch.setattr(loop.NodeUnion, "__init__", counting)
    grouped = run("fedavg", cora, part, **kw).runs[0].history
    assert sum(built) == 8 and (max(built) == 1) == (union_rows == 1) and len(built) > 1
    merged = one.merge(grouped, on=["round", "client", "split"], suffixes=("_one", "_grouped"))
    assert len(merged) == len(one) == 2 * 8 * 2
    assert (merged.accuracy_one - merged.accuracy_grouped).abs().max() <= 1e-6


def test_a_client_scored_alone_reuses_its_models_adjacency(cora, monkeypatch):
    "Pooled scoring of a client alone (here `UNION_ROWS=1`) goes through the client's evaluation model, whose graph caches are its own model's: each client's adjacency is built once in the run, for training and scoring alike."
    import fglit.fl.loop as loop
    import fglit.graph_preprocessing as gp
    from fglit.partition import partition
    part = partition(cora, "metis", 4, seed=0)
    monkeypatch.setattr(loop, "UNION_ROWS", 1)
    built, original = [], gp.adjacency
    def counting(edge_index, *args, **kwargs):
        built.append(edge_index.data_ptr()); return original(edge_index, *args, **kwargs)
    monkeypatch.setattr(gp, "adjacency", counting)
    r = run("fedavg", cora, part, rounds=2, local_epochs=1, seeds=(0,), progress=False)
    assert len(r.runs[0].history) == 2 * 4 * 2 and len(built) == len(set(built)) == 4


def test_progress_bars_rounds_clients_and_silence(cora, monkeypatch, capsys):
    import fglit.fl.loop as loop
    monkeypatch.setattr(loop, "SLOW_ROUND_S", 0.0)           # every round counts as slow (the loop reads its own constant)
    run("fedavg", cora, "louvain", 3, rounds=2, local_epochs=1, progress=True)
    err = capsys.readouterr().err
    assert "fedavg Cora seed 0" in err and "round 2: clients" in err and "val=" in err
    run("fedavg", cora, "louvain", 3, rounds=2, local_epochs=1, progress=False)
    assert capsys.readouterr().err == ""


def test_fedavg_averages_each_model_among_the_clients_running_it():
    from fglit.algorithms.fedavg import FedAvgConfig, FedAvgServer
    from fglit.federation import ClientInfo, ModelSpec, flat_state, mlp_spec
    spec = ModelSpec("gcn", 5, 3, "node", 8, 2, 0.0)
    mlp = mlp_spec(spec)
    infos = [ClientInfo(0, 4, 4), ClientInfo(1, 4, 4, mlp, True), ClientInfo(2, 4, 4), ClientInfo(3, 4, 4, mlp, True)]
    server = FedAvgServer(FedAvgConfig(), infos, spec)
    n_gcn, n_mlp = len(flat_state(spec.build())), len(flat_state(mlp.build()))
    assert n_gcn != n_mlp
    down = server.broadcast(1, [0, 1, 2, 3])
    assert [len(down[c]["params"]) for c in range(4)] == [n_gcn, n_mlp, n_gcn, n_mlp]
    replies = {c: {"params": torch.full((len(down[c]["params"]),), float(c)), "weight": float(c + 1)} for c in range(4)}
    server.aggregate(1, replies)
    assert torch.allclose(server.params, torch.full((n_gcn,), (0 * 1 + 2 * 3) / 4))      # clients 0 and 2
    assert torch.allclose(server.group_params[mlp], torch.full((n_mlp,), (1 * 2 + 3 * 4) / 6))   # clients 1 and 3
    assert server.shared_evaluation_message() is None and len(server.evaluation_message(3)["params"]) == n_mlp


def test_graphless_model_runs_the_mlp_on_graphless_clients_only(shared_root):
    from fglit.federation import ConfigError, run
    seen = {}
    res = run("fedavg", "Cora", "louvain", 4, rounds=2, local_epochs=1, seeds=[0], progress=False,
              settings=dict(graphless_ratio=0.5, graphless_model="mlp", model="kipfgcn"),
              callback=lambda rnd, server, clients: seen.update({c.cid: (c.data.graphless, c.spec.name) for c in clients}))
    assert sorted(seen.values()) == [(False, "kipfgcn"), (False, "kipfgcn"), (True, "mlp"), (True, "mlp")]
    assert res.per_round().test_accuracy.notna().all()
    with pytest.raises(ConfigError, match="graphless_model must be"):
        run("fedavg", "Cora", "louvain", 4, rounds=1, settings=dict(graphless_model="nope"), progress=False)
    with pytest.raises(ConfigError, match="SCAFFOLD keeps one control variate.*same model"):
        run("scaffold", "Cora", "louvain", 4, rounds=1, settings=dict(graphless_ratio=0.5, graphless_model="mlp"), progress=False)


def test_git_commit_names_the_imported_code():
    import re
    from fglit.federation import git_commit
    c = git_commit()
    assert c is None or re.fullmatch(r"[0-9a-f]{40}(-dirty)?", c), c


def test_git_commit_sees_a_change_anywhere_in_the_package(tmp_path):
    "A run on a checkout whose fglit/ differs from HEAD (here fglit/core.py, outside fglit/fl/) is recorded as '-dirty'."
    import shutil, subprocess, sys
    from pathlib import Path
    import fglit
    repo = tmp_path / "checkout"
    shutil.copytree(Path(fglit.__file__).parent, repo / "fglit", ignore=shutil.ignore_patterns("__pycache__"))
    git = lambda *a: subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *a], cwd=repo, check=True, capture_output=True)
    git("init", "-q"); git("add", "."); git("commit", "-qm", "copy")
    ask = lambda: subprocess.run([sys.executable, "-c", "from fglit.fl.results import git_commit; print(git_commit())"], cwd=repo,
                                 env={**__import__("os").environ, "PYTHONPATH": str(repo)}, capture_output=True, text=True, check=True).stdout.strip()
    clean = ask()
    assert len(clean) == 40, clean
    with open(repo / "fglit" / "core.py", "a") as f: f.write("\n# changed\n")
    assert ask() == clean + "-dirty"


def test_cross_validation_fold_is_the_test_set(shared_root):
    from fglit.federation import ConfigError, LocalData, run
    from fglit.data import load_dataset
    from fglit.partition import partition
    p = partition(load_dataset("NCI1"), "soft_dirichlet", 4, seed=0, folds=5)
    for f in range(5):
        d = LocalData(p.clients[0], "graph", fold=f)
        _, test = p.clients[0].fold_split(f)
        assert d.counts["test"] == len(test) and d.counts["val"] == 0 and d.counts["train"] + len(test) == len(p.clients[0])
    node = partition(load_dataset("Cora"), "louvain", 3, seed=0, folds=4)
    d = LocalData(node.clients[1], "node", fold=2)
    assert bool((d.masks["test"].cpu() == (node.clients[1].fold == 2)).all()) and not bool((d.masks["train"] & d.masks["test"]).any())
    res = run("fedavg", "NCI1", "soft_dirichlet", 4, rounds=2, seeds=[0], progress=False,
              settings=dict(folds=5, fold=3, selection="last", weighting="plain"))
    assert res.per_client()["n"].sum() == sum(int((c.fold == 3).sum()) for c in p.clients)
    with pytest.raises(ConfigError, match="needs a partition made with folds"):
        run("fedavg", "NCI1", "soft_dirichlet", 4, rounds=1, settings=dict(fold=1, selection="last"), progress=False)
    with pytest.raises(ConfigError, match="no validation set"):
        run("fedavg", "NCI1", "soft_dirichlet", 4, rounds=1, settings=dict(folds=5, fold=1), progress=False)


# -- ROC AUC in the evaluation ------------------------------------------------------------------------------

def _old_predict(client, model, splits=("val", "test")):
    "`Client.predict` as it was before `outputs`: argmax per batch (graph tasks) or of `node_logits` (node tasks)."
    model.eval()
    with torch.no_grad():
        if client.data.task == "node":
            pred = client.node_logits(model).argmax(-1)
            return {s: (client.data.graph.y[client.data.masks[s]], pred[client.data.masks[s]]) for s in splits}
        out = {}
        for s in splits:
            bs = client.data.eval_batches(s)
            out[s] = (torch.cat([b.y for b in bs]) if bs else torch.empty(0, dtype=torch.long),
                      torch.cat([model(b.x, b.edge_index, b.batch).argmax(-1) for b in bs]) if bs else torch.empty(0, dtype=torch.long))
        return out


def test_predict_unchanged_and_predict_proba_gives_probabilities(cora, shared_root):
    "`predict` gives what it always gave; `predict_proba` rows are softmax probabilities; `evaluate` = `classification_scores` of both."
    from fglit.federation import Client, LocalData, ModelSpec
    from fglit.metrics import classification_scores
    from fglit.partition import partition
    nci1 = load_dataset("NCI1", shared_root)
    cases = [(cora, partition(cora, "louvain", 3, seed=0).clients[1], "node", -1, "gcn"),
             (nci1, partition(nci1, "soft_dirichlet", 4, seed=0).clients[2], "graph", -1, "gin"),
             (nci1, partition(nci1, "soft_dirichlet", 4, seed=0, folds=5).clients[0], "graph", 1, "gin")]   # fold: empty val split
    for ds, part, task, fold, name in cases:
        seed_everything(0)
        spec = ModelSpec(name, ds.num_features, ds.num_classes, task, 32, 2, 0.5)
        client = Client(0, LocalData(part, task, fold=fold), FedConfig(), spec)
        model = client.model
        old, pred, proba, ev = (_old_predict(client, model), client.predict(model), client.predict_proba(model),
                                client.evaluate(model, ds.num_classes))
        assert set(pred) == set(proba) == set(ev) == {"val", "test"}
        for s in ("val", "test"):
            (y0, p0), (y1, p1), (y2, pr) = old[s], pred[s], proba[s]
            assert torch.equal(y0, y1) and torch.equal(y1, y2) and torch.equal(p0, p1) and p1.dtype == torch.long
            assert pr.shape == (len(y1), ds.num_classes) and torch.allclose(pr.sum(1).cpu(), torch.ones(len(y1)), atol=1e-5)
            assert torch.equal(pr.argmax(1), p1)
            ref = classification_scores(y1, p1, ds.num_classes, scores=pr)
            assert ev[s] == pytest.approx(ref, nan_ok=True) and "auc" in ev[s]
        if fold >= 0:
            assert len(pred["val"][0]) == 0 and proba["val"][1].shape == (0, ds.num_classes) and np.isnan(ev["val"]["auc"])


def test_union_auc_equals_per_client_auc(cora):
    "The one-pass union scoring with `auc=True` gives each client's own `Client.evaluate` scores, AUC included."
    from fglit.federation import Client, LocalData, ModelSpec, NodeUnion
    from fglit.partition import partition
    data = [LocalData(c, "node") for c in partition(cora, "louvain", 5, seed=0).clients]
    spec = ModelSpec("gcn", cora.num_features, cora.num_classes, "node", 64, 2, 0.5)
    seed_everything(0)
    model = spec.build()
    union, plain = NodeUnion(data).score(model, cora.num_classes, auc=True), NodeUnion(data).score(model, cora.num_classes)
    for cid, d in enumerate(data):
        ev = Client(cid, d, FedConfig(), spec).evaluate(model, cora.num_classes)
        for split in ("val", "test"):
            assert union[split][cid] == pytest.approx(ev[split], nan_ok=True)
            assert "auc" not in plain[split][cid] and plain[split][cid] == {k: v for k, v in union[split][cid].items() if k != "auc"}


def test_runs_record_auc_beside_accuracy(cora, shared_root):
    "Node (union path) and graph runs: `auc` in the history, `test_auc` per round, `auc` at the selected round, `auc_mean`/`auc_std`."
    from fglit.metrics import client_average, mean_std
    node = run("fedavg", cora, "louvain", 3, rounds=2, local_epochs=1, seeds=[0], progress=False)
    graph = run("fedavg", load_dataset("PROTEINS", shared_root), "dirichlet", 4, rounds=2, local_epochs=1, seeds=[0, 1], progress=False)
    local = run("standalone", cora, "louvain", 3, rounds=2, local_epochs=1, seeds=[0], progress=False)   # per-client path
    for r in (node, graph, local):
        h, s = r.runs[0].history, r.summary()
        assert "auc" in h.columns and h.auc.dropna().between(0, 1).all() and h.auc.notna().any()
        assert {"val_auc", "test_auc"} <= set(r.per_round().columns)
        sc = r.scores()
        assert (s["auc_mean"], s["auc_std"]) == pytest.approx(mean_std(sc.auc))
        for seed_run, (_, row) in zip(r.runs, sc.iterrows()):
            pc = seed_run.per_client()
            assert row.auc == pytest.approx(client_average(pc.auc, pc.n, seed_run.weighting))
        assert {"auc"} <= set(s["per_client"][0]) and "accuracy_mean" in s and "f1_macro_present_std" in s
    assert node.summary()["auc_mean"] > 0.5                   # Cora after two rounds: better than chance ranking


@pytest.mark.parametrize("case", ["pooled", "stacked", "per_client", "graph"])
def test_auc_off_drops_only_the_auc(cora, shared_root, case):
    "`auc=False` on each evaluation path (pooled union, stacked engine, each client's `evaluate`, graph batches): the same history without its `auc` column, and NaN AUC in the scores."
    args = dict(node=("fedavg", cora, "louvain", 3), graph=("fedavg", load_dataset("PROTEINS", shared_root), "dirichlet", 3))
    algo, ds, part, k = args["graph" if case == "graph" else "node"]
    settings = dict(stacked=dict(engine="stacked"), per_client=dict(evaluation="local")).get(case, {})
    on, off = (run(algo, ds, part, k, rounds=2, local_epochs=1, seeds=[0], progress=False, settings=dict(settings, auc=a))
               for a in (True, False))
    h_on, h_off = on.runs[0].history, off.runs[0].history
    assert "auc" in h_on.columns and "auc" not in h_off.columns
    pd.testing.assert_frame_equal(h_on.drop(columns="auc"), h_off)
    assert np.isnan(off.summary()["auc_mean"]) and not np.isnan(on.summary()["auc_mean"])
    assert "test_auc" not in off.per_round().columns and off.scores().accuracy.tolist() == on.scores().accuracy.tolist()


def test_every_algorithm_refuses_what_its_config_declares():
    "`node_task_only` / `graph_task_only` / `one_model_only` are enforced through `resolve_run_config` and `make_config`, for every registered algorithm."
    from fglit.federation import ALGORITHMS, load_algorithms, make_config, resolve_run_config
    load_algorithms()
    declared = {kind: {n for n, a in ALGORITHMS.items() if getattr(a.config, kind)} for kind in ("node_task_only", "graph_task_only", "one_model_only")}
    assert declared["node_task_only"] == {"adafgl", "coboost", "dense", "fedgls", "fedgm", "fedgta", "fedlog", "fedsage", "fedspray", "fedtad",
                                          "fgssl", "ghost", "opfgl", "renode"}
    assert declared["graph_task_only"] == {"fedstar", "gpfl"}
    assert declared["one_model_only"] == {"coboost", "dense", "fedamp", "feddc", "fedgen", "fedgm", "fedgta", "fedkd", "fedlog", "fedpub", "fedselect",
                                          "fedstar", "fedtad", "gcfl", "gcfl+", "ghost", "gpfl", "pfedgraph", "scaffold"}
    for name, algo in ALGORITHMS.items():
        for task, other, dataset, partition in (("node", "graph", "Cora", "louvain"), ("graph", "node", "PROTEINS", "dirichlet")):
            reason = getattr(algo.config, f"{other}_task_only")
            if reason:
                with pytest.raises(ConfigError, match=re.escape(f"{reason}; got a {task} task")):
                    resolve_run_config(algo, dataset, task, partition)
            else:
                config, _ = resolve_run_config(algo, dataset, task, partition)
                assert isinstance(config, algo.config), name
        if name in declared["one_model_only"]:
            with pytest.raises(ConfigError, match=re.escape(algo.config.one_model_only) + ".*same model; unset graphless_model"):
                make_config(algo.config, {"graphless_model": "mlp"})
        elif name != "fedgls":            # FedGLS refuses graphless_model for its own reason (tests/test_fedgls.py)
            assert make_config(algo.config, {"graphless_model": "mlp"}).graphless_model == "mlp"


def test_pool_one_client_views(cora):
    # one METIS part cuts no edge: both pooled views are the plain one-client run, to the last digit
    kw = dict(rounds=2, local_epochs=1, seeds=[0], progress=False)
    plain = run("standalone", cora, "metis", 1, **kw).scores()
    for pool in POOLS:
        r = run("standalone", cora, "metis", 1, pool=pool, **kw)
        assert r.pool == pool and r.summary()["pool"] == pool
        pd.testing.assert_frame_equal(r.scores().drop(columns="wall_time_s"), plain.drop(columns="wall_time_s"))
    # four parts: one client holding every client's test nodes
    four = run("standalone", cora, "metis", 4, **kw)
    central = run("standalone", cora, "metis", 4, pool="centralised", **kw)
    assert "pool" not in four.summary()
    pc, total = central.per_client(), four.per_client().n.sum()
    assert len(pc) == 1 and pc.n.iloc[0] == total


@pytest.mark.parametrize("kwargs, message", [
    (dict(pool="everything"), "pool must be one of centralised, pooled"),
    (dict(pool="pooled", dataset="MUTAG"), "needs a node task"),
])
def test_pool_bad_input(kwargs, message, cora, shared_root):
    ds = load_dataset(kwargs.pop("dataset"), shared_root) if "dataset" in kwargs else cora
    with pytest.raises(ConfigError, match=message):
        run("standalone", ds, "metis" if ds.task == "node" else "iid", 2, rounds=1, local_epochs=1, progress=False, **kwargs)


@pytest.mark.parametrize("env,inside", [(None, True), ("0", False)])
def test_the_round_loop_flushes_denormals_unless_told_not_to(cora_parts, monkeypatch, env, inside):
    """Each round runs with denormal floats flushed to zero on the CPU (`cpu_compute`), unless FGLIT_FLUSH_DENORMAL=0;
    the caller's mode (here: not flushing) is back after the run."""
    from fglit.core import denormals_flushed
    ds, part = cora_parts
    if env is not None: monkeypatch.setenv("FGLIT_FLUSH_DENORMAL", env)
    assert not denormals_flushed()
    seen = []
    run("fedavg", dataset=ds, partition=part, clients=3, rounds=2, local_epochs=1, settings={"engine": "stacked"},
        progress=False, callback=lambda rnd, server, clients: seen.append(denormals_flushed()))
    assert seen == [inside, inside]
    assert not denormals_flushed()

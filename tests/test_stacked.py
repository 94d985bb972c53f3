"""The stacked engine from the outside (`engine="stacked"`, fglit.fl.stacked): through `run` (the CLI passes it as
`--set engine=stacked`), what it refuses,
and the client-scaling benchmark on a tiny size. (The two engines' per-round equality is checked in nbs/10_fedavg.)"""
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from hypothesis import given, settings, strategies as st

from fglit.federation import run
from fglit.fl.config import ConfigError
from fglit.fl.loop import stacked_algorithms

REPO = Path(__file__).resolve().parents[1]


def test_the_declared_algorithms_are_the_stacked_ones():
    assert stacked_algorithms() == ["fedavg", "fedavg_ft", "fedproto", "fedprox", "fedtgp", "moon", "opfgl", "scaffold", "standalone"]


def test_run_with_the_stacked_engine_matches_the_sequential_one_without_dropout():
    kw = dict(rounds=3, local_epochs=1, seeds=(0,), progress=False)
    seq = run("fedavg", "Cora", "metis", 6, settings={"dropout": 0.0}, **kw)
    stk = run("fedavg", "Cora", "metis", 6, settings={"dropout": 0.0, "engine": "stacked"}, **kw)
    a, b = seq.runs[0].per_round(), stk.runs[0].per_round()
    assert (a.test_accuracy - b.test_accuracy).abs().max() <= 1e-5
    assert seq.runs[0].communication.bytes.sum() == stk.runs[0].communication.bytes.sum()         # the same messages, the same bytes


def test_refusals_name_the_reason():
    with pytest.raises(ConfigError, match="node tasks"):
        run("fedavg", "MUTAG", "iid", 3, rounds=1, settings={"engine": "stacked"}, progress=False)
    with pytest.raises(ConfigError, match="no stacked form.*fedavg"):
        run("fedgta", "Cora", "metis", 3, rounds=1, settings={"engine": "stacked"}, progress=False)
    with pytest.raises(ConfigError, match="engine"):
        run("fedavg", "Cora", "metis", 3, rounds=1, settings={"engine": "vmap"}, progress=False)


def test_client_scaling_benchmark_runs_on_a_tiny_size(tmp_path):
    out = tmp_path / "scaling.csv"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "client_scaling.py"), "--dataset", "Cora", "--clients", "3", "6",
                           "--rounds", "1", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = pd.read_csv(out)
    assert rows[["clients", "engine"]].values.tolist() == [[3, "sequential"], [3, "stacked"], [6, "sequential"], [6, "stacked"]]
    assert rows.error.isna().all() and (rows.simulate_s > 0).all() and rows.test_accuracy.between(0, 1).all()


def test_opfgl_engines_benchmark_runs_on_a_tiny_size(tmp_path):
    import shutil
    out = tmp_path / "opfgl.csv"
    kernels = ["torch", "c"] if shutil.which("cc") or shutil.which("gcc") else ["torch"]     # 'c' compiles a small C routine
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "opfgl_engines.py"), "--seeds", "0", "--out", str(out),
                           "--stage-workers", "1", "2", "--surrogate-kernels", *kernels,
                           "--set", "surrogate_iters=20", "stage1_iters=20", "finetune_iters=20"],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "FGLIT_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = pd.read_csv(out)
    expected = [["sequential", 1, "torch"]] + [["stacked", w, k] for k in kernels for w in (1, 2)]
    assert rows[["engine", "stage_workers", "surrogate_kernel"]].values.tolist() == expected
    assert (rows.simulate_s > 0).all()
    parts = rows[["surrogate_s", "stage1_s", "stage2_s"]]
    assert (parts > 0).all().all() and (parts.sum(axis=1) < rows.simulate_s).all()     # each part measured, within the whole
    torch_rows = rows[rows.surrogate_kernel == "torch"]
    assert torch_rows.accuracy.nunique() == 1   # O-pFGL has no dropout: the engines agree, in one process or two
    assert rows[rows.surrogate_kernel == "c"].accuracy.nunique() <= 1


def test_opfgl_engines_benchmark_writes_the_kernel_that_built_the_graph(tmp_path):
    "Asked for the C routine on a graph it does not cover (two surrogate nodes per class), O-pFGL builds it with torch, and the row says torch."
    import shutil
    if not (shutil.which("cc") or shutil.which("gcc")): pytest.skip("surrogate_kernel='c' needs a C compiler")
    out = tmp_path / "opfgl.csv"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "opfgl_engines.py"), "--seeds", "0", "--out", str(out),
                           "--engines", "stacked", "--surrogate-kernels", "c", "--set", "surrogate_nodes_per_class=2",
                           "surrogate_iters=5", "stage1_iters=5", "finetune_iters=5"],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "FGLIT_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "does not cover this graph" in proc.stderr
    assert pd.read_csv(out).surrogate_kernel.tolist() == ["torch"]


def test_opfgl_engines_benchmark_writes_the_kernel_that_trained_the_stages(tmp_path):
    "--stage-kernels torch c: one row each, and each row names the kernel its stages ran in (read off the clients' logs)."
    import shutil
    if not (shutil.which("cc") or shutil.which("gcc")): pytest.skip("stage_kernel='c' needs a C compiler")
    out = tmp_path / "opfgl.csv"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "opfgl_engines.py"), "--seeds", "0", "--out", str(out),
                           "--engines", "stacked", "--stage-workers", "2", "--stage-kernels", "torch", "c",
                           "--set", "surrogate_iters=20", "stage1_iters=40", "finetune_iters=40", "eval_interval=20"],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "FGLIT_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = pd.read_csv(out)
    assert rows[["stage_workers", "stage_kernel"]].values.tolist() == [[2, "torch"], [2, "c"]]
    assert (rows[["stage1_s", "stage2_s"]] > 0).all().all() and rows.accuracy.between(0, 1).all()


@pytest.mark.parametrize("privacy", [{"secure_aggregation": True}, {"dp_noise": 0.5, "dp_clip": 1.0, "dp_seeded_noise": True}])
def test_the_uplink_works_the_same_on_the_stacked_engine(privacy):
    "Each client still seals its own reply: secure aggregation and (seeded) DP noise give the sequential engine's results."
    kw = dict(rounds=2, local_epochs=1, seeds=(0,), progress=False)
    a = run("fedavg", "Cora", "metis", 4, settings={"dropout": 0.0, **privacy}, **kw).runs[0]
    b = run("fedavg", "Cora", "metis", 4, settings={"dropout": 0.0, "engine": "stacked", **privacy}, **kw).runs[0]
    assert (a.per_round().test_accuracy - b.per_round().test_accuracy).abs().max() <= 1e-5
    assert a.communication.bytes.sum() == b.communication.bytes.sum()


@pytest.fixture(scope="module")
def cora_clients():
    from fglit.data import load_dataset
    from fglit.fl.local_data import clients_data
    from fglit.partition import partition
    ds = load_dataset("Cora")
    return ds, clients_data(partition(ds, "louvain", 6, seed=0).clients, "node", 64)



@settings(max_examples=15, deadline=None)
@given(picked=st.lists(st.integers(0, 5), min_size=1, max_size=6, unique=True))
def test_a_selected_stack_holds_the_blocks_of_its_clients(cora_clients, picked):
    "`ClientStack.select(ks)` is the stack of those clients, padded to the largest of them: every per-row tensor is `rows_of` the full one, the adjacency its diagonal blocks cut to that padding."
    import torch
    from fglit.fl.stacked import ClientStack
    _, data = cora_clients
    full = ClientStack(data)
    sub, ks = full.select(picked), torch.tensor(picked)
    assert sub.n_max == int(full.sizes[ks].max()) <= full.n_max and sub.num_clients == len(picked)
    assert torch.equal(sub.x, full.rows_of(full.x, ks)) and torch.equal(sub.y, full.rows_of(full.y, ks))
    for split in ("train", "val", "test"):
        assert torch.equal(sub.masks[split], full.rows_of(full.masks[split], ks))
    assert torch.equal(sub.num_train, full.num_train[ks]) and torch.equal(sub.sizes, full.sizes[ks])
    dense, n = full.adj.matrix.to_dense(), full.n_max
    blocks = [dense[k * n:k * n + sub.n_max, k * n:k * n + sub.n_max] for k in picked]
    assert torch.equal(sub.adj.matrix.to_dense(), torch.block_diag(*blocks))


def test_feature_csr_and_the_block_input_hold_the_features(cora_clients):
    "`feature_csr()` is `x` in CSR form (made once); the block input (`x_blocks`) puts client `k`'s features in columns `k d ... (k+1) d - 1` of its rows, zeros elsewhere."
    import torch
    from fglit.fl.stacked import ClientStack
    _, data = cora_clients
    stack = ClientStack(data)
    crow, col, val = stack.feature_csr()
    assert stack.feature_csr()[0] is crow
    assert torch.equal(torch.sparse_csr_tensor(crow, col, val, stack.x.shape).to_dense(), stack.x)
    K, n, d = stack.num_clients, stack.n_max, stack.x.size(1)
    blocks = stack.x_blocks.matrix.to_dense().view(K, n, K, d)
    for k in range(K):
        assert torch.equal(blocks[k, :, k], stack.x.view(K, n, d)[k])
        assert not blocks[k, :, [j for j in range(K) if j != k]].any()


def test_selected_params_train_apart_and_go_back(cora_clients):
    "`StackedParams.select(rows)` copies those clients' weights and optimizer state; `put` writes them back and leaves the other rows as they were."
    import torch
    from fglit.fl.protocol import ModelSpec, flat_state
    from fglit.fl.stacked import StackedParams
    from fglit.fl.config import FedConfig
    ds, _ = cora_clients
    spec = ModelSpec("kipfgcn", ds.num_features, ds.num_classes, "node", 16, 2, 0.0)
    params = StackedParams(spec, [flat_state(spec.build()) for _ in range(5)], FedConfig())
    for t in params.tensors: t.grad = torch.randn_like(t)
    params.step(torch.ones(5, dtype=torch.bool))
    before, m_before = params.flat().clone(), [m.clone() for m in params.m]
    rows = torch.tensor([3, 1])
    sub = params.select(rows)
    assert torch.equal(sub.flat(), before[rows]) and sub.K == 2 and torch.equal(sub.steps, params.steps[rows])
    for t in sub.tensors: t.grad = torch.randn_like(t)
    sub.step(torch.ones(2, dtype=torch.bool))
    assert torch.equal(params.flat(), before)                 # the full stack is untouched until `put`
    params.put(rows, sub)
    after = params.flat()
    assert torch.equal(after[rows], sub.flat()) and not torch.equal(after[rows], before[rows])
    others = torch.tensor([0, 2, 4])
    assert torch.equal(after[others], before[others]) and all(torch.equal(m[others], mb[others]) for m, mb in zip(params.m, m_before))
    assert params.steps.tolist() == [1, 2, 1, 2, 1]


def test_opfgl_stacked_narrows_to_the_running_clients_and_matches_sequential():
    "With clients stopping at different steps (patience 1), the stacked stages drop the stopped clients and still give every client the sequential engine's iterations and validation accuracy."
    from fglit.data import load_dataset
    from fglit.federation import get_algorithm, make_config, simulate
    from fglit.partition import partition
    import fglit.algorithms.opfgl_stacked as stacked_module
    ds, algo = load_dataset("Cora"), get_algorithm("opfgl")
    part = partition(ds, "louvain+", 6, seed=0)
    narrowed = []
    original = stacked_module.StackedOpFGL._narrow
    def spy(self, full_params, full_stack, clients):
        narrowed.append(None if clients is None else len(clients))
        return original(self, full_params, full_stack, clients)
    logs = {}
    for engine in ("sequential", "stacked"):
        cfg = make_config(algo.config, {**algo.defaults_for("Cora", "louvain+"), "surrogate_iters": 100, "stage1_iters": 300,
                                        "finetune_iters": 300, "eval_interval": 20, "patience": 1, "engine": engine})
        def keep(rnd, server, clients, engine=engine): logs[engine] = pd.DataFrame([c.log for c in clients])
        stacked_module.StackedOpFGL._narrow = spy
        try:
            simulate(algo, part.clients, "node", ds.num_features, ds.num_classes, cfg, seed=0, progress=False, callback=keep)
        finally:
            stacked_module.StackedOpFGL._narrow = original
    cols = ["stage1_iters", "stage1_val", "stage2_iters", "stage2_val"]
    seq, stk = logs["sequential"][cols], logs["stacked"][cols]
    assert seq.stage1_iters.nunique() > 1 or seq.stage2_iters.nunique() > 1      # clients stopped at different steps
    assert any(n is not None and n < 6 for n in narrowed)                       # ... and the stack went on without them
    pd.testing.assert_frame_equal(seq, stk, check_exact=False, atol=1e-6)


@pytest.mark.parametrize("setting", [dict(lambda_mode="fixed"), dict(lambda_mode="none"), dict(finetune_loss="focal")])
def test_opfgl_stacked_stage2_variants_match_sequential(setting):
    "Stage 2's other losses (fixed lambda and the default CE through `stage2_loss`; plain fine-tuning and focal loss through autograd) give every client the sequential engine's iterations and validation accuracy."
    from fglit.data import load_dataset
    from fglit.federation import get_algorithm, make_config, simulate
    from fglit.partition import partition
    ds, algo = load_dataset("Cora"), get_algorithm("opfgl")
    part = partition(ds, "louvain+", 5, seed=1)
    logs = {}
    for engine in ("sequential", "stacked"):
        cfg = make_config(algo.config, {**algo.defaults_for("Cora", "louvain+"), "surrogate_iters": 50, "stage1_iters": 100,
                                        "finetune_iters": 200, "finetune_lr": 5e-3, "eval_interval": 20, "patience": 2, "engine": engine,
                                        **setting})
        def keep(rnd, server, clients, engine=engine): logs[engine] = pd.DataFrame([c.log for c in clients])
        simulate(algo, part.clients, "node", ds.num_features, ds.num_classes, cfg, seed=1, progress=False, callback=keep)
    cols = ["stage2_iters", "stage2_val", "lambda_mean"]
    pd.testing.assert_frame_equal(logs["sequential"][cols], logs["stacked"][cols], check_exact=False, atol=1e-6)


@given(sizes=st.lists(st.integers(0, 60), min_size=1, max_size=12), budget=st.integers(1, 200))
@settings(max_examples=200, deadline=None)
def test_stack_chunks_cover_every_client_once_within_the_row_budget(sizes, budget):
    "`stack_chunks`: every client in exactly one stack, each stack in client order, and a stack's padded rows (clients x its largest) within the budget unless it is one client alone; greedy; 0 keeps one stack, and so does O-pFGL's on an accelerator."
    import types
    import torch
    from fglit.fl.stacked import stack_chunks
    from fglit.algorithms.opfgl_stacked import StackedOpFGL
    cids = list(range(len(sizes)))
    chunks = stack_chunks(sizes, cids, budget)
    assert sorted(k for c in chunks for k in c) == cids and all(c == sorted(c) and c for c in chunks)
    assert all(len(c) == 1 or len(c) * max(1, max(sizes[k] for k in c)) <= budget for c in chunks)
    merged = [a + b for a, b in zip(chunks, chunks[1:])]      # greedy: no two neighbouring stacks would have fitted as one
    assert all(len(m) * max(1, max(sizes[k] for k in m)) > budget for m in merged)
    assert stack_chunks(sizes, cids, 0) == [cids]
    fake = types.SimpleNamespace(config=types.SimpleNamespace(stack_rows=budget),
                                 data=[types.SimpleNamespace(graph=types.SimpleNamespace(num_nodes=n, x=torch.zeros(1))) for n in sizes])
    assert StackedOpFGL.stack_chunks(fake, cids) == chunks
    fake.data[0].graph.x = types.SimpleNamespace(device=torch.device("meta"))       # not the CPU: one stack
    assert StackedOpFGL.stack_chunks(fake, cids) == [cids]


@pytest.fixture(scope="module")
def cora_metis8():
    from fglit.data import load_dataset
    from fglit.partition import partition
    ds = load_dataset("Cora")
    return ds, partition(ds, "metis", 8, seed=0)


STACKED_SETTINGS = {"standalone": {}, "fedavg": {"client_fraction": 0.5}, "fedavg_ft": {"evaluation": "local"}, "fedprox": {"mu": 1.0},
                    "scaffold": {}, "moon": {"client_fraction": 0.5}, "fedproto": {}, "fedtgp": {}}


@pytest.mark.parametrize("name", sorted(STACKED_SETTINGS))
def test_every_stacked_algorithm_in_bounded_stacks_matches_the_sequential_engine(name, cora_metis8):
    "With `stack_rows` small enough for several stacks (`StackGroups`), every client's per-round scores are the sequential engine's (dropout 0): each algorithm's per-client state (control variates, previous models, prototypes) follows its client's stack."
    from fglit.federation import get_algorithm
    from fglit.fl.stacked import compare_engines, stack_chunks
    ds, part = cora_metis8
    algo = get_algorithm(name)
    assert len(stack_chunks([c.num_nodes for c in part.clients], list(range(8)), 1000)) > 1
    worst, h, runs = compare_engines(algo, part.clients, "node", ds.num_features, ds.num_classes,
                                     {"rounds": 3, "local_epochs": 2, "dropout": 0.0, "stack_rows": 1000, **STACKED_SETTINGS[name]}, seed=1)
    assert worst <= 1e-5, worst
    assert len(h) == 3 * 8 * 2 or STACKED_SETTINGS[name].get("client_fraction")      # every (round, client, split) scored


@pytest.mark.parametrize("stack_rows", [0, 1000])
def test_the_stacked_engine_scores_the_global_model_on_its_stacks_without_a_union(stack_rows, cora_metis8, monkeypatch):
    "Global evaluation under the stacked engine reads the stacks' own rows (one stack, or several): no `NodeUnion` (a second copy of every client's graph) is built, and the scores are the sequential engine's (dropout 0)."
    import fglit.fl.loop as loop
    ds, part = cora_metis8
    settings = {"dropout": 0.0, "evaluation": "global"}
    kw = dict(rounds=2, local_epochs=1, seeds=(0,), progress=False)
    seq = run("fedavg", ds, part, settings=settings, **kw)
    def refuse(*args, **kwargs):
        raise AssertionError("the stacked engine built a NodeUnion")
    monkeypatch.setattr(loop.NodeUnion, "__init__", refuse)
    stk = run("fedavg", ds, part, settings={**settings, "engine": "stacked", "stack_rows": stack_rows}, **kw)
    a, b = seq.runs[0].history, stk.runs[0].history
    assert len(a) == len(b) == 2 * 8 * 2
    key = ["round", "client", "split"]
    merged = a.merge(b, on=key, suffixes=("_seq", "_stk"))
    assert (merged.accuracy_seq - merged.accuracy_stk).abs().max() <= 1e-5
    with pytest.raises(AssertionError, match="NodeUnion"):          # the sequential engine still scores on its union
        run("fedavg", ds, part, settings=settings, **kw)


def test_stacked_groups_are_made_only_where_the_clients_exceed_stack_rows(cora_metis8):
    "`build`: several stacks (one per `stack_chunks` list) on the CPU when the clients' padded rows exceed `stack_rows`; one stack when they fit or `stack_rows=0`. (O-pFGL's stacked class keeps one and splits its stages itself: the small-stacks test below.)"
    import torch
    from fglit.federation import get_algorithm, make_config
    from fglit.fl.local_data import clients_data
    from fglit.fl.protocol import ModelSpec
    from fglit.fl.stacked import StackGroups, StackedClients, stack_chunks
    ds, part = cora_metis8
    data = clients_data(part.clients, "node")
    spec = ModelSpec("gcn", ds.num_features, ds.num_classes, "node", hidden=16, layers=2, dropout=0.0)
    init = StackedClients.initial_states(spec, len(data))
    sizes = [d.graph.num_nodes for d in data]
    for rows in (0, 1000, 10 ** 6):
        cfg = make_config(get_algorithm("fedavg").config, {"stack_rows": rows})
        group = StackedClients.build(data, cfg, spec, init)
        chunks = stack_chunks(sizes, list(range(len(data))), rows)
        assert (len(chunks) > 1) == (rows == 1000)                               # Cora's 8 METIS clients: ~340 nodes each
        if len(chunks) == 1: assert isinstance(group, StackedClients)
        else:
            assert isinstance(group, StackGroups) and group.chunks == chunks and len(chunks) > 1
            assert [s.params.K for s in group.stacks] == [len(c) for c in chunks]
        assert group.flat().equal(torch.stack(init))                              # the clients' weights, in client order


@pytest.mark.parametrize("workers", [1, 2])
def test_opfgl_stacked_in_small_stacks_gives_the_one_stack_results(workers, monkeypatch):
    "With `stack_rows` small enough to split the clients into several stacks (one after another, in each process), every client's log and score is the one a single stack gives; the logs name each client's process and stack; no stack of every client is built (training nor scoring), where one stack holds them all otherwise."
    from fglit.data import load_dataset
    from fglit.federation import get_algorithm, make_config, simulate
    from fglit.fl.stacked import ClientStack
    from fglit.partition import partition
    ds, algo = load_dataset("Cora"), get_algorithm("opfgl")
    part = partition(ds, "louvain+", 6, seed=0)
    logs, runs, built, build = {}, {}, {0: [], 1000: []}, ClientStack.__init__
    for rows in (0, 1000):
        def spy(self, data, n_max=None, rows=rows):
            built[rows].append(len(data)); build(self, data, n_max)
        monkeypatch.setattr(ClientStack, "__init__", spy)
        cfg = make_config(algo.config, {**algo.defaults_for("Cora", "louvain+"), "surrogate_iters": 50, "stage1_iters": 100,
                                        "finetune_iters": 100, "eval_interval": 20, "patience": 1, "engine": "stacked",
                                        "stage_workers": workers, "stack_rows": rows})
        def keep(rnd, server, clients, rows=rows): logs[rows] = pd.DataFrame([c.log for c in clients])
        runs[rows] = simulate(algo, part.clients, "node", ds.num_features, ds.num_classes, cfg, seed=0, progress=False, callback=keep)
    cols = ["stage1_iters", "stage1_val", "stage2_iters", "stage2_val", "lambda_mean"]
    pd.testing.assert_frame_equal(logs[0][cols], logs[1000][cols], check_exact=True)
    assert runs[0].history.equals(runs[1000].history)
    assert logs[0].stage_stack.eq(0).all() and logs[1000].stage_stack.nunique() > 1        # split into stacks
    assert logs[1000].stage_process.nunique() == workers
    assert max(built[0]) == 6 and 0 < max(built[1000]) < 6             # (this process's stacks: the forked worker's are its own)
    assert (logs[1000].stage_peak_rss_mb > 0).all()                      # each process's peak memory, the worker's its own


def test_train_loss_refuses_logits_of_every_row(cora_metis8):
    "`train_loss` reads `train_forward`'s logits (the training rows); the logits of every row (`forward`) end in an error naming both shapes."
    import torch
    from fglit.federation import get_algorithm, make_config
    from fglit.fl.local_data import clients_data
    from fglit.fl.protocol import ModelSpec
    from fglit.fl.stacked import StackedClients
    ds, part = cora_metis8
    data = clients_data(part.clients, "node")
    spec = ModelSpec("gcn", ds.num_features, ds.num_classes, "node", hidden=16, layers=2, dropout=0.0)
    group = StackedClients(data, make_config(get_algorithm("fedavg").config, {}), spec, StackedClients.initial_states(spec, len(data)))
    active = torch.ones(len(data), dtype=torch.bool)
    _, rows_logits = group.train_forward()
    assert rows_logits.shape[1] == int(group.stack.num_train.max()) < group.stack.n_max
    assert torch.isfinite(group.train_loss(rows_logits, active))
    _, every = group.forward()
    with pytest.raises(ValueError, match="train_forward"):
        group.train_loss(every, active)


from _device import DEV, cpu_routine, same_tensor  # noqa: E402


def _fedavg_stack(cora_clients, local_kernel: str, algorithm: str = "fedavg", model: str = "kipfgcn", subclass=None):
    "The algorithm's stacked clients on `cora_clients` (2-layer `model`, dropout 0.5), drawn from seed 0; `subclass(kind)` gives a class to build instead of the stacked form `kind`."
    import torch
    from fglit.federation import get_algorithm, make_config
    from fglit.fl.loop import stacked_form
    from fglit.fl.protocol import ModelSpec
    ds, data = cora_clients
    algo = get_algorithm(algorithm)
    cfg = make_config(algo.config, {"engine": "stacked", "local_kernel": local_kernel, "dropout": 0.5, "layers": 2})
    spec = ModelSpec(model, ds.num_features, ds.num_classes, "node", 64, 2, 0.5)
    kind = stacked_form(algo.client)
    torch.manual_seed(0)
    return (kind if subclass is None else subclass(kind))(data, cfg, spec, kind.initial_states(spec, len(data)))


@cpu_routine
def test_local_kernel_c_follows_the_torch_path_with_the_same_dropout(cora_clients):
    "`local_kernel='c'`: FedAvg's stacked clients take three local steps in the C routine (fglit.fl.gcn_kernel) with the torch path's dropout masks, drawn in its order: the weights move as the torch path moves them (within 2% of the move: the same maths, other rounding), the step counts advance, and an inactive client is left alone."
    import torch
    runs = {}
    for kernel in ("torch", "c"):
        stack = _fedavg_stack(cora_clients, kernel)
        start = stack.params.flat().clone()
        active = torch.ones(stack.stack.num_clients, dtype=torch.bool); active[2] = False
        torch.manual_seed(123)
        stack.fit(3, active)
        runs[kernel] = (stack, start)
    (t, start), (c, _) = runs["torch"], runs["c"]
    assert vars(c)["_kernel"] is not None and "_kernel" not in vars(t)
    move = float((t.params.flat() - start).abs().max())
    assert move > 1e-3 and float((c.params.flat() - t.params.flat()).abs().max()) < 0.02 * move
    assert torch.equal(c.params.flat()[2], start[2]) and c.params.steps.tolist() == t.params.steps.tolist() == [3, 3, 0, 3, 3, 3]
    with pytest.raises(ValueError, match="x_keep must be"):
        c.local_kernel().steps(torch.ones(6, dtype=torch.bool), 2, torch.ones(1, 5), None)


@cpu_routine
def test_local_kernel_c_runs_fedavg_like_the_torch_path():
    "A short FedAvg run on Cora with local_kernel='c' scores as the torch path does, client by client (within two test nodes' worth at every round)."
    from fglit.federation import run
    kw = dict(rounds=5, local_epochs=3, model="kipfgcn", seeds=[0], progress=False)
    settings = {"engine": "stacked", "layers": 2, "auc": False}
    a, b = (run("fedavg", "Cora", "louvain", 6, settings={**settings, "local_kernel": k}, **kw).runs[0].history for k in ("torch", "c"))
    h = a.merge(b, on=["round", "client", "split", "n"], suffixes=("_torch", "_c"))
    assert len(h) == len(a) == len(b)
    assert ((h.accuracy_torch - h.accuracy_c).abs() <= 2.0 / h.n + 1e-9).all()


@cpu_routine
def test_local_kernel_c_leaves_what_it_does_not_cover_to_the_torch_path(cora_clients):
    "FedProx adds a term to the loss: with local_kernel='c' it warns once and trains exactly as the torch path; local_kernel='c' needs the stacked engine."
    import torch
    from fglit.federation import get_algorithm, make_config
    flats = {}
    for kernel in ("torch", "c"):
        stack = _fedavg_stack(cora_clients, kernel, "fedprox")
        stack.receive(list(range(6)), [{"params": stack.params.flat()[0].clone()}] * 6)
        torch.manual_seed(5)
        if kernel == "c":
            with pytest.warns(UserWarning, match="local_kernel='c' is not used: it covers clients whose loss is plain cross-entropy"):
                stack.fit(2, torch.ones(6, dtype=torch.bool))
        else:
            stack.fit(2, torch.ones(6, dtype=torch.bool))
        flats[kernel] = stack.params.flat()
    assert torch.equal(flats["torch"], flats["c"])
    with pytest.raises(ConfigError, match="local_kernel='c' trains the stacked engine's clients: set engine='stacked'"):
        make_config(get_algorithm("fedavg").config, {"local_kernel": "c"})


def test_the_local_kernel_names_what_it_does_not_cover():
    "check_gcn_step_setting's reasons, on any machine: another device, another model, another optimizer."
    import torch
    from fglit.fl.gcn_kernel import check_gcn_step_setting
    from fglit.fl.protocol import ModelSpec
    spec = ModelSpec("kipfgcn", 10, 3, "node", 8, 2, 0.5)
    assert check_gcn_step_setting(spec, "adam", torch.device("cpu")) == ""
    assert check_gcn_step_setting(spec, "adam", torch.device("cuda")) == "it runs on the CPU; this run is on cuda"
    assert "2-layer kipfgcn" in check_gcn_step_setting(ModelSpec("gcn", 10, 3, "node", 8, 2, 0.5), "adam", torch.device("cpu"))
    assert check_gcn_step_setting(spec, "sgd", torch.device("cpu")) == "it covers Adam; this run has sgd"


@pytest.mark.parametrize("algorithm,model", [("fedavg", "kipfgcn"), ("fedavg", "gcn"), ("fedprox", "kipfgcn"), ("moon", "kipfgcn"),
                                             ("moon", "gcn"), ("fedproto", "kipfgcn"), ("fedtgp", "gcn")])
def test_a_training_pass_at_the_training_rows_trains_as_the_pass_over_every_row(cora_clients, algorithm, model):
    """The stacked training pass propagates its last layer to the training rows alone: FedAvg's and FedProx's read no
    embeddings (`training_embeddings` 'none'), MOON's and FedProto's/FedTGP's read the training rows' ('rows'; MOON's
    global and previous models and FedProto's class means are embedded there alone too). Three steps with dropout move
    the weights as a stack made to compute every row's embeddings moves them (same masks, same seeds), and FedProto's
    class statistics are the same."""
    import torch
    from fglit.fl.stacked import _gather_rows

    def every_row(kind):
        class EveryRow(kind):
            training_embeddings = "all"

            def extra_loss(self, emb, logits, active):
                assert emb is not None and emb.shape[:2] == (self.stack.num_clients, self.stack.n_max)
                if kind.training_embeddings == "rows": emb = _gather_rows(emb, self.stack.train_rows()[0])
                return super().extra_loss(emb, logits, active)

            def embed(self, params=None, training=False, rows=None):
                every = super().embed(params, training)
                return every if rows is None else _gather_rows(every, rows)
        return EveryRow

    def downloads(stack, start):
        if algorithm not in ("fedproto", "fedtgp"): return [{"params": v} for v in start]   # (FedProx's anchor, MOON's global model)
        g = torch.Generator().manual_seed(7)
        C = stack.spec.num_classes
        return [{"protos": torch.randn(C, stack.spec.hidden, generator=g).to(DEV), "mask": torch.ones(C, dtype=torch.bool, device=DEV)}
                for _ in start]

    moved = []
    for subclass in (None, every_row):
        stack = _fedavg_stack(cora_clients, "torch", algorithm, model, subclass)
        start = stack.params.flat().clone()
        stack.receive(list(range(len(start))), downloads(stack, start))
        torch.manual_seed(123)
        stack.fit(3, torch.ones(len(start), dtype=torch.bool, device=start.device))
        moved.append((stack, stack.params.flat() - start))
    (narrow, a), (every, b) = moved
    assert narrow.training_embeddings == ("rows" if algorithm in ("moon", "fedproto", "fedtgp") else "none") and every.training_embeddings == "all"
    move = float(a.abs().max())
    exact = DEV.type == "cpu"
    assert move > 1e-3 and float((a - b).abs().max()) <= (1e-6 if exact else 0.02 * move)   # CUDA's sparse sums: other rounding
    if algorithm in ("fedproto", "fedtgp"):          # on the same weights (gcn's three steps above differ in the last bits)
        every.params.load(list(range(len(start))), list(narrow.params.flat()))
        for x, y in zip(narrow.class_statistics(), every.class_statistics()):
            assert torch.equal(x, y) if exact else torch.allclose(x, y, rtol=1e-4, atol=1e-4)


def test_moons_term_embeds_each_rounds_global_and_previous_models(cora_clients):
    "Stacked MOON embeds the global and previous models once a round (both are fixed within it, and embedded without dropout): at every round's steps they are that round's, as a fresh embedding of the models it was sent and trained last gives them."
    import torch
    stack = _fedavg_stack(cora_clients, "torch", "moon")
    K, places = stack.stack.num_clients, stack.stack.train_rows()[0]
    active = torch.ones(K, dtype=torch.bool, device=DEV)
    g = torch.Generator().manual_seed(3)
    for rnd in (1, 2, 3):
        sent = stack.params.flat().clone() + 0.05 * torch.randn(stack.params.flat().shape, generator=g).to(DEV)   # another global model each round
        stack.receive(list(range(K)), [{"params": v} for v in sent])
        previous = stack.previous.clone()
        torch.manual_seed(rnd)
        stack.fit(2, active)
        z_global, z_previous = stack._anchors
        with torch.no_grad():                                    # (on CUDA within 1e-5: its sparse sums may round otherwise)
            assert same_tensor(z_global, stack.embed(stack.params.unflatten(sent), rows=places), atol=1e-5), rnd
            assert same_tensor(z_previous, stack.embed(stack.params.unflatten(previous), rows=places), atol=1e-5), rnd
        stack.reply(list(range(K)), rnd)


def test_sequential_moon_embeds_a_rounds_models_once_per_batch_as_at_every_step(cora_clients):
    "The sequential MOON client embeds the global and previous models once per batch and round (a node task's one batch: once a round): three rounds, each with another download and dropout, leave its weights as a client that embeds them at every step leaves them."
    import torch
    from fglit.federation import get_algorithm, make_config
    from fglit.fl.protocol import ModelSpec, flat_state
    ds, data = cora_clients
    algo = get_algorithm("moon")
    cfg = make_config(algo.config, {"local_epochs": 3, "dropout": 0.5})
    spec = ModelSpec("gcn", ds.num_features, ds.num_classes, "node", 32, 2, 0.5)

    class EveryStep(algo.client):
        def extra_loss(self, b, emb, logits):
            self._anchors = None
            return super().extra_loss(b, emb, logits)

    clients = []
    for kind in (algo.client, EveryStep):
        torch.manual_seed(0)
        clients.append(kind(0, data[0], cfg, spec))
    g = torch.Generator().manual_seed(5)
    sent = flat_state(clients[0].model)
    for rnd in (1, 2, 3):
        sent = sent + 0.05 * torch.randn(sent.shape, generator=g).to(sent.device)
        replies = []
        for c in clients:
            torch.manual_seed(rnd)
            replies.append(c.local_step({"params": sent.clone()}, rnd)["params"])
        once, every = replies
        assert same_tensor(once, every, atol=1e-5), rnd
        assert clients[0]._anchors is None                       # nothing of the round is kept (a Flower node pickles its client)


def test_a_stack_declaring_unknown_training_embeddings_is_refused(cora_clients):
    "`training_embeddings` outside `EMBEDDINGS` stops the stack's construction with an error that lists the choices."
    def misdeclared(kind):
        return type("Misdeclared", (kind,), {"training_embeddings": "train"})
    with pytest.raises(ValueError, match="Misdeclared.training_embeddings is 'train'; it takes one of: all, rows, none"):
        _fedavg_stack(cora_clients, "torch", "moon", "kipfgcn", misdeclared)


def test_commit_ab_benchmark_runs_on_a_tiny_size(tmp_path):
    "benchmarks/commit_ab.py against HEAD itself: one (before, after) pair of interpreters, a row per side, the same accuracy on both, and its scratch worktree removed."
    out = tmp_path / "ab.csv"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "commit_ab.py"), "--before", "HEAD", "--repeats", "1", "--rounds", "2",
                           "--local-epochs", "1", "--seeds", "0", "--clients", "3", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = pd.read_csv(out)
    assert rows.side.tolist() == ["before", "after"] and rows.error.isna().all() and (rows.simulate_s > 0).all()
    assert rows.accuracy.nunique() == 1 and "median simulate" in proc.stdout
    worktrees = subprocess.run(["git", "worktree", "list"], cwd=REPO, capture_output=True, text=True).stdout
    assert "fglit-ab-" not in worktrees

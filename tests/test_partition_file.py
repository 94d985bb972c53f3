"""Partitions brought in from outside: `from_assignment`, partition files (NPZ / JSON), `run` and `fglit run --partition-file`."""
import json
import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from fglit.partition import (PartitionFileError, community_graph, from_assignment, load_partition_file, metis,
                             save_partition_file)
from test_cli import fglit
from test_partition import check_graph_partition, check_node_partition, random_graph_set

SETTINGS = settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FGLIT_CACHE", str(tmp_path / "cache"))


def random_assignment(n: int, k: int, seed: int, left_out: float, unsplit: bool = False):
    "Every client non-empty with a training item; a share `left_out` in no client; codes 0/1/2, or also -1 (no split) if `unsplit`."
    rng = np.random.default_rng(seed)
    a = rng.integers(0, k, n)
    a[rng.random(n) < left_out] = -1
    a[:k] = np.arange(k)
    codes = rng.integers(-1 if unsplit else 0, 3, n)
    codes[:k] = 0
    codes[a < 0] = -1
    return a, codes


@SETTINGS
@given(n=st.integers(30, 120), k=st.integers(1, 6), seed=st.integers(0, 10_000), left_out=st.sampled_from([0.0, 0.2]),
       suffix=st.sampled_from([".npz", ".json"]), as_ids=st.booleans(), unsplit=st.booleans())
def test_node_assignment_round_trips(tmp_path_factory, n, k, seed, left_out, suffix, as_ids, unsplit):
    data = community_graph(n, 3 * n, 4, seed=seed)
    a, codes = random_assignment(n, k, seed, left_out, unsplit)
    splits = [np.flatnonzero(codes == s) if as_ids else codes == s for s in range(3)]
    p = from_assignment(data, a, *splits)
    assert np.array_equal(p.assignment.numpy(), a) and np.array_equal(p.split_codes.numpy(), codes)
    if not unsplit:                                     # the partitioners' own invariants hold too
        check_node_partition(p, data, covers_all=left_out == 0.0)
    for i, c in enumerate(p.clients):                   # each client: its nodes, the edges among them, its masks
        gid = c.global_id.numpy()
        assert np.array_equal(gid, np.flatnonzero(a == i))
        both = np.isin(data.edge_index.numpy(), gid).all(0)
        assert c.edge_index.size(1) == int(both.sum())
        assert np.array_equal(c.train_mask.numpy(), codes[gid] == 0) and np.array_equal(c.test_mask.numpy(), codes[gid] == 2)
    path = save_partition_file(p, tmp_path_factory.mktemp("f") / f"p{suffix}")
    assert load_partition_file(data, path).same_as(p)


@SETTINGS
@given(num_graphs=st.integers(20, 60), k=st.integers(1, 5), seed=st.integers(0, 10_000), suffix=st.sampled_from([".npz", ".json"]))
def test_graph_assignment_round_trips(tmp_path_factory, num_graphs, k, seed, suffix):
    graphs = random_graph_set(num_graphs, 2, seed)
    a, codes = random_assignment(num_graphs, k, seed, 0.0)
    codes[codes < 0] = 2                                    # every graph in a split, as check_graph_partition asks
    codes[codes == 1] = 0                                   # GPFL-style: train and test, no validation
    p = from_assignment(graphs, a, codes == 0, None, codes == 2)
    check_graph_partition(p, graphs)
    back = load_partition_file(graphs, save_partition_file(p, tmp_path_factory.mktemp("g") / f"g{suffix}"))
    assert back.same_as(p) and back.task == "graph"


def test_node_file_refused_for_a_graph_dataset(tmp_path):
    data = community_graph(60, 200, 4, seed=0)
    path = save_partition_file(metis(data, 3, seed=0), tmp_path / "p.npz")
    with pytest.raises(PartitionFileError, match="no `graph_client` array .*node-level partition"):
        load_partition_file(random_graph_set(30, 2, 0), path)


def test_run_on_a_saved_partition_equals_the_plain_run(shared_root, tmp_path):
    from fglit.federation import ConfigError, run
    from fglit.partition import partition
    plain = run("fedavg", "Cora", "metis", 4, rounds=2, seeds=[0, 1], root=shared_root, progress=False)
    from fglit.data import load_dataset
    cora = load_dataset("Cora", shared_root)
    files = [save_partition_file(partition(cora, "metis", 4, seed=s), tmp_path / f"s{s}.npz") for s in (0, 1)]
    given = run("fedavg", cora, [load_partition_file(cora, f) for f in files], seeds=[0, 1], rounds=2, progress=False)
    assert given.partition == "file" and given.clients == 4
    assert given.scores()[["accuracy", "f1_macro"]].equals(plain.scores()[["accuracy", "f1_macro"]])
    assert given.communication()["bytes"].sum() == plain.communication()["bytes"].sum()
    with pytest.raises(ConfigError, match="2 partitions for 3 seeds"):
        run("fedavg", cora, [load_partition_file(cora, f) for f in files], seeds=[0, 1, 2], rounds=1, progress=False)
    with pytest.raises(ConfigError, match="made for another dataset"):
        run("fedavg", "CiteSeer", load_partition_file(cora, files[0]), rounds=1, root=shared_root, progress=False)


def test_like_picks_the_partitioners_defaults(shared_root, tmp_path):
    "O-pFGL's Cora defaults differ under Louvain (HRE degree 20): a file standing for louvain+ gets them."
    from fglit.data import load_dataset
    from fglit.federation import resolve_run_config
    cora = load_dataset("Cora", shared_root)
    path = save_partition_file(metis(cora, 3, seed=0), tmp_path / "p.json")
    degree = {like: resolve_run_config("opfgl", "Cora", "node", load_partition_file(cora, path, like=like).info["like"], {})[0].hre_degree
              for like in ("louvain+", "metis+")}
    assert degree["louvain+"] == 20 and degree["metis+"] != 20


def _doc(tmp_path, **change):
    base = dict(dataset="Cora", node_client=[i % 3 for i in range(2708)], train=list(range(0, 2708, 5)),
                test=list(range(1, 2708, 5)))
    path = tmp_path / "p.json"
    path.write_text(json.dumps({**base, **change}))
    return path


@pytest.mark.parametrize("change, needle", [
    (dict(node_client=[i % 3 for i in range(2700)]), "has 2700 entries but Cora has 2708 nodes"),
    (dict(num_clients=2), "unknown client 2"),
    (dict(val=[3, 10]), "splits overlap: 1 nodes are in both `train` and `val` (first: 10)"),
])
def test_cli_refuses_bad_files_in_one_line(tmp_path, shared_root, change, needle):
    out = fglit("run", "fedavg", "--dataset", "Cora", "--partition-file", str(_doc(tmp_path, **change)), "--rounds", "1",
                "--quiet", env={"FGLIT_DATA": str(shared_root)})
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert needle in out.stderr and "Traceback" not in out.stderr


def test_cli_runs_a_good_file_and_reports_it(tmp_path, shared_root):
    env = {"FGLIT_DATA": str(shared_root)}
    saved = tmp_path / "metis3.npz"
    out = fglit("partition", "--dataset", "Cora", "--method", "metis", "--clients", "3", "--save", str(saved), env=env)
    assert out.returncode == 0 and saved.is_file(), out.stderr
    shown = fglit("partition", "--dataset", "Cora", "--file", str(saved), "--json", env=env)
    made = fglit("partition", "--dataset", "Cora", "--method", "metis", "--clients", "3", "--json", env=env)
    assert json.loads(shown.stdout) == json.loads(made.stdout)
    via_file = fglit("run", "fedavg", "--dataset", "Cora", "--partition-file", str(saved), "--rounds", "2", "--quiet", "--json", env=env)
    plain = fglit("run", "fedavg", "--dataset", "Cora", "--partition", "metis", "--clients", "3", "--rounds", "2", "--quiet",
                  "--json", env=env)
    a, b = json.loads(via_file.stdout), json.loads(plain.stdout)
    assert a["partition"] == "file" and a["accuracy_mean"] == b["accuracy_mean"] and a["bytes_up"] == b["bytes_up"]
    both = fglit("partition", "--dataset", "Cora", "--method", "metis", "--file", str(saved), env=env)
    assert both.returncode == 2 and "--method" in both.stderr

"""One conformance test for every registered algorithm: it registers with the protocol's parts, its config
round-trips through `--set`, and a 2-round run on each task it declares gives the summary's keys, counts its bytes
and repeats bit for bit; the same run through the Flower transport gives the same scores and bytes."""
import dataclasses
import json

import pytest

from fglit.cli import parse_settings
from fglit.data import load_dataset
from fglit.federation import ALGORITHMS, Client, FedConfig, Server, load_algorithms, make_config, run

from _device import same_bytes, same_run

load_algorithms()
NAMES = sorted(ALGORITHMS)
# Settings that shorten an algorithm's own inner loops (not the protocol's rounds) so 2 rounds stay quick.
QUICK = {"opfgl": dict(surrogate_iters=20, stage1_iters=20, finetune_iters=20), "adafgl": dict(personal_epochs=4),
         "dense": dict(distill_epochs=2), "coboost": dict(distill_epochs=2),
         "fedlog": dict(pretrain_epochs=2, prompt_epochs=2, prompt_models=1, prompt_hidden=16, synthetic_per_class=5),
         "ghost": dict(proxy_epochs=3), "fedgm": dict(condense_steps=3, server_epochs=20)}
SUMMARY_KEYS = {"algorithm", "dataset", "partition", "clients", "rounds", "seeds", "accuracy_mean", "accuracy_std",
                "f1_macro_mean", "auc_mean", "selected_rounds", "bytes_up", "bytes_down", "floats_up", "floats_down",
                "communication_rounds", "wall_time_s", "config", "commit", "per_client"}
TASKS = {"node": ("Cora", "louvain", {}), "graph": ("MUTAG", "dirichlet", {"alpha": 1.0, "min_size": 5})}


def tasks_of(algo) -> list[str]:
    return [t for t in TASKS if not getattr(algo.config, f"{'graph' if t == 'node' else 'node'}_task_only")]


def test_every_algorithm_module_registers_something():
    from fglit.federation import ALGORITHM_MODULES
    modules = {a.client.__module__ for a in ALGORITHMS.values()} | {a.server.__module__ for a in ALGORITHMS.values()}
    assert {"fglit.algorithms.fedavg", "fglit.algorithms.opfgl", "fglit.algorithms.gpfl", "fglit.algorithms.fedgls",
            "fglit.algorithms.fedpg"} <= modules <= set(ALGORITHM_MODULES) | {"fglit.fl.protocol"}
    assert len(NAMES) >= 22


@pytest.mark.parametrize("name", NAMES)
def test_registration_and_config_round_trip(name):
    algo = ALGORITHMS[name]
    assert algo.name == name and issubclass(algo.client, Client) and issubclass(algo.server, Server)
    assert issubclass(algo.config, FedConfig) and tasks_of(algo)
    default = algo.config()
    pairs = [f"{k}={json.dumps(v)}" for k, v in dataclasses.asdict(default).items()]     # what `--set` would carry
    assert make_config(algo.config, parse_settings(pairs)) == default


@pytest.fixture(scope="module")
def datasets(shared_root):
    return {t: load_dataset(d, shared_root) for t, (d, _, _) in TASKS.items()}


@pytest.mark.parametrize("name, task", [(n, t) for n in NAMES for t in tasks_of(ALGORITHMS[n])])
def test_two_rounds_summary_bytes_and_rerun(name, task, datasets):
    _, partition, part_settings = TASKS[task]
    kw = dict(rounds=2, local_epochs=1, seeds=[0], progress=False,
              settings={"hidden": 16, **part_settings, **QUICK.get(name, {})})
    first = run(name, datasets[task], partition, 3, **kw)
    s = first.summary()
    assert SUMMARY_KEYS <= set(s) and s["algorithm"] == name and len(s["per_client"]) == 3
    assert 0.0 <= s["accuracy_mean"] <= 1.0
    json.dumps(s, default=str)                                  # JSON-ready, as `fglit run --json` prints it
    comm = first.communication()
    assert set(comm.direction) <= {"up", "down"} and (comm.bytes >= 0).all()
    if name != "standalone":                                    # every other algorithm talks: its bytes are counted
        assert s["bytes_up"] > 0 and s["communication_rounds"] >= 1
    again = run(name, datasets[task], partition, 3, **kw)
    assert same_run(first.runs[0].history, again.runs[0].history)
    assert same_bytes(first.communication(), again.communication())


# -- the same 2-round run through the Flower transport ------------------------------------------------------------------

@pytest.mark.parametrize("name, task", [(n, t) for n in NAMES for t in tasks_of(ALGORITHMS[n])])
def test_two_rounds_through_flower_match_in_process(name, task, shared_root):
    """Every algorithm through `FlowerTransport` (fglit's ClientApp on in-process SuperNodes, `_flower_grid.FakeGrid`) with
    `replay=True`: the same per-client scores as in process (to 1e-6) and the same bytes, because both are fglit's one
    round loop with a different transport."""
    pytest.importorskip("flwr")
    from fglit.flower import FlowerRun, serve
    from _flower_grid import FakeGrid, assert_matches_in_process
    dataset, partition, part_settings = TASKS[task]
    settings = {"rounds": 2, "local_epochs": 1, "hidden": 16, **part_settings, **QUICK.get(name, {})}
    flower = serve(FakeGrid(3), FlowerRun(name, dataset, partition, 3, 0, settings, root=str(shared_root), replay=True,
                                          timeout=120.0, wait_nodes=5.0))
    local = run(name, dataset, partition, 3, seeds=[0], progress=False, settings=settings, root=shared_root)
    assert_matches_in_process(flower, local)

"""Tests for fglit on Flower (`fglit.flower`, from nbs/07_flower.ipynb)."""
import contextlib
import os
import signal

import numpy as np
import psutil
import pytest
import torch
from hypothesis import given, settings, strategies as st

pytest.importorskip("flwr")

from flwr.app import RecordDict
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto

from fglit.flower import (FlowerRun, LocalFederation, array_to_tensor, flower_nbytes, free_port, get_message,
                          message_to_record, put_message, record_to_message, tensor_to_array)
from fglit.federation import message_nbytes, run

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8, torch.uint8,
          torch.bool]


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 4), min_size=0, max_size=3))
    n = int(np.prod(shape)) if shape else 1
    raw = draw(st.binary(min_size=n * torch.empty(0, dtype=dtype).element_size(),
                         max_size=n * torch.empty(0, dtype=dtype).element_size()))
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    if dtype == torch.bool: t = t % 2
    return t.view(dtype).reshape(shape).clone()


scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**63 - 1), st.floats(allow_nan=True), st.text(max_size=20))
messages = st.dictionaries(st.from_regex(r"[a-z_][a-z0-9_]{0,11}", fullmatch=True), st.one_of(tensors(), scalars), max_size=6)


def bitwise_equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        if not (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape): return False
        return a.numel() == 0 or torch.equal(a.cpu().contiguous().reshape(-1).view(torch.uint8), b.cpu().contiguous().reshape(-1).view(torch.uint8))
    if isinstance(a, float):
        return type(b) is float and (a == b or (a != a and b != b))
    return type(a) is type(b) and a == b


@settings(max_examples=60, deadline=None)
@given(messages)
def test_record_round_trip_is_exact(message):
    "message -> RecordDict -> protobuf (the wire) -> RecordDict -> message gives the same message, bit for bit, same types."
    record = recorddict_from_proto(recorddict_to_proto(message_to_record(message, {"round": 3})))
    back = record_to_message(record)
    assert back.keys() == message.keys()
    assert all(bitwise_equal(message[k], back[k]) for k in message)


@settings(max_examples=20, deadline=None)
@given(messages, messages)
def test_two_messages_in_one_record(a, b):
    "A train message and an evaluation message travel side by side under their prefixes."
    rd = put_message(put_message(RecordDict(), a), b, "fglit.eval")
    rd = recorddict_from_proto(recorddict_to_proto(rd))
    ga, gb = get_message(rd), get_message(rd, "fglit.eval")
    assert ga.keys() == a.keys() and gb.keys() == b.keys()
    assert all(bitwise_equal(a[k], ga[k]) for k in a) and all(bitwise_equal(b[k], gb[k]) for k in b)


def test_numpy_arrays_come_back_as_tensors():
    back = record_to_message(message_to_record({"x": np.arange(6, dtype=np.int16).reshape(2, 3)}))
    assert isinstance(back["x"], torch.Tensor) and back["x"].dtype == torch.int16 and back["x"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert torch.equal(array_to_tensor(tensor_to_array(torch.ones(2, dtype=torch.bfloat16))), torch.ones(2, dtype=torch.bfloat16))


def test_received_tensors_land_on_fglits_device(monkeypatch):
    "A message read off the wire goes where the receiving model and server state live (on a GPU run: CUDA, not the CPU)."
    import fglit.flower_records as fl
    record = message_to_record({"params": torch.arange(4.0), "weight": 2.0})
    assert get_message(record, device="meta")["params"].device.type == "meta"
    monkeypatch.setattr(fl, "get_device", lambda: torch.device("meta"))      # stands in for a CUDA device on a CPU machine
    back = record_to_message(record)
    assert back["params"].device.type == "meta" and back["weight"] == 2.0


def test_unsupported_values_are_refused():
    with pytest.raises(TypeError): message_to_record({"a": [1, 2]})
    with pytest.raises(TypeError): message_to_record({"a": 2**70})
    with pytest.raises(TypeError): message_to_record({1: 2})


def test_flower_bytes_are_close_to_fglit_bytes():
    m = {"params": torch.randn(10_000), "weight": 3.0}
    fl, fg = flower_nbytes(message_to_record(m)), message_nbytes(m)
    assert fg <= fl <= fg + 1024


def test_run_config_round_trip():
    r = FlowerRun("fedavg", "cora", "metis", 4, 3, {"rounds": 2, "lr": 0.1}, replay=True, min_clients=3, progress="p.jsonl")
    cfg = r.to_config()
    assert all(isinstance(v, (str, int, float, bool)) for v in cfg.values())
    assert FlowerRun.from_config(cfg) == r


# -- end to end: a SuperLink and 4 SuperNodes as real processes on loopback ----------------------------------

@contextlib.contextmanager
def time_limit(seconds: int):
    "Fail the test (and leave the `with` blocks inside, which stop the processes) after `seconds`."
    def handler(signum, frame): raise TimeoutError(f"test ran past {seconds}s")
    old = signal.signal(signal.SIGALRM, handler)
    signal.alarm(seconds)
    try: yield
    finally:
        signal.alarm(0); signal.signal(signal.SIGALRM, old)


def _descendants() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _compare(flower, local, tol: float) -> None:
    "Same rows, the run's accuracy within `tol` (tol 0: every client's score identical), the same fglit bytes."
    key = ["round", "client", "split"]
    a = flower.runs[0].history.sort_values(key).reset_index(drop=True)
    b = local.runs[0].history.sort_values(key).reset_index(drop=True)
    assert a[key + ["n"]].equals(b[key + ["n"]])
    if tol == 0:
        assert (a.accuracy - b.accuracy).abs().max() == 0
    assert abs(flower.scores().accuracy[0] - local.scores().accuracy[0]) <= tol
    assert flower.summary()["bytes_up"] == local.summary()["bytes_up"]
    assert flower.summary()["bytes_down"] == local.summary()["bytes_down"]


OPFGL_TOL = 0.03   # O-pFGL without replay: its nodes draw their clients' initial weights from their own seeds (see nb07)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm,settings_,tol", [("fedavg", {"rounds": 2}, 0.0),
                                                    pytest.param("opfgl", {}, OPFGL_TOL, marks=pytest.mark.long)])
def test_deployment_on_loopback_matches_in_process(algorithm, settings_, tol, shared_root, tmp_path):
    """4 SuperNodes + a SuperLink as processes (insecure, loopback, free ports), each node building only its own client
    (`replay=False`): the accuracy of `run` with the same seed. FedAvg: identical per-client scores (its clients start
    from the server's model). O-pFGL: its clients keep their own initial weights, drawn on the node from (seed, client),
    not from the in-process simulator's one random stream, so the accuracy agrees within `OPFGL_TOL`."""
    torch.set_num_threads(1)
    before = _descendants()
    with time_limit(420):
        with LocalFederation(4, tmp_path / "fed", env={"FGLIT_DATA": str(shared_root)}) as fed:
            spec = FlowerRun(algorithm, "cora", "louvain", 4, 0, settings_, root=str(shared_root), timeout=200, wait_nodes=60)
            result = fed.submit(spec, timeout=400)
        local = run(algorithm, "cora", "louvain", 4, seeds=(0,), settings=settings_, root=shared_root, progress=False)
    print(f"{algorithm}: Flower {result.scores().accuracy[0]:.4f}, in-process {local.scores().accuracy[0]:.4f}")
    _compare(result, local, tol)
    assert result.dropped.empty
    table = result.bytes_table()
    assert (table.flower_bytes > 0).all()
    assert _descendants() <= before, "processes left behind"


@pytest.mark.slow
@pytest.mark.long     # minutes of SuperNode processes on loopback: `make test-long` (make test keeps the FedAvg deployment above)
def test_deployment_faults_on_loopback(shared_root, tmp_path):
    """A SuperNode lost mid-run, over real processes. (a) FedAvg, node 3 SIGKILLed (a crash) once round 1 is aggregated,
    min_clients=3: the run completes with clients 0..2 and lists the drop; the SuperLink reports the dead node once it has
    missed its heartbeats (about 60 s). (b) O-pFGL (one shot), node 3 restarted, then stopped (SIGTERM) after the setup,
    min_clients=0 (all): a FlowerRunError naming client 3 and the minimum, not a hang. The same stop below the minimum
    for FedAvg, and O-pFGL going on with 3 clients, are in test_flower_faults.py (same code path, fake grid).
    Every process is gone afterwards."""
    import time
    from fglit.flower import FlowerRunError
    torch.set_num_threads(1)
    before = _descendants()
    with time_limit(600):
        with LocalFederation(4, tmp_path / "fed", env={"FGLIT_DATA": str(shared_root)}) as fed:
            def kill_after(rnd, hard):
                def on_progress(event):
                    if event["round"] == rnd: fed.kill_supernode(3, hard=hard)
                return on_progress
            # (a) FedAvg completes with 3 of 4
            t0 = time.monotonic()
            spec = FlowerRun("fedavg", "cora", "louvain", 4, 0, {"rounds": 2}, root=str(shared_root), timeout=150,
                             wait_nodes=60, min_clients=3)
            result = fed.submit(spec, timeout=300, on_progress=kill_after(1, hard=True))
            seconds_a = time.monotonic() - t0
            assert result.dropped[["round", "client", "what"]].values.tolist() == [[2, 3, "train"]]
            assert "NODE_UNAVAILABLE" in result.dropped.reason[0]
            h = result.runs[0].history
            assert set(h[h["round"] == 2].client) == {0, 1, 2} and h.accuracy.between(0, 1).all()
            assert 0 < result.scores().accuracy[0] <= 1
            # (b) O-pFGL below the minimum: reported, not hung on
            fed.start_supernode(3)
            t0 = time.monotonic()
            with pytest.raises(FlowerRunError, match=r"train \(round 1\): lost client 3 .*fewer than min_clients=4"):
                fed.submit(FlowerRun("opfgl", "cora", "louvain", 4, 0, {}, root=str(shared_root), timeout=150, wait_nodes=60),
                           timeout=300, on_progress=kill_after(0, hard=False))
            seconds_b = time.monotonic() - t0
    print(f"(a) FedAvg with a crashed node: {seconds_a:.0f}s; (b) O-pFGL stopped after {seconds_b:.0f}s")
    assert _descendants() <= before, "processes left behind"


def test_simulation_without_ray_is_refused_before_anything_starts(monkeypatch, tmp_path):
    "Flower's simulation engine needs Ray: without it `LocalSimulation` says so at once, naming the extra (`optional_import`'s error), and starts no SuperLink (it used to wait for a run that the SuperLink could not start)."
    import importlib.util
    from fglit.flower import LocalSimulation
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else find_spec(name, *a))
    sim = LocalSimulation(2, tmp_path)
    with pytest.raises(ModuleNotFoundError, match=r"ray is not installed; it comes with fglit's 'simulation' extra") as err:
        sim.__enter__()
    assert err.value.name == "ray"
    assert getattr(sim, "superlink", None) is None and not any(tmp_path.iterdir())


def _stand_in_engine(monkeypatch, fail_at=()) -> list:
    """Stand in for Flower's simulation engine with the in-process run of each seed (a seed in `fail_at` raises instead, as a
    run killed there); the calls it got, as a list that fills as the command runs."""
    import dataclasses
    import pandas as pd
    import fglit.flower
    from fglit.flower import DROPPED_COLUMNS, FlowerRunResult
    calls = []

    def stand_in(algorithm, dataset, partition, clients, rounds=None, seed=0, settings=None, root=None, **kw):
        calls.append(dict(algorithm=algorithm, dataset=dataset, partition=str(partition), clients=clients, rounds=rounds, seed=seed,
                          settings=settings, root=root))
        if seed in fail_at: raise KeyboardInterrupt(f"stopped at seed {seed}")
        res = run(algorithm, dataset, partition, clients, rounds=rounds, seeds=(seed,), settings=settings, root=root, progress=False)
        return FlowerRunResult(**{f.name: getattr(res, f.name) for f in dataclasses.fields(res)}, backend="flower-sim",
                               dropped=pd.DataFrame(columns=DROPPED_COLUMNS))
    monkeypatch.setattr(fglit.flower, "run_flower_simulation", stand_in)
    return calls


def test_cli_backend_flower_sim_runs_each_seed_through_flowers_simulation(shared_root, monkeypatch, capsys):
    """`fglit run --backend flower-sim` hands each seed, with the command's settings, to `run_flower_simulation` and prints
    one result of all the seeds, as the in-process command prints its own (here the engine is stood in for by the
    in-process run of each seed, so the wiring is checked in seconds; the real engine: the test below, in `make test-long`,
    and `test_secure_aggregation_in_flowers_simulation_engine`)."""
    import dataclasses, json
    import pandas as pd
    import fglit.flower
    from fglit.cli import main
    from fglit.flower import DROPPED_COLUMNS, FlowerRunResult
    calls = _stand_in_engine(monkeypatch)
    args = ["run", "fedavg", "--dataset", "Cora", "--partition", "louvain", "--clients", "3", "--rounds", "2", "--seeds", "0", "1",
            "--local-epochs", "2", "--set", "lr=0.02", "--root", str(shared_root), "--json"]
    printed = []
    for extra in ([], ["--backend", "flower-sim"]):
        assert main(args + extra) == 0
        printed.append(json.loads(capsys.readouterr().out))
    assert [c["seed"] for c in calls] == [0, 1]
    assert all(c["algorithm"] == "fedavg" and c["dataset"] == "Cora" and c["partition"] == "louvain" and c["clients"] == 3
               and c["rounds"] == 2 and c["settings"] == {"lr": 0.02, "local_epochs": 2} and c["root"] == str(shared_root) for c in calls)
    local, flower = printed
    assert flower["accuracy_mean"] == local["accuracy_mean"] and flower["bytes_up"] == local["bytes_up"] and flower["dropped"] == []


def test_cli_backend_flower_sim_records_each_seed_as_it_ends_and_resumes(shared_root, monkeypatch, capsys, tmp_path):
    """`--out` on Flower's engine: a run stopped at its third seed leaves the first two recorded; the same command again runs
    the third alone, and the record equals that of an uninterrupted in-process run (the engine stood in for, as above)."""
    import json
    from fglit.cli import main
    args = ["run", "fedavg", "--dataset", "Cora", "--partition", "louvain", "--clients", "3", "--rounds", "2", "--seeds", "0", "1", "2",
            "--root", str(shared_root), "--quiet", "--out"]
    assert main(args + [str(tmp_path / "local")]) == 0
    calls = _stand_in_engine(monkeypatch, fail_at=(2,))
    with pytest.raises(KeyboardInterrupt):
        main(args + [str(tmp_path / "flower"), "--backend", "flower-sim"])
    assert sorted(p.name for p in (tmp_path / "flower" / "seeds").iterdir()) == ["seed_0.json", "seed_1.json"]
    assert [c["seed"] for c in calls] == [0, 1, 2]
    calls = _stand_in_engine(monkeypatch)
    capsys.readouterr()
    assert main(args + [str(tmp_path / "flower"), "--backend", "flower-sim"]) == 0
    assert [c["seed"] for c in calls] == [2] and "seed(s) 0, 1 of this run are there already" in capsys.readouterr().err
    local, flower = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("local", "flower"))
    assert [local[k] for k in ("accuracy_mean", "accuracy_std", "bytes_up")] == [flower[k] for k in ("accuracy_mean", "accuracy_std", "bytes_up")]
    import pandas as pd
    scores = [pd.read_csv(tmp_path / d / "scores.csv") for d in ("local", "flower")]
    pd.testing.assert_frame_equal(*(t.drop(columns=[c for c in t if "second" in c or "time" in c]) for t in scores))   # wall times aside


@pytest.mark.slow
@pytest.mark.long     # a minute of Flower's simulation engine from the command line: `make test-long` (the wiring: the test above)
def test_cli_backend_flower_sim_matches_inprocess(shared_root):
    import json, os, subprocess, sys
    pytest.importorskip("ray", reason="Flower's simulation engine needs Ray (flwr[simulation])")
    from pathlib import Path
    script = Path(sys.executable).parent / "fglit"
    args = [str(script), "run", "fedavg", "--dataset", "Cora", "--partition", "louvain", "--clients", "3", "--rounds", "2", "--json"]
    env = {**os.environ, "FGLIT_DATA": str(shared_root)}
    out = [subprocess.run(args + extra, capture_output=True, text=True, env=env, timeout=400) for extra in ([], ["--backend", "flower-sim"])]
    assert all(o.returncode == 0 for o in out), out[1].stderr[-2000:]
    local, flower = (json.loads(o.stdout) for o in out)
    assert flower["accuracy_mean"] == local["accuracy_mean"] and flower["bytes_up"] == local["bytes_up"]


@pytest.mark.slow
@pytest.mark.parametrize("algorithm,rounds,settings_", [
    ("fedavg", 2, {}),
    pytest.param("fedprox", 2, {}, marks=pytest.mark.long),
    pytest.param("scaffold", 2, {}, marks=pytest.mark.long),
    pytest.param("opfgl", None, {}, marks=pytest.mark.long),
    pytest.param("fedpg", 2, {"upload": "class_sums"}, marks=pytest.mark.long),    # FedPG's summable form (50_fedpg)
])
def test_secure_aggregation_in_flowers_simulation_engine(algorithm, rounds, settings_, shared_root):
    """Secure aggregation in Flower's simulation engine (a SuperLink in simulation mode, `flwr run`, Ray workers: the
    ClientApps in other processes): the protocol's steps travel as Flower messages, and every client's score and fglit's
    byte counts equal the in-process run's (replay=True: the nodes draw their clients' initial weights as `run` does).
    FedAvg runs in `make test`; the other four in `make test-long` (about a minute each)."""
    pytest.importorskip("ray", reason="Flower's simulation engine needs Ray (flwr[simulation])")
    from fglit.flower import run_flower_simulation
    settings_ = {**settings_, "secure_aggregation": True}
    sim = run_flower_simulation(algorithm, "cora", "louvain", 3, rounds=rounds, seed=0, settings=settings_, root=str(shared_root),
                                replay=True, num_cpus=2, timeout=400)
    local = run(algorithm, "cora", "louvain", 3, rounds=rounds, seeds=(0,), settings=settings_, root=shared_root, progress=False)
    _compare(sim, local, 0.0)
    assert {"uplink.advertise", "uplink.unmask"} <= set(sim.wire.kind)
    assert sim.summary()["privacy"]["secagg_rounds"] == local.summary()["privacy"]["secagg_rounds"] == (rounds or 1)


def test_flwr_run_answer_is_found_among_other_output():
    "`flwr run --format json` can print lines with braces before its answer: the first whole JSON object is the answer."
    from fglit.flower import _first_json_object
    assert _first_json_object('note {not json} ... {"success": true, "run-id": 7}\n{"later": 1}') == {"success": True, "run-id": 7}
    assert _first_json_object("no answer") == {} and _first_json_object('[1, {"a": 2}]') == {"a": 2}
    coloured = '\x1b[1m{\x1b[0m\n  \x1b[1;34m"success"\x1b[0m: \x1b[3;92mtrue\x1b[0m\n\x1b[1m}\x1b[0m\n'      # as flwr prints in a kernel
    assert _first_json_object(coloured) == {"success": True}

"""Faults on Flower (`fglit.flower.serve`, nbs/07_flower.ipynb): lost clients dropped above `min_clients`, a clear error below.

These tests drive `serve` with `FakeGrid`, a Grid that runs fglit's ClientApp in this process (one Context per node) and
can lose a node in a chosen round, answering as the SuperLink does for a dead SuperNode (a `NODE_UNAVAILABLE` error
reply) or not at all. The same faults over real processes are in test_flower.py.
"""
import time

import pytest

pytest.importorskip("flwr")

from flwr.app import RecordDict

from fglit.federation import ConfigError, run
from fglit.flower import FlowerRun, FlowerRunError, serve

from _device import DEV, deterministic_on_cuda
from _flower_grid import FakeGrid, assert_matches_in_process


def spec(root, algorithm="fedavg", settings=None, **kw) -> FlowerRun:
    return FlowerRun(algorithm, "cora", "louvain", 4, 0, settings if settings is not None else {"rounds": 3}, root=str(root),
                     timeout=kw.pop("timeout", 30.0), wait_nodes=5.0, **kw)


def test_fake_grid_without_faults_matches_in_process(shared_root):
    "The fake grid itself is faithful: no fault, the same per-client scores as `run` (so the fault tests below test serve)."
    result = serve(FakeGrid(4), spec(shared_root))
    local = run("fedavg", "cora", "louvain", 4, seeds=(0,), settings={"rounds": 3}, root=shared_root, progress=False)
    key = ["round", "client", "split"]
    a, b = (r.runs[0].history.sort_values(key).reset_index(drop=True) for r in (result, local))
    assert_matches_in_process(result, local, tol=0)      # the same rows, accuracies equal (on CUDA within same_run's tolerance), bytes
    exact = DEV.type == "cpu"         # on CUDA atomic adds sum in a varying order (tests/_device.py)
    assert a.auc.notna().any() and ((a.auc - b.auc).abs().max() < (1e-6 if exact else 0.05))   # AUC too (NaN where a client's split has one class)
    assert a.auc.isna().equals(b.auc.isna()) and result.summary()["auc_mean"] == pytest.approx(local.summary()["auc_mean"])
    assert result.dropped.empty and result.summary()["dropped"] == []


def test_lost_client_is_dropped_when_min_clients_allows(shared_root):
    "Client 3 dies before round 2: with min_clients=3 the run completes with 0..2, says so, and lists the drop."
    grid = FakeGrid(4, lose={3: 2})
    result = serve(grid, spec(shared_root, min_clients=3))
    assert result.dropped[["round", "client", "what"]].values.tolist() == [[2, 3, "train"]]
    assert "NODE_UNAVAILABLE" in result.dropped.reason[0]
    assert result.summary()["dropped"][0]["client"] == 3 and result.summary()["scored_clients"] == [0, 1, 2]
    h = result.runs[0].history
    assert set(h[h["round"] == 1].client) == {0, 1, 2, 3}     # round 1 was scored before client 3 was lost
    assert set(h[h["round"] == 3].client) == {0, 1, 2}
    assert not any(cid == 3 and rnd >= 2 for cid, _, rnd in grid.received)   # never asked again
    assert 0 < result.scores().accuracy[0] <= 1
    # round 1 ran with all four: they score round 1 exactly as in-process
    local = run("fedavg", "cora", "louvain", 4, seeds=(0,), settings={"rounds": 3}, root=shared_root, progress=False)
    lh = local.runs[0].history
    key = ["client", "split"]
    a = h[h["round"] == 1].sort_values(key).reset_index(drop=True)
    b = lh[lh["round"] == 1].sort_values(key).reset_index(drop=True)
    assert (a.accuracy - b.accuracy).abs().max() == 0
    # later rounds average 3 clients' models, not 4: not the in-process scores
    b3 = lh[(lh["round"] == 3) & (lh.client < 3)].sort_values(key).reset_index(drop=True)
    a3 = h[h["round"] == 3].sort_values(key).reset_index(drop=True)
    assert (a3.accuracy - b3.accuracy).abs().max() > 0


def test_lost_client_logs_continuing(shared_root, caplog):
    "The ServerApp's log says what happened (Flower's logger: the console, or `flwr log` in a deployment)."
    serve(FakeGrid(4, lose={2: 3}), spec(shared_root, min_clients=2))
    assert "train (round 3): lost client 2" in caplog.text and "continuing with 3 of 4 clients" in caplog.text


def test_lost_client_below_minimum_stops_naming_it(shared_root):
    with pytest.raises(FlowerRunError, match=r"train \(round 2\): lost client 3 \(NODE_UNAVAILABLE.*3 of 4 clients left, fewer than min_clients=4"):
        serve(FakeGrid(4, lose={3: 2}), spec(shared_root))


def test_silent_node_is_reported_after_the_timeout(shared_root):
    "A node that neither answers nor is reported offline: the round's `timeout` bounds the wait."
    t0 = time.monotonic()
    with pytest.raises(FlowerRunError, match=r"lost client 1 \(no reply within 1s\)"):
        serve(FakeGrid(4, lose={1: 1}, silent=True), spec(shared_root, timeout=1.0))
    assert time.monotonic() - t0 < 60


def test_two_losses_one_round_apart(shared_root):
    "Losses accumulate: min_clients=2 tolerates 3 then 0; a third loss would stop it."
    result = serve(FakeGrid(4, lose={3: 2, 0: 3}), spec(shared_root, min_clients=2))
    assert result.dropped[["round", "client"]].values.tolist() == [[2, 3], [3, 0]]
    assert set(result.runs[0].history.query("round == 3").client) == {1, 2}
    with pytest.raises(FlowerRunError, match="1 of 4 clients left, fewer than min_clients=2"):
        serve(FakeGrid(4, lose={3: 2, 0: 3, 1: 3}), spec(shared_root, min_clients=2))


def test_a_failing_client_app_counts_as_lost(shared_root):
    "A ClientApp that raises (here: its state wiped, as after a SuperNode restart) is lost like a dead node."
    grid = FakeGrid(4)
    orig = grid.push_messages
    def push(messages):
        for m in messages:
            if grid.nodes[m.metadata.dst_node_id] == 2 and m.metadata.group_id == "2":
                grid.contexts[m.metadata.dst_node_id].state = RecordDict()
        return orig(messages)
    grid.push_messages = push
    result = serve(grid, spec(shared_root, min_clients=3))
    assert result.dropped.client.tolist() == [2] and "CLIENT_APP_RAISED_EXCEPTION" in result.dropped.reason[0]


def test_partial_participation_skips_dropped_clients(shared_root):
    "client_fraction 0.5: the selection is drawn as in-process, then the dropped client is left out of it."
    grid = FakeGrid(4, lose={1: 2})
    result = serve(grid, spec(shared_root, settings={"rounds": 4, "client_fraction": 0.5}, min_clients=3))
    assert result.dropped.client.tolist() == [1]
    assert not any(cid == 1 and rnd > 2 for cid, _, rnd in grid.received)
    assert set(result.runs[0].history.query("round == 4").client) == {0, 2, 3}


def test_setup_needs_every_client(shared_root):
    with pytest.raises(FlowerRunError, match=r"setup \(round 0\): the run needs every client.*SuperNode 103"):
        serve(FakeGrid(4, lose={3: 0}), spec(shared_root, min_clients=1))


def test_min_clients_is_checked(shared_root):
    with pytest.raises(ConfigError, match="min_clients must be in 0..4"):
        serve(FakeGrid(4), spec(shared_root, min_clients=5))


def test_opfgl_missing_client_is_reported_or_left_out(shared_root):
    """O-pFGL (one shot: round 1 uploads statistics, round 2 downloads the surrogate graph). A client lost in round 1:
    with min_clients=4 the run stops naming it; with min_clients=3 the server sums the other three's statistics."""
    with pytest.raises(FlowerRunError, match=r"train \(round 1\): lost client 3"):
        serve(FakeGrid(4, lose={3: 1}), spec(shared_root, "opfgl", settings={}))
    result = serve(FakeGrid(4, lose={3: 1}), spec(shared_root, "opfgl", settings={}, min_clients=3))
    assert result.dropped[["round", "client"]].values.tolist() == [[1, 3]]
    final = result.runs[0].history.query("round == 2 and split == 'test'")
    assert set(final.client) == {0, 1, 2} and final.accuracy.between(0, 1).all()
    assert result.summary()["bytes_up"] > 0


# -- privacy on Flower: the round loop's uplink runs between the nodes ------------------------------------------------

@pytest.mark.parametrize("algorithm,settings_", [
    ("fedavg", {"rounds": 2, "secure_aggregation": True}),
    ("fedprox", {"rounds": 2, "secure_aggregation": True}),
    ("scaffold", {"rounds": 2, "secure_aggregation": True}),
    pytest.param("opfgl", {"secure_aggregation": True}, marks=pytest.mark.long),   # minutes: `make test-long` (test_secagg checks O-pFGL's secure sums in process)
    ("fedavg", {"rounds": 2, "secure_aggregation": True, "dp_noise": 0.5, "secagg_dropout": 0.25, "dp_seeded_noise": True}),
    ("fedpg", {"rounds": 2, "upload": "class_sums", "secure_aggregation": True}),   # FedPG's summable form (50_fedpg)
    ("fedpg", {"rounds": 2, "dp_noise": 0.2, "dp_clip": 5.0, "dp_seeded_noise": True}),      # the paper's form needs each upload: local DP
])
def test_privacy_on_flower_matches_in_process(algorithm, settings_, shared_root):
    """Secure aggregation (the protocol's four steps as `query.uplink` messages between the ServerApp and the nodes) and
    DP (each node privatises its own reply; seeded noise, so that both runs draw the same) through the Flower transport: every client's score equals the in-process run's
    to 1e-6 (replay=True: the same client initialisation), and fglit counts the same bytes."""
    grid = FakeGrid(4)
    with deterministic_on_cuda():     # FedPG's class sums after 2 rounds sit on near-tied logits: CUDA's atomic adds flipped them
        result = serve(grid, spec(shared_root, algorithm, settings_, replay=True))
        local = run(algorithm, "cora", "louvain", 4, seeds=(0,), settings=settings_, root=shared_root, progress=False)
    assert_matches_in_process(result, local)
    fs, ls = result.summary(), local.summary()
    if settings_.get("secure_aggregation"):
        steps = {t for _, t, _ in grid.received if t == "query.uplink"}
        assert steps and fs["privacy"]["secagg_rounds"] == ls["privacy"]["secagg_rounds"] > 0
        kinds = set(result.wire.kind)
        assert {"uplink.advertise", "uplink.share", "uplink.masked_input", "uplink.consistency", "uplink.unmask"} <= kinds
    if settings_.get("dp_noise"):
        assert fs["privacy"]["epsilon"] == ls["privacy"]["epsilon"]


def test_plain_reply_never_leaves_a_node_under_secure_aggregation(shared_root):
    """Everything the ServerApp receives from the nodes in a secure run: the train replies hold only the layout and
    float count of each node's reply, and no received message holds a node's model vector (the in-process uplink's
    clients, run with the same seed and replay, hold the plain replies to search for)."""
    from fglit.flower import get_message
    from fglit.secagg import view_contains
    grid = FakeGrid(4)
    seen = []
    orig_pull = grid.pull_messages
    def pull(ids):
        replies = orig_pull(ids)
        seen.extend(get_message(r.content, device="cpu") for r in replies if not r.has_error())
        return replies
    grid.pull_messages = pull
    serve(grid, spec(shared_root, "fedavg", {"rounds": 1, "secure_aggregation": True}, replay=True))
    train_replies = [m for m in seen if "layout" in m]
    assert len(train_replies) == 4 and all(set(m) == {"layout", "floats"} for m in train_replies)
    plain = []
    from fglit.uplink import UplinkClient
    orig_seal = UplinkClient.seal
    def spy(self, rnd, down, reply):
        plain.append(reply["params"].double().cpu().numpy()); return orig_seal(self, rnd, down, reply)
    UplinkClient.seal = spy
    try:
        run("fedavg", "cora", "louvain", 4, seeds=(0,), settings={"rounds": 1, "secure_aggregation": True}, root=shared_root, progress=False)
    finally:
        UplinkClient.seal = orig_seal
    protocol = [{k: v.numpy() if hasattr(v, "numpy") else v for k, v in m.items()} for m in seen if "layout" not in m and "step" in m]
    assert len(plain) == 4 and protocol
    assert not any(view_contains(protocol, vector) for vector in plain)


def test_node_lost_during_secure_aggregation_is_a_dropout(shared_root):
    """A node lost between sharing keys and sending its masked input: the protocol goes on without its vector (the others'
    shares rebuild its pairwise masks), the run completes above min_clients, and the loss is recorded in that step."""
    grid = FakeGrid(4)
    orig = grid.push_messages
    def push(messages):
        for m in messages:
            if m.metadata.message_type == "query.uplink" and grid.nodes[m.metadata.dst_node_id] == 3 \
                    and m.content["fglit.meta"]["step"] == "masked_input":
                grid.lose[3] = int(m.metadata.group_id)
        return orig(messages)
    grid.push_messages = push
    result = serve(grid, spec(shared_root, "fedavg", {"rounds": 2, "secure_aggregation": True}, min_clients=3))
    assert result.dropped[["round", "client", "what"]].values.tolist() == [[1, 3, "uplink.masked_input"]]
    assert set(result.runs[0].history.query("round == 2").client) == {0, 1, 2}
    assert 0 < result.scores().accuracy[0] <= 1


# -- the backend's processes: a dead one ends the wait in one line; SIGINT / SIGTERM end them all (issue #58) ----------

# A stand-in backend: `sleep`s named as Flower's and Ray's processes (bash's `exec -a`), in a session of their own, as
# Flower's SuperExec opens one with setsid.
FAKE_BACKEND = ("setsid bash -c '(exec -a raylet sleep 120) & (exec -a gcs_server sleep 120) & exec -a flower-superexec sleep 120' "
                "& wait")


def _fake_superlink():
    import subprocess
    return subprocess.Popen(["bash", "-c", FAKE_BACKEND], start_new_session=True)


def _watching(watch, programs: int = 3):
    "Wait until `watch` has seen the stand-in's processes; their pids by program."
    for _ in range(100):
        assert watch.check() is None
        if len(watch.watched) == programs:
            return {w[1]: pid for pid, w in watch.watched.items()}
        time.sleep(0.1)
    raise AssertionError(f"saw only {watch.watched}")


def test_backend_watch_names_the_dead_process_and_kill_ends_its_sessions(tmp_path):
    """`BackendWatch` names a watched process that dies (a zombie counts as dead), with its pid and log; `kill()` then ends
    every process, including one that left the tree (its parent killed: reparented, found by its session)."""
    import os, signal
    from fglit.flower import BackendWatch
    from _processes import left_alive, sessions_and_descendants
    root = _fake_superlink()
    watch = BackendWatch(lambda: [root], tmp_path / "superlink.log")
    try:
        pids = _watching(watch)
        sessions, seen = set(), {}
        sessions_and_descendants(os.getpid(), sessions, seen)
        assert set(pids.values()) <= set(seen) and len(sessions) == 2     # the root's session and the setsid one
        os.kill(pids["raylet"], signal.SIGKILL)
        time.sleep(0.3)
        assert watch.check() == f"Ray's raylet (pid {pids['raylet']}) died; its log: {tmp_path / 'superlink.log'}"
        os.kill(pids["flower-superexec"], signal.SIGKILL)                  # gcs_server is now nobody's descendant here
        time.sleep(0.3)
        root.wait(timeout=10)                                              # the root's `wait` returned: no descendant is left
        assert pids["gcs_server"] in {p.pid for p in watch.processes()}
        t0 = time.monotonic()
        assert watch.kill() == 1                                           # gcs_server, found by its session
        assert time.monotonic() - t0 < 10 and root.returncode is not None
        assert left_alive(seen, sessions, wait=2) == []
    finally:
        watch.kill(hard=True)


class _FakeFederation:
    "A `LocalFederation` whose SuperLink is the stand-in backend (no Flower process)."
    def __new__(cls, workdir):
        from fglit.flower import LocalFederation
        class Fake(LocalFederation):
            def __init__(self, workdir):
                super().__init__(0, workdir)
            def __enter__(self):
                self._own()
                self.superlink = _fake_superlink()
                return self
        return Fake(workdir)


def test_wait_ends_in_seconds_with_one_line_when_the_backend_dies(tmp_path):
    """`submit`'s wait (`wait_for`): the raylet stand-in SIGKILLed mid-wait ends it within seconds (the watch looks every
    second, then waits 3 s for a result on its way) with a `FlowerRunError` whose first line names the raylet and the log;
    a result that exists is returned at once, dead backend or not."""
    import os, signal, threading
    with _FakeFederation(tmp_path) as fed:
        pids = _watching(fed.watch)
        fed.watch.begin_run()                                   # as submit does: the per-run stand-ins are then not this run's
        assert fed.watch.check() is None and set(w[1] for w in fed.watch.watched.values()) == {"flower-superexec"}
        fed.watch.ignored.clear()                               # ... here they are
        threading.Timer(2.0, os.kill, (pids["raylet"], signal.SIGKILL)).start()
        t0 = time.monotonic()
        with pytest.raises(FlowerRunError) as err:
            fed.wait_for(tmp_path / "result.pkl", timeout=120)
        waited = time.monotonic() - t0
        first = str(err.value).splitlines()[0]
        assert 2 < waited < 12, waited
        assert first == (f"the Flower backend failed before the run's result came: Ray's raylet (pid {pids['raylet']}) died; "
                         f"its log: {tmp_path / 'superlink.log'}")
        (tmp_path / "result.pkl").write_bytes(b"")
        assert fed.wait_for(tmp_path / "result.pkl", timeout=120) == 0
    assert fed.superlink.returncode is not None and fed.watch.processes() == []


def test_a_superlink_that_exits_ends_the_wait(tmp_path):
    with _FakeFederation(tmp_path) as fed:
        _watching(fed.watch)
        fed.superlink.kill()
        with pytest.raises(FlowerRunError, match=rf"the SuperLink \(pid {fed.superlink.pid}\) exited with code -9; its log: "):
            fed.wait_for(tmp_path / "result.pkl", timeout=120)


def test_signal_handlers_are_installed_for_the_run_only(tmp_path):
    "Inside the `with` block SIGINT and SIGTERM are fglit's; after it, the handlers from before (also after an error)."
    import signal
    before = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
    with _FakeFederation(tmp_path) as fed:
        assert [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)] == [fed._guard._handle] * 2
    assert [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)] == before
    with pytest.raises(RuntimeError):
        with _FakeFederation(tmp_path / "b"):
            raise RuntimeError
    assert [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)] == before


@pytest.mark.parametrize("sig,code", [("SIGTERM", 143), pytest.param("SIGINT", -2, marks=pytest.mark.long)])
def test_a_signal_ends_every_process_the_federation_started(sig, code, tmp_path):
    """SIGTERM (exit status 143) or SIGINT (KeyboardInterrupt, which Python ends by SIGINT) to a process holding a federation open:
    every process of the stand-in backend ends, including those in the session the stand-in SuperExec opened."""
    import os, signal, subprocess, sys
    from pathlib import Path
    from _processes import left_alive, sessions_and_descendants
    script = (f"import sys, time; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
              "from test_flower_faults import _FakeFederation, _watching\n"
              f"with _FakeFederation({str(tmp_path)!r}) as fed:\n"
              "    _watching(fed.watch); print('ready', flush=True); time.sleep(120)\n")
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        assert child.stdout.readline().strip() == "ready", child.stderr.read()
        sessions, seen = set(), {}
        sessions_and_descendants(child.pid, sessions, seen)
        assert len(seen) >= 4 and len(sessions) == 2            # bash, flower-superexec, raylet, gcs_server; two sessions
        t0 = time.monotonic()
        child.send_signal(getattr(signal, sig))
        assert child.wait(timeout=30) == code
        assert time.monotonic() - t0 < 15
        assert left_alive(seen, sessions, wait=2) == []
    finally:
        if child.poll() is None: os.killpg(child.pid, signal.SIGKILL)


def _flower_sim_command(shared_root):
    "`fglit run --backend flower-sim` (200 rounds: it is still running when the test acts), in its own session."
    import os, subprocess, sys
    from pathlib import Path
    pytest.importorskip("ray", reason="Flower's simulation engine needs Ray (flwr[simulation])")
    cmd = [str(Path(sys.executable).parent / "fglit"), "run", "fedavg", "--dataset", "Cora", "--partition", "louvain", "--clients", "2",
           "--rounds", "200", "--backend", "flower-sim"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "FGLIT_DATA": str(shared_root), "OMP_NUM_THREADS": "1"})


def _once_raylet_runs(child, sessions: set, seen: dict, limit: float = 300) -> int:
    """Note what `child` starts until Ray's raylet runs; its pid. (The tests act seconds later, not after Ray's workers
    start: under load a raylet can die by itself in its first 20 s, Ray's "Timed out waiting for file .../metrics_agent_port".)"""
    import psutil
    from _processes import sessions_and_descendants
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        assert child.poll() is None, child.communicate()[1][-3000:]
        sessions_and_descendants(child.pid, sessions, seen)
        for pid in seen:
            try:
                if psutil.Process(pid).cmdline()[0].endswith("/raylet"): return pid
            except (psutil.Error, IndexError): pass
        time.sleep(0.2)
    raise AssertionError(f"no raylet within {limit}s")


@pytest.mark.slow
@pytest.mark.long      # a minute and more of Flower's simulation engine: `make test-long` (the same logic on a stand-in: above)
def test_flower_sim_ends_in_one_line_when_its_raylet_dies(shared_root):
    """Ray's raylet SIGKILLed in the middle of `fglit run --backend flower-sim`: the command ends within 30 s of the kill, with
    exit status 2 and one line naming the raylet and its log, and no process it started is left (it used to wait 420-540 s)."""
    import os, shutil, signal
    from _processes import left_alive
    child, sessions, seen = _flower_sim_command(shared_root), set(), {}
    try:
        raylet = _once_raylet_runs(child, sessions, seen)
        time.sleep(3)                          # fglit's watch has seen it (it looks every second)
        os.kill(raylet, signal.SIGKILL)
        t0 = time.monotonic()
        _, err = child.communicate(timeout=60)
        seconds = time.monotonic() - t0
        lines = [line for line in err.splitlines() if line.strip()]
        print(f"ended {seconds:.1f}s after the kill: {lines}")
        assert seconds < 30 and child.returncode == 2
        assert len(lines) == 1 and lines[0].startswith("fglit: error: FlowerRunError: the Flower backend failed before the run's result came: "
                                                       f"Ray's raylet (pid {raylet}) died; its log: /"), lines
        kept = lines[0].split("the SuperLink's log: ")[1]
        assert kept.endswith("/superlink.log") and os.path.exists(kept)       # the working folder is kept for its log
        shutil.rmtree(os.path.dirname(kept))
        assert left_alive(seen, sessions) == []
    finally:
        if child.poll() is None: os.killpg(child.pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.long
def test_sigterm_to_flower_sim_ends_every_process_it_started(shared_root):
    """SIGTERM to `fglit run --backend flower-sim` once Ray runs: it exits (status 143) and every process it started (the
    SuperLink, the SuperExec in its own session, flwr-simulation, Ray's GCS server, raylet and agents) is gone."""
    import os, signal
    from _processes import left_alive
    child, sessions, seen = _flower_sim_command(shared_root), set(), {}
    try:
        _once_raylet_runs(child, sessions, seen)
        time.sleep(1)
        from _processes import sessions_and_descendants
        sessions_and_descendants(child.pid, sessions, seen)
        count = len(seen)
        t0 = time.monotonic()
        child.send_signal(signal.SIGTERM)
        child.communicate(timeout=60)
        print(f"{count} processes; fglit ended {time.monotonic() - t0:.1f}s after SIGTERM")
        assert child.returncode == 143 and count >= 8
        assert left_alive(seen, sessions) == []
    finally:
        if child.poll() is None: os.killpg(child.pid, signal.SIGKILL)


def test_cli_prints_a_dead_backend_as_one_line(monkeypatch, capsys):
    "`fglit run --backend flower-sim` prints the watch's FlowerRunError as one line (not the SuperLink log after it), exit 2."
    import fglit.flower
    from fglit.cli import main
    why = "the Flower backend failed before the run's result came: Ray's raylet (pid 7) died; its log: /tmp/ray/raylet.out"
    def dies(*a, **kw): raise FlowerRunError(f"{why}\nINFO: the SuperLink's log\nmore of it")
    monkeypatch.setattr(fglit.flower, "run_flower_simulation", dies)
    assert main(["run", "fedavg", "--dataset", "Cora", "--clients", "2", "--rounds", "1", "--backend", "flower-sim"]) == 2
    assert capsys.readouterr().err.splitlines() == [f"fglit: error: FlowerRunError: {why}"]

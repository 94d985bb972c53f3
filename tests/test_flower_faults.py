"""Faults on Flower (`fglit.flower.serve`, nbs/07_flower.ipynb): lost clients dropped above `min_clients`, a clear error below.

These tests drive `serve` with `FakeGrid`, a Grid that runs fglit's ClientApp in this process (one Context per node) and
can lose a node in a chosen round, answering as the SuperLink does for a dead SuperNode (a `NODE_UNAVAILABLE` error
reply) or not at all. The same faults over real processes are in test_flower.py.
"""
import itertools
import time
import uuid

import pytest

pytest.importorskip("flwr")

from flwr.app import Context, Error, Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.supercore.task_identity import TaskIdentity

from fglit.federation import ConfigError, run
from fglit.flower import FlowerRun, FlowerRunError, client_app, serve

_RUN_IDS = itertools.count(1000)


class FakeGrid:
    """A Grid whose SuperNodes are in this process. `lose={cid: round}`: from the first message of that round (0: setup)
    on, client `cid`'s node answers nothing (`silent`) or an error reply `NODE_UNAVAILABLE` (as the SuperLink does)."""

    def __init__(self, clients: int, lose: dict | None = None, silent: bool = False):
        self.run_id = next(_RUN_IDS)
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = self.run_id, SUPERLINK_NODE_ID, 1   # as a ServerApp process
        self.nodes = {100 + cid: cid for cid in range(clients)}
        self.contexts = {nid: Context(self.run_id, nid, {"partition-id": cid}, RecordDict(), {}) for nid, cid in self.nodes.items()}
        self.lose, self.silent = dict(lose or {}), silent
        self.replies: dict[str, Message] = {}
        self.received: list[tuple[int, str, int]] = []       # (cid, message type, round) of every message a node handled

    def get_node_ids(self):
        return list(self.nodes)

    def push_messages(self, messages):
        ids = []
        for m in messages:
            mid = uuid.uuid4().hex
            m.metadata.__dict__["_message_id"] = mid
            ids.append(mid)
            cid, rnd = self.nodes[m.metadata.dst_node_id], int(m.metadata.group_id)
            if cid in self.lose and rnd >= self.lose[cid]:
                if not self.silent:
                    self.replies[mid] = Message(Error(ErrorCode.NODE_UNAVAILABLE, "missed its heartbeats"), reply_to=m)
                continue
            self.received.append((cid, m.metadata.message_type, rnd))
            try:
                self.replies[mid] = client_app(m, self.contexts[m.metadata.dst_node_id])
            except Exception as err:           # as a SuperNode reports a ClientApp that raised
                self.replies[mid] = Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, repr(err)), reply_to=m)
        return ids

    def pull_messages(self, message_ids):
        return [self.replies.pop(i) for i in list(message_ids) if i in self.replies]


def spec(root, algorithm="fedavg", settings=None, **kw) -> FlowerRun:
    return FlowerRun(algorithm, "cora", "louvain", 4, 0, settings if settings is not None else {"rounds": 3}, root=str(root),
                     timeout=kw.pop("timeout", 30.0), wait_nodes=5.0, **kw)


def test_fake_grid_without_faults_matches_in_process(shared_root):
    "The fake grid itself is faithful: no fault, the same per-client scores as `run` (so the fault tests below test serve)."
    result = serve(FakeGrid(4), spec(shared_root))
    local = run("fedavg", "cora", "louvain", 4, seeds=(0,), settings={"rounds": 3}, root=shared_root, progress=False)
    key = ["round", "client", "split"]
    a, b = (r.runs[0].history.sort_values(key).reset_index(drop=True) for r in (result, local))
    assert a[key].equals(b[key]) and (a.accuracy - b.accuracy).abs().max() == 0
    assert a.auc.notna().any() and ((a.auc - b.auc).abs().max() < 1e-6)           # AUC too (NaN where a client's split has one class)
    assert a.auc.isna().equals(b.auc.isna()) and result.summary()["auc_mean"] == pytest.approx(local.summary()["auc_mean"])
    assert result.dropped.empty and result.summary()["dropped"] == []


def test_lost_client_is_dropped_when_min_clients_allows(shared_root):
    "Client 3 dies before round 2: with min_clients=3 the run completes with 0..2, says so, and lists the drop."
    grid = FakeGrid(4, lose={3: 2})
    result = serve(grid, spec(shared_root, min_clients=3))
    assert result.dropped[["round", "client", "what"]].values.tolist() == [[2, 3, "train"]]
    assert "NODE_UNAVAILABLE" in result.dropped.reason[0]
    assert result.summary()["dropped"][0]["client"] == 3
    h = result.runs[0].history
    assert set(h[h["round"] == 1].client) == {0, 1, 2}        # round 1's scores rode on round 2's message, lost for 3
    assert set(h[h["round"] == 3].client) == {0, 1, 2}
    assert not any(cid == 3 and rnd >= 2 for cid, _, rnd in grid.received)   # never asked again
    assert 0 < result.scores().accuracy[0] <= 1
    # round 1 ran with all four: clients 0..2 score round 1 exactly as in-process
    local = run("fedavg", "cora", "louvain", 4, seeds=(0,), settings={"rounds": 3}, root=shared_root, progress=False)
    lh = local.runs[0].history
    key = ["client", "split"]
    a = h[h["round"] == 1].sort_values(key).reset_index(drop=True)
    b = lh[(lh["round"] == 1) & (lh.client < 3)].sort_values(key).reset_index(drop=True)
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

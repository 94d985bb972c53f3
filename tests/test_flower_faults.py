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

"""`FakeGrid`: a Flower Grid whose SuperNodes run fglit's ClientApp in this process (one Context per node), and can lose a
node in a chosen round, answering as the SuperLink does for a dead SuperNode. Used by test_flower_faults.py and the
Flower half of test_conformance.py."""
import itertools
import tempfile
import uuid

from flwr.app import Context, Error, Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.supercore.task_identity import TaskIdentity

from fglit.flower import client_app
from fglit.secagg import provision_keys
from _device import DEV, same_total_bytes, score_tolerance

_RUN_IDS = itertools.count(1000)


class FakeGrid:
    """A Grid whose SuperNodes are in this process. `lose={cid: round}`: from the first message of that round (0: setup)
    on, client `cid`'s node answers nothing (`silent`) or an error reply `NODE_UNAVAILABLE` (as the SuperLink does)."""

    def __init__(self, clients: int, lose: dict | None = None, silent: bool = False):
        self.run_id = next(_RUN_IDS)
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = self.run_id, SUPERLINK_NODE_ID, 1   # as a ServerApp process
        self.nodes = {100 + cid: cid for cid in range(clients)}
        self.keys = provision_keys(tempfile.mkdtemp(prefix="fglit-keys-"), clients)     # the operator's keys for secure aggregation
        self.contexts = {nid: Context(self.run_id, nid, {"partition-id": cid, "key-folder": str(self.keys)}, RecordDict(), {})
                         for nid, cid in self.nodes.items()}
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


def assert_matches_in_process(flower, local, tol: float = 1e-6) -> None:
    """A Flower run against the in-process run: the same (round, client, split, n) rows, every score within `tol`, the same
    fglit bytes. On CUDA, where atomic adds sum floats in a varying order, scores agree within `same_run`'s tolerance
    (0.05, or three of a client's predictions) and bytes
    within `same_bytes`' 0.1% (a float in a message header is written in as many characters as it needs)."""
    key = ["round", "client", "split"]
    a = flower.runs[0].history.sort_values(key).reset_index(drop=True)
    b = local.runs[0].history.sort_values(key).reset_index(drop=True)
    assert a[key + ["n"]].equals(b[key + ["n"]])
    tol = tol if DEV.type == "cpu" else score_tolerance(a.n.to_numpy(), max(tol, 0.05))
    gap = (a.accuracy - b.accuracy).abs().fillna(0).to_numpy()
    assert (gap <= tol).all(), f"scores moved by up to {gap.max():.4f} (rows {a[gap > tol][key].to_dict('records')}); tolerance {tol}"
    fs, ls = flower.summary(), local.summary()
    assert same_total_bytes(fs["bytes_up"], ls["bytes_up"]) and same_total_bytes(fs["bytes_down"], ls["bytes_down"])

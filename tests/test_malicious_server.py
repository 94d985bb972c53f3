"""A server that deviates from the protocol to learn one client's update (issue #58's three attacks): it plays fake
clients under keys of its own, it claims a huge number of senders to shrink each client's DP noise, and it sums clients in
groups while epsilon is reported for one. Each attack succeeded on main before the key directory, the threshold-sized
noise and the per-group accountant; each test fails if its defence is removed."""
import math

import numpy as np
import pytest
import torch

from fglit.algorithms.fedavg import FedAvgConfig
from fglit.federation import get_algorithm, run
from fglit.fl.config import make_config
from fglit.privacy import PrivacyAccountant
from fglit.secagg import (FixedPoint, KeyDirectory, MessageRejected, SecAggClient, SecAggError, SecAggParams, SecAggServer,
                          _raw_public, group_threshold, make_identities, run_protocol, client_step, load_site_keys,
                          provision_keys)
from fglit.uplink import UplinkClient, enrol_in_process

L = 4000                                        # update length: long enough to measure the noise's std


def _halves(n: int, settings: dict) -> dict:
    "n enrolled FedAvg uplink halves holding a sealed reply of round 1 (params = c + 1 everywhere, weight 1)."
    cfg = make_config(FedAvgConfig, {"secure_aggregation": True, **settings})
    halves = {c: UplinkClient(c, get_algorithm("fedavg"), cfg, seed=0) for c in range(n)}
    enrol_in_process(halves)
    for c, h in halves.items(): h.seal(1, {}, {"params": torch.full((L,), float(c + 1)), "weight": 1.0})
    return halves


def _context(pki: dict, n: int, **extra) -> dict:
    return {"session": "s", "group": n, "pki": {str(c): _raw_public(k).hex() for c, k in pki.items()}, **extra}


def test_a_server_that_plays_fake_clients_recovers_nothing_and_the_victim_aborts():
    """Attack 1: the server enrols keys of its own under ids 1-5 and runs the protocol with the victim (client 0) and its
    puppets (inputs zero). Without the operator's directory the sum is the victim's update (error 0); with it, the victim
    checks the announced keys first and aborts: no message of its carries its input."""
    victim = _halves(6, {})[0]
    puppet_keys = make_identities(range(1, 6))
    pki = {0: victim.identity.public_key(), **{c: k.public_key() for c, k in puppet_keys.items()}}
    params = SecAggParams()
    server = SecAggServer("s", 1, L + 1, pki, params, FixedPoint(32), np.random.default_rng(0))
    puppets = {c: SecAggClient(c, k, "s", 1, params, {c2: p for c2, p in pki.items()}) for c, k in puppet_keys.items()}
    context = _context(pki, 6)
    sent_by_victim = []
    def call(step, messages):
        out = {c: client_step(puppets[c], step, m, np.zeros(L + 1, np.uint64)) for c, m in messages.items() if c != 0}
        if 0 in messages:
            out[0] = victim.step(1, step, messages[0], context); sent_by_victim.append(out[0])
        return out
    with pytest.raises(MessageRejected, match="server's key for client 1 is not the one in the operator's key directory"):
        run_protocol(server, list(range(6)), call)
    assert sent_by_victim == [] and server.result is None

    # the same attack on a client that took the server's keys (main before the fix) recovers the update exactly
    naive = SecAggClient(0, victim.identity, "s", 1, params, pki)
    x = FixedPoint(32).encode(np.r_[np.full(L, 1.0), 1.0], 6)
    server = SecAggServer("s", 1, L + 1, pki, params, FixedPoint(32), np.random.default_rng(0))
    puppets = {c: SecAggClient(c, k, "s", 1, params, pki) for c, k in puppet_keys.items()}
    both = {0: naive, **puppets}
    res = run_protocol(server, list(range(6)), lambda step, ms: {c: client_step(both[c], step, m, x if c == 0 else
                                                                                 np.zeros(L + 1, np.uint64)) for c, m in ms.items()})
    assert np.abs(res.total - FixedPoint(32).decode(x)).max() == 0.0


def test_keys_the_server_signs_itself_or_a_directory_it_forges_do_not_verify(tmp_path):
    """Attack 1, other forms: the server announces the real keys but signs the victim's neighbours' adverts with its own;
    or it hands out a directory it signed itself. The first fails the advert's signature check, the second the operator's."""
    halves = _halves(4, {})
    real = {c: h.identity.public_key() for c, h in halves.items()}
    context = _context(real, 4)
    victim = halves[0]
    victim.step(1, "advertise", {}, context)
    fake = make_identities(range(1, 4))
    body = {"session": "s", "round": 1, "step": "advertise"}
    roster = {"neighbours": np.array([1, 2, 3])}
    for c, k in fake.items():
        adv = SecAggClient(c, k, "s", 1, SecAggParams(), {}).advertise()
        roster |= {f"c_pk/{c}": adv["c_pk"], f"s_pk/{c}": adv["s_pk"], f"sig/{c}": adv["signature"]}
    with pytest.raises(MessageRejected, match="does not verify"):
        victim.step(1, "share", roster, context)
    provision_keys(tmp_path, 3)
    identity, directory = load_site_keys(tmp_path, 0)
    forged = KeyDirectory.signed({**directory.keys, 1: _raw_public(fake[1])}, make_identities([9])[9])
    with pytest.raises(MessageRejected, match="operator's key"):
        forged.verified(bytes.fromhex((tmp_path / "operator.pub").read_text()))
    (tmp_path / "directory.json").write_text(forged.to_json())
    with pytest.raises(MessageRejected, match="operator's key"):
        load_site_keys(tmp_path, 0)


def test_a_client_without_the_operators_directory_takes_no_keys_from_the_server():
    cfg = make_config(FedAvgConfig, {"secure_aggregation": True})
    half = UplinkClient(0, get_algorithm("fedavg"), cfg, seed=0)
    half.seal(1, {}, {"params": torch.ones(3), "weight": 1.0})
    with pytest.raises(SecAggError, match="no key directory from the operator"):
        half.step(1, "advertise", {}, _context({0: half.identity.public_key()}, 1))


def _noise_std(n: int, context_extra: dict, sigma: float = 1.0) -> float:
    "Run an honest protocol among n DP halves, the server adding `context_extra` to the context; the std of the sum's noise."
    halves = _halves(n, {"dp_noise": sigma, "dp_clip": 1e3})      # a clip no update reaches: the noise is all that differs
    pki = {c: h.identity.public_key() for c, h in halves.items()}
    server = SecAggServer("s", 1, L + 1, pki, halves[0].params, FixedPoint(32), np.random.default_rng(0))
    context = _context(pki, n, **context_extra)
    res = run_protocol(server, list(range(n)), lambda step, ms: {c: halves[c].step(1, step, m, context) for c, m in ms.items()})
    return float(np.std(res.total[:L] - sum(c + 1 for c in range(n))))


def test_a_server_that_claims_a_million_senders_does_not_lower_the_noise():
    """Attack 2: noise used to be sigma*C/sqrt(senders) with `senders` from the server's context. Each client now sizes it by
    the threshold t it enforces itself, so the unmasked sum carries std sigma*C*sqrt(n/t) >= sigma*C whatever the server says."""
    n, t = 5, group_threshold(5, 2 / 3)
    honest, lying = _noise_std(n, {}), _noise_std(n, {"senders": 10 ** 6})
    expected = 1e3 * math.sqrt(n / t)                             # sigma * C * sqrt(n / t), C = 1e3
    assert honest == pytest.approx(expected, rel=0.05) and lying == pytest.approx(expected, rel=0.05)
    assert lying >= 1e3 * 0.95                                     # never below sigma * C


def test_clients_given_different_thresholds_refuse_to_unmask():
    """A server that gives some clients larger groups (larger t, less noise each) than others: every client signs its t
    with the list of senders, so a client sees the others' signatures fail and reveals no share."""
    ids = list(range(6))
    keys = make_identities(ids)
    pki = {c: k.public_key() for c, k in keys.items()}
    server = SecAggServer("s", 1, 8, pki, SecAggParams(), FixedPoint(32), np.random.default_rng(0))
    clients = {c: SecAggClient(c, keys[c], "s", 1, SecAggParams(), pki) for c in ids}
    rosters = server.advertise([clients[c].advertise() for c in ids], ids)
    forwarded = server.share([clients[c].share_keys(rosters[c]) for c in ids])
    survivors = server.masked_input([clients[c].masked_input(forwarded[c], np.zeros(8, np.uint64)) for c in ids])
    clients[5].t = clients[5].t + 1                               # as if the server had given client 5 a larger group
    signatures = server.consistency([clients[c].consistency(survivors[c]) for c in ids])
    for c in range(5):
        with pytest.raises(MessageRejected, match="different lists"):
            clients[c].unmask(signatures[c])


def test_epsilon_is_the_weakest_groups_and_each_group_agrees_with_dp_accounting(shared_root):
    """Attack 3: clients on an MLP (graphless) and on the GCN are summed in two groups; with 5 clients in groups of 2 and 3
    epsilon used to be reported for one multiplier, 1.0, while the groups' sums carried 0.632 and 0.775. Here 10 clients, 3
    graphless (groups of 3 and 7). Each client now noises by its group's t, so every
    group's sum is held to sigma (the guarantee, whichever clients a server keeps) and this run's sums carried
    sigma*sqrt(sum over members of 1/t). Each group's epsilon is reported beside the weakest, and each agrees with
    dp-accounting's RDP and PLD accountants."""
    from dp_accounting import GaussianDpEvent
    from dp_accounting.pld import pld_privacy_accountant as pld
    from dp_accounting.rdp import rdp_privacy_accountant as rdp
    def dp_accounting_epsilon(multiplier, releases):
        return min(rdp.RdpAccountant().compose(GaussianDpEvent(multiplier), releases).get_epsilon(1e-5),
                   pld.PLDAccountant(value_discretization_interval=1e-3).compose(GaussianDpEvent(multiplier), releases).get_epsilon(1e-5))
    rounds, sigma = 3, 0.8
    s = run("fedavg", "Cora", "louvain", 10, rounds=rounds, local_epochs=1, seeds=[0], progress=False, root=shared_root,
            settings=dict(graphless_ratio=0.3, graphless_model="mlp", dp_noise=sigma, dp_clip=1.0,
                          secure_aggregation=True)).summary()["privacy"]
    eps, this_run = s["dp_epsilon_groups"], s["dp_epsilon_groups_this_run"]
    assert len(eps) == 2 and s["epsilon"] == max(eps.values()) and s["dp_weakest_group"] == max(eps, key=eps.get)
    assert sorted(s["dp_noise_multiplier_groups_this_run"].values()) == pytest.approx(
        sorted(sigma * math.sqrt(m / group_threshold(m, 2 / 3)) for m in (3, 7)))
    for group in eps:
        assert eps[group] == pytest.approx(dp_accounting_epsilon(sigma, rounds), rel=1e-3)
        multiplier = s["dp_noise_multiplier_groups_this_run"][group]
        assert multiplier >= sigma - 1e-12
        assert this_run[group] == pytest.approx(dp_accounting_epsilon(multiplier, rounds), rel=1e-3) and this_run[group] <= eps[group]


def _until_shares(n: int) -> tuple:
    "n enrolled DP halves through an honest advertise and share: (halves, context, server, rosters, forwarded shares)."
    halves = _halves(n, {"dp_noise": 1.0, "dp_clip": 10.0})
    pki = {c: h.identity.public_key() for c, h in halves.items()}
    context = _context(pki, n)
    server = SecAggServer("s", 1, L + 1, pki, halves[0].params, FixedPoint(32), np.random.default_rng(0))
    rosters = server.advertise([halves[c].step(1, "advertise", {}, context) for c in range(n)], list(range(n)))
    forwarded = server.share([halves[c].step(1, "share", rosters[c], context) for c in range(n)])
    return halves, context, server, rosters, forwarded


def test_a_client_takes_part_in_one_aggregation_a_round():
    """A server that runs a second aggregation of the same round over other clients could subtract the two sums and isolate
    one client's noised input: a client that already sent its masked input of a round aborts a second session."""
    halves, context, server, rosters, forwarded = _until_shares(4)
    server.masked_input([halves[c].step(1, "masked_input", forwarded[c], context) for c in range(4)])
    with pytest.raises(SecAggError, match="one aggregation a round"):
        halves[0].step(1, "advertise", {}, {**context, "session": "again"})


def test_a_supernode_takes_its_keys_from_its_own_settings_never_from_the_server(monkeypatch, tmp_path):
    from flwr.app import Context, RecordDict
    from fglit.federation import ConfigError
    from fglit.flower_app import _site_keys
    monkeypatch.delenv("FGLIT_KEY_FOLDER", raising=False)
    with pytest.raises(ConfigError, match="key-folder"):
        _site_keys(Context(1, 2, {"partition-id": 0}, RecordDict(), {}), 0)
    provision_keys(tmp_path, 2)
    identity, directory = _site_keys(Context(1, 2, {"partition-id": 1, "key-folder": str(tmp_path)}, RecordDict(), {}), 1)
    assert directory.keys[1] == _raw_public(identity) and directory.keys[0] != directory.keys[1]


def test_a_second_masked_input_under_the_same_masks_is_refused():
    """Asked twice for its masked input in one session, a client would send y1 - y2 = its two noise draws' difference (the
    masks cancel): it answers each step once, in order, and nothing but consistency and unmask once its input is sent."""
    halves, context, server, rosters, forwarded = _until_shares(4)
    with pytest.raises(MessageRejected, match="each step is answered once, in order"):
        halves[0].step(1, "share", rosters[0], context)               # share again: new b and shares
    first = halves[0].step(1, "masked_input", forwarded[0], context)
    with pytest.raises(SecAggError, match="one aggregation a round"):
        halves[0].step(1, "masked_input", forwarded[0], context)
    session = SecAggClient(1, halves[1].identity, "s", 1, SecAggParams(), {c: h.identity.public_key() for c, h in halves.items()})
    with pytest.raises(MessageRejected, match="first"):
        client_step(session, "masked_input", forwarded[1], np.zeros(L + 1, np.uint64))   # out of turn
    assert first["y"].shape == (L + 1,)


def test_a_node_seals_every_reply_whatever_the_servers_message_says(shared_root, monkeypatch):
    """A server that tells the nodes not to seal (`seal: False` in its train message) would get plain replies; a node with an
    uplink seals regardless, so the ServerApp receives layouts and float counts only."""
    from fglit.flower import FlowerRun, FlowerTransport, serve
    from _flower_grid import FakeGrid
    replies = []
    real = FlowerTransport.train
    def hostile(self, rnd, seed, messages, seal, show=False):
        out = real(self, rnd, seed, messages, False, show)
        replies.extend(out.values())
        return out
    monkeypatch.setattr(FlowerTransport, "train", hostile)
    result = serve(FakeGrid(3), FlowerRun("fedavg", "cora", "louvain", 3, 0, {"rounds": 1, "secure_aggregation": True},
                                          root=str(shared_root), timeout=30.0, wait_nodes=5.0))
    assert len(replies) == 3 and all(set(r) == {"layout", "floats"} for r in replies)
    assert result.summary()["privacy"]["secagg_rounds"] == 1


def test_a_supernode_refuses_a_run_below_its_own_privacy_floors(shared_root):
    from flwr.app import Context, RecordDict
    from fglit.algorithms.fedavg import FedAvgConfig
    from fglit.federation import ConfigError
    from fglit.flower_app import _node_floors
    node = lambda **nc: Context(1, 2, {"partition-id": 0, **nc}, RecordDict(), {})
    plain = make_config(FedAvgConfig, {})
    noised = make_config(FedAvgConfig, {"secure_aggregation": True, "dp_noise": 1.0})
    with pytest.raises(ConfigError, match="requires secure aggregation"):
        _node_floors(node(**{"require-secure-aggregation": True}), plain)
    with pytest.raises(ConfigError, match="requires dp_noise >= 2"):
        _node_floors(node(**{"min-dp-noise": 2.0}), noised)
    _node_floors(node(**{"require-secure-aggregation": "true", "min-dp-noise": 0.5}), noised)     # at or above its floors: runs

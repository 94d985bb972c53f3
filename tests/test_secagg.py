"""Secure aggregation: fixed point, Shamir, the protocol's sums under dropouts, the threshold, the server's view,
tampered messages, and the round-loop integration (O-pFGL on Cora end to end)."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from fglit.federation import ConfigError, get_algorithm, run
from fglit.fl.config import make_config
from fglit.secagg import (PRIME, FixedPoint, FixedPointOverflow, MessageRejected, SecAggParams, ThresholdError,
                          _signed, group_threshold, make_identities, neighbour_graph, secagg_plus_degree,
                          secure_sum, shamir_reconstruct, shamir_share, view_contains)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    old = torch.get_num_threads(); torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 40), st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=50), st.integers(1, 100))
def test_fixed_point_round_trip(bits, values, n):
    fp = FixedPoint(bits)
    x = np.array(values)
    if np.abs(x).max() >= fp.bound(n):
        with pytest.raises(FixedPointOverflow):
            fp.encode(x, n)
    else:
        assert np.abs(fp.decode(fp.encode(x, n)) - x).max() <= fp.precision + np.abs(x).max() * 2 ** -52


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2 ** 256 - 1), st.integers(2, 12), st.data())
def test_shamir_any_t_shares_reconstruct_fewer_refuse(secret, m, data):
    t = data.draw(st.integers(1, m))
    xs = list(range(1, m + 1))
    shares = shamir_share(secret, xs, t)
    subset = data.draw(st.lists(st.sampled_from(xs), min_size=t, max_size=m, unique=True))
    assert shamir_reconstruct({x: shares[x] for x in subset}, t) == secret
    if t > 1:
        fewer = subset[:t - 1]
        with pytest.raises(ThresholdError):
            shamir_reconstruct({x: shares[x] for x in fewer}, t)
        # interpolating t-1 points gives a field element unrelated to the secret (overwhelmingly not it)
        if t - 1 >= 1:
            assert shamir_reconstruct({x: shares[x] for x in fewer}, t - 1) != secret or secret == 0


@settings(max_examples=25, deadline=None)
@given(st.integers(3, 14), st.integers(1, 40), st.sampled_from([0, -1]), st.integers(0, 2 ** 32), st.data())
def test_secure_sum_equals_plain_sum_above_threshold(n, length, k, seed, data):
    rng = np.random.default_rng(seed)
    vecs = {c: rng.normal(0, 100, length) * rng.uniform(0, 5) for c in range(n)}
    params = SecAggParams(neighbours=k)
    # dropouts that keep every group above its threshold: at most floor of the slack in the smallest group
    deg = n - 1 if k == 0 else min(n - 1, params.degree(n) + params.degree(n) % 2)
    slack = (deg + 1) - group_threshold(deg + 1, params.threshold)
    order = rng.permutation(n).tolist()
    nb = data.draw(st.integers(0, slack)); na = data.draw(st.integers(0, slack - nb))
    before, after = order[:nb], order[nb:nb + na]
    if n - nb < 2: return
    res = secure_sum(vecs, params, before, after, rng=np.random.default_rng(seed))
    assert sorted(res.included) == sorted(set(range(n)) - set(before))
    plain = sum(vecs[c] for c in res.included)
    assert np.abs(res.total - plain).max() <= len(res.included) * FixedPoint().precision + 1e-9 * np.abs(plain).max()


def test_secagg_plus_graph_is_k_regular_and_symmetric():
    for n in (10, 100, 1000):
        k = secagg_plus_degree(n)
        g = neighbour_graph(list(range(n)), k, np.random.default_rng(n))
        assert all(len(v) == min(k, n - 1) for v in g.values())
        assert all(u in g[v] for u in g for v in g[u]) and all(u not in g[u] for u in g)


def test_below_threshold_aborts_and_nothing_is_aggregated():
    rng = np.random.default_rng(0)
    vecs = {c: rng.normal(size=50) for c in range(10)}          # t = 7 of 10
    for before, after in [((), (0, 1, 2, 3)), ((0, 1, 2, 3), ())]:
        seen = {}
        with pytest.raises(ThresholdError, match="threshold is 7"):
            secure_sum(vecs, drop_before=before, drop_after=after, intercept=lambda step, m: seen.setdefault(id(m), m))
    # the SecAgg+ variant aborts per neighbourhood
    vecs = {c: rng.normal(size=5) for c in range(30)}
    with pytest.raises(ThresholdError):
        secure_sum(vecs, SecAggParams(neighbours=4), drop_after=tuple(range(0, 30, 2)))


def test_server_view_never_contains_a_plain_vector():
    rng = np.random.default_rng(1)
    vecs = {c: rng.normal(size=300) for c in range(10)}
    for after in ((), (2, 5, 8)):
        res = secure_sum(vecs, drop_after=after)
        assert res.view and not any(view_contains(res.view, v) for v in vecs.values())
    assert view_contains(res.view + [{"oops": vecs[4]}], vecs[4])


def _tampered(change, step_name, sender=2):
    return lambda step, m: change(m) if step == step_name and m["sender"] == sender else m


def test_tampered_and_malformed_messages_are_rejected():
    rng = np.random.default_rng(2)
    vecs = {c: rng.normal(size=20) for c in range(8)}
    ids = make_identities(range(8))
    old = {}
    secure_sum(vecs, identities=ids, session="S", rnd=1, intercept=lambda step, m: old.setdefault((step, m["sender"]), m))
    cases = {
        "has 19 values, expected 20": _tampered(lambda m: {**m, "y": m["y"][:-1]}, "masked_input"),
        "not a 1-d int64": _tampered(lambda m: {**m, "y": m["y"].astype(np.float64)}, "masked_input"),
        "does not verify under client 5": _tampered(lambda m: {**m, "sender": 5}, "masked_input"),
        "round 1, this is round 2": _tampered(lambda m: old[("masked_input", 2)], "masked_input"),
        "second masked_input message": _tampered(lambda m: old[("masked_input", 1)] | {"round": 2}, "masked_input", sender=3),
        "does not verify under client 2": _tampered(lambda m: {**m, "y": m["y"] ^ np.int64(4)}, "masked_input"),
        "not expected": _tampered(lambda m: {**m, "sender": 42}, "advertise"),
        "another session": _tampered(lambda m: {**m, "session": "T"}, "share"),
        "fail authentication": _tampered(lambda m: _signed({**{k: v for k, v in m.items() if k != "signature"},
                                                             "ct/3": m["ct/3"] ^ np.uint8(1)}, ids[2]), "share"),
        "expected its neighbours": _tampered(lambda m: _signed({k: v for k, v in m.items() if k not in ("signature", "ct/3")}, ids[2]), "share"),
    }
    for expected, intercept in cases.items():
        with pytest.raises(MessageRejected, match=expected):
            secure_sum(vecs, identities=ids, session="S", rnd=2, intercept=intercept)


def test_sums_only_false_algorithm_refuses_secure_aggregation(shared_root):
    from fglit.data import load_dataset
    cora = load_dataset("Cora", shared_root)
    for algo in ("fedtgp", "gcfl"):
        with pytest.raises(ConfigError, match=f"{algo} cannot run under secure aggregation"):
            run(algo, cora, "louvain", 3, rounds=1, seeds=[0], progress=False, settings={"secure_aggregation": True})
    # FedPG decides by its settings: the paper's form is refused, with the setting that makes it summable named
    with pytest.raises(ConfigError, match="fedpg cannot run under secure aggregation.*with upload=class_sums only"):
        run("fedpg", cora, "louvain", 3, rounds=1, seeds=[0], progress=False, settings={"secure_aggregation": True})
    fedpg = get_algorithm("fedpg")
    assert not fedpg.takes_sums() and fedpg.takes_sums(make_config(fedpg.config, {"upload": "class_sums"}))
    assert get_algorithm("fedavg").takes_sums() and not get_algorithm("gcfl").takes_sums()


def test_fedavg_and_fedproto_unchanged_under_secure_aggregation(shared_root):
    from fglit.data import load_dataset
    cora = load_dataset("Cora", shared_root)
    for algo in ("fedavg", "fedproto", "scaffold"):
        out = {}
        for sec in (False, True):
            params = {}
            r = run(algo, cora, "louvain", 5, rounds=2, local_epochs=1, seeds=[0], progress=False,
                    settings={"secure_aggregation": True, "secagg_dropout": 0.2} if sec else {},
                    callback=lambda rnd, server, clients: params.update(p=getattr(server, "params", getattr(server, "protos", None)).clone()))
            out[sec] = (r.summary(), params["p"])
        assert torch.allclose(out[False][1].double(), out[True][1].double(), atol=1e-5), algo
        assert abs(out[False][0]["accuracy_mean"] - out[True][0]["accuracy_mean"]) < 1e-9, algo
        assert out[True][0]["privacy"]["secagg_dropped_after"] == 2 and out[True][0]["bytes_up"] > out[False][0]["bytes_up"]


@pytest.mark.parametrize("dropout", [0.0, 0.1, 0.3])
def test_opfgl_cora_secure_sums_and_accuracy_match_plain(shared_root, dropout):
    from fglit.data import load_dataset
    cora = load_dataset("Cora", shared_root)
    quick = dict(surrogate_iters=100, stage1_iters=200, finetune_iters=200)

    def go(extra):
        sums = {}
        def grab(rnd, server, clients):
            if rnd == 1: sums.update({k: v.clone() for k, v in server.sums.items()})
        s = run("opfgl", cora, "louvain", 10, seeds=[0], progress=False, settings={**quick, **extra}, callback=grab).summary()
        return s, sums

    plain, ps = go({})
    sec, ss = go({"secure_aggregation": True, "secagg_dropout": dropout})
    bound = 10 * FixedPoint().precision
    for k in ps:
        assert (ps[k] - ss[k]).abs().max() <= bound + 1e-6 * ps[k].abs().max(), k
    assert round(sec["accuracy_mean"], 4) == round(plain["accuracy_mean"], 4)
    assert sec["privacy"]["secagg_dropped_after"] == round(dropout * 10)


def test_cli_secure_aggregation_and_dp_flags(shared_root, capsys):
    import json
    from fglit.cli import main
    main(["run", "fedavg", "--dataset", "Cora", "--clients", "4", "--rounds", "2", "--local-epochs", "1", "--quiet", "--json",
          "--root", str(shared_root), "--secure-aggregation", "--secagg-dropout", "0.25", "--dp-noise", "2.0", "--dp-clip", "0.5"])
    s = json.loads(capsys.readouterr().out)
    pv = s["privacy"]
    assert pv["secure_aggregation"] and pv["secagg_dropped_after"] == 2 and pv["releases"] == 2
    assert s["config"]["privacy"]["secagg_dropout"] == 0.25 and s["config"]["privacy"]["dp_noise"] == 2.0 and 0 < pv["epsilon"] < float("inf")


def _until_masked_inputs(n: int = 6):
    "Clients and a server of one aggregation, run honestly up to the masked inputs."
    from fglit.secagg import SecAggClient, SecAggServer
    ids = list(range(n))
    identities = make_identities(ids)
    pki = {c: identities[c].public_key() for c in ids}
    params, fixed = SecAggParams(), FixedPoint(32)
    server = SecAggServer("S", 1, 8, pki, params, fixed, np.random.default_rng(0))
    clients = {c: SecAggClient(c, identities[c], "S", 1, params, pki) for c in ids}
    xs = {c: fixed.encode(np.random.default_rng(c).normal(size=8), n) for c in ids}
    rosters = server.advertise([clients[c].advertise() for c in ids], ids)
    forwarded = server.share([clients[c].share_keys(rosters[c]) for c in ids])
    server.masked_input([clients[c].masked_input(forwarded[c], xs[c]) for c in ids])
    return ids, clients


def test_a_server_that_splits_the_survivor_list_learns_nothing():
    """The attack: tell some clients the victim sent its input (they release its b share) and the others that it did not
    (they release its s_SK share): with t of each, both masks of the victim, so its input. With the consistency round
    every honest client first checks t signatures on the list *it* was sent: no split gives both sides t."""
    from fglit.secagg import MessageRejected
    ids, clients = _until_masked_inputs(6)              # threshold 2/3: t = 5 of 6
    victim, told_sent, told_dropped = 0, [0, 1, 2, 3], [4, 5]
    lists = {c: np.array(ids if c in told_sent else ids[1:], np.int64) for c in ids}
    sigs = {c: clients[c].consistency({"u3": lists[c]})["u3_sig"] for c in ids}
    released = []
    for side in (told_sent, told_dropped):             # (a) each side sees only its own side's signatures: fewer than t
        msg = {"u4": np.array(side, np.int64), **{f"sig/{u}": sigs[u] for u in side}}
        for c in side:
            with pytest.raises(ThresholdError):
                released.append(clients[c].unmask(msg))
    msg = {"u4": np.array(ids, np.int64), **{f"sig/{u}": sigs[u] for u in ids}}
    for c in ids:                                       # (b) all signatures, claimed to be on one list: some do not verify
        with pytest.raises(MessageRejected, match="different lists"):
            released.append(clients[c].unmask(msg))
    assert released == []                               # no share of the victim's secrets left any client


def test_thresholds_below_two_thirds_are_refused():
    from fglit.algorithms.fedavg import FedAvgConfig
    from fglit.federation import make_config
    with pytest.raises(ConfigError, match=r"in \[2/3, 1\).*Bonawitz"):
        SecAggParams(0.3)
    with pytest.raises(ConfigError, match="secagg_threshold must be >= 0.666667"):
        make_config(FedAvgConfig, {"secure_aggregation": True, "secagg_threshold": 0.3})

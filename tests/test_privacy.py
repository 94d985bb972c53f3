"""Differential privacy: clipping, the Gaussian mechanism, the accountant against the RDP formulas, and runs reporting epsilon."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from fglit.federation import ConfigError, make_config, run
from fglit.privacy import PrivacyAccountant, classic_epsilon, clip_l2, gaussian_mechanism, noise_for_epsilon


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-1e3, 1e3, allow_nan=False), min_size=1, max_size=30), st.floats(0.01, 100))
def test_clip_l2_bounds_the_norm_and_keeps_small_vectors(values, clip):
    v = torch.tensor(values, dtype=torch.float64)
    (out,), factor = clip_l2([v], clip)
    assert float(out.norm()) <= clip * (1 + 1e-9)
    if float(v.norm()) <= clip: assert torch.equal(out, v) and factor == 1.0


def test_gaussian_mechanism_std_and_fraction():
    g = torch.Generator().manual_seed(0)
    x = gaussian_mechanism(torch.zeros(200_000), 3.0, g)
    assert abs(float(x.std()) - 3.0) < 0.03
    y = gaussian_mechanism(torch.zeros(200_000), 3.0, g, fraction=0.2)
    assert abs(float((y != 0).double().mean()) - 0.2) < 0.01


@settings(max_examples=20, deadline=None)
@given(st.floats(0.5, 20), st.integers(1, 50), st.sampled_from([1e-5, 1e-6]))
def test_accountant_matches_rdp_formulas(sigma, rounds, delta):
    acc = PrivacyAccountant(delta)
    for _ in range(rounds): acc.step(sigma)
    eps = acc.epsilon()
    # the library's conversion is never looser than the classic one, and composition of T Gaussians is one of sigma/sqrt(T)
    assert 0 < eps <= classic_epsilon([sigma] * rounds, delta) + 1e-9
    one = PrivacyAccountant(delta); one.step(sigma / math.sqrt(rounds))
    assert abs(one.epsilon() - eps) < 1e-6 * max(1, eps)


def test_known_value_and_monotonicity():
    # classic RDP conversion for sigma = 1, delta = 1e-5: min_a a/2 + log(1e5)/(a-1) = 5.2989...
    closed = min(a / 2 + math.log(1e5) / (a - 1) for a in np.linspace(1.01, 60, 200_000))
    assert abs(classic_epsilon([1.0], 1e-5) - closed) < 5e-3
    eps = [PrivacyAccountant(1e-5) for _ in range(3)]
    for a, s in zip(eps, (0.8, 1.6, 3.2)): a.step(s)
    assert eps[0].epsilon() > eps[1].epsilon() > eps[2].epsilon()
    sub = PrivacyAccountant(1e-5); sub.step(1.6, 0.2)
    assert sub.epsilon() < eps[1].epsilon()
    part = PrivacyAccountant(); part.step(1.0, fraction=0.1)
    assert part.epsilon() == math.inf


def test_noise_for_epsilon_inverts_the_accountant():
    for target, releases in ((1.0, 1), (4.0, 20)):
        s = noise_for_epsilon(target, 1e-5, releases)
        a = PrivacyAccountant(1e-5)
        for _ in range(releases): a.step(s)
        assert a.epsilon() <= target + 1e-9 and a.epsilon() > 0.95 * target


def test_runs_report_epsilon(shared_root):
    from fglit.data import load_dataset
    cora = load_dataset("Cora", shared_root)
    for sec in (False, True):
        s = run("fedavg", cora, "louvain", 5, rounds=3, local_epochs=1, seeds=[0], progress=False,
                settings={"dp_noise": 1.0, "dp_clip": 0.5, "secure_aggregation": sec}).summary()
        acc = PrivacyAccountant(1e-5)              # local: noise sigma*C on an upload of sensitivity 2C (replace one client)
        for _ in range(3): acc.step(1.0 if sec else 0.5)   # distributed: the sum holds >= t clients' noise of std sigma*C/sqrt(t)
        assert s["privacy"]["epsilon"] == pytest.approx(acc.epsilon())
        assert s["privacy"]["dp_placement"] == ("distributed" if sec else "local")
        assert s["privacy"]["epsilon_rdp"] >= s["privacy"]["epsilon_pld"] == s["privacy"]["epsilon"]
        assert ("add or remove" if sec else "replace") in s["privacy"]["neighbouring"]
    s = run("fedproto", cora, "louvain", 5, rounds=2, local_epochs=1, seeds=[0], progress=False,
            settings={"dp_noise": 1.0, "dp_fraction": 0.2, "secure_aggregation": True}).summary()
    assert s["privacy"]["epsilon"] == math.inf
    with pytest.raises(ConfigError):
        run("fedavg", cora, "louvain", 5, rounds=1, seeds=[0], progress=False, settings={"dp_clip": 0.0})


def test_dp_update_is_clipped_around_the_broadcast_model(shared_root):
    from fglit.data import load_dataset
    cora = load_dataset("Cora", shared_root)
    seen = []
    def grab(rnd, server, clients): seen.append(server.params.clone())
    run("fedavg", cora, "louvain", 5, rounds=2, local_epochs=3, seeds=[0], progress=False,
        settings={"dp_noise": 1e-9, "dp_clip": 0.1, "secure_aggregation": True}, callback=grab)
    # with (almost) no noise the average of updates clipped to 0.1 moves the model by at most 0.1 per round
    assert float((seen[1] - seen[0]).norm()) <= 0.1 + 1e-5


def test_individual_message_algorithms_get_local_dp_only_when_declared(shared_root):
    from fglit.data import load_dataset
    cora = load_dataset("Cora", shared_root)
    with pytest.raises(ConfigError, match="sums=SumSpec"):          # GCFL: no SumSpec says what to clip
        run("gcfl", cora, "louvain", 3, rounds=1, seeds=[0], progress=False, settings={"dp_noise": 1.0})
    with pytest.raises(ConfigError, match="individual"):            # FedPG: local DP yes, secure aggregation no
        run("fedpg", cora, "metis", 3, rounds=1, seeds=[0], progress=False,
            settings={"dp_noise": 1.0, "secure_aggregation": True})
    s = run("fedpg", cora, "metis", 3, rounds=2, model="gcn", seeds=[0], progress=False,
            settings={"dp_noise": 1.0, "dp_clip": 10.0}).summary()["privacy"]
    acc = PrivacyAccountant(1e-5)
    for _ in range(2): acc.step(0.5)
    assert s["epsilon"] == pytest.approx(acc.epsilon()) and s["dp_placement"] == "local"
    assert s["dp_public_fields"] == ["counts"] and 0 <= s["dp_clipped_share"] <= 1


def test_fedpg_prototypes_are_clipped_and_noised_counts_released_as_they_are():
    from fglit.algorithms.fedpg import FedPGConfig
    from fglit.federation import get_algorithm
    from fglit.uplink import UplinkClient
    from fglit.fl.config import PrivacyConfig
    g = torch.Generator().manual_seed(1)
    reply = {"protos": 3 * torch.randn(7, 3, 64, generator=g), "counts": torch.randint(0, 40, (7, 3), generator=g)}
    up = UplinkClient(0, get_algorithm("fedpg"), FedPGConfig(privacy=PrivacyConfig(dp_noise=0.2, dp_clip=4.0)), seed=0)
    outs = [up.privatize(rnd, reply, {}, n=1) for rnd in range(1, 21)]
    assert all(torch.equal(o["counts"], reply["counts"]) for o in outs)
    mean = torch.stack([o["protos"].double() for o in outs]).mean(0)     # noise averages out to the clipped prototypes
    clipped = reply["protos"].double() * 4.0 / float(reply["protos"].norm())
    assert float((mean - clipped).std()) == pytest.approx(0.2 * 4.0 / math.sqrt(20), rel=0.1)
    assert up.clipped == up.uploads == 20


def test_sampling_the_server_sees_gets_no_amplification(shared_root):
    "Half the clients per round: the server picks them, so the accountant uses sampling rate 1 (no amplification)."
    s = run("fedavg", "cora", "louvain", 4, rounds=4, local_epochs=1, seeds=[0], progress=False, root=shared_root,
            settings={"dp_noise": 1.0, "dp_clip": 1.0, "client_fraction": 0.5}).summary()["privacy"]
    acc = PrivacyAccountant(1e-5)
    for _ in range(4): acc.step(0.5)
    assert s["sampling_rate"] == 1.0 and s["epsilon"] == pytest.approx(acc.epsilon())
    assert "no amplification" in s["observer"]


def test_accountants_agree_with_the_analytic_gaussian_mechanism():
    "One Gaussian release: PLD within its discretisation of the exact epsilon (Balle & Wang 2018), RDP above it."
    from fglit.privacy import analytic_gaussian_delta, analytic_gaussian_epsilon
    for sigma, delta in ((0.8, 1e-5), (1.0, 1e-5), (2.0, 1e-6), (5.0, 1e-5)):
        exact = analytic_gaussian_epsilon(sigma, delta)
        assert analytic_gaussian_delta(sigma, exact) == pytest.approx(delta, rel=1e-6)
        acc = PrivacyAccountant(delta); acc.step(sigma)
        eps = acc.epsilons()
        assert exact - 1e-9 <= eps["pld"] <= exact + 0.01 and eps["rdp"] >= exact


def _fedpg_uplink(seeded: bool):
    from fglit.algorithms.fedpg import FedPGConfig
    from fglit.federation import get_algorithm
    from fglit.uplink import UplinkClient
    cfg = make_config(FedPGConfig, {"dp_noise": 0.5, "dp_clip": 100.0, "dp_seeded_noise": seeded})
    return UplinkClient(3, get_algorithm("fedpg"), cfg, seed=0)


def test_dp_noise_cannot_be_regenerated_from_what_a_result_prints():
    """The attack: a result prints its seed, and the old noise was a function of (seed, round, client). Regenerate it
    and subtract: with `dp_seeded_noise` (the research option) that recovers the upload; by default it must not."""
    import numpy as np
    g = torch.Generator().manual_seed(5)
    reply = {"protos": torch.randn(7, 3, 16, generator=g), "counts": torch.randint(1, 9, (7, 3), generator=g)}
    recovered = {}
    for seeded in (True, False):
        out = _fedpg_uplink(seeded).privatize(2, reply, {}, n=1)
        gen = torch.Generator().manual_seed(int(np.random.SeedSequence([0, 2, 3, 0xD9]).generate_state(1)[0]))
        noise = torch.randn(reply["protos"].shape, generator=gen, dtype=torch.float64) * 0.5 * 100.0
        recovered[seeded] = torch.allclose(out["protos"].double() - noise, reply["protos"].double(), atol=1e-3)
        assert float((out["protos"].double() - reply["protos"].double()).std()) == pytest.approx(50.0, rel=0.2)
    assert recovered == {True: True, False: False}


def test_private_noise_differs_between_identical_runs_and_the_result_says_which(shared_root):
    kw = dict(rounds=1, local_epochs=1, seeds=[0], progress=False, root=shared_root)
    dp = {"dp_noise": 1.0, "dp_clip": 1.0}
    a, b = (run("fedavg", "cora", "louvain", 3, settings=dp, **kw) for _ in range(2))
    assert not a.runs[0].history.accuracy.equals(b.runs[0].history.accuracy)      # fresh noise each run
    pa = a.summary()["privacy"]
    assert pa["dp_private"] is True and "entropy" in pa["dp_noise_source"]
    c, d = (run("fedavg", "cora", "louvain", 3, settings={**dp, "dp_seeded_noise": True}, **kw) for _ in range(2))
    assert c.runs[0].history.accuracy.equals(d.runs[0].history.accuracy)
    pc = c.summary()["privacy"]
    assert pc["dp_private"] is False and "NOT PRIVATE" in pc["dp_noise_source"]


@pytest.mark.parametrize("settings_, why", [
    ({"dp_clip": 2.0}, "dp_clip does nothing without dp_noise"),
    ({"dp_fraction": 0.1, "dp_delta": 1e-6}, "dp_delta, dp_fraction do nothing without dp_noise"),
    ({"dp_seeded_noise": True}, "dp_seeded_noise does nothing without dp_noise"),
    ({"secagg_threshold": 0.8}, "secagg_threshold does nothing without secure_aggregation=True"),
])
def test_privacy_settings_that_do_nothing_alone_are_refused(settings_, why):
    from fglit.algorithms.fedavg import FedAvgConfig
    with pytest.raises(ConfigError, match=why):
        make_config(FedAvgConfig, settings_)

"""Differential privacy: clipping, the Gaussian mechanism, the accountant against the RDP formulas, and runs reporting epsilon."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from fglit.federation import ConfigError, run
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
        acc = PrivacyAccountant(1e-5)
        for _ in range(3): acc.step(1.0)
        assert s["privacy"]["epsilon"] == pytest.approx(acc.epsilon())
        assert s["privacy"]["dp_placement"] == ("distributed" if sec else "local")
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
    for _ in range(2): acc.step(1.0)
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
    outs = [up.privatize(rnd, reply, {}, n=5) for rnd in range(1, 21)]
    assert all(torch.equal(o["counts"], reply["counts"]) for o in outs)
    mean = torch.stack([o["protos"].double() for o in outs]).mean(0)     # noise averages out to the clipped prototypes
    clipped = reply["protos"].double() * 4.0 / float(reply["protos"].norm())
    assert float((mean - clipped).std()) == pytest.approx(0.2 * 4.0 / math.sqrt(20), rel=0.1)
    assert up.clipped == up.uploads == 20

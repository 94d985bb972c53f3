"""Tests for FedSpray (`fglit.algorithms.fedspray`, from nbs/11j_fedspray.ipynb)."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from _device import same_tensor

from fglit.algorithms.fedspray import (FedSprayClient, FedSprayConfig, FedSprayServer, FeatureStructureEncoder,
                                       aggregate_proxies, node_proxies, soft_targets)
from fglit.federation import ClientInfo, ConfigError, ModelSpec, flat_state, get_algorithm, make_config, run

pytestmark = pytest.mark.usefixtures("module_cache")
SHORT = {"local_epochs": 30, "lr": 0.01, "hidden": 16}


def test_registered_with_the_authors_defaults():
    algo = get_algorithm("fedspray")
    assert (algo.client, algo.server, algo.config) == (FedSprayClient, FedSprayServer, FedSprayConfig)
    assert "KDD 2024" in algo.paper and algo.takes_sums()
    c = make_config(FedSprayConfig)
    assert (c.rounds, c.local_epochs, c.lr, c.weight_decay, c.kd_weight, c.proxy_lr, c.confidence) == (500, 5, 3e-3, 0.0, 1.0, 0.02, 0.7)
    assert c.evaluation == "global" and FedSprayConfig.node_task_only and not FedSprayConfig.one_model_only
    for bad in ({"confidence": 1.1}, {"kd_weight": -1.0}, {"proxy_weighting": "plain"}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            make_config(FedSprayConfig, bad)
    with pytest.raises(ConfigError, match="node"):
        FedSprayServer(c, [ClientInfo(0, 5, 5)], ModelSpec("gin", 6, 3, "graph", 8, 2, 0.0))


rows = st.lists(st.floats(-5, 5, allow_nan=False, width=32), min_size=6, max_size=6)


@settings(max_examples=40, deadline=None)
@given(rows, rows, st.lists(st.sampled_from([0.0, 0.5, 2.0]), min_size=6, max_size=6))
def test_property_proxies_are_the_class_weighted_mean_or_kept(a, b, w):
    # two clients, 3 classes, 2-d proxies: s_c = (w_A s_A + w_B s_B) / (w_A + w_B), the previous s_c where both weigh 0
    sa, sb, wa, wb = torch.tensor(a).view(3, 2), torch.tensor(b).view(3, 2), torch.tensor(w[:3]), torch.tensor(w[3:])
    prev = torch.full((3, 2), 7.0)
    got = aggregate_proxies(wa[:, None] * sa + wb[:, None] * sb, wa + wb, prev)
    for c in range(3):
        if wa[c] + wb[c] == 0: assert torch.equal(got[c], prev[c])
        else: assert torch.allclose(got[c], (wa[c] * sa[c] + wb[c] * sb[c]) / (wa[c] + wb[c]), atol=1e-5)


def test_soft_targets_use_the_class_proxy_on_labelled_nodes_only():
    torch.manual_seed(0)
    enc = FeatureStructureEncoder(5, 4, 3)
    x, y, proxies = torch.randn(6, 5), torch.tensor([0, 1, 2, 0, 1, 2]), torch.randn(3, 4)
    labelled = torch.tensor([True, True, False, False, False, False])
    q, reliable = soft_targets(enc, x, proxies, y, labelled, 0.0)
    assert reliable.all() and torch.allclose(q.exp().sum(1), torch.ones(6))
    h = enc.embed(x)
    assert torch.allclose(q[1], torch.log_softmax(enc.proxy_head(h[1] + proxies[1]), -1), atol=1e-6)
    # changing an unlabelled node's true label changes nothing: its proxy comes from the pseudo-label mix
    y2 = y.clone(); y2[4] = 0
    assert torch.equal(soft_targets(enc, x, proxies, y2, labelled, 0.0)[0], q)
    assert torch.allclose(node_proxies(proxies, y, labelled, torch.eye(3)[[0, 0, 1, 1, 2, 2]])[2:], proxies[[1, 1, 2, 2]])


def _gnn_states(store):
    return lambda rnd, server, clients: store.append([flat_state(c.model).clone() for c in clients])


def test_one_round_learns_and_scoring_a_download_never_changes_the_run(cora_parts):
    ds, part = cora_parts
    states, scores = {}, {}
    for mode in ("global", "local"):
        states[mode] = []
        r = run("fedspray", ds, part, rounds=1, seeds=[0], progress=False, settings={**SHORT, "evaluation": mode},
                callback=_gnn_states(states[mode]))
        scores[mode] = r.summary()["accuracy_mean"]
    assert all(same_tensor(a, b) for a, b in zip(states["global"][0], states["local"][0]))   # the same training
    assert min(scores.values()) > 0.5 and scores["global"] != scores["local"]                # 7 classes: chance ~0.3


def test_heterogeneous_gnns_share_one_encoder(cora_parts):
    ds, part = cora_parts
    seen = []
    r = run("fedspray", ds, part, rounds=1, seeds=[0], progress=False,
            settings={**SHORT, "local_epochs": 15, "heterogeneous_models": True},
            callback=lambda rnd, server, clients: seen.append(([type(c.model).__name__ for c in clients], server.version,
                                                             server.params.numel())))
    names, version, size = seen[-1]
    assert len(set(names)) == 3 and version == 1 and r.summary()["accuracy_mean"] > 0.4
    assert size == flat_state(FeatureStructureEncoder(ds.num_features, 64, ds.num_classes)).numel()


def test_secure_aggregation_gives_the_plain_aggregate(cora_parts):
    ds, part = cora_parts
    seen = {}
    for secure in (False, True):
        seen[secure] = []
        run("fedspray", ds, part, rounds=1, seeds=[0], progress=False,
            settings={**SHORT, "local_epochs": 5, "secure_aggregation": secure},
            callback=lambda rnd, server, clients: seen[secure].append((server.params.clone(), server.proxies.clone())))
    (p0, s0), (p1, s1) = seen[False][0], seen[True][0]
    assert torch.allclose(p0, p1, atol=1e-5) and torch.allclose(s0, s1, atol=1e-5) and not torch.equal(s0[1], s0[2])

"""Tests of fglit.algorithms.fedselect: GradSelect's growing masks, the per-entry average, LocalAlt's frozen entries, and end-to-end runs on both tasks."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from _device import DEV, same_run
from _node_pfl import make_clients as pfl_clients

from fglit.algorithms.fedselect import (FedSelectClient, FedSelectConfig, FedSelectServer, grow_personal, masked_average,
                                        selection_groups)
from fglit.algorithms.personalisation import parameter_views
from fglit.federation import ModelSpec, flat_state, get_algorithm, make_config, run

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True)
QUICK = dict(local_epochs=1, seeds=[0], progress=False)


@SETTINGS
@given(st.lists(st.integers(1, 30), min_size=1, max_size=4), st.floats(0.01, 1.0), st.floats(0.0, 1.0),
       st.integers(1, 8), st.integers(0, 2**31 - 1))
def test_personal_mask_grows_by_the_rate_up_to_the_limit_and_never_shrinks(sizes, rate, limit, rounds, seed):
    g = torch.Generator().manual_seed(seed)
    offsets = [0] + list(torch.tensor(sizes).cumsum(0).tolist())
    groups = [torch.arange(a, b) for a, b in zip(offsets, offsets[1:])]
    personal = torch.zeros(offsets[-1], dtype=torch.bool)
    for _ in range(rounds):
        change = torch.randn(offsets[-1], generator=g)              # a new change every round, as local training gives
        grown = grow_personal(change, personal, groups, rate, limit)
        assert torch.equal(grown | personal, grown)                  # monotone
        for idx in groups:
            n, have = idx.numel(), int(personal[idx].sum())
            cap = math.floor(limit * n + 1e-9)
            expected = have + max(0, min(int(rate * (n - have) + 0.5), cap - have))
            assert int(grown[idx].sum()) == expected <= max(cap, have)
            new = grown[idx] & ~personal[idx]
            if new.any() and (~grown[idx]).any():                    # the new entries changed at least as much as any left shared
                assert change[idx][new].abs().min() >= change[idx][~grown[idx]].abs().max()
        personal = grown


@SETTINGS
@given(st.integers(1, 5), st.integers(1, 20), st.integers(0, 2**31 - 1), st.booleans())
def test_masked_average_is_the_mean_over_the_clients_sharing_each_entry(K, P, seed, weighted):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(K, P, generator=g, dtype=torch.float64)
    shared = torch.rand(K, P, generator=g) < 0.5
    weights = torch.rand(K, generator=g, dtype=torch.float64) + 0.1 if weighted else torch.ones(K, dtype=torch.float64)
    previous = torch.randn(P, generator=g, dtype=torch.float64)
    out = masked_average(values, shared, weights, previous)
    for j in range(P):
        rows = shared[:, j]
        expected = (values[rows, j] * weights[rows]).sum() / weights[rows].sum() if rows.any() else previous[j]
        assert torch.isclose(out[j], expected)


def test_selection_groups_cover_the_weights_not_the_buffers():
    gin = ModelSpec("gin", 7, 2, "graph", 8, 2, 0.0).build()
    groups = selection_groups(gin)
    assert [g.numel() for g in groups] == [p.numel() for p in gin.parameters()]
    assert torch.equal(selection_groups(gin, "model")[0], torch.cat(groups))
    assert torch.cat(groups).numel() < flat_state(gin).numel()              # batch-norm statistics are never selected
    with pytest.raises(ValueError, match="scope"):
        selection_groups(gin, "layer")


# -- the client and server -----------------------------------------------------------------------------------------

def make_clients(cora_parts, **settings):
    torch.manual_seed(0)
    _, _, server, clients = pfl_clients(FedSelectConfig, FedSelectServer, FedSelectClient, *cora_parts, **settings)
    return clients, server


def test_a_pass_moves_only_the_entries_it_trains(cora_parts):
    (client, *_), _ = make_clients(cora_parts)
    g = torch.Generator().manual_seed(1)
    client.personal = client.trainable & (torch.rand(client.trainable.numel(), generator=g) < 0.5).to(DEV)
    for masks, moving in ((parameter_views(client.model, client.personal), client.personal), (None, client.trainable)):
        before = flat_state(client.model)
        client.train_pass(masks)
        after = flat_state(client.model)
        assert torch.equal(after[~moving], before[~moving]) and not torch.equal(after[moving], before[moving])


def test_rounds_keep_personal_entries_and_average_the_shared(cora_parts):
    clients, server = make_clients(cora_parts, select_every=2, size_weighted=True)
    sizes = torch.tensor([float(c.data.num_train) for c in clients], device=DEV)
    for rnd in (1, 2, 3):
        down = server.broadcast(rnd, [0, 1, 2])
        kept = [flat_state(c.model)[~c.shared()] for c in clients]
        replies = {}
        for i, c in enumerate(clients):
            c.receive(down[i])
            assert torch.equal(flat_state(c.model)[~c.shared()], kept[i])          # a download leaves personal entries alone
            replies[i] = c.local_step({}, rnd)
        assert all(("personal" in r) == (rnd == 2) for r in replies.values())     # the mask travels when it changed
        server.aggregate(rnd, replies)
        share = [c.personal[c.trainable].float().mean().item() for c in clients]
        assert all(abs(s - (0.25 if rnd >= 2 else 0.0)) < 0.01 for s in share)
        states, sharing = torch.stack([flat_state(c.model) for c in clients]), torch.stack([c.shared() for c in clients])
        w = sharing * sizes.unsqueeze(1)
        some = sharing.any(0)
        assert torch.allclose(server.params[some], ((states * w).sum(0) / w.sum(0).clamp_min(1))[some], atol=1e-5)


# -- end to end ----------------------------------------------------------------------------------------------------

def test_registered_with_the_official_defaults():
    algo = get_algorithm("fedselect")
    assert algo.sums_only is False and algo.config is FedSelectConfig and "Tamirisa" in algo.paper
    c = make_config(FedSelectConfig)
    assert (c.personal_rate, c.personal_limit, c.select_every, c.selection_scope, c.local_alt, c.size_weighted, c.evaluation) == \
        (0.25, 0.8, 1, "tensor", True, False, "local")


def test_mutag_graph_task_repeats_and_uploads_only_shared_entries(shared_root):
    kw = dict(rounds=3, root=shared_root, settings={"alpha": 1.0, "min_size": 5, "hidden": 16}, **QUICK)
    shares = []
    a = run("fedselect", "MUTAG", "dirichlet", 3, callback=lambda rnd, server, cs: shares.append(
        [(c.personal[c.trainable].float().mean().item(), int(c.shared().sum())) for c in cs]), **kw)
    b = run("fedselect", "MUTAG", "dirichlet", 3, **kw)
    assert same_run(a.runs[0].history, b.runs[0].history) and 0 < a.summary()["accuracy_mean"] <= 1
    up = a.communication().query("direction == 'up'").sort_values(["round", "client"])
    for rnd, per_client in enumerate(shares, 1):
        for cid, (share, n_shared) in enumerate(per_client):
            assert abs(share - (1 - 0.75 ** rnd)) < 0.03
            assert int(up.query("round == @rnd and client == @cid").floats.iloc[0]) == n_shared


def test_cora_node_task_learns(shared_root):
    r = run("fedselect", "Cora", "louvain", 3, rounds=3, root=shared_root, **{**QUICK, "local_epochs": 3})
    assert r.summary()["accuracy_mean"] > 0.6                                     # chance is 1/7

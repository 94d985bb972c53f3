"""Clients' data moved to the device together (`clients_data`, `_move_together`) equals the clients built one by one."""
import torch
from hypothesis import given, settings, strategies as st

from fglit.fl.local_data import SPLITS, LocalData, _move_together, clients_data
from fglit.partition import community_graph, partition

from _device import DEV


def _same(a: LocalData, b: LocalData) -> bool:
    fields = all(torch.equal(getattr(a.graph, f).cpu(), getattr(b.graph, f).cpu()) for f in ("x", "edge_index", "y"))
    masks = all(torch.equal(a.masks[s].cpu(), b.masks[s].cpu()) for s in SPLITS)
    train = torch.equal(a._train.y.cpu(), b._train.y.cpu()) and torch.equal(a._train.select.cpu(), b._train.select.cpu())
    return fields and masks and train and a.counts == b.counts and a.graph.x.device == b.graph.x.device


@settings(max_examples=15, deadline=None)
@given(clients=st.integers(1, 6), method=st.sampled_from(["metis", "louvain"]), seed=st.integers(0, 50))
def test_moving_together_equals_one_by_one(clients, method, seed):
    p = partition(community_graph(120, 600, 4, seed=seed), method, clients, seed=seed, cache=False)
    one_by_one = [LocalData(c, "node", device=torch.device("cpu")) for c in p.clients]
    together = [LocalData(c, "node", device=torch.device("cpu")) for c in p.clients]
    _move_together(together, torch.device("cpu"))
    assert all(_same(a, b) for a, b in zip(one_by_one, together))
    assert len({d.graph.x.untyped_storage().data_ptr() for d in together}) == 1      # one copy for every client


def test_clients_data_on_the_run_device():
    "On fglit's device (CUDA under make test-gpu: the moved-together path) the clients equal those built one by one."
    p = partition(community_graph(200, 1000, 5, seed=1), "metis", 4, seed=1, cache=False)
    got = clients_data(p.clients, "node", device=DEV)
    ref = [LocalData(c, "node", device=DEV) for c in p.clients]
    assert all(_same(a, b) for a, b in zip(got, ref)) and got[0].graph.x.device.type == DEV.type

"""Shared by the tests of the personalised node-level baselines (Fed-PUB, FedGTA): clients built directly on a partition,
and the partial-participation check every server that keeps one model per client must pass; `fglit run ... --json` in a
subprocess."""
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from fglit.federation import ALGORITHM_MODULES, ClientInfo, LocalData, ModelSpec, make_config

SCRIPT = Path(sys.executable).parent / "fglit"


def cli_run_json(shared_root, algorithm: str, *args: str) -> dict:
    "The summary printed by `fglit run ALGORITHM ARGS --json` (the algorithm's module is found in the fglit.algorithms package)."
    module = f"fglit.algorithms.{algorithm}"
    assert module in ALGORITHM_MODULES, f"{module} is not a module of fglit.algorithms (the CLI cannot find it)"
    assert SCRIPT.is_file(), f"the fglit console script is not installed at {SCRIPT}"
    out = subprocess.run([str(SCRIPT), "run", algorithm, *args, "--json"], capture_output=True, text=True,
                         env={**os.environ, "FGLIT_DATA": str(shared_root)}, timeout=600)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def make_clients(config_cls, server_cls, client_cls, ds, part, datas=None, **settings):
    "`(config, spec, server, clients)` of a GCN run on `part` (clients' data from `datas` if given), 1 local epoch, 16 hidden."
    cfg = make_config(config_cls, {"local_epochs": 1, "hidden": 16, **settings})
    spec = ModelSpec("gcn", ds.num_features, ds.num_classes, "node", cfg.hidden, cfg.layers, cfg.dropout)
    info = [ClientInfo(i, int(c.train_mask.sum()), c.num_nodes) for i, c in enumerate(part.clients)]
    datas = datas or part.clients
    return cfg, spec, server_cls(cfg, info, spec), [client_cls(i, LocalData(c, "node"), cfg, spec) for i, c in enumerate(datas)]


def check_unselected_clients_keep_their_model(server, clients):
    "Clients 0 and 2 take part in a round, client 1 does not: its personalised model stays, the others' change."
    before = server.params.clone()
    server.aggregate(1, {i: clients[i].local_step(server.broadcast(1, [i])[i], 1) for i in (0, 2)})
    assert torch.equal(server.params[1], before[1]) and not torch.equal(server.params[0], before[0])
    assert server.weights.shape == (2, 2)

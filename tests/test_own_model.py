"""Bring your own model (issue 27): a plain PyG module registered by name runs under fglit's algorithms, and installed packages add models and algorithms through entry points."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch_geometric.nn import GCNConv

from fglit.federation import ConfigError, run
from fglit.models import MODEL_NAMES, MODELS
from fglit.own_model import ModuleAdapter, register_model

REPO = Path(__file__).resolve().parents[1]


class TwoGCN(torch.nn.Module):
    "A plain PyG model: two GCNConv layers and a linear classifier, no fglit base class."
    def __init__(self, in_dim, num_classes, hidden=16):
        super().__init__()
        self.conv1, self.conv2 = GCNConv(in_dim, hidden), GCNConv(hidden, hidden)
        self.classifier = torch.nn.Linear(hidden, num_classes)

    def forward(self, x, edge_index):
        h = F.dropout(F.relu(self.conv1(x, edge_index)), 0.5, self.training)
        return self.classifier(F.relu(self.conv2(h, edge_index)))


class GCNMLP(torch.nn.Module):
    "A GCN layer and a two-layer MLP head: the last Linear's input is 32 wide, the MLP's input `hidden`."
    def __init__(self, in_dim, num_classes, hidden=16):
        super().__init__()
        self.conv = GCNConv(in_dim, hidden)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(hidden, 32), torch.nn.ReLU(), torch.nn.Linear(32, num_classes))

    def forward(self, x, edge_index):
        return self.mlp(F.relu(self.conv(x, edge_index)))


class Convs(torch.nn.Module):
    "No torch.nn.Linear anywhere: logits come straight out of a GCNConv."
    def __init__(self, in_dim, num_classes):
        super().__init__()
        self.conv1, self.conv2 = GCNConv(in_dim, 16), GCNConv(16, num_classes)

    def forward(self, x, edge_index):
        return self.conv2(F.relu(self.conv1(x, edge_index)), edge_index)


@pytest.fixture(autouse=True)
def _restore_models(tmp_path, monkeypatch):
    "Each test registers into a registry restored afterwards, with a private cache."
    monkeypatch.setenv("FGLIT_CACHE", str(tmp_path / "cache"))
    models, names = dict(MODELS), list(MODEL_NAMES)
    yield
    MODELS.clear(); MODELS.update(models); MODEL_NAMES[:] = names


def quick(algorithm, model, root, **kw):
    "Cora, 3 Louvain clients, 2 rounds; returns the result and the clients seen by the callback after the last round."
    seen = {}
    result = run(algorithm, "Cora", "louvain", 3, rounds=2, model=model, root=root, progress=False,
                 callback=lambda rnd, server, clients: seen.update(clients=clients), **kw)
    return result, seen["clients"]


def embeddings(client):
    g = client.data.graph
    client.model.eval()
    with torch.no_grad():
        return client.model.encode(g.x, g.edge_index)


def test_plain_module_runs_fedavg(shared_root):
    register_model("mine", TwoGCN)
    result, clients = quick("fedavg", "mine", shared_root)
    assert all(isinstance(c.model, ModuleAdapter) and isinstance(c.model.module, TwoGCN) for c in clients)
    assert clients[0].model.module.conv1.out_channels == 64          # hidden comes from the run's config (default 64)
    s = result.summary()
    assert s["model"] == "mine" and 0.3 < s["accuracy_mean"] <= 1.0 and s["bytes_up"] > 0


def test_plain_module_runs_fedproto_on_embeddings(shared_root):
    register_model("mine", TwoGCN)
    result, clients = quick("fedproto", "mine", shared_root)
    for c in clients:
        emb = embeddings(c)
        assert c.model.head_name == "classifier" and c.model.embedding_dim == 64
        assert emb.shape == (c.data.graph.num_nodes, c.model.module.classifier.in_features)
        assert torch.allclose(c.model.head(emb), c.model(c.data.graph.x, c.data.graph.edge_index), atol=1e-5)
    assert result.summary()["accuracy_mean"] > 0.3


def test_named_head(shared_root):
    register_model("gcnmlp", GCNMLP)
    _, clients = quick("fedproto", "gcnmlp", shared_root, local_epochs=1)
    assert clients[0].model.head_name == "mlp.2" and embeddings(clients[0]).shape[1] == 32   # default: the last Linear
    register_model("gcnmlp", GCNMLP, head="mlp")
    _, clients = quick("fedproto", "gcnmlp", shared_root, local_epochs=1)
    assert clients[0].model.head_name == "mlp" and embeddings(clients[0]).shape[1] == 64    # the whole MLP is the head
    register_model("gcnmlp", GCNMLP, head="readout")
    with pytest.raises(ConfigError, match="no submodule 'readout'"):
        quick("fedavg", "gcnmlp", shared_root)


def test_module_without_linear(shared_root):
    register_model("convs", Convs)
    result, clients = quick("fedavg", "convs", shared_root)
    assert not clients[0].model.has_head and result.summary()["accuracy_mean"] > 0.2
    with pytest.raises(ConfigError) as err:
        quick("fedproto", "convs", shared_root)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("fedproto needs the model's embeddings") and "'convs'" in msg and "fedavg" in msg
    with pytest.raises(ConfigError, match="^moon needs the model's embeddings"):
        quick("moon", "convs", shared_root)


def test_unknown_model_lists_choices(shared_root):
    register_model("mine", TwoGCN)
    with pytest.raises(ConfigError) as err:
        quick("fedavg", "nosuch", shared_root)
    assert "unknown model 'nosuch'" in str(err.value) and "GCN" in str(err.value) and "mine" in str(err.value)


def test_register_refuses_builtin_names():
    for name in ("gcn", "GraphSAGE", "sage"):
        with pytest.raises(ConfigError, match="one of fglit's models"):
            register_model(name, TwoGCN)
    assert MODELS["gcn"].__name__ == "GCN"


PLUGIN = '''
import torch
from fglit.algorithms.fedavg import FedAvgClient, FedAvgConfig, FedAvgServer
from fglit.federation import register_algorithm
from fglit.own_model import register_model

class Tiny(torch.nn.Module):
    def __init__(self, in_dim, num_classes):
        super().__init__(); self.lin = torch.nn.Linear(in_dim, num_classes)
    def forward(self, x, edge_index): return self.lin(x)

register_model("plugmodel", Tiny)

def register():
    register_algorithm("plugavg", FedAvgClient, FedAvgServer, FedAvgConfig, paper="a plugin's algorithm")
'''

CHECK = '''
import contextlib, io
from fglit.cli import main
from fglit.federation import run
from fglit.models import build_model
out = io.StringIO()
with contextlib.redirect_stdout(out):
    main(["algorithms"])
    try: main(["run", "--help"])
    except SystemExit: pass
text = out.getvalue()
print("ALGORITHMS_LISTED", "plugavg" in text and "a plugin's algorithm" in text)
print("MODEL_IN_HELP", "plugmodel" in " ".join(text.split()))
print("BUILT", type(build_model("plugmodel", 5, 3)).__name__)
r = run("plugavg", "Cora", "louvain", 3, rounds=1, local_epochs=1, model="plugmodel", progress=False)
print("RAN", r.algorithm, r.summary()["model"])
'''


def test_entry_points_register_models_and_algorithms(tmp_path, shared_root):
    "A package's entry points (a dist-info on sys.path, as pip leaves it) add a model and an algorithm the CLI lists."
    site = tmp_path / "site"
    (site / "fglit_plugin-0.1.dist-info").mkdir(parents=True)
    (site / "fglit_plugin-0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: fglit-plugin\nVersion: 0.1\n")
    (site / "fglit_plugin-0.1.dist-info" / "entry_points.txt").write_text(
        "[fglit.models]\nplug = fglit_plugin_mod\n\n[fglit.algorithms]\nplugavg = fglit_plugin_mod:register\n")
    (site / "fglit_plugin_mod.py").write_text(textwrap.dedent(PLUGIN))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(REPO)]), FGLIT_DATA=str(shared_root),
               FGLIT_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)
    assert lines.get("ALGORITHMS_LISTED") == "True" and lines.get("MODEL_IN_HELP") == "True", proc.stdout[-2000:]
    assert lines.get("BUILT") == "ModuleAdapter" and lines.get("RAN") == "plugavg plugmodel", proc.stdout[-2000:]


def test_broken_entry_point_warns(tmp_path, shared_root):
    site = tmp_path / "site"
    (site / "broken-0.1.dist-info").mkdir(parents=True)
    (site / "broken-0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: broken\nVersion: 0.1\n")
    (site / "broken-0.1.dist-info" / "entry_points.txt").write_text("[fglit.models]\nbad = no_such_module_here\n")
    code = "import warnings\nfrom fglit.models import model_names\nwith warnings.catch_warnings(record=True) as w:\n" \
           "    warnings.simplefilter('always'); names = model_names()\nprint('GCN' in names, [str(x.message) for x in w])"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(REPO)]), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("True") and "'bad'" in proc.stdout and "no_such_module_here" in proc.stdout


def test_algorithm_reading_fglit_encoders_refuses_own_module(shared_root):
    "FedPG reads the layers of fglit's encoders (its depth): a module of your own stops it with a ConfigError, not an AttributeError."
    register_model("mine", TwoGCN)
    with pytest.raises(ConfigError, match="no separate encoder module"):
        quick("fedpg", "mine", shared_root, local_epochs=1)

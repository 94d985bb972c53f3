#!/usr/bin/env bash
# The package as a user gets it: build the sdist and the wheel (the wheel from the sdist), install the wheel into a
# fresh venv with nothing else of this checkout, and run fglit from outside the repository.
#   bash .ci/wheel_check.sh        (PYTHON=... picks the interpreter; FGLIT_DATA must point at the datasets)
set -euo pipefail
PY=${PYTHON:-python3}
repo=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
"$PY" -m venv "$tmp/tools" && "$tmp/tools/bin/python" -m pip install --quiet build
"$tmp/tools/bin/python" -m build --outdir "$tmp/dist" "$repo" > "$tmp/build.log" 2>&1 || { tail -20 "$tmp/build.log"; exit 1; }
ls "$tmp/dist"
"$PY" -m venv "$tmp/user"
"$tmp/user/bin/python" -m pip install --quiet torch==2.13.0          # the CPU build (a local wheel here)
"$tmp/user/bin/python" -m pip install --quiet "$tmp"/dist/fglit-*.whl
cd "$tmp"
"$tmp/user/bin/fglit" --version
"$tmp/user/bin/python" -c "import fglit, pathlib; assert '$repo' not in fglit.__file__, fglit.__file__; print('imported from', pathlib.Path(fglit.__file__).parent)"
OMP_NUM_THREADS=1 "$tmp/user/bin/fglit" run fedavg --dataset Cora --clients 3 --rounds 2 --quiet --out "$tmp/record"
OMP_NUM_THREADS=1 "$tmp/user/bin/fglit" run fedavg --config "$tmp/record/config.json" --quiet --json > "$tmp/again.json"
# the rest of the issue-27 bullets from the installed wheel: your own PyG Data, your own torch module, the record read back
OMP_NUM_THREADS=1 "$tmp/user/bin/python" - "$tmp" <<'PY'
import json, sys
import torch
from torch_geometric.data import Data
from torch_geometric.nn import GCNConv
from torch_geometric.utils import stochastic_blockmodel_graph
from fglit.federation import run
from fglit.own_model import register_model

tmp = sys.argv[1]
first, again = json.load(open(f"{tmp}/record/summary.json")), json.load(open(f"{tmp}/again.json"))
assert first["accuracy_mean"] == again["accuracy_mean"], (first["accuracy_mean"], again["accuracy_mean"])
torch.manual_seed(0)
y = torch.arange(3).repeat_interleave(40)
g = Data(x=torch.randn(120, 8) + y[:, None], edge_index=stochastic_blockmodel_graph([40] * 3, [[0.2, 0.01, 0.01], [0.01, 0.2, 0.01], [0.01, 0.01, 0.2]]), y=y)
print("own Data:", run("fedavg", g, "louvain", 3, rounds=2, progress=False))

class TwoGCN(torch.nn.Module):
    def __init__(self, in_dim, num_classes, hidden=32):
        super().__init__()
        self.conv1, self.conv2, self.out = GCNConv(in_dim, hidden), GCNConv(hidden, hidden), torch.nn.Linear(hidden, num_classes)
    def forward(self, x, edge_index):
        return self.out(self.conv2(self.conv1(x, edge_index).relu(), edge_index).relu())

register_model("twogcn", TwoGCN)
print("own model:", run("fedproto", g, "louvain", 3, rounds=2, model="twogcn", progress=False))
PY
out=$("$tmp/user/bin/fglit" flower local fedavg --dataset Cora --clients 3 --rounds 1 2>&1 || true)
grep -q "pip install 'fglit\[flower\]'" <<< "$out" || { echo "wheel-check: fglit flower without the extra said: $out"; exit 1; }
echo "wheel-check: without the flower extra, fglit flower names the extra to install"
echo "wheel-check: the wheel installs into a fresh venv and runs"

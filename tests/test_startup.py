"""Start-up of the `fglit` command (issue 28): the parser, `--help` and `--version` import no torch, and the light
catalogue they read (`fglit.catalogue.CATALOGUE`) holds what the real registries hold."""
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(sys.executable).parent / "fglit"      # the console script pip installed beside this python
HEAVY = ("torch", "torch_geometric", "pandas")


def env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def test_parser_help_and_version_import_no_torch():
    "Build the parser, print `--help`, `run --help`, `flower local --help` and `--version`: none of HEAVY is imported."
    code = ("import contextlib, io, json, sys\n"
            "from fglit.cli import build_parser, main\n"
            "build_parser()\n"
            "out = {}\n"
            "for argv in (['--help'], ['run', '--help'], ['flower', 'local', '--help'], ['--version']):\n"
            "    text = io.StringIO()\n"
            "    with contextlib.redirect_stdout(text):\n"
            "        try: main(argv)\n"
            "        except SystemExit as stop: assert stop.code == 0, (argv, stop.code)\n"
            "    out[' '.join(argv)] = text.getvalue()\n"
            f"print(json.dumps(dict(out=out, heavy=[m for m in {HEAVY!r} if m in sys.modules])))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env(), cwd=REPO, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["heavy"] == [], f"building the parser imported {result['heavy']}"
    run_help = " ".join(result["out"]["run --help"].split())
    for name in ("fedavg", "gcfl+", "opfgl", "GCN", "GINGPFL", "soft_dirichlet", "dirichlet-soft = soft_dirichlet", "centralised"):
        assert name in run_help, name
    assert result["out"]["--version"].startswith("fglit ")


def test_console_script_help_imports_no_torch():
    "The installed `fglit` script itself, as users run it: `python -X importtime` shows no torch or torch_geometric import."
    assert SCRIPT.is_file(), f"the fglit console script is not installed at {SCRIPT} (pip install -e .)"
    for argv in (["--help"], ["--version"]):
        done = subprocess.run([sys.executable, "-X", "importtime", str(SCRIPT), *argv], capture_output=True, text=True, env=env(),
                              cwd=REPO, timeout=60)
        assert done.returncode == 0, done.stderr[-2000:]
        imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
        assert "fglit.cli" in imported, "the script did not import fglit.cli"
        assert not imported & set(HEAVY), f"fglit {' '.join(argv)} imported {sorted(imported & set(HEAVY))}"


def test_catalogue_equals_the_registries():
    "In a fresh process (no plugins, nothing registered by hand), `CATALOGUE` equals what fglit's registries hold."
    code = ("import json\n"
            "from fglit.catalogue import CATALOGUE, registry_catalogue\n"
            "print(json.dumps([CATALOGUE, registry_catalogue()]))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env(), cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    stored, real = json.loads(done.stdout.strip().splitlines()[-1])
    assert stored == real, ("fglit.catalogue.CATALOGUE differs from the registries: run `python .ci/catalogue.py`, then nbdev_export; "
                            f"differences (stored, real): { {k: (stored.get(k), real.get(k)) for k in real if stored.get(k) != real.get(k)} }")


def test_catalogue_lists_names_registered_in_the_process(monkeypatch):
    "An algorithm or model registered before the parser is built (a notebook, a plugin loaded earlier) is listed too."
    import types
    from fglit import catalogue
    monkeypatch.setattr(catalogue, "_plugin_groups", lambda: frozenset())      # no plugins: the branch that imports nothing
    monkeypatch.setitem(sys.modules, "fglit.fl.registry", types.SimpleNamespace(ALGORITHMS={"zz_registered_here": None}))
    monkeypatch.setitem(sys.modules, "fglit.models", types.SimpleNamespace(MODEL_NAMES=list(catalogue.CATALOGUE["models"]) + ["zzmodel"]))
    assert "zz_registered_here" in catalogue.known_algorithms() and "fedavg" in catalogue.known_algorithms()
    assert catalogue.known_models()[-1] == "zzmodel" and catalogue.known_models()[0] == "GCN"



def test_loading_every_algorithm_imports_no_scipy_or_networkx():
    "`load_algorithms` (which `get_algorithm` and every run call) imports every algorithm module: none may import networkx or scipy.sparse at the top (a run of FedAvg would pay for GCFL's min-cut and GPFL's shortest paths), and every algorithm keeps its stacked form where it has one."
    code = ("import json, sys\n"
            "from fglit.federation import load_algorithms\n"
            "from fglit.fl.loop import stacked_form\n"
            "algos = load_algorithms()\n"
            "print(json.dumps(dict(heavy=[m for m in ('networkx', 'scipy.sparse', 'sklearn') if m in sys.modules],\n"
            "                      stacked=sorted(n for n, a in algos.items() if stacked_form(a.client) is not None))))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env(), cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["heavy"] == [], f"loading the algorithms imported {result['heavy']}"
    assert {"fedavg", "opfgl", "fedproto"} <= set(result["stacked"])

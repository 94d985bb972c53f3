"""Packaging: the declared dependencies match what fglit imports, the core runs without the extras, and the sdist
carries what building the wheel from it needs. (`.ci/wheel_check.sh`, run by CI, installs the wheel into a fresh venv.)"""
import ast
import configparser
import json
import importlib.metadata as md
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CFG = configparser.ConfigParser(delimiters=["="])
CFG.read(REPO / "settings.ini")
CFG = CFG["DEFAULT"]


def dist_names(key: str) -> set[str]:
    "Distribution names (canonical, extras stripped) of one requirements line of settings.ini."
    return {re.sub(r"[-_.]+", "-", re.split(r"[\[<>=!~ ]", r, maxsplit=1)[0]).lower() for r in CFG[key].split()}


def imported_modules() -> dict[str, set[str]]:
    "Third-party top-level module -> the fglit files that import it (at any depth: lazy imports count)."
    out: dict[str, set[str]] = {}
    for path in (REPO / "fglit").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "fglit":
                    out.setdefault(top, set()).add(path.relative_to(REPO).as_posix())
    return out


def test_every_import_is_declared_and_every_core_requirement_is_imported():
    owners = md.packages_distributions()
    core, extras = dist_names("requirements"), set().union(*(dist_names(k) for k in ("flower_requirements", "plots_requirements")))
    imported = {}
    for module, files in imported_modules().items():
        dists = {re.sub(r"[-_.]+", "-", d).lower() for d in owners.get(module, [module])}
        assert dists & (core | extras), f"{module} (imported in {sorted(files)[:3]}) is not declared in settings.ini"
        imported.update({d: module for d in dists})
    assert not core - set(imported), f"declared but never imported: {sorted(core - set(imported))}"


def test_the_core_runs_without_the_extras(shared_root, tmp_path):
    "With flwr, Ray, matplotlib and seaborn missing: a run, the algorithm and reproduction lists and --version work; a Flower command names the extra."
    blocker = tmp_path / "sitecustomize.py"
    blocker.write_text(
        "import sys, importlib.abc\n"
        "class Missing(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in {'flwr', 'ray', 'matplotlib', 'seaborn'}:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Missing())\n")
    env = {"PYTHONPATH": f"{tmp_path}:{REPO}", "FGLIT_DATA": str(shared_root), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    script = (
        "import contextlib, io, json, sys\n"
        "from fglit.cli import main\n"
        "out = []\n"
        "for args in json.loads(sys.argv[1]):\n"
        "    o, e = io.StringIO(), io.StringIO()\n"
        "    with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):\n"
        "        try: code = main(args)\n"
        "        except SystemExit as stop: code = stop.code\n"
        "    out.append([code, o.getvalue(), e.getvalue()])\n"
        "print(json.dumps(out))\n")
    calls = [["run", "fedavg", "--dataset", "Cora", "--clients", "3", "--rounds", "1", "--quiet", "--json"], ["algorithms"],
             ["reproduce", "--list"], ["flower", "local", "fedavg", "--dataset", "Cora", "--clients", "3", "--rounds", "1"], ["--version"]]
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(calls)], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (run_, algos, repro, flower, version) = json.loads(proc.stdout.strip().splitlines()[-1])
    assert run_[0] == 0 and '"accuracy_mean"' in run_[1], run_[2][-1500:]
    assert algos[0] == 0 and "fedpg" in algos[1] and repro[0] == 0 and "gpfl" in repro[1]
    assert flower[0] == 2 and flower[2].strip().splitlines() == [
        "fglit: error: this command needs flwr, which comes with fglit's 'flower' extra: pip install 'fglit[flower]'"], flower[2]
    assert "matplotlib" not in proc.stderr and "seaborn" not in proc.stderr
    assert version[0] == 0 and version[1].strip() == f"fglit {CFG['version']}"     # the package's version, from settings.ini


def test_sdist_carries_what_building_the_wheel_needs(tmp_path):
    pytest.importorskip("build", reason="the dev extra installs `build`")
    out = subprocess.run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", str(tmp_path), str(REPO)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-1500:] + out.stderr[-1500:]
    (sdist,) = tmp_path.glob("fglit-*.tar.gz")
    names = {n.split("/", 1)[1] for n in tarfile.open(sdist).getnames() if "/" in n}
    assert {"settings.ini", "setup.py", "LICENSE", "README.md"} <= names
    assert {f"fglit/paper_numbers/{p}.csv" for p in ("opfgl", "gpfl", "fedgls", "fedpg")} <= names

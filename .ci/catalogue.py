"""Write `fglit.catalogue.CATALOGUE` (the names `fglit --help` lists without importing torch) from fglit's registries.

    python .ci/catalogue.py            # rewrite its cell in nbs/06a_catalogue.ipynb, then run nbdev_export
    python .ci/catalogue.py --check    # exit 1 when the notebook's catalogue differs from the registries

The registries are read in this process (`fglit.catalogue.registry_catalogue`: fglit's algorithm modules, no plugins),
from the exported package: after editing a notebook, `nbdev_export` first. tests/test_startup.py runs the same check.
"""
import argparse
import ast
import pprint
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "nbs" / "06a_catalogue.ipynb"
HEAD = "#| export\n"


def catalogue_cell(nb):
    cells = [c for c in nb.cells if c.cell_type == "code" and c.source.startswith(HEAD + "CATALOGUE = ")]
    assert len(cells) == 1, f"{NOTEBOOK}: expected one cell starting {HEAD + 'CATALOGUE = '!r}, found {len(cells)}"
    return cells[0]


def as_source(catalogue: dict, width: int = 118) -> str:
    "The dict literal, one key a line, each value wrapped under its key."
    lines = ["{"]
    for key, value in catalogue.items():
        prefix = f"    {key!r}: "
        text = pprint.pformat(value, width=width - len(prefix), compact=True, sort_dicts=False)
        lines.append(prefix + text.replace("\n", "\n" + " " * len(prefix)) + ",")
    return "\n".join(lines + ["}"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="only compare; exit 1 on a difference")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from fglit.catalogue import registry_catalogue
    real = registry_catalogue()
    nb = nbformat.read(NOTEBOOK, as_version=4)
    cell = catalogue_cell(nb)
    stored = ast.literal_eval(cell.source[len(HEAD + "CATALOGUE = "):])
    if stored == real:
        print(f"{NOTEBOOK.relative_to(ROOT)}: CATALOGUE matches the registries")
        return 0
    diff = {k: (stored.get(k), real.get(k)) for k in set(stored) | set(real) if stored.get(k) != real.get(k)}
    if args.check:
        print(f"{NOTEBOOK.relative_to(ROOT)}: CATALOGUE differs from the registries (stored, real): {diff}\n"
              f"run python .ci/catalogue.py, then nbdev_export", file=sys.stderr)
        return 1
    cell.source = HEAD + "CATALOGUE = " + as_source(real)
    nbformat.write(nb, NOTEBOOK)
    print(f"rewrote CATALOGUE in {NOTEBOOK.relative_to(ROOT)} ({', '.join(sorted(diff))} changed); now run nbdev_export")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Keep the builder's own folders out of the notebooks' stored outputs.

The docs site is built from the outputs stored in `nbs/`, on whatever machine builds it, so those outputs must not
carry the folders of the machine that ran the notebooks: the data root becomes `$FGLIT_DATA`, the repository
`<repo>`, the virtual environment `<venv>`, and a cell's temporary file `<cell>`. This rewrites every notebook under
`nbs/` that way (run it after executing a notebook; `make check-sync` runs it and fails on a change), then exits 1,
naming notebook and cell, if a local path of any machine is still in an output.
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import nbformat

REPO = Path(__file__).resolve().parents[1]
LOCAL = re.compile(r"(/work/|/root/|/home/|/Users/|site-packages|/tmp/ipykernel)")


def redact(text: str) -> str:
    "The folders of this machine in `text` as placeholders."
    data = os.environ.get("FGLIT_DATA")
    pairs = [(str(Path(sys.prefix)), "<venv>"), (str(REPO), "<repo>")]
    if data: pairs += [(str(Path(data).resolve()), "$FGLIT_DATA"), (data.rstrip("/"), "$FGLIT_DATA")]
    for old, new in sorted(pairs, key=lambda p: -len(p[0])):
        text = text.replace(old, new)
    return re.sub(r"/tmp/ipykernel_\d+/\d+\.py", "<cell>", text)


def _texts(out):
    "(container, key) of every text an output holds."
    if "text" in out: yield out, "text"
    for kind in out.get("data", {}):
        if kind.startswith("text/") or kind == "application/json": yield out["data"], kind
    if "traceback" in out:
        for i in range(len(out["traceback"])): yield out["traceback"], i


def redact_notebook(path: Path) -> tuple[bool, list[str]]:
    "Rewrite `path`'s outputs; whether it changed and the cells still showing a local path."
    nb = nbformat.read(path, as_version=4)
    changed, left = False, []
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            for box, key in _texts(out):
                value = box[key]
                if not isinstance(value, str):
                    if isinstance(value, list) and all(isinstance(v, str) for v in value): value = "".join(value)
                    else: continue
                new = redact(value)
                if new != value: box[key], changed = new, True
                if m := LOCAL.search(new): left.append(f"{path.relative_to(REPO)} cell {i}: ...{new[max(0, m.start() - 40):m.end() + 40]!r}...")
    if changed: nbformat.write(nb, path)
    return changed, left


if __name__ == "__main__":
    changed, left = [], []
    for path in sorted((REPO / "nbs").rglob("*.ipynb")):
        if ".ipynb_checkpoints" in path.parts: continue
        c, l = redact_notebook(path)
        if c: changed.append(str(path.relative_to(REPO)))
        left += l
    for name in changed: print(f"redact_outputs: local folders replaced in {name}")
    if left:
        print("redact_outputs: local paths still in stored outputs (replace them in the notebook):", *left, sep="\n  ")
        sys.exit(1)

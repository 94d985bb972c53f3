"""Write README.md from nbs/index.ipynb (what `nbdev_readme` does with Quarto, done without it):
markdown cells as they are, code cells as fenced Python, their text outputs as fenced text."""
from pathlib import Path

import nbformat

root = Path(__file__).resolve().parents[1]
nb = nbformat.read(root / "nbs" / "index.ipynb", as_version=4)
parts = []
for cell in nb.cells:
    source = cell.source.strip()
    if cell.cell_type == "markdown":
        parts.append(source)
    elif cell.cell_type == "code" and source and not source.startswith("#| hide"):
        parts.append(f"```python\n{source}\n```")
        texts = [o.get("text", "") or o.get("data", {}).get("text/plain", "") for o in cell.get("outputs", [])]
        text = "".join(t if isinstance(t, str) else "".join(t) for t in texts).rstrip()
        if text:
            parts.append(f"```\n{text}\n```")
(root / "README.md").write_text("<!-- Written from nbs/index.ipynb by .ci/nb2readme.py: edit the notebook, not this file. -->\n\n"
                                + "\n\n".join(parts) + "\n")

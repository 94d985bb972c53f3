"""Render the processed notebooks (`_proc/`, from `make docs-proc`) to a static HTML site without Quarto, and check
every page. Quarto cannot be installed offline; where it is, `nbdev_docs` renders `_proc/` the usual way.

    python .ci/render_docs.py [--proc _proc] [--out _site] [--check-only]

What Quarto would interpret is interpreted here, so that no page shows it raw: the YAML front matter nbdev writes
(title, description), cell directives (`#| echo: false` hides the code, `#| include: false` / `#| hide` drop the
cell, `#| output: false` drops the outputs; the directive lines themselves never show), and Quarto's attributes on
links and spans (`{target="_blank"}`, `{.class}`). The stored outputs are already free of the folders of the machine
that ran them (.ci/redact_outputs.py, checked by `make check-sync`); the same redaction is applied here again.

Then every page is checked: no cell directive, Quarto attribute or front matter left; no local path; no warning
written to stderr; as many figures as the notebook's outputs hold. Exit status 1 lists the problems, page by page.
"""
from __future__ import annotations

import argparse
import html
import re
import sys
from pathlib import Path

import nbformat
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from redact_outputs import LOCAL, redact      # one redaction for stored outputs and pages

REPO = Path(__file__).resolve().parents[1]
ATTRS = re.compile(r"(?<=[)\]])\{(?:target=|[.#][\w-])[^}]*\}")        # {target="_blank" ...} / {.class} / {#id} after a link or span
DIVS = re.compile(r"^:::.*$", re.M)
FIGURE_TYPES = ("image/png", "image/svg+xml", "image/jpeg")


def directives(source: str) -> tuple[dict, str]:
    "A code cell's `#| key: value` directives (and bare `#| hide`) and its source without them."
    found, body = {}, []
    for line in source.splitlines():
        m = re.match(r"^#\|\s*([\w-]+)\s*(?::\s*(.*))?$", line.strip())
        if m and not body:
            found[m.group(1)] = (m.group(2) or "true").strip().lower()
        else:
            body.append(line)
    return found, "\n".join(body).strip("\n")


def _redact_outputs(cell) -> None:
    for out in cell.get("outputs", []):
        if "text" in out:
            out["text"] = redact(out["text"] if isinstance(out["text"], str) else "".join(out["text"]))
        for kind, value in list(out.get("data", {}).items()):
            if kind.startswith("text/"):
                value = redact(value if isinstance(value, str) else "".join(value))
                out["data"][kind] = ATTRS.sub("", value) if kind == "text/markdown" else value     # show_doc's [source](...){target=...}


def quarto_to_plain(nb) -> None:
    "Interpret in place what Quarto would: front matter, directives, attributes, fenced divs."
    cells = []
    for cell in nb.cells:
        if cell.cell_type == "raw" and cell.source.lstrip().startswith("---"):
            meta = yaml.safe_load(cell.source.strip().strip("-")) or {}
            text = f"# {meta.get('title', '')}".rstrip() + (f"\n\n> {meta['description']}" if meta.get("description") else "")
            cells.append(nbformat.v4.new_markdown_cell(text))
            continue
        if cell.cell_type == "markdown":
            cell.source = DIVS.sub("", ATTRS.sub("", cell.source))
        if cell.cell_type == "code":
            found, cell.source = directives(cell.source)
            if found.get("include") == "false" or "hide" in found:
                continue
            if found.get("output") == "false":
                cell.outputs = []
            cell.metadata.setdefault("tags", [])
            if found.get("echo") == "false" or not cell.source.strip():
                cell.metadata["tags"].append("remove_input")
            if found.get("output") == "asis":       # show_doc's markdown: render it as markdown
                for out in cell.outputs:
                    if out.get("output_type") == "stream":
                        out.update(output_type="display_data", data={"text/markdown": out.pop("text")}, metadata={})
                        out.pop("name", None)
            _redact_outputs(cell)
        cells.append(cell)
    nb.cells = cells


def figures_in(nb) -> int:
    return sum(1 for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
               if any(t in o.get("data", {}) for t in FIGURE_TYPES))


def check_page(page: str, figures: int) -> list[str]:
    "What is wrong with one rendered page (empty when nothing)."
    text = html.unescape(re.sub(r"<[^>]+>", " ", re.sub(r"<(script|style)\b.*?</\1>", " ", page, flags=re.S)))
    problems = []
    if m := re.search(r"(?m)^\s*#\|\s*[\w-]+", text): problems.append(f"a cell directive shows: {m.group(0).strip()!r}")
    if m := re.search(r"\{target=[^}]*\}|\{\.[\w-]+[^}]*\}", text): problems.append(f"a Quarto attribute shows: {m.group(0)!r}")
    if m := re.search(r"(?m)^\s*(title|description):\s.*$", text[:2000]): problems.append(f"front matter shows: {m.group(0).strip()!r}")
    if m := LOCAL.search(text): problems.append(f"a local path shows: ...{text[max(0, m.start() - 40):m.end() + 40]!r}...")
    for block in re.findall(r'<div [^>]*data-mime-type="application/vnd\.jupyter\.stderr"[^>]*>(.*?)</div>', page, flags=re.S):
        if re.search(r"Warning|WARNING", block): problems.append(f"a warning on stderr: {html.unescape(re.sub(r'<[^>]+>', '', block)).strip()[:120]!r}")
    shown = len(re.findall(r'<img[^>]+src="data:image/|<svg\b', page))
    if shown < figures: problems.append(f"{figures} figures in the outputs, {shown} on the page")
    return problems


def render(proc: Path, out: Path) -> dict[str, list[str]]:
    "Render every notebook under `proc` into `out` (same relative paths, .html) and an index; the problems per page."
    from nbconvert import HTMLExporter
    from traitlets.config import Config
    conf = Config()
    conf.TagRemovePreprocessor.remove_input_tags = {"remove_input"}
    conf.TagRemovePreprocessor.enabled = True
    exporter = HTMLExporter(config=conf, template_name="lab")
    problems, pages = {}, []
    for path in sorted(proc.rglob("*.ipynb")):
        if ".ipynb_checkpoints" in path.parts: continue
        nb = nbformat.read(path, as_version=4)
        quarto_to_plain(nb)
        body, _ = exporter.from_notebook_node(nb)
        rel = path.relative_to(proc).with_suffix(".html")
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_text(body)
        title = next((c.source.splitlines()[0].lstrip("# ") for c in nb.cells if c.cell_type == "markdown" and c.source.startswith("# ")), rel.stem)
        pages.append((rel.as_posix(), title))
        found = check_page(body, figures_in(nb))
        if found: problems[rel.as_posix()] = found
    links = "\n".join(f'<li><a href="{html.escape(r)}">{html.escape(t)}</a> <small>{html.escape(r)}</small></li>' for r, t in pages)
    (out / "index.html").write_text(f"<!doctype html><meta charset=utf-8><title>fglit</title><h1>fglit</h1><ul>\n{links}\n</ul>\n")
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--proc", type=Path, default=REPO / "_proc")
    ap.add_argument("--out", type=Path, default=REPO / "_site")
    o = ap.parse_args()
    if not o.proc.is_dir():
        print(f"render_docs: no {o.proc}; run `make docs-proc` first", file=sys.stderr)
        return 1
    problems = render(o.proc, o.out)
    pages = len(list(o.out.rglob("*.html"))) - 1
    for page, found in problems.items():
        for p in found: print(f"{page}: {p}")
    print(f"render_docs: {pages} pages in {o.out}; " + (f"{len(problems)} with problems" if problems else "every page checked"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

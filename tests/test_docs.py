"""The offline docs renderer (.ci/render_docs.py, run by `make docs-proc`): what Quarto would interpret is interpreted,
and the page check finds each kind of leak. (`make test` renders and checks every real page before pytest runs.)"""
import importlib.util
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("render_docs", REPO / ".ci" / "render_docs.py")
render_docs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(render_docs)


def notebook():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_raw_cell("---\ntitle: A page\ndescription: what it is about\n---"),
                nbformat.v4.new_markdown_cell("See [the code](https://example.org){target=\"_blank\"} here.\n\n::: {.callout-note}\nnote\n:::"),
                nbformat.v4.new_code_cell("#| echo: false\n#| output: asis\nshow_doc(f)"),
                nbformat.v4.new_code_cell("#| hide\nsecret = 1"),
                nbformat.v4.new_code_cell("x = 1")]
    nb.cells[2].outputs = [nbformat.v4.new_output("stream", name="stdout", text="### f\n[source](https://x){target=\"_blank\" style=\"float:right\"}\n")]
    return nb


def test_quarto_syntax_is_interpreted_and_the_page_is_clean(tmp_path):
    pytest.importorskip("nbconvert", reason="the docs render with nbconvert (jupyterlab's; a GPU machine's offline environment leaves it out)")
    proc, out = tmp_path / "proc", tmp_path / "site"
    proc.mkdir()
    nbformat.write(notebook(), proc / "page.ipynb")
    assert render_docs.render(proc, out) == {}
    page = (out / "page.html").read_text()
    assert "A page" in page and "what it is about" in page and "secret" not in page and "show_doc(f)" not in page
    assert "{target=" not in page and ":::" not in page and "#|" not in page
    # a real stderr output as nbconvert renders it: a warning is caught, an error line a cell shows on purpose is not
    nb = notebook()
    nb.cells[4].outputs = [nbformat.v4.new_output("stream", name="stderr", text="fglit: error: bad input\n")]
    nbformat.write(nb, proc / "page.ipynb")
    assert render_docs.render(proc, out) == {}
    nb.cells[4].outputs = [nbformat.v4.new_output("stream", name="stderr", text="x.py:3: FutureWarning: soon\n")]
    nbformat.write(nb, proc / "page.ipynb")
    assert "warning on stderr" in render_docs.render(proc, out)["page.html"][0]
    assert 'href="page.html"' in (out / "index.html").read_text()


def test_the_check_finds_each_leak():
    page = lambda body: f"<html><body>{body}</body></html>"
    assert render_docs.check_page(page("<p>fine</p>"), 0) == []
    for body, word in [("<pre>#| echo: false\nx</pre>", "directive"), ('<p>[a](b){target="_blank"}</p>', "Quarto attribute"),
                       ("<p>/work/main/.venv/lib/x.py</p>", "local path"),
                       ('<div class="jp-RenderedText jp-OutputArea-output" data-mime-type="application/vnd.jupyter.stderr" tabindex="0">'
                        '<pre>UserWarning: careful</pre></div>', "warning")]:
        found = render_docs.check_page(page(body), 0)
        assert found and word in found[0], (body, found)
    assert "figures" in render_docs.check_page(page("<p>no image</p>"), 1)[0]


def test_stored_outputs_lose_this_machines_folders_and_another_machines_are_refused(tmp_path, monkeypatch):
    "The CI builder's folders differ from the machine that ran the notebooks: stored outputs must hold neither."
    spec = importlib.util.spec_from_file_location("redact_outputs", REPO / ".ci" / "redact_outputs.py")
    redact_outputs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(redact_outputs)
    data = tmp_path / "datasets"
    data.mkdir()
    monkeypatch.setenv("FGLIT_DATA", str(data))
    monkeypatch.setattr(redact_outputs, "REPO", tmp_path)
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("print(root)")]
    nb.cells[0].outputs = [nbformat.v4.new_output("stream", name="stdout", text=f"data root: {data}\nCora at {data}/Cora\n")]
    path = tmp_path / "a.ipynb"
    nbformat.write(nb, path)
    assert redact_outputs.redact_notebook(path) == (True, [])
    assert nbformat.read(path, as_version=4).cells[0].outputs[0].text == "data root: $FGLIT_DATA\nCora at $FGLIT_DATA/Cora\n"
    assert redact_outputs.redact_notebook(path) == (False, [])          # already clean: unchanged
    nb.cells[0].outputs[0].text = "not under /home/someone/datasets\n"   # the machine that ran it is not this one
    nbformat.write(nb, path)
    changed, left = redact_outputs.redact_notebook(path)
    assert not changed and len(left) == 1 and "a.ipynb cell 0" in left[0] and "/home/" in left[0]

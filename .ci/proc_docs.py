"""Process the notebooks for the docs site as `nbdev_proc_nbs` does, minus its Quarto installer.

nbdev 2's `nbdev_proc_nbs` first downloads Quarto when it is missing, which cannot work offline.
The steps after that (quarto.yml refresh, module index, sidebar, processing every notebook into
`_proc/`) are what this runs; `nbdev_docs` on a machine with Quarto renders `_proc/`.
"""
from nbdev.doclinks import _build_modidx
from nbdev.quarto import nbdev_sidebar, refresh_quarto_yml
from nbdev.serve import proc_nbs

if __name__ == "__main__":      # proc_nbs starts worker processes that re-import this file
    refresh_quarto_yml()
    _build_modidx()
    nbdev_sidebar.__wrapped__()
    proc_nbs()
    print("docs-proc: notebooks processed into _proc/")

"""Every notebook executes without error (one pytest item per notebook).

`nbdev.test.test_nb` runs a notebook in-process and honours nbdev's
directives (`#| eval: false`, flags); it is imported under another name so
that pytest does not collect it as a test itself.
"""
import os
from pathlib import Path

import pytest
import nbdev.test as nbdev_test

from conftest import ROOT

NOTEBOOKS = sorted(p for p in (ROOT / "nbs").glob("*.ipynb") if not p.name.startswith("_"))


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(nb: Path):
    cwd = os.getcwd()
    try:
        os.chdir(nb.parent)
        ok, secs = nbdev_test.test_nb(nb, basepath=ROOT, do_print=False)
    finally:
        os.chdir(cwd)
    assert ok, f"{nb.name} raised while executing (run `.venv/bin/nbdev-test {nb}`)"

"""Every notebook executes without error — one pytest item per notebook.

The book build (the `book` fixture) executes each notebook of `_toc.yml` in a
fresh Jupyter kernel, as a reader's Jupyter would, with `raise_on_error`; this
test reads myst-nb's record of each execution instead of running the
notebooks a second time. Developers can still run one notebook in-process with
`.venv/bin/nbdev-test nbs/NAME.ipynb`.
"""
import re

import pytest

from conftest import ROOT, exec_data, toc_files

NOTEBOOKS = [d for d in toc_files() if (ROOT / f"{d}.ipynb").exists()]


def test_every_notebook_is_in_the_book():
    listed = {f"{d}.ipynb" for d in NOTEBOOKS}
    found = {f"nbs/{p.name}" for p in (ROOT / "nbs").glob("*.ipynb")
             if not p.name.startswith("_")}
    assert found <= listed, f"notebooks missing from _toc.yml: {sorted(found - listed)}"


@pytest.mark.parametrize("doc", NOTEBOOKS, ids=[d.split("/")[-1] for d in NOTEBOOKS])
def test_notebook_executes(book, doc):
    rc, log = book
    data = exec_data(doc)
    errors = re.findall(rf"{re.escape(doc)}\.ipynb.*?(?:Error|error).*", log)
    assert data is not None, f"{doc} was not executed by the book build"
    assert data.get("succeeded"), (f"{doc} raised while executing:\n"
                                   + "\n".join(errors[:5]) + "\n" + log[-3000:])

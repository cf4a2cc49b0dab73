"""The book's structure: every chapter opens with what it shows and ends with a
summary, and the reproduction map is filled by glue from the chapters that
compute its values, never typed."""
import html
import json
import re

import pytest

from conftest import ROOT, toc_files

MAP = ROOT / "nbs" / "reproduction.md"
GLUE = re.compile(r"\{glue:text\}`([0-9A-Za-z_]+)\.ipynb::([A-Za-z0-9_-]+):s`")


def _chapters():
    "Notebook chapters of the toc (the root page is an introduction, not a chapter)."
    return [f for f in toc_files()[1:] if (ROOT / f"{f}.ipynb").exists()]


def _cells(doc):
    nb = json.loads((ROOT / f"{doc}.ipynb").read_text())
    return [(c["cell_type"], "".join(c["source"])) for c in nb["cells"]]


@pytest.mark.parametrize("doc", _chapters())
def test_chapter_opens_with_what_it_shows_and_ends_with_summary(doc):
    md = [src for kind, src in _cells(doc) if kind == "markdown"]
    assert md and md[0].lstrip().startswith("# "), f"{doc}: the first markdown cell is not the title"
    assert re.search(r"\{admonition\} What this chapter (shows|holds)", md[0]), (
        f"{doc}: the first cell should open with a 'What this chapter shows' admonition "
        "saying what the chapter shows and which paper result it derives or reproduces")
    assert any(re.search(r"^## Summary\s*$", s, re.M) for s in md), f"{doc}: no '## Summary' section"


def _map_rows():
    "The table rows of the reproduction map's source: (section, cells)."
    rows, section = [], None
    for line in MAP.read_text().splitlines():
        if line.startswith("## "):
            section = line[3:]
        elif line.startswith("| ") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            if cells[0] not in ("claim of the paper", "claim or figure of the paper",
                                "connection claimed", "result"):
                rows.append((section, cells))
    return rows


def test_map_rows_are_glued_and_link_their_chapter():
    rows = _map_rows()
    assert len(rows) >= 18, f"only {len(rows)} rows in the reproduction map"
    for section, cells in rows:
        assert len(cells) == 4, f"row with {len(cells)} cells: {cells}"
        claim, paper, where, ours = cells
        assert "{doc}`" in where, f"{claim!r}: no chapter link"
        refs = GLUE.findall(ours)
        assert refs, f"{claim!r}: the 'ours' cell has no glued value"
        # the chapter that computes a value is the chapter the row points to
        linked = set(re.findall(r"\{doc\}`([0-9A-Za-z_]+)`", where))
        assert {d for d, _ in refs} <= linked, f"{claim!r}: value glued from an unlinked chapter"
        typed = GLUE.sub("", ours)
        # results are never typed: no decimals, exponents or percentages outside glue
        assert not re.search(r"\d\.\d|\de[-+]?\d|\d\s*%", typed), f"{claim!r}: typed result in {typed!r}"


def test_map_covers_every_experiment_and_foundation_chapter():
    linked = set(re.findall(r"\{doc\}`([0-9A-Za-z_]+)`", MAP.read_text()))
    need = {f.split("/")[-1] for f in _chapters() if re.match(r"nbs/(0[2-9]|1[01])", f)}
    need.discard("05_regression"), need.discard("05a_train")   # the setting, not a claim
    need.discard("11ac_hf_checks")      # the checks around a patched run, not a claim
    need.discard("11g_hf")              # the real-model API in one import, not a claim
    assert need <= linked, f"chapters missing from the reproduction map: {sorted(need - linked)}"


def _glue_value(doc, key):
    data = json.loads((ROOT / "_build" / "jupyter_execute" / "nbs" / f"{doc}.glue.json").read_text())
    assert key in data, f"{doc} glues no {key!r}"
    text = data[key]["data"]["text/plain"]
    return text[1:-1] if text[:1] in "'\"" and text[-1:] == text[:1] else text


def test_map_page_shows_the_chapters_values(book):
    rc, log = book
    assert rc == 0, log[-3000:]
    page = html.unescape((ROOT / "_build" / "html" / "nbs" / "reproduction.html").read_text())
    body = page.split('<article class="bd-article">', 1)[-1]
    assert "{glue" not in body and "pending" not in body.lower()
    refs = {m for _, cells in _map_rows() for m in GLUE.findall(cells[3])}
    for doc, key in sorted(refs):
        value = _glue_value(doc, key)
        assert f'<span class="pasted-text">{value}</span>' in body, (
            f"reproduction map: {doc}::{key} = {value!r} not shown on the page")

"""The book's structure: every chapter opens with what it shows and ends with a
summary, and the reproduction map is filled by glue from the chapters that
compute its values, never typed."""
import html
import json
import re

import pytest

from conftest import ROOT, toc_files

MAP = ROOT / "nbs" / "reproduction.md"
INDEX = ROOT / "nbs" / "index.ipynb"
GLUE = re.compile(r"\{glue:text\}`([0-9A-Za-z_]+)\.ipynb::([A-Za-z0-9_-]+):s`")
DOC = re.compile(r"\{doc\}`([0-9A-Za-z_]+)`")
VERDICTS = ("reproduced", "partly", "not reproduced", "beyond the paper")
BEYOND = "Beyond the paper"          # the map's section of results the paper does not report
TYPED = re.compile(r"\d\.\d|\de[-+]?\d|\d\s*%")   # a decimal, exponent or percentage


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


def _table_rows(lines):
    "(section, cells) of the body rows of the Markdown tables in `lines` (headers skipped)."
    rows, section = [], None
    for i, line in enumerate(lines):
        if line.startswith("## "):
            section = line[3:].strip()
        elif line.startswith("| ") and not line.startswith("|---"):
            if i + 1 < len(lines) and lines[i + 1].startswith("|---"):
                continue                                    # a header row
            rows.append((section, [c.strip() for c in line.strip().strip("|").split(" | ")]))
    return rows


def _map_rows():
    "The table rows of the reproduction map's source: (section, cells)."
    return _table_rows(MAP.read_text().splitlines())


def _found():
    "The index's 'What we found' section: its text and its table rows (cells)."
    nb = json.loads(INDEX.read_text())
    text = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    parts = re.split(r"^## What we found\s*$", text, flags=re.M)
    assert len(parts) == 2, "the index has no (or more than one) '## What we found' heading"
    section = re.split(r"^## ", parts[1], flags=re.M)[0]
    return section, [cells for _, cells in _table_rows(section.splitlines())]


def test_map_rows_are_glued_and_link_their_chapter():
    rows = _map_rows()
    assert len(rows) >= 18, f"only {len(rows)} rows in the reproduction map"
    for section, cells in rows:
        assert len(cells) == 5, f"row with {len(cells)} cells: {cells}"
        claim, verdict, paper, where, ours = cells
        assert verdict in VERDICTS, f"{claim!r}: verdict {verdict!r} is not one of {VERDICTS}"
        assert "{doc}`" in where, f"{claim!r}: no chapter link"
        refs = GLUE.findall(ours)
        assert refs, f"{claim!r}: the 'ours' cell has no glued value"
        # the chapter that computes a value is the chapter the row points to
        linked = set(DOC.findall(where))
        assert {d for d, _ in refs} <= linked, f"{claim!r}: value glued from an unlinked chapter"
        typed = GLUE.sub("", ours)
        # results are never typed: no decimals, exponents or percentages outside glue
        assert not TYPED.search(typed), f"{claim!r}: typed result in {typed!r}"


def test_map_tables_have_a_verdict_column():
    lines = MAP.read_text().splitlines()
    heads = [l for i, l in enumerate(lines[:-1]) if l.startswith("| ") and lines[i + 1].startswith("|---")]
    assert heads, "no table in the reproduction map"
    for h in heads:
        assert [c.strip() for c in h.strip("|").split(" | ")][1] == "Verdict", f"no Verdict column: {h}"


def _match(cells, rows):
    "Index of the map row whose verdict and glued values an index row repeats, or None."
    claim, verdict, number, chapter = cells
    keys = set(GLUE.findall(number))
    for i, (_, (_, v, _, _, ours)) in enumerate(rows):
        if v == verdict and keys <= set(GLUE.findall(ours)):
            return i
    return None


def test_index_says_what_we_found_claim_by_claim():
    section, found = _found()
    rows = _map_rows()
    assert found, "'What we found' has no table"
    matched = []
    for cells in found:
        assert len(cells) == 4, f"'What we found' row with {len(cells)} cells: {cells}"
        claim, verdict, number, chapter = cells
        assert verdict in VERDICTS, f"{claim!r}: verdict {verdict!r} is not one of {VERDICTS}"
        refs = GLUE.findall(number)
        assert refs, f"{claim!r}: no glued number"
        assert not TYPED.search(GLUE.sub("", number)), f"{claim!r}: typed number in {number!r}"
        assert {d for d, _ in refs} <= set(DOC.findall(chapter)), (
            f"{claim!r}: a number glued from a chapter the row does not link")
        i = _match(cells, rows)
        assert i is not None, (f"{claim!r}: no row of the reproduction map has its verdict "
                               f"{verdict!r} and the values it shows")
        matched.append(i)
    assert matched == sorted(matched), "'What we found' is not in the order of the map"
    # one row per claim of the paper the map holds, and every real-model test of one
    claims = {i for i, (sec, _) in enumerate(rows) if sec != BEYOND}
    assert claims <= set(matched), ("claims of the map missing from 'What we found': "
                                    f"{[rows[i][1][0] for i in sorted(claims - set(matched))]}")
    assert len(matched) == len(set(matched)), "two rows of 'What we found' repeat one claim"
    tested = {d for sec, (_, v, _, _, ours) in rows if sec == BEYOND and v != "beyond the paper"
              for d, _ in GLUE.findall(ours)}         # the chapters that measured them
    shown = {d for cells in found for d in DOC.findall(cells[3])}
    assert tested <= shown, f"real-model verdicts missing from 'What we found': {sorted(tested - shown)}"


def test_index_states_the_one_model_limit():
    section, _ = _found()
    prose = "\n".join(l for l in section.splitlines() if not l.startswith("|"))
    m = re.search(r"SmolLM2-135M-Instruct[^\n]*?in context", prose)
    assert m and GLUE.search(m.group(0)), (
        "'What we found' should say that every real-LM result rests on SmolLM2-135M-Instruct "
        "and how far it gets in context, with the number glued from its chapter")


def test_map_covers_every_experiment_and_foundation_chapter():
    linked = set(re.findall(r"\{doc\}`([0-9A-Za-z_]+)`", MAP.read_text()))
    need = {f.split("/")[-1] for f in _chapters() if re.match(r"nbs/(0[2-9]|1[01])", f)}
    need.discard("06_regression"), need.discard("07_train")   # the setting, not a claim
    need.discard("18_hf_checks")      # the checks around a patched run, not a claim
    need.discard("28_hf")              # the real-model API in one import, not a claim
    need.discard("29_front")           # the one import for every model: the library, not a claim
    need.discard("16_wrappers")       # how nnsight / TransformerLens models are read: the library
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
    refs = {m for _, cells in _map_rows() for m in GLUE.findall(cells[4])}
    for doc, key in sorted(refs):
        value = _glue_value(doc, key)
        assert f'<span class="pasted-text">{value}</span>' in body, (
            f"reproduction map: {doc}::{key} = {value!r} not shown on the page")


def test_index_page_shows_what_we_found(book):
    rc, log = book
    assert rc == 0, log[-3000:]
    page = html.unescape((ROOT / "_build" / "html" / "nbs" / "index.html").read_text())
    body = page.split('<article class="bd-article">', 1)[-1]
    assert re.search(r"<h2>What we found", body), "no 'What we found' heading on the index"
    assert "{glue" not in body
    section, found = _found()
    for doc, key in sorted(set(GLUE.findall(section))):
        value = _glue_value(doc, key)
        assert f'<span class="pasted-text">{value}</span>' in body, (
            f"index: {doc}::{key} = {value!r} not shown on the page")

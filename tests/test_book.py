"""The book builds with warnings as errors, and its HTML is what a reader needs.

The build executes every notebook (`raise_on_error: true`); the checks read
the HTML it wrote, and, where headless Chromium is installed, the page as a
browser renders it: typeset math, images, no raw LaTeX delimiters.
"""
import html as _h
import json
import re
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from conftest import ROOT, toc_files as _toc_files

sys.path.insert(0, str(ROOT / "tools"))
import page_metrics  # noqa: E402  (tools/page_metrics.py: Chromium and layout probes)
sys.path.insert(0, str(ROOT / "_ext"))
from book_cells import imports_only  # noqa: E402  (the rule the book's extension applies)

HTML = ROOT / "_build" / "html"
ARTIFACTS = ROOT / "test-artifacts"


class _Page(HTMLParser):
    "Collect images, scripts and the text outside code blocks."
    def __init__(self):
        super().__init__(); self.imgs, self.scripts, self.text = [], [], []
        self._pre = 0

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "img": self.imgs.append(a.get("src", ""))
        if tag == "script" and a.get("src"): self.scripts.append(a["src"])
        if tag in ("pre", "code"): self._pre += 1
        if tag in ("td", "th"): self.text.append(" | ")    # cells do not run together

    def handle_endtag(self, tag):
        if tag in ("pre", "code"): self._pre -= 1

    def handle_data(self, data):
        if not self._pre: self.text.append(data)


def _page(doc):
    path = HTML / f"{doc}.html"
    assert path.exists(), f"{doc} is in _toc.yml but {path} was not built"
    p = _Page(); p.feed(path.read_text()); return path, p


@pytest.mark.parametrize("doc", _toc_files())
def test_page_built_with_local_math_and_images(book, doc):
    path, p = _page(doc)
    text = " ".join(p.text)
    assert "$$" not in text, f"{doc}: raw $$ left in the page (math not parsed)"
    role = re.search(r".{0,40}(?<![\\\w])\{(?:glue:|cite:|numref|doc\}|ref\}).{0,40}", text)
    assert not role, f"{doc}: unresolved role: {role.group(0)!r}"
    assert not re.search(r"^\s*\.\. [a-z:]+::", text, re.M), f"{doc}: raw reST directive"
    mathjax = [s for s in p.scripts if "tex-chtml" in s]
    if 'class="math' in path.read_text():
        assert mathjax, f"{doc}: the page has math but loads no MathJax"
    assert all(not s.startswith("http") for s in p.scripts), \
        f"{doc}: scripts must come from the vendored copies, got {p.scripts}"
    for src in p.imgs:
        if src.startswith("data:"): continue
        img = (path.parent / src.split("?")[0]).resolve()
        assert img.exists() and img.stat().st_size > 0, f"{doc}: image {src} missing or empty"
    assert path.stat().st_size < 5_000_000, f"{doc}: page is {path.stat().st_size} bytes"
    twice = sorted({src for src in p.imgs if p.imgs.count(src) > 1})
    assert not twice, (f"{doc}: image shown more than once, {twice} (a glued figure left "
                       "open is also displayed by its cell: close it after `glue`)")


def test_book_builds_with_warnings_as_errors(book):
    rc, log = book
    assert rc == 0, "book build failed (jupyter-book build -W -n --keep-going .):\n" + log[-6000:]


def test_index_redirects_to_root(book):
    assert "nbs/index.html" in (HTML / "index.html").read_text()


def _chromium():
    "Headless Chromium: $CHROMIUM, else Debian's `chromium`, else a Chrome on PATH."
    return page_metrics.chromium()


def _browse(url, *extra):
    return page_metrics.browse(url, 1280, *extra)


@pytest.mark.skipif(_chromium() is None, reason="headless Chromium not installed "
                    "(`make browser` or `apt-get install chromium`)")
@pytest.mark.parametrize("doc", _toc_files())
def test_math_typeset_in_browser(book, doc):
    "Every formula of the page is a MathJax container once the browser ran it."
    path, p = _page(doc)
    raw = path.read_text()
    if 'class="math' in raw:
        r = _checks(doc)
        assert r["sources"] > 0, f"{doc}: the HTML has math but the browser found none"
        assert r["typeset"] >= r["sources"], (f"{doc}: math present but not typeset by "
                                              f"MathJax ({r['typeset']} of {r['sources']})")
    if doc.endswith(("02_patch", "01_blocks", "reproduction")):
        ARTIFACTS.mkdir(exist_ok=True)
        shot = ARTIFACTS / f"{Path(doc).name}.png"
        _browse(path.as_uri(), f"--screenshot={shot}")
        assert shot.exists() and shot.stat().st_size > 10_000


_CHECKS = {}

EXPLORER = "nbs/31_explorer"

needs_chromium = pytest.mark.skipif(_chromium() is None, reason="headless Chromium not "
                                    "installed (`make browser` or `apt-get install chromium`)")


def _widget_outputs(html):
    "The cell outputs that hold a widget view (its script and what renders it)."
    views = re.findall(r'<div class="cell_output[^"]*">(.*?'
                       r'application/vnd\.jupyter\.widget-view\+json.*?</script>)',
                       html, re.S)
    return [v[v.rfind('<div class="cell_output'):] for v in views]


def test_explorer_page_embeds_widget_state(book):
    "The build recorded the static explorer: its panels, the Stacks and the links."
    path, _ = _page(EXPLORER)
    raw = path.read_text()
    assert 'type="application/vnd.jupyter.widget-state+json"' in raw, \
        "no widget state recorded: the static page cannot render the explorer"
    assert raw.count('type="application/vnd.jupyter.widget-view+json"') == 1, \
        "the page shows one widget, the static explorer"
    for model in ("VBoxModel", "DropdownModel", "ToggleButtonsModel", "StackModel",
                  "LinkModel", "ImageModel"):
        assert f'"{model}"' in raw, f"widget state lacks a {model}"
    assert raw.count('"_model_name": "ImageModel"') >= 20, "fewer than 20 panels recorded"
    assert raw.count("embed-amd.js") == 1, "the widget manager must be loaded once"
    assert raw.index("widget-view+json") < raw.index('id="what-is-computed'), \
        "the explorer comes first on its page"


@needs_chromium
def test_static_explorer_reacts_to_a_control(book):
    "Moving a control in the static page (no kernel) switches the panel."
    js = r"""
    const view = document.querySelector('.widget-vbox');
    if (!view) { report({error: 'no widget rendered'}); return; }
    const shown = () => ({imgs: [...view.querySelectorAll('img')].filter(i => i.offsetParent && i.offsetWidth > 0).length,
      info: [...view.querySelectorAll('.widget-html')].filter(h => h.offsetParent).map(h => h.textContent.slice(0, 40))[0],
      src: [...view.querySelectorAll('img')].filter(i => i.offsetParent && i.offsetWidth > 0).map(i => i.src)[0]});
    const before = shown();
    const sel = view.querySelector('.widget-dropdown select');
    sel.selectedIndex = sel.options.length - 1; sel.dispatchEvent(new Event('change', {bubbles: true}));
    await new Promise(r => setTimeout(r, 1500));
    const kind = shown();
    const btn = [...view.querySelectorAll('.widget-toggle-buttons button')].find(b => b.textContent.trim() === '1');
    btn.click();
    await new Promise(r => setTimeout(r, 1500));
    report({before, kind, depth: shown(), last: sel.options[sel.options.length - 1].textContent});
    """
    r = page_metrics.probe(EXPLORER, js, wait_ms=5000)
    assert "error" not in r, r
    assert r["before"]["imgs"] == 1 and r["before"]["info"].startswith("softmax, 3 layers"), r
    assert r["kind"]["imgs"] == 1 and r["kind"]["info"].startswith(f"{r['last']}, 3 layers"), r
    assert r["kind"]["src"] != r["before"]["src"], "the picture did not change"
    assert r["depth"]["info"].startswith(f"{r['last']}, the block"), r
    ARTIFACTS.mkdir(exist_ok=True)
    page_metrics.screenshot(EXPLORER, 1400, str(ARTIFACTS / "31_explorer.png"), height=2000)


# --- what a reader sees: no nbdev directives, no words about how the book was made,
#     collapsed code, tables as tables, nothing clipped at 390 px

class _Code(HTMLParser):
    "Text of every <pre> block and each cell's classes with its input's text."
    def __init__(self):
        super().__init__(); self.pre, self.cells = [], []
        self._depth, self._buf, self._cell, self._cdepth = 0, [], None, 0

    def handle_starttag(self, tag, attrs):
        cls = dict(attrs).get("class", "") or ""
        if tag == "div" and re.search(r"\bcell\b", cls) and "cell_input" not in cls \
                and "cell_output" not in cls and self._cell is None:
            self._cell, self._cdepth = {"cls": cls, "code": ""}, 0
        if self._cell is not None and tag == "div": self._cdepth += 1
        if self._cell is not None and tag == "details": self._cell["details"] = True
        if tag == "pre": self._depth += 1; self._buf = []

    def handle_endtag(self, tag):
        if tag == "pre" and self._depth:
            self._depth -= 1; text = "".join(self._buf); self.pre.append(text)
            if self._cell is not None and not self._cell["code"]: self._cell["code"] = text
        if self._cell is not None and tag == "div":
            self._cdepth -= 1
            if self._cdepth == 0: self.cells.append(self._cell); self._cell = None

    def handle_data(self, data):
        if self._depth: self._buf.append(data)


def _code(doc):
    path, _ = _page(doc)
    p = _Code(); p.feed(path.read_text()); return path, p


@pytest.mark.parametrize("doc", _toc_files())
def test_no_nbdev_directives_in_displayed_code(book, doc):
    _, p = _code(doc)
    bad = [l for t in p.pre for l in t.splitlines() if l.lstrip().startswith("#|")]
    assert not bad, f"{doc}: nbdev directives shown in code: {bad[:3]}"


@pytest.mark.parametrize("doc", _toc_files())
def test_thebe_names_this_repository(book, doc):
    path, _ = _page(doc)
    assert "binder-examples" not in path.read_text(), \
        f"{doc}: Thebe names a placeholder repository (set thebe_config in _config.yml)"


@pytest.mark.parametrize("doc", [d for d in _toc_files() if (ROOT / f"{d}.ipynb").exists()
                                 and not d.endswith("index")])
def test_implementation_cells_collapsed(book, doc):
    "Every code cell shown is folded, unless it only imports or is tagged show-input."
    _, p = _code(doc)
    cells = [c for c in p.cells if "tag_remove-input" not in c["cls"] and c["code"]]
    assert cells, f"{doc}: no code cells found"
    open_ = [c for c in cells if "tag_hide-input" not in c["cls"]]
    bad = [c["code"][:60] for c in open_
           if "tag_show-input" not in c["cls"] and not imports_only(c["code"])]
    assert not bad, f"{doc}: code cells shown unfolded: {bad[:3]}"
    assert all(c.get("details") for c in cells if "tag_hide-input" in c["cls"]), \
        f"{doc}: a hide-input cell has no show-code toggle"
    assert len([c for c in open_ if "tag_show-input" in c["cls"]]) <= 4, \
        f"{doc}: more than four code cells opened with show-input"
    first = cells[0]
    assert imports_only(first["code"]) and "tag_hide-input" not in first["cls"], \
        f"{doc}: the first code cell shown should be the chapter's imports, got {first['code'][:80]!r}"


GLUE_FIGURE = re.compile(r"```\{glue:figure\}[ \t]+(\S+)[ \t]*\n((?:[ \t]*:[\w-]+:.*\n)*)")


def glued_tables_in(markdown: str) -> list:
    "Names of the `{glue:figure}` directives of class `table` in `markdown`."
    return [name for name, opts in GLUE_FIGURE.findall(markdown)
            if re.search(r"^[ \t]*:figclass:.*\btable\b", opts, re.M)]


def source_text(doc) -> str:
    "The markdown a page is built from: a .md file, or a notebook's markdown cells."
    md, nb = ROOT / f"{doc}.md", ROOT / f"{doc}.ipynb"
    if md.exists(): return md.read_text()
    cells = json.loads(nb.read_text())["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


def test_glued_table_names_are_read():
    "The source side of the check below, on a page of three glued figures."
    page = ("```{glue:figure} a\n:figclass: table\n:name: a\n\nA.\n```\n"
            "```{glue:figure} b\n:name: b\n\nB.\n```\n"
            "```{glue:figure} c\n:name: tbl-c\n:figclass: wide table\n\nC.\n```\n")
    assert glued_tables_in(page) == ["a", "c"]


def test_the_book_glues_tables():
    "The pages the check below finds tables on: some, each listed in _toc.yml."
    pages = {doc: glued_tables_in(source_text(doc)) for doc in _toc_files()}
    with_tables = {d for d, names in pages.items() if names}
    assert len(with_tables) >= 5, f"only {sorted(with_tables)} glue tables"
    assert "nbs/09_finetune" in with_tables and len(pages["nbs/09_finetune"]) == 3, pages


@pytest.mark.parametrize("doc", _toc_files())
def test_glued_tables_are_tables(book, doc):
    """A figure that holds a table is numbered and captioned as a table, and the
    page shows one such table per `{glue:figure}` of class `table` in its source."""
    path, _ = _page(doc)
    figs = [f for f in re.findall(r"<figure\b.*?</figure>", path.read_text(), re.S)
            if "<table" in f]
    bad = [re.sub("<[^>]+>", "", f)[:120] for f in figs
           if not ("glued-table" in f and re.search(r'caption-number">Table \d', f))]
    assert not bad, f"{doc}: a table is captioned as a figure: {bad}"
    want = glued_tables_in(source_text(doc))
    assert len(figs) == len(want), (f"{doc}: the source glues {len(want)} tables "
                                    f"{want}, the page shows {len(figs)}")


_PHONE = {}


@needs_chromium
@pytest.mark.parametrize("doc", _toc_files())
def test_nothing_clipped_on_a_phone(book, doc):
    "At 390 px, display math, code, tables and images fit their box or scroll inside it."
    if not _PHONE:                              # one Chromium per dozen pages
        _PHONE.update(page_metrics.measure_many(_toc_files(), 390))
    m = _PHONE[doc]
    assert not m["wide"], f"{doc}: wider than the page at 390 px, not scrollable: {m['wide'][:3]}"
    # and the page itself does not scroll sideways (signatures, long names wrap)
    _against_known("wider-than-phone", doc, m["beyond"] if m["page_width"] > 391 else [])


_FIT = r"""
const main = document.querySelector('.bd-article') || document.body;
const col = main.clientWidth, wide = [];
for (const img of main.querySelectorAll('figure img, .cell_output img')) {
  if (!img.offsetParent) continue;
  const w = img.getBoundingClientRect().width;
  if (w > col + 1) wide.push(`${img.src.split('/').pop().slice(0, 12)}: ${Math.round(w)} px`);
}
report({col, wide});
"""


@needs_chromium
def test_figures_fit_the_column_on_a_phone(book):
    "At 390 px every figure scales to the text column: none is wider, none scrolls sideways."
    got = page_metrics.probe_many(_toc_files(), _FIT, width=390, wait_ms=1500)
    assert set(got) == set(_toc_files())
    bad = {doc: r["wide"] for doc, r in got.items() if r["wide"]}
    assert not bad, f"figures wider than the column at 390 px: {bad}"


@needs_chromium
def test_a_figure_opens_at_full_size(book):
    js = r"""
    const img = document.querySelector('.bd-article figure img');
    if (!img) { report({error: 'no figure'}); return; }
    img.click(); await new Promise(r => setTimeout(r, 300));
    const box = document.getElementById('icl-lightbox');
    const big = box && box.querySelector('img');
    const opened = !!box, natural = big ? big.naturalWidth : 0, shown = big ? big.getBoundingClientRect().width : 0;
    document.dispatchEvent(new KeyboardEvent('keydown', {key: 'Escape'}));
    report({opened, natural, shown, closed: !document.getElementById('icl-lightbox')});
    """
    r = page_metrics.probe("nbs/08_equivalence", js, width=390, wait_ms=2000)
    assert r.get("opened") and r["closed"], r
    assert r["shown"] >= min(r["natural"], 390) - 2, f"the figure is not shown at full size: {r}"


# --- proofreading checks (issue 24): each class of defect, on every page.
#
# KNOWN lists what the book still shows on pages whose fix is another piece of
# work: (page, exact instance).  It must only shrink: a new instance fails its
# test, and so does an entry that no longer occurs (delete it then).  Never
# add a whole page or a pattern here.
KNOWN = {
    # page -> table labels (first headers; the caption number is dropped)
    "table-too-wide": {},
    "math-error": {},          # page -> the red/erroneous TeX
    "math-too-wide": {},       # page -> the start of the display formula
    "broken-word": {},         # page -> a table cell's word cut across two lines
    "dangling-colon": {},      # page -> the end of a paragraph that announces nothing
    # page -> the start of a printed line longer than the column (scrolled out of view)
    "output-too-wide": {},
    "raw-tex": {},             # page -> text around the TeX outside maths
    "uncaptioned-table": {},   # page -> the table's first header cells
    "progress-bar": {},        # page -> the matched output text
    "making-of": {},           # page -> the phrase
    "glued-plural": {},        # page -> the matched words
    "wrong-doc-link": {},      # page -> "name -> target (defined in)"
    "wider-than-phone": {},    # page -> the elements that reach past 390 px
    "raw-markdown": {},        # page -> the Markdown the page shows instead of rendering
    "stderr-output": {},       # page -> the start of a warning a cell printed
}


def _against_known(cls, doc, found):
    "Fail on instances not in KNOWN[cls][doc], and on entries that are fixed."
    known = set(KNOWN[cls].get(doc, ()))
    new = [f for f in dict.fromkeys(found) if f not in known]
    fixed = sorted(known - set(found))
    assert not new, f"{doc}: {cls}: {new}"
    assert not fixed, (f"{doc}: {cls}: fixed, remove from KNOWN[{cls!r}][{doc!r}]"
                       f" in tests/test_book.py: {fixed}")


def _checks(doc):
    "One Chromium pass over every page (1400 px, a dozen pages per browser), shared."
    if not _CHECKS:
        _CHECKS.update(page_metrics.checks_many(_toc_files()))
    return _CHECKS[doc]


@needs_chromium
@pytest.mark.parametrize("doc", _toc_files())
def test_tables_fit_their_column(book, doc):
    "At 1400 px every table is whole: no column cut off or scrolled out of view."
    r = _checks(doc)
    # without the caption's number, which moves when a table is added before it
    _against_known("table-too-wide", doc,
                   [re.sub(r"^Table \d+: ", "", t["table"]) for t in r["tables"]])


@needs_chromium
@pytest.mark.parametrize("doc", _toc_files())
def test_display_formulas_fit_their_column(book, doc):
    "At 1400 px every display formula is whole: none runs past the column into a scrolled box."
    _against_known("math-too-wide", doc, _checks(doc)["wide_math"])


@needs_chromium
@pytest.mark.parametrize("doc", _toc_files())
def test_table_words_stay_whole(book, doc):
    "At 1400 px no word or number of a table is cut across two lines ('patt/ern', '1.3e-/07')."
    _against_known("broken-word", doc, _checks(doc)["broken"])


@needs_chromium
@pytest.mark.parametrize("doc", _toc_files())
def test_printed_output_fits_its_column(book, doc):
    "At 1400 px no printed line runs past its box (the box scrolls, the scrollbar is hidden)."
    _against_known("output-too-wide", doc, _checks(doc)["wide_output"])


@needs_chromium
@pytest.mark.parametrize("doc", _toc_files())
def test_every_formula_typesets(book, doc):
    "No MathJax error and no undefined macro (which MathJax shows in red)."
    _against_known("math-error", doc, _checks(doc)["math"])


@needs_chromium
@pytest.mark.parametrize("doc", _toc_files())
def test_no_tex_outside_maths(book, doc):
    "No TeX source (a macro, a $, a sub/superscript group) in the typeset text."
    _against_known("raw-tex", doc, _checks(doc)["tex"])


def _outputs_outside_figures(raw):
    "The HTML of the cell outputs that are not inside a captioned figure."
    bare = re.sub(r"<figure\b.*?</figure>", "", raw, flags=re.S)
    return re.findall(r'<div class="cell_output[^"]*">(.*?)(?=<div class="cell|'
                      r'<section|</section>|$)', bare, re.S)


def _headers(table_html):
    cells = re.findall(r"<th[^>]*>(.*?)</th>", table_html, re.S)
    text = [re.sub(r"<[^>]+>|&nbsp;", "", c).strip() for c in cells]
    return " | ".join([t for t in text if t][:3])


@pytest.mark.parametrize("doc", _toc_files())
def test_tables_are_captioned(book, doc):
    "A table a cell displays is glued into a numbered, captioned Table."
    path, _ = _page(doc)
    found = [_headers(t) for out in _outputs_outside_figures(path.read_text())
             for t in re.findall(r"<table\b.*?</table>", out, re.S)]
    _against_known("uncaptioned-table", doc, found)


PROGRESS = re.compile(r"\d+%\|[^|\n]{0,80}\||\d+(?:\.\d+)?\s?(?:it|s)/(?:s|it)\]|[█▉▊▋▌▍▎▏]{3}")


@pytest.mark.parametrize("doc", _toc_files())
def test_no_progress_bars(book, doc):
    "No progress bar (tqdm's text or widget) in a cell's output."
    path, _ = _page(doc)
    raw = path.read_text()
    found = [m.group(0) for out in re.findall(r'<div class="cell_output.*?</div>', raw, re.S)
             for m in [PROGRESS.search(_h.unescape(out))] if m]
    found += [w for w in ("FloatProgressModel", "IntProgressModel") if f'"{w}"' in raw]
    _against_known("progress-bar", doc, found)


def stderr_outputs(raw: str) -> list:
    "The start of every stderr stream a cell printed (a library's warning, a log line)."
    return [re.sub(r"\s+", " ", _h.unescape(re.sub(r"<[^>]+>", "", m))).strip()[:48]
            for m in re.findall(r'class="output stderr[^"]*">(.*?)</div>\s*</div>', raw, re.S)]


# a quote mark turned the wrong way by the smart-quote pass: an apostrophe
# after a code name or emphasis ("fn‘s"), or a closing quote that opens ("(”Q")
WRONG_QUOTE = re.compile(r"\w‘s\b|[(\[\s]”(?=\w)|[(\[]’(?=\w)")


@pytest.mark.parametrize("doc", _toc_files())
def test_quote_marks_face_the_right_way(book, doc):
    path, _ = _page(doc)
    text = _h.unescape(re.sub(r"<[^>]+>", "", path.read_text()))
    bad = [text[max(0, m.start() - 20):m.end() + 10] for m in WRONG_QUOTE.finditer(text)]
    assert not bad, f"{doc}: quote marks the wrong way round: {bad}"


def dangling_colons(raw: str) -> list:
    """The end of every paragraph of the article that ends with a colon and is
    followed by nothing: the last thing of its section, before the next
    heading (a cell it announced was removed, or never shown)."""
    from bs4 import BeautifulSoup
    art = BeautifulSoup(raw, "html.parser").select_one("article.bd-article")
    out = []
    for p in art.find_all("p") if art else []:
        text = re.sub(r"\s+", " ", p.get_text()).strip()
        if not text.endswith(":") or p.find_parent(["li", "td", "th", "figcaption", "dd", "dt"]):
            continue
        nxt = p.find_next_sibling()
        if nxt is None or nxt.name in ("section", "h1", "h2", "h3", "h4"):
            out.append(text[-60:])
    return out


def test_dangling_colons_are_found():
    page = ('<article class="bd-article"><section><p>Checked below:</p>'
            '<div class="cell">x</div><p>And here it is raised at once:</p></section>'
            '<section><h2>Summary</h2><ul><li><p>a list:</p></li></ul></section></article>')
    assert dangling_colons(page) == ["And here it is raised at once:"]


@pytest.mark.parametrize("doc", _toc_files())
def test_no_dangling_colons(book, doc):
    "No paragraph ends with a colon that announces nothing (its cell or figure gone)."
    path, _ = _page(doc)
    _against_known("dangling-colon", doc, dangling_colons(path.read_text()))


@pytest.mark.parametrize("doc", _toc_files())
def test_references_are_not_empty(book, doc):
    "A References heading lists something (a chapter that cites nothing shows an empty one)."
    path, _ = _page(doc)
    m = re.search(r'<section id="references">(.*?)</section>', path.read_text(), re.S)
    assert not m or 'class="citation"' in m.group(1), \
        f"{doc}: the References section is empty (the chapter cites nothing)"


def test_stderr_outputs_are_found():
    page = ('<div class="output stderr highlight-myst-ansi notranslate"><div class="highlight">'
            '<pre><span></span>UserWarning: something &amp; more</pre></div></div>')
    assert stderr_outputs(page) == ["UserWarning: something & more"]
    assert stderr_outputs('<div class="output stream"><pre>fine</pre></div></div>') == []


@pytest.mark.parametrize("doc", _toc_files())
def test_no_warnings_in_outputs(book, doc):
    "No warning or log line on stderr in a cell's output (silence it or say it in prose)."
    path, _ = _page(doc)
    _against_known("stderr-output", doc, stderr_outputs(path.read_text()))


def raw_markdown(raw: str) -> list:
    """Markdown the page shows as text: a `code span` or **bold** that a glued
    string or a table cell carried past the parser, or a directive's fence
    that was not parsed (outside code blocks and the API page's signatures)."""
    body = raw[raw.find("<main"):]
    for tag in ("script", "style", "pre", "code"):
        body = re.sub(rf"<{tag}\b.*?</{tag}>", " ", body, flags=re.S)
    body = re.sub(r'<dl class="py.*?</dl>', " ", body, flags=re.S)
    text = re.sub(r"\s+", " ", _h.unescape(re.sub(r"<[^>]+>", " ", body)))
    return [m.group(0).strip() for m in
            re.finditer(r"`{3}\{[\w:-]+\}|:{3}\{[\w:-]+\}"     # a directive not parsed
                        r"|(?:\w+ )?`[^`]{1,40}`(?: \(\d+\))?(?:, `[^`]{1,40}`(?: \(\d+\))?)*"
                        r"|\*\*\w[^*]{0,40}\*\*", text)]


def test_raw_markdown_is_found():
    assert raw_markdown("<main><p>the variants `lstsq` (2) and **bold**</p></main>") == \
        ["variants `lstsq` (2)", "**bold**"]
    assert raw_markdown("<main><p>the <code>lstsq</code> fit, 2 ** 3</p><pre>`x`</pre></main>") == []
    # a fence whose info string holds a backtick is no directive (CommonMark)
    assert raw_markdown("<main><p>```{table} A <code>x</code> caption</p></main>") == ["```{table}"]


@pytest.mark.parametrize("doc", _toc_files())
def test_no_raw_markdown(book, doc):
    "No backticks or ** shown as text: what a glued string says is rendered or plain."
    path, _ = _page(doc)
    _against_known("raw-markdown", doc, raw_markdown(path.read_text()))


# words about how the book was made, not about what it shows
MAKING_OF = [r"PAPER\.md", r"MODELS\.md", r"\bthe issue\b", r"third-party summar",
             r"could not be consulted", r"not in the available text", r"no number found",
             r"No machine that builds this book", r"earlier version of this chapter",
             r"Both were dropped", r"for old imports", r"\(goal: ", r"\b(?:\d|two|four)-core machine",
             r"\bits older name\b",
             r"while other jobs shared", r"\btook \d[\d.,–-]* ?(?:s|seconds|minutes?)\b",
             r"\bthe (?:target|goal) (?:is|was) (?:a |an )?(?:ratio|speedup|time)"]


@pytest.mark.parametrize("doc", _toc_files())
def test_no_making_of_phrases(book, doc):
    _, p = _page(doc)
    text = re.sub(r"\s+", " ", " ".join(p.text))
    found = [m.group(0) for pat in MAKING_OF for m in re.finditer(pat, text, re.I)]
    _against_known("making-of", doc, found)


# a number glued into prose with the wrong grammatical number, a "(s)" that a
# formatting helper should have decided, or a noun the template repeats
PLURAL = re.compile(
    r"(?<![\d.,\w])1 (?:times|minutes|seconds|hours|points|seeds|tasks|layers|blocks|tokens"
    r"|examples|runs|heads|steps|passes|threads|cores|models|samples|queries|prompts"
    r"|families|experts|rows|columns|digits|bits)\b|\d+ (?:[A-Za-z]+ )?[a-z]+\(s\)|"
    r"\b(\w+s) (?:on|of|over) \d+ \w+ \1\b")


@pytest.mark.parametrize("doc", _toc_files())
def test_glued_numbers_read(book, doc):
    "No '1 times', '1 minutes', 'thread(s)' or 'seeds on 9 tasks seeds'."
    _, p = _page(doc)
    text = re.sub(r"\s+", " ", " ".join(p.text))
    _against_known("glued-plural", doc, [m.group(0) for m in PLURAL.finditer(text)])


def equation_problems(doc: str, raw: str, text: str) -> list:
    """The book numbers its own equations by chapter, (2.1), (2.2), and names
    the paper's as the paper's ("the paper's Eq. (8)"), so that the two
    numberings cannot be confused. Returns what breaks that on page `doc`:
    a \\tag without the chapter's number, and an "Eq. (n)" in the prose
    without "paper" or the paper's authors within a few words of it."""
    m = re.match(r"(\d+)([a-z]*)_", Path(doc).name)
    chapter = f"{int(m.group(1))}{m.group(2)}" if m else None
    bad = [f"\\tag{{{t}}}" for t in re.findall(r"\\tag\{([^}]*)\}", _h.unescape(raw))
           if not (chapter and re.fullmatch(rf"{re.escape(chapter)}\.\d+", t))]
    for e in re.finditer(r"\bEq(?:uation)?s?\.?\s*\(\d+\)", text):
        near = text[max(0, e.start() - 40):e.end() + 40]
        if not re.search(r"paper|Dherin", near):
            bad.append(near.strip())
    return bad


def test_equation_numbers_tell_book_from_paper():
    "The check fails on a page that numbers like the paper or cites a bare Eq. (n)."
    assert equation_problems("nbs/02_patch", r"$$a \tag{2}$$", "") == [r"\tag{2}"]
    assert equation_problems("nbs/05_x", r"$$a \tag{5.1}$$", "") == []
    assert equation_problems("nbs/02_patch", r"$$a \tag{2.1}$$", "as in (2.1)") == []
    assert equation_problems("nbs/notation", r"$$a \tag{1.1}$$", "") == [r"\tag{1.1}"]
    assert len(equation_problems("nbs/07_x", "", "the patch of Eq. (8) alone")) == 1
    assert equation_problems("nbs/07_x", "", "the patch of the paper's Eq. (8) alone") == []


@pytest.mark.parametrize("doc", _toc_files())
def test_equation_numbers_are_the_books(book, doc):
    "Book equations carry the chapter's number; the paper's are named as the paper's."
    path, p = _page(doc)
    text = re.sub(r"\s+", " ", " ".join(p.text))
    bad = equation_problems(doc, path.read_text(), text)
    assert not bad, f"{doc}: equation numbers the reader could take for the paper's: {bad}"


def _definitions():
    "name -> the pages whose code defines it (def, class or a top-level name =)."
    out = {}
    for doc in _toc_files():
        path = HTML / f"{doc}.html"
        if not path.exists(): continue
        _, c = _code(doc)
        for code in c.pre:
            for m in re.finditer(r"^(?:def|class)\s+([A-Za-z_]\w*)|^([A-Za-z_]\w*)\s*=(?!=)",
                                 _h.unescape(code), re.M):
                out.setdefault(m.group(1) or m.group(2), set()).add(doc)
    return out


DOC_LINK = re.compile(
    r'<code class="docutils literal notranslate">(.*?)</code>\s*(?:\(|of |in |from |by )?\s*'
    r'<a class="reference internal" href="([^"#]+)\.html[^"]*"')


@pytest.mark.parametrize("doc", _toc_files())
def test_doc_links_name_their_target(book, doc):
    """A code name followed by a link to a chapter ("`f` of {doc}`X`") is
    defined in that chapter, when the book defines it somewhere."""
    if not hasattr(test_doc_links_name_their_target, "defs"):
        test_doc_links_name_their_target.defs = _definitions()
    defs = test_doc_links_name_their_target.defs
    path, _ = _page(doc)
    found = []
    for code, href in DOC_LINK.findall(path.read_text()):
        name = re.match(r"[A-Za-z_]\w*", _h.unescape(re.sub(r"<[^>]+>", "", code)))
        if not name or name.group(0) not in defs: continue
        target = str(Path(doc).parent / href).replace("\\", "/")
        where = defs[name.group(0)]
        if target not in where and doc not in where:
            found.append(f"{name.group(0)} -> {Path(target).name} "
                         f"(defined in {', '.join(sorted(Path(w).name for w in where))})")
    _against_known("wrong-doc-link", doc, found)


@pytest.mark.parametrize("doc", _toc_files())
def test_numrefs_name_their_target(book, doc):
    "A {numref} says Fig./Table/Eq. as its target's own number does."
    path, _ = _page(doc)
    raw = path.read_text()
    bad = []
    for href, text in re.findall(r'<a class="reference internal" href="([^"]*#[^"]+)">'
                                 r'<span class="std std-numref">(.*?)</span>', raw, re.S):
        page, anchor = href.split("#")
        tgt = (path.parent / page) if page else path
        if not tgt.exists(): continue
        m = re.search(rf'id="{re.escape(anchor)}".*?caption-number">(\w+)', tgt.read_text(), re.S)
        word = re.sub(r"<[^>]+>", "", text).split()[0].rstrip(".")
        if m and not m.group(1).startswith(word[:3]):
            bad.append(f"{text} -> {m.group(1)}")
    assert not bad, f"{doc}: numref text names another kind of target: {bad}"


# --- notation: every symbol of the book's maths, and the notation page's rule

import notation_table  # noqa: E402  (tools/notation_table.py)

# symbols the chapters use that the notation page does not list yet, and
# symbols the notation page lists in two rows (two meanings); both must shrink
KNOWN_UNLISTED: set = set()   # empty: a symbol used and not listed fails
KNOWN_DOUBLE: set = set()   # empty: a symbol in two rows of the notation page fails


def test_notation_page_lists_every_symbol(book):
    "Every symbol of the book's maths is on the notation page (table: test-artifacts)."
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "notation_table.md").write_text(notation_table.table() + "\n")
    used = notation_table.usage()
    have = notation_table.listed()
    missing = {s: d for s, d in used.items() if s not in have and s not in KNOWN_UNLISTED}
    assert not missing, ("symbols used but not on the notation page "
                         f"(python tools/notation_table.py): {missing}")
    stale = sorted(KNOWN_UNLISTED & have | KNOWN_UNLISTED - set(used))
    assert not stale, f"listed or unused now, remove from KNOWN_UNLISTED: {stale}"


def test_notation_page_one_meaning_per_symbol(book):
    double = notation_table.double_meanings()
    new = {s: m for s, m in double.items() if s not in KNOWN_DOUBLE}
    assert not new, f"a symbol in two rows of the notation page: {new}"
    assert not KNOWN_DOUBLE - set(double), \
        f"fixed, remove from KNOWN_DOUBLE: {sorted(KNOWN_DOUBLE - set(double))}"


@needs_chromium
def test_explorer_readable_in_dark_mode(book):
    "The explorer's labels and its line of numbers stand out from a dark page."
    r = page_metrics.contrast(EXPLORER, ".widget-vbox .widget-label, .widget-vbox .widget-html, "
                              ".widget-vbox .widget-readout, .widget-vbox label, "
                              ".widget-vbox button, .widget-vbox select", dark=True)
    assert r, "no widget text found on the explorer page"
    low = [x for x in r if x["ratio"] < 4.5]
    assert not low, f"text with a contrast below 4.5:1 in dark mode: {low[:5]}"

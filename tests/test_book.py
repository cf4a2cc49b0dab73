"""The book builds with warnings as errors, and its HTML is what a reader needs.

The build executes every notebook (`raise_on_error: true`); the checks read
the HTML it wrote, and, where headless Chromium is installed, the page as a
browser renders it: typeset math, images, no raw LaTeX delimiters.
"""
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
    assert not re.search(r"\{glue:|\{cite:|\{numref", text), f"{doc}: unresolved role"
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
    path, p = _page(doc)
    raw = path.read_text()
    dom = _browse(path.as_uri(), "--dump-dom").stdout
    assert "<body" in dom, f"{doc}: Chromium returned no DOM"
    if 'class="math' in raw:
        assert "<mjx-container" in dom, f"{doc}: math present but not typeset by MathJax"
        assert "<mjx-merror" not in dom, f"{doc}: MathJax reported a TeX error"
    if doc.endswith(("02_token_patch", "01_contextual_blocks", "reproduction")):
        ARTIFACTS.mkdir(exist_ok=True)
        shot = ARTIFACTS / f"{Path(doc).name}.png"
        _browse(path.as_uri(), f"--screenshot={shot}")
        assert shot.exists() and shot.stat().st_size > 10_000


EXPLORER = "nbs/13_explorer"

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
    page_metrics.screenshot(EXPLORER, 1400, str(ARTIFACTS / "13_explorer.png"), height=2000)


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
def test_no_words_about_how_the_book_was_made(book, doc):
    path, p = _page(doc)
    text = " ".join(p.text)
    assert "binder-examples" not in path.read_text(), \
        f"{doc}: Thebe names a placeholder repository (set thebe_config in _config.yml)"
    for phrase in ("PAPER.md", "the issue"):
        assert phrase.lower() not in text.lower(), f"{doc}: the page says {phrase!r}"


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


@pytest.mark.parametrize("doc", _toc_files())
def test_glued_tables_are_tables(book, doc):
    "A figure that holds a table is numbered and captioned as a table."
    path, _ = _page(doc)
    raw = path.read_text()
    for fig in re.findall(r"<figure\b.*?</figure>", raw, re.S):
        if "<table" in fig:
            assert "glued-table" in fig and re.search(r'caption-number">Table \d', fig), \
                f"{doc}: a table is captioned as a figure: {re.sub('<[^>]+>', '', fig)[:120]!r}"


@needs_chromium
@pytest.mark.parametrize("doc", _toc_files())
def test_nothing_clipped_on_a_phone(book, doc):
    "At 390 px, display math, code, tables and images fit their box or scroll inside it."
    m = page_metrics.measure(doc, 390)
    assert not m["wide"], f"{doc}: wider than the page at 390 px, not scrollable: {m['wide'][:3]}"


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
    r = page_metrics.probe("nbs/06_context_vs_patch", js, width=390, wait_ms=2000)
    assert r.get("opened") and r["closed"], r
    assert r["shown"] >= min(r["natural"], 390) - 2, f"the figure is not shown at full size: {r}"

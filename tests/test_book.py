"""The book builds with warnings as errors, and its HTML is what a reader needs.

The build executes every notebook (`raise_on_error: true`); the checks read
the HTML it wrote, and, where headless Chromium is installed, the page as a
browser renders it: typeset math, images, no raw LaTeX delimiters.
"""
import os
import re
import shutil
import subprocess
import tempfile
from html.parser import HTMLParser
from pathlib import Path

import pytest

from conftest import ROOT, toc_files as _toc_files

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
    return (os.environ.get("CHROMIUM") or shutil.which("chromium")
            or shutil.which("chromium-browser") or shutil.which("google-chrome"))


def _browse(url, *extra):
    with tempfile.TemporaryDirectory() as prof:
        cmd = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
               "--disable-background-networking", "--disable-component-update",
               "--disable-sync", "--no-first-run", f"--user-data-dir={prof}",
               "--window-size=1280,1000", "--virtual-time-budget=10000", *extra, url]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


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


def _widget_outputs(html):
    "The cell outputs that hold a widget view (its script and what renders it)."
    views = re.findall(r'<div class="cell_output[^"]*">(.*?'
                       r'application/vnd\.jupyter\.widget-view\+json.*?</script>)',
                       html, re.S)
    return [v[v.rfind('<div class="cell_output'):] for v in views]


def test_explorer_page_embeds_widget_state(book):
    "The build recorded the explorer's widget state and a view of it."
    path, _ = _page(EXPLORER)
    raw = path.read_text()
    assert 'type="application/vnd.jupyter.widget-state+json"' in raw, \
        "no widget state recorded: the static page cannot render the explorer"
    assert 'type="application/vnd.jupyter.widget-view+json"' in raw
    assert "embed-amd.js" in raw, "the page loads no ipywidgets HTML manager"
    for model in ("VBoxModel", "DropdownModel", "IntSliderModel", "OutputModel"):
        assert f'"{model}"' in raw, f"widget state lacks a {model}"
    assert '"image/png"' in raw, "the explorer's Output holds no figure"


@pytest.mark.skipif(_chromium() is None, reason="headless Chromium not installed "
                    "(`make browser` or `apt-get install chromium`)")
def test_explorer_widgets_rendered_in_browser(book):
    "The vendored html-manager turns the recorded state into live widget views."
    path, _ = _page(EXPLORER)
    dom = _browse(path.as_uri(), "--dump-dom").stdout
    assert "<body" in dom, "Chromium returned no DOM"
    views = _widget_outputs(dom)
    assert views, "no widget-view script in the rendered page"
    out = views[0]
    assert 'class="widget-subarea"' in out, \
        "the html-manager rendered nothing next to the widget-view script"
    for cls in ("lm-Widget", "jupyter-widgets", "widget-vbox", "widget-dropdown",
                "widget-slider", "widget-html", "widget-output", "jp-RenderedImage"):
        assert cls in out, f"rendered explorer lacks an element of class {cls}"
    assert out.count("widget-dropdown") >= 2 and out.count("widget-slider") >= 3
    assert 'src="data:image/png;base64,' in out, "the Output's figure is not shown"
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "13_explorer.png"
    _browse(path.as_uri(), f"--screenshot={shot}")
    assert shot.exists() and shot.stat().st_size > 10_000

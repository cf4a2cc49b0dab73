"""Measure built book pages as headless Chromium lays them out.

    python tools/page_metrics.py nbs/01_blocks [--width 1400] [--shot out.png]

prints one JSON line per page: its height in px at that width and the
elements that are wider than their box without scrolling (display math,
code, tables, images). A copy of the page with a small probe script is
written next to it (so every relative link still resolves), loaded, and
removed; the probe writes its findings into the DOM that Chromium dumps.
"""
import argparse, json, os, re, shutil, subprocess, sys, tempfile
from pathlib import Path

HTML = Path(__file__).resolve().parents[1] / "_build" / "html"

MEASURE = r"""
  const wide = [];
  const sel = 'div.math, mjx-container[display="true"], div.highlight pre, table, img';
  const main = document.querySelector('main, article, .bd-article') || document.body;
  const m = main.getBoundingClientRect();
  for (const el of document.querySelectorAll(sel)) {
    if (!el.offsetParent) continue;                                // not displayed
    const r = el.getBoundingClientRect();
    if (r.width === 0) continue;
    let scrolls = false;                                           // a box that scrolls it
    for (let p = el; p && p !== document.body; p = p.parentElement) {
      if (/(auto|scroll)/.test(getComputedStyle(p).overflowX) && p.scrollWidth > p.clientWidth + 1) { scrolls = true; break; }
    }
    if (scrolls) continue;
    let box = el.parentElement, clip = false;                      // content cut off by a clipping box
    for (let p = el.parentElement; p && p !== document.body; p = p.parentElement) {
      const b = p.getBoundingClientRect();
      if (getComputedStyle(p).overflowX === 'hidden' && (r.right > b.right + 1 || r.left < b.left - 1)) { clip = true; box = p; break; }
    }
    if (clip || r.left < m.left - 1 || r.right > m.right + 1) {
      wide.push({tag: el.tagName.toLowerCase(), cls: String(el.className && el.className.baseVal !== undefined ? el.className.baseVal : el.className),
                 left: Math.round(r.left), right: Math.round(r.right), box: [Math.round(m.left), Math.round(m.right)],
                 clipped: clip, text: (el.textContent || '').trim().slice(0, 60)});
    }
  }
  const over = [...document.querySelectorAll('.bd-article *')].filter(e => e.offsetParent && e.getBoundingClientRect().right > innerWidth + 1
      && ![...(function* () { for (let p = e.parentElement; p; p = p.parentElement) yield p; })()].some(p => /(auto|scroll|hidden)/.test(getComputedStyle(p).overflowX)))
    .slice(0, 3).map(e => e.tagName.toLowerCase() + ': ' + (e.textContent || '').trim().slice(0, 50));
  report({height: document.documentElement.scrollHeight, width: innerWidth, wide: wide,
          page_width: document.documentElement.scrollWidth, beyond: over});
"""


# What a reader of the typeset page would see wrong, in one pass (1400 px):
# tables wider than the article's column (cut off or scrolled out of view),
# display formulas wider than it (scrolled, the rest out of view),
# formulas MathJax could not typeset (an error, or an undefined macro that
# it shows in red), and TeX source left in the text outside any formula.
CHECKS = r"""
  const art = document.querySelector('.bd-article') || document.body;
  const cs = getComputedStyle(art);
  const col = art.clientWidth - parseFloat(cs.paddingLeft) - parseFloat(cs.paddingRight);
  const label = t => {
    const f = t.closest('figure'), n = f && f.querySelector('.caption-number');
    const h = [...t.querySelectorAll('th')].map(x => x.textContent.trim()).filter(Boolean).slice(0, 3).join(' | ');
    return (n ? n.textContent.trim().replace(/\s+$/, '') + ': ' : '') + h.slice(0, 60);
  };
  const tables = [];
  for (const t of art.querySelectorAll('table')) {
    if (!t.offsetParent || t.closest('.widget-vbox, .jupyter-widgets')) continue;
    const w = Math.max(t.getBoundingClientRect().width, t.scrollWidth);
    if (w > col + 1) tables.push({table: label(t), width: Math.round(w), column: Math.round(col)});
  }
  // display formulas wider than the column: the theme scrolls them in a box
  // whose scrollbar is hidden, so the reader sees the formula cut off
  const wideMath = [];
  for (const c of art.querySelectorAll('mjx-container[display="true"]')) {
    if (!c.offsetParent) continue;
    const inner = c.firstElementChild, w = Math.max(c.scrollWidth, inner ? inner.getBoundingClientRect().width : 0);
    if (w > Math.min(col, c.clientWidth) + 1) {
      const mml = c.querySelector('mjx-assistive-mml');
      wideMath.push((mml ? mml.textContent : c.textContent).trim().replace(/\s+/g, ' ').slice(0, 60));
    }
  }
  // words of a table cell broken across lines (a row name cut as 'patt/ern',
  // a number as '1.3e-/07'); a break may fall at a space, or after a hyphen
  // or dash that a letter follows (pre-/norm); code names may wrap anywhere
  const broken = [];
  for (const cell of art.querySelectorAll('table th, table td')) {
    if (!cell.offsetParent || cell.closest('.widget-vbox, .jupyter-widgets')) continue;
    const tw = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
    for (let n = tw.nextNode(); n; n = tw.nextNode()) {
      if (n.parentElement.closest('code, .pre, mjx-container, .MathJax')) continue;
      const word = /(?:[^\s\-–]|[\-–](?![A-Za-z]))+[\-–]?/g;
      for (let m = word.exec(n.textContent); m; m = word.exec(n.textContent)) {
        if (m[0].replace(/[^A-Za-z0-9]/g, '').length < 3) continue;
        const r = document.createRange(); r.setStart(n, m.index); r.setEnd(n, m.index + m[0].length);
        const lines = new Set([...r.getClientRects()].filter(x => x.width > 0).map(x => Math.round(x.top)));
        if (lines.size > 1) broken.push(m[0].slice(0, 40));
      }
    }
  }
  // printed output lines longer than the column: their box scrolls with a
  // hidden scrollbar, and the end of the line is out of view
  const wideOut = [];
  for (const p of art.querySelectorAll('.cell_output pre, .output pre')) {
    if (!p.offsetParent || p.scrollWidth <= p.clientWidth + 2) continue;
    const lines = p.textContent.split('\n');
    const long = lines.reduce((a, l) => (l.length > a.length ? l : a), '');
    wideOut.push(long.trim().slice(0, 50));
  }
  const math = [];
  for (const c of document.querySelectorAll('mjx-container')) {
    const red = c.querySelector('mjx-merror, [style*="color: red"], [mathcolor="red"]');
    if (red) {
      const mml = c.querySelector('mjx-assistive-mml');
      const bad = [...c.querySelectorAll('[mathcolor="red"], merror')].map(e => e.textContent.trim());
      math.push((bad.join(' ') || 'error') + ' in: ' + (mml ? mml.textContent : c.textContent).trim().slice(0, 60));
    }
  }
  // (docstrings on the API page are plain text that writes x_{i+1} on purpose)
  const tex = [], skip = 'mjx-container, pre, code, script, style, .highlight, .MathJax, mjx-assistive-mml, .math, dl.py';
  const walker = document.createTreeWalker(art, NodeFilter.SHOW_TEXT);
  const re = /\\[A-Za-z]{2,}|\$|\\\(|\\\[|[_^]\{/;
  for (let n = walker.nextNode(); n; n = walker.nextNode()) {
    const p = n.parentElement;
    if (!p || p.closest(skip) || !p.offsetParent) continue;
    const m = n.textContent.match(re);
    if (m) { const i = n.textContent.indexOf(m[0]);
             tex.push(n.textContent.slice(Math.max(0, i - 30), i + 30).replace(/\s+/g, ' ').trim()); }
  }
  report({tables, math, tex, wide_math: wideMath, broken: [...new Set(broken)], wide_output: wideOut, column: Math.round(col),
          typeset: document.querySelectorAll('mjx-container').length,
          sources: art.querySelectorAll('.math').length});
"""


CONTRAST = r"""
  const lum = c => { const v = c.match(/[\d.]+/g).slice(0, 3).map(x => x / 255)
      .map(x => x <= 0.03928 ? x / 12.92 : ((x + 0.055) / 1.055) ** 2.4);
    return 0.2126 * v[0] + 0.7152 * v[1] + 0.0722 * v[2]; };
  const bg = e => { for (let p = e; p; p = p.parentElement) { const c = getComputedStyle(p).backgroundColor;
      const a = c.match(/[\d.]+/g); if (a && (a.length < 4 || +a[3] > 0.5)) return c; }
    return 'rgb(255, 255, 255)'; };
  const out = [];
  for (const e of document.querySelectorAll(SELECTOR)) {
    if (!e.offsetParent || !e.textContent.trim()) continue;
    const a = lum(getComputedStyle(e).color), b = lum(bg(e));
    out.push({text: e.textContent.trim().slice(0, 40), ratio: (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05)});
  }
  report(out);
"""


def contrast(doc, selector, width=1400, dark=False):
    "Contrast ratio (WCAG) of the text of every visible `selector` element."
    return probe(doc, CONTRAST.replace("SELECTOR", repr(selector)), width,
                 wait_ms=4000, dark=dark)


def checks(doc, width=1400):
    "Tables wider than the column, MathJax errors and raw TeX of page `doc`."
    return probe(doc, CHECKS, width, wait_ms=2500)


def chromium():
    return (os.environ.get("CHROMIUM") or shutil.which("chromium")
            or shutil.which("chromium-browser") or shutil.which("google-chrome"))


def browse(url, width, *extra, height=1000):
    with tempfile.TemporaryDirectory() as prof:
        cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu",
               "--disable-background-networking", "--no-first-run", "--hide-scrollbars",
               f"--user-data-dir={prof}", f"--window-size={width},{height}",
               *([] if any(e.startswith("--virtual-time-budget") for e in extra)
                 else ["--virtual-time-budget=15000"]), *extra, url]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=180)


FRAME = """<!doctype html><html><body style="margin:0">
<iframe src="{src}" style="border:0;width:{w}px;height:{h}px"></iframe>
<script>addEventListener('message', e => {{
  const p = document.createElement('pre'); p.id = '__metrics__'; p.textContent = e.data;
  document.body.appendChild(p); }});</script></body></html>"""


def _framed(page, src, width, height):
    "A page next to `page` that shows `src` in an iframe `width` px wide."
    f = page.with_name(f"_frame_{page.name}")
    f.write_text(FRAME.format(src=src.name, w=width, h=height))
    return f


def _dark(html: str) -> str:
    "The page in the theme's dark mode (the theme reads it from localStorage)."
    force = ("<script>localStorage.setItem('mode', 'dark');"
             "localStorage.setItem('theme', 'dark');</script>")
    return html.replace("<head>", "<head>" + force, 1)


def probe(doc, js, width=1400, wait_ms=4000, dark=False):
    """Run `js` in built page `doc` after it loaded (and `wait_ms` more);
    the script calls `report(value)` once; returns that value (JSON).
    The page is copied next to itself with the script added (so relative
    links resolve) and shown in an iframe `width` px wide."""
    page = HTML / f"{doc}.html"
    if not page.exists():
        raise FileNotFoundError(f"{page} not built: run `make book` first")
    script = ("<script>function report(v) { const p = document.createElement('pre');"
              " p.id = '__metrics__'; p.textContent = JSON.stringify(v);"
              " document.body.appendChild(p);"
              " if (window.parent !== window) window.parent.postMessage(JSON.stringify(v), '*'); }"
              f"window.addEventListener('load', () => setTimeout(async () => {{ {js} }}, {wait_ms}));"
              "</script>")
    html = page.read_text()
    tmp = page.with_name(f"_js_{page.name}")
    tmp.write_text((_dark(html) if dark else html).replace("</body>", script + "</body>"))
    frame = _framed(page, tmp, width, 1000)       # Chromium's window is >= 500 px
    try:
        dom = browse(frame.as_uri(), max(width, 500), "--dump-dom").stdout
    finally:
        tmp.unlink(); frame.unlink()
    m = re.search(r'<pre id="__metrics__">(.*?)</pre>', dom, re.S)
    if not m:
        raise RuntimeError(f"{doc}: the probe reported nothing (page failed to load?)")
    import html as _h
    return json.loads(_h.unescape(m.group(1)))


BATCH = """<!doctype html><html><body style="margin:0">{frames}
<script>const got = {{}};
addEventListener('message', e => {{ const m = JSON.parse(e.data); got[m.doc] = m.value;
  let p = document.getElementById('__metrics__');
  if (!p) {{ p = document.createElement('pre'); p.id = '__metrics__'; document.body.appendChild(p); }}
  p.textContent = JSON.stringify(got); }});</script></body></html>"""


def probe_many(docs, js, width=1400, wait_ms=4000, batch=12):
    """`probe` for many pages, `batch` of them in one Chromium: each page runs
    in its own iframe `width` px wide and posts {doc, value} to the frame page.
    Returns {doc: value}; a page that reported nothing raises RuntimeError."""
    import html as _h
    out = {}
    for i in range(0, len(docs), batch):
        part, made = docs[i:i + batch], []
        try:
            frames = []
            for k, doc in enumerate(part):
                page = HTML / f"{doc}.html"
                if not page.exists():
                    raise FileNotFoundError(f"{page} not built: run `make book` first")
                script = ("<script>function report(v) { window.parent.postMessage("
                          f"JSON.stringify({{doc: {json.dumps(doc)}, value: v}}), '*'); }}"
                          f"window.addEventListener('load', () => setTimeout(async () => {{ {js} }}, {wait_ms}));"
                          "</script>")
                tmp = page.with_name(f"_js{k}_{page.name}")
                tmp.write_text(page.read_text().replace("</body>", script + "</body>"))
                made.append(tmp)
                rel = os.path.relpath(tmp, HTML)
                frames.append(f'<iframe src="{rel}" style="border:0;display:block;'
                              f'width:{width}px;height:1000px"></iframe>')
            frame = HTML / f"_batch_{i}.html"
            frame.write_text(BATCH.format(frames="\n".join(frames)))
            made.append(frame)
            dom = browse(frame.as_uri(), max(width, 500), "--dump-dom",
                         f"--virtual-time-budget={15000 + 1500 * len(part)}").stdout
        finally:
            for f in made: f.unlink(missing_ok=True)
        m = re.search(r'<pre id="__metrics__">(.*?)</pre>', dom, re.S)
        got = json.loads(_h.unescape(m.group(1))) if m else {}
        missing = [d for d in part if d not in got]
        if missing:
            raise RuntimeError(f"{missing}: the probe reported nothing (page failed to load?)")
        out.update(got)
    return out


def checks_many(docs, width=1400):
    "`checks` for many pages at once: {doc: result}."
    return probe_many(docs, CHECKS, width, wait_ms=2500)


def measure_many(docs, width=1400):
    "`measure` for many pages at once: {doc: result}."
    return probe_many(docs, MEASURE, width, wait_ms=2500)


def measure(doc, width=1400, dark=False):
    "Height and unscrolled overflows of built page `doc` at `width` px."
    return probe(doc, MEASURE, width, wait_ms=2500, dark=dark)


def screenshot(doc, width, shot, dark=False, height=None):
    "Full-page screenshot of `doc` at `width` px (height: the page's own)."
    h = height or min(measure(doc, width)["height"], 16000)
    page = HTML / f"{doc}.html"
    src = page.with_name(f"_shot_{page.name}")
    html = page.read_text()
    src.write_text(_dark(html) if dark else html)
    frame = _framed(page, src, width, h)
    try:
        browse(frame.as_uri(), max(width, 500), f"--screenshot={shot}", height=h)
    finally:
        src.unlink(); frame.unlink()
    return h


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("docs", nargs="+")
    ap.add_argument("--width", type=int, default=1400)
    ap.add_argument("--dark", action="store_true")
    ap.add_argument("--shot", help="folder for full-page screenshots")
    a = ap.parse_args()
    for d in a.docs:
        m = measure(d, a.width, a.dark)
        if a.shot:
            Path(a.shot).mkdir(parents=True, exist_ok=True)
            screenshot(d, a.width, str(Path(a.shot) / f"{Path(d).name}_{a.width}{'_dark' if a.dark else ''}.png"),
                       a.dark, height=min(m["height"], 16000))
        print(json.dumps({"doc": d, "width": a.width, "height": m["height"],
                          "wide": m["wide"][:5], "n_wide": len(m["wide"])}))

"""Every symbol the book's maths uses, from the built pages, and where.

    python tools/notation_table.py [--md out.md]

reads the TeX of every formula of the built HTML book (`_build/html/nbs`),
splits it into symbols (a letter or Greek letter with its decorations:
`\\Delta W`, `\\hat w`, `W'`, `\\mathbf A`), and prints one row per symbol with
the pages that use it and whether the notation page lists it.  It also finds
the symbols the notation page lists in more than one row (one symbol, two
meanings).  `tests/test_book.py` turns both lists into checks.
"""
import argparse
import html as _html
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HTML = ROOT / "_build" / "html"
NOTATION = "nbs/notation"

# TeX that is structure, not a symbol: operators, spacing, delimiters, fonts
_STRUCT = set("""
frac dfrac tfrac sum prod int lim max min sup inf arg argmin argmax log
exp ln sqrt left right big Big bigg Bigg bigl bigr Bigl Bigr biggl biggr
lVert rVert lvert rvert Vert vert langle rangle lceil rceil lfloor
rfloor cdot cdots ldots dots vdots ddots times div pm mp circ odot
otimes oplus star ast le leq ge geq ne neq approx sim simeq equiv propto
ll gg to mapsto rightarrow leftarrow Rightarrow Leftarrow iff implies
gets uparrow downarrow longrightarrow in notin subset subseteq supset
supseteq cup cap setminus emptyset varnothing forall exists neg land lor
wedge vee top intercal dagger prime partial nabla infty quad qquad text
mathrm operatorname mathbb mathcal mathbf mathit mathsf mathtt
boldsymbol bm textbf textit emph hat tilde bar widehat widetilde
overline underline vec dot ddot check breve acute grave mathring
overbrace underbrace begin end label tag nonumber notag displaystyle
textstyle scriptstyle limits nolimits mid colon ldotp cdotp not tr det
rank diag span ker dim big| mathop mathrel mathbin stackrel overset
underset substack color hspace vspace phantom hphantom vphantom mkern
kern mskip mbox hbox sin cos tan sinh cosh tanh sign sgn mod bmod pmod
gcd Pr Var Cov lbrace rbrace lbrack rbrack backslash vdash models perp
parallel triangleq coloneqq eqqcolon quad enspace thinspace negthinspace
cases aligned align split matrix pmatrix bmatrix vmatrix array
""".split())
_GREEK = set("""
alpha beta gamma delta epsilon varepsilon zeta eta theta vartheta iota
kappa lambda mu nu xi pi varpi rho varrho sigma varsigma tau upsilon phi
varphi chi psi omega Gamma Delta Theta Lambda Xi Pi Sigma Upsilon Phi
Psi Omega ell
""".split())
_DECOR = {"hat", "tilde", "bar", "widehat", "widetilde", "overline", "vec",
          "mathbf", "boldsymbol", "bm", "mathcal", "dot"}
_NAMES = {"text", "mathrm", "operatorname", "textbf", "textit", "mathit",
          "mathsf", "mathtt", "texttt", "mbox", "hbox", "label", "tag",
          "begin", "end", "color", "hspace", "vspace", "mathbb"}

_MATH = re.compile(
    r'<(span|div) class="math[^"]*">(.*?)</\1>', re.S)


def page_tex(path: Path) -> list:
    "The TeX source of every formula on one built page."
    out = []
    for _, body in _MATH.findall(path.read_text()):
        tex = _html.unescape(re.sub(r"<[^>]+>", "", body)).strip()
        tex = re.sub(r"^\\[(\[]|\\[)\]]$", "", tex).strip()
        out.append(tex)
    return out


def _skip_group(tex: str, i: int) -> int:
    "Index after the brace group (or single token) starting at tex[i]."
    while i < len(tex) and tex[i] == " ": i += 1
    if i < len(tex) and tex[i] == "{":
        depth = 0
        for j in range(i, len(tex)):
            depth += {"{": 1, "}": -1}.get(tex[j], 0)
            if depth == 0: return j + 1
        return len(tex)
    m = re.match(r"\\[A-Za-z]+|.", tex[i:])
    return i + (len(m.group(0)) if m else 1)


def symbols(tex: str) -> list:
    """The symbols of one formula: base letters with their decorations,
    subscripts and superscripts dropped (`\\Delta W_i` -> `\\Delta W`)."""
    out, i, pending = [], 0, []
    while i < len(tex):
        c = tex[i]
        if c in "_^":                          # an index: skip its group
            i = _skip_group(tex, i + 1); continue
        if c == "\\":
            m = re.match(r"\\([A-Za-z]+)", tex[i:])
            if not m:
                i += 2; continue
            name = m.group(1); i += len(m.group(0))
            if name in _NAMES:                 # a word or a set, not a symbol
                i = _skip_group(tex, i); continue
            if name in _DECOR:
                pending.append("\\" + name); continue
            if name == "Delta" and re.match(r"\s*\\?[A-Za-z]", tex[i:]) \
                    and not re.match(r"\s*_", tex[i:]):
                pending.append("\\Delta"); continue   # an increment: ΔW
            if name in _GREEK:
                out.append(" ".join(pending + ["\\" + name])); pending = []
            else:
                pending = []
            continue
        if c.isalpha():
            out.append(" ".join(pending + [c])); pending = []
            i += 1; continue                   # a prime (x') is x again
        if c not in " {":
            pending = []
        i += 1
    return out


def usage(html=HTML) -> dict:
    "symbol -> sorted list of the pages (doc names) whose maths uses it."
    use = defaultdict(set)
    for path in sorted((html / "nbs").glob("*.html")):
        if path.name.startswith("_"): continue
        doc = f"nbs/{path.stem}"
        for tex in page_tex(path):
            for s in symbols(tex):
                use[s].add(doc)
    return {s: sorted(d) for s, d in use.items()}


def _index_form(tex: str) -> list:
    """The symbols of a notation-table cell with their indices, index letters
    made generic (`a_k`, `a_i` -> `a_•`), so two rows naming one are
    found."""
    out = []
    for part in _top_level(tex):
        part = part.split("=")[0].strip()
        m = re.match(r"((?:\\(?:Delta|hat|tilde|bar|mathbf)\s*)*"
                     r"(?:\\[A-Za-z]+|[A-Za-z])'*)\s*(?:_(\{[^}]*\}|\\?\w+))?",
                     part)
        if not m or not m.group(1): continue
        base = re.sub(r"\s+", " ", m.group(1))
        if base.lstrip("\\") in _STRUCT - _DECOR - {"Delta"}: continue
        sub = (m.group(2) or "").strip("{}")
        if re.fullmatch(r"[ijklt]|\\ell|[ijkt]\+1|[ijkt]-1", sub):
            sub = "•"
        rest = re.sub(r"\s+", "", part[m.end():])   # superscripts, arguments
        out.append(base + (f"_{sub}" if sub else "") + rest)
    return out


def _top_level(tex: str) -> list:
    "Split a cell's TeX at the commas and semicolons outside any bracket."
    parts, depth, cur = [], 0, ""
    for c in tex:
        depth += (c in "({[") - (c in ")}]")
        if c in ",;" and depth == 0:
            parts.append(cur); cur = ""
        else:
            cur += c
    return parts + [cur]


def notation_rows(html=HTML) -> list:
    "(row symbols in index form, meaning text) of the notation page's tables."
    raw = (html / f"{NOTATION}.html").read_text()
    rows = []
    for tr in re.findall(r"<tr[^>]*>(.*?)</tr>", raw, re.S):
        cells = re.findall(r"<td[^>]*>(.*?)</td>", tr, re.S)
        if len(cells) < 2: continue
        tex = " , ".join(page_tex_from(cells[0]))
        text = _html.unescape(re.sub(r"<[^>]+>", "", cells[1])).strip()
        rows.append((_index_form(tex), set(
            s for t in page_tex_from(cells[0]) for s in symbols(t)), text))
    return rows


def page_tex_from(fragment: str) -> list:
    "TeX of the formulas in an HTML fragment."
    out = []
    for _, body in _MATH.findall(fragment):
        tex = _html.unescape(re.sub(r"<[^>]+>", "", body)).strip()
        out.append(re.sub(r"^\\[(\[]|\\[)\]]$", "", tex).strip())
    return out


def listed(html=HTML) -> set:
    "Every symbol the notation page's maths contains (rows and prose)."
    return {s for t in page_tex(html / f"{NOTATION}.html") for s in symbols(t)}


def double_meanings(html=HTML) -> dict:
    "symbol (index form) -> the meanings of the notation rows that list it."
    where = defaultdict(list)
    for syms, _, text in notation_rows(html):
        for s in dict.fromkeys(syms):
            where[s].append(text[:70])
    return {s: m for s, m in where.items() if len(m) > 1}


def table(html=HTML) -> str:
    "The symbol table as Markdown: symbol, on the notation page, pages."
    have, rows = listed(html), []
    for s, docs in sorted(usage(html).items(), key=lambda kv: kv[0].lower()):
        pages = ", ".join(Path(d).name for d in docs if d != NOTATION)
        on = 'yes' if s in have else '**no**'
        rows.append(f"| ${s}$ | {on} | {pages} |")
    return "\n".join(["| symbol | on the notation page | pages |",
                      "|---|---|---|", *rows])


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--md", help="write the table to this Markdown file")
    a = ap.parse_args()
    t = table()
    if a.md: Path(a.md).write_text(t + "\n")
    else: print(t)
    for s, m in double_meanings().items():
        print(f"two meanings on the notation page: {s}: {m}")

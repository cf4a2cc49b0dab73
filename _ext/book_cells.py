"""How the book shows the notebooks: directives stripped, code collapsed, tables numbered.

The notebooks in `nbs/` are the library's source, so their code cells carry
nbdev directives (`#| export`, `#| hide`, ...) and are long.  A reader of the
book wants the derivation, the results and, on request, the code.  This local
Sphinx extension changes what the *book* shows, never the notebooks:

* every `#|` line is removed from the code a reader sees (and copies);
* a cell marked `#| hide` is removed from the page (its outputs too);
* every other code cell's input is collapsed behind myst-nb's "Show code cell
  source" toggle; its outputs stay visible.  Two kinds stay open: cells that
  only import (so the first visible cells of a chapter show what the rest
  needs) and cells tagged `show-input` (a key definition);
* a `{glue:figure}` with `:figclass: table` is numbered and captioned as a
  table ("Table N", caption above), not as a figure.

The notebook is rewritten as myst-nb reads it, before it is executed; the
stripped lines are comments, so what runs is what the notebook says.
"""
import ast

from docutils import nodes
from sphinx.transforms import SphinxTransform

KEEP = {"remove-cell", "remove-input", "hide-input", "show-input"}


def _strip(source: str) -> str:
    "The source without its nbdev `#|` directive lines."
    return "\n".join(l for l in source.splitlines() if not l.lstrip().startswith("#|"))


def _directives(source: str) -> set:
    return {l.lstrip()[2:].strip().split(":")[0].split()[0]
            for l in source.splitlines()
            if l.lstrip().startswith("#|") and l.lstrip()[2:].strip()}


def imports_only(source: str) -> bool:
    "True when `source` holds at least one statement and every one is an import."
    try:
        body = ast.parse(source).body
    except SyntaxError:                   # IPython magics etc.: treat as code
        return False
    return bool(body) and all(isinstance(s, (ast.Import, ast.ImportFrom)) for s in body)


def present(cell) -> None:
    "Rewrite one code cell (a nbformat node) the way the book shows it."
    src = cell.source
    tags = list(cell.metadata.get("tags", []))
    if "hide" in _directives(src) and "remove-cell" not in tags:
        tags.append("remove-cell")
    cell.source = _strip(src).strip("\n")
    if not cell.source.strip() and "remove-input" not in tags:
        tags.append("remove-input")      # only directives: nothing to show
    if not KEEP & set(tags) and not imports_only(cell.source):
        tags.append("hide-input")
    cell.metadata["tags"] = tags


def present_notebook(nb):
    for cell in nb.cells:
        if cell.cell_type == "code":
            present(cell)
    return nb


def _wrap_reader():
    "Patch myst-nb so every notebook is `present`ed as it is read."
    import myst_nb.sphinx_ as sx
    if getattr(sx.create_nb_reader, "_icl_book", False):
        return
    original = sx.create_nb_reader

    def create_nb_reader(path, md_config, nb_config, content):
        reader = original(path, md_config, nb_config, content)
        if reader is None or not str(path).endswith(".ipynb"):
            return reader
        read = reader.read
        reader.read = lambda text: present_notebook(read(text))
        return reader

    create_nb_reader._icl_book = True
    sx.create_nb_reader = create_nb_reader


class glued_table(nodes.figure):
    "A glued output shown as a numbered table."


def _table_title(node):
    cap = next(iter(node.findall(nodes.caption)), None)
    return cap.astext() if cap is not None else ""


class GluedTables(SphinxTransform):
    "Turn `{glue:figure}` nodes of class `table` into numbered tables, caption first."
    default_priority = 200

    def apply(self):
        for fig in list(self.document.findall(nodes.figure)):
            if type(fig) is not nodes.figure or "table" not in fig["classes"]:
                continue
            tab = glued_table(fig.rawsource, **fig.attributes)
            tab["classes"] = [c for c in fig["classes"] if c != "table"] + ["glued-table"]
            caps = [c for c in fig.children if isinstance(c, nodes.caption)]
            rest = [c for c in fig.children if not isinstance(c, nodes.caption)]
            tab.extend(caps + rest)                      # a table's caption sits above it
            fig.replace_self(tab)
            for i in tab["ids"]:                         # labels point at the table
                self.document.ids[i] = tab


def _visit(self, node):
    self.visit_figure(node)


def _depart(self, node):
    self.depart_figure(node)


def _one_script_each(app, pagename, templatename, context, doctree):
    """Load each script once: myst-nb adds the widget manager a second time on
    a page that pastes a glued widget, and a second manager renders every
    widget twice."""
    name = lambda js: str(getattr(js, "filename", js)).split("?")[0]
    dup = lambda js: name(js).endswith(("embed-amd.js", "require.js"))
    files = context.get("script_files") or []
    best = {}                                     # the copy with its attributes
    for js in files:
        if dup(js) and len(getattr(js, "attributes", {}) or {}) >= \
                len(getattr(best.get(name(js)), "attributes", {}) or {}):
            best[name(js)] = js
    keep, seen = [], set()
    for js in sorted(files, key=lambda js: getattr(js, "priority", 500)):
        if dup(js):
            if name(js) in seen: continue
            seen.add(name(js)); js = best[name(js)]
        keep.append(js)
    files[:] = keep
    for key in ("css_files", "script_files"):      # and no other file twice
        seen, once = set(), []
        for f in context.get(key) or []:
            if not getattr(f, "filename", None):   # inline scripts: all kept
                once.append(f); continue
            if name(f) not in seen:
                seen.add(name(f)); once.append(f)
        if context.get(key): context[key][:] = once


def setup(app):
    _wrap_reader()
    app.add_enumerable_node(glued_table, "table", _table_title,
                            html=(_visit, _depart), latex=(_visit, _depart),
                            text=(_visit, _depart))
    app.add_transform(GluedTables)
    app.connect("html-page-context", _one_script_each, priority=900)
    app.add_css_file("book.css")
    app.add_js_file("book.js")
    return {"parallel_read_safe": True, "parallel_write_safe": True}

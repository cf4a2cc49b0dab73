"""Measure the house's shape: import direction, names, room sizes, test hygiene.

    python tools/house.py          # report
    python tools/house.py --json   # the same as JSON (tests/test_house.py reads it)

Every figure in issue 23's closing note comes from this script.
"""
from __future__ import annotations
import ast, json, re, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "icl_book"
LIMITS = dict(module_lines=500, cell_lines=40)   # reported, not enforced: sizes follow the ideas
# test files about the whole project; every other tests/test_X.py checks module X
PROJECT_TESTS = {"book", "cli", "experiments", "house", "lock", "notebooks", "publish",
                 "readme", "reproduction", "sync", "zoo"}


def notebooks(nbs: Path) -> list:
    "Notebooks of folder `nbs` in nbdev's order: (stem, default module, cells, every module it exports)."
    out = []
    for p in sorted(nbs.glob("*.ipynb")):
        cells = json.loads(p.read_text())["cells"]
        mod, targets = None, set()
        for c in cells:
            s = "".join(c["source"])
            m = re.search(r"^#\|\s*default_exp\s+(\S+)", s, re.M)
            if m and mod is None: mod = m.group(1)
            t = re.search(r"^#\|[ \t]*exporti?[ \t]+(\S+)", s, re.M)
            if t: targets.add(t.group(1))
        out.append((p.stem, mod, cells, targets | ({mod} if mod else set())))
    return out


def module_of(path: Path, pkg: Path) -> str:
    "Dotted name of the module file `path` inside the package folder `pkg`."
    return ".".join(path.relative_to(pkg).with_suffix("").parts)


def package_imports(path: Path, pkg: Path) -> list:
    "(target module, line, at module level?) for every import of the package inside `path`."
    tree, mod, out = ast.parse(path.read_text()), module_of(path, pkg), []
    pkg = mod.split(".")[:-1]
    top = {id(n) for n in tree.body}
    def walk(node, toplevel):
        for ch in ast.iter_child_nodes(node):
            lvl = toplevel and id(ch) in top
            if isinstance(ch, ast.ImportFrom):
                if ch.level:
                    base = pkg[: len(pkg) - ch.level + 1] if ch.level > 1 else pkg
                    tgt = ".".join(base + ([ch.module] if ch.module else []))
                elif (ch.module or "").startswith("icl_book"):
                    tgt = ch.module[len("icl_book."):] if ch.module != "icl_book" else ""
                else: tgt = None
                if tgt is not None:
                    names = [a.name for a in ch.names]
                    tgts = [tgt] if tgt else names
                    for t in tgts: out.append((t, ch.lineno, lvl))
            elif isinstance(ch, ast.Import):
                for a in ch.names:
                    if a.name.startswith("icl_book."): out.append((a.name[9:], ch.lineno, lvl))
            walk(ch, False)
    walk(tree, True)
    return out


def measure(root: Path = ROOT) -> dict:
    """The house's figures for the repository at `root` (its package `icl_book/`,
    notebooks `nbs/` and tests `tests/`); each list names its offenders."""
    PKG, NBS, TESTS = root / PACKAGE, root / "nbs", root / "tests"
    nbs = notebooks(NBS)
    order = {m: i for i, (_, _, _, ts) in enumerate(nbs) for m in ts}
    mods = {module_of(p, PKG): p for p in PKG.rglob("*.py")
            if p.name not in ("_modidx.py", "__init__.py")}
    edges, forward, inner, inner_forward = [], [], [], []
    for m, p in sorted(mods.items()):
        for t, line, lvl in package_imports(p, PKG):
            if t not in mods or t == m: continue
            edges.append((m, t))
            if not lvl: inner.append(f"{m}:{line} -> {t}")
            if m in order and t in order and order[t] > order[m]:
                forward.append(f"{m}:{line} -> {t}")
                if not lvl: inner_forward.append(f"{m}:{line} -> {t}")
    graph = {}
    for a, b in edges: graph.setdefault(a, set()).add(b)
    cycles, state = [], {}
    def dfs(u, stack):
        state[u] = 1; stack.append(u)
        for v in sorted(graph.get(u, ())):
            if state.get(v) == 1: cycles.append(stack[stack.index(v):] + [v])
            elif not state.get(v): dfs(v, stack)
        stack.pop(); state[u] = 2
    for u in sorted(graph):
        if not state.get(u): dfs(u, [])
    experiment_code = [f"{m}.{d}" for m, p in mods.items() if not m.startswith("experiments.")
                       for d in re.findall(r"^def ((?:plot|bench|reproduce)_\w+)", p.read_text(), re.M)]
    # the package's own __init__ may serve its top level lazily; no other module forwards
    inits = {module_of(p, PKG): p for p in PKG.rglob("__init__.py") if p.parent != PKG}
    getattr_fwd = [m for m, p in {**mods, **inits}.items()
                   if re.search(r"^def __getattr__", p.read_text(), re.M)]
    private_cross = []   # `from .other import _name`: a helper another module keeps private
    for m, p in sorted(mods.items()):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith(PACKAGE)):
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        private_cross.append(f"{m}:{node.lineno} {node.module or ''}.{a.name}")
    misnamed = []
    for stem, _, _, ts in nbs:
        name = re.sub(r"^\d+[a-z]*_", "", stem)
        for mod in ts:   # experiments.X lives in the chapter of X; __main__ in 30_cli
            want = "cli" if mod == "__main__" else mod.split(".")[-1]
            if name != want: misnamed.append(f"{stem} -> {mod}")
    late_methods = [f"{m}:{x}" for m, p in sorted(mods.items())
                    for x in methods_after_class(ast.parse(p.read_text()))]
    unexported = sorted(set(mods) - set(order))
    big = {m: n for m, p in mods.items()
           if (n := len(p.read_text().splitlines())) > LIMITS["module_lines"]}
    long_cells = []
    for stem, _, cells, _ in nbs:
        for i, c in enumerate(cells):
            if c["cell_type"] == "code" and \
                    (n := len("".join(c["source"]).splitlines())) > LIMITS["cell_lines"]:
                long_cells.append(f"{stem}[{i}] {n}")
    # also the book pages without an exported module (index)
    private = []
    for p in sorted(TESTS.glob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGE):
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        private.append(f"{p.name}:{node.lineno} {node.module}.{a.name}")
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.attr.startswith("_") and not node.attr.startswith("__") \
                    and node.value.id in _aliases(p, PKG):
                private.append(f"{p.name}:{node.lineno} {node.value.id}.{node.attr}")
    leaves = {m.split(".")[-1] for m in mods}
    unnamed_tests = sorted(p.name for p in TESTS.glob("test_*.py")
                           if p.stem[5:] not in leaves | PROJECT_TESTS)
    return dict(modules=len(mods), notebooks=sum(1 for *_, ts in nbs if ts),
                modules_without_notebook=unexported,
                cycles=cycles, forward_imports=forward, function_level_imports=inner,
                function_level_forward_imports=inner_forward,
                getattr_forwarding=getattr_fwd, experiment_code_in_library=experiment_code, misnamed_notebooks=misnamed,
                modules_over_500=big, cells_over_40=long_cells, private_test_imports=private,
                private_cross_imports=private_cross, methods_after_class=late_methods,
                tests_not_named_after_a_module=unnamed_tests,
                library_lines=sum(len(p.read_text().splitlines()) for p in mods.values()))


_WRAPS = {"property", "staticmethod", "classmethod", "partialmethod", "partial",
          "MethodType", "wraps", "cached_property"}


def methods_after_class(tree: ast.Module) -> list:
    """'line Cls.name' for each function a module assigns to one of its classes
    after the class body (`Cls.f = g`, `Cls.f = lambda ...`, `Cls.p = property(...)`,
    `setattr(Cls, ..., ...)`), at module level (loops and ifs included). A
    fastcore `@patch` is a decorated def, visibly a method, and is not counted."""
    def top(body):                                   # statements outside defs/classes
        for st in body:
            if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            yield st
            for f in ("body", "orelse", "finalbody", "handlers"):
                yield from top(getattr(st, f, None) or [])
    classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    defs = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    def root(e):
        while isinstance(e, ast.Attribute): e = e.value
        return e.id if isinstance(e, ast.Name) else None
    def is_function(v):
        if isinstance(v, ast.Lambda): return True
        if isinstance(v, ast.Name): return v.id in defs
        if isinstance(v, ast.Attribute): return root(v) in classes or v.attr in defs
        if isinstance(v, ast.Call):
            f = v.func.attr if isinstance(v.func, ast.Attribute) else getattr(v.func, "id", "")
            return f in _WRAPS
        return False
    out = []
    for st in top(tree.body):
        if isinstance(st, (ast.Assign, ast.AnnAssign)):
            targets = st.targets if isinstance(st, ast.Assign) else [st.target]
            pairs = []                                    # (target, its value)
            for t in targets:
                if isinstance(t, ast.Tuple) and isinstance(st.value, ast.Tuple) \
                        and len(t.elts) == len(st.value.elts):
                    pairs += zip(t.elts, st.value.elts)
                else:
                    pairs += [(e, st.value) for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
            for t, v in pairs:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) \
                        and t.value.id in classes and v is not None and is_function(v):
                    out.append(f"{t.lineno} {t.value.id}.{t.attr}")
        for node in ast.walk(st) if not isinstance(st, (ast.For, ast.While, ast.If, ast.With,
                                                        ast.Try)) else []:
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" \
                    and node.args and isinstance(node.args[0], ast.Name) \
                    and node.args[0].id in classes:
                name = node.args[1].value if len(node.args) > 1 and \
                    isinstance(node.args[1], ast.Constant) else "..."
                out.append(f"{node.lineno} {node.args[0].id}.{name}")
    return out


def _aliases(p: Path, pkg: Path) -> set:
    "Names a test file binds to the package's modules (`import icl_book.hf as H`, `from icl_book import hf`)."
    out = set()
    for node in ast.walk(ast.parse(p.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith(PACKAGE): out.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGE):
            for a in node.names:
                rel = f"{node.module}.{a.name}"[len(PACKAGE) + 1:].replace(".", "/")
                if (pkg / (rel + ".py")).exists() or (pkg / rel).is_dir():
                    out.add(a.asname or a.name)
    return out


if __name__ == "__main__":
    r = measure()
    if "--json" in sys.argv: print(json.dumps(r, indent=1)); sys.exit()
    for k, v in r.items():
        n = len(v) if isinstance(v, (list, dict)) else v
        print(f"{k}: {n}")
        if isinstance(v, (list, dict)) and v:
            for x in (v.items() if isinstance(v, dict) else v): print("   ", x)

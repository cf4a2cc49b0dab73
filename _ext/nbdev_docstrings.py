"""Render nbdev-style docstrings (Markdown-ish one-liners) safely as reST.

The library's docstrings use `code` spans, shapes like (B, n, d) and symbols
such as ** and x_i; reST would read those as interpreted text, emphasis or
references and warn. This hook turns code spans into literals (with escaped
separators so any neighbouring character is allowed) and escapes `*`, `|` and
a trailing `_`. A MyST role such as {doc}`15_families`, which a module's
description may carry from its notebook, becomes the reST role :doc:.
"""
import re

_SPAN = re.compile(r"`([^`]+)`")
_ROLE = re.compile(r"\{(doc|ref|numref)\}`([^`]+)`")


def _fix(line: str) -> str:
    "One docstring line as reST: MyST roles kept as roles, the rest escaped."
    pieces = _ROLE.split(line)
    if len(pieces) > 1:                            # text, role, target, text, ...
        return "".join(_fix(p) if i % 3 == 0 else
                       (f":{p}:" if i % 3 == 1 else f"`{p}`\\ ")
                       for i, p in enumerate(pieces))
    parts, out = _SPAN.split(line), []
    for i, p in enumerate(parts):
        if i % 2:                                  # inside a code span
            out.append("\\ ``" + p + "``\\ ")
        else:
            p = p.replace("\\", "\\\\").replace("*", "\\*").replace("|", "\\|")
            out.append(re.sub(r"(\w)_(?=\W|$)", r"\1\\_", p))
    return "".join(out)


def _process(app, what, name, obj, options, lines):
    lines[:] = [_fix(l) for l in lines]


def setup(app):
    app.connect("autodoc-process-docstring", _process)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

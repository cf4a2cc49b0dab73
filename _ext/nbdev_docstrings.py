"""Render nbdev-style docstrings (Markdown-ish one-liners) safely as reST.

The library's docstrings use `code` spans, shapes like (B, n, d) and symbols
such as ** and x_i; reST would read those as interpreted text, emphasis or
references and warn. This hook turns code spans into literals (with escaped
separators so any neighbouring character is allowed) and escapes `*`, `|` and
a trailing `_`.
"""
import re

_SPAN = re.compile(r"`([^`]+)`")


def _fix(line: str) -> str:
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

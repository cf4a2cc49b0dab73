"""The README's example runs and prints what the README says it prints."""
import re
import subprocess
import sys

from conftest import ROOT


def _blocks(lang):
    return re.findall(rf"```{lang}\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def _tiny(line):
    "Treat round-off-level numbers (< 1e-12) as equal: they vary by machine."
    return re.sub(r"\d(\.\d+)?e-(1[2-9]|[2-9]\d)", "<round-off>", line)


def test_readme_example_output():
    code, = _blocks("python")
    expected, = _blocks("text")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    assert [_tiny(l) for l in out.splitlines()] == [_tiny(l) for l in expected.splitlines()]

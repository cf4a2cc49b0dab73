"""The README's example runs and prints what the README says it prints."""
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT


def _blocks(lang):
    return re.findall(rf"```{lang}\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def _tiny(line):
    """Treat round-off-level numbers as equal, they vary by machine: < 1e-12
    (float64) and 1e-11 ... 1e-5 (float32); anything larger must match."""
    line = re.sub(r"\d(\.\d+)?e-(1[2-9]|[2-9]\d)", "<round-off>", line)
    return re.sub(r"\d(\.\d+)?e-(0[5-9]|1[01])", "<float32 round-off>", line)


def _examples():
    "Each ```python block of the README with the ```text block that follows it."
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```python\n(.*?)```.*?```text\n(.*?)```", text, re.S)


def test_readme_has_its_examples():
    assert len(_examples()) == 2 == len(_blocks("python")), \
        "every ```python block of the README is followed by the ```text it prints"


@pytest.mark.parametrize("i", range(2))
def test_readme_example_output(i):
    code, expected = _examples()[i]
    if "load_pretrained" in code:
        from icl_book.weights import missing
        if missing("smollm2"):
            pytest.skip(missing("smollm2"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT, env=env).stdout
    assert [_tiny(l) for l in out.splitlines()] == [_tiny(l) for l in expected.splitlines()]

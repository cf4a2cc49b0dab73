"""The README's example runs and prints what the README says it prints.

Text and plain numbers (shapes, ranks) must match exactly. A number in
scientific notation (`1e-07`: a round-off error, which varies by machine)
must be of the same order of magnitude as the one the example computes:
within a factor of `DECADE` either way, so the README's `1e-07` accepts
`2e-07` or `4e-08`, and refuses `1e-05` or `1e-09`.
"""
import math
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT

SCI = re.compile(r"[-+]?\d(?:\.\d+)?e[-+]\d+")
DECADE = 10.0   # how far a printed round-off may drift between machines


def _blocks(lang):
    return re.findall(rf"```{lang}\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def _examples():
    "Each ```python block of the README with the ```text block that follows it."
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```python\n(.*?)```.*?```text\n(.*?)```", text, re.S)


def same_order(got: float, want: float, factor: float = DECADE) -> bool:
    "`got` within a factor `factor` of `want` (both zero, or of one sign)."
    if got == want: return True
    if got == 0 or want == 0 or (got > 0) != (want > 0): return False
    return abs(math.log10(got / want)) <= math.log10(factor)


def line_mismatch(printed: str, claimed: str) -> str | None:
    "Why `printed` is not the README's `claimed` line, or None when it is."
    if SCI.split(printed) != SCI.split(claimed):
        return f"printed {printed!r}, the README says {claimed!r}"
    for got, want in zip(SCI.findall(printed), SCI.findall(claimed)):
        if not same_order(float(got), float(want)):
            return (f"printed {got} where the README says {want} (more than a "
                    f"factor {DECADE:g} apart) in {claimed!r}")
    return None


def output_mismatches(printed: str, claimed: str) -> list:
    "Every line where the printed output is not what the README claims."
    p, c = printed.splitlines(), claimed.splitlines()
    bad = [m for a, b in zip(p, c) if (m := line_mismatch(a, b))]
    if len(p) != len(c):
        bad.append(f"{len(p)} lines printed, the README shows {len(c)}: {p}")
    return bad


def test_readme_has_its_examples():
    assert len(_examples()) == 2 == len(_blocks("python")), \
        "every ```python block of the README is followed by the ```text it prints"


def test_readme_claims_numbers():
    "What the order-of-magnitude rule applies to: the README's round-off figures."
    claimed = [SCI.findall(text) for _, text in _examples()]
    assert all(claimed), f"an example's output claims no number: {claimed}"


@pytest.mark.parametrize("printed,claimed,ok", [
    ("1e-07", "1e-07", True), ("2e-07", "1e-07", True), ("9e-08", "1e-07", True),
    ("1e-05", "1e-07", False), ("1e-09", "1e-07", False), ("2e-06", "1e-07", False),
    ("0e+00", "1e-07", False), ("-1e-07", "1e-07", False),
    ("torch.Size([1, 32]) 1", "torch.Size([1, 32]) 1", True),
    ("torch.Size([1, 32]) 2", "torch.Size([1, 32]) 1", False),
    ("' Rome.\\n'", "' Paris.\\n'", False)])
def test_line_comparison(printed, claimed, ok):
    "The rule itself: text exact, round-off within one order of magnitude."
    assert (line_mismatch(printed, claimed) is None) == ok


def test_output_comparison_counts_lines():
    assert output_mismatches("1e-07\n", "1e-07\nx\n")
    assert not output_mismatches("3e-07\n' Rome.'", "1e-07\n' Rome.'")


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
    bad = output_mismatches(out, expected)
    assert not bad, "README example %d:\n%s" % (i + 1, "\n".join(bad))

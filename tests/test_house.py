"""The house's shape (issue 23's Done-when), measured by tools/house.py.

The whole-tree tests read the repository; the tests of the checker build a
small fake repository (a package, its notebooks, its tests) in a temporary
folder and show each rule passing on a clean house and failing on a house
that breaks it. Also the test suite's own `--device` option.
"""
import json
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, cuda_skip_reason

sys.path.insert(0, str(ROOT / "tools"))
import house  # noqa: E402  (tools/house.py)


def offenders(r: dict) -> dict:
    "Each rule of the Done-when -> what breaks it in `house.measure()`'s figures `r`."
    return {
        "no import cycle": r["cycles"],
        "no import from a later notebook": r["forward_imports"],
        "no function-level import of a later module": r["function_level_forward_imports"],
        "no module __getattr__": r["getattr_forwarding"],
        "every notebook named after its module(s)":
            r["misnamed_notebooks"] + [f"{m} (no notebook)" for m in r["modules_without_notebook"]],
        "no test imports a private name": r["private_test_imports"],
        "no private name imported across modules": r["private_cross_imports"],
        "no plot_/bench_/reproduce_ in library modules": r["experiment_code_in_library"],
        "no function assigned to a class attribute after its body": r["methods_after_class"],
        "every test file named after the module it checks": r["tests_not_named_after_a_module"],
    }


RULES = list(offenders(house.measure(ROOT)))


def assert_rule(r: dict, rule: str):
    "The assertion of one rule, its message listing the offenders."
    bad = offenders(r)[rule]
    assert not bad, f"{rule}: {len(bad)} offender(s) (python tools/house.py):\n" + \
        "\n".join(f"  {b}" for b in bad)


@pytest.fixture(scope="module")
def tree():
    return house.measure(ROOT)


@pytest.mark.parametrize("rule", RULES)
def test_the_house(tree, rule):
    assert_rule(tree, rule)


# --- the checker itself, on a fake repository

def notebook(*cells: str) -> str:
    "An .ipynb with one code cell per source."
    return json.dumps({"cells": [{"cell_type": "code", "source": c.splitlines(True),
                                  "metadata": {}, "outputs": [], "execution_count": None}
                                 for c in cells], "metadata": {}, "nbformat": 4,
                       "nbformat_minor": 5})


CLEAN = {
    "nbs/00_core.ipynb": notebook("#| default_exp core", "#| export\ndef f(x): return x"),
    "nbs/01_blocks.ipynb": notebook("#| default_exp blocks",
                                    "#| export\nfrom .core import f\ndef g(x): return f(x)",
                                    "#| export experiments.blocks\ndef plot_g(): pass"),
    "icl_book/__init__.py": "",
    "icl_book/core.py": "def f(x): return x\n",
    "icl_book/blocks.py": "from .core import f\n\ndef g(x):\n    from .core import f\n"
                          "    return f(x)\n",
    "icl_book/experiments/__init__.py": "",
    "icl_book/experiments/blocks.py": "from ..blocks import g\n\ndef plot_g(): pass\n",
    "tests/test_blocks.py": "from icl_book.blocks import g\nfrom icl_book import core\n"
                            "def test_g(): assert g(1) == core.f(1)\n",
}

# rule -> files that, written over the clean house, break it
BREAKS = {
    "no import cycle": {"icl_book/core.py": "from .blocks import g\ndef f(x): return x\n"},
    "no import from a later notebook": {"icl_book/core.py": "from icl_book import blocks\n"},
    "no function-level import of a later module": {
        "icl_book/core.py": "def f(x):\n    from .blocks import g\n    return x\n"},
    "no module __getattr__": {"icl_book/blocks.py": "def __getattr__(name): return 1\n"},
    "no private name imported across modules": {
        "icl_book/blocks.py": "from .core import _f\n\ndef g(x): return _f(x)\n"},
    "every notebook named after its module(s)": {
        "nbs/01_contextual_blocks.ipynb": notebook("#| default_exp blocks")},
    "no test imports a private name": {
        "tests/test_core.py": "from icl_book import core\ndef test(): core._hidden\n"},
    "no plot_/bench_/reproduce_ in library modules": {
        "icl_book/core.py": "def f(x): return x\ndef bench_f(): pass\n"},
    "no function assigned to a class attribute after its body": {
        "icl_book/core.py": "class A:\n    pass\n\ndef f(x): return x\nA.f = f\n"},
    "every test file named after the module it checks": {
        "tests/test_edge_cases.py": "def test(): pass\n"},
}

EXPECTED = {   # what each message names
    "no import cycle": "['blocks', 'core', 'blocks']",
    "no import from a later notebook": "core:1 -> blocks",
    "no function-level import of a later module": "core:2 -> blocks",
    "no module __getattr__": "blocks",
    "every notebook named after its module(s)": "01_contextual_blocks -> blocks",
    "no test imports a private name": "test_core.py:2 core._hidden",
    "no private name imported across modules": "blocks:1 core._f",
    "no plot_/bench_/reproduce_ in library modules": "core.bench_f",
    "no function assigned to a class attribute after its body": "core:5 A.f",
    "every test file named after the module it checks": "test_edge_cases.py",
}


def fake_house(folder, files: dict) -> dict:
    "Write `files` (path -> text) under `folder` and measure it."
    for path, text in files.items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_text(text)
    return house.measure(folder)


def test_every_rule_has_a_breaking_house():
    assert set(BREAKS) == set(RULES) == set(EXPECTED)


@pytest.mark.parametrize("rule", RULES)
def test_rule_holds_on_a_clean_house(tmp_path, rule):
    assert_rule(fake_house(tmp_path, CLEAN), rule)


@pytest.mark.parametrize("rule", RULES)
def test_rule_fails_on_a_house_that_breaks_it(tmp_path, rule):
    fake_house(tmp_path, CLEAN)
    if rule.startswith("every notebook"):
        (tmp_path / "nbs/01_blocks.ipynb").unlink()
    r = fake_house(tmp_path, BREAKS[rule])
    with pytest.raises(AssertionError) as e:
        assert_rule(r, rule)
    assert EXPECTED[rule] in str(e.value), str(e.value)


def test_only_the_package_init_may_have_a_module_getattr(tmp_path):
    "The top level's lazy names are allowed; a subpackage's __init__ forwarding is not."
    fake_house(tmp_path, CLEAN)
    r = fake_house(tmp_path, {"icl_book/__init__.py": "def __getattr__(name): return 1\n"})
    assert_rule(r, "no module __getattr__")
    r = fake_house(tmp_path, {"icl_book/experiments/__init__.py": "def __getattr__(name): return 1\n"})
    with pytest.raises(AssertionError, match="experiments"):
        assert_rule(r, "no module __getattr__")


def test_sizes_are_a_report_not_a_rule(tmp_path):
    "A long module or cell is measured (python tools/house.py prints it) and breaks no rule."
    long = "\n".join(["pass"] * 41)
    r = fake_house(tmp_path, {**CLEAN, "nbs/02_long.ipynb": notebook(*[long] * 6),
                              "icl_book/core.py": "x = 1\n" * 501})
    assert len(r["cells_over_40"]) == 6 and r["modules_over_500"] == {"core": 501}
    for rule in RULES:
        assert_rule(r, rule)


@pytest.mark.parametrize("code,found", [
    ("for op in ('add', 'mul'):\n    setattr(A, f'__{op}__', A.m)\n", ["6 A...."]),
    ("A.p = property(lambda a: 1)\n", ["5 A.p"]),
    ("if True:\n    A.g = lambda a: 2\n", ["6 A.g"]),
    ("A.m2, A.n = A.m, 3\n", ["5 A.m2"]),
    ("A.N = 3\nA.__doc__ = 'data, not a function'\n", []),
    ("from fastcore.basics import patch\n@patch\ndef g(self: A): return 2\n", []),
])
def test_methods_after_the_class_body(code, found):
    "Functions bound to a class after its body, by assignment or setattr; a @patch def is not."
    src = "class A:\n    def m(self): return 1\n\n\n" + code
    assert house.methods_after_class(__import__("ast").parse(src)) == found


def test_earlier_module_imports_are_not_forward(tmp_path):
    "The clean house's function-level import of an earlier module is counted, not refused."
    r = fake_house(tmp_path, CLEAN)
    assert r["function_level_imports"] == ["blocks:4 -> core"]
    assert r["forward_imports"] == [] and r["modules"] == 3 and r["notebooks"] == 2


# --- pytest --device (tests/conftest.py)

@pytest.mark.parametrize("device,available,runs", [
    ("cpu", False, False), ("cpu", True, False), ("cuda", False, False), ("cuda", True, True)])
def test_cuda_tests_run_only_with_device_cuda_on_a_gpu(device, available, runs):
    assert (cuda_skip_reason(device, available) is None) == runs


def test_device_option_in_a_session(tmp_path):
    """A cuda-marked test is skipped with the default --device cpu; `device` is
    'cpu'; a test that uses the `book` fixture is marked `book`."""
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_dev.py").write_text(
        "import pytest\n"
        "@pytest.mark.cuda\ndef test_gpu(): assert False\n"
        "def test_dev(device): assert device == 'cpu'\n"
        "def test_built(book): assert False\n")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                        "-m", "not book", str(tmp_path)], capture_output=True, text=True,
                       cwd=tmp_path)
    assert "1 passed, 1 skipped, 1 deselected" in r.stdout, r.stdout + r.stderr
    assert "needs --device cuda" in r.stdout, r.stdout


def test_api_page_lists_every_module_in_order():
    "nbs/api.md is what tools/api_page.py writes from the notebooks and the CHANGELOG."
    import api_page  # tools/api_page.py
    page = api_page.page()
    assert (ROOT / "nbs" / "api.md").read_text() == page, \
        "nbs/api.md is out of date: run `python tools/api_page.py` and commit it"
    mods = [m for *_, ts in house.notebooks(ROOT / "nbs") for m in sorted(ts)]
    pos = [page.index(f".. automodule:: icl_book.{m}\n") for m in mods]
    lib = [p for m, p in zip(mods, pos) if not m.startswith("experiments.")]
    assert lib == sorted(lib), "the library's sections are not in notebook order"
    assert "## Moved in this release" in page and "icl_book.hf_patch" in page


def test_every_chapter_says_who_it_is_for():
    """Each chapter opens with a box of its own naming its audience and what it
    assumes (dmol-book's habit), apart from the box saying what it shows."""
    missing = []
    for stem, _, cells, _ in house.notebooks(ROOT / "nbs"):
        head = "".join("".join(c["source"]) for c in cells[:4] if c["cell_type"] == "markdown")
        shows = head.split("```{admonition} What this chapter")[-1].split("```")[0]
        if stem != "index" and ("```{admonition} Who this chapter is for" not in head
                                or "Who this chapter is for" in shows):
            missing.append(stem)
    assert not missing, f"chapters without a 'Who this chapter is for' opening: {missing}"


def test_api_page_lists_every_public_top_level_and_hf_name():
    "A public name of `import icl_book as icl` or of `icl_book.hf` that nbs/api.md does not list fails."
    import icl_book
    import icl_book.hf as hf
    page = (ROOT / "nbs" / "api.md").read_text()
    top = page.split("## The library")[0]
    missing = [f"icl.{n}" for n in icl_book.__all__ if f"`icl.{n}`" not in top]
    missing += [f"hf.{n}" for n in hf.__all__ if f"`{n}`" not in top.split("`icl_book.hf` serves")[-1]]
    assert not missing, f"public names the API page does not list: {missing}; run python tools/api_page.py"

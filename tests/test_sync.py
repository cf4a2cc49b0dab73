"""The library is what the notebooks export, and the notebooks are clean.

Both checks run on a copy of the sources in a temporary folder, so they never
change the working tree: they fail if `nbdev-export` or `nbdev-clean` *would*
change a file, and say which command to run.
"""
import filecmp
import shutil
import subprocess

import pytest

from conftest import ROOT, tool


def _copy_project(dst):
    for name in ("nbs", "icl_book", "pyproject.toml"):
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dst / name,
                            ignore=shutil.ignore_patterns("__pycache__", ".ipynb_checkpoints"))
        else:
            shutil.copy(src, dst / name)


def _changed(a, b):
    "Files that differ or exist on one side only, recursively."
    cmp = filecmp.dircmp(a, b, ignore=["__pycache__"])
    out = [f"{a.name}/{f}" for f in cmp.diff_files + cmp.left_only + cmp.right_only]
    for sub in cmp.common_dirs:
        out += _changed(a / sub, b / sub)
    return out


@pytest.mark.parametrize("cmd,folder", [("nbdev-export", "icl_book"),
                                        ("nbdev-clean", "nbs")])
def test_command_would_change_nothing(tmp_path, cmd, folder):
    "nbdev-export: the library is in sync; nbdev-clean: the notebooks are clean."
    _copy_project(tmp_path)
    subprocess.run([tool(cmd)], cwd=tmp_path, check=True)
    changed = _changed(ROOT / folder, tmp_path / folder)
    assert not changed, (f"{cmd} would change {changed}: run `.venv/bin/{cmd}` "
                         f"and commit {folder}/")

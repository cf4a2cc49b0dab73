"""Shared fixtures: the repository root and the project's command-line tools."""
import os
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    "Path of a console script installed next to the running Python."
    p = BIN / name
    return str(p) if p.exists() else shutil.which(name) or name


@pytest.fixture(scope="session")
def root() -> Path:
    return ROOT


def pytest_configure(config):
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")

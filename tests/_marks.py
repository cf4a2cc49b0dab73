"""Skip marks shared by the test files (imported as `from _marks import ...`)."""
import pytest

from icl_book.weights import missing


def needs(name: str):
    "Skip unless the offline weights `name` load here; the reason says how to install them."
    why = missing(name)
    return pytest.mark.skipif(why is not None, reason=str(why))


needs_smollm2 = needs("smollm2")   # tests/test_hf.py, test_lm_dynamics.py, test_lm_monitor.py

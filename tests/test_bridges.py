"""icl_book.bridges: ROME and MEMIT edits refuse bad input with a clear error."""
import pytest

from _inputs import BAD  # noqa: E402


@pytest.mark.parametrize('case', list(BAD['bridges']))
def test_bad_input_is_a_clear_error(case):
    fn, exc, words = BAD['bridges'][case]
    with pytest.raises(exc, match=words):
        fn()

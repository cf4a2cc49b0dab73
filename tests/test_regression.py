"""icl_book.regression: the task's configuration, ridge, query masks and
prompt sampling refuse bad input with a clear error."""
import pytest

from _inputs import BAD  # noqa: E402


@pytest.mark.parametrize('case', list(BAD['regression']))
def test_bad_input_is_a_clear_error(case):
    fn, exc, words = BAD['regression'][case]
    with pytest.raises(exc, match=words):
        fn()

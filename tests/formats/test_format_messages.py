"""formats.messages words every blob defect code the way the Python parser words the defect,
and hands every other engine code to errors.engine_error unchanged."""

from __future__ import annotations

import pytest

from recurrent_cache import errors
from recurrent_cache.errors import StateError
from recurrent_cache.formats import messages

DETAIL = dict(what="op", seq=3, size=4, token=1, pos=5, prev=2, n=1, index=1, field="rows", offset=12, need=8,
              length=10, cell=0, other=0, value=7, n_layer=1, expected=0)
BLOB_NAMES = sorted(name for name in vars(errors) if name.startswith("BLOB_"))
OTHER_NAMES = sorted(name for name, value in vars(errors).items()
                     if isinstance(value, int) and name.isupper() and value < 0 and not name.startswith("BLOB_"))


def test_every_blob_code_of_errors_is_worded():
    assert messages.BLOB_CODES == {getattr(errors, name) for name in BLOB_NAMES}


@pytest.mark.parametrize("name", BLOB_NAMES)
def test_a_blob_code_is_a_state_error_in_the_parser_s_words(name):
    exc = messages.engine_error(getattr(errors, name), **DETAIL)
    assert type(exc) is StateError and str(exc).startswith(("state blob", "sequence state blob")), str(exc)


def test_a_blob_code_says_what_the_parser_says():
    exc = messages.engine_error(errors.BLOB_TYPE, **DETAIL)
    assert str(exc) == str(messages.type_mismatch(messages.tensor_name(1, 1), 12, 7, 0))
    exc = messages.engine_error(errors.BLOB_TRUNCATED, **DETAIL)
    assert str(exc) == str(messages.truncated("layer 0 s rows", 12, 8, 10))


@pytest.mark.parametrize("name", OTHER_NAMES)
def test_any_other_code_is_the_error_table_s(name):
    code = getattr(errors, name)
    exc, table = messages.engine_error(code, **DETAIL), errors.engine_error(code, **DETAIL)
    assert type(exc) is type(table) and str(exc) == str(table)

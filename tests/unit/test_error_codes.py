"""`proxy.kafka.error_codes` against kio's `ErrorCode`, over every int16 and beyond."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kio.schema.errors import ErrorCode

from proxy.kafka.error_codes import error_code, retriable


def _retriable_by_enum(value: int) -> bool:
    try:
        return bool(ErrorCode(value).retriable)
    except ValueError:  # a code kio does not know: a client is assumed to retry
        return True


@given(st.integers(min_value=-(1 << 15), max_value=(1 << 15) - 1))
def test_error_code_is_kios_enum_member_or_the_same_error(value: int) -> None:
    try:
        expected = ErrorCode(value)
    except ValueError:
        with pytest.raises(ValueError):
            error_code(value)
        return
    assert error_code(value) is expected


@given(st.integers(min_value=-(1 << 16), max_value=1 << 16))
def test_retriable_agrees_with_the_enum(value: int) -> None:
    assert retriable(value) is _retriable_by_enum(value)


@pytest.mark.parametrize("code", list(ErrorCode))
def test_every_known_code(code: ErrorCode) -> None:
    assert error_code(int(code)) is code
    assert error_code(code) is code  # a member is its own value
    assert retriable(code) is code.retriable


def test_an_unknown_code_is_retriable_and_not_a_member() -> None:
    unknown = max(int(code) for code in ErrorCode) + 1
    assert retriable(unknown)
    with pytest.raises(ValueError):
        error_code(unknown)

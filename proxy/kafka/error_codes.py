"""Kafka's error codes by value: kio's `ErrorCode` without an enum lookup per answer."""

from __future__ import annotations

from typing import Final

from kio.schema.errors import ErrorCode

_BY_VALUE: Final[dict[int, ErrorCode]] = {int(code): code for code in ErrorCode}
_RETRIABLE: Final = frozenset(value for value, code in _BY_VALUE.items() if code.retriable)


def error_code(value: int) -> ErrorCode:
    """`ErrorCode(value)`, ValueError included for a code kio does not know."""
    code = _BY_VALUE.get(value)
    return ErrorCode(value) if code is None else code


def retriable(value: int) -> bool:
    """Whether a client retries after this code; a code kio does not know: assume it does."""
    return value in _RETRIABLE or value not in _BY_VALUE

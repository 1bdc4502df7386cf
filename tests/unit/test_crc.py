"""CRC32C of joined byte strings from the parts' CRCs (`dedup.crc`), against crc32c itself."""

from __future__ import annotations

import pytest
from crc32c import crc32c
from hypothesis import given
from hypothesis import strategies as st

from dedup.crc import crc32c_combine, crc32c_of_second

pytestmark = pytest.mark.unit


@given(first=st.binary(max_size=200), second=st.binary(max_size=5000))
def test_the_combined_crc_is_the_crc_of_the_joined_bytes(first: bytes, second: bytes) -> None:
    assert crc32c_combine(crc32c(first), crc32c(second), len(second)) == crc32c(first + second)


@given(first=st.binary(max_size=64), zeros=st.integers(0, 1 << 21))
def test_long_seconds(first: bytes, zeros: int) -> None:
    second = bytes(zeros)  # long, and cheap to make: every length bit is exercised
    assert crc32c_combine(crc32c(first), crc32c(second), zeros) == crc32c(first + second)


@given(first=st.binary(max_size=200), second=st.binary(max_size=5000))
def test_the_second_crc_is_recovered_from_the_joined_and_the_first(
    first: bytes, second: bytes
) -> None:
    joined = crc32c(first + second)
    assert crc32c_of_second(joined, crc32c(first), len(second)) == crc32c(second)


def test_an_empty_second_leaves_the_first() -> None:
    assert crc32c_combine(0x12345678, crc32c(b""), 0) == 0x12345678


@pytest.mark.parametrize("length", [-1, 1 << 64])
def test_lengths_out_of_range_are_refused(length: int) -> None:
    with pytest.raises(ValueError):
        crc32c_combine(0, 0, length)

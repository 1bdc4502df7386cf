"""The acknowledgement cursor: the offset a snapshot may claim to cover (pure logic)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dedup.partitions import AckCursor

pytestmark = pytest.mark.unit


def test_an_unsettled_write_holds_the_cursor_back_until_it_settles() -> None:
    cursor = AckCursor(10)
    first, second = cursor.submitted(), cursor.submitted()
    cursor.settled(second, 30, 5)
    assert cursor.safe_end == 10, "the write below it may still land"
    cursor.settled(first, 25, 5)
    assert (cursor.safe_end, cursor.records_settled, cursor.unsettled) == (30, 10, 0)


def test_a_failed_or_offsetless_write_does_not_hold_the_cursor_back() -> None:
    cursor = AckCursor(0)
    failed, duplicate, written = cursor.submitted(), cursor.submitted(), cursor.submitted()
    cursor.settled(failed, None, 0)
    cursor.settled(duplicate, None, 3)  # Kafka: a repeat of an earlier append, offset unknown
    cursor.settled(written, 12, 2)
    assert (cursor.safe_end, cursor.records_settled) == (12, 5)


@given(
    st.lists(st.integers(min_value=1, max_value=20), min_size=1, max_size=30).flatmap(
        lambda sizes: st.tuples(st.just(sizes), st.permutations(range(len(sizes))))
    ),
)
def test_the_cursor_is_the_end_of_the_longest_settled_prefix(
    case: tuple[list[int], list[int]],
) -> None:
    sizes, order = case
    start = 100
    cursor = AckCursor(start)
    tickets = [cursor.submitted() for _ in sizes]
    ends = [start + sum(sizes[: i + 1]) for i in range(len(sizes))]
    settled: set[int] = set()
    for index in order:
        cursor.settled(tickets[index], ends[index], sizes[index])
        settled.add(index)
        prefix = 0
        while prefix in settled:
            prefix += 1
        assert cursor.safe_end == (ends[prefix - 1] if prefix else start)
        assert cursor.records_settled == sum(sizes[:prefix])
        assert cursor.unsettled == len(sizes) - prefix

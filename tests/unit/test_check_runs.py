"""`dedup.state.check_runs`: a batch's (producer, sequence) list as runs of consecutive
sequences, what the check script gets instead of one entry per record."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dedup.state import SEQUENCE_MAX, SEQUENCE_MIN, check_runs

pytestmark = pytest.mark.unit


def test_runs_end_at_a_producer_change_a_step_other_than_one_and_a_wrap() -> None:
    assert check_runs([]) == []
    assert check_runs([("a", 5)]) == [("a", 5, 5, 1)]
    identities = [
        *(("a", 0), ("a", 1), ("a", 2)),
        ("b", 3),  # another producer
        ("a", 3),  # a again: a new run, though its sequence follows
        ("a", 5),  # a hole
        ("a", 5),  # a repeat
        ("a", 4),  # going down
        *(("k", 2**31 - 1), ("k", 0), ("k", 1)),  # an implicit sequence wrapping
        *(("m", SEQUENCE_MAX - 1), ("m", SEQUENCE_MAX)),
        *(("n", SEQUENCE_MIN), ("n", SEQUENCE_MIN + 1), ("n", -1), ("n", 0), ("n", 1)),
    ]
    assert check_runs(identities) == [
        ("a", 0, 2, 3),
        ("b", 3, 3, 1),
        ("a", 3, 3, 1),
        ("a", 5, 5, 1),
        ("a", 5, 5, 1),
        ("a", 4, 4, 1),
        ("k", 2**31 - 1, 2**31 - 1, 1),
        ("k", 0, 1, 2),
        ("m", SEQUENCE_MAX - 1, SEQUENCE_MAX, 2),
        ("n", SEQUENCE_MIN, SEQUENCE_MIN + 1, 2),
        ("n", -1, 1, 3),
    ]


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["a", "b"]),
            st.one_of(st.integers(-3, 3), st.integers(SEQUENCE_MIN, SEQUENCE_MAX)),
            st.integers(1, 4),
        )
    )
)
def test_runs_are_maximal_and_give_back_every_record(
    segments: list[tuple[str, int, int]],
) -> None:
    identities = [(p, s) for p, first, n in segments for s in range(first, first + n)]
    runs = check_runs(identities)
    assert [(p, s) for p, first, last, n in runs for s in range(first, last + 1)] == identities
    assert all(last == first + n - 1 for _, first, last, n in runs)
    for (p, _, last, _), (q, first, _, _) in itertools.pairwise(runs):
        assert not (p == q and first == last + 1), "two runs that are one"

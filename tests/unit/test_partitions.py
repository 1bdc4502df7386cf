"""The refusals a partition keeps for requests behind one not written (`PartitionState`)."""

from __future__ import annotations

import pytest

from dedup.partitions import (
    MAX_CONNECTIONS_REFUSED,
    MAX_PRODUCERS_REFUSED,
    PartitionState,
    Reach,
)

pytestmark = pytest.mark.unit


def test_a_refusal_on_a_connection_refuses_that_connections_requests_admitted_so_far() -> None:
    state = PartitionState(admitted=3)
    state.refuse_behind(Reach.CONNECTION, "a")
    state.admitted = 4  # admitted after the refusal was decided: sent after its answer
    assert [state.refuses(n, "a") for n in (2, 3, 4)] == [Reach.CONNECTION, Reach.CONNECTION, None]
    assert state.refuses(3, "b") is None
    assert state.refuses(3, None) is None


def test_a_refusal_of_the_partition_refuses_every_connections_requests() -> None:
    state = PartitionState(admitted=3, refuse_through=3)
    state.refuse_behind(Reach.CONNECTION, "a")
    assert state.refuses(3, "a") is Reach.PARTITION
    assert state.refuses(3, "b") is Reach.PARTITION
    assert state.refuses(4, "a") is None


def test_refusals_on_more_connections_than_the_bound_refuse_every_request() -> None:
    """A client that opens connection after connection cannot grow the partition's memory:
    beyond the bound, a refusal holds back every request admitted so far, as before."""
    state = PartitionState(admitted=7)
    for connection in range(MAX_CONNECTIONS_REFUSED):
        state.refuse_behind(Reach.CONNECTION, connection)
    assert state.refuses(7, "elsewhere") is None
    state.refuse_behind(Reach.CONNECTION, 0)  # one already kept: still within the bound
    assert state.refuses(7, "elsewhere") is None
    state.refuse_behind(Reach.CONNECTION, "one more")
    assert len(state.refuse_through_on) == MAX_CONNECTIONS_REFUSED
    assert state.refuses(7, "elsewhere") is Reach.PARTITION


def test_connection_refusals_are_let_go_once_every_request_admitted_is_released() -> None:
    state = PartitionState(admitted=2)
    state.refuse_behind(Reach.CONNECTION, "a")
    state.released_one()
    assert state.refuses(2, "a") is Reach.CONNECTION, "one request still under way"
    state.released_one()
    assert state.refuse_through_on == {}
    assert state.released == 2


def test_a_refusal_of_itself_refuses_none_and_of_an_unknown_connection_every_one() -> None:
    state = PartitionState(admitted=3)
    state.refuse_behind(Reach.ITSELF, "a")
    assert [state.refuses(3, c) for c in ("a", None)] == [None, None]
    state.refuse_behind(Reach.CONNECTION, None)
    assert [state.refuses(3, c) for c in ("a", None)] == [Reach.PARTITION, Reach.PARTITION]


def test_a_refusal_of_producers_refuses_the_requests_naming_one_of_them() -> None:
    state = PartitionState(admitted=3)
    state.refuse_behind(Reach.PRODUCERS, "a", ["p", "q"])
    state.admitted = 4  # admitted after the refusal was decided: sent after its answer
    assert state.refuses(3, "b", lambda: ["q", "r"]) is Reach.PRODUCERS
    assert state.refuses(3, "a", lambda: ["r"]) is None, "not its connection's to hold"
    assert state.refuses(3, "a", lambda: []) is None
    assert state.refuses(4, "b", lambda: ["p"]) is None
    state.released_one()
    state.released_one()
    state.released_one()
    assert state.refuses(3, "b", lambda: ["p"]) is Reach.PRODUCERS, "one request under way"
    state.released_one()
    assert state.refuse_through_for == {}


def test_refusals_of_more_producers_than_the_bound_refuse_every_request() -> None:
    state = PartitionState(admitted=5)
    state.refuse_behind(Reach.PRODUCERS, "a", [str(n) for n in range(MAX_PRODUCERS_REFUSED - 1)])
    state.refuse_behind(Reach.PRODUCERS, "a", ["0", "last"])  # one new: within the bound
    assert state.refuses(5, "a", lambda: ["elsewhere"]) is None
    state.refuse_behind(Reach.PRODUCERS, "a", ["0", "one more"])
    assert len(state.refuse_through_for) == MAX_PRODUCERS_REFUSED
    assert state.refuses(5, "a", lambda: ["elsewhere"]) is Reach.PARTITION


def test_a_refusal_of_no_producer_refuses_every_request() -> None:
    state = PartitionState(admitted=2)
    state.refuse_behind(Reach.PRODUCERS, "a", [])
    assert state.refuses(2, "b", lambda: ["p"]) is Reach.PARTITION


def test_the_producers_of_a_request_are_asked_only_while_a_producer_refusal_is_kept() -> None:
    def never() -> list[str]:
        raise AssertionError("asked")

    state = PartitionState(admitted=2)
    state.refuse_behind(Reach.CONNECTION, "a")
    assert state.refuses(2, "b", never) is None

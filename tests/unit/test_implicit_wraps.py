"""`dedup.implicit_wraps`: Kafka's implicit sequences counted on past their wrap at 2^31,
read by each reader the produce path has (the Rust scan's uniform batch, record by record),
and written into the log's identity headers as counted on (the Rust rewrite, the rebuild)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dedup.batches import (
    Identity,
    build_batch,
    read_batches,
    rewritten_with_identity_headers,
)
from dedup.implicit_wraps import Wraps, nearest
from tests.support.raw import record_batch

WRAP = 1 << 31
PRODUCER = "kafka-pid-40-1"
REBUILT_AS: dict[str, Any] = {
    "compression": 0,
    "timestamp_type": 0,
    "producer_id": 7,
    "producer_epoch": 0,
    "base_sequence": 0,
    "add_identity_headers": True,
}


def kafka_batch(base_sequence: int, count: int, explicit_at: int | None = None) -> bytes:
    """A Kafka idempotent producer's batch, implicit identities (`explicit_at`: that record
    names an explicit producer in headers instead)."""
    named = [(b"dedup.producer", b"named"), (b"dedup.sequence", b"7")]
    return record_batch(
        [(b"v%d" % i, named if i == explicit_at else []) for i in range(count)],
        (40, 1, base_sequence),
    )


def sequences(batch_bytes: bytes) -> list[int]:
    """The implicit identities' sequences as the produce path reads them, record by record."""
    [batch] = read_batches(batch_bytes)
    return [r.identity.sequence for r in batch.records if r.identity is not None]


def written(batch: object) -> list[tuple[str, int]]:
    """The identities the log's headers will say, for a batch written whole."""
    header, records = rewritten_with_identity_headers(
        batch,  # type: ignore[arg-type]
        producer_id=7,
        producer_epoch=0,
        base_sequence=0,
    )
    [back] = read_batches(bytes(header) + bytes(records), from_log=True)
    return [(r.identity.producer, r.identity.sequence) for r in back.records if r.identity]


@given(
    st.integers(1 << 30, 1 << 62),
    st.integers(-(1 << 30) + 1, (1 << 30) - 1),
)
def test_the_nearest_sequence_is_the_true_one_within_half_a_wrap(last: int, step: int) -> None:
    true = last + 1 + step
    assert nearest(last, true % WRAP) == true


def test_nearest_counts_on_across_the_wrap_and_back_for_retries() -> None:
    assert nearest(WRAP - 1, 0) == WRAP
    assert nearest(WRAP + 5, WRAP - 3) == WRAP - 3, "a retry from before the wrap"
    assert nearest(3 * WRAP + 10, 11) == 3 * WRAP + 11
    assert nearest(5, WRAP - 1) == WRAP - 1, "never below 0"


def test_producers_below_two_to_the_30_are_left_alone() -> None:
    wraps = Wraps()
    [batch] = read_batches(kafka_batch(100, 3))
    assert wraps.unwrap([batch]) is None
    assert len(wraps) == 0


def test_a_uniform_batch_across_the_wrap_counts_on() -> None:
    wraps = Wraps()
    [batch] = read_batches(kafka_batch(WRAP - 2, 4))
    assert batch.run is not None and batch.run.runs() == [
        (PRODUCER, WRAP - 2, WRAP - 1, 2),
        (PRODUCER, 0, 1, 2),
    ], "as read: Kafka's sequences"
    [unwrapped] = wraps.unwrap([batch]) or []
    assert unwrapped.run is not None
    assert unwrapped.run.runs() == [(PRODUCER, WRAP - 2, WRAP + 1, 4)]
    expected = [WRAP - 2, WRAP - 1, WRAP, WRAP + 1]
    assert [r.identity.sequence for r in unwrapped.records if r.identity] == expected
    assert written(unwrapped) == [(PRODUCER, s) for s in expected], "the Rust rewrite"
    # The next batch, Kafka's 2..3, goes on from there.
    [after] = wraps.unwrap(read_batches(kafka_batch(2, 2))) or []
    assert after.run is not None and after.run.runs() == [(PRODUCER, WRAP + 2, WRAP + 3, 2)]
    assert written(after) == [(PRODUCER, WRAP + 2), (PRODUCER, WRAP + 3)]


def test_a_batch_read_record_by_record_keeps_its_explicit_identities() -> None:
    wraps = Wraps()
    wraps.seed({PRODUCER: (WRAP + 9, 0)})
    [batch] = read_batches(kafka_batch(10, 3, explicit_at=1))
    assert batch.run is None, "not uniform: read record by record"
    [unwrapped] = wraps.unwrap([batch]) or []
    assert [r.identity for r in unwrapped.records] == [
        Identity(PRODUCER, WRAP + 10),
        Identity("named", 7),
        Identity(PRODUCER, WRAP + 12),
    ]
    # As after dropping duplicates: the records kept, rebuilt with identity headers.
    rebuilt = build_batch(list(unwrapped.records), **REBUILT_AS)
    [back] = read_batches(rebuilt, from_log=True)
    assert [r.identity for r in back.records] == [r.identity for r in unwrapped.records]


def test_seeded_from_a_recovered_state_only_with_implicit_producers_near_the_wrap() -> None:
    wraps = Wraps()
    wraps.seed(
        {
            PRODUCER: (2 * WRAP + 5, 0),
            "kafka-pid-41-0": (17, 0),  # far below the wrap: its sequences are its own
            "orders-loader": (3 * WRAP, 0),  # explicit: never unwrapped
        }
    )
    assert len(wraps) == 1
    [batch] = wraps.unwrap(read_batches(kafka_batch(6, 1))) or []
    assert [r.identity.sequence for r in batch.records if r.identity] == [2 * WRAP + 6]
    wraps.forget([PRODUCER])
    assert wraps.unwrap(read_batches(kafka_batch(6, 1))) is None


@pytest.mark.parametrize(("retry_base", "unwrapped_base"), [(WRAP - 2, WRAP - 2), (0, WRAP)])
def test_a_retry_sent_again_after_the_wrap_reads_as_it_did(
    retry_base: int, unwrapped_base: int
) -> None:
    wraps = Wraps()
    assert wraps.unwrap(read_batches(kafka_batch(WRAP - 2, 4))) is not None
    retry = read_batches(kafka_batch(retry_base, 2))
    [again] = wraps.unwrap(retry) or retry  # None: its sequences are Kafka's as they are
    assert [r.identity.sequence for r in again.records if r.identity] == [
        unwrapped_base,
        unwrapped_base + 1,
    ]

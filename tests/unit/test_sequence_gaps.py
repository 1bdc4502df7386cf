"""Kafka's sequence-gap rule per partition (`dedup.sequence_gaps.SequenceGaps`), by example
and under hypothesis: what skips ahead, what is a retry, the wrap at 2^31, producers not
known, the bound on how many are kept, and batches the rule leaves alone."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dedup.sequence_gaps import SEQUENCE_MODULUS, SequenceGaps

pytestmark = pytest.mark.unit


@dataclass
class Batch:
    """The fields of `dedup.batches.IncomingBatch` the rule reads."""

    base_sequence: int
    count: int
    producer_id: int = 7
    producer_epoch: int = 0
    transactional: bool = False
    control: bool = False
    implicit_identities: bool = False
    records: list[None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.records = [None] * self.count


def batch(base: int, count: int = 4, **fields: Any) -> list[Any]:
    return [Batch(base, count, **fields)]


def test_the_next_batch_follows_the_last_accepted_one_and_a_skip_is_a_gap() -> None:
    gaps = SequenceGaps()
    assert gaps.gap(batch(0)) is None  # not known: may start anywhere
    gaps.accepted(batch(0))
    assert gaps.gap(batch(4)) is None
    assert gaps.gap(batch(8)) == (
        "sequence 8 of Kafka producer 7 (epoch 0) skips ahead of 4: "
        "a request it sent before this one is still to come"
    )
    # Retries of what was accepted, whole or in part, are no gap (the check sorts them).
    assert gaps.gap(batch(0)) is None and gaps.gap(batch(2)) is None


def test_a_refused_batch_must_come_again_before_anything_after_it() -> None:
    gaps = SequenceGaps()
    gaps.accepted(batch(0))
    gaps.accepted(batch(4))
    gaps.accepted(batch(8))  # in flight: next is 12
    gaps.refused(batch(4))  # not written
    gaps.refused(batch(8))  # refused behind it: next stays at 4
    assert gaps.gap(batch(8)) is not None and gaps.gap(batch(12)) is not None
    assert gaps.gap(batch(4)) is None
    gaps.accepted(batch(4))
    assert gaps.gap(batch(8)) is None


def test_a_producer_whose_first_batch_was_refused_is_known_from_then_on() -> None:
    gaps = SequenceGaps()
    gaps.refused(batch(100))
    assert gaps.gap(batch(104)) is not None
    assert gaps.gap(batch(100)) is None


def test_producers_epochs_and_batches_the_rule_leaves_alone() -> None:
    gaps = SequenceGaps()
    gaps.accepted(batch(0))
    assert gaps.gap(batch(50, producer_epoch=1)) is None  # a new epoch: a new producer
    assert gaps.gap(batch(50, producer_id=8)) is None
    for alone in (
        batch(50, producer_id=-1),  # not idempotent
        batch(50, producer_epoch=-1),
        batch(-1),  # no sequence
        batch(50, transactional=True),
        batch(50, control=True),
    ):
        assert gaps.gap(alone) is None
        gaps.accepted(alone)
        gaps.refused(alone)
    assert gaps.gap(batch(4)) is None and len(gaps) == 1


def test_several_batches_of_one_producer_in_one_partition_batch_follow_each_other() -> None:
    gaps = SequenceGaps()
    gaps.accepted(batch(0))
    assert gaps.gap([*batch(4), *batch(8)]) is None
    assert gaps.gap([*batch(4), *batch(9)]) is not None


def test_sequences_wrap_at_two_to_the_31() -> None:
    gaps = SequenceGaps()
    gaps.accepted(batch(SEQUENCE_MODULUS - 2))  # ends past the wrap: next is 2
    assert gaps.gap(batch(2)) is None
    assert gaps.gap(batch(3)) is not None
    assert gaps.gap(batch(SEQUENCE_MODULUS - 2)) is None  # a retry from before the wrap


def test_the_least_recently_seen_producers_go_beyond_the_bound_and_forget_clears() -> None:
    gaps = SequenceGaps(max_producers=2)
    for producer_id in (1, 2, 1, 3):
        gaps.accepted(batch(0, producer_id=producer_id))
    assert len(gaps) == 2
    assert gaps.gap(batch(8, producer_id=2)) is None  # gone: not known any more
    assert gaps.gap(batch(8, producer_id=1)) is not None
    gaps.forget()
    assert len(gaps) == 0 and gaps.gap(batch(8, producer_id=1)) is None
    with pytest.raises(ValueError, match="at least 1"):
        SequenceGaps(max_producers=0)


def test_a_recovered_state_seeds_the_kafka_producers_its_log_names() -> None:
    """A new owner knows each Kafka producer of the log, by its implicit identity, as
    Kafka's new leader knows it from its replica: the next batch follows the last record."""
    gaps = SequenceGaps()
    gaps.seed(
        {
            "kafka-pid-7-0": (11, 1_000),  # next: 12
            "kafka-pid-8-2": (SEQUENCE_MODULUS + 4, 1_000),  # unwrapped past the wrap: 5
            "orders-service": (99, 1_000),  # an explicit name: no Kafka sequences
            "kafka-pid-x-0": (3, 1_000),  # not an implicit identity's form
        },
        first_sequence_wait_s=0,
    )
    assert len(gaps) == 2
    assert gaps.gap(batch(12)) is None
    assert gaps.gap(batch(16)) is not None, "the request for 12.. is still to come"
    assert gaps.gap(batch(0)) is None, "a re-send of what the log holds is no gap"
    assert gaps.gap(batch(5, producer_id=8, producer_epoch=2)) is None
    assert gaps.gap(batch(9, producer_id=8, producer_epoch=2)) is not None
    assert gaps.gap(batch(40, producer_epoch=1)) is None, "a new epoch starts anywhere"


def test_seeding_replaces_what_was_seen_and_keeps_the_most_recently_seen_within_the_bound() -> None:
    gaps = SequenceGaps(max_producers=2)
    gaps.accepted(batch(0, producer_id=1))  # next: 4, seen before the partition changed hands
    gaps.seed(
        {"kafka-pid-1-0": (99, 3), "kafka-pid-2-0": (9, 2), "kafka-pid-3-0": (19, 1)},
        first_sequence_wait_s=0,
    )
    assert len(gaps) == 2
    assert gaps.gap(batch(4, producer_id=1)) is None, "behind the log's 100: a re-send"
    assert gaps.gap(batch(104, producer_id=1)) is not None  # the log's: next is 100
    assert gaps.gap(batch(14, producer_id=2)) is not None  # next is 10
    assert gaps.gap(batch(24, producer_id=3)) is None  # the least recently seen: not kept


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_after_a_seed_a_producer_the_log_does_not_name_starts_at_zero_for_a_while() -> None:
    """Its first request may still come from the owner before: a later one written first
    would make it read as duplicates. Implicit identities only (an explicit one's log
    carries no Kafka sequence), and only for the wait (a producer whose records the log
    lost may start anywhere then, as with Kafka)."""
    clock = Clock()
    gaps = SequenceGaps(clock=clock)
    gaps.seed({"kafka-pid-7-0": (11, 1_000)}, first_sequence_wait_s=60)
    new = {"producer_id": 9, "implicit_identities": True}
    gap = gaps.gap(batch(4, **new))
    assert gap is not None and "sequence 0, sent to the owner before, may still come" in gap
    gaps.refused(batch(4, **new))
    assert gaps.gap(batch(4, **new)) is not None, "refused, it still waits for 0, not for 4"
    assert gaps.gap(batch(12, implicit_identities=True)) is None, "known: goes on from the log"
    assert gaps.gap(batch(4, producer_id=9)) is None, "explicit identities: met anew"
    assert gaps.gap(batch(4, producer_epoch=1, implicit_identities=True)) is not None
    assert gaps.gap(batch(0, **new)) is None
    gaps.accepted(batch(0, **new))
    assert gaps.gap(batch(4, **new)) is None, "after 0-3, 4 follows"
    clock.now += 60
    assert gaps.gap(batch(8, producer_id=10, implicit_identities=True)) is None, "waited"
    gaps.refused(batch(8, producer_id=10, implicit_identities=True))
    assert gaps.gap(batch(12, producer_id=10, implicit_identities=True)) is not None


def test_the_wait_for_sequence_zero_ends_when_the_partition_is_forgotten() -> None:
    gaps = SequenceGaps(clock=Clock())
    gaps.seed({}, first_sequence_wait_s=60)
    assert gaps.gap(batch(4, implicit_identities=True)) is not None
    gaps.forget()  # its producers go on at another owner
    assert gaps.gap(batch(4, implicit_identities=True)) is None
    gaps.seed({}, first_sequence_wait_s=0)
    assert gaps.gap(batch(4, implicit_identities=True)) is None, "no wait"


@given(
    st.integers(0, SEQUENCE_MODULUS - 1),
    st.integers(1, 200),
    st.integers(-(1 << 29), 1 << 29),
)
def test_a_gap_is_exactly_a_batch_ahead_of_the_next_sequence(
    base: int, count: int, shift: int
) -> None:
    gaps = SequenceGaps()
    gaps.accepted(batch(base, count))
    following = (base + count) % SEQUENCE_MODULUS
    sent = (following + shift) % SEQUENCE_MODULUS
    assert (gaps.gap(batch(sent)) is not None) == (shift > 0)

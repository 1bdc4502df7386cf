"""Implicit sequences past Kafka's wrap: 2^31 records per producer session, and on.

Kafka numbers an idempotent producer's records to a partition with int32 sequences that
wrap from 2^31-1 to 0 (`DefaultRecordBatch.incrementSequence`), and a long-lived producer
does wrap: at 100,000 records/s to one partition, within six hours. An implicit identity is
that sequence (`dedup.batches`). Compared as numbers, the records after a wrap would read as
old duplicates of the first ones, be dropped and be answered success: lost.

So the owner unwraps them before the check. A batch's implicit sequences become the int64
sequence of the same record counted from the producer's first (`n * 2^31 + Kafka's`): the
one nearest to the producer's last known (`nearest`). Those are what the check compares and
what the identity headers in the log say, so a replay reads them back unwrapped, and the
check, Redis's maps and the snapshots need nothing of this.

The nearest one is right while the producer's records since its last known sequence are
fewer than 2^30 either way: a producer numbers its batches without holes and keeps at most
a few in flight. Per partition, `Wraps` keeps the last known sequence of the implicit
producers that reached 2^30, the only ones that can be near a wrap: any other's sequences
are its own. Recovery seeds it from the state it loads; each batch queued for the check
moves it on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from dedup.batches import (
    IMPLICIT_PRODUCER_PREFIX,
    IMPLICIT_SEQUENCE_MODULUS,
    Identity,
    IncomingBatch,
    IncomingRecord,
    LazyRecords,
    implicit_producer,
    kafka_sequenced,
)

_NEAR = 1 << 30  # half the wrap: how far from the last known a sequence may lie


def nearest(last: int, sequence: int) -> int:
    """The sequence congruent to Kafka's ``sequence`` modulo 2^31 nearest to ``last + 1``
    (never below 0)."""
    expected = last + 1
    candidate = expected - expected % IMPLICIT_SEQUENCE_MODULUS + sequence
    if candidate - expected >= _NEAR:
        candidate -= IMPLICIT_SEQUENCE_MODULUS
    elif expected - candidate > _NEAR:
        candidate += IMPLICIT_SEQUENCE_MODULUS
    return candidate if candidate >= 0 else candidate + IMPLICIT_SEQUENCE_MODULUS


class Wraps:
    """The last known unwrapped sequence of each implicit producer of one partition that
    reached 2^30."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._last)

    def seed(self, producers: Mapping[str, tuple[int, int]]) -> None:
        """From a recovered state: producer -> (sequence, last seen ms)."""
        self._last = {
            name: sequence
            for name, (sequence, _) in producers.items()
            if name.startswith(IMPLICIT_PRODUCER_PREFIX) and sequence >= _NEAR
        }

    def unwrap(self, batches: list[IncomingBatch]) -> list[IncomingBatch] | None:
        """The batches with their implicit sequences unwrapped, or None when that changes
        none of them (the usual case: every producer below 2^31)."""
        changed: list[IncomingBatch] | None = None
        for index, batch in enumerate(batches):
            if not (batch.implicit_identities and kafka_sequenced(batch)):
                continue
            if not self._last and batch.base_sequence + len(batch.records) <= _NEAR:
                continue  # the usual batch: a producer far below the wrap
            producer = implicit_producer(batch.producer_id, batch.producer_epoch)
            last = self._last.get(producer)
            first = batch.base_sequence if last is None else nearest(last, batch.base_sequence)
            end = first + len(batch.records) - 1
            if end >= _NEAR:
                self._last[producer] = end if last is None else max(last, end)
            if first != batch.base_sequence or end >= IMPLICIT_SEQUENCE_MODULUS:
                changed = changed or list(batches)
                changed[index] = _unwrapped(batch, producer, first)
        return changed

    def forget(self, producers: list[str] | tuple[str, ...] | None = None) -> None:
        """These producers (evicted from the state), or all (the partition changed hands)."""
        if producers is None:
            self._last.clear()
        for name in producers or ():
            self._last.pop(name, None)


def _unwrapped(batch: IncomingBatch, producer: str, first: int) -> IncomingBatch:
    """The batch with each implicit identity's sequence `first + offset delta`; the
    identities its records name in headers stay as they are."""
    base = batch.base_sequence

    def unwrapped(record: IncomingRecord) -> IncomingRecord:
        identity = record.identity
        if (
            identity is None
            or identity.producer != producer
            or identity.sequence != (base + record.offset_delta) % IMPLICIT_SEQUENCE_MODULUS
        ):
            return record
        return replace(record, identity=Identity(producer, first + record.offset_delta))

    records = batch.records
    if isinstance(records, LazyRecords):  # still undecoded: unwrapped when they are
        kept = records
        unwrapped_records: tuple[IncomingRecord, ...] | LazyRecords = LazyRecords(
            len(kept), lambda: tuple(unwrapped(record) for record in kept)
        )
    else:
        unwrapped_records = tuple(unwrapped(record) for record in records)
    run = batch.run
    if run is not None and run.implicit:
        run = replace(run, first=first, unwrapped=True)
    return replace(batch, records=unwrapped_records, run=run)

"""Kafka's sequence-gap rule, for the clients that keep it: Kafka's idempotent producers.

A Kafka idempotent producer (a producer id and epoch in its record batches: Kafka's Java
client since 3.0 by default, librdkafka with ``enable.idempotence``, `dedup.client`) numbers
the batches it sends to a partition without holes, whatever identities the proxy reads from
their records (implicit, explicit headers, or both). Kafka's broker refuses a batch that
skips ahead (``OUT_OF_ORDER_SEQUENCE_NUMBER``): an earlier batch is still to come.

The proxy needs that rule for the one hazard its ordering cannot see otherwise
(docs/design.md, "Ordering"): a request answered "retry" refuses the requests admitted
behind it, but a request of the same producer that arrives after that answer was decided,
sent before its client read it, would be written ahead of the retry, whose records would
then read as old duplicates and be dropped. Such a request skips ahead of what this owner
accepted or refused of its producer, so it is refused too, retriable. A batch refused so
holds back nothing behind it (`dedup.partitions.Reach.ITSELF`): the rule refuses its
producer's later batches itself, and another producer's have no reason to wait, as at
Kafka's broker.

Per partition, per Kafka producer (id, epoch): the sequence its next batch must start at,
as this owner has seen the partition while holding its lease (the engine records nothing
otherwise, and `forget` empties it at a handoff or loss: what another instance accepts
meanwhile is unknown here). A batch is taken as accepted when its
check is queued; the expectation goes back to its first sequence when it is answered
"retry" (the client sends it again), and passes over it when it is refused for good (the
client never does). A producer not known may start anywhere, as with Kafka.

When an owner takes a partition another instance may have written (`seed`), it starts
from the log, as Kafka's new leader starts from its replica's producer state: each producer
the log names by its implicit identity (Kafka's producer id, epoch and sequence, in the
identity headers) must go on after its last record there. So a request that reaches the
new owner ahead of one its producer sent to the old owner is refused too. Producers the log
names by explicit identities only carry no Kafka sequence there, and are met anew.

A producer with implicit identities that the log does not name may have sent its first
request to the old owner, unwritten there and still to come: for `first_sequence_wait_s`
after the seed, such a producer must start at sequence 0 (where a Kafka producer starts on
every partition, under each producer id and epoch). A later request that came first would
be written ahead of it, and the records of the first would then read as duplicates of that
producer and be dropped while acknowledged. After the wait, a producer not known may start
anywhere again (one whose records the log lost to retention or compaction, or that the
state purged as idle): the wait bounds what such a producer can be held up.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping

from dedup.batches import IncomingBatch, kafka_producer_of, kafka_sequenced

SEQUENCE_MODULUS = 1 << 31  # Kafka's sequences wrap there
_AHEAD = 1 << 30  # a distance below this, modulo the wrap, is "ahead"; above, "behind"
DEFAULT_MAX_PRODUCERS = 10_000  # per partition; the least recently seen go beyond it

_Producer = tuple[int, int]  # Kafka's producer id and epoch


def _ahead(sequence: int, of: int) -> bool:
    """Whether `sequence` comes after `of`, with wrap-around (Kafka's numbering)."""
    return 0 < (sequence - of) % SEQUENCE_MODULUS < _AHEAD


def _sequenced(
    batches: Iterable[IncomingBatch],
) -> Iterable[tuple[IncomingBatch, _Producer, int, int]]:
    """(batch, producer, first sequence, records) of each batch of an idempotent producer."""
    for batch in batches:
        if kafka_sequenced(batch):
            producer = (batch.producer_id, batch.producer_epoch)
            yield batch, producer, batch.base_sequence, len(batch.records)


class SequenceGaps:
    """The next sequence each Kafka producer must send to one partition."""

    def __init__(
        self,
        max_producers: int = DEFAULT_MAX_PRODUCERS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_producers < 1:
            raise ValueError(f"max_producers must be at least 1: {max_producers}")
        self._max = max_producers
        self._clock = clock
        self._next: OrderedDict[_Producer, int] = OrderedDict()
        # Until then (clock time), a producer with implicit identities not known here must
        # start at sequence 0: its first request may still come from the previous owner.
        self._from_zero_until = float("-inf")

    def __len__(self) -> int:
        return len(self._next)

    def gap(self, batches: Iterable[IncomingBatch]) -> str | None:
        """Why this partition batch skips ahead of its producer's next sequence; None if it
        does not (or its producer is not known here, or not idempotent)."""
        expected: dict[_Producer, int] = {}
        for batch, producer, first, count in _sequenced(batches):
            following = expected.get(producer, self._next.get(producer))
            if following is None and self._from_zero(batch, first):
                producer_id, epoch = producer
                return (
                    f"sequence {first} of Kafka producer {producer_id} (epoch {epoch}) is its "
                    "first here since the partition changed owner, and the log does not name "
                    "it: its sequence 0, sent to the owner before, may still come"
                )
            if following is not None and _ahead(first, following):
                producer_id, epoch = producer
                return (
                    f"sequence {first} of Kafka producer {producer_id} (epoch {epoch}) skips "
                    f"ahead of {following}: a request it sent before this one is still to come"
                )
            expected[producer] = (first + count) % SEQUENCE_MODULUS
        return None

    def accepted(self, batches: Iterable[IncomingBatch]) -> None:
        """The batches go on to the check: their producers' next sequence follows them
        (never moving back: a retry of what was accepted already is no gap)."""
        for _, producer, first, count in _sequenced(batches):
            self._move(producer, (first + count) % SEQUENCE_MODULUS, on=True)

    def refused(self, batches: Iterable[IncomingBatch]) -> None:
        """The batches were not written: their producers must send them again before
        anything after them (a producer not known yet is known from here on, unless it
        must still start at 0)."""
        for batch, producer, first, _ in _sequenced(batches):
            if producer not in self._next and self._from_zero(batch, first):
                continue  # known from here on, it would wait for `first`, not for 0
            self._move(producer, first, on=False)

    def _from_zero(self, batch: IncomingBatch, first: int) -> bool:
        """Whether this batch, of a producer not known here, must start at sequence 0."""
        return first != 0 and batch.implicit_identities and self._clock() < self._from_zero_until

    def _move(self, producer: _Producer, sequence: int, *, on: bool) -> None:
        """The producer's next sequence to `sequence` if that moves it on (`on`) or back;
        the least recently seen producer goes beyond the bound."""
        known = self._next.get(producer)
        if known is None or (_ahead(sequence, known) if on else _ahead(known, sequence)):
            self._next[producer] = sequence
        self._next.move_to_end(producer)
        if len(self._next) > self._max:
            self._next.popitem(last=False)

    def forget(self) -> None:
        """The partition changed hands: what its producers sent meanwhile is not known."""
        self._next.clear()
        self._from_zero_until = float("-inf")

    def seed(self, producers: Mapping[str, tuple[int, int]], first_sequence_wait_s: float) -> None:
        """The partition's producers as its log alone tells (a new owner): from a recovered
        state (producer name -> (last sequence, last seen ms)), each Kafka producer the log
        names by its implicit identity must go on after its last record there, as Kafka's
        new leader expects of a producer its replica knows. The most recently seen are kept
        within the bound. For `first_sequence_wait_s` from now, a producer with implicit
        identities that the log does not name must start at sequence 0."""
        self._from_zero_until = self._clock() + first_sequence_wait_s
        known = sorted(
            (last_seen, producer, sequence)
            for name, (sequence, last_seen) in producers.items()
            if (producer := kafka_producer_of(name)) is not None
        )
        self._next = OrderedDict(
            (producer, (sequence + 1) % SEQUENCE_MODULUS)
            for _, producer, sequence in known[-self._max :]
        )

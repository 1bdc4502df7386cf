"""Where a producer's latest batches went in the log, so that a batch sent again and dropped
whole as duplicates is answered as Kafka's broker answers one: with the offset and the log
append time it gave the original (Kafka keeps the last 5 batches of each producer for this,
`ProducerStateEntry`; a Java producer then reports the record's real offset, not -1).

Only what this instance wrote under its current hold of the partition is known (an append
is kept with the partition's recovery token, which names the lease and the topic's
incarnation: while it holds, no one else writes the partition), for the latest
``max_producer_partitions`` (producer, partition) pairs to write. A re-send that meets
none of it (another instance wrote the original, or the partition changed hands or was
created again since) is answered -1, as before; so is one that is not exactly a batch
written. A partition Kafka says it does not have forgets its own.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from dedup import metrics
from dedup.partitions import Key

BATCHES_PER_PRODUCER = 5  # Kafka's: at most 5 requests of an idempotent producer in flight


@dataclass(frozen=True, slots=True)
class Append:
    """One batch as written: the producer's sequences ``first`` .. ``first + count - 1``."""

    first: int
    count: int
    base_offset: int
    log_append_time_ms: int  # -1 for a topic with create-time timestamps
    token: str  # the partition's recovery token it was written under


class RecentAppends:
    def __init__(self, max_producer_partitions: int) -> None:
        self._max = max_producer_partitions
        # Per partition and producer, its latest appends; the least recently written first.
        self._appends: OrderedDict[tuple[Key, str], deque[Append]] = OrderedDict()
        self._producers: dict[Key, set[str]] = {}  # to forget a partition without a scan

    def __len__(self) -> int:
        return len(self._appends)

    def record(self, key: Key, producer: str, append: Append) -> None:
        if self._max <= 0:
            return
        entry = (key, producer)
        appends = self._appends.get(entry)
        if appends is None:
            appends = self._appends[entry] = deque(maxlen=BATCHES_PER_PRODUCER)
            self._producers.setdefault(key, set()).add(producer)
            if len(self._appends) > self._max:
                self._drop(next(iter(self._appends)))
            metrics.RECENT_APPEND_PRODUCERS.set(len(self._appends))
        else:
            self._appends.move_to_end(entry)
            last = appends[-1]
            if append.token != last.token or append.first < last.first + last.count:
                # Written under another hold of the partition, or not above the last (the
                # producer started its sequences again: its state purged when idle, or
                # Kafka's wrapped): the earlier appends may no longer say where these
                # sequences are.
                appends.clear()
        appends.append(append)

    def find(self, key: Key, producer: str, first: int, count: int, token: str) -> Append | None:
        """The append of exactly these sequences, if it is among the producer's latest and
        was written under this recovery token."""
        for append in self._appends.get((key, producer), ()):
            if append.first == first and append.count == count and append.token == token:
                return append
        return None

    def forget(self, key: Key) -> None:
        producers = self._producers.get(key)
        if not producers:
            return  # the common case: a partition that never existed
        for producer in list(producers):
            self._drop((key, producer))
        metrics.RECENT_APPEND_PRODUCERS.set(len(self._appends))

    def _drop(self, entry: tuple[Key, str]) -> None:
        key, producer = entry
        del self._appends[entry]
        producers = self._producers[key]
        producers.discard(producer)
        if not producers:
            del self._producers[key]

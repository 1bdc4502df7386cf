"""Where a producer's latest batches went in the log, so that a batch sent again and dropped
whole as duplicates is answered as Kafka's broker answers one: with the offset and the log
append time it gave the original (Kafka keeps the last 5 batches of each producer for this,
`ProducerStateEntry`; a Java producer then reports the record's real offset, not -1).

Three sources, each kept with the partition's recovery token (it names the lease and the
topic's incarnation: while it holds, no one else writes the partition), for the latest
``max_producer_partitions`` (producer, partition) pairs:
- the batches this instance wrote whole under its current hold of the partition;
- what the recovery that opened that hold read near the end of the log's tail (`seed`):
  each producer's latest runs there, consecutive sequences at consecutive offsets. A batch
  whose answer was lost with the instance that wrote it (a crash, or this one before a
  restart) is found in them, as Kafka's new leader finds the original in the producer
  state it replicated.
- what the snapshot that recovery started from carries: the appends its owner knew below
  its offset (`latest`), so the owner a partition is handed over to answers them too.
An append that continues the producer's last one (its sequences and its offsets right
after, of one log append time) is merged into it: the latest 5 are runs, and a producer
that nothing else writes between keeps a single run however many batches it sends, so that
a blind re-send after its restart is answered from it too. Kafka's 5 batches are what its
producers' retries need; a re-send from the last checkpoint goes back further. A re-send is
answered from a run it lies within, since a run's sequences are at consecutive offsets. One
that lies within none (older than the producer's latest 5 runs, or across a gap in the
log such as a fence's marker) is answered -1, as before. A partition Kafka says it does
not have forgets its own.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dedup import metrics
from dedup.partitions import Key

BATCHES_PER_PRODUCER = 5  # Kafka's: at most 5 requests of an idempotent producer in flight


@dataclass(slots=True)
class Append:
    """One batch as written, or a run of them as read from the log: the producer's
    sequences ``first`` .. ``first + count - 1``, at offsets from ``base_offset`` on.

    `RecentAppends.record` keeps the one it is given and grows it in place as the
    producer's next appends continue it (a frozen one built anew at each write doubled
    the cost of recording it), so its callers build a fresh one per write and keep none;
    what it answers (`RecentAppends.find`, `RecentAppends.latest`) is built anew."""

    first: int
    count: int
    base_offset: int
    log_append_time_ms: int  # -1 for a topic with create-time timestamps
    token: str  # the partition's recovery token it was written under

    def continued_by(self, append: Append) -> bool:
        """Whether ``append`` follows this one in the producer's sequences and in the log,
        of one log append time: every sequence of both is then at this one's base offset
        plus its distance from this one's first."""
        return (
            append.first == self.first + self.count
            and append.base_offset == self.base_offset + self.count
            and append.log_append_time_ms == self.log_append_time_ms
        )

    def part(self, first: int, count: int) -> Append:
        """Sequences ``first`` .. ``first + count - 1`` of this one, where they are."""
        offset = self.base_offset + (first - self.first)
        return Append(first, count, offset, self.log_append_time_ms, self.token)


class RecentAppends:
    def __init__(self, max_producer_partitions: int) -> None:
        self._max = max_producer_partitions
        # Per partition and producer, its latest runs; the least recently written first.
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
            elif last.continued_by(append):
                # Right after the last in sequences and in the log: one run of them, so
                # that a producer no other writes between reaches back further than 5
                # batches (a blind re-send after a restart goes back further than that).
                last.count += append.count
                return
        appends.append(append)

    def seed(
        self, key: Key, runs: Mapping[str, Sequence[tuple[int, int, int, int]]], token: str
    ) -> None:
        """What a recovery read in the log's tail (`dedup.replay.ReplayResult.runs`): each
        producer's latest runs of consecutive sequences at consecutive offsets, kept as its
        appends under the partition's new token. The log is the truth whoever wrote it, so
        a batch the previous owner (or this instance before a restart) wrote and never
        answered is answered from it. Producers are seeded by their latest run's offset,
        oldest first, so that the bound keeps the newest."""
        for producer, produced in sorted(runs.items(), key=lambda item: _latest_offset(item[1])):
            for first, count, base_offset, appended in produced:
                self.record(key, producer, Append(first, count, base_offset, appended, token))

    def find(self, key: Key, producer: str, first: int, count: int, token: str) -> Append | None:
        """Where these sequences were written, if they lie within one of the producer's
        latest runs made under this recovery token: a run holds its sequences at
        consecutive offsets, so a part of it is found as well as the whole. (Appends that
        follow each other in the log were merged into one run as they were recorded.)"""
        end = first + count
        for run in self._appends.get((key, producer), ()):
            if run.token == token and run.first <= first < end <= run.first + run.count:
                return run.part(first, count)
        return None

    def latest(self, key: Key, token: str, below: int) -> dict[str, tuple[Append, ...]]:
        """Per producer of the partition, its appends made under ``token`` below offset
        ``below`` (of a run that goes on past it, the part below), oldest first: what a
        snapshot taken at ``below`` carries (`dedup.snapshots`), so that the next owner
        answers from them too."""
        found = {}
        for producer in self._producers.get(key, ()):
            appends = tuple(
                run.part(run.first, min(run.count, below - run.base_offset))
                for run in self._appends[(key, producer)]
                if run.token == token and run.base_offset < below
            )
            if appends:
                found[producer] = appends
        return found

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


def _latest_offset(runs: Sequence[tuple[int, int, int, int]]) -> int:
    return runs[-1][2] if runs else -1

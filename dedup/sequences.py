"""Pulsar's two sequence maps of one partition, held in the memory of the instance that owns it.

While this instance owns a partition (it holds the lease and recovered the partition), it
alone checks and writes it (`dedup.ownership`), so the check needs no store of its own:
Pulsar's ``MessageDeduplication`` keeps ``highestSequencedPushed`` and
``highestSequencedPersisted`` in the owning broker's memory in just this way, and Kafka keeps
its idempotent producers' state in the partition leader's. What makes a takeover safe is
not a shared store but the log: a new owner fences the old one on Kafka and rebuilds these
maps from a snapshot and the log's tail (`dedup.recovery`). Redis keeps a copy of the
acknowledged positions, written behind (`dedup.persisted`): what other instances read, and
how a Redis that lost it is found out (its token).

Per producer ``p``: ``pushed`` (the highest position accepted for writing), ``persisted``
(the highest Kafka acknowledged), the chunked message in progress beside each
(`ChunkProgress`), and when ``p`` was last seen. The rules are ``dedup/lua/check.lua``'s,
which remains the check when the state is kept in Redis (``check_state = "redis"``); a
property test holds the two to the same answers:

==========================================  =========  =======================================
condition (positions: sequence, chunk id)   status     why
==========================================  =========  =======================================
no ``pushed[p]``, or above it               NOT_DUP    forward it; ``pushed[p]`` rises (later
                                                       records of the batch see it)
at or below ``persisted[p]``                DUP        Kafka acknowledged it: drop, report ok
raised into ``pushed[p]`` by an earlier     DUP        its first copy is in this very batch
record of this batch
at or below ``pushed[p]`` as it was when    UNKNOWN    an earlier write of it is in flight or
the batch started                                      failed: the partition batch is refused
==========================================  =========  =======================================

A batch with an UNKNOWN record, or one that breaks the chunk rule (`dedup.chunks`) or
``max_sequence_jump``, changes nothing. Everything here is synchronous: a check runs in the
request's place in line, between two awaits, so no other request's check interleaves.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from dedup.chunks import (
    LAST,
    ChunkError,
    ChunkGap,
    ChunkMeta,
    ChunkProgress,
    accept_chunk,
    accept_whole,
    check_consistent,
)
from dedup.state import (
    PartitionCheck,
    PartitionVerdict,
    Persisted,
    ProducerState,
    RecoveredState,
    RunIdentities,
    Status,
    check_runs,
)

# How many producers an eviction steps over (in flight, or in the batch) before it gives up
# for this check and leaves the table over its bound (check.lua's EVICTION_SCAN).
EVICTION_SCAN = 1024

Position = tuple[int, int]  # (sequence, chunk id); a whole record is at chunk LAST


def _at(sequence: int | None, chunk: ChunkProgress | None) -> Position | None:
    """Where a producer's entry stands: its message in progress, else its complete
    sequence; None (below every position) when it holds neither."""
    if chunk is not None:
        return chunk.sequence, chunk.chunk_id
    if sequence is not None:
        return sequence, LAST
    return None


def _above(position: Position, other: Position | None) -> bool:
    return other is None or position > other


@dataclass(slots=True)
class _Producer:
    pushed: int | None = None
    pushed_chunk: ChunkProgress | None = None
    persisted: int | None = None
    persisted_chunk: ChunkProgress | None = None
    seen_ms: int = 0

    def in_flight(self) -> bool:
        """Pushed beyond persisted: a write of it may still land, so it must not be
        forgotten (its retry would read as new and be written twice)."""
        return self.pushed != self.persisted or self.pushed_chunk != self.persisted_chunk


class PartitionSequences:
    """The maps of one partition, loaded by its recovery and valid under its `token`."""

    def __init__(self, token: str, *, max_producers: int = 10_000, max_jump: int = 0) -> None:
        if max_producers < 1:
            raise ValueError(f"max_producers must be at least 1: {max_producers}")
        if max_jump < 0:
            raise ValueError(f"max_jump must be >= 0 (0: none): {max_jump}")
        self.token = token
        self._max_producers = max_producers
        self._max_jump = max_jump
        # Least recently seen first: an entry moves to the end whenever it is seen later,
        # so the order is by last seen as long as the clock does not step back (`_ordered`;
        # else it is sorted again before an eviction). Ties are put in name order there.
        self._producers: OrderedDict[str, _Producer] = OrderedDict()
        self._ordered = True
        self._latest_ms = 0  # the last seen of the entry at the end, while `_ordered`

    @classmethod
    def recovered(
        cls,
        token: str,
        producers: Mapping[str, tuple[int, int]],
        chunks: Mapping[str, tuple[ChunkProgress, int]] | None = None,
        *,
        max_producers: int = 10_000,
        max_jump: int = 0,
    ) -> PartitionSequences:
        """What a recovery rebuilt: {producer: (sequence, last seen ms)} and the chunked
        messages in progress, as both maps (pushed = persisted)."""
        table = cls(token, max_producers=max_producers, max_jump=max_jump)
        entries: dict[str, _Producer] = {}
        for name, (sequence, seen_ms) in producers.items():
            entries[name] = _Producer(sequence, None, sequence, None, seen_ms)
        for name, (chunk, seen_ms) in (chunks or {}).items():
            entry = entries.setdefault(name, _Producer(seen_ms=seen_ms))
            entry.pushed_chunk = entry.persisted_chunk = chunk
            entry.seen_ms = max(entry.seen_ms, seen_ms)
        table._producers.update(entries)
        table._sort()
        return table

    def __len__(self) -> int:
        return len(self._producers)

    # -- the check ------------------------------------------------------------------------

    def check(self, check: PartitionCheck, now_ms: int) -> PartitionVerdict:
        """Classify every record of one partition batch (the module's table); unless one is
        UNKNOWN or breaks a rule, raise ``pushed`` and last-seen and make room for new
        producers (`max_producers`: the least recently seen go first, never one with a
        write in flight)."""
        if check.token and check.token != self.token:
            return PartitionVerdict((), (), lost=True)
        batch = _Batch(self._producers, self._max_jump, bool(check.chunks))
        stop = batch.classify(check)
        if stop is not None:
            return stop
        if batch.refused:
            return PartitionVerdict(tuple(batch.statuses), (), sizes=tuple(batch.sizes))
        for name, (pushed, chunk) in batch.pushed.items():
            entry = self._producers.get(name)
            if entry is None:
                entry = self._producers[name] = _Producer(seen_ms=now_ms)
            entry.pushed, entry.pushed_chunk = pushed, chunk
            self._seen(name, entry, now_ms)
        evicted = self._evict(batch.pushed.keys())
        return PartitionVerdict(tuple(batch.statuses), evicted, sizes=tuple(batch.sizes))

    def _evict(self, batch: Collection[str]) -> tuple[str, ...]:
        """The least recently seen go, in (last seen, name) order as Redis's sorted set
        has them, stepping over the batch's producers and those with a write in flight."""
        excess = len(self._producers) - self._max_producers
        if excess <= 0:
            return ()
        if not self._ordered:
            self._sort()
        # In last-seen order; the producers seen at the same time as the last one taken
        # are looked at too, since a name of theirs may come first.
        candidates: list[tuple[int, str]] = []
        boundary: int | None = None
        stepped_over = 0
        for name, entry in self._producers.items():
            if (boundary is not None and entry.seen_ms > boundary) or stepped_over > EVICTION_SCAN:
                break
            if name in batch or entry.in_flight():
                stepped_over += 1
                continue
            candidates.append((entry.seen_ms, name))
            if boundary is None and len(candidates) == excess:
                boundary = entry.seen_ms
        victims = [name for _, name in sorted(candidates)[:excess]]
        for name in victims:
            del self._producers[name]
        return tuple(victims)

    def _seen(self, name: str, entry: _Producer, now_ms: int) -> None:
        """Last seen at now_ms, unless it was seen later (a step back of the clock)."""
        if now_ms < entry.seen_ms:
            return
        entry.seen_ms = now_ms
        self._producers.move_to_end(name)
        if now_ms < self._latest_ms:
            self._ordered = False  # seen "now", yet before the one it passed
        else:
            self._latest_ms = now_ms

    def _sort(self) -> None:
        """Least recently seen first, ties by name."""
        ordered = sorted(self._producers.items(), key=lambda item: (item[1].seen_ms, item[0]))
        self._producers = OrderedDict(ordered)
        self._latest_ms = ordered[-1][1].seen_ms if ordered else 0
        self._ordered = True

    # -- after the write ------------------------------------------------------------------

    def persisted(self, highest: Mapping[str, Persisted], now_ms: int) -> None:
        """Kafka acknowledged these positions: ``persisted[p]`` rises to each (a complete
        sequence ends the message in progress; a chunk that is not the last moves only the
        message in progress), and ``pushed[p]`` is raised to it where it is below (an
        acknowledgement may arrive after a reset or an eviction)."""
        for name, position in highest.items():
            entry = self._producers.get(name)
            if entry is None:
                entry = self._producers[name] = _Producer(seen_ms=now_ms)
            if isinstance(position, ChunkProgress):
                at = position.position
                if _above(at, _at(entry.persisted, entry.persisted_chunk)):
                    entry.persisted_chunk = position
            elif _above((position, LAST), _at(entry.persisted, entry.persisted_chunk)):
                entry.persisted, entry.persisted_chunk = position, None
            top = _at(entry.persisted, entry.persisted_chunk)
            assert top is not None
            if _above(top, _at(entry.pushed, entry.pushed_chunk)):
                if entry.persisted is not None and (
                    entry.pushed is None or entry.persisted > entry.pushed
                ):
                    entry.pushed = entry.persisted
                entry.pushed_chunk = entry.persisted_chunk
            self._seen(name, entry, now_ms)

    def reset(self) -> None:
        """pushed := persisted (Pulsar's resetHighestSequenceIdPushed), once the writes of a
        failed one have settled: what was pushed but never acknowledged is forgotten."""
        for entry in self._producers.values():
            entry.pushed, entry.pushed_chunk = entry.persisted, entry.persisted_chunk

    # -- administration -------------------------------------------------------------------

    def forget(self, producer: str) -> bool:
        """An operator's reset of one producer; whether it was there."""
        return self._producers.pop(producer, None) is not None

    def purge_idle(self, older_than_ms: int) -> list[str]:
        """Forget the producers last seen before older_than_ms; their names."""
        idle = [name for name, entry in self._producers.items() if entry.seen_ms < older_than_ms]
        for name in idle:
            del self._producers[name]
        return idle

    def producers(self) -> dict[str, ProducerState]:
        """Every producer, with pushed, persisted and last seen (the admin API's view)."""
        return {
            name: ProducerState(
                entry.pushed,
                entry.persisted,
                entry.seen_ms,
                entry.pushed_chunk,
                entry.persisted_chunk,
            )
            for name, entry in sorted(self._producers.items())
        }

    def persisted_state(self) -> RecoveredState:
        """The acknowledged positions with last-seen times, as a snapshot stores them."""
        return RecoveredState(
            {
                name: (entry.persisted, entry.seen_ms)
                for name, entry in self._producers.items()
                if entry.persisted is not None
            },
            {
                name: (entry.persisted_chunk, entry.seen_ms)
                for name, entry in self._producers.items()
                if entry.persisted_chunk is not None
            },
        )


class _Batch:
    """One check under way: each producer's pushed position as this batch raises it,
    beside the one it had when the batch started; the statuses so far."""

    __slots__ = (
        "_chunked",
        "_max_jump",
        "_table",
        "before",
        "pushed",
        "refused",
        "sizes",
        "statuses",
    )

    def __init__(self, table: Mapping[str, _Producer], max_jump: int, chunked: bool) -> None:
        self._table = table
        self._max_jump = max_jump
        self._chunked = chunked  # sizes: one per record, only for a batch with chunks
        self.before: dict[str, tuple[int | None, ChunkProgress | None]] = {}
        self.pushed: dict[str, tuple[int | None, ChunkProgress | None]] = {}
        self.statuses: list[Status] = []
        self.sizes: list[int | None] = []
        self.refused = False

    def classify(self, check: PartitionCheck) -> PartitionVerdict | None:
        """Every record; a verdict that ends the check (a rule broken), else None."""
        if check.chunks:
            for n, ((producer, sequence), chunk) in enumerate(
                zip(check.identities, check.chunks, strict=True)
            ):
                meta, size = chunk if chunk is not None else (None, 0)
                stop = self._record(n, producer, sequence, meta, size)
                if stop is not None:
                    return stop
            return None
        runs = (
            check.identities.runs
            if isinstance(check.identities, RunIdentities)
            else check_runs(check.identities)
        )
        n = 0
        for producer, first, last, count in runs:
            stop = self._run(n, producer, first, last, count)
            if stop is not None:
                return stop
            n += count
        return None

    def _meet(self, producer: str) -> None:
        if producer not in self.before:
            entry = self._table.get(producer)
            start = (None, None) if entry is None else (entry.pushed, entry.pushed_chunk)
            self.before[producer] = self.pushed[producer] = start

    def _run(
        self, n: int, producer: str, first: int, last: int, count: int
    ) -> PartitionVerdict | None:
        """Records n .. n+count-1 of one producer, sequences first .. last in a row."""
        self._meet(producer)
        if _above((first, LAST), _at(*self.pushed[producer])):
            # Above pushed: the first is NOT_DUP (and is checked against the rules), and
            # raises pushed; so does each next one.
            stop = self._record(n, producer, first, None, 0)
            if stop is not None or count == 1:
                return stop
            self.statuses += [Status.NOT_DUP] * (count - 1)
            self.pushed[producer] = (last, None)
            return None
        whole = self._overlap_status(producer, first, last)
        if whole is not None:
            self.statuses += [whole] * count
            self.refused = self.refused or whole is Status.UNKNOWN
            return None
        for k in range(count):
            stop = self._record(n + k, producer, first + k, None, 0)
            if stop is not None:
                return stop
            if k < count - 1 and self.statuses[-1] is Status.NOT_DUP:
                # pushed is this record's sequence now: the rest of the run is above it.
                self.statuses += [Status.NOT_DUP] * (count - 1 - k)
                self.pushed[producer] = (last, None)
                return None
        return None

    def _overlap_status(self, producer: str, first: int, last: int) -> Status | None:
        """The one status every record of a run gets when its first is not above pushed and
        its ends tell, else None (checked record by record)."""
        if _above((last, LAST), _at(*self.pushed[producer])):
            return None  # it ends above pushed: NOT_DUP from somewhere inside
        persisted = self._persisted_at(producer)
        if persisted is not None and (last, LAST) <= persisted:
            return Status.DUP  # all acknowledged: a retry of a written batch
        if persisted is not None and (first, LAST) <= persisted:
            return None  # acknowledged up to somewhere inside
        before = _at(*self.before[producer])
        if _above((first, LAST), before):
            return Status.DUP  # all raised by earlier records of this batch
        if before is not None and (last, LAST) <= before:
            return Status.UNKNOWN  # all pushed by an earlier batch, none acknowledged
        return None

    def _persisted_at(self, producer: str) -> Position | None:
        entry = self._table.get(producer)
        return None if entry is None else _at(entry.persisted, entry.persisted_chunk)

    def _record(
        self, n: int, producer: str, sequence: int, meta: ChunkMeta | None, size: int
    ) -> PartitionVerdict | None:
        """Record number n (0-based); a verdict that ends the check, else None."""
        self._meet(producer)
        pushed, chunk = self.pushed[producer]
        if meta is not None:
            try:
                check_consistent(chunk, sequence, meta)
            except ChunkError as bad:
                return _broken(n, str(bad))
        position = (sequence, LAST if meta is None or meta.last else meta.chunk_id)
        size_so_far: int | None = None
        if _above(position, _at(pushed, chunk)):
            if self._max_jump and pushed is not None and sequence - pushed > self._max_jump:
                return _broken(
                    n,
                    f"sequence {sequence} is more than {self._max_jump} above {producer}'s "
                    f"last sequence {pushed} (max_sequence_jump): refused, nothing written",
                    jump=True,
                )
            try:
                if meta is None:
                    accept_whole(chunk, sequence)  # a message in progress is abandoned
                    self.pushed[producer] = (sequence, None)
                else:
                    after = accept_chunk(chunk, sequence, meta, size)
                    if after is None:  # the last chunk completes the sequence
                        self.pushed[producer] = (sequence, None)
                    else:
                        self.pushed[producer] = (pushed, after)
                        size_so_far = after.size
            except ChunkGap as gap:
                return _broken(n, str(gap), gap=True)
            except ChunkError as bad:
                return _broken(n, str(bad))
            status = Status.NOT_DUP
        elif not _above(position, self._persisted_at(producer)):
            status = Status.DUP  # Kafka acknowledged it
        elif _above(position, _at(*self.before[producer])):
            status = Status.DUP  # an earlier record of this batch, written together with it
        else:
            status = Status.UNKNOWN  # pushed by an earlier batch, not acknowledged (yet?)
            self.refused = True
        self.statuses.append(status)
        if self._chunked:
            self.sizes.append(size_so_far)
        return None


def _broken(n: int, why: str, *, gap: bool = False, jump: bool = False) -> PartitionVerdict:
    """A rule broken by record n: the batch is refused, nothing changed."""
    return PartitionVerdict((), (), bad=why, bad_index=n, gap=gap, jump=jump)

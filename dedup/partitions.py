"""What the engine keeps in memory per topic-partition it writes.

- The gate between a request's check and its outcome (a failed write closes it until
  ``pushed`` is reset), the place in line of the latest admitted request, and how far
  back in line requests are refused after one was not written (`PartitionState.refuse_through`;
  or `refuse_through_on` a client connection, `refuse_through_for` producers, when the
  refusal was about that request or its producers alone).
- Recovery: whether the partition's dedup state has been rebuilt from the log by this
  proxy process (``recovered``), and the token that proves Redis still holds that state.
- The sequence maps themselves, when the owner keeps them (``check_state = "memory"``,
  `dedup.sequences`): loaded by the recovery, checked and updated by the engine.
- The acknowledgement cursor (`AckCursor`): the offset a snapshot may claim to cover.
- The sequence each Kafka idempotent producer must send next (`dedup.sequence_gaps`), and
  the implicit producers near or past Kafka's sequence wrap (`dedup.implicit_wraps`).
- Snapshot bookkeeping for `dedup.snapshotter`.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Final

from dedup.implicit_wraps import Wraps
from dedup.sequence_gaps import SequenceGaps

if TYPE_CHECKING:
    from dedup.sequences import PartitionSequences


@dataclass(slots=True)
class _Ticket:
    done: bool = False
    end_offset: int | None = None  # one past the write's last offset; None: unknown or none
    records: int = 0


class AckCursor:
    """The offset below which every write this proxy submitted to a partition is settled.

    Writes are submitted in log order (the proxy is the partition's idempotent producer),
    but their outcomes are handled in any order. A snapshot may only say "covers every
    record below O" for an O below which no write is still unsettled, so ``safe_end`` moves
    over a contiguous prefix of settled writes only: an ambiguous write holds it back until
    it resolves. A write settled with an unknown offset (Kafka said: duplicate of an earlier
    append) lies below the next known one, so it does not hold the cursor back.
    """

    def __init__(self, start: int) -> None:
        self.safe_end = start
        self.records_settled = 0  # written records passed over since the partition recovered
        self._tickets: deque[_Ticket] = deque()

    def submitted(self) -> _Ticket:
        """A write was submitted (call in submission order)."""
        ticket = _Ticket()
        self._tickets.append(ticket)
        return ticket

    def settled(self, ticket: _Ticket, end_offset: int | None, records: int) -> None:
        """The write has its outcome: ``end_offset`` None when not written or unknown."""
        ticket.done, ticket.end_offset, ticket.records = True, end_offset, records
        while self._tickets and self._tickets[0].done:
            first = self._tickets.popleft()
            if first.end_offset is not None:
                self.safe_end = max(self.safe_end, first.end_offset)
            self.records_settled += first.records

    @property
    def unsettled(self) -> int:
        return len(self._tickets)


Key = tuple[str, int]  # topic, partition


class Reach(Enum):
    """What a request answered "not written, retry" holds back behind it on its partition:
    the requests admitted before that answer was decided (their clients sent them without
    knowing it), which, written, would overtake its retry."""

    PARTITION = "partition"  # every one (a write failed, the partition is recovering, ...)
    # Those of its client connection, where the refusal is about the request alone and any
    # client can draw it: a damaged batch (no producer in it the proxy can trust), a chunk
    # whose chunk before never came (a later whole record of its producer would be taken).
    # A client pipelines its requests to a partition on the one connection.
    CONNECTION = "connection"
    # Those naming one of its producers, where the refusal is about its producers' records
    # alone: records of theirs still in flight (a retry sent while the first attempt is
    # written). Another producer's records do not touch their sequences.
    PRODUCERS = "producers"
    # None: a Kafka idempotent producer's batch that skips ahead of its sequence. Kafka's
    # rule itself then holds back that producer's later batches, and no other's, as
    # Kafka's broker refuses the one batch (`dedup.sequence_gaps`).
    ITSELF = "itself"


# Client connections a partition keeps refusals of its own for at once (`refuse_behind`); a
# refusal beyond them refuses every request behind it, as any other refusal does.
MAX_CONNECTIONS_REFUSED: Final = 1_000
# ... and producers, for `Reach.PRODUCERS`.
MAX_PRODUCERS_REFUSED: Final = 1_000


@dataclass(slots=True)
class PartitionState:
    pending: int = 0  # requests between their check and their outcome
    failed: bool = False  # a write failed: reset pushed once pending reaches 0
    open: asyncio.Event = field(default_factory=asyncio.Event)
    last_in_line: asyncio.Future[None] | None = None  # the latest admitted request's turn
    last_queued: asyncio.Future[None] | None = None  # ... and when its check is queued
    admitted: int = 0  # requests admitted so far: the latest one's number in line
    released: int = 0  # ... and of those, the requests whose work on it has ended
    # A request not written (retriable) refuses every request admitted before its answer
    # could reach the client: those were sent without knowing, and written they would
    # overtake its retry (whose records would then read as old duplicates and be lost).
    refuse_through: int = 0
    # ... or, for a refusal of `Reach.CONNECTION`, only the requests of its client
    # connection. Connection -> the number in line refused through.
    refuse_through_on: dict[object, int] = field(default_factory=dict)
    # ... or, for `Reach.PRODUCERS`, the requests naming one of its producers. Producer ->
    # the number in line refused through.
    refuse_through_for: dict[str, int] = field(default_factory=dict)

    recovered: bool = False  # the state was rebuilt from the log by this process
    holder: str | None = None  # another instance held the lease when this one tried
    holder_until: float = 0.0  # event loop time until which `holder` is believed
    token: str = ""  # proves Redis holds the state this process recovered
    # Kafka's id of the topic that state was rebuilt from (`dedup.topic_ids`); None: unknown
    topic_id: str | None = None
    sequences: PartitionSequences | None = None  # the maps, when kept in memory
    cursor: AckCursor = field(default_factory=lambda: AckCursor(0))
    # Kafka's sequence-gap rule for its idempotent producers, since this owner took it.
    gaps: SequenceGaps = field(default_factory=SequenceGaps)
    # Implicit sequences past Kafka's wrap: the producers near or past it (seeded by recovery)
    wraps: Wraps = field(default_factory=Wraps)
    # Kafka's log start offset as the recovery that opened the partition here read it, or
    # a later answer to a write here gave it (-1: neither yet). A batch dropped whole is
    # answered with it, as Kafka answers a duplicate.
    log_start_offset: int = -1

    snapshot_generation: int = 0  # of the next snapshot
    snapshot_offset: int | None = None  # of the latest snapshot known (taken or recovered)
    snapshot_ms: int | None = None  # when that snapshot was taken
    snapshot_records: int = 0  # cursor.records_settled covered by the latest snapshot
    snapshot_due: bool = False  # right after a recovery that replayed a tail
    snapshot_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one at a time
    snapshot_failures: int = 0  # in a row, for the retry backoff
    snapshot_retry_at: float = 0.0  # monotonic time before which no retry is made

    def __post_init__(self) -> None:
        self.open.set()

    def refuse_behind(
        self, reach: Reach, connection: object | None, producers: Collection[str] = ()
    ) -> None:
        """Refuse the requests admitted so far, as far as ``reach``: those that came on
        ``connection`` for `Reach.CONNECTION`, those naming one of ``producers`` for
        `Reach.PRODUCERS`, none for `Reach.ITSELF`. With the connection or the producers
        unknown, or beyond their bound, every request admitted so far."""
        if reach is Reach.ITSELF:
            return
        on, of = self.refuse_through_on, self.refuse_through_for
        if reach is Reach.CONNECTION and connection is not None:
            kept = _room(on, (connection,), MAX_CONNECTIONS_REFUSED)
            if kept:
                on[connection] = self.admitted
        elif reach is Reach.PRODUCERS and producers:
            kept = _room(of, producers, MAX_PRODUCERS_REFUSED)
            if kept:
                of.update(dict.fromkeys(producers, self.admitted))
        else:
            kept = False
        if not kept:
            self.refuse_through = max(self.refuse_through, self.admitted)

    def refuses(
        self,
        number: int,
        connection: object | None,
        producers: Callable[[], Iterable[str]] | None = None,
    ) -> Reach | None:
        """The reach of a refusal ahead of request ``number`` in line that refuses it too,
        if any. ``producers`` names the request's producers; asked only while a refusal
        of `Reach.PRODUCERS` is kept."""
        if number <= self.refuse_through:
            return Reach.PARTITION
        if connection is not None and number <= self.refuse_through_on.get(connection, 0):
            return Reach.CONNECTION
        if self.refuse_through_for and producers is not None:
            through = self.refuse_through_for
            if any(number <= through.get(producer, 0) for producer in producers()):
                return Reach.PRODUCERS
        return None

    def released_one(self) -> None:
        """A request's work on the partition ended; with none left, the refusals of
        single connections or producers refuse nothing any more (every number they name
        is done)."""
        self.released += 1
        if (self.refuse_through_on or self.refuse_through_for) and self.released >= self.admitted:
            self.refuse_through_on.clear()
            self.refuse_through_for.clear()

    def held_by(self, now: float) -> str | None:
        """The instance that held the partition's lease when last tried, if recently."""
        return self.holder if self.holder is not None and now < self.holder_until else None

    def unopened(self, now: float) -> bool:
        """Not recovered here, and held by no other instance known of: at its first use
        here, a partition this instance is to take if it serves it."""
        return not self.recovered and self.held_by(now) is None


def _room(kept: dict[Any, int], new: Iterable[object], bound: int) -> bool:
    """Whether ``kept`` stays within ``bound`` keys with ``new`` added."""
    return len(kept) + sum(1 for key in new if key not in kept) <= bound


class PartitionStates(dict[Key, PartitionState]):
    """Every partition the engine has met, its state created on first mention."""

    def of(self, key: Key) -> PartitionState:
        state = self.get(key)
        if state is None:
            state = self[key] = PartitionState()
        return state

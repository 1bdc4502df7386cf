"""The consumer-side verdict on one run, as the seed defines it.

The producer sends the integers ``start, start + 1, ...`` in order; the consumer reads the
topic back and walks the values in the order consumed, keeping ``last`` (initially
``start - 1``) and which values it has already seen:

==========================  ==========================  =================================
value                       not seen before             seen before
==========================  ==========================  =================================
``last + 1``                in order                    in order, a duplicate (no event)
``> last + 1``              JUMP FORWARDS (JF)          DUPLICATE JUMP FORWARDS (DJF)
``<= last``                 JUMP BACKWARDS (JB)         DUPLICATE JUMP BACKWARDS (DJB)
==========================  ==========================  =================================

Each jump is an event with ``distance = abs(last - value)``. A repeat of the previous value
(``value == last``) is a duplicate going back by 0: counted as DJB with distance 0, as the
seed's published consumer does (its test for "backwards" is ``last >= value``).

A re-sent block of messages therefore yields exactly one event, at its first message: the
rest of the block continues in order from there. This is what the seed's order logs call a
"DUPLICATE BLOCK": those lines are the DJB (and DJF) events themselves, one line per event,
not a separate aggregation; the CSV rows' DJB counts equal the number of such lines. So
there is one kind of event and two renderings of it (`JumpEvent.inline`, the worked
example's wording, and `JumpEvent.log_line`, the order log's wording).

The run's counters are the seed's CSV columns, in its order (`COLUMNS`). The state is kept
in bytearrays indexed by ``value - start`` (one byte per sent message), so a run of
1,000,000 messages costs about a megabyte and one pass in Python; the set-wise counts are
computed with bytes.translate and integer bit operations, in C.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from deploy.chaos.reported_offsets import ReportedOffsets

COLUMNS: Final = (
    "DedupEnabled",
    "TestRun",
    "SendCount",
    "AckCount",
    "PosAckCount",
    "NegAckCount",
    "Received",
    "NotReceived",
    "ReceivedNoAck",
    "MsgsWithDups",
    "DJF",
    "DJB",
    "JF",
    "JB",
)

# Acknowledgement state per sent value, one byte each (the producers' encoding).
ACK_NONE: Final = 0
ACK_POSITIVE: Final = 1
ACK_NEGATIVE: Final = 2


class JumpKind(enum.Enum):
    """The four deviations from in-order delivery the seed's consumer logs."""

    JF = "JUMP FORWARDS"
    JB = "JUMP BACKWARDS"
    DJF = "DUPLICATE JUMP FORWARDS"
    DJB = "DUPLICATE JUMP BACKWARDS"

    @property
    def words(self) -> str:
        """The wording of the seed's worked example, e.g. ``DUPLICATE JUMP BACKWARDS``."""
        return str(self.value)

    @property
    def log_words(self) -> str:
        """The wording of the seed's ``*_order_output.txt`` files, where a duplicate jump is
        a ``DUPLICATE BLOCK - JUMP BACKWARDS`` (or ``FORWARDS``)."""
        if self in (JumpKind.DJF, JumpKind.DJB):
            return "DUPLICATE BLOCK - " + self.words.removeprefix("DUPLICATE ")
        return self.words


@dataclass(frozen=True, slots=True)
class JumpEvent:
    """One deviation: the consumer read `value` right after `last`. `position` is the
    value's index in the consumed stream (0-based), so a listing can be rebuilt."""

    kind: JumpKind
    last: int
    value: int
    position: int

    @property
    def distance(self) -> int:
        return abs(self.last - self.value)

    def inline(self) -> str:
        """The worked example's line, printed in place of the value:
        ``30 JUMP FORWARDS 20 (10 -> 30)``."""
        return f"{self.value} {self.kind.words} {self.distance} ({self.last} -> {self.value})"

    def log_line(self, run: int) -> str:
        """The order log's line: ``Test run: 1 JUMP BACKWARDS 1637 (108110 -> 106473)``."""
        return (
            f"Test run: {run} {self.kind.log_words} {self.distance} ({self.last} -> {self.value})"
        )


@dataclass(frozen=True)
class RunResult:
    """One run's counters (the seed's CSV row) and its jump events in consumed order."""

    dedup_enabled: bool
    run: int
    send_count: int
    ack_count: int
    pos_ack_count: int
    neg_ack_count: int
    received: int
    not_received: int
    received_no_ack: int
    msgs_with_dups: int
    jumps: list[JumpEvent] = field(default_factory=list)
    # Whether the delivery reports name where each record is (not one of the seed's columns)
    reported_offsets: ReportedOffsets | None = None

    def count(self, kind: JumpKind) -> int:
        return sum(1 for event in self.jumps if event.kind is kind)

    @property
    def row(self) -> dict[str, str | int]:
        """The CSV row, keys in `COLUMNS` order; DedupEnabled is ``true``/``false``."""
        values: tuple[str | int, ...] = (
            "true" if self.dedup_enabled else "false",
            self.run,
            self.send_count,
            self.ack_count,
            self.pos_ack_count,
            self.neg_ack_count,
            self.received,
            self.not_received,
            self.received_no_ack,
            self.msgs_with_dups,
            self.count(JumpKind.DJF),
            self.count(JumpKind.DJB),
            self.count(JumpKind.JF),
            self.count(JumpKind.JB),
        )
        return dict(zip(COLUMNS, values, strict=True))

    @property
    def clean(self) -> bool:
        """What dedup must deliver: nothing acknowledged lost, nothing twice, all in order.
        Received-but-unacknowledged messages do not count against it: a lost ack is the
        very case the producer retries for."""
        return self.not_received == 0 and self.msgs_with_dups == 0 and not self.jumps

    def report_lines(self) -> list[str]:
        """The seed's per-run terminal summary."""
        return [
            f"Final send count: {self.send_count}",
            f"Final ack count: {self.ack_count}",
            f"Final positive ack count: {self.pos_ack_count}",
            f"Final negative ack count: {self.neg_ack_count}",
            f"Messages received: {self.received}",
            f"Acked messages missing: {self.not_received}",
            f"Non-acked messages received: {self.received_no_ack}",
            f"Duplicates: {self.msgs_with_dups}",
            f"Duplicate Jump Forward: {self.count(JumpKind.DJF)}",
            f"Duplicate Jump Back: {self.count(JumpKind.DJB)}",
            f"Non-Duplicate Jump Forward: {self.count(JumpKind.JF)}",
            f"Non-Duplicate Jump Back: {self.count(JumpKind.JB)}",
        ]


@dataclass
class _Walk:
    """The ordering pass: how often each value was read and where the order broke.
    `counts[i]` is the number of reads of ``start + i``, saturated at 2 (enough for "seen"
    and "duplicated"); values outside the sent range are counted in `stray`."""

    received: int
    counts: bytearray
    stray: dict[int, int]
    jumps: list[JumpEvent]


def _walk(values: Iterable[int], *, start: int, size: int) -> _Walk:
    counts = bytearray(size)
    stray: dict[int, int] = {}
    jumps: list[JumpEvent] = []
    expected = start  # last + 1
    position = -1
    # The hot loop: one pass, locals only, an event built only off the in-order path.
    for position, value in enumerate(values):
        index = value - start
        if 0 <= index < size:
            seen = counts[index]
            if seen < 2:
                counts[index] = seen + 1
        else:
            seen = stray.get(value, 0)
            stray[value] = seen + 1
        if value != expected:
            last = expected - 1
            if value > last:
                kind = JumpKind.DJF if seen else JumpKind.JF
            else:
                kind = JumpKind.DJB if seen else JumpKind.JB
            jumps.append(JumpEvent(kind, last, value, position))
        expected = value + 1
    received = position + 1
    return _Walk(received, counts, stray, jumps)


# Translation tables turning a state byte into a 0/1 flag byte.
_IS_POSITIVE: Final = bytes(1 if b == ACK_POSITIVE else 0 for b in range(256))
_NOT_POSITIVE: Final = bytes(0 if b == ACK_POSITIVE else 1 for b in range(256))
_UNREAD: Final = bytes(1 if b == 0 else 0 for b in range(256))
_READ: Final = bytes(0 if b == 0 else 1 for b in range(256))


def _both(a: bytes | bytearray, b: bytes | bytearray) -> int:
    """How many positions hold a 1 in both flag strings (bytes of 0 or 1)."""
    return (int.from_bytes(a, "little") & int.from_bytes(b, "little")).bit_count()


def classify_run(
    values: Iterable[int],
    acks: bytes | bytearray,
    *,
    start: int = 0,
    dedup_enabled: bool,
    run: int,
    send_count: int | None = None,
) -> RunResult:
    """Classify one run. `values` are the integers in the order consumed (duplicates
    included); ``acks[i]`` is the acknowledgement of sent value ``start + i`` (`ACK_NONE`,
    `ACK_POSITIVE` or `ACK_NEGATIVE`). SendCount is ``len(acks)`` unless `send_count` says
    fewer went out (a producer that failed partway leaves the rest `ACK_NONE`).

    The counters, distinct values throughout except Received:

    - Received: records consumed, duplicates included.
    - NotReceived: positively acknowledged values never consumed ("Acked messages missing").
    - ReceivedNoAck: consumed values without a positive acknowledgement (none or negative),
      including values that were never sent (outside ``[start, start + len(acks))``). The
      seed's consumer counted only such values read exactly once (one read twice went to
      MsgsWithDups alone); here a value is in every count it qualifies for.
    - MsgsWithDups: values consumed more than once. In the seed's data it is always
      Received - SendCount, which holds when every sent value arrives at most twice.
    """
    size = len(acks)
    if send_count is not None and not 0 <= send_count <= size:
        raise ValueError(f"send_count {send_count} outside 0..{size} (len(acks))")
    positive, negative = acks.count(ACK_POSITIVE), acks.count(ACK_NEGATIVE)
    if positive + negative + acks.count(ACK_NONE) != size:
        raise ValueError("acks may only hold ACK_NONE, ACK_POSITIVE and ACK_NEGATIVE")
    walk = _walk(values, start=start, size=size)
    counts = walk.counts
    not_received = _both(acks.translate(_IS_POSITIVE), counts.translate(_UNREAD))
    never_sent = len(walk.stray)
    received_no_ack = _both(acks.translate(_NOT_POSITIVE), counts.translate(_READ)) + never_sent
    msgs_with_dups = counts.count(2) + sum(1 for n in walk.stray.values() if n > 1)
    return RunResult(
        dedup_enabled=dedup_enabled,
        run=run,
        send_count=size if send_count is None else send_count,
        ack_count=positive + negative,
        pos_ack_count=positive,
        neg_ack_count=negative,
        received=walk.received,
        not_received=not_received,
        received_no_ack=received_no_ack,
        msgs_with_dups=msgs_with_dups,
        jumps=walk.jumps,
    )


def trace(values: Iterable[int], *, start: int = 0) -> Iterator[str]:
    """The seed's terminal listing of a consumed stream: one line per value, the value
    itself when in order, its `JumpEvent.inline` line where the order broke."""
    consumed = list(values)
    size = max(consumed) - start + 1 if consumed else 0
    events = {e.position: e for e in _walk(consumed, start=start, size=max(size, 0)).jumps}
    for position, value in enumerate(consumed):
        event = events.get(position)
        yield str(value) if event is None else event.inline()

"""Whether each acknowledged message's delivery report names where it is in the log.

Beside the seed's verdict (what the log holds), a Kafka user relies on the offset a
producer's delivery report gives (`RecordMetadata.offset()`, librdkafka's
`rd_kafka_message_t.offset`): stored as a position, logged, handed on. A report is

- right: the record at the offset it names carries its value;
- unknown: it names no offset (a negative one: Kafka's -1, librdkafka's -1001). Kafka's
  Java client reports -1 for every record of a batch answered without an offset: a
  duplicate whose batch its broker no longer holds (DUPLICATE_SEQUENCE_NUMBER), or a
  re-send the proxy cannot place (offset -1). librdkafka numbers a batch's records from
  the answer's base offset, -1 too (-1, 0, 1, ...: wrong reports), so the proxy answers
  its clients such a batch at minus its record count: each record below zero, unknown;
- wrong: the offset it names holds another value, or no record at all. A proxy must
  never do that; no client can tell it from a right one.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final

from deploy.chaos.classify import ACK_POSITIVE

NOT_IN_LOG: Final = -1  # a `log` entry of an offset no record was read at


@dataclass(frozen=True)
class ReportedOffsets:
    """One run's positive reports, counted by kind."""

    right: int
    unknown: int
    wrong: int
    examples: list[tuple[int, int]] = field(default_factory=list)  # (value, offset) wrong

    def describe(self) -> str:
        """``offsets right=.. unknown=.. wrong=..``, and the wrong examples (value, offset)."""
        counts = f"offsets right={self.right} unknown={self.unknown} wrong={self.wrong}"
        return counts + (f" {self.examples}" if self.examples else "")

    @classmethod
    def total(cls, counts: Iterable[ReportedOffsets], *, keep: int = 5) -> ReportedOffsets:
        """Several counts as one (their examples in order, up to `keep`)."""
        counts = list(counts)
        examples = [example for count in counts for example in count.examples][:keep]
        return cls(
            sum(c.right for c in counts),
            sum(c.unknown for c in counts),
            sum(c.wrong for c in counts),
            examples,
        )


def check_reported_offsets(
    reported: array[int], acks: bytes | bytearray, log: array[int], *, keep: int = 5
) -> ReportedOffsets:
    """`reported[v]`: the offset the positive report of value v named (negative: none);
    `acks[v]`: its acknowledgement (`ACK_POSITIVE`: reported); `log[o]`: the value at
    offset o (`NOT_IN_LOG`: none read). Up to `keep` wrong reports are kept as examples."""
    positive = (
        (value, offset, 0 <= offset < len(log) and log[offset] == value)
        for value, ack in enumerate(acks)
        if ack == ACK_POSITIVE
        for offset in (reported[value],)
    )
    return tally(positive, keep=keep)


def tally(reports: Iterable[tuple[int, int, bool]], *, keep: int = 5) -> ReportedOffsets:
    """Reports counted: each (what it reports, the offset it names, whether the record at
    that offset is its own), unknown where the offset is negative. Up to `keep` wrong
    ones are kept as examples, (what, offset)."""
    right = unknown = wrong = 0
    examples: list[tuple[int, int]] = []
    for what, offset, at_its_record in reports:
        if offset < 0:
            unknown += 1
        elif at_its_record:
            right += 1
        else:
            wrong += 1
            if len(examples) < keep:
                examples.append((what, offset))
    return ReportedOffsets(right, unknown, wrong, examples)

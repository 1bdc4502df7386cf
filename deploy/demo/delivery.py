"""The loaders' delivery reports, kept and checked against the log.

A loader's producer reports, for each row Kafka (or the proxy) acknowledged, the partition
and offset it was written at. A Kafka user stores that position, logs it, hands it on; so
the demo writes every positive report to a file beside the loader's checkpoint (one line
each, ``row,partition,offset``, across the loader's runs) and, once the load is done,
checks each against what the topic holds at that position (`ReportedOffsets`: right,
unknown, or wrong, as the chaos suite counts them).

A re-sent row is reported once per send: through the proxy, its re-send is answered at
its original's position; straight to Kafka, a re-send Kafka took for a new record is
reported at its new copy. Both are right.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

from deploy.chaos.reported_offsets import ReportedOffsets, tally

NO_OFFSET = -1  # librdkafka reports a batch answered without an offset at -1 (None here)

# (partition, offset) -> (producer, sequence): the identity headers of the record there
Identities = Mapping[tuple[int, int], tuple[bytes | None, bytes | None]]


class ReportWriter:
    """The delivery callbacks of one loader run: each positive report appended as a line,
    written through at once (line buffered), so a SIGKILL loses no report given before."""

    def __init__(self, path: Path) -> None:
        self._file: IO[str] = path.open("a", buffering=1)

    def callback(self, row: int) -> Any:
        def delivered(error: Any, message: Any) -> None:
            if error is None:
                offset = message.offset()
                at = NO_OFFSET if offset is None or offset < 0 else offset
                self._file.write(f"{row},{message.partition()},{at}\n")

        return delivered

    def close(self) -> None:
        self._file.close()


def read_reports(path: Path) -> Iterator[tuple[int, int, int]]:
    """(row, partition, offset) of each report written, in order. A line cut short by a
    SIGKILL mid-write, the only damage a line-buffered file can take, is skipped."""
    if not path.exists():
        return
    with path.open() as handle:
        for line in handle:
            fields = line.strip().split(",")
            if len(fields) == 3 and all(f.lstrip("-").isdigit() for f in fields):
                yield int(fields[0]), int(fields[1]), int(fields[2])


def check_reports(
    reports: Iterator[tuple[int, int, int]], producer: str, log: Identities, *, keep: int = 5
) -> ReportedOffsets:
    """Each report of ``producer``'s rows against the record at the position it names: right
    where that record carries the row's identity (the producer's name, the row number as
    its sequence), unknown where it names no offset, wrong otherwise. Up to ``keep``
    wrong reports are kept as examples, (row, offset)."""
    name = producer.encode()
    return tally(
        (
            (row, offset, log.get((partition, offset)) == (name, str(row).encode()))
            for row, partition, offset in reports
        ),
        keep=keep,
    )

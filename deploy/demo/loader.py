"""One loader: replays a CSV source into a topic, the row number as the sequence id, the
way a batch import or CDC relay does. It checkpoints every `checkpoint_every` rows once
Kafka has acknowledged them, and a restarted loader resumes after its last checkpoint, so
the rows between that checkpoint and a crash are sent again. Each positive delivery report
is kept (`deploy.demo.delivery`), to be checked against the log once the load is done.

Run as its own process (``python -m deploy.demo.loader``) so that a crash is a real
SIGKILL: whatever librdkafka had in flight may or may not have been written.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from dedup.client import DedupProducer
from deploy.demo.delivery import ReportWriter


@dataclass
class Checkpoint:
    next_row: int = 0  # every row before it is acknowledged
    sent: int = 0  # rows handed to the producer over all runs, re-sends included
    runs: int = 0

    @classmethod
    def load(cls, path: Path) -> Checkpoint:
        if not path.exists():
            return cls()
        return cls(**json.loads(path.read_text()))

    def save(self, path: Path) -> None:
        # Write-then-rename: a crash never leaves half a checkpoint.
        staging = path.with_suffix(".tmp")
        staging.write_text(json.dumps(asdict(self)))
        os.replace(staging, path)


def read_rows(source: Path) -> list[dict[str, str]]:
    with source.open(newline="") as handle:
        return list(csv.DictReader(handle))


def run_loader(
    source: Path,
    bootstrap: str,
    topic: str,
    producer_name: str,
    checkpoint_path: Path,
    checkpoint_every: int,
    rows_per_s: float,
    crash_after_row: int | None,
    reports_path: Path | None = None,
) -> None:
    rows = read_rows(source)
    checkpoint = Checkpoint.load(checkpoint_path)
    checkpoint.runs += 1
    producer = DedupProducer(bootstrap, producer_name)
    reports = None if reports_path is None else ReportWriter(reports_path)
    started = time.monotonic()
    start_row = checkpoint.next_row
    for row_number in range(start_row, len(rows)):
        row = rows[row_number]
        producer.send(
            topic,
            json.dumps(row, separators=(",", ":")).encode(),
            key=row["order_id"].encode(),
            sequence_id=row_number,
            on_delivery=None if reports is None else reports.callback(row_number),
        )
        checkpoint.sent += 1
        if crash_after_row is not None and row_number == crash_after_row:
            checkpoint.save(checkpoint_path)  # the count of sends, not a new resume point
            os.kill(os.getpid(), signal.SIGKILL)
        if (row_number + 1) % checkpoint_every == 0:
            producer.flush()
            checkpoint.next_row = row_number + 1
            checkpoint.save(checkpoint_path)
        _pace(started, row_number - start_row + 1, rows_per_s)
    producer.flush()
    checkpoint.next_row = len(rows)
    checkpoint.save(checkpoint_path)
    if reports is not None:
        reports.close()


def _pace(started: float, sent: int, rows_per_s: float) -> None:
    ahead = sent / rows_per_s - (time.monotonic() - started)
    if ahead > 0.005:
        time.sleep(ahead)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--source", type=Path, required=True)
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--topic", required=True)
    parser.add_argument("--producer", required=True)
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--checkpoint-every", type=int, default=1000)
    parser.add_argument("--rows-per-s", type=float, default=2000.0)
    parser.add_argument("--crash-after-row", type=int, default=None)
    parser.add_argument("--reports", type=Path, default=None, help="delivery reports, appended")
    args = parser.parse_args()
    run_loader(
        source=args.source,
        bootstrap=args.bootstrap,
        topic=args.topic,
        producer_name=args.producer,
        checkpoint_path=args.checkpoint,
        checkpoint_every=args.checkpoint_every,
        rows_per_s=args.rows_per_s,
        crash_after_row=args.crash_after_row,
        reports_path=args.reports,
    )


if __name__ == "__main__":
    main()

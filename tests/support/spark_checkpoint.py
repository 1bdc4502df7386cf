"""What a Structured Streaming checkpoint says: the micro-batches committed (their output
written) and the source offsets they reached."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.wait import wait_until


def _batch_ids(directory: Path) -> list[int]:
    if not directory.is_dir():
        return []
    return sorted(int(f.name) for f in directory.iterdir() if f.name.isdigit())


def committed_batches(checkpoint: Path) -> int:
    return len(_batch_ids(checkpoint / "commits"))


def committed_offsets(checkpoint: Path) -> dict[str, dict[int, int]]:
    """The next offset to read per topic and partition after the last committed batch (a
    source scanned twice by the query has two equal lines; they are merged)."""
    committed = _batch_ids(checkpoint / "commits")
    if not committed:
        return {}
    # v1, the batch's metadata, then one JSON line per source.
    lines = (checkpoint / "offsets" / str(committed[-1])).read_text().splitlines()[2:]
    offsets: dict[str, dict[int, int]] = {}
    for line in lines:
        for topic, partitions in json.loads(line).items():
            for partition, offset in partitions.items():
                offsets.setdefault(topic, {})[int(partition)] = int(offset)
    return offsets


def wait_for_commits(checkpoint: Path, count: int, timeout_s: float = 180) -> None:
    wait_until(
        lambda: committed_batches(checkpoint) >= count,
        timeout_s,
        lambda: f"{count} micro-batches are committed (only {committed_batches(checkpoint)} are)",
        interval_s=0.05,
    )

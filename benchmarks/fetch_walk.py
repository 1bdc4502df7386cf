"""What the proxy pays to learn whether a Fetch response names brokers, in one process.

Every Fetch response of v11 or later that a filter may rewrite (KIP-951 endpoints, and in
a group of instances a preferred read replica or current leader, KIP-392) is first walked
by its structure (`proxy.kafka.fetch_names.fetch_broker_names`): partition by partition,
stepping over each partition's records by their length prefix. Only a response the walk
finds naming a broker is decoded (kio) and encoded again. This measures the walk beside
the decode it saves, for responses of about 1 MB spread over 1 to 1000 partitions, at the
versions the walk reads differently (v11 names topics, v12 adds compact lengths and tagged
fields, v13 names topics by id, v16 adds node endpoints).

The cases run interleaved, one timed run of each per round for ``--repeats`` rounds; the
figure is the fastest run of each (the least disturbed), the median is in the CSV too.

    .venv/bin/python -m benchmarks.fetch_walk --out /tmp/bench-fetch-walk [--repeats 15]
"""

from __future__ import annotations

import argparse
import csv
import datetime
import functools
import importlib
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

from kio.schema.errors import ErrorCode
from kio.schema.types import BrokerId, TopicName
from kio.static.primitive import i32, i32Timedelta, i64

from proxy.kafka.fetch_names import fetch_broker_names
from proxy.kafka.schemas import decode_response_body, encode_body

RESPONSE_BYTES: Final = 1_000_000
PARTITIONS: Final = (1, 10, 100, 1000)
VERSIONS: Final = (11, 12, 13, 16)
FETCH: Final = 1
# Response header as the chain sees it: correlation id, then (flexible versions) no tags.
CORRELATION_ID: Final = (42).to_bytes(4, "big")


@dataclass(frozen=True)
class Figure:
    version: int
    partitions: int
    walk_us: float
    walk_us_median: float
    decode_us: float
    decode_us_median: float
    walk_gb_per_s: float
    decode_to_walk: float


def response_payload(version: int, partitions: int) -> tuple[bytes, int]:
    """A Fetch response of ``version`` carrying about `RESPONSE_BYTES` of records spread
    evenly over ``partitions`` partitions of one topic, naming no broker; and where its
    body starts in the payload."""
    module = importlib.import_module(f"kio.schema.fetch.v{version}.response")
    records = bytes(RESPONSE_BYTES // partitions)  # the walk never looks inside them
    parts = tuple(
        module.PartitionData(
            partition_index=i32(p),
            error_code=ErrorCode.none,
            high_watermark=i64(1_000_000),
            last_stable_offset=i64(1_000_000),
            log_start_offset=i64(0),
            aborted_transactions=None,
            preferred_read_replica=BrokerId(-1),
            records=records,
        )
        for p in range(partitions)
    )
    topic = {"topic_id": uuid.uuid4()} if version >= 13 else {"topic": TopicName("orders")}
    response = module.FetchResponse(
        throttle_time=i32Timedelta.parse(datetime.timedelta(0)),
        error_code=ErrorCode.none,
        session_id=i32(7),
        responses=(module.FetchableTopicResponse(**topic, partitions=parts),),
    )
    header = CORRELATION_ID + (b"\x00" if version >= 12 else b"")
    return header + encode_body(response), len(header)


def timed(run: Callable[[], Any], loops: int) -> float:
    """Seconds per call, over ``loops`` calls."""
    started = time.perf_counter()
    for _ in range(loops):
        run()
    return (time.perf_counter() - started) / loops


def measure(repeats: int) -> list[Figure]:
    cases = [(v, n, *response_payload(v, n)) for v in VERSIONS for n in PARTITIONS]
    for version, partitions, payload, start in cases:  # the walk reads them as kio wrote them
        names = fetch_broker_names(version, payload, start)
        assert names is not None and not names.endpoints and not names.ids, (version, partitions)
    walks: dict[tuple[int, int], list[float]] = {(v, n): [] for v, n, _, _ in cases}
    decodes: dict[tuple[int, int], list[float]] = {(v, n): [] for v, n, _, _ in cases}
    for round_ in range(repeats):
        for version, partitions, payload, start in cases:
            key = (version, partitions)
            walk = functools.partial(fetch_broker_names, version, payload, start)
            decode = functools.partial(decode_response_body, FETCH, version, payload, start)
            walks[key].append(timed(walk, 50))
            decodes[key].append(timed(decode, 5))
        print(f"round {round_ + 1} of {repeats}", file=sys.stderr, flush=True)
    figures = []
    for (version, partitions), walk in walks.items():
        decode = decodes[(version, partitions)]
        figures.append(
            Figure(
                version=version,
                partitions=partitions,
                walk_us=round(min(walk) * 1e6, 2),
                walk_us_median=round(statistics.median(walk) * 1e6, 2),
                decode_us=round(min(decode) * 1e6, 1),
                decode_us_median=round(statistics.median(decode) * 1e6, 1),
                walk_gb_per_s=round(RESPONSE_BYTES / min(walk) / 1e9, 1),
                decode_to_walk=round(min(decode) / min(walk), 1),
            )
        )
    return figures


def write(figures: list[Figure], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with (out / "fetch-walk.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(figures[0])))
        writer.writeheader()
        writer.writerows(asdict(figure) for figure in figures)
    lines = [
        "| version | partitions | walk, µs | decode (kio), µs | decode / walk |",
        "|---:|---:|---:|---:|---:|",
        *(
            f"| v{f.version} | {f.partitions} | {f.walk_us} | {f.decode_us} | {f.decode_to_walk} |"
            for f in figures
        ),
    ]
    (out / "fetch-walk.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fetch_walk", description=__doc__)
    parser.add_argument("--out", type=Path, required=True, help="directory for the CSV and table")
    parser.add_argument("--repeats", type=int, default=15, help="interleaved rounds (default 15)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be positive")
    write(measure(args.repeats), args.out)


if __name__ == "__main__":
    main()

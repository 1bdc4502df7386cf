"""The produce path's record codec alone, in one process: records/s reading a client's batch
(`dedup.batches.read_batches`) and reading it then writing the batch the proxy forwards,
before (kafka-python's pure-Python reader and builder) and now (aiokafka's compiled reader;
the client's bytes restamped, or a rebuild by the compiled builder where records are
dropped or headers added).

Batches of about 1 MB, records of 100 B and 1000 B of random bytes with the two identity
headers (`dedup.producer`, `dedup.sequence`), as `benchmarks/passthrough.py` sends them;
uncompressed and zstd. The cases of one record size and codec run interleaved, one timed
run of each per round for ``--repeats`` rounds, so a burst of load on the machine hits them
alike; records/s is from the fastest run of each (the least disturbed), the median is in
the CSV too.

    .venv/bin/python -m benchmarks.codec --out /tmp/bench-codec [--repeats 15]
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

from aiokafka.record._crecords import DefaultRecordBatch as CompiledRecordBatch
from kafka.record.default_records import DefaultRecordBatch, DefaultRecordBatchBuilder

from dedup import batches
from dedup.batches import (
    CODEC_NAMES,
    CODEC_NONE,
    CODEC_ZSTD,
    DEFAULT_HEADERS,
    HEADER_PRODUCER,
    HEADER_SEQUENCE,
    HEADER_SIZE,
    IncomingBatch,
    IncomingRecord,
    build_batch,
    read_batches,
    restamp_batch,
)

BATCH_BYTES: Final = 1_000_000
RECORD_BYTES: Final = (100, 1000)
CODECS: Final = (CODEC_NONE, CODEC_ZSTD)
PRODUCER: Final = (9, 1, 100)  # the proxy's producer id, epoch, base sequence


@dataclass(frozen=True)
class Row:
    record_bytes: int
    compression: str
    # parse (the codec alone), read (read_batches: checks, identities) or read+write (and
    # the batch the proxy forwards)
    step: str
    codec: str  # kafka-python, compiled, compiled+restamp, compiled+rebuild
    records: int
    batch_bytes: int
    seconds: float  # the fastest run, per batch
    median_seconds: float
    records_per_s: float  # from the fastest run


def client_batch(record_bytes: int, codec: int) -> bytes:
    """About `BATCH_BYTES` of records as a client sends them (kafka-python's builder)."""
    builder: Any = DefaultRecordBatchBuilder(
        magic=2,
        compression_type=codec,
        is_transactional=False,
        producer_id=-1,
        producer_epoch=-1,
        base_sequence=-1,
        batch_size=sys.maxsize,
    )
    now_ms = int(time.time() * 1000)
    for offset in range(BATCH_BYTES // (record_bytes + 50)):
        headers = [(HEADER_PRODUCER, b"bench-producer-1"), (HEADER_SEQUENCE, b"%d" % offset)]
        builder.append(offset, now_ms + offset, None, os.urandom(record_bytes), headers)
    return bytes(builder.build())


def read_reference(data: bytes) -> IncomingBatch:
    """kafka-python's reader with read_batches' checks (the reader before this codec)."""
    return batches._read_reference(data, 0, DEFAULT_HEADERS, False)


def build_reference(batch: IncomingBatch) -> bytes:
    """The rebuild as it was: kafka-python's builder, then the codec and the header."""
    builder: Any = DefaultRecordBatchBuilder(
        magic=2,
        compression_type=CODEC_NONE,
        is_transactional=False,
        producer_id=PRODUCER[0],
        producer_epoch=PRODUCER[1],
        base_sequence=PRODUCER[2],
        batch_size=sys.maxsize,
    )
    for offset, record in enumerate(batch.records):
        builder.append(offset, record.timestamp, record.key, record.value, list(record.headers))
    buffer = bytes(builder.build())
    if batch.compression == CODEC_NONE:
        return buffer
    body = batches._ENCODERS[batch.compression](buffer[HEADER_SIZE:])
    return build_batch_header(buffer, body, batch.compression)


def build_batch_header(buffer: bytes, body: bytes, codec: int) -> bytes:
    fields = list(batches._HEADER.unpack_from(buffer))
    fields[1] = HEADER_SIZE - 12 + len(body)
    fields[5] = codec
    out = bytearray(batches._HEADER.pack(*fields)) + body
    batches._write_crc(out)
    return bytes(out)


def rebuild(records: Sequence[IncomingRecord], batch: IncomingBatch) -> bytes:
    return build_batch(
        records,
        compression=batch.compression,
        timestamp_type=batch.timestamp_type,
        producer_id=PRODUCER[0],
        producer_epoch=PRODUCER[1],
        base_sequence=PRODUCER[2],
        add_identity_headers=True,
    )


def parse_only(reader: Any, data: bytes) -> int:
    """The records decoded by a codec alone: no checks, no identities, no objects of ours."""
    return sum(1 for _ in reader(data))


def cases(data: bytes) -> dict[tuple[str, str], Callable[[], object]]:
    return {
        ("parse", "kafka-python"): lambda: parse_only(DefaultRecordBatch, data),
        ("parse", "compiled"): lambda: parse_only(CompiledRecordBatch, data),
        ("read", "kafka-python"): lambda: read_reference(data),
        ("read", "compiled"): lambda: read_batches(data),
        ("read+write", "kafka-python"): lambda: build_reference(read_reference(data)),
        # Every record new, identities in headers: the client's bytes, restamped.
        ("read+write", "compiled+restamp"): lambda: restamp_batch(
            read_batches(data)[0].raw, *PRODUCER
        ),
        # A record dropped (or headers to add): rebuilt by the compiled builder.
        ("read+write", "compiled+rebuild"): lambda: _rebuild_without_first(data),
    }


def _rebuild_without_first(data: bytes) -> bytes:
    [batch] = read_batches(data)
    return rebuild(batch.records[1:], batch)


def timed_rounds(
    runs: dict[tuple[str, str], Callable[[], object]], repeats: int
) -> dict[tuple[str, str], list[float]]:
    """Per case, the seconds of each of its runs: one run of every case per round."""
    for run in runs.values():
        run()  # warm-up
    times: dict[tuple[str, str], list[float]] = {case: [] for case in runs}
    for _ in range(repeats):
        for case, run in runs.items():
            start = time.perf_counter()
            run()
            times[case].append(time.perf_counter() - start)
    return times


def measure(repeats: int) -> list[Row]:
    rows = []
    for record_bytes in RECORD_BYTES:
        for codec in CODECS:
            data = client_batch(record_bytes, codec)
            count = len(read_batches(data)[0].records)
            for (step, name), seconds in timed_rounds(cases(data), repeats).items():
                best = min(seconds)
                row = Row(
                    record_bytes,
                    CODEC_NAMES[codec],
                    step,
                    name,
                    count,
                    len(data),
                    round(best, 6),
                    round(statistics.median(seconds), 6),
                    round(count / best),
                )
                print(
                    f"{record_bytes:>5} B {row.compression:<5} {step:<10} {name:<17} "
                    f"{row.records_per_s:>10,.0f} records/s",
                    flush=True,
                )
                rows.append(row)
    return rows


def write_csv(path: Path, rows: list[Row]) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(asdict(rows[0])))
        writer.writeheader()
        for row in rows:
            writer.writerow(asdict(row))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for codec.csv")
    parser.add_argument("--repeats", type=int, default=15, help="timed runs per figure")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = measure(args.repeats)
    write_csv(args.out / "codec.csv", rows)
    print(f"wrote {args.out / 'codec.csv'}")


if __name__ == "__main__":
    main()

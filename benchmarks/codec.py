"""The produce path's record codec alone, in one process: records/s reading a client's batch
(`dedup.batches.read_batches`) and reading it then writing the batch the proxy forwards,
before (kafka-python's pure-Python reader and builder) and now (aiokafka's compiled reader;
the client's bytes restamped, or a rebuild by the compiled builder where records are
dropped or headers added).

Batches of about 1 MB, records of 100 B and 1000 B of random bytes with the two identity
headers (`dedup.producer`, `dedup.sequence`), as `benchmarks/passthrough.py` sends them;
uncompressed and zstd. Each figure is the median of ``--repeats`` timed runs.

    .venv/bin/python -m benchmarks.codec --out /tmp/bench-codec [--repeats 7]
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

from kafka.record.default_records import DefaultRecordBatchBuilder

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
    step: str  # read, or read+write (the batch the proxy forwards)
    codec: str  # kafka-python, compiled, compiled+restamp, compiled+rebuild
    records: int
    batch_bytes: int
    seconds: float  # median of the repeats, per batch
    records_per_s: float


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


def cases(data: bytes) -> dict[tuple[str, str], Callable[[], object]]:
    return {
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


def median_seconds(run: Callable[[], object], repeats: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(repeats: int) -> list[Row]:
    rows = []
    for record_bytes in RECORD_BYTES:
        for codec in CODECS:
            data = client_batch(record_bytes, codec)
            count = len(read_batches(data)[0].records)
            for (step, name), run in cases(data).items():
                seconds = median_seconds(run, repeats)
                row = Row(
                    record_bytes,
                    CODEC_NAMES[codec],
                    step,
                    name,
                    count,
                    len(data),
                    round(seconds, 6),
                    round(count / seconds),
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
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per figure")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = measure(args.repeats)
    write_csv(args.out / "codec.csv", rows)
    print(f"wrote {args.out / 'codec.csv'}")


if __name__ == "__main__":
    main()

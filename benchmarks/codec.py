"""The produce path's record codec alone, in one process: records/s reading a client's batch
(`dedup.batches.read_batches`) and reading it then writing the batch the proxy forwards, by
each reader the proxy has had: kafka-python's pure-Python reader and builder; aiokafka's
compiled reader (a record object each; the client's bytes restamped, or a rebuild by the
compiled builder where records are dropped or headers added); and the Rust scan
(`dedup._records`) of a uniform batch, which makes no object per record (restamped, or for
implicit identities rewritten with their headers in Rust).

Batches of about 1 MB, records of 100 B and 1000 B of random bytes with the two identity
headers (`dedup.producer`, `dedup.sequence`), as `benchmarks/passthrough.py` sends them;
and the same records without headers from an idempotent producer (implicit identities,
step ``implicit``: read and written with the identity headers added); uncompressed and
zstd. The cases of one record size and codec run interleaved, one timed
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
    rewritten_with_identity_headers,
)

BATCH_BYTES: Final = 1_000_000
RECORD_BYTES: Final = (100, 1000)
CODECS: Final = (CODEC_NONE, CODEC_ZSTD)
PRODUCER: Final = (9, 1, 100)  # the proxy's producer id, epoch, base sequence


@dataclass(frozen=True)
class Row:
    record_bytes: int
    compression: str
    # parse (the codec alone), read (read_batches: checks, identities), read+write (and
    # the batch the proxy forwards), implicit (read+write of implicit identities)
    step: str
    codec: str  # kafka-python, compiled[+restamp|+rebuild], rust scan[+restamp|+rewrite]
    records: int
    batch_bytes: int
    seconds: float  # the fastest run, per batch
    median_seconds: float
    records_per_s: float  # from the fastest run


def client_batch(record_bytes: int, codec: int, *, implicit: bool = False) -> bytes:
    """About `BATCH_BYTES` of records as a client sends them (kafka-python's builder): with
    identity headers, or (`implicit`) without, from an idempotent producer."""
    builder: Any = DefaultRecordBatchBuilder(
        magic=2,
        compression_type=codec,
        is_transactional=False,
        producer_id=77 if implicit else -1,
        producer_epoch=0 if implicit else -1,
        base_sequence=0 if implicit else -1,
        batch_size=sys.maxsize,
    )
    now_ms = int(time.time() * 1000)
    for offset in range(BATCH_BYTES // (record_bytes + 50)):
        headers = [(HEADER_PRODUCER, b"bench-producer-1"), (HEADER_SEQUENCE, b"%d" % offset)]
        builder.append(
            offset, now_ms + offset, None, os.urandom(record_bytes), [] if implicit else headers
        )
    return bytes(builder.build())


def read_reference(data: bytes) -> IncomingBatch:
    """kafka-python's reader with read_batches' checks (the reader before this codec)."""
    return batches._read_reference(data, 0, DEFAULT_HEADERS, False, None)


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


def cases(data: bytes, implicit: bytes) -> dict[tuple[str, str], Callable[[], object]]:
    return {
        ("parse", "kafka-python"): lambda: parse_only(DefaultRecordBatch, data),
        ("parse", "compiled"): lambda: parse_only(CompiledRecordBatch, data),
        ("read", "kafka-python"): lambda: read_reference(data),
        ("read", "compiled"): lambda: read_compiled(data),
        ("read", "rust scan"): lambda: read_batches(data),
        ("read+write", "kafka-python"): lambda: build_reference(read_reference(data)),
        # Every record new, identities in headers: the client's bytes, restamped.
        ("read+write", "compiled+restamp"): lambda: restamp_batch(
            read_compiled(data).raw, *PRODUCER
        ),
        ("read+write", "rust scan+restamp"): lambda: restamp_batch(
            read_batches(data)[0].raw, *PRODUCER
        ),
        # A record dropped: rebuilt by the compiled builder (whatever read the batch).
        ("read+write", "compiled+rebuild"): lambda: _rebuild_without_first(data),
        # Implicit identities, every record new: the headers added.
        ("implicit", "compiled+rebuild"): lambda: rebuild(
            read_compiled(implicit).records, read_compiled(implicit)
        ),
        ("implicit", "rust scan+rewrite"): lambda: _rewritten(implicit),
    }


def read_compiled(data: bytes) -> IncomingBatch:
    """The compiled reader's batch (a record object each), the Rust scan left out."""
    batch = batches._read_compiled(data, DEFAULT_HEADERS, False)
    assert batch is not None
    return batch


def _rebuild_without_first(data: bytes) -> bytes:
    batch = read_compiled(data)
    return rebuild(batch.records[1:], batch)


def _rewritten(data: bytes) -> bytes:
    [batch] = read_batches(data)
    header, records = rewritten_with_identity_headers(
        batch, producer_id=PRODUCER[0], producer_epoch=PRODUCER[1], base_sequence=PRODUCER[2]
    )
    return header + records


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
            implicit = client_batch(record_bytes, codec, implicit=True)
            count = len(read_batches(data)[0].records)
            if read_batches(data)[0].run is None or read_batches(implicit)[0].run is None:
                raise SystemExit("the Rust scan is not built (dedup._records): see README")
            for (step, name), seconds in timed_rounds(cases(data, implicit), repeats).items():
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

"""Record batches of one partition: reading them with each record's identity, and building
the batch the proxy forwards from the records it keeps.

A uniform batch (every record of one producer with sequences in a row, or every record of
implicit identity) is read by the project's Rust scan (`dedup._records`, built from
`records_native/`) into a `BatchRun`, its records left undecoded (`LazyRecords`); implicit
identities get their headers by the Rust rewrite (`rewritten_with_identity_headers`). The scan
declines anything else, which is read record by record: the record-batch format (magic 2)
is read and written by aiokafka's compiled codec
(`aiokafka.record._crecords`), with kafka-python's pure-Python reader as the reference for
what it must read alike (`_read_compiled`: input it cannot vouch for goes to the reference),
`kafka.codec` for compression and the `crc32c` package for CRC32C; this module adds the
checks a broker makes on a produce request, with the broker's error codes, and the identity
rules (names and sequence text: `dedup.identity`; docs/design.md, "1. Identity"):

- Explicit identity: headers `dedup.producer` (UTF-8, non-empty) and `dedup.sequence`
  (signed 64-bit integer, ASCII decimal as Java's `Long.parseLong` reads it: an optional
  sign, then digits, at most 64 bytes; `dedup.identity.parse_sequence`). Both or neither;
  if a name occurs more than once the last occurrence counts (Java's `Headers.lastHeader`),
  so the proxy and a consumer agree on what a record says.
- Implicit identity: a record without identity headers in a batch with producer id >= 0
  that is neither transactional nor control is producer `kafka-pid-<id>-<epoch>` with
  sequence `(baseSequence + offsetDelta) mod 2**31`. That is the sequence Kafka itself
  gives the record (`DefaultRecordBatch.incrementSequence`: int32 sequences wrap from
  2**31-1 to 0), so it names the same record Kafka's own idempotence does. A long-lived
  idempotent producer does wrap (2**31 records per producer id and epoch): the owner
  unwraps them before the check (`dedup.implicit_wraps`, `BatchRun.unwrapped`).
- Chunked messages (`dedup.chunks`): a record with chunk headers (``dedup.uuid``,
  ``dedup.chunk.id``, ``dedup.chunk.count``, ``dedup.total.size``) needs an explicit identity
  (chunks of one message share a sequence, which implicit identities cannot), a non-null
  value no larger than the total size, and valid headers; else INVALID_RECORD. The rest of
  the chunk rule needs the chunks before it: the check's (`dedup.chunks.accept_chunk`).
- Transactional and control batches: no identity (they are forwarded untouched).

Error codes: where Kafka 4 refuses the same bytes, its code; the rule behind them:

- The bytes are damaged (framing lengths, truncation, CRC32C mismatch, impossible magic):
  `CORRUPT_MESSAGE` (2), which clients retry, as for damage in transit.
- The bytes are intact (CRC32C matches) but what they say is refused: magic 0 or 1
  (Kafka's `ProduceRequest.validateRecords` answers this for produce v3+, the only
  versions Kafka 4 takes), more or fewer than one batch, a bad record count or offset
  delta, a control batch, a record that does not parse, a payload that does not
  decompress (Kafka: UNKNOWN_SERVER_ERROR), a bad identity header: `INVALID_RECORD` (87),
  not retriable, since resending the same bytes cannot help.
- An unknown compression codec id (5..7): `UNSUPPORTED_COMPRESSION_TYPE` (76).
- Over a bound of `ReadLimits` (a Produce request's batches only, never the log's):
  more records than `max_records`, or decompressing to more than `max_decompressed_bytes`
  (stopped there, never decompressed in full): `MESSAGE_TOO_LARGE` (10), on which Kafka's
  Java producer splits the batch and retries; a record with more headers than
  `max_headers`, or a producer name longer than `max_producer_bytes`: `INVALID_RECORD`.

`read_batches(..., from_log=True)` reads batches fetched from a partition's log (replay)
instead: a partial batch at the end is normal there (Fetch cuts at max bytes), compaction
leaves gaps in offset deltas and empty batches, control batches (transaction markers)
occur, and identity comes from headers only (see `read_batches`).
"""

from __future__ import annotations

import gzip
import io
import struct
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, overload

import kafka.codec as _codec
import lz4.frame  # type: ignore[import-untyped]
import zstandard
from aiokafka.record._crecords import DefaultRecordBatch as _CompiledBatch
from aiokafka.record._crecords import DefaultRecordBatchBuilder as _CompiledBuilder
from crc32c import crc32c as _crc32c
from kafka.record.default_records import DefaultRecordBatch
from kio.schema.errors import ErrorCode

from dedup.chunks import CHUNK_HEADERS, ChunkError, ChunkMeta, parse_chunk_headers
from dedup.crc import crc32c_combine, crc32c_of_second
from dedup.identity import (
    DEFAULT_PRODUCER_HEADER,
    DEFAULT_SEQUENCE_HEADER,
    parse_sequence,
    sequence_fault,
)

try:  # the Rust record scan (dedup/records_native): optional, see `NATIVE_SCAN`
    from dedup import _records as _native  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - a machine without a Rust toolchain
    _native = None


def copy_of(data: bytes, start: int, end: int) -> bytes:
    """data[start:end], copied by the Rust module with the GIL released where it is built:
    from a worker thread, a large copy then leaves the event loop free (a slice holds the
    GIL while it copies)."""
    if _native is not None:
        return _native.copy_of(data, start, end)  # type: ignore[no-any-return]
    return data[start:end]


# Whether uniform batches are read by the Rust scan (`_read_uniform`). Without it every
# batch is read record by record in Python: the same answers, several times slower.
NATIVE_SCAN: Final = _native is not None


class _NativeScan:
    on = NATIVE_SCAN  # `use_native_scan`: built, and not switched off


def use_native_scan(enabled: bool) -> bool:
    """Switch the Rust scan on or off for this process (the `native_record_scan` setting:
    the Python readers without a rebuild, should the scan ever be in doubt); whether it is
    in use now (never when it is not built)."""
    _NativeScan.on = enabled and NATIVE_SCAN
    return _NativeScan.on


HEADER_PRODUCER: Final = DEFAULT_PRODUCER_HEADER
HEADER_SEQUENCE: Final = DEFAULT_SEQUENCE_HEADER

IMPLICIT_PRODUCER_PREFIX: Final = "kafka-pid-"
IMPLICIT_SEQUENCE_MODULUS: Final = 1 << 31
_UNBOUNDED_SEQUENCES: Final = (1 << 63) - 1  # the rewrite's modulus for unwrapped ones

CODEC_NONE: Final = 0
CODEC_GZIP: Final = 1
CODEC_SNAPPY: Final = 2
CODEC_LZ4: Final = 3
CODEC_ZSTD: Final = 4
CODEC_NAMES: Final = {0: "none", 1: "gzip", 2: "snappy", 3: "lz4", 4: "zstd"}

TIMESTAMP_CREATE_TIME: Final = 0
TIMESTAMP_LOG_APPEND_TIME: Final = 1

# The batch header: base offset, length, partition leader epoch, magic, CRC, attributes,
# last offset delta, first and max timestamp, producer id, producer epoch, base sequence,
# record count (Kafka's DefaultRecordBatch; kafka-python's HEADER_STRUCT is the same).
_HEADER: Final = struct.Struct(">qiibIhiqqqhii")
HEADER_SIZE: Final[int] = _HEADER.size  # 61: Kafka's RECORD_BATCH_OVERHEAD
_LOG_OVERHEAD: Final = 12  # base offset (8) + length (4)
_MAGIC_OFFSET: Final = 16
_CRC_OFFSET: Final = 17
_ATTRIBUTES_OFFSET: Final = 21  # the CRC32C covers the batch from here to its end
_PRODUCER_OFFSET: Final = 43
_PRODUCER: Final = struct.Struct(">qhi")  # producer id, producer epoch, base sequence
_RECORD_COUNT_OFFSET: Final = 57  # the header's last field, then the records
_CODEC_MASK: Final = 0x07
_TIMESTAMP_TYPE_MASK: Final = 0x08
_TRANSACTIONAL_MASK: Final = 0x10
_CONTROL_MASK: Final = 0x20

_SHOW_BYTES: Final = 40


class BadBatch(Exception):
    """A partition's record data that must be refused: the Kafka error code to answer for
    that partition and a message for the client (Produce v8+ `error_message`) and the log."""

    def __init__(self, error_code: ErrorCode, message: str) -> None:
        super().__init__(f"{error_code.name} ({int(error_code)}): {message}")
        self.error_code = error_code
        self.message = message


class LimitExceeded(BadBatch):
    """Over a bound of `ReadLimits`: refused at once, never handed to the reference reader
    (which would do the unbounded work the bound is there to prevent)."""


@dataclass(frozen=True, slots=True)
class ReadLimits:
    """What one partition batch of a Produce request may expand to (defaults: the proxy's
    settings of the same names, docs/operations.md)."""

    max_records: int = 50_000
    max_decompressed_bytes: int = 32 << 20
    max_headers: int = 1_000
    max_producer_bytes: int = 256


@dataclass(frozen=True, slots=True)
class IdentityHeaders:
    """The names of the two identity headers (configurable; defaults: `dedup.identity`)."""

    producer: str = HEADER_PRODUCER
    sequence: str = HEADER_SEQUENCE

    def __post_init__(self) -> None:
        if not self.producer or not self.sequence:
            raise ValueError("identity header names must not be empty")
        if self.producer == self.sequence:
            raise ValueError(f"identity header names must differ, both are {self.producer!r}")


DEFAULT_HEADERS: Final = IdentityHeaders()


@dataclass(frozen=True, slots=True)
class Identity:
    producer: str
    sequence: int


@dataclass(frozen=True, slots=True)
class IncomingRecord:
    offset_delta: int
    timestamp: int  # ms; for a LOG_APPEND_TIME batch the batch's max timestamp
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes | None], ...]
    identity: Identity | None
    chunk: ChunkMeta | None = None  # the chunk headers (`dedup.chunks`) of a chunked message


@dataclass(frozen=True, slots=True)
class BatchRun:
    """The identities of a uniform batch, whole: record i is `producer`'s with sequence
    `first + i` (an implicit one wrapping at 2^31, as Kafka's do). Found by the Rust scan
    without a Python object per record (`_read_uniform`)."""

    producer: str
    first: int
    count: int
    implicit: bool
    # The records can be written again with identity headers by the Rust rewrite
    # (`with_identity_headers`): implicit, create time, first record at the first timestamp.
    rewritable: bool = False
    max_timestamp: int = -1  # the largest record timestamp (for the rewrite's header)
    # Implicit sequences counted on past Kafka's wrap (`dedup.implicit_wraps`): `first + i`.
    unwrapped: bool = False

    @property
    def wraps(self) -> bool:
        """Whether its sequences wrap at 2^31 (Kafka's, as read)."""
        return self.implicit and not self.unwrapped

    def sequence(self, index: int) -> int:
        sequence = self.first + index
        return sequence % IMPLICIT_SEQUENCE_MODULUS if self.wraps else sequence

    def runs(self) -> list[tuple[str, int, int, int]]:
        """As the check's runs (`dedup.state.check_runs`): split where an implicit sequence
        wraps to 0."""
        if not self.wraps or self.first + self.count <= IMPLICIT_SEQUENCE_MODULUS:
            return [(self.producer, self.first, self.first + self.count - 1, self.count)]
        before = IMPLICIT_SEQUENCE_MODULUS - self.first
        return [
            (self.producer, self.first, IMPLICIT_SEQUENCE_MODULUS - 1, before),
            (self.producer, 0, self.count - before - 1, self.count - before),
        ]


class LazyRecords(Sequence["IncomingRecord"]):
    """A uniform batch's records, decoded into `IncomingRecord`s only when something asks
    for one (a duplicate to drop, a rebuild, a policy that inspects records): the usual
    batch, every record new, is written without them. Its length needs no decoding."""

    __slots__ = ("_count", "_load", "_records")

    def __init__(self, count: int, load: Callable[[], tuple[IncomingRecord, ...]]) -> None:
        self._count = count
        self._load: Callable[[], tuple[IncomingRecord, ...]] | None = load
        self._records: tuple[IncomingRecord, ...] | None = None

    def _loaded(self) -> tuple[IncomingRecord, ...]:
        if self._records is None:
            assert self._load is not None
            records = self._load()
            if len(records) != self._count:
                raise AssertionError(f"{len(records)} records decoded, {self._count} scanned")
            self._records, self._load = records, None
        return self._records

    @property
    def loaded(self) -> bool:
        return self._records is not None

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> IncomingRecord: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[IncomingRecord, ...]: ...
    def __getitem__(self, index: int | slice) -> IncomingRecord | tuple[IncomingRecord, ...]:
        return self._loaded()[index]

    def __iter__(self) -> Iterator[IncomingRecord]:
        return iter(self._loaded())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, LazyRecords):
            other = other._loaded()
        return isinstance(other, tuple) and self._loaded() == other

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"LazyRecords({self._count}, loaded={self.loaded})"


@dataclass(frozen=True, slots=True)
class IncomingBatch:
    records: tuple[IncomingRecord, ...] | LazyRecords
    compression: int  # Kafka codec id 0..4
    timestamp_type: int  # 0 create time, 1 log append time
    producer_id: int
    producer_epoch: int
    base_sequence: int
    transactional: bool
    control: bool
    raw: bytes  # the batch's exact bytes, to forward untouched
    # Where the batch sits in a log (from_log); 0 and n-1 in a produce request.
    base_offset: int = 0
    last_offset_delta: int = -1
    # Read by the compiled reader: every record in its shortest encoding, so Kafka reads
    # `raw` as the proxy did, and `restamp_batch` may forward it.
    canonical: bool = False
    # Some record's identity is implicit, not in its headers: a rebuild would add them.
    implicit_identities: bool = False
    # The bytes of its records decompressed, when read within limits (else -1)
    decompressed_size: int = -1
    # Every record's identity at once, for a uniform batch read by the Rust scan (its
    # records are then `LazyRecords`); None: look at each record's. Not compared: the same
    # batch read either way is equal.
    run: BatchRun | None = field(default=None, compare=False)


def records_declared(data: bytes | memoryview) -> int | None:
    """How many records the batches of a partition's records say they hold (each header's
    count, summed), without reading a record; None where the bytes are not whole batches
    of magic 2. For an answer (`dedup.produce_filter`), on bytes the engine read already."""
    total, pos, end = 0, 0, len(data)
    while pos < end:
        if end - pos < HEADER_SIZE or data[pos + _MAGIC_OFFSET] != 2:
            return None
        (length,) = struct.unpack_from(">i", data, pos + 8)
        (count,) = struct.unpack_from(">i", data, pos + _RECORD_COUNT_OFFSET)
        if length < HEADER_SIZE - _LOG_OVERHEAD or count < 0:
            return None
        total += count
        pos += _LOG_OVERHEAD + length
    return total if pos == end else None


def kafka_sequenced(batch: IncomingBatch) -> bool:
    """The batch carries Kafka's own sequences: an idempotent producer's, outside a
    transaction, and not a control batch."""
    return (
        batch.producer_id >= 0
        and batch.producer_epoch >= 0
        and batch.base_sequence >= 0
        and not (batch.transactional or batch.control)
    )


def implicit_producer(producer_id: int, producer_epoch: int) -> str:
    return f"{IMPLICIT_PRODUCER_PREFIX}{producer_id}-{producer_epoch}"


def kafka_producer_of(name: str) -> tuple[int, int] | None:
    """The Kafka producer id and epoch an implicit identity's producer name stands for
    (`implicit_producer`'s inverse); None for any other name."""
    if not name.startswith(IMPLICIT_PRODUCER_PREFIX):
        return None
    producer_id, _, epoch = name[len(IMPLICIT_PRODUCER_PREFIX) :].rpartition("-")
    if not (producer_id.isdigit() and epoch.isdigit()):
        return None
    return int(producer_id), int(epoch)


def implicit_sequence(base_sequence: int, offset_delta: int) -> int:
    """Kafka's sequence of the record at `offset_delta` (int32, wrapping to 0)."""
    return (base_sequence + offset_delta) % IMPLICIT_SEQUENCE_MODULUS


# --------------------------------------------------------------------------- reading


def read_batches(
    data: bytes,
    headers: IdentityHeaders = DEFAULT_HEADERS,
    *,
    from_log: bool = False,
    limits: ReadLimits | None = None,
) -> list[IncomingBatch]:
    """The record batches in `data` with every record and its identity.

    By default `data` is the records of one partition of a Produce request and is checked as
    a broker checks it: exactly one batch, magic 2, CRC32C, a record count that matches the
    last offset delta, offset deltas 0..n-1, no control batch, a base sequence with a
    producer id. Any problem raises `BadBatch`; nothing else is raised for any bytes.

    With `from_log=True` `data` is what a Fetch returned (replay): a partial batch at the
    end is skipped, the produce-only checks (batch count, record count, offset deltas,
    control, base sequence) are off, and identity comes from headers only: every identity
    the proxy accepted is in the log as headers, while the batch header there carries the
    proxy's own producer id, so implicit identities would be bogus. A record whose identity
    headers are malformed (written around the proxy) has no identity instead of failing
    the replay.

    `limits` bound what a produce request's batch may expand to (see the module); the log
    is read without bounds, since its records are what recovery must read back.
    """
    batches: list[IncomingBatch] = []
    pos, end = 0, len(data)
    while pos < end:
        index = len(batches)
        remaining = end - pos
        if remaining <= _MAGIC_OFFSET:
            if from_log:
                break
            raise BadBatch(
                ErrorCode.corrupt_message,
                f"batch {index} is truncated: {remaining} bytes, fewer than the "
                f"{_MAGIC_OFFSET + 1} bytes up to its magic byte",
            )
        length = int.from_bytes(data[pos + 8 : pos + 12], "big", signed=True)
        magic = int.from_bytes(
            data[pos + _MAGIC_OFFSET : pos + _MAGIC_OFFSET + 1], "big", signed=True
        )
        if magic in (0, 1):
            raise BadBatch(
                ErrorCode.invalid_record,
                f"batch {index} has magic {magic}: only record batches with magic 2 are "
                "accepted (as Kafka does in produce requests of version 3 and above)",
            )
        if magic != 2:
            raise BadBatch(
                ErrorCode.corrupt_message, f"batch {index} has invalid magic byte {magic}"
            )
        if length < HEADER_SIZE - _LOG_OVERHEAD:
            raise BadBatch(
                ErrorCode.corrupt_message,
                f"batch {index} declares {length} bytes after its length field, fewer than "
                f"a batch header's {HEADER_SIZE - _LOG_OVERHEAD}",
            )
        batch_end = pos + _LOG_OVERHEAD + length
        if batch_end > end:
            if from_log:
                break
            raise BadBatch(
                ErrorCode.corrupt_message,
                f"batch {index} is truncated: it declares {_LOG_OVERHEAD + length} bytes, "
                f"{remaining} are there",
            )
        if index >= 1 and not from_log:
            raise BadBatch(
                ErrorCode.invalid_record,
                "produce requests of version 3 and above may contain exactly one record "
                "batch per partition",
            )
        batches.append(_read_batch(bytes(data[pos:batch_end]), index, headers, from_log, limits))
        pos = batch_end
    if not batches and not from_log:
        raise BadBatch(
            ErrorCode.invalid_record,
            "produce requests of version 3 and above must have one record batch per partition",
        )
    return batches


def _read_batch(
    raw: bytes, index: int, names: IdentityHeaders, from_log: bool, limits: ReadLimits | None
) -> IncomingBatch:
    """The compiled reader where it is sure to read what the reference reader reads; the
    reference reader for everything else: bad input (its checks and messages are the
    rules) and encodings no client writes. Bounds first, on an intact batch (a damaged
    one is the reference reader's: CORRUPT_MESSAGE before it decompresses anything)."""
    fields = _HEADER.unpack_from(raw)
    intact = _crc32c(memoryview(raw)[_ATTRIBUTES_OFFSET:]) == fields[4]
    body = None
    if limits is not None and intact:
        body = _within_limits(raw, fields, index, limits)
    batch = None
    if intact and not from_log:
        batch = _read_uniform(raw, names, fields, body, limits)
    # The scan bounds every record's headers itself; the compiled reader does not.
    large = body is not None and len(body) > SCAN_HEADERS_ABOVE_BYTES
    if batch is None and limits is not None and body is not None and large:
        _scan_header_counts(body, limits.max_headers)
    if intact and batch is None:
        batch = _read_compiled(
            raw, names, from_log, fields=fields, intact=intact, body=body, limits=limits
        )
    if batch is None:
        size = -1 if body is None else len(body)
        batch = _read_reference(raw, index, names, from_log, limits, size)
    return batch


def _records_of(
    codec: int, raw: bytes, body: bytes | memoryview | None = None
) -> tuple[bytes, int] | None:
    """A batch's records and where they start: the raw batch after its header, or its body
    decompressed (`body`, when that is done already); None when it does not decompress."""
    if codec == CODEC_NONE:
        return raw, HEADER_SIZE
    if body is None:
        body = _decompressed(codec, memoryview(raw)[HEADER_SIZE:])
        if body is None:
            return None
    return bytes(body), 0


def _read_uniform(
    raw: bytes,
    names: IdentityHeaders,
    fields: tuple[Any, ...],
    body: bytes | memoryview | None,
    limits: ReadLimits | None,
) -> IncomingBatch | None:
    """An intact produce batch the Rust scan finds uniform (`BatchRun`), its records left
    undecoded (`LazyRecords`); None for any other (read record by record). The scan
    vouches only for what the compiled reader would read alike: every record in its
    shortest encoding, offset deltas 0..n-1, no chunk header, no identity header repeated
    or half there; the Python readers decide everything else, errors included."""
    attributes, last_offset_delta, first_timestamp = fields[5:8]
    producer_id, producer_epoch, base_sequence, count = fields[9:13]
    codec = attributes & _CODEC_MASK
    if (
        _native is None
        or not _NativeScan.on
        or codec not in CODEC_NAMES
        or attributes & (_CONTROL_MASK | _TRANSACTIONAL_MASK)
        or count <= 0
        or last_offset_delta != count - 1
        or (producer_id >= 0 and base_sequence < 0)
        or _CHUNK_NAMES.intersection((names.producer, names.sequence))
    ):
        return None
    if body is None and codec != CODEC_NONE and limits is not None:
        return None  # `_within_limits` found it does not decompress
    records = _records_of(codec, raw, body)
    if records is None:
        return None
    data, start = records
    size = -1 if limits is None else len(data) - start  # as `_read_compiled` reports it
    bounds = limits or _UNBOUNDED
    found = _native.scan(
        data,
        start,
        count,
        names.producer.encode("utf-8"),
        names.sequence.encode("utf-8"),
        _CHUNK_NAME_BYTES,
        bounds.max_headers,
        bounds.max_producer_bytes,
    )
    if found is None:
        return None
    explicit, first_delta, max_delta = found
    log_append = bool(attributes & _TIMESTAMP_TYPE_MASK)
    if explicit is not None:
        producer_bytes, first_sequence = explicit
        try:
            producer = producer_bytes.decode("utf-8")
        except UnicodeDecodeError:  # the scan checked it: never
            return None
        run = BatchRun(producer, first_sequence, count, implicit=False)
    elif producer_id >= 0:
        run = BatchRun(
            implicit_producer(producer_id, producer_epoch),
            base_sequence,
            count,
            implicit=True,
            rewritable=not log_append and first_delta == 0,
            max_timestamp=first_timestamp + max_delta,
        )
    else:
        return None  # no identity at all: read as before (rarely worth a fast path)

    def load() -> tuple[IncomingRecord, ...]:
        read = _read_compiled(raw, names, False, fields=fields, intact=True, body=body)
        if read is None:  # the scan and the compiled reader disagree: a defect
            read = _read_reference(raw, 0, names, False, None)
        return tuple(read.records)

    return IncomingBatch(
        records=LazyRecords(count, load),
        compression=codec,
        timestamp_type=int(log_append),
        producer_id=producer_id,
        producer_epoch=producer_epoch,
        base_sequence=base_sequence,
        transactional=False,
        control=False,
        raw=raw,
        base_offset=fields[0],
        last_offset_delta=last_offset_delta,
        canonical=True,
        implicit_identities=run.implicit,
        decompressed_size=size,
        run=run,
    )


def _within_limits(
    raw: bytes, fields: tuple[Any, ...], index: int, limits: ReadLimits
) -> bytes | memoryview | None:
    """Raises `LimitExceeded` for a batch over `limits`; else its records decompressed (None
    when they do not decompress: the reference reader says why)."""
    count, codec = fields[12], fields[5] & _CODEC_MASK
    if count > limits.max_records:
        raise LimitExceeded(
            ErrorCode.message_too_large,
            f"batch {index} has {count} records, over the proxy's max_batch_records "
            f"{limits.max_records}",
        )
    if codec not in CODEC_NAMES:
        return None
    try:
        body = _bounded_decompressed(codec, memoryview(raw)[HEADER_SIZE:], limits)
    except _OverLimit:
        body = None
        over = True
    else:
        over = body is not None and len(body) > limits.max_decompressed_bytes
    if over:
        raise LimitExceeded(
            ErrorCode.message_too_large,
            f"batch {index}'s {CODEC_NAMES[codec]} records decompress to more than "
            f"{limits.max_decompressed_bytes} bytes, the most the proxy takes "
            "(max_batch_decompressed_bytes, and max_request_decompressed_bytes for all the "
            "partitions of a request)",
        )
    return body


# The compiled reader holds the GIL while it parses a record, headers and all (some 70 ns
# a header): a record of millions of empty headers, two bytes each, would stop the event
# loop for as long. Records bodies larger than this are walked first (in Python, which
# lets the loop run between bytecodes; about 1 us a record) for each record's header
# count; smaller ones hold too few headers to matter (at most 256k headers, some 20 ms).
SCAN_HEADERS_ABOVE_BYTES: Final = 512 << 10


def _scan_header_counts(body: bytes | memoryview, max_headers: int) -> None:
    """Raises `LimitExceeded` at the first record declaring more than `max_headers` headers.
    Stops quietly at anything malformed: the readers refuse it (the reference reader, which
    lets the loop run, for anything the compiled one cannot read)."""
    try:
        _scan(body if isinstance(body, bytes) else bytes(body), max_headers)
    except IndexError:  # a varint running past the end
        return


def _scan(data: bytes, max_headers: int) -> None:
    end, pos = len(data), 0
    varint = _varint_at
    while pos < end:
        # Record length, then (after the attributes byte) timestamp delta, offset delta,
        # key length and key, value length and value, header count: zigzag varints, most
        # of them one byte (read inline).
        b = data[pos]
        if b < 0x80:
            length, pos = (b >> 1) ^ -(b & 1), pos + 1
        else:
            length, pos = varint(data, pos)
        record_end = pos + length
        if length <= 0 or record_end > end:
            return
        at = pos + 1  # the timestamp delta, then the offset delta: skipped
        while data[at] >= 0x80:
            at += 1
        at += 1
        delta_at = at
        while data[at] >= 0x80:
            at += 1
        at += 1
        b = data[at]  # key length and key
        if b < 0x80:
            at += 1 + max((b >> 1) ^ -(b & 1), 0)
        else:
            key_length, at = varint(data, at)
            at += max(key_length, 0)
        if at >= end:
            return
        b = data[at]  # value length and value
        if b < 0x80:
            at += 1 + max((b >> 1) ^ -(b & 1), 0)
        else:
            value_length, at = varint(data, at)
            at += max(value_length, 0)
        if at >= end:
            return
        b = data[at]  # header count
        if b >= 0x80 or (b >> 1) > max_headers:  # one byte: at most 63 headers
            headers, _ = varint(data, at)
            if headers > max_headers:
                offset_delta, _ = varint(data, delta_at)
                raise LimitExceeded(
                    ErrorCode.invalid_record,
                    f"record at offset delta {offset_delta} has {headers} headers, over the "
                    f"proxy's max_headers_per_record {max_headers}",
                )
        pos = record_end


def _varint_at(data: bytes, pos: int) -> tuple[int, int]:
    """Kafka's zigzag varint at `pos` (at most 10 bytes) and the position after it; past
    the end of `data`, what was read so far."""
    value = shift = 0
    for i in range(pos, min(pos + 10, len(data))):
        byte = data[i]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return (value >> 1) ^ -(value & 1), i + 1
        shift += 7
    return (value >> 1) ^ -(value & 1), len(data)


def _read_reference(
    raw: bytes,
    index: int,
    names: IdentityHeaders,
    from_log: bool,
    limits: ReadLimits | None,
    decompressed_size: int = -1,
) -> IncomingBatch:
    """kafka-python's pure-Python reader with every check of a produce request: the rules.
    Its codec is over ten times slower than the compiled one, so it reads only what
    `_read_compiled` leaves."""
    batch: Any = DefaultRecordBatch(raw)
    if not batch.validate_crc():
        computed = _crc32c(memoryview(raw)[_ATTRIBUTES_OFFSET:])
        raise BadBatch(
            ErrorCode.corrupt_message,
            f"batch {index} is corrupt: stored CRC32C {int(batch.crc):#010x}, "
            f"computed {computed:#010x}",
        )
    attributes = int(batch.attributes)
    codec = attributes & _CODEC_MASK
    if codec not in CODEC_NAMES:
        raise BadBatch(
            ErrorCode.unsupported_compression_type,
            f"batch {index} uses unknown compression codec id {codec}",
        )
    count = int(batch.records_count)
    last_offset_delta = int(batch.last_offset_delta)
    producer_id = int(batch.producer_id)
    producer_epoch = int(batch.producer_epoch)
    base_sequence = int(batch.base_sequence)
    transactional = bool(attributes & _TRANSACTIONAL_MASK)
    control = bool(attributes & _CONTROL_MASK)
    timestamp_type = int(bool(attributes & _TIMESTAMP_TYPE_MASK))
    if count < 0 or (count == 0 and not from_log):  # compaction can leave empty batches
        raise BadBatch(ErrorCode.invalid_record, f"batch {index} has record count {count}")
    if not from_log:
        if last_offset_delta != count - 1:
            raise BadBatch(
                ErrorCode.invalid_record,
                f"batch {index} has {count} records but last offset delta {last_offset_delta}",
            )
        if control:
            raise BadBatch(
                ErrorCode.invalid_record, "clients are not allowed to write control records"
            )
        if producer_id >= 0 and base_sequence < 0:
            raise BadBatch(
                ErrorCode.invalid_record,
                f"batch {index} has producer id {producer_id} but base sequence {base_sequence}",
            )
    codec_name = CODEC_NAMES[codec]
    try:
        iterator = iter(batch)  # decompresses
    except Exception as exc:
        raise BadBatch(
            ErrorCode.invalid_record,
            f"batch {index}: its {codec_name} payload does not decompress: {_describe(exc)}",
        ) from exc
    identify = _Identify(
        names, from_log, attributes, producer_id, producer_epoch, base_sequence, limits
    )
    base_offset = int(batch.base_offset)
    records: list[IncomingRecord] = []
    position = 0
    try:
        for record in iterator:
            offset_delta = int(record.offset) - base_offset
            if not from_log and offset_delta != position:
                raise BadBatch(
                    ErrorCode.invalid_record,
                    f"batch {index}: record {position} has offset delta {offset_delta}, "
                    f"expected {position}",
                )
            record_headers: tuple[tuple[str, bytes | None], ...] = tuple(record.headers)
            identify.count_headers(len(record_headers), offset_delta)
            identity, chunk = identify(record_headers, offset_delta, record.value)
            records.append(
                IncomingRecord(
                    offset_delta=offset_delta,
                    timestamp=int(record.timestamp),
                    key=record.key,
                    value=record.value,
                    headers=record_headers,
                    identity=identity,
                    chunk=chunk,
                )
            )
            position += 1
    except BadBatch:
        raise
    except Exception as exc:
        raise BadBatch(
            ErrorCode.invalid_record,
            f"batch {index}: record {position} does not parse: {_describe(exc)}",
        ) from exc
    return IncomingBatch(
        records=tuple(records),
        compression=codec,
        timestamp_type=timestamp_type,
        producer_id=producer_id,
        producer_epoch=producer_epoch,
        base_sequence=base_sequence,
        transactional=transactional,
        control=control,
        raw=raw,
        base_offset=base_offset,
        last_offset_delta=last_offset_delta,
        implicit_identities=identify.implicit_given,
        decompressed_size=decompressed_size,
    )


_ABSENT: Final = object()
_CHUNK_NAMES: Final = frozenset(CHUNK_HEADERS)
_CHUNK_NAME_BYTES: Final = [name.encode("utf-8") for name in CHUNK_HEADERS]
# No bounds (a caller without limits): the scan takes int64 and usize arguments.
_UNBOUNDED: Final = ReadLimits(max_headers=(1 << 63) - 3, max_producer_bytes=1 << 62)
_SHORT_SEQUENCE: Final = 18  # digits: below 10**18 < 2**63, so no range check


class _Identify:
    """Each record's identity and chunk headers, by the rules above, for one batch."""

    __slots__ = (
        "base_sequence",
        "fast",
        "from_log",
        "implicit",
        "implicit_given",
        "max_headers",
        "max_producer",
        "names",
        "producer",
        "sequence",
        "with_identity",
    )

    def __init__(
        self,
        names: IdentityHeaders,
        from_log: bool,
        attributes: int,
        producer_id: int,
        producer_epoch: int,
        base_sequence: int,
        limits: ReadLimits | None = None,
    ) -> None:
        self.names = names
        self.max_headers = sys.maxsize if limits is None else limits.max_headers
        self.max_producer = sys.maxsize if limits is None else limits.max_producer_bytes
        self.producer, self.sequence = names.producer, names.sequence
        self.from_log = from_log
        self.base_sequence = base_sequence
        self.with_identity = not attributes & (_TRANSACTIONAL_MASK | _CONTROL_MASK)
        # The implicit producer of records without identity headers.
        self.implicit: str | None = None
        if self.with_identity and not from_log and producer_id >= 0 and base_sequence >= 0:
            self.implicit = implicit_producer(producer_id, producer_epoch)
        self.implicit_given = False  # to a record so far
        # The shortcut below tells identity headers from chunk headers by name.
        self.fast = not _CHUNK_NAMES.intersection((self.producer, self.sequence))

    def count_headers(self, count: int, offset_delta: int) -> None:
        """Raises `LimitExceeded` for a record with more headers than the bound."""
        if count > self.max_headers:
            raise LimitExceeded(
                ErrorCode.invalid_record,
                f"record at offset delta {offset_delta} has {count} headers, over the "
                f"proxy's max_headers_per_record {self.max_headers}",
            )

    def __call__(
        self, headers: tuple[tuple[str, bytes | None], ...], offset_delta: int, value: bytes | None
    ) -> tuple[Identity | None, ChunkMeta | None]:
        if not self.with_identity:
            return None, None
        if self.fast:
            found = self._usual(headers, offset_delta)
            if found is not _ABSENT:
                assert found is None or isinstance(found, Identity)
                return found, None
        identity: Identity | None = None
        try:
            identity = _identity(
                headers,
                offset_delta,
                self.names,
                self.implicit,
                self.base_sequence,
                self.max_producer,
            )
            if identity is not None and not any(name == self.producer for name, _ in headers):
                self.implicit_given = True
            return identity, _chunk(headers, offset_delta, self.names, identity, value)
        except BadBatch:
            if not self.from_log:
                raise
            # In the log a malformed header loses what it says, and nothing else.
            return identity, None

    def _usual(self, headers: tuple[tuple[str, bytes | None], ...], offset_delta: int) -> object:
        """The identity of a record without chunk headers whose identity is implicit, absent
        or explicit with a sequence of at most 18 digits (always an int64), in one pass over
        its headers; `_ABSENT` for any other record (`_identity` and `_chunk` decide)."""
        producer_raw: object = _ABSENT
        sequence_raw: object = _ABSENT
        for name, raw in headers:
            if name == self.producer:
                producer_raw = raw
            elif name == self.sequence:
                sequence_raw = raw
            elif name in _CHUNK_NAMES:
                return _ABSENT
        if producer_raw is _ABSENT and sequence_raw is _ABSENT:
            if self.implicit is None:
                return None
            self.implicit_given = True
            return Identity(self.implicit, implicit_sequence(self.base_sequence, offset_delta))
        if (
            isinstance(producer_raw, bytes)
            and 0 < len(producer_raw) <= self.max_producer
            and isinstance(sequence_raw, bytes)
            and len(sequence_raw) <= _SHORT_SEQUENCE
            and sequence_raw.isdigit()  # ASCII digits only, as is_sequence_text
        ):
            try:
                return Identity(producer_raw.decode("utf-8"), int(sequence_raw))
            except UnicodeDecodeError:
                return _ABSENT
        return _ABSENT


# The compiled reader (aiokafka's Cython `DefaultRecordBatch`, over ten times kafka-python's
# speed; benchmarks/README.md) parses records; `_read_compiled` gives its result only when
# it is provably the one the reference reader would give, else None. Where the two differ:
# - aiokafka adds 64-bit integers (base offset + offset delta, first timestamp + delta)
#   with wrap-around, kafka-python without: it is given a header copy with base offset and
#   first timestamp 0, and the timestamp is added here in Python;
# - aiokafka reads a varint's first byte in bounds but the rest unchecked (kafka-python
#   raises IndexError): the bytes it reads sit in `_PADDING`, and a record that ends past
#   the data is refused all the same (its length check, or the next record's);
# - a 10-byte varint whose last byte is 2 or more: aiokafka drops the bits beyond 64, as
#   Kafka's Java reader does, kafka-python keeps them. No client writes one (every encoder
#   writes the shortest varint), so a batch is only taken from the compiled reader when
#   its records are exactly as long as their shortest encoding (`_SIZER`) and its deltas
#   far from the 64-bit ends (a 10-byte varint ending in an odd byte keeps its length).
# Bad input of any kind (a check fails, a record does not parse) goes to the reference
# reader too: its messages are the rules, and the compiled path need not repeat them.
_PADDING: Final = bytes(64)
_SAFE_DELTA: Final = 1 << 62
_INT32_MAX: Final = (1 << 31) - 1
_HEADER_CODEC_FREE: Final = ~(_CODEC_MASK | _TIMESTAMP_TYPE_MASK)
# A builder whose first timestamp is 0: its size_in_bytes(offset delta, timestamp delta,
# key, value, headers) is a record's shortest encoding, length prefix included.
_SIZER: Final[Any] = _CompiledBuilder(2, CODEC_NONE, 0, -1, -1, -1, sys.maxsize)
_SIZER.append(0, 0, None, None, [])


def _decompressed(codec: int, payload: memoryview) -> bytes | memoryview | None:
    """The records of a batch, decompressed by the codecs kafka-python's reader uses (so
    the same bytes); None when that fails (the reference reader says why)."""
    try:
        if codec == CODEC_NONE:
            return payload
        if codec == CODEC_GZIP:
            return bytes(_codec.gzip_decode(payload))
        if codec == CODEC_SNAPPY:
            return bytes(_codec.snappy_decode(payload.tobytes()))
        if codec == CODEC_LZ4:
            return bytes(_codec.lz4_decode(payload.tobytes()))
        return bytes(_codec.zstd_decode(payload.tobytes()))
    except Exception:
        return None


def _bounded_decompressed(
    codec: int, payload: memoryview, limits: ReadLimits
) -> bytes | memoryview | None:
    """The records of a batch decompressed as `_decompressed` does (the same bytes), but
    never more than one byte past `limits.max_decompressed_bytes` (a longer result means:
    over the bound; `_OverLimit` when that is told without decompressing); None when they
    do not decompress (the reference reader says why)."""
    limit = limits.max_decompressed_bytes + 1
    try:
        if codec == CODEC_NONE:
            return payload
        if codec == CODEC_GZIP:
            with gzip.GzipFile(fileobj=io.BytesIO(payload), mode="r") as gz:
                return gz.read(limit)
        if codec == CODEC_SNAPPY:
            data = payload.tobytes()
            if _snappy_size(data) >= limit:
                raise _OverLimit
            return bytes(_codec.snappy_decode(data))
        if codec == CODEC_LZ4:
            # lz4.frame.decompress, as kafka.codec uses, reads the first frame only.
            decompressor = lz4.frame.LZ4FrameDecompressor()
            decompressed: bytes = decompressor.decompress(payload.tobytes(), limit)
            if not decompressor.eof and len(decompressed) < limit:
                return None  # an incomplete frame: the reference reader refuses it, and why
            return decompressed
        reader = zstandard.ZstdDecompressor().stream_reader(
            io.BytesIO(payload), read_across_frames=True
        )
        with reader:
            parts, size = [], 0
            while size < limit and (part := reader.read(limit - size)):
                parts.append(part)
                size += len(part)
        return b"".join(parts)
    except _OverLimit:
        raise
    except Exception:
        return None


class _OverLimit(Exception):
    """Decompressing would go past the bound (told without decompressing)."""


def _snappy_size(data: bytes) -> int:
    """What snappy data (raw, or xerial-framed as Kafka's Java client writes it) says it
    decompresses to: each raw block starts with its length, which decompression checks."""
    if not _codec._detect_xerial_stream(data):
        return _snappy_block_size(data, 0)
    total, cursor = 0, 16
    while cursor + 4 <= len(data):
        block = int.from_bytes(data[cursor : cursor + 4], "big", signed=True)
        total += _snappy_block_size(data, cursor + 4)
        cursor += 4 + max(block, 0)
    return total


def _snappy_block_size(data: bytes, start: int) -> int:
    """A raw snappy block's uncompressed length: a little-endian base-128 varint."""
    size = shift = 0
    for i in range(start, min(start + 5, len(data))):
        size |= (data[i] & 0x7F) << shift
        if not data[i] & 0x80:
            return size
        shift += 7
    return 0  # malformed: decompression refuses it


def _read_compiled(
    raw: bytes,
    names: IdentityHeaders,
    from_log: bool,
    *,
    fields: tuple[Any, ...] | None = None,
    intact: bool | None = None,
    body: bytes | memoryview | None = None,
    limits: ReadLimits | None = None,
) -> IncomingBatch | None:
    """The batch read by the compiled codec, or None: the reference reader decides. Given
    by `_read_batch`: `fields`, its header; `intact`, whether its CRC32C matches; `body`,
    its records decompressed already (within `limits`), else decompressed here."""
    if fields is None:
        fields = _HEADER.unpack_from(raw)
    if intact is None:
        intact = _crc32c(memoryview(raw)[_ATTRIBUTES_OFFSET:]) == fields[4]
    base_offset, attributes, last_offset_delta = fields[0], fields[5], fields[6]
    first_timestamp, max_timestamp, producer_id, producer_epoch = fields[7:11]
    base_sequence, count = fields[11], fields[12]
    codec = attributes & _CODEC_MASK
    if (
        not intact
        or codec not in CODEC_NAMES
        or attributes & _CONTROL_MASK  # kafka-python reads control records as markers
        or count <= 0
        or (not from_log and last_offset_delta != count - 1)
        or (not from_log and producer_id >= 0 and base_sequence < 0)
    ):
        return None
    if body is None:
        if limits is not None:  # decompressed within them, or it failed to
            return None
        body = _decompressed(codec, memoryview(raw)[HEADER_SIZE:])
        if body is None:
            return None
    header = _HEADER.pack(
        0, 0, -1, 2, 0, attributes & _HEADER_CODEC_FREE, last_offset_delta, 0, 0, *fields[9:]
    )
    size = HEADER_SIZE + len(body)
    buffer = memoryview(b"".join((header, body, _PADDING)))[:size]
    log_append = bool(attributes & _TIMESTAMP_TYPE_MASK)
    identify = _Identify(
        names, from_log, attributes, producer_id, producer_epoch, base_sequence, limits
    )
    try:
        records = _compiled_records(
            buffer, identify, first_timestamp, max_timestamp if log_append else None, len(body)
        )
    except LimitExceeded:
        raise
    except Exception:
        return None
    if records is None:
        return None
    return IncomingBatch(
        records=records,
        compression=codec,
        timestamp_type=int(log_append),
        producer_id=producer_id,
        producer_epoch=producer_epoch,
        base_sequence=base_sequence,
        transactional=bool(attributes & _TRANSACTIONAL_MASK),
        control=False,
        raw=raw,
        base_offset=base_offset,
        last_offset_delta=last_offset_delta,
        canonical=True,
        implicit_identities=identify.implicit_given,
        decompressed_size=-1 if limits is None else len(body),
    )


def _compiled_records(
    buffer: memoryview,
    identify: _Identify,
    first_timestamp: int,
    log_append_time: int | None,
    body_size: int,
) -> tuple[IncomingRecord, ...] | None:
    """The records of a normalized batch (base offset and first timestamp 0, no codec), or
    None when the reference reader might read them otherwise. Raises on bad records."""
    size_of = _SIZER.size_in_bytes
    from_log = identify.from_log
    records: list[IncomingRecord] = []
    shortest = 0
    for record in _CompiledBatch(buffer):
        offset_delta: int = record.offset
        delta: int = record.timestamp
        if from_log:
            if not 0 <= offset_delta <= _INT32_MAX:
                return None
        elif offset_delta != len(records):
            return None
        if not -_SAFE_DELTA < delta < _SAFE_DELTA:
            return None
        key, value, header_list = record.key, record.value, record.headers
        if len(header_list) > identify.max_headers:
            identify.count_headers(len(header_list), offset_delta)
        shortest += size_of(offset_delta, delta, key, value, header_list)
        headers = tuple(header_list)
        identity, chunk = identify(headers, offset_delta, value)
        timestamp = first_timestamp + delta if log_append_time is None else log_append_time
        records.append(
            IncomingRecord(offset_delta, timestamp, key, value, headers, identity, chunk)
        )
    return tuple(records) if shortest == body_size else None


def _identity(
    headers: tuple[tuple[str, bytes | None], ...],
    offset_delta: int,
    names: IdentityHeaders,
    implicit: str | None,
    base_sequence: int,
    max_producer: int = sys.maxsize,
) -> Identity | None:
    producer_raw: object = _ABSENT
    sequence_raw: object = _ABSENT
    for name, value in headers:
        if name == names.producer:
            producer_raw = value
        elif name == names.sequence:
            sequence_raw = value
    if producer_raw is _ABSENT and sequence_raw is _ABSENT:
        if implicit is None:
            return None
        return Identity(implicit, implicit_sequence(base_sequence, offset_delta))
    where = f"record at offset delta {offset_delta}"
    if producer_raw is _ABSENT:
        raise BadBatch(
            ErrorCode.invalid_record, f"{where} has {names.sequence} but no {names.producer}"
        )
    if sequence_raw is _ABSENT:
        raise BadBatch(
            ErrorCode.invalid_record, f"{where} has {names.producer} but no {names.sequence}"
        )
    assert producer_raw is None or isinstance(producer_raw, bytes)
    assert sequence_raw is None or isinstance(sequence_raw, bytes)
    return Identity(
        _parse_producer(producer_raw, where, names.producer, max_producer),
        _parse_sequence(sequence_raw, where, names.sequence),
    )


def _chunk(
    headers: tuple[tuple[str, bytes | None], ...],
    offset_delta: int,
    names: IdentityHeaders,
    identity: Identity | None,
    value: bytes | None,
) -> ChunkMeta | None:
    """The record's chunk headers, checked as far as the record alone can tell (the rest,
    against the chunks before it, is the check's: `dedup.chunks.accept_chunk`)."""
    for name, _ in headers:
        if name in _CHUNK_NAMES:
            break
    else:
        return None  # the usual case, without parse_chunk_headers' bookkeeping
    try:
        meta = parse_chunk_headers(headers)
    except ChunkError as exc:
        message = f"record at offset delta {offset_delta} {exc}"
        raise BadBatch(ErrorCode.invalid_record, message) from None
    if meta is None:
        return None
    where = f"record at offset delta {offset_delta}"
    if identity is None or not any(name == names.producer for name, _ in headers):
        # An implicit identity numbers every record, so chunks could not share a sequence.
        raise BadBatch(
            ErrorCode.invalid_record,
            f"{where} has chunk headers but no {names.producer}/{names.sequence}: a chunk "
            "needs an explicit dedup identity",
        )
    if value is None:
        raise BadBatch(ErrorCode.invalid_record, f"{where} is a chunk with a null value")
    if len(value) > meta.total_size:
        raise BadBatch(
            ErrorCode.invalid_record,
            f"{where} is a chunk of {len(value)} bytes, over its message's total size "
            f"{meta.total_size}",
        )
    return meta


def _parse_producer(raw: bytes | None, where: str, name: str, max_bytes: int) -> str:
    if raw is None:
        raise BadBatch(ErrorCode.invalid_record, f"{where} has a null {name}")
    if not raw:
        raise BadBatch(ErrorCode.invalid_record, f"{where} has an empty {name}")
    if len(raw) > max_bytes:
        raise BadBatch(
            ErrorCode.invalid_record,
            f"{where} has a {name} of {len(raw)} bytes, over the proxy's "
            f"max_producer_name_bytes {max_bytes}: {_show(raw)}",
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BadBatch(
            ErrorCode.invalid_record, f"{where} has a {name} that is not UTF-8: {_show(raw)}"
        ) from None


def _parse_sequence(raw: bytes | None, where: str, name: str) -> int:
    if raw is None:
        raise BadBatch(ErrorCode.invalid_record, f"{where} has a null {name}")
    sequence = parse_sequence(raw)
    if sequence is None:
        # Asked only on refusal, so an accepted sequence is parsed once.
        fault = sequence_fault(raw)
        assert fault is not None
        message = f"{where} has a {name} {fault.value}: {_show(raw)}"
        raise BadBatch(ErrorCode.invalid_record, message)
    return sequence


def _show(raw: bytes) -> str:
    if len(raw) <= _SHOW_BYTES:
        return repr(raw)
    return f"{raw[:_SHOW_BYTES]!r}... ({len(raw)} bytes)"


def _describe(exc: BaseException) -> str:
    text = str(exc)
    if len(text) > 200:
        text = text[:200] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# --------------------------------------------------------------------------- building

_ENCODERS: Final[dict[int, Callable[[bytes], bytes]]] = {
    # zlib's default level, as Kafka's compression.gzip.level (kafka-python's default is 9).
    # Modification time 0, as Kafka's Java client writes it: the same records compress to
    # the same bytes whenever they are built (kafka-python stamps the current second).
    CODEC_GZIP: lambda data: gzip.compress(data, compresslevel=6, mtime=0),
    # xerial framing, as the Java client and kafka-python's producer write v2 batches;
    # Kafka brokers and every client read it (librdkafka, which writes raw snappy, too).
    CODEC_SNAPPY: lambda data: bytes(_codec.snappy_encode(data, xerial_compatible=True)),
    # LZ4 frames with independent blocks (kafka-python forces block_linked=False).
    CODEC_LZ4: lambda data: bytes(_codec.lz4_encode(data)),
    CODEC_ZSTD: lambda data: bytes(_codec.zstd_encode(data)),
}


def build_batch(
    records: Sequence[IncomingRecord],
    *,
    compression: int,
    timestamp_type: int,
    producer_id: int,
    producer_epoch: int,
    base_sequence: int,
    add_identity_headers: bool,
    headers: IdentityHeaders = DEFAULT_HEADERS,
) -> bytes:
    """A magic-2 record batch (base offset 0, not transactional) of `records` in order.

    Offset deltas are renumbered 0..n-1; timestamps are kept (first timestamp = the first
    record's, max timestamp = the largest); the codec is kept even where it does not shrink
    the payload (kafka-python's producer would fall back to none). With
    `add_identity_headers`, a record whose identity is not in its headers (an implicit one)
    gets the two identity headers appended, so that replaying the log recovers it.
    """
    if not records:
        raise ValueError("a record batch needs at least one record")
    if compression not in CODEC_NAMES:
        raise ValueError(f"unknown compression codec id {compression}")
    if timestamp_type not in (TIMESTAMP_CREATE_TIME, TIMESTAMP_LOG_APPEND_TIME):
        raise ValueError(f"unknown timestamp type {timestamp_type}")
    if producer_id >= 0 and (producer_epoch < 0 or base_sequence < 0):
        raise ValueError(
            f"producer id {producer_id} needs an epoch and a base sequence >= 0, "
            f"not {producer_epoch} and {base_sequence} (Kafka refuses the batch)"
        )
    # aiokafka's compiled builder writes the same records as kafka-python's (shortest
    # varints, the same header) several times faster; its partition leader epoch is -1, as
    # the Java client's (the broker sets it).
    builder: Any = _CompiledBuilder(
        2, CODEC_NONE, 0, producer_id, producer_epoch, base_sequence, sys.maxsize
    )
    for offset_delta, record in enumerate(records):
        record_headers: list[tuple[str, bytes | None]] = list(record.headers)
        identity = record.identity
        if (
            add_identity_headers
            and identity is not None
            and not any(name == headers.producer for name, _ in record_headers)
        ):
            record_headers.append((headers.producer, identity.producer.encode("utf-8")))
            record_headers.append((headers.sequence, str(identity.sequence).encode("ascii")))
        builder.append(offset_delta, record.timestamp, record.key, record.value, record_headers)
    buffer: bytearray = builder.build()
    if compression == CODEC_NONE and timestamp_type == TIMESTAMP_CREATE_TIME:
        return bytes(buffer)
    # The builders cannot set the timestamp type, and aiokafka's would compress with its own
    # settings (gzip level 9, kafka-python's too): compress here and rewrite the header's
    # length, attributes and CRC.
    body = bytes(buffer[HEADER_SIZE:])
    if compression != CODEC_NONE:
        body = _ENCODERS[compression](body)
    fields = list(_HEADER.unpack_from(buffer))
    fields[1] = HEADER_SIZE - _LOG_OVERHEAD + len(body)  # length
    fields[4] = 0  # CRC, computed below
    fields[5] = compression | (_TIMESTAMP_TYPE_MASK if timestamp_type else 0)  # attributes
    out = bytearray(_HEADER.pack(*fields))
    out += body
    _write_crc(out)
    return bytes(out)


def identity_records(batch: IncomingBatch, headers: IdentityHeaders = DEFAULT_HEADERS) -> bytes:
    """The records of a rewritable uniform batch (`BatchRun.rewritable`) with the two
    identity headers appended to each, compressed with the batch's codec: what follows the
    header in `rewritten_with_identity_headers`. Independent of the producer the batch is
    written under, so it may be made ahead (in a worker thread: the rewrite and the codecs
    release the GIL)."""
    run = batch.run
    if _native is None or run is None or not run.rewritable:
        raise ValueError("only a rewritable uniform batch is rewritten (BatchRun.rewritable)")
    codec = batch.compression
    found = _records_of(codec, batch.raw)
    if found is None:
        raise ValueError("the batch no longer decompresses")
    data, start = found
    records: bytes = _native.with_identity_headers(
        data,
        start,
        run.count,
        headers.producer.encode("utf-8"),
        headers.sequence.encode("utf-8"),
        run.producer.encode("utf-8"),
        run.first,
        IMPLICIT_SEQUENCE_MODULUS if run.wraps else _UNBOUNDED_SEQUENCES,
    )
    return records if codec == CODEC_NONE else _ENCODERS[codec](records)


@dataclass(frozen=True, slots=True)
class MadeAhead:
    """What a worker thread makes of a batch before its write, so that the event loop only
    stamps the header: the records it is written with, when they change (`identity_records`),
    and the CRC32C of what follows the header it is written with (`records_crc`)."""

    identity_records: bytes | None
    records_crc: int


def made_ahead(
    batch: IncomingBatch, headers: IdentityHeaders, add_identity_headers: bool
) -> MadeAhead:
    """For `rewritten_with_identity_headers` when the batch is rewritable and gets identity
    headers, else for `restamped` (a rebuild, after duplicates were dropped, uses neither).
    `batch` is as `read_batches` read it, its stored CRC32C verified: the records' CRC is
    derived from it, without a second pass over them."""
    if add_identity_headers and batch.run is not None and batch.run.rewritable:
        records = identity_records(batch, headers)
        return MadeAhead(records, _crc32c(records))
    raw = memoryview(batch.raw)
    stored_crc = _HEADER.unpack_from(raw)[4]
    header_crc = _crc32c(raw[_ATTRIBUTES_OFFSET:_RECORD_COUNT_OFFSET])
    return MadeAhead(
        None, crc32c_of_second(stored_crc, header_crc, len(raw) - _RECORD_COUNT_OFFSET)
    )


def _header_and_records_crc(
    header: bytearray, records: bytes | memoryview, records_crc: int | None
) -> int:
    """The batch's CRC32C: from the header's attributes over the records; the records' own
    CRC, when given, joined to the header's without a pass over them."""
    header_crc = _crc32c(memoryview(header)[_ATTRIBUTES_OFFSET:])
    if records_crc is None:
        return int(_crc32c(records, header_crc))
    return crc32c_combine(header_crc, records_crc, len(records))


def rewritten_with_identity_headers(
    batch: IncomingBatch,
    *,
    producer_id: int,
    producer_epoch: int,
    base_sequence: int,
    headers: IdentityHeaders = DEFAULT_HEADERS,
    ahead: MadeAhead | None = None,
) -> tuple[bytes, bytes]:
    """What `build_batch` writes for every record of a rewritable uniform batch
    (`BatchRun.rewritable`) with `add_identity_headers`, byte for byte, by the Rust rewrite:
    each record copied with the two identity headers appended, no Python object per record.
    In two pieces, the batch header and the records, so a large batch need not be copied
    again to join them (`RecordPieces`). `ahead`: its `made_ahead`, when made."""
    if producer_id >= 0 and (producer_epoch < 0 or base_sequence < 0):
        raise ValueError(
            f"producer id {producer_id} needs an epoch and a base sequence >= 0, "
            f"not {producer_epoch} and {base_sequence} (Kafka refuses the batch)"
        )
    records = ahead.identity_records if ahead is not None else None
    if records is None:
        records = identity_records(batch, headers)
        ahead = None  # its CRC, if any, is not of these records
    run = batch.run
    assert run is not None  # identity_records checked it, or made `records`
    first_timestamp = _HEADER.unpack_from(batch.raw)[7]
    header = bytearray(
        _HEADER.pack(
            0,
            HEADER_SIZE - _LOG_OVERHEAD + len(records),
            -1,  # partition leader epoch: the broker sets it
            2,
            0,  # CRC, below
            batch.compression,
            run.count - 1,
            first_timestamp,
            run.max_timestamp,
            producer_id,
            producer_epoch,
            base_sequence,
            run.count,
        )
    )
    crc = _header_and_records_crc(header, records, ahead.records_crc if ahead else None)
    struct.pack_into(">I", header, _CRC_OFFSET, crc)
    return bytes(header), records


def _write_crc(batch: bytearray) -> None:
    crc = _crc32c(memoryview(batch)[_ATTRIBUTES_OFFSET:])
    struct.pack_into(">I", batch, _CRC_OFFSET, crc)


def restamp_batch(raw: bytes, producer_id: int, producer_epoch: int, base_sequence: int) -> bytes:
    """A client's batch as it is, under the proxy's producer: its records untouched (not
    even decompressed), the header's producer id, epoch and base sequence replaced, base
    offset 0, not transactional, the CRC32C recomputed. What `build_batch` would write for
    the same records when none is dropped and no header is added, at the cost of a copy
    and a CRC (a rebuild decodes and encodes every record, and compresses again)."""
    return b"".join(restamped(raw, producer_id, producer_epoch, base_sequence))


def restamped(
    raw: bytes,
    producer_id: int,
    producer_epoch: int,
    base_sequence: int,
    ahead: MadeAhead | None = None,
) -> tuple[bytes, memoryview]:
    """`restamp_batch` in two pieces: the new header, and a view of the client's records
    (no copy of them; `RecordPieces`). `ahead`: the batch's `made_ahead`, when made."""
    if len(raw) < HEADER_SIZE:
        raise ValueError(f"a record batch has at least {HEADER_SIZE} bytes, not {len(raw)}")
    if producer_id >= 0 and (producer_epoch < 0 or base_sequence < 0):
        raise ValueError(
            f"producer id {producer_id} needs an epoch and a base sequence >= 0, "
            f"not {producer_epoch} and {base_sequence} (Kafka refuses the batch)"
        )
    header = bytearray(raw[:_RECORD_COUNT_OFFSET])
    header[:8] = bytes(8)  # base offset 0: the broker assigns offsets
    attributes = int.from_bytes(header[_ATTRIBUTES_OFFSET : _ATTRIBUTES_OFFSET + 2], "big")
    struct.pack_into(">h", header, _ATTRIBUTES_OFFSET, attributes & ~_TRANSACTIONAL_MASK)
    _PRODUCER.pack_into(header, _PRODUCER_OFFSET, producer_id, producer_epoch, base_sequence)
    # The records are the client's, as they are (from the record count on).
    records = memoryview(raw)[_RECORD_COUNT_OFFSET:]
    # An `ahead` made for the rewrite holds the CRC of other records.
    made = ahead if ahead is not None and ahead.identity_records is None else None
    crc = _header_and_records_crc(header, records, made.records_crc if made else None)
    struct.pack_into(">I", header, _CRC_OFFSET, crc)
    return bytes(header), records


def forwardable(
    batch: IncomingBatch, kept: Sequence[IncomingRecord], add_identity_headers: bool
) -> bool:
    """Whether `restamp_batch` of the client's bytes writes what `build_batch` would: a
    canonical batch (`IncomingBatch.canonical`) with every record kept, none to be given
    identity headers (no implicit identity, or `add_identity_headers` off). Constant time:
    what it needs was found while reading."""
    if len(kept) != len(batch.records) or batch.control or not batch.canonical:
        return False
    return not (add_identity_headers and batch.implicit_identities)

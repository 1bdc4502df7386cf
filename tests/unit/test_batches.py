"""Record batches: identity rules, the rebuild round trip for every codec, the broker's error
codes for bad input, and fuzzing (only BadBatch, whatever the bytes)."""

from __future__ import annotations

import contextlib
import itertools
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from kafka.codec import snappy_encode
from kafka.record.default_records import DefaultRecordBatch, DefaultRecordBatchBuilder
from kafka.record.util import calc_crc32c
from kio.schema.errors import ErrorCode

from dedup import batches
from dedup.batches import (
    CODEC_NAMES,
    DEFAULT_HEADERS,
    HEADER_PRODUCER,
    HEADER_SEQUENCE,
    HEADER_SIZE,
    BadBatch,
    Identity,
    IdentityHeaders,
    IncomingBatch,
    IncomingRecord,
    LimitExceeded,
    ReadLimits,
    build_batch,
    forwardable,
    implicit_producer,
    kafka_producer_of,
    read_batches,
    restamp_batch,
)
from dedup.chunks import CHUNK_HEADERS
from tests.support.raw import bomb_batch

pytestmark = pytest.mark.unit

CODECS = sorted(CODEC_NAMES)
HEADER = DefaultRecordBatch.HEADER_STRUCT
ATTRIBUTES_OFFSET = DefaultRecordBatch.ATTRIBUTES_OFFSET
CRC_OFFSET = DefaultRecordBatch.CRC_OFFSET
# Field positions in kafka-python's HEADER_STRUCT.
F_LENGTH, F_MAGIC, F_ATTRIBUTES, F_LAST_DELTA, F_PID, F_EPOCH, F_BASE_SEQ, F_COUNT = (
    1,
    3,
    5,
    6,
    9,
    10,
    11,
    12,
)

# Bounds small enough for the fuzzers' batches to meet them.
TIGHT = ReadLimits(max_records=3, max_decompressed_bytes=200, max_headers=2, max_producer_bytes=4)

CASES = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------- helpers


def fix_crc(batch: bytes | bytearray) -> bytes:
    out = bytearray(batch)
    crc = calc_crc32c(memoryview(out)[ATTRIBUTES_OFFSET:])
    struct.pack_into(">I", out, CRC_OFFSET, crc)
    return bytes(out)


def with_header(batch: bytes, **fields: int) -> bytes:
    """The batch with header fields replaced (by HEADER_STRUCT position name) and the CRC
    recomputed, so that only the changed field is wrong."""
    positions = {
        "length": F_LENGTH,
        "magic": F_MAGIC,
        "attributes": F_ATTRIBUTES,
        "last_offset_delta": F_LAST_DELTA,
        "producer_id": F_PID,
        "producer_epoch": F_EPOCH,
        "base_sequence": F_BASE_SEQ,
        "count": F_COUNT,
    }
    values = list(HEADER.unpack_from(batch))
    for name, value in fields.items():
        values[positions[name]] = value
    return fix_crc(HEADER.pack(*values) + batch[HEADER_SIZE:])


def raw_batch(
    records: Sequence[tuple[int, bytes | None, bytes | None, Sequence[tuple[str, bytes | None]]]],
    *,
    compression: int = 0,
    transactional: bool = False,
    producer_id: int = -1,
    producer_epoch: int = -1,
    base_sequence: int = -1,
) -> bytes:
    """A batch as a client writes it (kafka-python's own builder): (offset, key, value,
    headers) per record, timestamp 1000 + offset."""
    builder: Any = DefaultRecordBatchBuilder(
        magic=2,
        compression_type=compression,
        is_transactional=transactional,
        producer_id=producer_id,
        producer_epoch=producer_epoch,
        base_sequence=base_sequence,
        batch_size=1 << 30,
    )
    for offset, key, value, headers in records:
        builder.append(offset, 1000 + offset, key, value, list(headers))
    return bytes(builder.build())


def explicit(producer: bytes | None, sequence: bytes | None) -> list[tuple[str, bytes | None]]:
    return [(HEADER_PRODUCER, producer), (HEADER_SEQUENCE, sequence)]


def error_of(data: bytes, **kwargs: Any) -> BadBatch:
    with pytest.raises(BadBatch) as info:
        read_batches(data, **kwargs)
    return info.value


# --------------------------------------------------------------------------- strategies

optional_bytes = st.none() | st.binary(max_size=40)
# Plain headers: any name but the ones with a dedup meaning (identity and chunk headers).
RESERVED_HEADERS = (HEADER_PRODUCER, HEADER_SEQUENCE, *CHUNK_HEADERS)
header_names = st.text(max_size=12).filter(lambda n: n not in RESERVED_HEADERS)
plain_headers = st.lists(st.tuples(header_names, optional_bytes), max_size=4).map(tuple)
producer_names = st.text(min_size=1, max_size=20)
int64s = st.integers(-(1 << 63), (1 << 63) - 1)


@dataclass(frozen=True)
class Spec:
    """One record as a client sends it; `explicit` is its identity headers, if any."""

    timestamp: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes | None], ...]
    explicit: Identity | None

    def wire_headers(self) -> tuple[tuple[str, bytes | None], ...]:
        if self.explicit is None:
            return self.headers
        # Identity headers anywhere among the others (the reader must not care where).
        cut = len(self.headers) // 2
        return (
            *self.headers[:cut],
            (HEADER_PRODUCER, self.explicit.producer.encode()),
            *self.headers[cut:],
            (HEADER_SEQUENCE, str(self.explicit.sequence).encode()),
        )


specs = st.builds(
    Spec,
    timestamp=st.integers(0, 1 << 44),
    key=optional_bytes,
    value=optional_bytes,
    headers=plain_headers,
    explicit=st.none() | st.builds(Identity, producer_names, int64s),
)


@dataclass(frozen=True)
class Producer:
    producer_id: int
    producer_epoch: int
    base_sequence: int


producers = st.one_of(
    st.just(Producer(-1, -1, -1)),
    st.builds(
        Producer,
        st.integers(0, (1 << 63) - 1),
        st.integers(0, (1 << 15) - 1),
        # Near the int32 end too, where Kafka's sequences wrap to 0.
        st.integers(0, (1 << 31) - 1) | st.integers((1 << 31) - 20, (1 << 31) - 1),
    ),
)


def expected_identity(spec: Spec, offset_delta: int, producer: Producer) -> Identity | None:
    if spec.explicit is not None:
        return spec.explicit
    if producer.producer_id < 0:
        return None
    return Identity(
        f"kafka-pid-{producer.producer_id}-{producer.producer_epoch}",
        (producer.base_sequence + offset_delta) % (1 << 31),
    )


def client_records(items: Sequence[Spec]) -> list[IncomingRecord]:
    return [
        IncomingRecord(i, s.timestamp, s.key, s.value, s.wire_headers(), None)
        for i, s in enumerate(items)
    ]


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("codec", CODECS, ids=[CODEC_NAMES[c] for c in CODECS])
@CASES
@given(
    items=st.lists(specs, min_size=1, max_size=12),
    client=producers,
    proxy=producers,
    keep=st.lists(st.booleans(), min_size=12, max_size=12),
    data=st.data(),
)
def test_read_then_rebuild_kept_records(
    codec: int,
    items: list[Spec],
    client: Producer,
    proxy: Producer,
    keep: list[bool],
    data: st.DataObject,
) -> None:
    timestamp_type = data.draw(st.sampled_from([0, 1]), label="client timestamp type")
    # The client's batch (built by build_batch without identity headers: a client's batch).
    incoming_bytes = build_batch(
        client_records(items),
        compression=codec,
        timestamp_type=0,
        producer_id=client.producer_id,
        producer_epoch=client.producer_epoch,
        base_sequence=client.base_sequence,
        add_identity_headers=False,
    )
    [incoming] = read_batches(incoming_bytes)
    assert incoming.raw == incoming_bytes
    assert incoming.compression == codec
    assert (incoming.producer_id, incoming.producer_epoch, incoming.base_sequence) == (
        client.producer_id,
        client.producer_epoch,
        client.base_sequence,
    )
    assert not incoming.transactional and not incoming.control
    assert [r.offset_delta for r in incoming.records] == list(range(len(items)))
    for record, spec in zip(incoming.records, items, strict=True):
        assert (record.timestamp, record.key, record.value) == (
            spec.timestamp,
            spec.key,
            spec.value,
        )
        assert record.headers == spec.wire_headers()
        assert record.identity == expected_identity(spec, record.offset_delta, client)

    # Keep a subset and rebuild under the proxy's producer.
    kept = [r for r, k in zip(incoming.records, keep, strict=False) if k] or [incoming.records[0]]
    rebuilt = build_batch(
        kept,
        compression=codec,
        timestamp_type=timestamp_type,
        producer_id=proxy.producer_id,
        producer_epoch=proxy.producer_epoch,
        base_sequence=proxy.base_sequence,
        add_identity_headers=True,
    )
    [out] = read_batches(rebuilt)
    assert out.compression == codec
    assert out.timestamp_type == timestamp_type
    assert (out.producer_id, out.producer_epoch, out.base_sequence) == (
        proxy.producer_id,
        proxy.producer_epoch,
        proxy.base_sequence,
    )
    header = DefaultRecordBatch(rebuilt)
    assert header.first_timestamp == kept[0].timestamp
    assert header.max_timestamp == max(r.timestamp for r in kept)
    assert header.last_offset_delta == len(kept) - 1
    assert [r.offset_delta for r in out.records] == list(range(len(kept)))
    for got, was in zip(out.records, kept, strict=True):
        expected_ts = header.max_timestamp if timestamp_type == 1 else was.timestamp
        assert (got.timestamp, got.key, got.value) == (expected_ts, was.key, was.value)
        # Every identity survives, the implicit ones through the appended headers; a record
        # that had none reads (outside the log) as one of the proxy's own producer.
        if was.identity is not None:
            assert got.identity == was.identity
        elif proxy.producer_id >= 0:
            assert got.identity == Identity(
                f"kafka-pid-{proxy.producer_id}-{proxy.producer_epoch}",
                (proxy.base_sequence + got.offset_delta) % (1 << 31),
            )
        else:
            assert got.identity is None
        if was.identity is not None and not any(n == HEADER_PRODUCER for n, _ in was.headers):
            assert got.headers == (
                *was.headers,
                (HEADER_PRODUCER, was.identity.producer.encode()),
                (HEADER_SEQUENCE, str(was.identity.sequence).encode()),
            )
        else:
            assert got.headers == was.headers
    # And a replay of the log (batch header = the proxy's producer) finds them in headers.
    [logged] = read_batches(rebuilt, from_log=True)
    assert [r.identity for r in logged.records] == [r.identity for r in kept]


@CASES
@given(items=st.lists(specs, min_size=1, max_size=8), codec=st.sampled_from(CODECS))
def test_rebuild_without_identity_headers_keeps_headers(items: list[Spec], codec: int) -> None:
    records = [replace(r, identity=Identity("p", 1)) for r in client_records(items)]
    rebuilt = build_batch(
        records,
        compression=codec,
        timestamp_type=0,
        producer_id=-1,
        producer_epoch=-1,
        base_sequence=-1,
        add_identity_headers=False,
    )
    [out] = read_batches(rebuilt)
    assert [r.headers for r in out.records] == [r.headers for r in records]


@pytest.mark.parametrize("codec", CODECS, ids=[CODEC_NAMES[c] for c in CODECS])
def test_codec_is_kept_even_when_it_does_not_shrink(codec: int) -> None:
    record = IncomingRecord(0, 5, None, bytes(range(7)), (), None)
    batch = build_batch(
        [record],
        compression=codec,
        timestamp_type=0,
        producer_id=-1,
        producer_epoch=-1,
        base_sequence=-1,
        add_identity_headers=False,
    )
    assert DefaultRecordBatch(batch).compression_type == codec
    assert read_batches(batch)[0].records[0].value == bytes(range(7))


def test_snappy_writes_xerial_framing_and_reads_raw_snappy() -> None:
    """The Java client writes xerial-framed snappy, librdkafka raw snappy: read both, write
    xerial (what kafka-python's producer and the Java client send)."""
    record = IncomingRecord(0, 5, b"k", b"hello " * 50, (), None)
    built = build_batch(
        [record],
        compression=2,
        timestamp_type=0,
        producer_id=-1,
        producer_epoch=-1,
        base_sequence=-1,
        add_identity_headers=False,
    )
    assert built[HEADER_SIZE:].startswith(b"\x82SNAPPY\x00")
    plain = raw_batch([(0, b"k", b"hello " * 50, [])])
    compressed = snappy_encode(plain[HEADER_SIZE:], xerial_compatible=False)
    assert not compressed.startswith(b"\x82SNAPPY")
    raw_snappy = with_header(
        plain[:HEADER_SIZE] + compressed,
        attributes=2,
        length=HEADER_SIZE - 12 + len(compressed),
    )
    for data in (built, raw_snappy):
        [batch] = read_batches(data)
        assert batch.compression == 2
        assert batch.records[0].value == b"hello " * 50


def test_configurable_header_names() -> None:
    names = IdentityHeaders(producer="app", sequence="n")
    data = raw_batch([(0, None, b"v", [("app", b"me"), ("n", b"42")])])
    assert read_batches(data, names)[0].records[0].identity == Identity("me", 42)
    # The default names are ordinary headers then.
    data = raw_batch([(0, None, b"v", explicit(b"me", b"42"))])
    assert read_batches(data, names)[0].records[0].identity is None
    rebuilt = build_batch(
        [IncomingRecord(0, 1, None, b"v", (), Identity("kafka-pid-1-0", 7))],
        compression=0,
        timestamp_type=0,
        producer_id=3,
        producer_epoch=0,
        base_sequence=0,
        add_identity_headers=True,
        headers=names,
    )
    assert read_batches(rebuilt, names)[0].records[0].headers == (
        ("app", b"kafka-pid-1-0"),
        ("n", b"7"),
    )
    with pytest.raises(ValueError):
        IdentityHeaders(producer="x", sequence="x")


# --------------------------------------------------------------------------- identity rules


def test_implicit_sequence_wraps_as_kafka_does() -> None:
    data = raw_batch(
        [(i, None, b"v", []) for i in range(4)],
        producer_id=9,
        producer_epoch=3,
        base_sequence=(1 << 31) - 2,
    )
    identities = [r.identity for r in read_batches(data)[0].records]
    assert identities == [
        Identity("kafka-pid-9-3", (1 << 31) - 2),
        Identity("kafka-pid-9-3", (1 << 31) - 1),
        Identity("kafka-pid-9-3", 0),
        Identity("kafka-pid-9-3", 1),
    ]


def test_mixed_batch_explicit_wins_over_implicit() -> None:
    data = raw_batch(
        [(0, None, b"a", explicit(b"app", b"-5")), (1, None, b"b", [("x", None)])],
        producer_id=4,
        producer_epoch=0,
        base_sequence=10,
    )
    records = read_batches(data)[0].records
    assert records[0].identity == Identity("app", -5)
    assert records[1].identity == Identity("kafka-pid-4-0", 11)


def test_last_identity_header_counts() -> None:
    headers = [*explicit(b"old", b"1"), *explicit(b"new", b"2")]
    data = raw_batch([(0, None, b"v", headers)])
    assert read_batches(data)[0].records[0].identity == Identity("new", 2)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        (b"0", 0),
        (b"+5", 5),
        (b"007", 7),
        (b"-9223372036854775808", -(1 << 63)),
        (b"9223372036854775807", (1 << 63) - 1),
    ],
)
def test_sequence_text_accepted(text: bytes, value: int) -> None:
    data = raw_batch([(0, None, b"v", explicit(b"p", text))])
    assert read_batches(data)[0].records[0].identity == Identity("p", value)


def test_no_identity_without_producer_id() -> None:
    data = raw_batch([(0, None, b"v", [("other", b"1")])])
    assert read_batches(data)[0].records[0].identity is None


def test_transactional_batches_have_no_identity_and_are_not_checked() -> None:
    data = raw_batch(
        [(0, None, b"a", []), (1, None, b"b", explicit(b"", b"not a number"))],
        transactional=True,
        producer_id=5,
        producer_epoch=1,
        base_sequence=0,
    )
    [batch] = read_batches(data)
    assert batch.transactional
    assert batch.raw == data
    assert [r.identity for r in batch.records] == [None, None]


def test_from_log_reads_several_batches_and_skips_a_partial_tail() -> None:
    first = raw_batch([(0, None, b"a", explicit(b"p", b"1"))], producer_id=7, producer_epoch=0)
    first = with_header(first, base_sequence=0)
    second = bytearray(
        raw_batch([(0, None, b"b", [])], producer_id=7, producer_epoch=0, base_sequence=1)
    )
    second[0:8] = (1).to_bytes(8, "big")  # base offset 1 in the log (not under the CRC)
    data = first + bytes(second) + bytes(second[:30])
    batches = read_batches(data, from_log=True)
    assert [b.base_offset for b in batches] == [0, 1]
    # Identity comes from headers only in the log: the header's producer is the proxy's.
    assert [b.records[0].identity for b in batches] == [Identity("p", 1), None]
    # Malformed identity headers in the log: no identity, the replay goes on.
    bad = raw_batch([(0, None, b"v", explicit(b"p", b"x"))])
    assert read_batches(bad, from_log=True)[0].records[0].identity is None
    # A compacted batch: gaps in offset deltas, fewer records than the offset range.
    compacted = with_header(raw_batch([(0, None, b"a", []), (3, None, b"b", [])]), count=2)
    [batch] = read_batches(compacted, from_log=True)
    assert [r.offset_delta for r in batch.records] == [0, 3]
    assert batch.last_offset_delta == 3


# --------------------------------------------------------------------------- errors


VALID = raw_batch(
    [(0, b"k", b"v", []), (1, None, b"w", [])], producer_id=3, producer_epoch=0, base_sequence=0
)

INVALID = ErrorCode.invalid_record
CORRUPT = ErrorCode.corrupt_message


@pytest.mark.parametrize(
    ("data", "code", "fragment"),
    [
        (b"", INVALID, "must have one record batch"),
        (VALID + VALID, INVALID, "exactly one record batch"),
        (VALID[:10], CORRUPT, "truncated"),
        (VALID[:-1], CORRUPT, "truncated"),
        (VALID + b"\x00" * 5, CORRUPT, "truncated"),
        (VALID[:17], CORRUPT, "truncated"),
        (with_header(VALID, length=20), CORRUPT, "fewer than a batch header"),
        (VALID[:16] + b"\x00" + VALID[17:], INVALID, "magic 0"),
        (VALID[:16] + b"\x01" + VALID[17:], INVALID, "magic 1"),
        (VALID[:16] + b"\x03" + VALID[17:], CORRUPT, "invalid magic byte 3"),
        (VALID[:16] + b"\xff" + VALID[17:], CORRUPT, "invalid magic byte -1"),
        (VALID[:-1] + bytes([VALID[-1] ^ 1]), CORRUPT, "CRC32C"),
        (with_header(VALID, attributes=5), ErrorCode.unsupported_compression_type, "id 5"),
        (with_header(VALID, attributes=7), ErrorCode.unsupported_compression_type, "id 7"),
        (with_header(VALID, count=0, last_offset_delta=-1), INVALID, "record count 0"),
        (with_header(VALID, count=3, last_offset_delta=2), INVALID, "does not parse"),
        (with_header(VALID, count=2, last_offset_delta=5), INVALID, "last offset delta 5"),
        (with_header(VALID, attributes=0x20), INVALID, "control records"),
        (with_header(VALID, base_sequence=-1), INVALID, "base sequence -1"),
        (
            with_header(raw_batch([(1, None, b"a", []), (1, None, b"b", [])]), last_offset_delta=1),
            INVALID,
            "record 0 has offset delta 1, expected 0",
        ),
        (with_header(VALID, attributes=3), INVALID, "lz4 payload does not decompress"),
        (with_header(VALID, attributes=1), INVALID, "gzip payload does not decompress"),
        (with_header(VALID, attributes=2), INVALID, "snappy payload does not decompress"),
        (with_header(VALID, attributes=4), INVALID, "zstd payload does not decompress"),
    ],
)
def test_bad_batches(data: bytes, code: ErrorCode, fragment: str) -> None:
    error = error_of(data)
    assert error.error_code == code
    assert fragment in error.message, error.message


@pytest.mark.parametrize(
    ("headers", "fragment"),
    [
        (
            [(HEADER_SEQUENCE, b"1")],
            "record at offset delta 1 has dedup.sequence but no dedup.producer",
        ),
        (
            [(HEADER_PRODUCER, b"p")],
            "record at offset delta 1 has dedup.producer but no dedup.sequence",
        ),
        (explicit(None, b"1"), "null dedup.producer"),
        (explicit(b"", b"1"), "empty dedup.producer"),
        (explicit(b"\xff\xfe", b"1"), "not UTF-8: b'\\xff\\xfe'"),
        (explicit(b"p", None), "null dedup.sequence"),
        (explicit(b"p", b""), "not a decimal integer: b''"),
        (explicit(b"p", b" 1"), "not a decimal integer: b' 1'"),
        (explicit(b"p", b"1.0"), "not a decimal integer"),
        (explicit(b"p", b"0x10"), "not a decimal integer"),
        (explicit(b"p", b"1_000"), "not a decimal integer"),
        (explicit(b"p", "\u0661".encode()), "not a decimal integer"),  # Arabic-Indic one
        (explicit(b"p", b"9223372036854775808"), "outside the signed 64-bit range"),
        (explicit(b"p", b"-9223372036854775809"), "outside the signed 64-bit range"),
        (explicit(b"p", b"7" * 1000), "... (1000 bytes)"),
    ],
)
def test_bad_identity_headers(headers: list[tuple[str, bytes | None]], fragment: str) -> None:
    for compression in CODECS:
        data = raw_batch(
            [(0, None, b"fine", explicit(b"p", b"1")), (1, None, b"v", headers)],
            compression=compression,
            producer_id=8,
            producer_epoch=0,
            base_sequence=0,
        )
        error = error_of(data)
        assert error.error_code == INVALID
        assert fragment in error.message, error.message
        assert len(error.message) < 200


def test_bad_batch_is_an_exception_with_code_and_message() -> None:
    error = error_of(b"")
    assert isinstance(error, Exception)
    assert int(error.error_code) == 87
    assert "INVALID_RECORD" in str(error).upper()


def test_build_refuses_programming_errors() -> None:
    record = IncomingRecord(0, 1, None, b"v", (), None)
    common: dict[str, Any] = dict(
        timestamp_type=0,
        producer_id=-1,
        producer_epoch=-1,
        base_sequence=-1,
        add_identity_headers=False,
    )
    with pytest.raises(ValueError):
        build_batch([], compression=0, **common)
    with pytest.raises(ValueError):
        build_batch([record], compression=5, **common)
    with pytest.raises(ValueError):
        build_batch([record], compression=0, **{**common, "timestamp_type": 2})
    with pytest.raises(ValueError, match="base sequence"):
        build_batch([record], compression=0, **{**common, "producer_id": 1, "producer_epoch": 0})


# --------------------------------------------------------------------------- fuzz


def _only_bad_batch(data: bytes) -> None:
    for kwargs in ({"from_log": False}, {"from_log": True}, {"limits": TIGHT}):
        try:
            read_batches(data, **kwargs)  # type: ignore[arg-type]
        except BadBatch as error:
            assert isinstance(error.error_code, ErrorCode)
            assert error.message


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_fuzz_random_bytes(data: bytes) -> None:
    _only_bad_batch(data)


@settings(max_examples=150, deadline=None)
@given(st.binary(min_size=HEADER_SIZE - 17, max_size=300), st.sampled_from(CODECS))
def test_fuzz_random_payload_behind_a_valid_header(payload: bytes, codec: int) -> None:
    """Random record bytes under a header whose lengths and CRC are right: the record
    parser and the decompressors see garbage."""
    data = with_header(
        VALID[:HEADER_SIZE] + payload, length=HEADER_SIZE - 12 + len(payload), attributes=codec
    )
    _only_bad_batch(data)


@pytest.mark.parametrize("codec", CODECS, ids=[CODEC_NAMES[c] for c in CODECS])
@settings(max_examples=60, deadline=None)
@given(
    items=st.lists(specs, min_size=1, max_size=5),
    flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 255)), min_size=1, max_size=4),
    recompute_crc=st.booleans(),
    cut=st.none() | st.integers(0, 10_000),
)
def test_fuzz_flipped_valid_batches(
    codec: int,
    items: list[Spec],
    flips: list[tuple[int, int]],
    recompute_crc: bool,
    cut: int | None,
) -> None:
    data = bytearray(
        build_batch(
            client_records(items),
            compression=codec,
            timestamp_type=0,
            producer_id=2,
            producer_epoch=0,
            base_sequence=0,
            add_identity_headers=False,
        )
    )
    for position, mask in flips:
        data[position % len(data)] ^= mask
    if recompute_crc:
        data = bytearray(fix_crc(data))
    if cut is not None:
        data = data[: cut % (len(data) + 1)]
    _only_bad_batch(bytes(data))


def test_default_headers() -> None:
    assert IdentityHeaders(HEADER_PRODUCER, HEADER_SEQUENCE) == DEFAULT_HEADERS
    assert (HEADER_PRODUCER, HEADER_SEQUENCE) == ("dedup.producer", "dedup.sequence")


# --------------------------------------------------------------------------- compiled reader
#
# read_batches reads with aiokafka's compiled codec where it can vouch for the result, and
# with kafka-python's reader (the reference) otherwise. The reference alone is read_batches
# with the compiled path switched off; the two must never differ, for any bytes.


def reference(data: bytes, **kwargs: Any) -> list[IncomingBatch] | tuple[ErrorCode, str]:
    with (
        mock.patch.object(batches, "_read_uniform", return_value=None),
        mock.patch.object(batches, "_read_compiled", return_value=None),
    ):
        return outcome(data, **kwargs)


def outcome(data: bytes, **kwargs: Any) -> list[IncomingBatch] | tuple[ErrorCode, str]:
    """The batches read (`canonical` aside: it says which reader read them), or the error.
    A uniform batch's records (`LazyRecords`) are decoded here, to be compared."""
    try:
        return [
            replace(b, canonical=False, records=tuple(b.records))
            for b in read_batches(data, **kwargs)
        ]
    except BadBatch as error:
        return error.error_code, error.message


def assert_read_alike(data: bytes, **kwargs: Any) -> None:
    assert outcome(data, **kwargs) == reference(data, **kwargs)


def without_sizes(
    read: list[IncomingBatch] | tuple[ErrorCode, str],
) -> list[IncomingBatch] | tuple[ErrorCode, str]:
    """What was read, without the decompressed sizes measured within limits."""
    return [replace(b, decompressed_size=-1) for b in read] if isinstance(read, list) else read


def client_batch(
    items: Sequence[Spec],
    codec: int,
    client: Producer,
    *,
    transactional: bool = False,
    log_append: bool = False,
) -> bytes:
    """A batch as a client writes it, by kafka-python's builder (the codec's own settings),
    with the specs' timestamps."""
    builder: Any = DefaultRecordBatchBuilder(
        magic=2,
        compression_type=codec,
        is_transactional=transactional,
        producer_id=client.producer_id,
        producer_epoch=client.producer_epoch,
        base_sequence=client.base_sequence,
        batch_size=1 << 30,
    )
    for offset, spec in enumerate(items):
        builder.append(offset, spec.timestamp, spec.key, spec.value, list(spec.wire_headers()))
    data = bytes(builder.build())
    if log_append:  # (kafka-python's builder drops a codec that does not shrink the batch)
        data = with_header(data, attributes=HEADER.unpack_from(data)[F_ATTRIBUTES] | 0x08)
    return data


def with_first_timestamp(batch: bytes, first: int) -> bytes:
    values = list(HEADER.unpack_from(batch))
    values[7] = first  # first timestamp: every record's timestamp is this plus its delta
    return fix_crc(HEADER.pack(*values) + batch[HEADER_SIZE:])


@pytest.mark.parametrize("codec", CODECS, ids=[CODEC_NAMES[c] for c in CODECS])
@CASES
@given(
    items=st.lists(specs, min_size=1, max_size=10),
    client=producers,
    transactional=st.booleans(),
    log_append=st.booleans(),
    from_log=st.booleans(),
    names=st.sampled_from([DEFAULT_HEADERS, IdentityHeaders("app", "n")]),
)
def test_compiled_reader_reads_valid_batches_as_the_reference(
    codec: int,
    items: list[Spec],
    client: Producer,
    transactional: bool,
    log_append: bool,
    from_log: bool,
    names: IdentityHeaders,
) -> None:
    data = client_batch(items, codec, client, transactional=transactional, log_append=log_append)
    expected = reference(data, headers=names, from_log=from_log)
    assert outcome(data, headers=names, from_log=from_log) == expected
    if not from_log:  # within limits it allows, a batch reads the same with them
        assert_read_alike(data, headers=names, limits=ReadLimits())
        assert without_sizes(outcome(data, headers=names, limits=ReadLimits())) == expected
    if isinstance(expected, list):  # read, not refused: by the compiled codec, no fallback
        assert batches._read_compiled(data, names, from_log) is not None
        # Found while reading: whether a rebuild would add identity headers to a record.
        [batch] = expected
        assert batch.implicit_identities == any(
            r.identity is not None and all(n != names.producer for n, _ in r.headers)
            for r in batch.records
        )
    else:  # only the identity rules refuse a client's batch (here: headers named app, n)
        assert names != DEFAULT_HEADERS


@pytest.mark.parametrize("codec", CODECS, ids=[CODEC_NAMES[c] for c in CODECS])
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    items=st.lists(specs, min_size=1, max_size=5),
    client=producers,
    flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 255)), min_size=1, max_size=4),
    recompute_crc=st.booleans(),
    cut=st.none() | st.integers(0, 10_000),
    from_log=st.booleans(),
)
def test_compiled_reader_fuzz_mutated_batches_read_as_the_reference(
    codec: int,
    items: list[Spec],
    client: Producer,
    flips: list[tuple[int, int]],
    recompute_crc: bool,
    cut: int | None,
    from_log: bool,
) -> None:
    data = bytearray(client_batch(items, codec, client))
    for position, mask in flips:
        data[position % len(data)] ^= mask
    if recompute_crc:
        data = bytearray(fix_crc(data))
    if cut is not None:
        data = data[: cut % (len(data) + 1)]
    assert_read_alike(bytes(data), from_log=from_log)
    assert_read_alike(bytes(data), limits=TIGHT)


@settings(max_examples=150, deadline=None)
@given(
    payload=st.binary(min_size=HEADER_SIZE - 17, max_size=300),
    codec=st.sampled_from(CODECS),
    from_log=st.booleans(),
)
def test_compiled_reader_fuzz_random_records_read_as_the_reference(
    payload: bytes, codec: int, from_log: bool
) -> None:
    data = with_header(
        VALID[:HEADER_SIZE] + payload, length=HEADER_SIZE - 12 + len(payload), attributes=codec
    )
    assert_read_alike(data, from_log=from_log)


def varint(value: int, *, overlong: bool = False) -> bytes:
    """Kafka's zigzag varint; `overlong`: 10 bytes whose last has a bit beyond the 64th,
    which kafka-python keeps and aiokafka (and Kafka) drops."""
    unsigned = (value << 1) ^ (value >> 63)
    out = bytearray()
    if overlong:
        for shift in range(0, 63, 7):
            out.append(((unsigned >> shift) & 0x7F) | 0x80)
        out.append((unsigned >> 63) | 0x02)
        return bytes(out)
    while unsigned > 0x7F:
        out.append((unsigned & 0x7F) | 0x80)
        unsigned >>= 7
    out.append(unsigned)
    return bytes(out)


def hand_written_batch(values: dict[str, int], *, overlong: str | None = None) -> bytes:
    """One record (value b"v"), written field by field: the varints in `values` instead of
    the usual ones, the one named `overlong` in 10 bytes; a right header and CRC."""
    fields = {"attributes": 0, "timestamp_delta": 5, "offset_delta": 0, "key_length": -1}
    fields.update(values)
    parts = [varint(value, overlong=overlong == name) for name, value in fields.items()]
    body = b"".join(parts) + varint(1) + b"v" + varint(0)
    record = varint(len(body), overlong=overlong == "length") + body
    header = list(HEADER.unpack_from(VALID))
    header[F_LENGTH] = HEADER_SIZE - 12 + len(record)
    header[F_COUNT], header[F_LAST_DELTA] = 1, 0
    return fix_crc(HEADER.pack(*header) + record)


def test_hand_written_batch_is_read_by_the_compiled_reader() -> None:
    data = hand_written_batch({})
    assert batches._read_compiled(data, DEFAULT_HEADERS, False) is not None
    [batch] = read_batches(data)
    assert batch.canonical
    assert (batch.records[0].key, batch.records[0].value) == (None, b"v")


@pytest.mark.parametrize(
    "field", ["attributes", "timestamp_delta", "offset_delta", "key_length", "length"]
)
@pytest.mark.parametrize("from_log", [False, True])
def test_varints_beyond_64_bits_go_to_the_reference(field: str, from_log: bool) -> None:
    """aiokafka and kafka-python read these differently: the compiled path leaves them."""
    data = hand_written_batch({}, overlong=field)
    assert batches._read_compiled(data, DEFAULT_HEADERS, from_log) is None
    assert_read_alike(data, from_log=from_log)


@pytest.mark.parametrize("field", ["timestamp_delta", "offset_delta"])
@pytest.mark.parametrize("from_log", [False, True])
def test_far_deltas_in_10_bytes_ending_odd_go_to_the_reference(field: str, from_log: bool) -> None:
    """A delta beyond +-2**62 takes 10 bytes at its shortest, so an overlong copy ending in
    an odd byte has the same length: the size check cannot tell, the bound on deltas does."""
    far = -(1 << 62) - 5
    assert len(varint(far)) == 10 == len(varint(far, overlong=True))
    data = hand_written_batch({field: far}, overlong=field)
    assert batches._read_compiled(data, DEFAULT_HEADERS, from_log) is None
    assert_read_alike(data, from_log=from_log)


def test_timestamps_are_added_without_wrapping_as_kafka_python_does() -> None:
    """aiokafka adds the first timestamp and the delta in int64 (wrapping); the compiled
    path adds them in Python, as the reference."""
    last = (1 << 63) - 1
    data = with_first_timestamp(raw_batch([(0, None, b"a", []), (1, None, b"b", [])]), last)
    assert batches._read_compiled(data, DEFAULT_HEADERS, False) is not None
    assert_read_alike(data)
    assert [r.timestamp for r in read_batches(data)[0].records] == [last, last + 1]


# --------------------------------------------------------------------------- restamp


@pytest.mark.parametrize("codec", CODECS, ids=[CODEC_NAMES[c] for c in CODECS])
@CASES
@given(
    items=st.lists(specs, min_size=1, max_size=8),
    client=producers,
    proxy=producers,
    transactional=st.booleans(),
    log_append=st.booleans(),
)
def test_restamped_batch_is_the_clients_under_the_proxys_producer(
    codec: int,
    items: list[Spec],
    client: Producer,
    proxy: Producer,
    transactional: bool,
    log_append: bool,
) -> None:
    data = client_batch(items, codec, client, transactional=transactional, log_append=log_append)
    data = bytes(7) + b"\x2a" + data[8:]  # a base offset the broker must not see
    out = restamp_batch(data, proxy.producer_id, proxy.producer_epoch, proxy.base_sequence)
    # Read back by kafka-python's reader (the reference): CRC, header, the very same records.
    check: Any = DefaultRecordBatch(out)
    assert check.validate_crc()
    assert (check.producer_id, check.producer_epoch, check.base_sequence) == (
        proxy.producer_id,
        proxy.producer_epoch,
        proxy.base_sequence,
    )
    assert check.base_offset == 0 and not check.is_transactional
    original: Any = DefaultRecordBatch(data)
    assert check.attributes == original.attributes & ~0x10
    assert out[HEADER_SIZE:] == data[HEADER_SIZE:]
    assert [as_read(r, 0) for r in check] == [as_read(r, original.base_offset) for r in original]
    # The same bytes when the records' CRC was made ahead (in the reader thread).
    [batch] = read_batches(data, limits=ReadLimits())
    made = batches.made_ahead(batch, DEFAULT_HEADERS, add_identity_headers=False)
    assert made.identity_records is None
    stamped = batches.restamped(data, proxy.producer_id, proxy.producer_epoch, proxy.base_sequence)
    with_made = batches.restamped(
        data, proxy.producer_id, proxy.producer_epoch, proxy.base_sequence, made
    )
    assert b"".join(with_made) == b"".join(stamped) == out


def as_read(record: Any, base_offset: int) -> tuple[Any, ...]:
    """A record read by kafka-python: offset delta, timestamp, key, value, headers."""
    offset_delta = record.offset - base_offset
    return offset_delta, record.timestamp, record.key, record.value, record.headers


def test_restamp_refuses_what_kafka_would() -> None:
    with pytest.raises(ValueError, match="base sequence"):
        restamp_batch(VALID, 5, 0, -1)
    with pytest.raises(ValueError, match="at least 61 bytes"):
        restamp_batch(VALID[:60], 5, 0, 0)


def test_forwardable_only_when_nothing_changes() -> None:
    explicit_batch = read_batches(raw_batch([(0, None, b"a", explicit(b"p", b"1"))]))[0]
    implicit_batch = read_batches(
        raw_batch([(0, None, b"a", [])], producer_id=3, producer_epoch=0, base_sequence=0)
    )[0]
    plain_batch = read_batches(raw_batch([(0, None, b"a", []), (1, None, b"b", [])]))[0]
    assert forwardable(explicit_batch, explicit_batch.records, True)
    assert forwardable(plain_batch, plain_batch.records, True)  # no identity: nothing added
    assert not forwardable(plain_batch, plain_batch.records[:1], True)  # one dropped
    assert not forwardable(implicit_batch, implicit_batch.records, True)  # headers to add
    assert forwardable(implicit_batch, implicit_batch.records, False)
    # Read by the reference reader (an encoding no client writes): rebuilt, never forwarded.
    assert not forwardable(replace(explicit_batch, canonical=False), explicit_batch.records, True)


# --------------------------------------------------------------------------- builders


def kafka_python_build(records: Sequence[IncomingRecord], codec: int, log_append: bool) -> bytes:
    """build_batch as it was with kafka-python's builder, to compare the compiled one to."""
    builder: Any = DefaultRecordBatchBuilder(
        magic=2,
        compression_type=0,
        is_transactional=False,
        producer_id=9,
        producer_epoch=1,
        base_sequence=5,
        batch_size=1 << 30,
    )
    for offset, record in enumerate(records):
        builder.append(offset, record.timestamp, record.key, record.value, list(record.headers))
    buffer = bytes(builder.build())
    body = buffer[HEADER_SIZE:]
    if codec:
        body = batches._ENCODERS[codec](body)
    values = list(HEADER.unpack_from(buffer))
    values[F_LENGTH] = HEADER_SIZE - 12 + len(body)
    values[F_ATTRIBUTES] = codec | (0x08 if log_append else 0)
    return fix_crc(HEADER.pack(*values) + body)


@pytest.mark.parametrize("codec", CODECS, ids=[CODEC_NAMES[c] for c in CODECS])
@CASES
@given(items=st.lists(specs, min_size=1, max_size=10), log_append=st.booleans())
def test_compiled_builder_writes_kafka_pythons_bytes(
    codec: int, items: list[Spec], log_append: bool
) -> None:
    records = client_records(items)
    built = build_batch(
        records,
        compression=codec,
        timestamp_type=int(log_append),
        producer_id=9,
        producer_epoch=1,
        base_sequence=5,
        add_identity_headers=False,
    )
    expected = kafka_python_build(records, codec, log_append)
    # All but the partition leader epoch (set by the broker): -1 as the Java client's.
    assert built[:12] + built[16:] == expected[:12] + expected[16:]
    assert built[12:16] == b"\xff\xff\xff\xff"


@pytest.mark.parametrize("codec", CODECS[1:], ids=[CODEC_NAMES[c] for c in CODECS[1:]])
def test_the_same_records_compress_to_the_same_bytes_at_any_time(codec: int) -> None:
    # A retried rewrite, and the tests that compare two builds, need equal bytes for equal
    # records: gzip's header holds a time, which must not be the clock's.
    body = b"".join(bytes([i % 251]) * 97 for i in range(64))
    with mock.patch("time.time", return_value=1_700_000_000.0):
        first = batches._ENCODERS[codec](body)
    with mock.patch("time.time", return_value=1_800_000_001.0):
        second = batches._ENCODERS[codec](body)
    assert first == second
    assert bytes(batches._decompressed(codec, memoryview(first)) or b"") == body


# --------------------------------------------------------------------------- identity shortcut

# Sequences near the int64 ends and the shortcut's 18 digits, with zeros in front or not.
INT64_EDGES = [(1 << 63) - 1, 1 << 63, -(1 << 63), -(1 << 63) - 1, 10**18 - 1, 10**18, 1 << 64]
edge_texts = st.builds(
    lambda n, zeros: (b"-" if n < 0 else b"") + b"0" * zeros + str(abs(n)).encode(),
    st.sampled_from(INT64_EDGES),
    st.integers(0, 2),
)
sequence_texts = st.one_of(
    edge_texts,
    st.integers(-(1 << 64), 1 << 64).map(lambda n: str(n).encode()),
    st.text("0123456789+- x", max_size=22).map(str.encode),
    st.just("\u0661".encode()),
)
producer_values = st.sampled_from([b"p", b"app-1", "\u00e9".encode(), b"", b"\xff"]) | st.none()
identity_like_headers = st.one_of(
    st.tuples(st.just(HEADER_PRODUCER), producer_values),
    st.tuples(st.just(HEADER_SEQUENCE), st.none() | sequence_texts),
    st.tuples(st.just("x"), st.none() | st.binary(max_size=6)),
    st.tuples(st.sampled_from(CHUNK_HEADERS), st.none() | st.binary(max_size=6)),
)


def shortcut_case(sequence: bytes) -> Any:
    headers = ((HEADER_PRODUCER, b"p"), (HEADER_SEQUENCE, sequence))
    return example(headers=headers, producer=Producer(-1, -1, -1), from_log=False)


@settings(max_examples=1000, deadline=None)
@given(
    headers=st.lists(identity_like_headers, max_size=6).map(tuple),
    producer=producers,
    from_log=st.booleans(),
)
@shortcut_case(b"9" * 18)
@shortcut_case(b"9223372036854775807")
@shortcut_case(b"9223372036854775808")
@shortcut_case(b"0" * 17 + b"1")
@shortcut_case(b"0" * 18 + b"1")
def test_identity_shortcut_agrees_with_the_rules(
    headers: tuple[tuple[str, bytes | None], ...], producer: Producer, from_log: bool
) -> None:
    """Usual records take a shortcut past `_identity` and `_chunk`: same result for any."""

    def identify(fast: bool) -> object:
        rules = batches._Identify(
            DEFAULT_HEADERS,
            from_log,
            0,
            producer.producer_id,
            producer.producer_epoch,
            producer.base_sequence,
        )
        rules.fast = fast
        try:
            return rules(headers, 3, b"value")
        except BadBatch as error:
            return error.error_code, error.message

    assert identify(True) == identify(False)


# --------------------------------------------------------------------------- bounds


def _bomb(codec: int, size: int) -> bytes:
    """One record whose value, `size` bytes of one letter, compresses to almost nothing."""
    return raw_batch([(0, None, b"a" * size, explicit(b"p", b"1"))], compression=codec)


@pytest.mark.parametrize(
    "codec", [c for c in CODECS if c], ids=[CODEC_NAMES[c] for c in CODECS if c]
)
def test_a_decompression_bomb_is_refused_without_being_decompressed(codec: int) -> None:
    """Sixteen times the bound, in less than the bound: MESSAGE_TOO_LARGE, and the memory the
    read took stays within a few times the bound (decompressing it all would take 16)."""
    import tracemalloc

    bound = 1 << 20
    data = _bomb(codec, 16 * bound)
    assert len(data) < bound  # the batch itself is within it
    tracemalloc.start()
    try:
        with pytest.raises(LimitExceeded) as refused:
            read_batches(data, limits=ReadLimits(max_decompressed_bytes=bound))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert refused.value.error_code == ErrorCode.message_too_large
    assert f"more than {bound} bytes" in refused.value.message
    assert peak < 4 * bound, f"the read took {peak} bytes"


@pytest.mark.parametrize("codec", CODECS, ids=[CODEC_NAMES[c] for c in CODECS])
def test_a_batch_right_at_the_bound_is_read_as_without_one(codec: int) -> None:
    data = _bomb(codec, 4096)
    (unbounded,) = read_batches(data)
    size = len(batches._decompressed(codec, memoryview(data)[HEADER_SIZE:]) or b"")
    (bounded,) = read_batches(data, limits=ReadLimits(max_decompressed_bytes=size))
    assert bounded.decompressed_size == size
    assert replace(bounded, decompressed_size=-1) == unbounded
    with pytest.raises(LimitExceeded):
        read_batches(data, limits=ReadLimits(max_decompressed_bytes=size - 1))


def test_a_batch_with_more_records_than_the_bound_is_too_large() -> None:
    records = [(i, None, b"v", explicit(b"p", str(i).encode())) for i in range(11)]
    data = raw_batch(records)
    assert len(read_batches(data, limits=ReadLimits(max_records=11))[0].records) == 11
    refused = error_of(data, limits=ReadLimits(max_records=10))
    assert refused.error_code == ErrorCode.message_too_large
    assert "11 records, over the proxy's max_batch_records 10" in refused.message


@pytest.mark.parametrize("codec", CODECS, ids=[CODEC_NAMES[c] for c in CODECS])
@pytest.mark.parametrize("by", ["compiled", "reference"])
def test_a_record_with_too_many_headers_is_refused(codec: int, by: str) -> None:
    extra = [(f"h{i}", b"") for i in range(9)]
    data = raw_batch(
        [
            (0, None, b"ok", [*explicit(b"p", b"0"), *extra[:8]]),  # 10 headers
            (1, None, b"bomb", [*explicit(b"p", b"1"), *extra]),  # 11
        ],
        compression=codec,
    )
    limits = ReadLimits(max_headers=10)
    with (
        mock.patch.object(batches, "_read_compiled", return_value=None)
        if by == "reference"
        else contextlib.nullcontext()
    ):
        refused = error_of(data, limits=limits)
    assert isinstance(refused, LimitExceeded)
    assert refused.error_code == ErrorCode.invalid_record
    assert "offset delta 1 has 11 headers, over the proxy's max_headers_per_record 10" in (
        refused.message
    )


@pytest.mark.parametrize("fast", [True, False])
def test_a_producer_name_over_the_bound_is_refused_and_the_log_keeps_it(fast: bool) -> None:
    """Both ways of reading a name (the shortcut for short sequences, and the rules); the
    log, read without bounds, keeps a long name that an earlier bound let in."""
    sequence = b"7" if fast else b"+7"
    long_name = b"n" * 9
    data = raw_batch([(0, None, b"v", explicit(long_name, sequence))])
    ok = read_batches(data, limits=ReadLimits(max_producer_bytes=9))
    assert ok[0].records[0].identity == Identity("n" * 9, 7)
    refused = error_of(data, limits=ReadLimits(max_producer_bytes=8))
    assert refused.error_code == ErrorCode.invalid_record
    assert "dedup.producer of 9 bytes, over the proxy's max_producer_name_bytes 8" in (
        refused.message
    )
    assert read_batches(data, from_log=True)[0].records[0].identity == Identity("n" * 9, 7)


def test_a_header_bomb_is_found_before_the_compiled_reader_parses_it() -> None:
    """The compiled reader holds the GIL for a whole record: a record of more headers than
    a small body can hold is found by the walk first (the compiled reader never sees it)."""
    data = bomb_batch(headers_per_record=400_000)  # 800 KB of headers in a few hundred bytes
    with mock.patch.object(batches, "_CompiledBatch", side_effect=AssertionError("parsed")):
        refused = error_of(data, limits=ReadLimits())
    assert isinstance(refused, LimitExceeded)
    assert "offset delta 0 has 400000 headers" in refused.message


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400), st.integers(0, 70))
def test_fuzz_the_header_count_walk_raises_only_limit_exceeded(data: bytes, bound: int) -> None:
    try:
        batches._scan_header_counts(data, bound)
    except LimitExceeded as refused:
        assert refused.error_code == ErrorCode.invalid_record


@CASES
@given(items=st.lists(specs, min_size=1, max_size=10), codec=st.sampled_from(CODECS))
def test_the_header_count_walk_passes_every_valid_batch(items: list[Spec], codec: int) -> None:
    data = client_batch(items, codec, Producer(-1, -1, -1))
    written_as = data[ATTRIBUTES_OFFSET + 1] & 0x07  # the builder may not compress
    body = batches._decompressed(written_as, memoryview(data)[HEADER_SIZE:])
    assert body is not None
    most = max(len(item.wire_headers()) for item in items)
    batches._scan_header_counts(body, most)  # never raises at the batch's own most
    if most:
        with pytest.raises(LimitExceeded):
            batches._scan_header_counts(body, most - 1)


# --------------------------------------------------------------------------- the Rust scan
# A uniform batch (every record of implicit identity, or every record of one explicit
# producer with sequences rising by one) is read by the Rust scan (`_read_uniform`) with
# its records left undecoded; everything above compares it with the reference already
# (`reference` switches the scan off). These make sure the scan is really taken where it
# should be, agrees with the records it stands for, and writes what `build_batch` writes.

IMPLICIT_WRAP = batches.IMPLICIT_SEQUENCE_MODULUS

payloads = st.none() | st.binary(max_size=40)
other_headers = st.lists(st.tuples(st.sampled_from(["a", "b", "é", ""]), payloads), max_size=3).map(
    tuple
)


@dataclass(frozen=True)
class Plain:
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes | None], ...]
    timestamp_delta: int


plains = st.builds(Plain, payloads, payloads, other_headers, st.integers(0, 5000))


def uniform_batch(
    records: Sequence[Plain],
    codec: int,
    *,
    explicit: tuple[str, int] | None,
    producer_id: int,
    base_sequence: int,
    first_timestamp: int = 1_700_000_000_000,
) -> bytes:
    """A batch as a client writes it (kafka-python's builder): implicit identities, or
    `explicit` (producer, first sequence) in headers of every record."""
    builder: Any = DefaultRecordBatchBuilder(
        magic=2,
        compression_type=codec,
        is_transactional=False,
        producer_id=producer_id,
        producer_epoch=3 if producer_id >= 0 else -1,
        base_sequence=base_sequence if producer_id >= 0 else -1,
        batch_size=1 << 30,
    )
    for offset, record in enumerate(records):
        headers = list(record.headers)
        if explicit is not None:
            producer, first = explicit
            headers += [
                (HEADER_PRODUCER, producer.encode()),
                (HEADER_SEQUENCE, str(first + offset).encode()),
            ]
        timestamp = first_timestamp + (0 if offset == 0 else record.timestamp_delta)
        builder.append(offset, timestamp, record.key, record.value, headers)
    return bytes(builder.build())


def test_the_rust_scan_is_built() -> None:
    """The setup builds dedup._records (deploy/setup.sh, setuptools-rust): without it the
    proxy still works, record by record, and says so; the suite insists on it."""
    assert batches.NATIVE_SCAN


def test_the_rust_scan_can_be_switched_off_for_the_python_readers() -> None:
    """`native_record_scan=false` (`use_native_scan`): the same batch reads the same, record
    by record; switched on again, it is scanned whole again."""
    plain = Plain(b"k", b"v", (), 0)
    data = uniform_batch(
        [plain] * 3, batches.CODEC_NONE, explicit=("p", 7), producer_id=1, base_sequence=0
    )
    (scanned,) = read_batches(data)
    assert scanned.run is not None
    try:
        assert not batches.use_native_scan(False)
        (read,) = read_batches(data)
        assert read.run is None
        assert [r.identity for r in read.records] == [r.identity for r in scanned.records]
    finally:
        assert batches.use_native_scan(True)
    (again,) = read_batches(data)
    assert again.run is not None


@pytest.mark.parametrize("codec", CODECS, ids=[CODEC_NAMES[c] for c in CODECS])
@CASES
@given(
    records=st.lists(plains, min_size=1, max_size=8),
    explicit=st.none() | st.tuples(st.sampled_from(["app-1", "ü"]), st.integers(0, 10**17)),
    base_sequence=st.sampled_from([0, 7, IMPLICIT_WRAP - 3, IMPLICIT_WRAP - 1]),
    bounded=st.booleans(),
)
def test_a_uniform_batch_is_scanned_whole_and_reads_as_the_reference(
    codec: int,
    records: list[Plain],
    explicit: tuple[str, int] | None,
    base_sequence: int,
    bounded: bool,
) -> None:
    data = uniform_batch(
        records, codec, explicit=explicit, producer_id=42, base_sequence=base_sequence
    )
    limits = ReadLimits() if bounded else None
    [batch] = read_batches(data, limits=limits)
    run = batch.run
    assert run is not None, "a uniform batch goes the Rust way"
    assert isinstance(batch.records, batches.LazyRecords) and not batch.records.loaded
    assert outcome(data, limits=limits) == reference(data, limits=limits)
    expected = [(r.identity.producer, r.identity.sequence) for r in batch.records if r.identity]
    assert [(run.producer, run.sequence(i)) for i in range(run.count)] == expected
    assert run.count == len(records)
    assert run.implicit == (explicit is None) == batch.implicit_identities


@pytest.mark.parametrize("codec", CODECS, ids=[CODEC_NAMES[c] for c in CODECS])
@CASES
@given(
    records=st.lists(plains, min_size=1, max_size=8),
    base_sequence=st.sampled_from([0, 11, IMPLICIT_WRAP - 2]),
    out=st.tuples(st.integers(0, 1 << 40), st.integers(0, 100), st.integers(0, IMPLICIT_WRAP - 1)),
    names=st.sampled_from([DEFAULT_HEADERS, IdentityHeaders("app", "n")]),
)
def test_the_rust_rewrite_writes_what_build_batch_writes(
    codec: int,
    records: list[Plain],
    base_sequence: int,
    out: tuple[int, int, int],
    names: IdentityHeaders,
) -> None:
    data = uniform_batch(records, codec, explicit=None, producer_id=5, base_sequence=base_sequence)
    [batch] = read_batches(data, names, limits=ReadLimits())
    assert batch.run is not None and batch.run.rewritable
    producer_id, producer_epoch, sequence = out

    def rewritten(ahead: batches.MadeAhead | None = None) -> bytes:
        pieces = batches.rewritten_with_identity_headers(
            batch,
            producer_id=producer_id,
            producer_epoch=producer_epoch,
            base_sequence=sequence,
            headers=names,
            ahead=ahead,
        )
        return b"".join(pieces)

    rebuilt = build_batch(
        list(batch.records),
        compression=batch.compression,  # kafka-python's builder drops one that does not shrink
        timestamp_type=0,
        producer_id=producer_id,
        producer_epoch=producer_epoch,
        base_sequence=sequence,
        add_identity_headers=True,
        headers=names,
    )
    assert rewritten() == rebuilt
    made_ahead = batches.made_ahead(batch, names, True)  # as the reader thread makes it
    assert made_ahead.identity_records is not None
    assert rewritten(made_ahead) == rebuilt
    # Made for the rewrite, it says nothing of the client's records as they are.
    as_is = b"".join(batches.restamped(batch.raw, producer_id, producer_epoch, sequence))
    assert b"".join(batches.restamped(batch.raw, *out, made_ahead)) == as_is
    # and the log reads the identities back from the headers, as replay does
    [logged] = read_batches(rewritten(), names, from_log=True)
    assert [r.identity for r in logged.records] == [r.identity for r in batch.records]


def test_batches_that_are_not_uniform_are_read_record_by_record() -> None:
    plain = Plain(b"k", b"v", (), 0)
    two = [plain, plain]

    def explicit(sequences: list[bytes], producers: tuple[bytes, bytes] = (b"p", b"p")) -> bytes:
        return raw_batch(
            [
                (i, b"k", b"v", [(HEADER_PRODUCER, producers[i]), (HEADER_SEQUENCE, s)])
                for i, s in enumerate(sequences)
            ],
            producer_id=1,
            producer_epoch=0,
            base_sequence=0,
        )

    chunked = raw_batch(
        [
            (
                0,
                None,
                b"v",
                [(HEADER_PRODUCER, b"p"), (HEADER_SEQUENCE, b"1"), (CHUNK_HEADERS[0], b"u")],
            )
        ],
        producer_id=1,
        producer_epoch=0,
        base_sequence=0,
    )
    cases = {
        "a gap in the sequences": explicit([b"1", b"3"]),
        "two producers": explicit([b"1", b"2"], (b"p", b"q")),
        "a signed sequence": explicit([b"+1", b"2"]),
        "mixed explicit and implicit": raw_batch(
            [
                (0, b"k", b"v", [(HEADER_PRODUCER, b"p"), (HEADER_SEQUENCE, b"1")]),
                (1, b"k", b"v", []),
            ],
            producer_id=1,
            producer_epoch=0,
            base_sequence=0,
        ),
        "a repeated identity header": raw_batch(
            [
                (
                    0,
                    b"k",
                    b"v",
                    [(HEADER_PRODUCER, b"p"), (HEADER_PRODUCER, b"p"), (HEADER_SEQUENCE, b"1")],
                )
            ],
            producer_id=1,
            producer_epoch=0,
            base_sequence=0,
        ),
        "a chunk": chunked,
        "no identity at all (no producer id)": uniform_batch(
            two, 0, explicit=None, producer_id=-1, base_sequence=-1
        ),
    }
    for why, data in cases.items():
        fields = batches._HEADER.unpack_from(data)
        assert batches._read_uniform(data, DEFAULT_HEADERS, fields, None, None) is None, why
        assert outcome(data) == reference(data), why


def test_a_record_the_scan_cannot_vouch_for_goes_the_python_way() -> None:
    """A varint longer than its shortest encoding: Kafka reads it, the scan leaves it."""
    native: Any = batches._native

    def scan(data: bytes) -> Any:
        names = (HEADER_PRODUCER.encode(), HEADER_SEQUENCE.encode())
        return native.scan(data, HEADER_SIZE, 1, *names, [], 10, 10)

    assert scan(hand_written_batch({})) is not None
    for field in ("timestamp_delta", "offset_delta", "key_length", "length"):
        data = hand_written_batch({}, overlong=field)
        assert scan(data) is None, field
        assert outcome(data) == reference(data), field
    assert scan(hand_written_batch({"attributes": 1})) is None


@pytest.mark.parametrize("codec", CODECS, ids=[CODEC_NAMES[c] for c in CODECS])
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    records=st.lists(plains, min_size=1, max_size=5),
    explicit=st.none() | st.just(("app", 5)),
    flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 255)), min_size=1, max_size=3),
)
def test_fuzz_mutated_uniform_batches_read_as_the_reference(
    codec: int, records: list[Plain], explicit: tuple[str, int] | None, flips: list[tuple[int, int]]
) -> None:
    """Damage inside a uniform batch's records, the CRC made right again: the scan takes
    the batch only where the reference reads the same records, never what it refuses."""
    data = bytearray(
        uniform_batch(records, codec, explicit=explicit, producer_id=9, base_sequence=0)
    )
    for position, mask in flips:
        at = HEADER_SIZE + position % max(len(data) - HEADER_SIZE, 1)
        data[min(at, len(data) - 1)] ^= mask
    mutated = fix_crc(data)
    assert outcome(mutated) == reference(mutated)
    assert outcome(mutated, limits=TIGHT) == reference(mutated, limits=TIGHT)


@given(
    data=st.binary(max_size=300),
    start=st.integers(0, 320),
    count=st.integers(-2, 20),
    max_headers=st.integers(0, 5),
)
def test_fuzz_the_rust_functions_refuse_without_failing(
    data: bytes, start: int, count: int, max_headers: int
) -> None:
    """Any bytes: the scan answers None or a result, the rewrite a result or ValueError."""
    native: Any = batches._native
    names = (b"dedup.producer", b"dedup.sequence")
    with contextlib.suppress(ValueError):
        native.scan(data, start, count, *names, [b"x"], max_headers, 10)
    with contextlib.suppress(ValueError):
        native.with_identity_headers(data, start, count, *names, b"p", 0, IMPLICIT_WRAP)


def test_run_identities_are_the_records_identities() -> None:
    from dedup.state import RunIdentities, check_runs

    wrapping = batches.BatchRun("p", IMPLICIT_WRAP - 2, 5, implicit=True)
    assert wrapping.runs() == [("p", IMPLICIT_WRAP - 2, IMPLICIT_WRAP - 1, 2), ("p", 0, 2, 3)]
    whole = RunIdentities([*wrapping.runs(), ("p", 3, 4, 2), ("q", 5, 5, 1)])
    listed = list(whole)
    assert len(whole) == len(listed) == 8
    assert listed[:3] == [("p", IMPLICIT_WRAP - 2), ("p", IMPLICIT_WRAP - 1), ("p", 0)]
    assert whole[7] == ("q", 5)
    assert check_runs(whole) == check_runs(listed)  # runs that go on are joined


def test_copy_of_copies_a_span_with_the_gil_released() -> None:
    """From a worker thread, `copy_of` leaves other threads running while it copies (a
    slice would hold them for the whole copy): the decoder of large Produce requests
    relies on it to keep the event loop free."""
    data = bytes(range(256)) * (512 << 10)  # 128 MiB: tens of ms to copy
    assert batches.copy_of(data, 3, 9) == data[3:9]
    with pytest.raises(ValueError, match="not within"):
        batches.copy_of(data, 5, len(data) + 1)
    window: list[float] = []

    def copy() -> None:
        window.append(time.perf_counter())
        copied = batches.copy_of(data, 1, len(data))
        window.append(time.perf_counter())
        assert len(copied) == len(data) - 1

    ticks: list[float] = []
    worker = threading.Thread(target=copy)
    worker.start()
    while worker.is_alive():
        ticks.append(time.perf_counter())
    worker.join()
    start, end = window
    inside = [start, *(t for t in ticks if start < t < end), end]
    longest = max(b - a for a, b in itertools.pairwise(inside))
    assert longest < (end - start) / 2, f"this thread stood still {longest:.4f} s of the copy's"


@given(st.integers(0, (1 << 63) - 1), st.integers(0, (1 << 15) - 1))
def test_an_implicit_producer_name_gives_back_its_kafka_producer(
    producer_id: int, epoch: int
) -> None:
    assert kafka_producer_of(implicit_producer(producer_id, epoch)) == (producer_id, epoch)


@pytest.mark.parametrize(
    "name", ["orders-service", "kafka-pid-", "kafka-pid-7", "kafka-pid-x-0", "kafka-pid--7-0"]
)
def test_other_names_name_no_kafka_producer(name: str) -> None:
    assert kafka_producer_of(name) is None

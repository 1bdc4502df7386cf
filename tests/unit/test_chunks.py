"""Chunked messages, the pure parts (`dedup.chunks`): header parsing, splitting and
reassembly (round trips, duplicates, expiry, bounds), the check's chunk rule, the proxy's
reading of chunk headers (`dedup.batches`), the replay's fold of chunks (`dedup.replay`)
and the merging of acknowledged positions (`dedup.persisted`)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kafka.record.default_records import DefaultRecordBatchBuilder

from dedup.batches import HEADER_PRODUCER, HEADER_SEQUENCE, BadBatch, read_batches
from dedup.chunks import (
    HEADER_CHUNK_COUNT,
    HEADER_CHUNK_ID,
    HEADER_TOTAL_SIZE,
    HEADER_UUID,
    LAST,
    ChunkError,
    ChunkMeta,
    ChunkProgress,
    Reassembler,
    accept_chunk,
    accept_whole,
    chunk_headers,
    parse_chunk_headers,
    position,
    split_payload,
)
from dedup.persisted import PersistedRecorder
from dedup.replay import Fold

pytestmark = pytest.mark.unit

CASES = settings(max_examples=300, deadline=None)
Headers = list[tuple[str, bytes | None]]


def headers_of(meta: ChunkMeta) -> Headers:
    return list(chunk_headers(meta))


def chunks_of(value: bytes, size: int, uuid: str = "p-1") -> list[tuple[ChunkMeta, bytes]]:
    parts = split_payload(value, size)
    return [(ChunkMeta(uuid, i, len(parts), len(value)), part) for i, part in enumerate(parts)]


# --------------------------------------------------------------------------- headers


def test_chunk_headers_parse_back() -> None:
    meta = ChunkMeta("loader-10", 2, 7, 6_291_579)
    assert headers_of(meta) == [
        ("dedup.uuid", b"loader-10"),
        ("dedup.chunk.id", b"2"),
        ("dedup.chunk.count", b"7"),
        ("dedup.total.size", b"6291579"),
    ]
    assert parse_chunk_headers([("other", b"x"), *headers_of(meta)]) == meta
    assert parse_chunk_headers([("other", b"x")]) is None
    assert parse_chunk_headers(None) is None
    # The last occurrence of a name counts, as for the identity headers.
    assert parse_chunk_headers([*headers_of(meta), (HEADER_CHUNK_ID, b"3")]) == ChunkMeta(
        "loader-10", 3, 7, 6_291_579
    )


@given(
    st.text(min_size=1, max_size=50).filter(lambda t: len(t.encode("utf-8", "replace")) <= 1024),
    st.integers(1, 2**31 - 1),
    st.data(),
)
def test_any_valid_chunk_headers_round_trip(uuid: str, count: int, data: st.DataObject) -> None:
    try:
        uuid.encode("utf-8")
    except UnicodeEncodeError:
        return  # a lone surrogate is no header value
    meta = ChunkMeta(
        uuid, data.draw(st.integers(0, count - 1)), count, data.draw(st.integers(0, 2**53 - 1))
    )
    assert parse_chunk_headers(headers_of(meta)) == meta


GOOD = headers_of(ChunkMeta("u", 0, 2, 10))


def _replace(name: str, value: bytes | None) -> Headers:
    return [(n, value if n == name else v) for n, v in GOOD]


@pytest.mark.parametrize(
    ("headers", "fragment"),
    [
        ([h for h in GOOD if h[0] != HEADER_UUID], "but no dedup.uuid"),
        (GOOD[:1], "but no dedup.chunk.id, dedup.chunk.count, dedup.total.size"),
        (_replace(HEADER_UUID, b""), "an empty dedup.uuid"),
        (_replace(HEADER_UUID, None), "a null dedup.uuid"),
        (_replace(HEADER_UUID, b"\xff"), "dedup.uuid that is not UTF-8"),
        (_replace(HEADER_UUID, b"u" * 1025), "dedup.uuid of 1025 bytes"),
        (_replace(HEADER_CHUNK_ID, b"2"), "dedup.chunk.id 2, beyond its dedup.chunk.count 2"),
        (_replace(HEADER_CHUNK_ID, b"-1"), "dedup.chunk.id that is not a decimal number"),
        (_replace(HEADER_CHUNK_ID, b"+1"), "not a decimal number"),
        (_replace(HEADER_CHUNK_ID, "\u0661".encode()), "not a decimal number"),
        (_replace(HEADER_CHUNK_COUNT, b"0"), "dedup.chunk.count 0, outside [1, 2147483647]"),
        (_replace(HEADER_CHUNK_COUNT, b"2147483648"), "outside [1, 2147483647]"),
        (_replace(HEADER_TOTAL_SIZE, b"9007199254740992"), "dedup.total.size 9007199254740992"),
        (_replace(HEADER_TOTAL_SIZE, None), "a null dedup.total.size"),
        (_replace(HEADER_TOTAL_SIZE, b"1" * 20), "not a decimal number"),
    ],
)
def test_bad_chunk_headers_say_why(headers: Headers, fragment: str) -> None:
    with pytest.raises(ChunkError) as info:
        parse_chunk_headers(headers)
    assert fragment in str(info.value), str(info.value)


# --------------------------------------------------------------------------- splitting


@CASES
@given(st.binary(max_size=3000), st.integers(1, 700))
def test_split_round_trips(value: bytes, size: int) -> None:
    parts = split_payload(value, size)
    assert b"".join(parts) == value
    assert all(len(p) == size for p in parts[:-1])
    assert 0 < len(parts[-1]) <= size or not value
    assert len(parts) == max(1, -(-len(value) // size))


# --------------------------------------------------------------------------- the check's rule


@CASES
@given(st.binary(max_size=500), st.integers(1, 90), st.integers(-(2**63), 2**63 - 1))
def test_the_rule_accepts_the_chunks_of_a_message_in_order(
    value: bytes, size: int, sequence: int
) -> None:
    progress = None
    so_far = 0
    chunks = chunks_of(value, size)
    for meta, part in chunks:
        assert position(sequence, meta) > (progress.position if progress else (sequence - 1, 0))
        progress = accept_chunk(progress, sequence, meta, len(part))
        so_far += len(part)
        if meta.last:
            assert progress is None
        else:
            assert progress is not None and (progress.chunk_id, progress.size) == (
                meta.chunk_id,
                so_far,
            )
    assert position(sequence, chunks[-1][0]) == (sequence, LAST)


@CASES
@given(st.binary(min_size=3, max_size=300), st.integers(1, 50), st.data())
def test_the_rule_refuses_every_skip_and_every_wrong_size(
    value: bytes, size: int, data: st.DataObject
) -> None:
    chunks = chunks_of(value, size)
    if len(chunks) < 2:
        return
    stop = data.draw(st.integers(0, len(chunks) - 2))
    progress = None
    for meta, part in chunks[:stop]:
        progress = accept_chunk(progress, 5, meta, len(part))
    skip_to = data.draw(st.integers(stop + 1, len(chunks) - 1))
    with pytest.raises(ChunkError, match="skips ahead"):
        accept_chunk(progress, 5, chunks[skip_to][0], len(chunks[skip_to][1]))
    meta, part = chunks[stop]
    so_far = sum(len(p) for _, p in chunks[:stop])
    with pytest.raises(ChunkError, match="over its total size"):
        accept_chunk(progress, 5, meta, len(value) - so_far + data.draw(st.integers(1, 10)))
    last_meta, last_part = chunks[-1]
    ahead = progress
    for meta_, part_ in chunks[stop:-1]:
        ahead = accept_chunk(ahead, 5, meta_, len(part_))
    with pytest.raises(ChunkError, match="the chunks add up to"):
        accept_chunk(ahead, 5, last_meta, len(last_part) - 1)
    other = ChunkMeta("other", meta.chunk_id, meta.chunk_count, meta.total_size)
    if progress is not None:
        with pytest.raises(ChunkError, match="but its chunks so far say uuid p-1"):
            accept_chunk(progress, 5, other, len(part))
        with pytest.raises(ChunkError, match="which is the chunked message p-1 in progress"):
            accept_whole(progress, 5)
    # A later sequence abandons the message in progress: its chunk 0 is fine.
    assert accept_chunk(progress, 6, ChunkMeta("q", 0, 2, 9), 4) == ChunkProgress(
        6, "q", 0, 2, 9, 4
    )
    accept_whole(progress, 6)


@given(
    st.integers(-(2**63), 2**63 - 1),
    st.text(min_size=1, max_size=30).filter(lambda t: t == t.encode("utf-8", "ignore").decode()),
    st.integers(2, 2**31 - 1),
    st.data(),
)
def test_chunk_progress_encodes_as_the_lua_reads_it(
    sequence: int, uuid: str, count: int, data: st.DataObject
) -> None:
    total = data.draw(st.integers(0, 2**53 - 1))
    progress = ChunkProgress(
        sequence,
        uuid,
        data.draw(st.integers(0, count - 2)),
        count,
        total,
        data.draw(st.integers(0, total)),
    )
    assert ChunkProgress.decode(progress.encode()) == progress


def test_chunk_progress_is_never_complete() -> None:
    with pytest.raises(ValueError, match="chunk_id 1 is outside"):
        ChunkProgress(1, "u", 1, 2, 10, 5)
    with pytest.raises(ValueError, match="size 11 is outside"):
        ChunkProgress(1, "u", 0, 2, 10, 11)
    with pytest.raises(ValueError, match="uuid"):
        ChunkProgress(1, "", 0, 2, 10, 1)


# --------------------------------------------------------------------------- reassembly


def feed(
    reassembler: Reassembler,
    producer: str,
    sequence: int,
    meta: ChunkMeta,
    part: bytes,
    now_ms: int = 0,
    partition: int = 0,
) -> Any:
    return reassembler.add(
        producer,
        sequence,
        meta.uuid,
        meta.chunk_id,
        meta.chunk_count,
        meta.total_size,
        part,
        partition=partition,
        now_ms=now_ms,
        context=meta.chunk_id,
    )


@CASES
@given(st.binary(max_size=2000), st.integers(1, 300), st.data())
def test_reassembly_round_trips_and_tolerates_duplicate_chunks(
    value: bytes, size: int, data: st.DataObject
) -> None:
    chunks = chunks_of(value, size)
    # Each chunk once, in order, with re-sends of earlier chunks anywhere after them.
    stream: list[tuple[ChunkMeta, bytes]] = []
    for i, chunk in enumerate(chunks):
        stream.append(chunk)
        stream += data.draw(st.lists(st.sampled_from(chunks[: i + 1]), max_size=2))
    stream += data.draw(st.lists(st.sampled_from(chunks), max_size=3))  # after completion
    reassembler = Reassembler()
    out = [m for meta, part in stream if (m := feed(reassembler, "p", 1, meta, part))]
    assert len(out) == 1
    assert (out[0].value, out[0].chunk_count, out[0].contexts) == (
        value,
        len(chunks),
        tuple(range(len(chunks))),
    )
    assert reassembler.stats.duplicates == len(stream) - len(chunks)
    assert reassembler.stats.completed == 1
    assert reassembler.buffered_bytes == 0 and list(reassembler.pending()) == []


@CASES
@given(st.lists(st.binary(max_size=300), min_size=1, max_size=6), st.randoms())
def test_interleaved_producers_and_partitions_each_come_out_whole(
    values: list[bytes], rng: random.Random
) -> None:
    queues = [
        [(f"p{i % 3}", i, meta, part) for meta, part in chunks_of(v, 50, f"u{i}")]
        for i, v in enumerate(values)
    ]
    reassembler = Reassembler()
    out = []
    while any(queues):
        queue = rng.choice([q for q in queues if q])
        producer, sequence, meta, part = queue.pop(0)
        # Messages of one producer go to different partitions, so none abandons another.
        message = feed(reassembler, producer, sequence, meta, part, partition=sequence)
        if message is not None:
            out.append(message)
    assert sorted((m.sequence, m.value) for m in out) == list(enumerate(values))


def test_incomplete_messages_expire_counted_and_logged() -> None:
    reassembler = Reassembler(expire_after_ms=1000)
    (first, part), (second, rest) = chunks_of(b"abcdef", 3)
    assert feed(reassembler, "p", 1, first, part, now_ms=0) is None
    assert reassembler.expire(999) == []
    (expired,) = reassembler.expire(1000)
    assert (expired.producer, expired.sequence, expired.received, expired.chunk_count) == (
        "p",
        1,
        1,
        2,
    )
    assert reassembler.stats.expired == 1 and reassembler.buffered_bytes == 0
    # Its last chunk, late: a message missing its first chunk never completes.
    assert feed(reassembler, "p", 1, second, rest, now_ms=1001) is None
    assert reassembler.expire(5000)[0].received == 1 and reassembler.stats.expired == 2


def test_the_buffer_is_bounded() -> None:
    reassembler = Reassembler(max_buffer_bytes=10)
    a = chunks_of(b"a" * 8, 4, "a")
    b = chunks_of(b"b" * 8, 4, "b")
    feed(reassembler, "pa", 1, *a[0])
    feed(reassembler, "pb", 1, *b[0])
    assert reassembler.buffered_bytes == 8
    feed(reassembler, "pb", 2, *chunks_of(b"c" * 6, 3, "c")[0])  # 11 bytes: the oldest goes
    assert reassembler.stats.evicted == 1 and reassembler.buffered_bytes == 7
    assert [m.producer for m in reassembler.pending()] == ["pb", "pb"]
    assert feed(reassembler, "pz", 1, *chunks_of(b"z" * 11, 4, "z")[0]) is None
    assert reassembler.stats.too_large == 1 and reassembler.buffered_bytes == 7


def test_a_later_sequence_abandons_an_incomplete_message() -> None:
    reassembler = Reassembler()
    feed(reassembler, "p", 1, *chunks_of(b"abcdef", 3, "one")[0])
    feed(reassembler, "q", 1, *chunks_of(b"abcdef", 3, "other")[0])
    whole = [feed(reassembler, "p", 2, meta, part) for meta, part in chunks_of(b"xyz", 2, "two")]
    assert whole[-1].value == b"xyz"
    assert reassembler.stats.abandoned == 1
    assert [(m.producer, m.sequence) for m in reassembler.pending()] == [("q", 1)]
    assert reassembler.add_whole("q", 2) is True and reassembler.stats.abandoned == 2
    assert reassembler.add_whole("q", 2) is False  # a duplicate
    # Late chunks of an abandoned sequence are duplicates, not new partial messages.
    assert feed(reassembler, "p", 1, *chunks_of(b"abcdef", 3, "one")[1]) is None
    assert list(reassembler.pending()) == [] and reassembler.stats.duplicates == 2


def test_contradicting_chunks_are_counted_and_restart_the_message() -> None:
    reassembler = Reassembler()
    (first, part), (second, rest) = chunks_of(b"abcdef", 3)
    feed(reassembler, "p", 1, first, part)
    liar = ChunkMeta(second.uuid, second.chunk_id, 3, second.total_size)
    assert feed(reassembler, "p", 1, liar, rest) is None
    assert reassembler.stats.inconsistent == 1
    assert feed(reassembler, "p", 1, ChunkMeta("u", 5, 2, 6), b"x") is None
    assert reassembler.stats.inconsistent == 2
    with pytest.raises(ValueError):
        Reassembler(max_buffer_bytes=0)


# --------------------------------------------------------------------------- the proxy's reading


def batch(records: list[tuple[bytes | None, Headers]], producer_id: int = -1) -> bytes:
    builder: Any = DefaultRecordBatchBuilder(
        magic=2,
        compression_type=0,
        is_transactional=False,
        producer_id=producer_id,
        producer_epoch=0 if producer_id >= 0 else -1,
        base_sequence=0 if producer_id >= 0 else -1,
        batch_size=1 << 30,
    )
    for offset, (value, headers) in enumerate(records):
        builder.append(offset, 1000, None, value, headers)
    return bytes(builder.build())


IDENTITY: Headers = [(HEADER_PRODUCER, b"p"), (HEADER_SEQUENCE, b"3")]


def test_read_batches_gives_each_chunk_its_headers() -> None:
    (meta0, part0), (meta1, part1) = chunks_of(b"abcdefg", 4)
    (read,) = read_batches(
        batch([(part0, IDENTITY + headers_of(meta0)), (part1, IDENTITY + headers_of(meta1))])
    )
    assert [r.chunk for r in read.records] == [meta0, meta1]
    (plain,) = read_batches(batch([(b"x", IDENTITY)]))
    assert plain.records[0].chunk is None


@pytest.mark.parametrize(
    ("records", "producer_id", "fragment"),
    [
        ([(b"abc", headers_of(ChunkMeta("u", 0, 2, 5)))], -1, "needs an explicit dedup identity"),
        ([(b"abc", headers_of(ChunkMeta("u", 0, 2, 5)))], 7, "needs an explicit dedup identity"),
        ([(None, IDENTITY + headers_of(ChunkMeta("u", 0, 2, 5)))], -1, "a null value"),
        ([(b"abcdef", IDENTITY + headers_of(ChunkMeta("u", 0, 2, 5)))], -1, "over its message's"),
        ([(b"a", IDENTITY + headers_of(ChunkMeta("u", 0, 2, 5))[1:])], -1, "but no dedup.uuid"),
    ],
)
def test_read_batches_refuses_bad_chunks(
    records: list[tuple[bytes | None, Headers]], producer_id: int, fragment: str
) -> None:
    with pytest.raises(BadBatch) as info:
        read_batches(batch([(b"fine", IDENTITY), *records], producer_id))
    assert int(info.value.error_code) == 87
    assert info.value.message.startswith("record at offset delta 1 ")
    assert fragment in info.value.message, info.value.message


def test_read_from_the_log_keeps_the_identity_of_a_bad_chunk() -> None:
    bad = IDENTITY + headers_of(ChunkMeta("u", 0, 2, 1))
    (read,) = read_batches(batch([(b"abc", bad)]), from_log=True)
    assert (read.records[0].identity, read.records[0].chunk) is not None
    assert read.records[0].chunk is None


# --------------------------------------------------------------------------- the replay's fold


@dataclass
class Message:
    offset_: int
    headers_: Headers
    value_: bytes = b""
    timestamp_: int = 0

    def offset(self) -> int:
        return self.offset_

    def headers(self) -> Headers:
        return self.headers_

    def value(self) -> bytes:
        return self.value_

    def timestamp(self) -> tuple[int, int]:
        return (1, self.timestamp_)

    def error(self) -> None:
        return None


def identity(producer: str, sequence: int) -> Headers:
    return [(HEADER_PRODUCER, producer.encode()), (HEADER_SEQUENCE, str(sequence).encode())]


def log_of(*messages: tuple[str, int, ChunkMeta | None, bytes]) -> list[Message]:
    return [
        Message(
            offset,
            identity(p, s) + (headers_of(meta) if meta else []),
            value,
            timestamp_=offset,
        )
        for offset, (p, s, meta, value) in enumerate(messages)
    ]


def test_fold_follows_the_message_in_progress() -> None:
    a = chunks_of(b"a" * 10, 3, "a-1")  # 4 chunks
    b = chunks_of(b"b" * 5, 3, "b-7")  # 2 chunks
    messages = log_of(
        ("a", 0, None, b"whole"),
        ("a", 1, *a[0]),
        ("b", 7, *b[0]),
        ("a", 1, *a[1]),
        ("b", 7, *b[1]),
        ("c", 4, *chunks_of(b"ccc", 2, "c-4")[0]),
    )
    fold = Fold(100)
    fold.add(messages)
    assert fold.highest() == {"a": (0, 3), "b": (7, 4)}, "a chunk does not complete a sequence"
    assert fold.chunks() == {
        "a": (ChunkProgress(1, "a-1", 1, 4, 10, 6), 3),
        "c": (ChunkProgress(4, "c-4", 0, 2, 3, 2), 5),
    }
    assert (fold.records, fold.identified) == (6, 6)
    # Where a batch sent again lies: never at a chunk (a message's chunks share a sequence).
    assert fold.runs() == {"a": [(0, 1, 0, -1)]}


def test_fold_continues_the_snapshot_and_drops_completed_or_abandoned_messages() -> None:
    a = chunks_of(b"a" * 10, 3, "a-1")
    start = {"a": ChunkProgress(1, "a-1", 1, 4, 10, 6), "z": ChunkProgress(9, "z", 0, 2, 4, 1)}
    fold = Fold(100, chunks=start)
    fold.add(log_of(("a", 1, *a[1]), ("a", 1, *a[2]), ("z", 10, None, b"later")))
    assert fold.chunks() == {"a": (ChunkProgress(1, "a-1", 2, 4, 10, 9), 1)}
    fold.add([Message(3, identity("a", 1) + headers_of(a[3][0]), a[3][1])])
    assert fold.chunks() == {} and fold.highest()["a"] == (1, 1)
    untouched = Fold(100, chunks=start)
    assert untouched.chunks() == {p: (c, -1) for p, c in start.items()}


# --------------------------------------------------------------------------- acknowledgements


async def test_persisted_recorder_keeps_the_highest_position() -> None:
    calls: list[Any] = []

    class State:
        async def mark_persisted(self, updates: Any, now_ms: int, tokens: Any) -> list[int]:
            calls.append(updates)
            return []

    recorder = PersistedRecorder(State())  # type: ignore[arg-type]
    chunk1 = ChunkProgress(5, "u", 1, 3, 9, 6)
    recorder.add("t", 0, {"p": ChunkProgress(5, "u", 0, 3, 9, 3)})
    recorder.add("t", 0, {"p": chunk1, "q": 4})
    recorder.add("t", 0, {"p": 4, "q": ChunkProgress(4, "v", 0, 2, 2, 1)})
    assert recorder._pending == {("t", 0, ""): {"p": chunk1, "q": 4}}
    recorder.add("t", 0, {"p": 5})
    assert recorder._pending[("t", 0, "")]["p"] == 5

"""Chunked messages through the proxy (`dedup.chunks`), on real Kafka and Redis: a message
larger than ``max.message.bytes`` arrives once, re-sent and duplicated chunks never reach the
topic twice, a proxy killed in the middle of a message recovers exactly (from a snapshot,
from a replay, from both), producers interleave, bad chunks are refused; and the Lua check
against the Python rule (`accept_chunk`) under hypothesis.

This module runs its own proxy processes (`tests.support.ports.CHUNKS`) on Redis db 9, so
flushing Redis here touches no other test's state. Every test reads the topic back straight
from Kafka.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio
from confluent_kafka import Producer, TopicPartition
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dedup.batches import HEADER_PRODUCER, HEADER_SEQUENCE
from dedup.chunked_consumer import ChunkedConsumer, ConsumedMessage
from dedup.chunks import (
    HEADER_CHUNK_COUNT,
    HEADER_CHUNK_ID,
    HEADER_TOTAL_SIZE,
    HEADER_UUID,
    LAST,
    ChunkError,
    ChunkMeta,
    ChunkProgress,
    accept_chunk,
    accept_whole,
    check_consistent,
    chunk_headers,
    position,
    split_payload,
)
from dedup.client import DedupProducer
from dedup.state import DedupState, PartitionCheck, Persisted, ProducerState, Status
from deploy.launcher import ProxyProcess
from deploy.local import EnvInfo
from tests.support.kafka_io import read_all, read_messages
from tests.support.ports import CHUNKS
from tests.support.proxy_api import admin_call
from tests.support.raw import produce_raw, produce_request, record_batch
from tests.support.restartable import RestartableProxy
from tests.support.topics import new_topic

pytestmark = pytest.mark.integration

REDIS_DB = 9
INVALID_RECORD = 87
NOT_ENOUGH_REPLICAS = 19  # the proxy's "not written, retry"
CHUNK = 100_000  # the chunk size of the kill tests: several chunks, quickly


@pytest.fixture
def chunk_proxy(local_env: EnvInfo, tmp_path: Path) -> Iterator[RestartableProxy]:
    proxy = RestartableProxy(
        local_env, tmp_path, CHUNKS, REDIS_DB, "chunks", DEDUP_PROXY_POLICY_CACHE_S="0"
    )
    yield proxy
    proxy.stop()


@pytest.fixture
def running(chunk_proxy: RestartableProxy) -> ProxyProcess:
    return chunk_proxy.start()


# ----------------------------------------------------------------------------- helpers


def payload(size: int, seed: int = 0) -> bytes:
    """Bytes that differ from chunk to chunk, so a chunk out of place shows."""
    block = os.urandom(4096) if seed < 0 else bytes((seed + i) % 251 for i in range(4096))
    return (block * (size // len(block) + 1))[:size]


def chunk_records(
    producer: str, sequence: int, value: bytes, chunk_size: int, uuid_text: str | None = None
) -> list[tuple[bytes, list[tuple[bytes, bytes]]]]:
    """The records a producer sends for one chunked message: (value, headers) per chunk."""
    chunks = split_payload(value, chunk_size)
    uuid_text = uuid_text or f"{producer}-{sequence}"
    identity = [
        (HEADER_PRODUCER.encode(), producer.encode()),
        (HEADER_SEQUENCE.encode(), str(sequence).encode()),
    ]
    return [
        (
            chunk,
            identity
            + [
                (name.encode(), data)
                for name, data in chunk_headers(
                    ChunkMeta(uuid_text, chunk_id, len(chunks), len(value))
                )
            ],
        )
        for chunk_id, chunk in enumerate(chunks)
    ]


def whole(producer: str, sequence: int, value: bytes) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    """A record that is not chunked."""
    identity = [(HEADER_PRODUCER, producer), (HEADER_SEQUENCE, str(sequence))]
    return value, [(name.encode(), text.encode()) for name, text in identity]


def send_raw(
    proxy: ProxyProcess, topic: str, records: Sequence[tuple[bytes, Sequence[tuple[bytes, bytes]]]]
) -> Any:
    """One Produce request with one batch of these records; the partition's answer."""
    return produce_raw(proxy, produce_request(topic, {0: record_batch(records)}))


def assert_ok(answer: Any) -> None:
    assert answer.error_code == 0, (answer.error_code, answer.error_message)


def consume_all(bootstrap: str, topic: str, partitions: int = 1) -> ChunkedConsumer:
    """A ChunkedConsumer that has read every record of the topic; its messages in
    ``.got``."""
    consumer = ChunkedConsumer(
        {"bootstrap.servers": bootstrap, "group.id": f"c-{uuid.uuid4().hex}"}
    )
    ends = {}
    probe = consumer.consumer
    for partition in range(partitions):
        _, high = probe.get_watermark_offsets(TopicPartition(topic, partition), timeout=30)
        ends[partition] = high
    consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    got: list[ConsumedMessage] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        positions = consumer.consumer.position(
            [TopicPartition(topic, p) for p in range(partitions)]
        )
        if all(tp.offset >= ends[tp.partition] for tp in positions):
            break
        message = consumer.poll(0.5)
        if message is not None:
            got.append(message)
    consumer.got = got  # type: ignore[attr-defined]
    return consumer


def assembled(bootstrap: str, topic: str, partitions: int = 1) -> list[ConsumedMessage]:
    consumer = consume_all(bootstrap, topic, partitions)
    try:
        got: list[ConsumedMessage] = consumer.got  # type: ignore[attr-defined]
        assert consumer.stats.inconsistent == 0
        assert consumer.reassembler.buffered_bytes == 0, list(consumer.reassembler.pending())
        return got
    finally:
        consumer.close()


def chunk_ids(bootstrap: str, topic: str) -> list[tuple[str, int, int]]:
    """(producer, sequence, chunk id) of every record in the partition, in log order."""
    rows = []
    for _, headers in read_all(bootstrap, topic):
        chunk_id = int(headers[HEADER_CHUNK_ID]) if HEADER_CHUNK_ID in headers else -1
        rows.append((headers[HEADER_PRODUCER].decode(), int(headers[HEADER_SEQUENCE]), chunk_id))
    return rows


def last_sequence_id(proxy: ProxyProcess, topic: str, producer: str) -> int:
    path = f"/v1/topics/{topic}/partitions/0/producers/{producer}"
    return int(admin_call(proxy, "GET", path)["last_sequence_id"])


# ----------------------------------------------------------------------------- the product


def test_six_megabyte_message_arrives_once_and_a_resend_adds_nothing(
    running: ProxyProcess, local_env: EnvInfo
) -> None:
    topic = new_topic(local_env.bootstrap)  # the broker's default max.message.bytes
    value = payload(6 * 1024 * 1024 + 123, seed=-1)
    producer = DedupProducer(running.bootstrap, "big", admin_url=running.admin_url)
    outcomes: list[Any] = []
    for _ in range(2):  # the second time: a producer re-sending the same message
        producer.send(
            topic, value, key=b"k", sequence_id=10, on_delivery=lambda e, _m: outcomes.append(e)
        )
        assert producer.flush(60) == 0
    assert outcomes == [None, None], "one callback per message, both delivered"
    assert chunk_ids(local_env.bootstrap, topic) == [("big", 10, i) for i in range(7)]
    (message,) = assembled(local_env.bootstrap, topic)
    assert (message.producer, message.sequence, message.chunk_count) == ("big", 10, 7)
    assert message.value == value and message.key == b"k"
    assert not any(name.startswith("dedup.chunk") for name, _ in message.headers)
    assert last_sequence_id(running, topic, "big") == 10

    with pytest.raises(ValueError, match="over max_message_size"):
        DedupProducer(running.bootstrap, "tiny", max_message_size=1000).send(topic, b"x" * 1001)


def test_an_unkeyed_message_resent_by_a_restarted_producer_meets_its_first_send(
    running: ProxyProcess, local_env: EnvInfo
) -> None:
    """Dedup is per partition: without a key, the chunks' partition comes from the
    message's uuid, so the restarted producer's re-send lands where the first send did."""
    partitions = 4
    topic = new_topic(local_env.bootstrap, partitions=partitions)
    values = {sequence: payload(250_000, seed=sequence) for sequence in range(6)}
    for _ in range(2):  # a fresh producer each time: nothing remembered in between
        producer = DedupProducer(running.bootstrap, "unkeyed", chunk_size=100_000)
        for sequence, value in values.items():
            producer.send(topic, value, sequence_id=sequence)
        assert producer.flush(60) == 0
    got = assembled(local_env.bootstrap, topic, partitions)
    assert sorted((m.sequence, m.value) for m in got) == sorted(values.items())
    assert len({m.partition for m in got}) > 1, "the messages spread over the partitions"


def test_resent_and_duplicated_middle_chunks_are_written_once(
    running: ProxyProcess, local_env: EnvInfo
) -> None:
    topic = new_topic(local_env.bootstrap)
    two = chunk_records("dup", 1, payload(7, seed=1), 4)  # 2 chunks: 4 + 3 bytes
    three = chunk_records("dup", 2, payload(25, seed=2), 10)  # 3 chunks: 10 + 10 + 5
    answered = []
    for records in (
        [two[0]],
        [two[0], two[1]],  # chunk 0 again, with the next one
        [two[1]],  # a retry of the last chunk: the message is complete
        [three[0], three[1], three[1]],  # a middle chunk twice in one batch
        [three[1]],
        [three[0], three[1]],
        [three[2], three[2]],
        [three[1], three[2]],
    ):
        answer = send_raw(running, topic, records)
        assert_ok(answer)
        answered.append((records[0], answer.base_offset))
    assert chunk_ids(local_env.bootstrap, topic) == [
        ("dup", 1, 0),
        ("dup", 1, 1),
        ("dup", 2, 0),
        ("dup", 2, 1),
        ("dup", 2, 2),
    ]
    # A batch dropped whole is answered -1 or with where its first record is: never with
    # another chunk's offset (the chunks of a message share its sequence).
    logged = {
        m.offset(): dict(m.headers() or []) for m in read_messages(local_env.bootstrap, topic)
    }
    for (_, headers), offset in answered:
        if offset >= 0:
            sent = dict((name.decode(), value) for name, value in headers)
            assert logged[offset][HEADER_CHUNK_ID] == sent[HEADER_CHUNK_ID], (offset, sent)
    assert [(m.sequence, m.value) for m in assembled(local_env.bootstrap, topic)] == [
        (1, payload(7, seed=1)),
        (2, payload(25, seed=2)),
    ]

    # librdkafka's path: a plain producer that sends a middle chunk twice by hand.
    plain = Producer({"bootstrap.servers": running.bootstrap, "enable.idempotence": True})
    four = chunk_records("dup", 3, payload(30, seed=3), 10)
    for value, headers in [four[0], four[1], four[1], four[0], four[2], four[1]]:
        plain.produce(topic, value, headers=[(n.decode(), v) for n, v in headers], partition=0)
    assert plain.flush(60) == 0
    assert chunk_ids(local_env.bootstrap, topic)[5:] == [("dup", 3, i) for i in range(3)]
    assert assembled(local_env.bootstrap, topic)[2].value == payload(30, seed=3)


def test_a_sequence_is_persisted_only_with_its_last_chunk(
    running: ProxyProcess, local_env: EnvInfo
) -> None:
    topic = new_topic(local_env.bootstrap)
    assert_ok(send_raw(running, topic, chunk_records("mid", 4, b"abc", 2)[:1]))
    assert_ok(send_raw(running, topic, chunk_records("mid", 5, payload(30), 10)[:2]))
    assert last_sequence_id(running, topic, "mid") == -1, "neither message is complete"
    # A new sequence abandons the incomplete one; its late chunk is a duplicate now.
    assert_ok(send_raw(running, topic, chunk_records("mid", 6, b"whole", 10)))
    assert_ok(send_raw(running, topic, chunk_records("mid", 5, payload(30), 10)[2:]))
    assert last_sequence_id(running, topic, "mid") == 6
    assert chunk_ids(local_env.bootstrap, topic) == [
        ("mid", 4, 0),
        ("mid", 5, 0),
        ("mid", 5, 1),
        ("mid", 6, 0),
    ]
    consumer = consume_all(local_env.bootstrap, topic)
    try:
        got = consumer.got  # type: ignore[attr-defined]
        assert [(m.sequence, m.value, m.chunk_count) for m in got] == [(6, b"whole", 1)]
        assert consumer.stats.abandoned == 2, "sequences 4 and 5 will never complete"
    finally:
        consumer.close()


def test_interleaved_chunked_messages_of_several_producers_on_one_partition(
    running: ProxyProcess, local_env: EnvInfo
) -> None:
    topic = new_topic(local_env.bootstrap)
    a = chunk_records("a", 1, payload(30, seed=11), 10)
    b = chunk_records("b", 1, payload(20, seed=12), 10)
    c = chunk_records("c", 7, payload(11, seed=13), 10)
    for records in ([a[0], b[0]], [a[1], c[0], b[0]], [b[1], a[1], c[1]], [a[2], c[0], a[0]]):
        assert_ok(send_raw(running, topic, records))
    assert chunk_ids(local_env.bootstrap, topic) == [
        ("a", 1, 0),
        ("b", 1, 0),
        ("a", 1, 1),
        ("c", 7, 0),
        ("b", 1, 1),
        ("c", 7, 1),
        ("a", 1, 2),
    ]
    assert [(m.producer, m.value) for m in assembled(local_env.bootstrap, topic)] == [
        ("b", payload(20, seed=12)),
        ("c", payload(11, seed=13)),
        ("a", payload(30, seed=11)),
    ]

    # Three DedupProducers at once, each with several chunked messages and retries.
    topic = new_topic(local_env.bootstrap)
    values = {
        name: [payload(35_000 + i * 777, seed=i + n) for i in range(4)]
        for n, name in enumerate(("x", "y", "z"))
    }

    def send(name: str) -> None:
        producer = DedupProducer(running.bootstrap, name, chunk_size=10_000, **{"linger.ms": 0})
        for sequence, value in enumerate(values[name]):
            producer.send(topic, value, sequence_id=sequence, partition=0)
        for sequence, value in enumerate(values[name][:2]):  # a blind re-send
            producer.send(topic, value, sequence_id=sequence, partition=0)
        assert producer.flush(60) == 0

    failures: list[BaseException] = []

    def guarded(name: str) -> None:
        try:
            send(name)
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=guarded, args=(n,)) for n in values]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    got = assembled(local_env.bootstrap, topic)
    for name, sent in values.items():
        assert [m.value for m in got if m.producer == name] == sent
    rows = chunk_ids(local_env.bootstrap, topic)
    assert (
        len(rows)
        == len(set(rows))
        == sum(len(split_payload(v, 10_000)) for vs in values.values() for v in vs)
    )


@dataclass
class Bad:
    records: Any
    words: str
    before: Any = None  # records accepted first
    # A skip ahead is refused as not written (retriable): the chunk before may still come.
    code: int = INVALID_RECORD


BAD_CHUNKS = {
    "chunk-id-beyond-count": Bad(
        lambda: [_with(chunk_records("bad", 1, b"abcdef", 3)[0], {HEADER_CHUNK_ID: b"2"})],
        "dedup.chunk.id 2, beyond its dedup.chunk.count 2",
    ),
    "missing-uuid": Bad(
        lambda: [_with(chunk_records("bad", 1, b"abcdef", 3)[0], {HEADER_UUID: None})],
        "but no dedup.uuid",
    ),
    "chunk-over-total": Bad(
        lambda: [_with(chunk_records("bad", 1, b"abcdef", 3)[0], {HEADER_TOTAL_SIZE: b"2"})],
        "chunk of 3 bytes, over its message's total size 2",
    ),
    "chunks-over-total": Bad(
        lambda: [
            _with(r, {HEADER_TOTAL_SIZE: b"5"}) for r in chunk_records("bad", 1, b"abcdef", 3)
        ],
        "brings the message to 6 bytes, over its total size 5",
    ),
    "chunks-short-of-total": Bad(
        lambda: [
            _with(r, {HEADER_TOTAL_SIZE: b"7"}) for r in chunk_records("bad", 1, b"abcdef", 3)
        ],
        "is the last, but the chunks add up to 6 bytes, not the total size 7",
    ),
    "count-differs": Bad(
        lambda: [_with(chunk_records("bad", 1, b"abcdefghi", 3)[1], {HEADER_CHUNK_COUNT: b"4"})],
        "says uuid bad-1, 4 chunks, 9 bytes, but its chunks so far say uuid bad-1, 3 chunks",
        before=lambda: chunk_records("bad", 1, b"abcdefghi", 3)[:1],
    ),
    "skips-ahead": Bad(
        lambda: chunk_records("bad", 1, b"abcdefghi", 3)[2:],
        "skips ahead: the next chunk is 1",
        before=lambda: chunk_records("bad", 1, b"abcdefghi", 3)[:1],
        code=NOT_ENOUGH_REPLICAS,
    ),
    "starts-past-chunk-0": Bad(
        lambda: chunk_records("bad", 1, b"abcdefghi", 3)[1:],
        "skips ahead: the message's chunk 0 was never accepted",
        code=NOT_ENOUGH_REPLICAS,
    ),
    "whole-record-for-a-chunked-sequence": Bad(
        lambda: [(b"w", chunk_records("bad", 1, b"abcdef", 3)[0][1][:2])],
        "a record without chunk headers has sequence 1, which is the chunked message bad-1",
        before=lambda: chunk_records("bad", 1, b"abcdef", 3)[:1],
    ),
    "chunk-without-identity": Bad(
        lambda: [(b"abc", chunk_records("bad", 1, b"abcdef", 3)[0][1][2:])],
        "has chunk headers but no dedup.producer/dedup.sequence",
    ),
}


def _with(
    record: tuple[bytes, list[tuple[bytes, bytes]]], changes: dict[str, bytes | None]
) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    value, headers = record
    kept = [(n, v) for n, v in headers if n.decode() not in changes]
    return value, kept + [(n.encode(), v) for n, v in changes.items() if v is not None]


@pytest.mark.parametrize("kind", sorted(BAD_CHUNKS))
def test_bad_chunks_are_refused_precisely_and_nothing_is_written(
    running: ProxyProcess, local_env: EnvInfo, kind: str
) -> None:
    topic = new_topic(local_env.bootstrap)
    bad = BAD_CHUNKS[kind]
    before = [whole("ok", 0, b"first"), *(bad.before() if bad.before else [])]
    assert_ok(send_raw(running, topic, before))
    answer = send_raw(
        running,
        topic,
        [whole("ok", 1, b"fine"), *bad.records()],
    )
    assert answer.error_code == bad.code, answer
    assert bad.words in (answer.error_message or ""), answer.error_message
    assert len(read_all(local_env.bootstrap, topic)) == len(before), "nothing written"


def test_a_chunk_that_arrived_before_its_predecessor_goes_in_on_retry(
    running: ProxyProcess, local_env: EnvInfo
) -> None:
    """As when the request holding chunk 0 was refused (its partition was recovering) and
    the pipelined request holding chunk 1 was checked first: chunk 1 is not written but
    retriable, and goes in once chunk 0 has."""
    topic = new_topic(local_env.bootstrap)
    records = chunk_records("early", 4, b"abcdefghi", 3)
    refused = send_raw(running, topic, records[1:2])
    assert refused.error_code == NOT_ENOUGH_REPLICAS, refused
    for record in records:  # the client's retry: everything from chunk 0, in order
        assert_ok(send_raw(running, topic, [record]))
    assert chunk_ids(local_env.bootstrap, topic) == [("early", 4, i) for i in range(3)]
    (message,) = assembled(local_env.bootstrap, topic)
    assert message.value == b"abcdefghi"


# ----------------------------------------------------------------------------- crashes


def _kill_mid_message(
    proxy: RestartableProxy,
    local_env: EnvInfo,
    *,
    snapshot_after: int | None,
    sent: int,
    flush_redis: bool,
    replayed: int,
) -> None:
    """Chunks 0..sent-1 of a 5-chunk message go in (a snapshot taken after chunk
    ``snapshot_after``), the proxy is killed with -9 (and Redis flushed), a restarted
    proxy recovers (replaying ``replayed`` records after the snapshot), and the producer
    re-sends the whole message: each chunk once."""
    topic = new_topic(local_env.bootstrap)
    first = proxy.start()
    value = payload(4 * CHUNK + 1234, seed=-1)
    records = chunk_records("crash", 3, value, CHUNK)
    assert_ok(send_raw(first, topic, [whole("crash", 2, b"before")]))
    # A snapshot before the chunks: no automatic one is due for a while after it.
    admin_call(first, "POST", f"/v1/topics/{topic}/partitions/0/snapshot")
    for chunk_id in range(sent):
        assert_ok(send_raw(first, topic, [records[chunk_id]]))
        if chunk_id == snapshot_after:
            admin_call(first, "POST", f"/v1/topics/{topic}/partitions/0/snapshot")
    assert last_sequence_id(first, topic, "crash") == 2, "sequence 3 is not complete"
    proxy.kill()
    if flush_redis:
        redis.Redis.from_url(proxy.redis_url).flushdb()
    second = proxy.start()
    assert last_sequence_id(second, topic, "crash") == 2
    producer = DedupProducer(second.bootstrap, "crash", chunk_size=CHUNK)
    producer.send(topic, value, sequence_id=3, partition=0)
    producer.send(topic, b"after", sequence_id=4, partition=0)
    assert producer.flush(60) == 0
    assert chunk_ids(local_env.bootstrap, topic) == [
        ("crash", 2, -1),
        *(("crash", 3, i) for i in range(5)),
        ("crash", 4, -1),
    ]
    assert [(m.sequence, m.value) for m in assembled(local_env.bootstrap, topic)] == [
        (2, b"before"),
        (3, value),
        (4, b"after"),
    ]
    assert last_sequence_id(second, topic, "crash") == 4
    (line,) = [line for line in proxy.log_lines('"partition recovered"') if topic in line][-1:]
    assert '"chunked_in_progress": 1' in line, line
    assert f'"replayed": {replayed},' in line, line


def test_killed_mid_message_recovers_from_the_snapshot(
    chunk_proxy: RestartableProxy, local_env: EnvInfo
) -> None:
    _kill_mid_message(
        chunk_proxy, local_env, snapshot_after=2, sent=3, flush_redis=False, replayed=0
    )


def test_killed_mid_message_with_redis_flushed_recovers_by_replay(
    chunk_proxy: RestartableProxy, local_env: EnvInfo
) -> None:
    _kill_mid_message(
        chunk_proxy, local_env, snapshot_after=None, sent=2, flush_redis=True, replayed=2
    )


def test_killed_mid_message_replay_continues_the_snapshot(
    chunk_proxy: RestartableProxy, local_env: EnvInfo
) -> None:
    # Chunks 0-1 in the snapshot, 2-3 only in the log: the bytes so far must add up.
    _kill_mid_message(
        chunk_proxy, local_env, snapshot_after=1, sent=4, flush_redis=True, replayed=2
    )


# ----------------------------------------------------------------------------- the Lua rule


@dataclass
class Model:
    """The check on (sequence, chunk id) in Python, from `dedup.chunks`' rule functions:
    what ``check.lua`` / ``persist.lua`` / ``reset.lua`` must do."""

    pushed: dict[str, int] = field(default_factory=dict)
    pushed_chunk: dict[str, ChunkProgress] = field(default_factory=dict)
    persisted: dict[str, int] = field(default_factory=dict)
    persisted_chunk: dict[str, ChunkProgress] = field(default_factory=dict)

    @staticmethod
    def _pos(seq: int | None, chunk: ChunkProgress | None) -> tuple[int, int] | None:
        if chunk is not None:
            return chunk.position
        return None if seq is None else (seq, LAST)

    def pushed_pos(self, p: str) -> tuple[int, int] | None:
        return self._pos(self.pushed.get(p), self.pushed_chunk.get(p))

    def persisted_pos(self, p: str) -> tuple[int, int] | None:
        return self._pos(self.persisted.get(p), self.persisted_chunk.get(p))

    def check(self, records: list[tuple[str, int, ChunkMeta | None, int]]) -> Any:
        before = {p: self.pushed_pos(p) for p, *_ in records}
        pushed, chunks = dict(self.pushed), dict(self.pushed_chunk)
        statuses, sizes, refused = [], [], False
        for index, (p, s, meta, size) in enumerate(records):
            cur = chunks.get(p)
            rec = position(s, meta)
            now = self._pos(pushed.get(p), cur)
            out = None
            try:
                if meta is not None:
                    check_consistent(cur, s, meta)
                if now is None or rec > now:
                    status = Status.NOT_DUP
                    if meta is None:
                        accept_whole(cur, s)
                        after = None
                    else:
                        after = accept_chunk(cur, s, meta, size)
                    if after is None:
                        pushed[p] = s
                        chunks.pop(p, None)
                    else:
                        chunks[p] = after
                        out = after.size
                else:
                    done = self.persisted_pos(p)
                    earlier = before[p]  # raised by an earlier record of this batch: Dup
                    if (done is not None and rec <= done) or earlier is None or rec > earlier:
                        status = Status.DUP
                    else:
                        status, refused = Status.UNKNOWN, True
            except ChunkError as exc:
                return ("bad", index, str(exc))
            statuses.append(status)
            sizes.append(out)
        if not refused:
            self.pushed, self.pushed_chunk = pushed, chunks
        return (tuple(statuses), tuple(sizes))

    def persist(self, p: str, value: Persisted) -> None:
        pos = value.position if isinstance(value, ChunkProgress) else (value, LAST)
        done = self.persisted_pos(p)
        if done is None or pos > done:
            if isinstance(value, ChunkProgress):
                self.persisted_chunk[p] = value
            else:
                self.persisted[p] = value
                self.persisted_chunk.pop(p, None)
        top, now = self.persisted_pos(p), self.pushed_pos(p)
        assert top is not None
        if now is None or top > now:
            if p in self.persisted and self.persisted[p] > self.pushed.get(
                p, self.persisted[p] - 1
            ):
                self.pushed[p] = self.persisted[p]
            if p in self.persisted_chunk:
                self.pushed_chunk[p] = self.persisted_chunk[p]
            else:
                self.pushed_chunk.pop(p, None)

    def reset(self) -> None:
        self.pushed, self.pushed_chunk = dict(self.persisted), dict(self.persisted_chunk)

    def state(self) -> dict[str, tuple[Any, ...]]:
        names = self.pushed.keys() | self.pushed_chunk.keys() | self.persisted.keys()
        return {
            p: (
                self.pushed.get(p),
                self.persisted.get(p),
                self.pushed_chunk.get(p),
                self.persisted_chunk.get(p),
            )
            for p in names | self.persisted_chunk.keys()
        }


metas = st.none() | st.builds(
    lambda uuid_text, count, chunk_id, total: ChunkMeta(uuid_text, chunk_id % count, count, total),
    st.sampled_from(["u", "v w"]),
    st.integers(1, 3),
    st.integers(0, 2),
    st.integers(0, 6),
)
record_st = st.tuples(st.sampled_from(["a", "b"]), st.integers(0, 3), metas, st.integers(0, 4))
operations = st.lists(
    st.one_of(
        st.tuples(st.just("check"), st.lists(record_st, min_size=1, max_size=4)),
        st.tuples(st.just("persist"), st.sampled_from(["a", "b"])),
        st.tuples(st.just("reset"), st.none()),
    ),
    min_size=1,
    max_size=12,
)


@pytest.fixture(scope="module")
def lua_state(local_env: EnvInfo) -> Iterator[tuple[asyncio.AbstractEventLoop, DedupState]]:
    loop = asyncio.new_event_loop()
    client = redis.asyncio.from_url(local_env.redis.rsplit("/", 1)[0] + f"/{REDIS_DB}")
    yield loop, DedupState(client, key_prefix=f"chunk-model-{uuid.uuid4().hex[:8]}")
    loop.run_until_complete(client.aclose())
    loop.close()


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(operations)
def test_the_lua_check_follows_the_python_chunk_rule(
    lua_state: tuple[asyncio.AbstractEventLoop, DedupState], ops: list[tuple[str, Any]]
) -> None:
    loop, state = lua_state
    topic = f"t{uuid.uuid4().hex[:10]}"
    model = Model()
    for op, arg in ops:
        if op == "check":
            records = [
                (p, s, meta, min(size, meta.total_size) if meta else 0) for p, s, meta, size in arg
            ]
            (verdict,) = loop.run_until_complete(
                state.check_and_push(
                    [
                        PartitionCheck(
                            topic,
                            0,
                            [(p, s) for p, s, _, _ in records],
                            chunks=[None if m is None else (m, size) for _, _, m, size in records],
                        )
                    ],
                    1,
                )
            )
            expected = model.check(records)
            if expected[0] == "bad":
                kinds = ("skips ahead", "is the last", "over its total", "says uuid", "without")
                event("bad: " + next(k for k in kinds if k in expected[2]))
                assert (verdict.bad_index, verdict.bad) == expected[1:]
            else:
                for status, size in zip(*expected, strict=True):
                    event(f"{status.name} {'chunk in progress' if size is not None else ''}")
                assert (verdict.statuses, verdict.sizes) == expected
        elif op == "persist":
            value = model.pushed_chunk.get(arg) or model.pushed.get(arg)
            if value is None:
                continue
            loop.run_until_complete(state.mark_persisted([(topic, 0, {arg: value})], 1))
            model.persist(arg, value)
        else:
            loop.run_until_complete(state.reset_pushed(topic, 0))
            model.reset()
        found = loop.run_until_complete(state.producers(topic, 0))
        tracked = {
            p: (s.pushed, s.persisted, s.pushed_chunk, s.persisted_chunk) for p, s in found.items()
        }
        assert {p: t for p, t in tracked.items() if t != (None,) * 4} == model.state()
        assert all(isinstance(s, ProducerState) for s in found.values())

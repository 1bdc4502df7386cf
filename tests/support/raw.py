"""The wire protocol spoken by hand: Produce requests built with kio, frames read off a
socket, and one Produce request sent to a proxy's broker listener."""

from __future__ import annotations

import datetime
import io
import socket
import struct
import time
from collections.abc import Mapping, Sequence
from typing import Any

import kio.schema.metadata.v12.request as metadata_v12
import kio.schema.produce.v9.request as produce_v9
import kio.schema.produce.v9.response as produce_v9_response
import zstandard
from crc32c import crc32c
from kafka.record.util import encode_varint
from kio.records.schema import NewRecordBatch, Record, RecordHeader
from kio.records.writers import write_new_batch
from kio.schema.types import TopicName
from kio.static.primitive import Records, TZAwareMicros, i8, i16, i32, i32Timedelta, i64

from deploy.launcher import ProxyProcess
from proxy.kafka.schemas import decode_response_body
from proxy.kafka.upstream_client import encode_request

Headers = Sequence[tuple[bytes, bytes]]

# The largest frame the pass-through test proxy (conftest `proxy`) accepts.
MAX_FRAME_BYTES = 8 * 1024 * 1024
NOT_LEADER_OR_FOLLOWER = 6


def record_batch(
    records: Sequence[tuple[bytes, Headers]], producer: tuple[int, int, int] = (-1, -1, -1)
) -> bytes:
    """One uncompressed batch of (value, headers) records; plain, or with `producer`'s id,
    epoch and base sequence, a Kafka idempotent producer's."""
    producer_id, producer_epoch, base_sequence = producer
    now = TZAwareMicros.parse(datetime.datetime.now(datetime.UTC).replace(microsecond=0))
    batch = io.BytesIO()
    write_new_batch(
        batch,
        NewRecordBatch(
            producer_id=i64(producer_id),
            producer_epoch=i16(producer_epoch),
            base_sequence=i32(base_sequence),
            attributes=i16(0),
            records=tuple(
                Record(
                    attributes=i8(0),
                    timestamp=now,
                    offset=i64(offset),
                    key=None,
                    value=value,
                    headers=tuple(RecordHeader(key=k, value=v) for k, v in headers),
                )
                for offset, (value, headers) in enumerate(records)
            ),
        ),
    )
    return batch.getvalue()


def bomb_batch(records: int = 1, value_size: int = 0, headers_per_record: int = 2) -> bytes:
    """A zstd batch that is small on the wire and huge once read: `records` records of a
    `value_size` value of zero bytes and `headers_per_record` headers, the first two the
    identity (producer ``bomb``, sequence = offset), the rest empty. Compressed as a stream,
    so building it never holds what it decompresses to."""
    compressor = zstandard.ZstdCompressor().compressobj()
    out = [b""]
    chunk = bytes(1 << 20)
    for offset in range(records):
        identity = [(b"dedup.producer", b"bomb"), (b"dedup.sequence", str(offset).encode())]
        headers = b"".join(
            _varint(len(k)) + k + _varint(len(v)) + v for k, v in identity[:headers_per_record]
        ) + (_varint(0) + _varint(-1)) * max(headers_per_record - 2, 0)
        head = b"\x00" + _varint(0) + _varint(offset) + _varint(-1) + _varint(value_size)
        tail = _varint(headers_per_record) + headers
        out.append(compressor.compress(_varint(len(head) + value_size + len(tail)) + head))
        left = value_size
        while left:
            out.append(compressor.compress(chunk[: min(left, len(chunk))]))
            left -= min(left, len(chunk))
        out.append(compressor.compress(tail))
    body = b"".join(out) + compressor.flush()
    now = int(time.time() * 1000)
    # attributes (zstd: 4), last offset delta, first and max timestamp, producer id, epoch,
    # base sequence, record count: what the CRC32C covers, with the records.
    covered = struct.pack(">hiqqqhii", 4, records - 1, now, now, -1, -1, -1, records) + body
    prefix = struct.pack(">qiibI", 0, 4 + 1 + 4 + len(covered), -1, 2, crc32c(covered))
    return prefix + covered


def _varint(value: int) -> bytes:
    """Kafka's zigzag varint."""
    out = bytearray()
    encode_varint(value, out.append)
    return bytes(out)


def damaged(batch: bytes) -> bytes:
    """The batch with its last byte changed: its CRC no longer matches."""
    return batch[:-1] + bytes([batch[-1] ^ 0xFF])


def identity_batch(identities: Sequence[tuple[bytes, bytes]], value_size: int = 0) -> bytes:
    """Records carrying dedup identity headers (raw bytes, so tests can send bad ones);
    each value is ``v<sequence>`` padded with ``value_size`` bytes."""
    return record_batch(
        [
            (
                b"v" + sequence + b"x" * value_size,
                [(b"dedup.producer", producer), (b"dedup.sequence", sequence)],
            )
            for producer, sequence in identities
        ]
    )


def idempotent_batch(
    values: Sequence[bytes], producer_id: int, producer_epoch: int, base_sequence: int
) -> bytes:
    """A Kafka idempotent producer's batch, no headers: implicit identities."""
    return record_batch([(v, []) for v in values], (producer_id, producer_epoch, base_sequence))


def explicit_batch(identities: Sequence[tuple[str, int]], value_size: int = 0) -> bytes:
    return identity_batch([(p.encode(), str(s).encode()) for p, s in identities], value_size)


def produce_request(
    topic: str, batches: Mapping[int, bytes], acks: int = -1
) -> produce_v9.ProduceRequest:
    """A Produce v9 request writing ``batches[partition]`` to each partition of ``topic``."""
    return produce_request_to({topic: batches}, acks)


def produce_request_to(
    topics: Mapping[str, Mapping[int, bytes]], acks: int = -1
) -> produce_v9.ProduceRequest:
    """A Produce v9 request writing ``topics[topic][partition]`` to each partition named."""
    return produce_v9.ProduceRequest(
        transactional_id=None,
        acks=i16(acks),
        timeout=i32Timedelta.parse(datetime.timedelta(seconds=30)),
        topic_data=tuple(
            produce_v9.TopicProduceData(
                name=TopicName(topic),
                partition_data=tuple(
                    produce_v9.PartitionProduceData(index=i32(partition), records=Records(data))
                    for partition, data in sorted(batches.items())
                ),
            )
            for topic, batches in topics.items()
        ),
    )


# ----------------------------------------------------------------------------- frames


def read_response(sock: socket.socket) -> bytes:
    """One response frame's payload (correlation id first)."""
    size = int.from_bytes(receive_exactly(sock, 4), "big")
    return receive_exactly(sock, size)


def receive_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError(f"closed after {len(data)} of {size} bytes")
        data += chunk
    return data


def correlation_id(payload: bytes) -> int:
    return int.from_bytes(payload[:4], "big", signed=True)


# ----------------------------------------------------------------------------- Metadata

METADATA = 3


def metadata_request() -> metadata_v12.MetadataRequest:
    """A Metadata v12 request for the brokers alone (no topics)."""
    return metadata_v12.MetadataRequest(
        topics=(), allow_auto_topic_creation=False, include_topic_authorized_operations=False
    )


def metadata_node_ids(port: int, host: str = "127.0.0.1") -> list[int] | None:
    """The node ids a `metadata_request` answer from ``host:port`` lists; None when nothing
    listens there."""
    try:
        sock = socket.create_connection((host, port), timeout=10)
    except ConnectionRefusedError:
        return None
    with sock:
        sock.sendall(encode_request(metadata_request(), 1))
        answer = decode_response_body(METADATA, 12, read_response(sock), 5)  # flexible header
    return sorted(int(broker.node_id) for broker in answer.brokers)


# ----------------------------------------------------------------------------- Produce


def produce_raw(proxy: ProxyProcess, request: produce_v9.ProduceRequest) -> Any:
    """Send one Produce request to the proxy's broker 0 listener; the partition's answer.
    Retried, as every client does, while the answer is NOT_LEADER_OR_FOLLOWER (the proxy
    recovers a partition's dedup state before its first write)."""
    deadline = time.monotonic() + 60
    while True:
        answer = _produce_once(proxy, request)
        if answer.error_code != NOT_LEADER_OR_FOLLOWER or time.monotonic() > deadline:
            return answer
        time.sleep(0.1)


def produce_once(proxy: ProxyProcess, request: produce_v9.ProduceRequest) -> Any:
    """Send one Produce request; the partition's answer, whatever it is (no retry)."""
    return _produce_once(proxy, request)


def _produce_once(proxy: ProxyProcess, request: produce_v9.ProduceRequest) -> Any:
    return next(iter(produce_answers(proxy, request).values()))


def produce_answers(
    proxy: ProxyProcess, request: produce_v9.ProduceRequest
) -> dict[tuple[str, int], Any]:
    """Send one Produce request (no retry); each partition's answer, by (topic, partition)."""
    port = proxy.broker_port()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(encode_request(request, 1))
        return _answers_of(read_response(sock))


def produce_pipelined(
    proxy: ProxyProcess, requests: Sequence[produce_v9.ProduceRequest]
) -> list[Any]:
    """Send the Produce requests on one connection, each before any answer is read (as a
    client pipelines them); the first partition's answer to each, in order. No retry."""
    port = proxy.broker_port()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(b"".join(encode_request(r, n) for n, r in enumerate(requests, 1)))
        frames = [read_response(sock) for _ in requests]
    assert [correlation_id(f) for f in frames] == list(range(1, len(requests) + 1))
    return [first_answer(frame) for frame in frames]


def first_answer(frame: bytes) -> Any:
    """The first partition's answer in a Produce v9 response frame."""
    return next(iter(_answers_of(frame).values()))


def _answers_of(frame: bytes) -> dict[tuple[str, int], Any]:
    response = decode_response_body(0, 9, frame, 5)  # v9: flexible header, no tagged fields
    assert isinstance(response, produce_v9_response.ProduceResponse)
    return {
        (topic.name, answer.index): answer
        for topic in response.responses
        for answer in topic.partition_responses
    }

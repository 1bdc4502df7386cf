"""A confluent-kafka Consumer that hands out chunked messages whole (`dedup.chunks`).

    from dedup.chunked_consumer import ChunkedConsumer

    consumer = ChunkedConsumer({"bootstrap.servers": "kafka:9092", "group.id": "loader"})
    consumer.subscribe(["orders"])
    while (message := consumer.poll(1.0)) is not None or running:
        if message is not None:
            handle(message.value)
            consumer.commit()

Records without chunk headers come out as they are; chunks are fed to a `Reassembler`
(bounded buffer, expiry, duplicate tolerance) and come out as one message once complete.
Offsets are committed only by `commit`, and never past the first chunk of a message still
incomplete, so a restarted consumer reads its chunks again instead of losing the message.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import structlog
from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from dedup.batches import DEFAULT_HEADERS, IdentityHeaders
from dedup.chunks import (
    CHUNK_HEADERS,
    DEFAULT_EXPIRE_AFTER_MS,
    DEFAULT_MAX_BUFFER_BYTES,
    ChunkError,
    Reassembler,
    ReassemblyStats,
    parse_chunk_headers,
)
from dedup.replay import record_identity

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class ConsumedMessage:
    """A record, or a chunked message put back together."""

    topic: str
    partition: int
    offset: int  # of the record, or of the message's last chunk
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes | None], ...]  # the first chunk's, without chunk headers
    timestamp_ms: int
    producer: str | None  # the dedup identity, when the record has one
    sequence: int | None
    chunk_count: int = 0  # 0: not a chunked message


class ChunkedConsumer:
    def __init__(
        self,
        config: Mapping[str, Any],
        *,
        max_buffer_bytes: int = DEFAULT_MAX_BUFFER_BYTES,
        expire_after_ms: int = DEFAULT_EXPIRE_AFTER_MS,
        headers: IdentityHeaders = DEFAULT_HEADERS,
    ) -> None:
        self.consumer = Consumer({"enable.auto.commit": False, **config})
        self.reassembler = Reassembler(max_buffer_bytes, expire_after_ms)
        self._names = headers
        self._streams: dict[tuple[str, int], int] = {}  # (topic, partition) -> reassembler key
        self._consumed: dict[tuple[str, int], int] = {}  # next offset, per partition

    @property
    def stats(self) -> ReassemblyStats:
        return self.reassembler.stats

    def subscribe(self, topics: Sequence[str]) -> None:
        self.consumer.subscribe(list(topics))

    def assign(self, partitions: Sequence[TopicPartition]) -> None:
        self.consumer.assign(list(partitions))

    def poll(self, timeout: float = 1.0) -> ConsumedMessage | None:
        """The next record or complete chunked message; None when none came within
        ``timeout`` seconds. Raises KafkaException for a consumer error (partition EOF
        events are skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            message = self.consumer.poll(max(remaining, 0))
            if message is None:
                self.reassembler.expire()
                if remaining <= 0:
                    return None
                continue
            error = message.error()
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF:
                    continue
                raise KafkaException(error)
            result = self._take(message)
            if result is not None:
                return result
            if time.monotonic() >= deadline:
                return None

    def _take(self, message: Message) -> ConsumedMessage | None:
        topic, partition, offset = message.topic(), message.partition(), message.offset()
        assert topic is not None and partition is not None and offset is not None
        self._consumed[(topic, partition)] = offset + 1
        raw_headers: Any = message.headers() or ()  # confluent-kafka: [(str, bytes | None)]
        headers: tuple[tuple[str, bytes | None], ...] = tuple(raw_headers)
        identity = record_identity(headers, self._names)
        stream = self._streams.setdefault((topic, partition), len(self._streams))
        try:
            meta = parse_chunk_headers(headers)
        except ChunkError as exc:
            log.warning("record with bad chunk headers passed on as it is", error=str(exc))
            meta = None
        if meta is None or identity is None:
            if identity is not None:  # a whole record: earlier incomplete ones are abandoned
                self.reassembler.add_whole(*identity, partition=stream)
            return self._consumed_message(message, message.value(), headers, identity, 0)
        producer, sequence = identity
        assembled = self.reassembler.add(
            producer,
            sequence,
            meta.uuid,
            meta.chunk_id,
            meta.chunk_count,
            meta.total_size,
            message.value() or b"",
            partition=stream,
            context=(offset, message.key(), headers, message.timestamp()[1]),
        )
        if assembled is None:
            return None
        _, key, first_headers, timestamp = assembled.contexts[0]
        plain = tuple((n, v) for n, v in first_headers if n not in CHUNK_HEADERS)
        return ConsumedMessage(
            topic,
            partition,
            offset,
            key,
            assembled.value,
            plain,
            timestamp,
            producer,
            sequence,
            assembled.chunk_count,
        )

    def _consumed_message(
        self,
        message: Message,
        value: bytes | None,
        headers: tuple[tuple[str, bytes | None], ...],
        identity: tuple[str, int] | None,
        chunk_count: int,
    ) -> ConsumedMessage:
        topic, partition, offset = message.topic(), message.partition(), message.offset()
        assert topic is not None and partition is not None and offset is not None
        return ConsumedMessage(
            topic,
            partition,
            offset,
            message.key(),
            value,
            headers,
            message.timestamp()[1],
            None if identity is None else identity[0],
            None if identity is None else identity[1],
            chunk_count,
        )

    def safe_offsets(self) -> list[TopicPartition]:
        """Per consumed partition, the offset to commit: the next one to read, or the first
        chunk of the oldest message still incomplete there."""
        first: dict[int, int] = {}
        for pending in self.reassembler.pending():
            offset = pending.first_context[0]
            first[pending.partition] = min(first.get(pending.partition, offset), offset)
        return [
            TopicPartition(
                topic, partition, min(end, first.get(self._streams[(topic, partition)], end))
            )
            for (topic, partition), end in sorted(self._consumed.items())
        ]

    def commit(self) -> None:
        """Commit `safe_offsets` (synchronously)."""
        offsets = self.safe_offsets()
        if offsets:
            self.consumer.commit(offsets=offsets, asynchronous=False)

    def close(self) -> None:
        self.consumer.close()

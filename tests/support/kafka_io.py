"""Reading topics back, straight from Kafka or through a proxy, and checking what they hold."""

from __future__ import annotations

import itertools
import time
import uuid
from typing import Any

from confluent_kafka import Consumer, Message, TopicPartition


def read_all(
    bootstrap: str, topic: str, partition: int = 0, **config: str
) -> list[tuple[bytes, dict[str, bytes]]]:
    """Every record of the partition, read straight from Kafka: (value, headers).
    ``config``: more consumer settings (security)."""
    return [
        (message.value(), dict(message.headers() or []))
        for message in read_messages(bootstrap, topic, partition, **config)
    ]


def read_messages(bootstrap: str, topic: str, partition: int = 0, **config: str) -> list[Message]:
    """Every record of the partition, read straight from Kafka, as the consumer gives it."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"r-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            **config,
        }
    )
    try:
        _, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=30)
        consumer.assign([TopicPartition(topic, partition, 0)])
        messages: list[Message] = []
        deadline = time.monotonic() + 60
        # Offsets are not all records: the proxy's fence leaves transaction markers.
        while time.monotonic() < deadline:
            (position,) = consumer.position([TopicPartition(topic, partition)])
            if position.offset >= high:
                break
            for message in consumer.consume(1000, 0.5):
                assert message.error() is None, message.error()
                messages.append(message)
        return messages
    finally:
        consumer.close()


class DeliveryReports:
    """A producer's delivery callback that keeps every report: the offset each names, by
    the message's value (None: no offset), and the errors."""

    def __init__(self) -> None:
        self.offsets: dict[bytes, int | None] = {}
        self.errors: list[Any] = []

    def __call__(self, error: Any, message: Message) -> None:
        if error is not None:
            self.errors.append(error)
        self.offsets[message.value()] = message.offset()


def offsets_by_value(bootstrap: str, topic: str, **config: str) -> dict[bytes, int]:
    """Each record's offset in the partition, by its value (values unique). ``config``:
    more consumer settings (security)."""
    return {
        message.value(): message.offset() for message in read_messages(bootstrap, topic, **config)
    }


def values(bootstrap: str, topic: str) -> list[bytes]:
    return [value for value, _ in read_all(bootstrap, topic)]


def end_offset(bootstrap: str, topic: str, partition: int = 0, **config: str) -> int:
    """The partition's high watermark: the offset the next write gets (``config``: more
    consumer settings, security)."""
    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": f"e-{uuid.uuid4().hex}", **config}
    )
    try:
        _, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=30)
        return int(high)
    finally:
        consumer.close()


def assert_exactly_once_in_order(written: list[bytes], total: int) -> None:
    """The topic holds 0..total-1, each once, in order; else say what is wrong, briefly."""
    numbers = [int(v) for v in written]
    seen: set[int] = set()
    duplicates = [n for n in numbers if n in seen or seen.add(n)]  # type: ignore[func-returns-value]
    missing = sorted(set(range(total)) - seen)
    jumps = [(a, b) for a, b in itertools.pairwise(numbers) if b != a + 1]
    assert (duplicates, missing[:20], jumps[:20]) == ([], [], []), (
        f"{len(duplicates)} duplicates {duplicates[:10]}, {len(missing)} missing, "
        f"{len(jumps)} jumps"
    )


def consume_confluent(
    bootstrap: str, topic: str, count: int, group: str | None = None
) -> list[Message]:
    """Up to ``count`` messages from the start of the topic, read as a consumer group member
    (the group's offsets committed when ``group`` is given)."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": group or f"g-{uuid.uuid4().hex[:8]}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    consumer.subscribe([topic])
    messages: list[Message] = []
    try:
        for _ in range(600):
            if len(messages) >= count:
                break
            for message in consumer.consume(500, timeout=0.5):
                assert message.error() is None, message.error()
                messages.append(message)
        if group is not None:
            consumer.commit(asynchronous=False)
    finally:
        consumer.close()
    return messages


def consume(bootstrap: str, topic: str, count: int, timeout: float = 60.0) -> list[str]:
    """Up to ``count`` values from the start of the topic, decoded."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"local-env-test-{uuid.uuid4().hex[:12]}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    consumer.subscribe([topic])
    values: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while len(values) < count and time.monotonic() < deadline:
            msg = consumer.poll(1.0)
            if msg is None:
                continue
            assert msg.error() is None, msg.error()
            values.append(msg.value().decode())
    finally:
        consumer.close()
    return values

"""Topic set-up and an independent count of what a topic holds (read with librdkafka, not
Spark, so the two counts check each other)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import cast

from confluent_kafka import Consumer, TopicPartition

from dedup.batches import HEADER_PRODUCER, HEADER_SEQUENCE
from deploy.topics import create_topic as create_topic  # re-exported for the scenario


@dataclass(frozen=True)
class TopicCount:
    records: int
    distinct: int  # distinct (producer, sequence)
    # (partition, offset) -> (producer, sequence) of each record: what a report names
    identities: dict[tuple[int, int], tuple[bytes | None, bytes | None]] = field(
        default_factory=dict
    )

    @property
    def duplicates(self) -> int:
        return self.records - self.distinct


def count_topic(bootstrap: str, topic: str, timeout_s: float = 300.0) -> TopicCount:
    """Every data record of every partition, up to the end it has now, and the identity
    each offset holds. Offsets taken by transaction markers (the proxy's fences) are not
    records and are not counted."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": "dedup-demo-count",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "isolation.level": "read_uncommitted",
        }
    )
    try:
        metadata = consumer.list_topics(topic, timeout=30).topics[topic]
        ends: dict[int, int] = {}
        for partition in metadata.partitions:
            _, ends[partition] = consumer.get_watermark_offsets(
                TopicPartition(topic, partition), timeout=30
            )
        consumer.assign([TopicPartition(topic, p, 0) for p in ends])
        positions = dict.fromkeys(ends, 0)
        at: dict[tuple[int, int], tuple[bytes | None, bytes | None]] = {}
        records = 0
        deadline = time.monotonic() + timeout_s
        while any(positions[p] < ends[p] for p in ends):
            if time.monotonic() > deadline:
                raise TimeoutError(f"count of {topic} stopped at {positions} of {ends}")
            for message in consumer.consume(1000, 0.5):
                partition, offset = message.partition() or 0, message.offset() or 0
                if message.error() is not None:  # end of partition: its offset is the end
                    positions[partition] = max(positions[partition], offset)
                    continue
                positions[partition] = offset + 1
                if offset >= ends[partition]:
                    continue  # written after the count began
                records += 1
                producer = sequence = None
                # A consumed message's headers are a list of (name, value) pairs.
                headers = cast(list[tuple[str, bytes | None]], message.headers() or [])
                for name, value in headers:
                    if name == HEADER_PRODUCER:
                        producer = value
                    elif name == HEADER_SEQUENCE:
                        sequence = value
                at[(partition, offset)] = (producer, sequence)
        return TopicCount(records=records, distinct=len(set(at.values())), identities=at)
    finally:
        consumer.close()

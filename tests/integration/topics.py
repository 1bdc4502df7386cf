"""Fresh topics for tests, usable the moment they are returned."""

from __future__ import annotations

import time
import uuid

from confluent_kafka import Consumer, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic


def new_topic(
    bootstrap: str,
    config: dict[str, str] | None = None,
    partitions: int = 1,
    replication_factor: int = -1,
) -> str:
    """A fresh topic, returned once every partition's leader serves it."""
    name = f"t-{uuid.uuid4().hex[:12]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    topic = NewTopic(
        name, num_partitions=partitions, replication_factor=replication_factor, config=config or {}
    )
    admin.create_topics([topic])[name].result(30)
    deadline = time.monotonic() + 30
    while True:  # the broker learns of new partitions a moment after the controller
        found = admin.list_topics(name, timeout=30).topics[name]
        if len(found.partitions) == partitions and all(
            p.leader >= 0 and p.error is None for p in found.partitions.values()
        ):
            break
        assert time.monotonic() < deadline, f"{name} has no leaders yet"
        time.sleep(0.1)
    probe = Consumer({"bootstrap.servers": bootstrap, "group.id": "probe"})
    try:  # ListOffsets answers only once each leader serves its partition
        for partition in range(partitions):
            while True:
                try:
                    probe.get_watermark_offsets(TopicPartition(name, partition), timeout=5)
                    break
                except KafkaException:
                    assert time.monotonic() < deadline, f"{name}/{partition} is not served"
                    time.sleep(0.1)
    finally:
        probe.close()
    return name

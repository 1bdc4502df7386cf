"""Reading as a consumer in a rack (KIP-392): which replica, and so which node, served it."""

from __future__ import annotations

import json
import time
import uuid

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition


def read_as_rack(
    bootstrap: str, topic: str, count: int, rack: str, **config: str
) -> tuple[list[bytes], int]:
    """Partition 0 of the topic read from the start by a consumer in ``rack``: the values,
    and the node librdkafka says it fetched them from last (its statistics). ``config``:
    more consumer settings (security)."""
    fetched_from: list[int] = []

    def on_stats(text: str) -> None:
        partition = json.loads(text)["topics"].get(topic, {}).get("partitions", {}).get("0")
        if partition is not None and partition["broker"] >= 0:
            fetched_from.append(int(partition["broker"]))

    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"rack-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
            "client.rack": rack,
            "statistics.interval.ms": 200,
            "stats_cb": on_stats,
            **config,
        }
    )
    consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
    read: list[bytes] = []
    try:
        deadline = time.monotonic() + 60
        while len(read) < count and time.monotonic() < deadline:
            for message in consumer.consume(500, timeout=0.5):
                assert message.error() is None, message.error()
                read.append(message.value())
        consumer.consume(1, timeout=0.5)  # one more round of statistics after the last fetch
    finally:
        consumer.close()
    assert fetched_from, "librdkafka reported statistics"
    return read, fetched_from[-1]

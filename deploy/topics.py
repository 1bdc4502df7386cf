"""Topic creation and deletion for the lab (demo, chaos runs, benchmarks, tests): a topic is
returned only once every partition's leader serves it, so the first write or read does not
race it; a deletion returns once the controller took it."""

from __future__ import annotations

import time
import uuid

from confluent_kafka import Consumer, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic


def create_topic(
    bootstrap: str,
    name: str | None = None,
    partitions: int = 1,
    replication_factor: int = -1,
    config: dict[str, str] | None = None,
    timeout_s: float = 60.0,
    client_config: dict[str, str] | None = None,
) -> str:
    """Create a topic (``t-<random>`` when no name is given) and return its name once every
    partition has a leader that answers ListOffsets for it; `TimeoutError` otherwise.
    ``replication_factor`` -1 is the broker's default; ``client_config``: librdkafka
    settings of the clients that do it (security)."""
    name = name or f"t-{uuid.uuid4().hex[:12]}"
    admin = AdminClient({"bootstrap.servers": bootstrap, **(client_config or {})})
    topic = NewTopic(
        name, num_partitions=partitions, replication_factor=replication_factor, config=config or {}
    )
    admin.create_topics([topic])[name].result(timeout_s)
    deadline = time.monotonic() + timeout_s
    while not _has_leaders(admin, name, partitions):  # metadata lags the creation a moment
        if time.monotonic() > deadline:
            raise TimeoutError(f"topic {name} got no leaders within {timeout_s}s")
        time.sleep(0.1)
    probe = Consumer({"bootstrap.servers": bootstrap, "group.id": "probe", **(client_config or {})})
    try:  # ListOffsets answers only once each leader serves its partition
        for partition in range(partitions):
            while True:
                try:
                    probe.get_watermark_offsets(TopicPartition(name, partition), timeout=5)
                    break
                except KafkaException as exc:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{name}/{partition} is not served") from exc
                    time.sleep(0.1)
    finally:
        probe.close()
    return name


def delete_topic(
    bootstrap: str,
    name: str,
    timeout_s: float = 30.0,
    client_config: dict[str, str] | None = None,
) -> None:
    """Delete a topic and wait until the controller took the deletion (its error, if it
    refused, raised). Not waited for, the request may never leave the admin client: a
    chaos run's topics then pile up on disk (some 200 MB a run of a million messages)."""
    admin = AdminClient({"bootstrap.servers": bootstrap, **(client_config or {})})
    admin.delete_topics([name], operation_timeout=timeout_s)[name].result(timeout_s)


def _has_leaders(admin: AdminClient, name: str, partitions: int) -> bool:
    found = admin.list_topics(name, timeout=10).topics.get(name)
    return (
        found is not None
        and found.error is None
        and len(found.partitions) == partitions
        and all(p.leader >= 0 and p.error is None for p in found.partitions.values())
    )

"""The snapshot store (`dedup.snapshots`) against a real Kafka: the compacted topic, two slots
per data partition, falling back past a corrupt record, a missing topic, key placement over
several partitions, and a snapshot far larger than Kafka's default message size."""

from __future__ import annotations

import asyncio
import time
import uuid
import zlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace

import pytest
import pytest_asyncio
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType
from structlog.testing import capture_logs

from dedup.snapshots import (
    MAX_SNAPSHOT_BYTES,
    ProducerEntry,
    Snapshot,
    SnapshotError,
    SnapshotStore,
    StoredSnapshots,
    slot_key,
    snapshot_partition,
)
from deploy.local import EnvInfo
from tests.support.topics import new_topic

pytestmark = pytest.mark.integration

TIMEOUT_S = 20.0


def snapshot(generation: int, topic: str = "orders", partition: int = 0, **extra: int) -> Snapshot:
    return Snapshot(
        topic=topic,
        partition=partition,
        offset=100 * generation,
        created_ms=1_700_000_000_000 + generation,
        generation=generation,
        producers={
            "loader": ProducerEntry(generation, 1000 + generation),
            "ünïcode ✓": ProducerEntry(-(2**63), 5),
            "max": ProducerEntry(2**63 - 1, 6),
            **{f"extra-{i}": ProducerEntry(i, i) for i in range(extra.get("extra", 0))},
        },
    )


def admin(env: EnvInfo) -> AdminClient:
    # allow.auto.create.topics=false: a metadata request must not create what it asks about.
    # Keep the client referenced until its futures are done: a collected AdminClient fails
    # them with _DESTROY.
    return AdminClient({"bootstrap.servers": env.bootstrap, "allow.auto.create.topics": False})


def delete_topic(env: EnvInfo, name: str) -> None:
    client = admin(env)
    client.delete_topics([name])[name].result(30)


def topic_exists(env: EnvInfo, name: str) -> bool:
    return name in admin(env).list_topics(timeout=10).topics


def topic_configs(env: EnvInfo, name: str) -> dict[str, str]:
    resource = ConfigResource(ResourceType.TOPIC, name)
    client = admin(env)
    entries = client.describe_configs([resource])[resource].result(30)
    return {key: entry.value for key, entry in entries.items()}


def produce_raw(
    env: EnvInfo, topic: str, partition: int, key: bytes | None, value: bytes | None
) -> None:
    """A record written behind the store's back."""
    producer = Producer({"bootstrap.servers": env.bootstrap, "allow.auto.create.topics": False})
    errors: list[object] = []
    producer.produce(
        topic, value=value, key=key, partition=partition, on_delivery=lambda e, _: errors.append(e)
    )
    assert producer.flush(30) == 0
    assert errors == [None]


def consume_all(env: EnvInfo, topic: str, partitions: int) -> list[tuple[int, bytes | None]]:
    """(partition, key) of every record of the topic."""
    consumer = Consumer(
        {"bootstrap.servers": env.bootstrap, "group.id": "test", "enable.auto.commit": False}
    )
    try:
        ends = {
            p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
            for p in range(partitions)
        }
        consumer.assign([TopicPartition(topic, p, 0) for p, end in ends.items() if end > 0])
        seen: list[tuple[int, bytes | None]] = []
        while len(seen) < sum(ends.values()):
            message = consumer.poll(10)
            assert message is not None, f"only {len(seen)} of {sum(ends.values())} records"
            assert message.error() is None, message.error()
            partition = message.partition()
            assert partition is not None
            seen.append((partition, message.key()))
        return seen
    finally:
        consumer.close()


@pytest.fixture
def snapshot_topic(local_env: EnvInfo) -> Iterator[str]:
    """A fresh snapshot-topic name, deleted afterwards if it was created."""
    name = f"snapshots-{uuid.uuid4().hex[:12]}"
    yield name
    if topic_exists(local_env, name):
        delete_topic(local_env, name)


@pytest_asyncio.fixture
async def store(local_env: EnvInfo, snapshot_topic: str) -> AsyncIterator[SnapshotStore]:
    """A store whose topic exists."""
    store = SnapshotStore(local_env.bootstrap, snapshot_topic, timeout_s=TIMEOUT_S)
    await store.ensure_topic()
    yield store
    await store.close()


async def test_ensure_topic_creates_a_compacted_topic_once(
    local_env: EnvInfo, snapshot_topic: str
) -> None:
    stores = [
        SnapshotStore(local_env.bootstrap, snapshot_topic, partitions=3, timeout_s=TIMEOUT_S)
        for _ in range(3)
    ]
    try:
        # Three proxies starting at once: one creates the topic, the others find it.
        await asyncio.gather(*(s.ensure_topic() for s in stores))
        await stores[0].ensure_topic()
    finally:
        await asyncio.gather(*(s.close() for s in stores))
    configs = topic_configs(local_env, snapshot_topic)
    assert configs["cleanup.policy"] == "compact"
    assert configs["max.message.bytes"] == str(MAX_SNAPSHOT_BYTES)
    assert configs["min.insync.replicas"] == "1"  # one broker: replication factor 1
    assert configs["segment.ms"] == "3600000"
    assert float(configs["min.cleanable.dirty.ratio"]) < 0.5
    metadata = admin(local_env).list_topics(snapshot_topic, timeout=10).topics[snapshot_topic]
    assert len(metadata.partitions) == 3
    assert all(len(p.replicas) == 1 for p in metadata.partitions.values())


async def test_an_existing_topic_is_left_as_it_is(local_env: EnvInfo) -> None:
    name = new_topic(local_env.bootstrap, partitions=2)  # cleanup.policy=delete
    store = SnapshotStore(local_env.bootstrap, name, partitions=5, timeout_s=TIMEOUT_S)
    try:
        with capture_logs() as logs:
            await store.ensure_topic()
        assert topic_configs(local_env, name)["cleanup.policy"] == "delete"
        warnings = [e for e in logs if e["log_level"] == "warning"]
        assert [e["cleanup_policy"] for e in warnings] == ["delete"]
        # The topic's own partition count places keys, not the constructor's.
        await store.write(snapshot(0, "orders", 9))
        expected = snapshot_partition("orders", 9, 2)
        assert consume_all(local_env, name, 2) == [(expected, b"orders/9/0")]
    finally:
        await store.close()
        delete_topic(local_env, name)


async def test_three_generations_leave_the_newest_of_each_slot(store: SnapshotStore) -> None:
    for generation in range(3):
        await store.write(snapshot(generation))
    await store.write(snapshot(5, partition=1))
    found = await store.read([("orders", 0), ("orders", 1), ("orders", 2), ("orders", 0)])
    # Compaction has not run: the log still holds generation 0, which slot 0 outgrew.
    assert found == {
        ("orders", 0): StoredSnapshots(valid=(snapshot(2), snapshot(1)), corrupt=()),
        ("orders", 1): StoredSnapshots(valid=(snapshot(5, partition=1),), corrupt=()),
        ("orders", 2): StoredSnapshots(),
    }
    assert found["orders", 0].newest == snapshot(2)
    assert found["orders", 2].newest is None
    assert await store.read([]) == {}


async def test_a_corrupt_newest_snapshot_falls_back_to_the_other_slot(
    local_env: EnvInfo, store: SnapshotStore
) -> None:
    await store.write(snapshot(1))
    await store.write(snapshot(2))
    topic = store.topic
    produce_raw(local_env, topic, 0, b"orders/0/0", b"DDS1{garbage")
    with capture_logs() as logs:
        found = await store.read([("orders", 0)])
    assert found["orders", 0].valid == (snapshot(1),)
    [description] = found["orders", 0].corrupt
    assert description.startswith(f"{topic}[0]@2 key b'orders/0/0': snapshot body is not valid")
    assert any(e["event"] == "corrupt snapshot record" for e in logs)

    # A snapshot of another partition under this key is as wrong as garbage.
    produce_raw(local_env, topic, 0, b"orders/0/0", snapshot(4, partition=7).encode())
    [description] = (await store.read([("orders", 0)]))["orders", 0].corrupt
    assert description.endswith("holds the snapshot of orders/7")
    # So is a generation in the other generation's slot.
    produce_raw(local_env, topic, 0, b"orders/0/0", snapshot(3).encode())
    [description] = (await store.read([("orders", 0)]))["orders", 0].corrupt
    assert description.endswith("holds generation 3 in slot 0")

    # A good write to the slot replaces the bad record.
    await store.write(snapshot(4))
    assert await store.read([("orders", 0)]) == {
        ("orders", 0): StoredSnapshots(valid=(snapshot(4), snapshot(1)))
    }

    # Keys that name no data partition are skipped and logged; a bad slot is reported.
    produce_raw(local_env, topic, 0, b"no-slash", b"x")  # (a compacted topic refuses null keys)
    produce_raw(local_env, topic, 0, b"\xff\xfe", b"x")
    produce_raw(local_env, topic, 0, b"orders/0/2", b"x")
    with capture_logs() as logs:
        found = await store.read([("orders", 0)])
    assert found["orders", 0].valid == (snapshot(4), snapshot(1))
    [description] = found["orders", 0].corrupt
    assert description.endswith("key b'orders/0/2': the key's slot is not 0 or 1")
    [skipped] = [e for e in logs if e["event"] == "snapshot records skipped"]
    assert skipped["count"] == 2
    assert all(r.endswith(": names no data partition") for r in skipped["records"])

    # A tombstone empties its slot.
    produce_raw(local_env, topic, 0, b"orders/0/1", None)
    assert (await store.read([("orders", 0)]))["orders", 0].valid == (snapshot(4),)


async def test_a_missing_topic_means_no_snapshots(local_env: EnvInfo, snapshot_topic: str) -> None:
    store = SnapshotStore(local_env.bootstrap, snapshot_topic, timeout_s=TIMEOUT_S)
    try:
        assert await store.read([("orders", 0), ("payments", 3)]) == {
            ("orders", 0): StoredSnapshots(),
            ("payments", 3): StoredSnapshots(),
        }
        with pytest.raises(SnapshotError, match="does not exist"):
            await store.write(snapshot(0))
        # Neither created it (the broker auto-creates topics on metadata requests).
        assert not topic_exists(local_env, snapshot_topic)
    finally:
        await store.close()


async def test_a_write_while_the_topic_is_being_created_waits_for_it(
    local_env: EnvInfo, snapshot_topic: str
) -> None:
    """A proxy's first snapshot can come before its start-up has made the topic."""
    store = SnapshotStore(local_env.bootstrap, snapshot_topic, timeout_s=TIMEOUT_S)
    try:
        creating = asyncio.create_task(store.ensure_topic())
        await asyncio.sleep(0)  # it has begun
        await store.write(snapshot(0))
        await creating
        assert (await store.read([("orders", 0)]))["orders", 0].valid == (snapshot(0),)
    finally:
        await store.close()


async def test_an_empty_topic_reads_at_once(store: SnapshotStore) -> None:
    found = await asyncio.wait_for(store.read([("orders", 0)]), 5)
    assert found == {("orders", 0): StoredSnapshots()}


async def test_keys_are_placed_by_data_partition(local_env: EnvInfo, snapshot_topic: str) -> None:
    store = SnapshotStore(local_env.bootstrap, snapshot_topic, partitions=4, timeout_s=TIMEOUT_S)
    keys = [(topic, partition) for topic in ("orders", "pay.ments_2") for partition in range(6)]
    try:
        await store.ensure_topic()
        for generation in (0, 1):
            await asyncio.gather(*(store.write(snapshot(generation, t, p)) for t, p in keys))
        records = consume_all(local_env, snapshot_topic, 4)
        assert sorted(records) == sorted(
            (zlib.crc32(f"{t}/{p}".encode()) % 4, slot_key(t, p, g).encode())
            for t, p in keys
            for g in (0, 1)
        )
        assert len({partition for partition, _ in records}) > 1

        # A snapshot in a partition other than its key's is skipped, even in a partition
        # read for other keys: its order relative to the key's records is unknown.
        home = snapshot_partition("orders", 0, 4)
        elsewhere = next(p for p, _ in records if p != home)
        offset = sum(1 for p, _ in records if p == elsewhere)
        produce_raw(local_env, snapshot_topic, elsewhere, b"orders/0/0", snapshot(8).encode())

        # Another store (the constructor's count differs) finds them all where they are.
        reader = SnapshotStore(local_env.bootstrap, snapshot_topic, timeout_s=TIMEOUT_S)
        try:
            with capture_logs() as logs:
                found = await reader.read(keys)
        finally:
            await reader.close()
        [skipped] = [e for e in logs if e["event"] == "snapshot records skipped"]
        assert skipped["records"] == [
            f"{elsewhere}@{offset} key b'orders/0/0': belongs in partition {home}"
        ]
        assert found == {
            (t, p): StoredSnapshots(valid=(snapshot(1, t, p), snapshot(0, t, p))) for t, p in keys
        }
    finally:
        await store.close()


async def test_a_large_snapshot_round_trips(store: SnapshotStore) -> None:
    large = snapshot(3, extra=200_000)
    assert len(large.encode()) > 5 * 1024 * 1024  # five times Kafka's default message size
    await store.write(large)
    found = await store.read([("orders", 0)])
    assert found["orders", 0].valid == (large,)


async def test_an_oversize_snapshot_is_refused_before_sending(store: SnapshotStore) -> None:
    producers = {f"{i:05}-" + "p" * 1000: ProducerEntry(i, i) for i in range(17_000)}
    huge = replace(snapshot(0), producers=producers)
    with pytest.raises(SnapshotError, match="cap its producers"):
        await store.write(huge)
    await store.write(huge.capped(100))
    assert (await store.read([("orders", 0)]))["orders", 0].newest == huge.capped(100)


async def test_records_after_the_last_snapshot_do_not_stall_reading(
    local_env: EnvInfo, store: SnapshotStore
) -> None:
    """Transaction markers end the log with offsets no consumer sees: the end offset is never
    reached by a record, only by the end-of-partition event."""
    producer = Producer(
        {"bootstrap.servers": local_env.bootstrap, "transactional.id": uuid.uuid4().hex}
    )
    producer.init_transactions(30)
    producer.begin_transaction()
    producer.produce(store.topic, snapshot(1).encode(), b"orders/0/1", partition=0)
    producer.commit_transaction(30)
    producer.begin_transaction()
    producer.produce(store.topic, snapshot(2).encode(), b"orders/0/0", partition=0)
    producer.flush(30)  # abort_transaction drops what is not sent yet
    producer.abort_transaction(30)
    # The coordinator writes the markers after answering: wait for the end of the log
    # (read_committed sees up to the last stable offset) to pass the abort marker.
    probe = Consumer({"bootstrap.servers": local_env.bootstrap, "group.id": "test"})
    try:
        deadline = time.monotonic() + 30
        while probe.get_watermark_offsets(TopicPartition(store.topic, 0), timeout=10)[1] < 4:
            assert time.monotonic() < deadline, "the transaction markers were not written"
            await asyncio.sleep(0.05)
    finally:
        probe.close()
    found = await asyncio.wait_for(store.read([("orders", 0)]), 5)
    assert found == {("orders", 0): StoredSnapshots(valid=(snapshot(1),))}


async def test_a_closed_store_refuses_work(local_env: EnvInfo, snapshot_topic: str) -> None:
    store = SnapshotStore(local_env.bootstrap, snapshot_topic, timeout_s=TIMEOUT_S)
    await store.close()
    await store.close()
    with pytest.raises(RuntimeError, match="closed"):
        await store.read([("orders", 0)])


async def test_kafka_down_is_a_snapshot_error() -> None:
    store = SnapshotStore("127.0.0.1:1", "snapshots", timeout_s=1.0)
    try:
        with pytest.raises(SnapshotError, match="could not read metadata"):
            await store.read([("orders", 0)])
    finally:
        await store.close()


def test_the_constructor_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="topic name"):
        SnapshotStore("localhost:9092", "a/b")
    with pytest.raises(ValueError, match="partitions 0"):
        SnapshotStore("localhost:9092", partitions=0)
    with pytest.raises(ValueError, match="timeout_s"):
        SnapshotStore("localhost:9092", timeout_s=0)

"""Deduplication through the proxy, on real Kafka and Redis: Pulsar's own scenarios, ported.

Every test reads the topic back (directly from Kafka) and checks its exact content and
order, not just counts.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import kio.schema.produce.v9.request as produce_v9
import pytest
import redis
import redis.asyncio
from confluent_kafka import (
    TIMESTAMP_LOG_APPEND_TIME,
    Consumer,
    KafkaError,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
)

from dedup.client import DedupProducer
from dedup.identity import DEFAULT_PRODUCER_HEADER, DEFAULT_SEQUENCE_HEADER
from dedup.state import DedupState, PartitionCheck
from deploy.launcher import ProxyProcess
from deploy.local import EnvInfo, java_tool_command
from deploy.topics import create_topic
from proxy.kafka.schemas import decode_response_body
from proxy.kafka.upstream_client import encode_request
from tests.support.java_clients import misreported, sent
from tests.support.kafka_io import (
    DeliveryReports,
    assert_exactly_once_in_order,
    end_offset,
    offsets_by_value,
    read_all,
    values,
)
from tests.support.ports import (
    IDLE_PURGE,
    REDIS_CHECK,
    RELAY_BOOTSTRAP,
    RELAY_BROKER_BASE,
    RELAYED,
)
from tests.support.proxies import own_proxy
from tests.support.proxy_api import admin_call, metric_total
from tests.support.raw import (
    explicit_batch,
    idempotent_batch,
    identity_batch,
    produce_raw,
    produce_request,
    read_response,
    record_batch,
)
from tests.support.relay import Relay
from tests.support.restartable import RestartableProxy
from tests.support.topics import new_topic
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration


# ----------------------------------------------------------------------------- helpers


def send_all(producer: DedupProducer, topic: str, sequences: Sequence[int]) -> None:
    errors: list[KafkaError] = []
    for sequence in sequences:
        producer.send(
            topic,
            f"v{sequence}".encode(),
            sequence_id=sequence,
            on_delivery=lambda err, _m: errors.append(err) if err else None,
        )
    assert producer.flush(60) == 0
    assert errors == []


def explicit_request(
    topic: str, identities: Sequence[tuple[str, int]], value_size: int = 0
) -> produce_v9.ProduceRequest:
    """A raw Produce request: one batch whose records carry the given identities."""
    return produce_request(topic, {0: explicit_batch(identities, value_size)})


def first_offset(bootstrap: str, topic: str) -> int:
    """The offset of the partition's first record (the proxy's fence may come before it)."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"o-{uuid.uuid4().hex}"})
    try:
        consumer.assign([TopicPartition(topic, 0, 0)])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for message in consumer.consume(1, 0.5):
                assert message.error() is None, message.error()
                return int(message.offset())
        raise AssertionError(f"{topic} has no record")
    finally:
        consumer.close()


def recover(proxy: ProxyProcess, topic: str, partition: int = 0) -> int:
    """Have the proxy recover a partition now (admin API); the offset writes start at."""
    answer = admin_call(proxy, "POST", f"/v1/topics/{topic}/partitions/{partition}/recover")
    assert answer["recovered"] is True
    return int(answer["end"])


def in_state(redis_url: str, prefix: str, action: Any) -> Any:
    """Run ``action(state)`` against the proxy's own Redis state (white-box set-up)."""

    async def run() -> Any:
        client = redis.asyncio.from_url(redis_url)
        try:
            return await action(DedupState(client, key_prefix=prefix))
        finally:
            await client.aclose()

    return asyncio.run(run())


# ----------------------------------------------------------------------------- Pulsar's scenarios


def test_resent_sequences_are_dropped(dedup_proxy: ProxyProcess, local_env: EnvInfo) -> None:
    topic = new_topic(local_env.bootstrap)
    producer = DedupProducer(dedup_proxy.bootstrap, "p-resend", admin_url=dedup_proxy.admin_url)
    send_all(producer, topic, [0, 1, 2])
    send_all(producer, topic, [1, 2])
    assert values(local_env.bootstrap, topic) == [b"v0", b"v1", b"v2"]
    assert producer.last_sequence_id(topic) == 2


def test_a_log_append_time_topic_gives_the_client_kafkas_append_time(
    dedup_proxy: ProxyProcess, local_env: EnvInfo
) -> None:
    """A topic whose timestamps are Kafka's (`message.timestamp.type=LogAppendTime`): the
    time Kafka appended the record reaches the client through dedup, as it does from Kafka
    directly (librdkafka's delivery report says LOG_APPEND_TIME, the record's timestamp in
    the log). Before, the proxy answered -1 and the client reported its own create time."""
    topic = new_topic(local_env.bootstrap, config={"message.timestamp.type": "LogAppendTime"})
    reports: list[tuple[Any, tuple[int, int]]] = []
    producer = Producer({"bootstrap.servers": dedup_proxy.bootstrap, "enable.idempotence": True})
    created = 1_000_000_000_000  # 2001: far from any append time
    producer.produce(
        topic,
        b"v",
        timestamp=created,
        on_delivery=lambda error, message: reports.append((error, message.timestamp())),
    )
    assert producer.flush(30) == 0
    ((error, (kind, reported)),) = reports
    assert error is None
    consumer = Consumer({"bootstrap.servers": local_env.bootstrap, "group.id": f"g-{topic}"})
    consumer.assign([TopicPartition(topic, 0, 0)])
    message = None
    deadline = time.monotonic() + 30
    while message is None and time.monotonic() < deadline:
        message = consumer.poll(1)
    consumer.close()
    assert message is not None and message.error() is None
    assert message.timestamp() == (TIMESTAMP_LOG_APPEND_TIME, reported)
    assert (kind, reported != created) == (TIMESTAMP_LOG_APPEND_TIME, True)


def test_a_resent_batch_is_answered_with_its_originals_offset_and_append_time(
    dedup_proxy: ProxyProcess, local_env: EnvInfo
) -> None:
    """A Kafka idempotent producer's batches sent again (their answers lost) are answered
    as Kafka's broker answers a duplicate batch: with the offset and the log append time
    the original got, so the client reports where the record is. Before, offset -1."""
    topic = new_topic(local_env.bootstrap, config={"message.timestamp.type": "LogAppendTime"})

    def send(base: int, count: int) -> Any:
        keys = [f"k{base + i}".encode() for i in range(count)]
        return produce_raw(
            dedup_proxy, produce_request(topic, {0: idempotent_batch(keys, 7171, 0, base)})
        )

    original = 'dedup_duplicate_batches_total{offset="original"'
    before = metric_total(dedup_proxy, original)
    sent = [send(0, 2), send(2, 3)]
    assert [a.error_code for a in sent] == [0, 0]
    assert sent[0].base_offset == first_offset(local_env.bootstrap, topic)
    assert sent[1].base_offset == sent[0].base_offset + 2
    assert all(a.log_append_time is not None for a in sent)
    resent = [send(0, 2), send(2, 3)]
    assert [(a.error_code, a.base_offset, a.log_append_time) for a in resent] == [
        (0, a.base_offset, a.log_append_time) for a in sent
    ]
    assert metric_total(dedup_proxy, original) == before + 2
    assert values(local_env.bootstrap, topic) == [f"k{i}".encode() for i in range(5)]


def test_a_batch_partly_or_wholly_written_before_is_answered_with_its_first_records_offset(
    dedup_proxy: ProxyProcess, local_env: EnvInfo
) -> None:
    """A client numbers a batch's records from the answer's base offset (librdkafka even
    from -1: -1, 0, 1, ...). So a batch sent again across two earlier batches, or one
    whose first records were written before and the rest now, is answered with its first
    record's offset wherever its records follow each other in the log; where they do not
    (another producer's record between), -1."""
    topic = new_topic(local_env.bootstrap)

    def send(name: str, base: int, count: int) -> Any:
        batch = explicit_batch([(name, base + i) for i in range(count)])
        return produce_raw(dedup_proxy, produce_request(topic, {0: batch}))

    written = [send("p", 0, 2), send("p", 2, 2)]  # offsets 0-1, 2-3
    assert [(a.error_code, a.base_offset) for a in written] == [(0, 0), (0, 2)]
    across = send("p", 1, 2)  # p/1 and p/2: the end of one batch and the start of the next
    assert (across.error_code, across.base_offset) == (0, 1)
    partly = send("p", 2, 4)  # p/2, p/3 written before; p/4, p/5 written now at 4-5
    assert (partly.error_code, partly.base_offset) == (0, 2)
    whole = send("p", 0, 6)  # p/0-p/5 sent again: the part written just now is in the run
    assert (whole.error_code, whole.base_offset) == (0, 0)
    assert send("q", 0, 1).base_offset == 6
    apart = send("p", 5, 2)  # p/5 at 5; p/6 written now at 7, after q/0
    assert (apart.error_code, apart.base_offset) == (0, -1), "no base is right for both"
    in_log = [
        (h[DEFAULT_PRODUCER_HEADER], h[DEFAULT_SEQUENCE_HEADER])
        for _, h in read_all(local_env.bootstrap, topic)
    ]
    assert in_log == [(b"p", str(i).encode()) for i in range(6)] + [(b"q", b"0"), (b"p", b"6")]


def test_a_duplicate_is_answered_with_the_log_start_offset_of_kafkas_latest_answer(
    dedup_proxy: ProxyProcess, local_env: EnvInfo
) -> None:
    """Kafka answers a duplicate batch with the log's start offset. The proxy answers one
    with the start offset of Kafka's latest answer to its writes on the partition, or the
    one its latest recovery of the partition read: after records were deleted from the
    log's head (DeleteRecords), the start that write or that recovery saw."""
    topic = new_topic(local_env.bootstrap)

    def send(base: int, count: int) -> Any:
        return produce_raw(
            dedup_proxy,
            produce_request(topic, {0: explicit_batch([("p", base + i) for i in range(count)])}),
        )

    assert [
        (a.error_code, a.base_offset, a.log_start_offset) for a in (send(0, 2), send(2, 2))
    ] == [
        (0, 0, 0),
        (0, 2, 0),
    ]
    admin = AdminClient({"bootstrap.servers": local_env.bootstrap})
    for future in admin.delete_records([TopicPartition(topic, 0, 3)]).values():
        future.result(30)
    resent = send(2, 2)  # before any write saw the new start: the start Kafka gave last
    assert (resent.error_code, resent.base_offset, resent.log_start_offset) == (0, 2, 0)
    written = send(4, 1)
    assert (written.error_code, written.base_offset, written.log_start_offset) == (0, 4, 3)
    resent = send(2, 3)  # p/2, p/3 and p/4, at offsets 2-4 in a row
    assert (resent.error_code, resent.base_offset, resent.log_start_offset) == (0, 2, 3)
    # A recovery (as when the partition is taken again) reads the start with the end.
    for future in admin.delete_records([TopicPartition(topic, 0, 4)]).values():
        future.result(30)
    admin_call(dedup_proxy, "POST", f"/v1/topics/{topic}/partitions/0/recover")
    resent = send(4, 1)  # p/4 at 4, as the recovery read it in the log's tail
    assert (resent.error_code, resent.base_offset, resent.log_start_offset) == (0, 4, 4)


def test_discontinuous_sequence_ids(dedup_proxy: ProxyProcess, local_env: EnvInfo) -> None:
    topic = new_topic(local_env.bootstrap)
    producer = DedupProducer(dedup_proxy.bootstrap, "p-holes", admin_url=dedup_proxy.admin_url)
    send_all(producer, topic, [2, 3, 5])
    send_all(producer, topic, [2, 4, 6])
    assert values(local_env.bootstrap, topic) == [b"v2", b"v3", b"v5", b"v6"]


def test_restarted_producer_resumes_and_blind_resend_adds_nothing(
    dedup_proxy: ProxyProcess, local_env: EnvInfo
) -> None:
    topic = new_topic(local_env.bootstrap)
    first = DedupProducer(dedup_proxy.bootstrap, "p-restart", admin_url=dedup_proxy.admin_url)
    send_all(first, topic, range(10))
    del first
    second = DedupProducer(dedup_proxy.bootstrap, "p-restart", admin_url=dedup_proxy.admin_url)
    assert second.last_sequence_id(topic) == 9
    send_all(second, topic, range(10))  # a blind re-send from the start
    assert second.send(topic, b"v10") == 10  # automatic ids continue after the persisted one
    assert second.flush(60) == 0
    assert values(local_env.bootstrap, topic) == [f"v{i}".encode() for i in range(11)]


def test_a_blind_resend_is_reported_at_its_originals_offsets(
    dedup_proxy: ProxyProcess, local_env: EnvInfo
) -> None:
    """A producer restarted from an old checkpoint sends again far more than the 5 batches
    Kafka keeps per producer. Its first send wrote them in a row, so each re-sent batch is
    answered with its original's offset, and every delivery report of the re-send names
    its record's offset. (A batch answered -1 is numbered from -1 by librdkafka: its
    records' reports would name other records' offsets.)"""
    topic = new_topic(local_env.bootstrap)
    reports = DeliveryReports()

    def send(producer: DedupProducer) -> None:
        for sequence in range(2000):
            producer.send(topic, f"v{sequence}".encode(), sequence_id=sequence, on_delivery=reports)
            if sequence % 100 == 99:
                assert producer.flush(60) == 0  # a batch of 100 at most: 20 or more batches

    send(DedupProducer(dedup_proxy.bootstrap, "p-blind", admin_url=dedup_proxy.admin_url))
    in_log = offsets_by_value(local_env.bootstrap, topic)
    assert (reports.errors, reports.offsets) == ([], in_log)
    reports.offsets.clear()
    send(DedupProducer(dedup_proxy.bootstrap, "p-blind", admin_url=dedup_proxy.admin_url))
    assert offsets_by_value(local_env.bootstrap, topic) == in_log, "nothing written again"
    wrong = {value: at for value, at in reports.offsets.items() if at != in_log[value]}
    assert (reports.errors, len(reports.offsets), wrong) == ([], 2000, {})


# The re-sender's software as its ApiVersions request names it (KIP-511): librdkafka takes
# the name and version from its settings, so confluent-kafka for Python can speak as
# Confluent's Go and .NET clients do (their bare librdkafka version, read in their
# sources), or as a wrapper the proxy does not know: one the dedup proxy's
# `clients_numbering_from_base` lists (conftest), one it does not.
SOFTWARE_OF_RESENDER = {
    "python": {},
    "go": {"client.software.name": "confluent-kafka-go", "client.software.version": "2.6.1"},
    "dotnet": {
        "client.software.name": "confluent-kafka-dotnet",
        "client.software.version": "2.6.1",
    },
    "listed": {"client.software.name": "listed-wrapper", "client.software.version": "2.6.1"},
    "unlisted": {"client.software.name": "some-wrapper", "client.software.version": "2.6.1"},
}


@pytest.mark.parametrize("software", list(SOFTWARE_OF_RESENDER))
def test_a_resend_no_offset_is_right_for_is_reported_without_one_by_librdkafka(
    dedup_proxy: ProxyProcess, local_env: EnvInfo, software: str
) -> None:
    """Another producer wrote between each of p's records, so a batch of p's re-sent
    records has no base offset right for all of them. Kafka's Java client reports -1 for
    each record of a batch answered -1; librdkafka numbers them from it (-1, 0, 1, ...),
    other records' offsets. So a librdkafka client is answered minus the batch's record
    count: every report of such a batch names no offset, none another record's. A
    librdkafka client under a name the proxy does not know (nor `clients_numbering_from_base`
    lists) still gets -1, and some of its reports name other records' offsets: the limit
    the README states, and the proof that the name reached the proxy."""
    topic = new_topic(local_env.bootstrap)
    reports = DeliveryReports()
    first = DedupProducer(dedup_proxy.bootstrap, "p-apart", admin_url=dedup_proxy.admin_url)
    other = DedupProducer(dedup_proxy.bootstrap, "q-between", admin_url=dedup_proxy.admin_url)
    for sequence in range(60):
        first.send(topic, f"v{sequence}".encode(), sequence_id=sequence, on_delivery=reports)
        assert first.flush(60) == 0
        other.send(topic, f"q{sequence}".encode(), sequence_id=sequence)
        assert other.flush(60) == 0
    in_log = offsets_by_value(local_env.bootstrap, topic)
    mine = {v: at for v, at in in_log.items() if v[:1] == b"v"}
    assert (reports.errors, reports.offsets) == ([], mine)
    reports.offsets.clear()
    again = DedupProducer(
        dedup_proxy.bootstrap,
        "p-apart",
        admin_url=dedup_proxy.admin_url,
        **SOFTWARE_OF_RESENDER[software],
    )
    for sequence in range(60):  # blind, in batches of many records
        again.send(topic, f"v{sequence}".encode(), sequence_id=sequence, on_delivery=reports)
    assert again.flush(60) == 0
    assert offsets_by_value(local_env.bootstrap, topic) == in_log, "nothing written again"
    reported = reports.offsets
    wrong = {v: at for v, at in reported.items() if at is not None and at != in_log[v]}
    unknown = [v for v, at in reported.items() if at is None]
    assert (reports.errors, len(reported)) == ([], 60)
    if software == "unlisted":
        assert len(wrong) > 1, "numbered from -1: the batches' later records name others'"
        return
    assert wrong == {}
    assert len(unknown) > 1, "batches of more than one record were answered without an offset"


def test_unkeyed_messages_resent_by_a_restarted_producer_meet_their_first_send(
    dedup_proxy: ProxyProcess, local_env: EnvInfo
) -> None:
    """Dedup is per partition: without a key, a message's partition comes from its producer
    name and sequence id, so a restarted producer's re-send lands where the first send did
    (a client's own partitioner would pick at random)."""
    partitions = 4
    topic = new_topic(local_env.bootstrap, partitions=partitions)
    for _ in range(2):  # a fresh producer each time: nothing remembered in between
        send_all(DedupProducer(dedup_proxy.bootstrap, "p-unkeyed"), topic, range(40))
    found = [
        (partition, value)
        for partition in range(partitions)
        for value, _ in read_all(local_env.bootstrap, topic, partition)
    ]
    assert sorted(value for _, value in found) == sorted(f"v{i}".encode() for i in range(40))
    assert len({partition for partition, _ in found}) > 1, "spread over the partitions"


def test_batch_mixing_duplicates_and_new_records_forwards_only_new(
    dedup_proxy: ProxyProcess, local_env: EnvInfo
) -> None:
    topic = new_topic(local_env.bootstrap)
    first = produce_raw(dedup_proxy, explicit_request(topic, [("p-mix", 0), ("p-mix", 1)]))
    assert first.error_code == 0
    assert first.base_offset == first_offset(local_env.bootstrap, topic)
    mixed = produce_raw(
        dedup_proxy, explicit_request(topic, [("p-mix", 1), ("p-mix", 2), ("p-mix", 3)])
    )
    assert mixed.error_code == 0
    # Its first record's offset: p-mix/1 is just before the records written now.
    assert mixed.base_offset == first.base_offset + 1
    assert values(local_env.bootstrap, topic) == [b"v0", b"v1", b"v2", b"v3"]


REDIS_CHECK_DB = 11  # the Redis database of `redis_check_proxy`


@pytest.fixture(scope="module")
def redis_check_proxy(
    local_env: EnvInfo, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RestartableProxy]:
    """A dedup proxy whose check runs in Redis (``check_state = "redis"``)."""
    restartable = RestartableProxy(
        local_env,
        tmp_path_factory.mktemp("redis-check"),
        REDIS_CHECK,
        REDIS_CHECK_DB,
        "redis-check",
        DEDUP_PROXY_CHECK_STATE="redis",
    )
    restartable.start()
    yield restartable
    restartable.stop()


def test_pending_write_resent_is_unknown_and_never_written_twice(
    redis_check_proxy: RestartableProxy, local_env: EnvInfo
) -> None:
    """With the maps in Redis another writer's write in flight can be put there by hand:
    a re-send of it is UNKNOWN until it is acknowledged, then a duplicate. (With the maps
    in the owner's memory only the owner writes: `tests/unit/test_engine.py` holds its own
    write in flight for the same rule.)"""
    proxy = redis_check_proxy.process
    assert proxy is not None
    prefix = redis_check_proxy.settings["DEDUP_PROXY_REDIS_KEY_PREFIX"]
    redis_url = redis_check_proxy.redis_url
    topic = new_topic(local_env.bootstrap)
    assert produce_raw(proxy, explicit_request(topic, [("p-pending", 0)])).error_code == 0
    # Another write of sequence 5 is in flight: pushed, not yet persisted.
    in_state(
        redis_url,
        prefix,
        lambda state: state.check_and_push([PartitionCheck(topic, 0, [("p-pending", 5)])], 0),
    )
    unknown = produce_raw(proxy, explicit_request(topic, [("p-pending", 5)]))
    assert unknown.error_code == 19  # NOT_ENOUGH_REPLICAS: not written, retry later
    assert values(local_env.bootstrap, topic) == [b"v0"]
    # That other write is acknowledged: the retry is now a duplicate, success, not written.
    in_state(redis_url, prefix, lambda s: s.mark_persisted([(topic, 0, {"p-pending": 5})], 0))
    retried = produce_raw(proxy, explicit_request(topic, [("p-pending", 5)]))
    assert (retried.error_code, retried.base_offset) == (0, -1)
    assert values(local_env.bootstrap, topic) == [b"v0"]


def test_failed_write_then_retry_is_not_lost(dedup_proxy: ProxyProcess, local_env: EnvInfo) -> None:
    topic = new_topic(local_env.bootstrap, {"max.message.bytes": "2000"})
    big = explicit_request(topic, [("p-fail", 0)], value_size=5000)
    failed = produce_raw(dedup_proxy, big)
    assert failed.error_code in (10, 18), failed  # MESSAGE_TOO_LARGE / RECORD_LIST_TOO_LARGE
    admin = AdminClient({"bootstrap.servers": local_env.bootstrap})
    resource = ConfigResource(
        "topic",
        topic,
        incremental_configs=[
            ConfigEntry("max.message.bytes", "100000", incremental_operation=AlterConfigOpType.SET)
        ],
    )
    for future in admin.incremental_alter_configs([resource]).values():
        future.result(30)
    deadline = time.monotonic() + 30
    while (retried := produce_raw(dedup_proxy, big)).error_code != 0:
        assert time.monotonic() < deadline, retried
        time.sleep(0.5)
    assert retried.base_offset == first_offset(local_env.bootstrap, topic)
    assert len(values(local_env.bootstrap, topic)) == 1


# ----------------------------------------------------------------------------- policies


def test_policy_priority_require_and_disable_clears(
    dedup_proxy: ProxyProcess, local_env: EnvInfo, redis_key_prefix: str
) -> None:
    prefix = f"pol{uuid.uuid4().hex[:6]}-"
    by_prefix, by_topic, by_global = f"{prefix}a", f"{prefix}b", f"other-{uuid.uuid4().hex[:8]}"
    for name in (by_prefix, by_topic, by_global):
        create_topic(local_env.bootstrap, name, timeout_s=30)
    try:
        admin_call(dedup_proxy, "PUT", "/v1/policies/global", {"mode": "disabled"})
        admin_call(dedup_proxy, "PUT", f"/v1/policies/prefixes/{prefix}", {"mode": "enabled"})
        admin_call(dedup_proxy, "PUT", f"/v1/policies/topics/{by_topic}", {"mode": "disabled"})
        wait_for_policies(
            dedup_proxy,
            {"global": "disabled", f"prefix {prefix}": "enabled", f"topic {by_topic}": "disabled"},
        )
        for name in (by_prefix, by_topic, by_global):
            for _ in range(2):
                produce_raw(dedup_proxy, explicit_request(name, [("p-pol", 7)]))
        assert len(values(local_env.bootstrap, by_prefix)) == 1  # prefix beats global
        assert len(values(local_env.bootstrap, by_topic)) == 2  # topic beats prefix
        assert len(values(local_env.bootstrap, by_global)) == 2  # global beats the default

        admin_call(dedup_proxy, "PUT", f"/v1/policies/topics/{by_topic}", {"mode": "require"})
        wait_for_policies(dedup_proxy, {f"topic {by_topic}": "require"})
        anonymous = produce_raw(
            dedup_proxy,
            produce_request(by_topic, {0: record_batch([(b"anon", [])])}),
        )
        assert anonymous.error_code == 87  # INVALID_RECORD
        assert "requires a dedup identity" in (anonymous.error_message or "")
        assert len(values(local_env.bootstrap, by_topic)) == 2

        tracked = admin_call(dedup_proxy, "GET", f"/v1/topics/{by_prefix}/partitions/0/producers")
        assert "p-pol" in tracked["producers"]
        changed = admin_call(
            dedup_proxy, "PUT", f"/v1/policies/prefixes/{prefix}", {"mode": "disabled"}
        )
        assert by_prefix in changed["cleared_topics"]
        tracked = admin_call(dedup_proxy, "GET", f"/v1/topics/{by_prefix}/partitions/0/producers")
        assert tracked["producers"] == {}
    finally:
        admin_call(dedup_proxy, "DELETE", "/v1/policies/global")
        admin_call(dedup_proxy, "DELETE", f"/v1/policies/prefixes/{prefix}")
        admin_call(dedup_proxy, "DELETE", f"/v1/policies/topics/{by_topic}")
        wait_for_policies(
            dedup_proxy, {"global": None, f"prefix {prefix}": None, f"topic {by_topic}": None}
        )


def wait_for_policies(proxy: ProxyProcess, expected: dict[str, str | None]) -> None:
    """Until the proxy reads these modes: keys "global", "prefix <p>" and "topic <t>", None
    for no policy. Its produce path then does too: a change through the admin API refreshes
    the proxy's cached policies, and the dedup proxies here re-read them for every request."""

    def modes() -> dict[str, str | None]:
        found = admin_call(proxy, "GET", "/v1/policies")
        named = {
            "global": found["global"],
            **{f"prefix {name}": mode for name, mode in found["prefixes"].items()},
            **{f"topic {name}": mode for name, mode in found["topics"].items()},
        }
        return {key: named.get(key) for key in expected}

    wait_until(lambda: modes() == expected, 10, lambda: f"the policies are {expected}")


def test_a_policy_value_that_is_no_mode_is_ignored_listed_and_logged(
    dedup_proxy: ProxyProcess, local_env: EnvInfo, redis_key_prefix: str, dedup_proxy_log: Path
) -> None:
    """Policies written into Redis by hand, not through the admin API: a value that is no
    mode is skipped (the next less specific policy applies), as Kafka skips an invalid
    dynamic config, instead of failing every Produce request that reads the policies."""
    prefix = f"badpol{uuid.uuid4().hex[:6]}-"
    by_prefix, by_default = f"{prefix}a", f"other-{uuid.uuid4().hex[:8]}"
    for name in (by_prefix, by_default):
        create_topic(local_env.bootstrap, name, timeout_s=30)
    keys = {kind: f"{redis_key_prefix}:policy:{kind}" for kind in ("global", "prefixes", "topics")}
    client = redis.Redis.from_url(local_env.redis)
    try:
        client.set(keys["global"], "off")
        client.hset(keys["prefixes"], prefix, "disabled")
        client.hset(keys["topics"], by_prefix, "enable")
        wait_until(
            lambda: (
                admin_call(dedup_proxy, "GET", "/v1/policies")["invalid"]
                == {"global": "off", f"topic {by_prefix}": "enable"}
            ),
            10,
            "the proxy lists the two invalid values",
        )
        for name in (by_prefix, by_default):
            for _ in range(2):
                answer = produce_raw(dedup_proxy, explicit_request(name, [("p-badpol", 7)]))
                assert answer.error_code == 0, answer
        assert len(values(local_env.bootstrap, by_prefix)) == 2  # the prefix's "disabled"
        assert len(values(local_env.bootstrap, by_default)) == 1  # the default's "enabled"
        listed = admin_call(dedup_proxy, "GET", "/v1/policies")
        assert listed["global"] is None and by_prefix not in listed["topics"]
        assert listed["prefixes"][prefix] == "disabled"
        show = ["policy", "show", "--admin-url", dedup_proxy.admin_url]
        table = subprocess.run(
            [sys.executable, "-m", "dedup", *show],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
            env={**os.environ, "COLUMNS": "200"},
        ).stdout
        assert "'enable': not a mode, ignored" in table and "'off': not a mode" in table
        assert "invalid dedup policies in Redis are ignored" in dedup_proxy_log.read_text()
    finally:
        client.delete(keys["global"])
        client.hdel(keys["prefixes"], prefix)
        client.hdel(keys["topics"], by_prefix)
        client.close()
    wait_until(
        lambda: admin_call(dedup_proxy, "GET", "/v1/policies")["invalid"] == {},
        10,
        "the invalid values are gone",
    )


def test_unique_producer_names(dedup_proxy: ProxyProcess) -> None:
    names = {
        DedupProducer(dedup_proxy.bootstrap, admin_url=dedup_proxy.admin_url).producer_name
        for _ in range(3)
    }
    assert len(names) == 3


# ----------------------------------------------------------------------------- cut connections


@pytest.fixture(scope="module")
def relayed(
    local_env: EnvInfo, tmp_path_factory: pytest.TempPathFactory, redis_key_prefix: str
) -> Iterator[tuple[ProxyProcess, Relay]]:
    """A dedup proxy that clients reach only through a relay that can cut connections."""
    nodes = sorted(local_env.brokers)
    relay = Relay(
        {
            RELAY_BOOTSTRAP: RELAYED.listen,
            **{RELAY_BROKER_BASE + n: RELAYED.broker_base + n for n in nodes},
        }
    ).start()
    proxy = ProxyProcess(
        upstream=local_env.bootstrap,
        listen_port=RELAYED.listen,
        admin_port=RELAYED.admin,
        extra_args=["--broker-port-base", str(RELAYED.broker_base)],
        env={
            "DEDUP_PROXY_ADVERTISED_BROKER_PORT_BASE": str(RELAY_BROKER_BASE),
            "DEDUP_PROXY_REDIS": local_env.redis,
            # Its own deployment (instances sharing a prefix share partition ownership).
            "DEDUP_PROXY_REDIS_KEY_PREFIX": f"{redis_key_prefix}-relayed",
            "DEDUP_PROXY_POLICY_CACHE_S": "0",  # see the dedup_proxy fixture
        },
        log_path=tmp_path_factory.mktemp("relayed") / "proxy.log",
    ).start()
    yield proxy, relay
    proxy.stop()
    relay.stop()


def cut_while(
    relay: Relay, running: threading.Thread, every_s: float = 0.4, limit: int = 8
) -> None:
    time.sleep(every_s)
    while running.is_alive() and relay.cuts < limit:
        relay.cut()
        time.sleep(every_s)


def run_with_cuts(relay: Relay, work: Callable[[], None], timeout_s: float = 180) -> None:
    """Run ``work`` in a thread while the relay cuts every connection now and then."""
    worker = threading.Thread(target=work)
    relay.cuts = 0
    worker.start()
    cut_while(relay, worker)
    worker.join(timeout_s)
    assert not worker.is_alive(), "the producer did not finish"


def test_idempotent_librdkafka_through_cut_connections(
    relayed: tuple[ProxyProcess, Relay], local_env: EnvInfo
) -> None:
    """Implicit identity: an unmodified idempotent producer, connections reset mid-stream.
    librdkafka must never see a fatal error, and the topic holds each message once, in order."""
    _, relay = relayed
    topic = new_topic(local_env.bootstrap)
    total, errors, fatal = 20_000, [], []
    reported: dict[bytes, int] = {}  # each record's offset, by its delivery report
    producer = Producer(
        {
            "bootstrap.servers": f"127.0.0.1:{RELAY_BOOTSTRAP}",
            "enable.idempotence": True,
            "linger.ms": 1,
            "batch.num.messages": 200,
            "message.timeout.ms": 120_000,
            "error_cb": lambda err: fatal.append(err) if err.fatal() else None,
        }
    )

    def produce() -> None:
        for index in range(total):
            while True:
                try:
                    producer.produce(
                        topic,
                        str(index).encode(),
                        on_delivery=delivered,
                    )
                    break
                except BufferError:
                    producer.poll(0.05)
            producer.poll(0)
            if index % 500 == 0:
                time.sleep(0.02)
        producer.flush(120)

    def delivered(error: Any, message: Any) -> None:
        if error:
            errors.append(error)
        reported[message.value()] = message.offset()

    run_with_cuts(relay, produce)
    assert relay.cuts > 0
    assert fatal == [] and errors == []
    assert_exactly_once_in_order(values(local_env.bootstrap, topic), total)
    # Each record is reported where it is. These cuts seldom make librdkafka re-send a
    # batch that was written (with duplicates answered -1, 2 runs of 2 passed): the Java
    # test below is the one that meets duplicates' answers.
    in_log = offsets_by_value(local_env.bootstrap, topic)
    wrong = sorted((int(v), o) for v, o in reported.items() if o != in_log[v])
    assert len(reported) == total and wrong == [], (len(wrong), wrong[:5])


def test_dedup_producer_keeps_order_with_five_in_flight_through_cuts(
    relayed: tuple[ProxyProcess, Relay], local_env: EnvInfo
) -> None:
    proxy, relay = relayed
    topic = new_topic(local_env.bootstrap)
    total, errors = 20_000, []
    producer = DedupProducer(
        f"127.0.0.1:{RELAY_BOOTSTRAP}",
        "p-ordered",
        admin_url=proxy.admin_url,
        **{"max.in.flight.requests.per.connection": 5, "linger.ms": 1, "batch.num.messages": 100},
    )

    def produce() -> None:
        for index in range(total):
            producer.send(
                topic,
                str(index).encode(),
                on_delivery=lambda err, _m: errors.append(err) if err else None,
            )
            if index % 500 == 0:
                time.sleep(0.02)
        producer.flush(120)

    run_with_cuts(relay, produce)
    assert relay.cuts > 0 and errors == []
    assert_exactly_once_in_order(values(local_env.bootstrap, topic), total)


def test_java_idempotent_verifiable_producer_through_cuts(
    relayed: tuple[ProxyProcess, Relay], local_env: EnvInfo, tmp_path: Any
) -> None:
    _, relay = relayed
    topic = new_topic(local_env.bootstrap)
    config = tmp_path / "producer.properties"
    config.write_text(
        "enable.idempotence=true\nacks=all\nretries=2147483647\nlinger.ms=1\nbatch.size=4096\n"
    )
    total = 5000
    command = java_tool_command(
        "org.apache.kafka.tools.VerifiableProducer",
        "--bootstrap-server",
        f"127.0.0.1:{RELAY_BOOTSTRAP}",
        "--topic",
        topic,
        "--max-messages",
        str(total),
        "--throughput",
        "800",
        "--command-config",
        str(config),
    )
    output: list[str] = []

    def run() -> None:
        done = subprocess.run(command, capture_output=True, text=True, timeout=240, check=True)
        output.extend(done.stdout.splitlines())

    runner = threading.Thread(target=run)
    relay.cuts = 0
    runner.start()
    wait_until(  # the JVM starts and gets going
        lambda: end_offset(local_env.bootstrap, topic) > 0 or not runner.is_alive(),
        120,
        "the Java producer has written its first records",
    )
    cut_while(relay, runner, every_s=0.5, limit=5)
    runner.join(300)
    events = [json.loads(line) for line in output if line.startswith("{")]
    acked, failed = sent(events)
    assert relay.cuts > 0
    assert failed == [] and acked == total, (len(failed), failed[:3])
    assert_exactly_once_in_order(values(local_env.bootstrap, topic), total)
    # Each record is reported where it is, a retry answered as a duplicate included.
    wrong = misreported(events, offsets_by_value(local_env.bootstrap, topic))
    assert wrong == [], (len(wrong), wrong[:5])


# ----------------------------------------------------------------------------- operations


def test_idle_producers_are_purged(
    local_env: EnvInfo, tmp_path: Any, redis_key_prefix: str
) -> None:
    proxy = own_proxy(
        local_env,
        IDLE_PURGE,
        f"{redis_key_prefix}-idle",
        tmp_path / "proxy.log",
        DEDUP_PROXY_PRODUCER_IDLE_TIMEOUT_S="2",
    ).start()
    try:
        topic = new_topic(local_env.bootstrap)
        send_all(DedupProducer(proxy.bootstrap, "p-idle"), topic, [0, 1])
        path = f"/v1/topics/{topic}/partitions/0/producers"
        assert "p-idle" in admin_call(proxy, "GET", path)["producers"]
        wait_until(
            lambda: not admin_call(proxy, "GET", path)["producers"],
            20,
            "the idle producer is purged",
            interval_s=0.5,
        )
        assert "purged idle producers" in (tmp_path / "proxy.log").read_text()
    finally:
        assert proxy.stop() == 0


def test_policy_and_producers_cli(dedup_proxy: ProxyProcess, local_env: EnvInfo) -> None:
    cli = [sys.executable, "-m", "dedup"]
    admin = ["--admin-url", dedup_proxy.admin_url]
    topic = new_topic(local_env.bootstrap)

    def run(*args: str) -> str:
        done = subprocess.run(
            [*cli, *args, *admin], capture_output=True, text=True, timeout=60, check=True
        )
        return done.stdout

    try:
        run("policy", "set", "topic", "require", topic)
        policies = json.loads(run("policy", "show", "--json-output"))
        assert policies["topics"][topic] == "require"
        send_all(DedupProducer(dedup_proxy.bootstrap, "p-cli"), topic, [3, 4])
        assert run("producers", topic, "--name", "p-cli").strip() == "4"
        assert "p-cli" in json.loads(run("producers", topic, "--json-output"))["producers"]
    finally:
        run("policy", "clear", "topic", topic)
    assert topic not in json.loads(run("policy", "show", "--json-output"))["topics"]
    bad = subprocess.run(
        [*cli, "policy", "set", "planet", "enabled", "x", *admin], capture_output=True, text=True
    )
    assert bad.returncode != 0 and "scope must be global, prefix or topic" in bad.stderr


def _flip_last_byte(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 0xFF])


BAD_PARTITION_BATCHES = {
    "unparseable-sequence": (lambda: identity_batch([(b"p-bad", b"12x")]), 87, "dedup.sequence"),
    "empty-producer": (lambda: identity_batch([(b"", b"1")]), 87, "dedup.producer"),
    "crc-mismatch": (lambda: _flip_last_byte(identity_batch([(b"p-bad", b"1")])), 2, "CRC"),
}


@pytest.mark.parametrize("kind", sorted(BAD_PARTITION_BATCHES))
def test_bad_input_refuses_only_that_partition(
    dedup_proxy: ProxyProcess, local_env: EnvInfo, kind: str
) -> None:
    topic = new_topic(local_env.bootstrap, partitions=2)
    make_bad, code, words = BAD_PARTITION_BATCHES[kind]
    before = _bad_input_count(dedup_proxy)
    recover(dedup_proxy, topic, 0)
    start = recover(dedup_proxy, topic, 1)
    request = produce_request(topic, {0: make_bad(), 1: identity_batch([(b"p-good", b"1")])})
    port = dedup_proxy.broker_port()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(encode_request(request, 1))
        frame = read_response(sock)
    answers = {
        int(p.index): p
        for p in decode_response_body(0, 9, frame, 5).responses[0].partition_responses
    }
    assert answers[0].error_code == code
    assert words.lower() in (answers[0].error_message or "").lower(), answers[0].error_message
    assert (answers[1].error_code, answers[1].base_offset) == (0, start)
    assert read_all(local_env.bootstrap, topic, partition=0) == []
    assert [v for v, _ in read_all(local_env.bootstrap, topic, partition=1)] == [b"v1"]
    assert _bad_input_count(dedup_proxy) == before + 1


def _bad_input_count(proxy: ProxyProcess) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in proxy.metrics_text().splitlines()
        if line.startswith("dedup_bad_input_total{")
    )


def test_pipelined_requests_of_one_producer_reach_the_log_in_order(
    dedup_proxy: ProxyProcess, local_env: EnvInfo
) -> None:
    """Many requests in flight on one connection: each waits on Redis (policies re-read per
    request in this fixture) yet none may overtake an earlier one, or the earlier one's
    records would be dropped as old duplicates of the later ones."""
    topic = new_topic(local_env.bootstrap)
    requests, per_request = 200, 5
    start = recover(dedup_proxy, topic)
    port = dedup_proxy.broker_port()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        frames = [
            encode_request(
                explicit_request(
                    topic, [("p-pipelined", n * per_request + i) for i in range(per_request)]
                ),
                n,
            )
            for n in range(requests)
        ]
        sock.sendall(b"".join(frames))
        answers = []
        for _ in range(requests):
            frame = read_response(sock)
            answers.append(decode_response_body(0, 9, frame, 5).responses[0].partition_responses[0])
    assert [a.error_code for a in answers] == [0] * requests
    assert [a.base_offset for a in answers] == [start + n * per_request for n in range(requests)]
    expected = [f"v{s}".encode() for s in range(requests * per_request)]
    assert values(local_env.bootstrap, topic) == expected

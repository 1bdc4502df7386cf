"""Crashes that must lose nothing and duplicate nothing: the proxy killed with -9, Redis
flushed or replaced, snapshots far behind, missing or corrupt.

Each test runs its own proxy process (so it can be killed), a producer that re-sends what
was not acknowledged, and reads the topic back from Kafka: exactly 0..N-1, once each, in
order.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from confluent_kafka import Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewPartitions

from dedup.batches import HEADER_PRODUCER, HEADER_SEQUENCE
from dedup.client import DedupProducer
from dedup.snapshots import SnapshotStore, slot_key, snapshot_partition
from deploy.launcher import ProxyProcess
from deploy.local import EnvInfo, LocalEnvironment
from deploy.processes import port_open
from tests.support.java_clients import sent, verifiable_producer_during
from tests.support.kafka_io import (
    assert_exactly_once_in_order,
    end_offset,
    offsets_by_value,
    read_all,
    values,
)
from tests.support.load import SequencedProducer
from tests.support.ports import RECOVERY, REDIS_RELAY
from tests.support.proxy_api import admin_call, metric_total
from tests.support.raw import (
    NOT_LEADER_OR_FOLLOWER,
    explicit_batch,
    idempotent_batch,
    produce_answers,
    produce_once,
    produce_raw,
    produce_request,
    produce_request_to,
)
from tests.support.relay import relayed_redis
from tests.support.restartable import RestartableProxy
from tests.support.topics import create_again, delete_and_create_again, delete_topic, new_topic
from tests.support.transactions import begun_transaction
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration

REDIS_DB = 5  # this file's proxies only: a FLUSHDB here touches no other test's state
NOT_ENOUGH_REPLICAS = 19  # Kafka's retriable "not written", the answer without Redis
UNKNOWN_TOPIC_OR_PARTITION = 3
REDIS_DOWN = "dedup state unavailable"  # the log line of a request refused without Redis
# ... and of acknowledged positions not written to Redis (the maps kept in memory)
COPY_FAILING = "could not record persisted sequences"


def recovery_proxy(env: EnvInfo, log_dir: Path, **settings: str) -> RestartableProxy:
    return RestartableProxy(env, log_dir, RECOVERY, REDIS_DB, "recovery", **settings)


@pytest.fixture
def restartable(local_env: EnvInfo, tmp_path: Path) -> Iterator[RestartableProxy]:
    proxy = recovery_proxy(local_env, tmp_path)
    yield proxy
    proxy.stop()


def blind_resend(
    proxy: ProxyProcess, topic: str, name: str, sequences: range, prefix: str = ""
) -> None:
    """A producer that restarted without knowing what was written re-sends a range."""
    producer = DedupProducer(proxy.bootstrap, name)
    for sequence in sequences:
        producer.send(topic, f"{prefix}{sequence}".encode(), sequence_id=sequence)
    assert producer.flush(120) == 0


def assert_topic_is(bootstrap: str, topic: str, total: int) -> None:
    assert_exactly_once_in_order(values(bootstrap, topic), total)


def recoveries(proxy: RestartableProxy, **fields: Any) -> list[str]:
    """Log lines of finished partition recoveries whose fields include ``fields``."""
    wanted = [
        f'"{k}": {v}' if not isinstance(v, str) else f'"{k}": "{v}"' for k, v in fields.items()
    ]
    return [
        line
        for line in proxy.log_events()
        if '"partition recovered"' in line and all(w in line for w in wanted)
    ]


# ----------------------------------------------------------------------------- kill -9


def test_proxy_killed_under_load_producer_retries_and_blind_resend_adds_nothing(
    restartable: RestartableProxy, local_env: EnvInfo
) -> None:
    topic = new_topic(local_env.bootstrap)
    total = 6000
    first = restartable.start()
    load = SequencedProducer(first.bootstrap, topic, "p-kill", total).start()
    load.wait_delivered(total // 3)
    restartable.kill()  # requests in flight: some in Kafka unacknowledged, some not sent
    wait_until(
        lambda: not port_open("127.0.0.1", RECOVERY.listen),
        10,
        "the killed proxy's listener is closed",
    )
    second = restartable.start()
    load.join()  # librdkafka re-sends what was not acknowledged, to the new proxy
    blind_resend(second, topic, "p-kill", range(total // 4, total))
    assert_topic_is(local_env.bootstrap, topic, total)
    assert recoveries(restartable, topic=topic), "the restarted proxy recovered the partition"


def test_proxy_killed_producer_gives_up_and_resumes_from_last_sequence_id(
    restartable: RestartableProxy, local_env: EnvInfo
) -> None:
    topic = new_topic(local_env.bootstrap)
    total = 5000
    first = restartable.start()
    # The producer dies with the proxy: what it had not had acknowledged is lost to it.
    # Paced to outlast the kill (some 3 s of load left): at 5,000 records/s the load once
    # ended before the kill landed, and nothing was cut off.
    load = SequencedProducer(
        first.bootstrap,
        topic,
        "p-resume",
        total,
        per_second=1000,
        **{"message.timeout.ms": 2000},
    ).start()
    load.wait_delivered(total // 3)
    restartable.kill()
    failed = load.finish(30)
    assert failed > 0, "some records must have been cut off by the crash"
    second = restartable.start()
    resumed = DedupProducer(second.bootstrap, "p-resume", admin_url=second.admin_url)
    last = resumed.last_sequence_id(topic)
    assert last >= load.delivered - 1, "at least what was acknowledged is known"
    for sequence in range(last + 1, total):
        resumed.send(topic, str(sequence).encode(), sequence_id=sequence)
    assert resumed.flush(120) == 0
    assert_topic_is(local_env.bootstrap, topic, total)


def test_restart_with_a_snapshot_far_behind_replays_the_tail(
    local_env: EnvInfo, tmp_path: Path
) -> None:
    restartable = recovery_proxy(
        local_env,
        tmp_path,
        DEDUP_PROXY_SNAPSHOT_EVERY_RECORDS="100000000",
        DEDUP_PROXY_SNAPSHOT_EVERY_S="3600",
    )
    topic = new_topic(local_env.bootstrap)
    total = 8000
    try:
        first = restartable.start()
        blind_resend(first, topic, "p-tail", range(total))
        restartable.kill()
        # Redis too: only the snapshot (taken at the first recovery, before any record)
        # and the log are left to recover from.
        redis.Redis.from_url(restartable.redis_url).flushdb()
        second = restartable.start()
        blind_resend(second, topic, "p-tail", range(total))
        assert_topic_is(local_env.bootstrap, topic, total)
        (line,) = recoveries(restartable, topic=topic, replayed=total)
        assert '"identified": 8000' in line, line
    finally:
        restartable.stop()


def test_a_sequence_of_an_aborted_transaction_is_written_when_resent_after_a_recovery(
    rare_snapshots: RestartableProxy, local_env: EnvInfo
) -> None:
    """Records sent in a transaction pass the proxy unchecked; once it aborted they are not
    in the log for a read_committed reader. The replay must not count them: read as
    persisted, their re-send outside a transaction was dropped while acknowledged (lost)."""
    restartable = rare_snapshots
    topic = new_topic(local_env.bootstrap)
    first = restartable.start()
    blind_resend(first, topic, "p-aborted", range(3))
    transactional = _open_transaction(first.bootstrap, topic, "p-aborted", (3, 4))
    transactional.abort_transaction(30)
    restartable.kill()
    redis.Redis.from_url(restartable.redis_url).flushdb()  # the log is all that is left
    second = restartable.start()
    blind_resend(second, topic, "p-aborted", range(5))
    assert_topic_is(local_env.bootstrap, topic, 5)
    assert recoveries(restartable, topic=topic, identified=3), "the aborted two counted"


def test_a_transaction_open_at_the_recovery_is_waited_for_and_its_abort_respected(
    rare_snapshots: RestartableProxy, local_env: EnvInfo
) -> None:
    """A transaction still open when the partition is recovered holds the last stable
    offset back: the replay waits for it (`replay_transaction_wait_s`). It aborts during
    the wait, so its sequences do not count and their re-send outside a transaction is
    written. (Counted as read uncommitted, they were dropped while acknowledged: lost.)
    The transactional client writes to Kafka directly: its requests would pass the proxy
    unchecked, and it must outlive the proxy it would otherwise be connected to."""
    restartable = rare_snapshots
    topic = new_topic(local_env.bootstrap)
    first = restartable.start()
    blind_resend(first, topic, "p-open", range(3))
    transactional = _open_transaction(local_env.bootstrap, topic, "p-open", (3, 4))
    restartable.kill()
    redis.Redis.from_url(restartable.redis_url).flushdb()  # the log is all that is left
    second = restartable.start()
    aborting = threading.Timer(3.0, transactional.abort_transaction, args=(30,))
    aborting.start()
    try:
        blind_resend(second, topic, "p-open", range(5))
    finally:
        aborting.join()
    assert_topic_is(local_env.bootstrap, topic, 5)
    (line,) = recoveries(restartable, topic=topic, identified=3)
    recovered = json.loads(line)
    assert recovered["read_uncommitted_from"] is None, line
    assert recovered["waited_for_transactions_s"] > 0, line


def test_a_transaction_longer_than_the_fixed_wait_is_waited_for_until_kafka_aborts_it(
    local_env: EnvInfo, tmp_path: Path
) -> None:
    """A client whose transaction.timeout.ms is longer than `replay_transaction_wait_s`, and
    that never ends its transaction: Kafka tells the transaction's deadline, and the replay
    waits until Kafka aborted it, not just the fixed 1 s. Counted after 1 s, its two records
    read as persisted and their re-send was dropped (3 records in the topic, not 5).
    Meanwhile another topic's first use is recovered and written: the wait holds up no
    other partition's recovery."""
    restartable = recovery_proxy(local_env, tmp_path, DEDUP_PROXY_REPLAY_TRANSACTION_WAIT_S="1")
    topic, other = new_topic(local_env.bootstrap), new_topic(local_env.bootstrap)
    try:
        blind_resend(restartable.start(), topic, "p-abandoned", range(3))
        _open_transaction(local_env.bootstrap, topic, "p-abandoned", (3, 4), timeout_s=6)
        restartable.kill()
        redis.Redis.from_url(restartable.redis_url).flushdb()
        second = restartable.start()
        resending = threading.Thread(
            target=blind_resend, args=(second, topic, "p-abandoned", range(5))
        )
        resending.start()
        wait_until(
            lambda: restartable.log_lines("waiting for a transaction open in the log to end"),
            30,
            "the recovery waits for the open transaction",
        )
        blind_resend(second, other, "p-other", range(3))
        assert not recoveries(restartable, topic=topic, identified=3), "written meanwhile"
        resending.join(120)
        assert_topic_is(local_env.bootstrap, other, 3)
        assert_topic_is(local_env.bootstrap, topic, 5)
        (line,) = recoveries(restartable, topic=topic, identified=3)
        recovered = json.loads(line)
        assert recovered["read_uncommitted_from"] is None, line
        assert recovered["waited_for_transactions_s"] > 1, line
        (waiting,) = restartable.log_lines("waiting for a transaction open in the log to end")
        assert 6 < json.loads(waiting)["wait_s"] <= 36, waiting  # its timeout, plus 30 s
        assert not restartable.log_lines("a transaction stayed open past the replay's wait")
    finally:
        restartable.stop()


def test_a_transaction_still_open_after_the_wait_counts_with_a_warning(
    local_env: EnvInfo, tmp_path: Path
) -> None:
    """Past the wait (here `replay_transaction_wait_max_s`, below the transaction's
    deadline) the replay reads on uncommitted from the open transaction's first record, and
    its records count (the README's limit): the recovery says so in a warning and a metric."""
    restartable = recovery_proxy(
        local_env,
        tmp_path,
        DEDUP_PROXY_REPLAY_TRANSACTION_WAIT_S="1",
        DEDUP_PROXY_REPLAY_TRANSACTION_WAIT_MAX_S="1",
    )
    topic = new_topic(local_env.bootstrap)
    transactional = None
    try:
        blind_resend(restartable.start(), topic, "p-still-open", range(3))
        transactional = _open_transaction(local_env.bootstrap, topic, "p-still-open", (3, 4))
        restartable.kill()
        redis.Redis.from_url(restartable.redis_url).flushdb()
        second = restartable.start()
        blind_resend(second, topic, "p-still-open", range(3))  # all three below the open two
        (line,) = recoveries(restartable, topic=topic, identified=5, read_uncommitted_from=3)
        assert 1 <= json.loads(line)["waited_for_transactions_s"] < 10, line  # the setting's
        (warning,) = restartable.log_lines("a transaction stayed open past the replay's wait")
        assert f'"topic": "{topic}"' in warning, warning
        assert metric_total(second, "dedup_replays_past_open_transactions_total") == 1
    finally:
        if transactional is not None:
            transactional.abort_transaction(30)
        restartable.stop()
    assert_topic_is(local_env.bootstrap, topic, 3)


def _open_transaction(
    bootstrap: str,
    topic: str,
    producer: str,
    sequences: Iterable[int],
    timeout_s: float = 60,
) -> Producer:
    """A transactional client that wrote ``sequences`` under ``producer``'s identity to
    partition 0 and has not ended its transaction (Kafka aborts it after ``timeout_s``)."""
    transactional = begun_transaction(bootstrap, timeout_s)
    for sequence in sequences:
        transactional.produce(
            topic,
            str(sequence).encode(),
            partition=0,
            headers=[(HEADER_PRODUCER, producer.encode()), (HEADER_SEQUENCE, b"%d" % sequence)],
        )
    assert transactional.flush(30) == 0
    return transactional


def test_graceful_stop_snapshots_so_the_restart_replays_nothing(
    rare_snapshots: RestartableProxy, local_env: EnvInfo
) -> None:
    restartable, topic = rare_snapshots, new_topic(local_env.bootstrap)
    blind_resend(restartable.start(), topic, "p-stop", range(3000))
    restartable.stop()  # SIGTERM: drain, then a snapshot of every changed partition
    blind_resend(restartable.start(), topic, "p-stop", range(3000))
    assert_topic_is(local_env.bootstrap, topic, 3000)
    _, second = recoveries(restartable, topic=topic)
    assert '"replayed": 0' in second, second


# ----------------------------------------------------------------------------- Redis


@pytest.fixture
def rare_snapshots(local_env: EnvInfo, tmp_path: Path) -> Iterator[RestartableProxy]:
    """Snapshots only when asked: what came after one can only be known by replaying it."""
    proxy = recovery_proxy(
        local_env,
        tmp_path,
        DEDUP_PROXY_SNAPSHOT_EVERY_RECORDS="100000000",
        DEDUP_PROXY_SNAPSHOT_EVERY_S="3600",
    )
    yield proxy
    proxy.stop()


def _quiet_producer_before_the_fault(restartable: RestartableProxy, topic: str) -> None:
    """A snapshot of the (new) partition, then 1000 records of a producer that then falls
    silent: after the fault nothing but the replay of the tail knows them."""
    proxy_json(restartable, f"/v1/topics/{topic}/partitions/0/recover", "POST")
    taken = proxy_json(restartable, f"/v1/topics/{topic}/partitions/0/snapshot", "POST")
    assert taken["producers"] == 0
    assert restartable.process is not None
    blind_resend(restartable.process, topic, "p-quiet", range(1000), prefix="q")


def _read_back(bootstrap: str, topic: str, total: int) -> None:
    """The load's 0..total-1 in order and the quiet producer's 1000 records, each once."""
    written = values(bootstrap, topic)
    quiet = [v for v in written if v.startswith(b"q")]
    assert quiet == [f"q{i}".encode() for i in range(1000)]
    assert_exactly_once_in_order([v for v in written if not v.startswith(b"q")], total)


def test_redis_flushed_under_load(rare_snapshots: RestartableProxy, local_env: EnvInfo) -> None:
    restartable, topic, total = rare_snapshots, new_topic(local_env.bootstrap), 6000
    proxy = restartable.start()
    _quiet_producer_before_the_fault(restartable, topic)
    load = SequencedProducer(proxy.bootstrap, topic, "p-flush", total).start()
    load.wait_delivered(total // 3)
    redis.Redis.from_url(restartable.redis_url).flushdb()
    blind_resend(proxy, topic, "p-quiet", range(1000), prefix="q")  # all duplicates
    load.join()  # the load's own retries across the loss
    blind_resend(proxy, topic, "p-flush", range(0, total, 7))
    _read_back(local_env.bootstrap, topic, total)
    assert len(recoveries(restartable, topic=topic)) >= 2, "first use, then the lost state"
    assert any('"state lost"' in line for line in restartable.log_events())


@pytest.mark.parametrize("check_state", ["memory", "redis"])
def test_redis_killed_and_restarted_empty_under_load(
    check_state: str, local_env: EnvInfo, local_environment: LocalEnvironment, tmp_path: Path
) -> None:
    """With the maps in Redis, requests are refused (retriable) while it is down; with them
    in the owner's memory, requests go on and the acknowledged copy waits. Either way the
    empty Redis is noticed and the partition recovered from the log."""
    restartable = recovery_proxy(
        local_env,
        tmp_path,
        DEDUP_PROXY_SNAPSHOT_EVERY_RECORDS="100000000",
        DEDUP_PROXY_SNAPSHOT_EVERY_S="3600",
        DEDUP_PROXY_CHECK_STATE=check_state,
    )
    try:
        _killed_redis_comes_back_empty(restartable, check_state, local_env, local_environment)
    finally:
        restartable.stop()


def _killed_redis_comes_back_empty(
    restartable: RestartableProxy,
    check_state: str,
    local_env: EnvInfo,
    local_environment: LocalEnvironment,
) -> None:
    topic, total = new_topic(local_env.bootstrap), 6000
    proxy = restartable.start()
    _quiet_producer_before_the_fault(restartable, topic)
    load = SequencedProducer(proxy.bootstrap, topic, "p-redis", total).start()
    load.wait_delivered(total // 3)
    noticed = REDIS_DOWN if check_state == "redis" else COPY_FAILING
    noticed_before = len(restartable.log_lines(noticed))
    local_environment.kill_redis()
    wait_until(  # the check refuses, retriable; or the copy written behind waits
        lambda: len(restartable.log_lines(noticed)) > noticed_before,
        30,
        f"the proxy logs {noticed!r} for want of Redis",
    )
    local_environment.start_redis(empty=True)
    blind_resend(proxy, topic, "p-quiet", range(1000), prefix="q")
    load.join()
    blind_resend(proxy, topic, "p-redis", range(total // 2, total))
    _read_back(local_env.bootstrap, topic, total)
    assert len(recoveries(restartable, topic=topic)) >= 2, "first use, then the empty Redis"


@pytest.mark.parametrize("check_state", ["memory", "redis"])
def test_a_blackholed_redis_is_answered_within_its_timeout(
    check_state: str, local_env: EnvInfo, tmp_path: Path
) -> None:
    """Redis stops answering, its connections left open (a blackholed network): a Produce
    is answered within the Redis timeout instead of hanging ("retry" with the check in
    Redis; written, with the maps in the owner's memory), and once Redis answers again the
    producer's records land once each (a check held in the network and run late
    included)."""
    relay, relayed = relayed_redis(local_env.redis, REDIS_RELAY, REDIS_DB)
    restartable = recovery_proxy(
        local_env,
        tmp_path,
        DEDUP_PROXY_REDIS=relayed,
        DEDUP_PROXY_REDIS_TIMEOUT_S="1",
        DEDUP_PROXY_CHECK_STATE=check_state,
    )
    try:
        proxy = restartable.start()
        topic = new_topic(local_env.bootstrap)
        blind_resend(proxy, topic, "p-hole", range(100))
        relay.freeze()
        started = time.monotonic()
        answer = produce_raw(
            proxy, produce_request(topic, {0: explicit_batch([("p-hole", 100), ("p-hole", 101)])})
        )
        waited = time.monotonic() - started
        relay.thaw()
        assert answer.error_code == (NOT_ENOUGH_REPLICAS if check_state == "redis" else 0), answer
        # The policies' re-read and the check, a second each, and some slack.
        assert waited < 8, f"answered after {waited:.1f} s"
        blind_resend(proxy, topic, "p-hole", range(100, 300))
        if check_state == "redis":
            assert_topic_is(local_env.bootstrap, topic, 300)
        else:  # 100 and 101 were written with the maps in memory: their re-sends are dropped
            written = [str(n).encode() for n in range(300)]
            written[100:102] = [b"v100", b"v101"]
            assert values(local_env.bootstrap, topic) == written
    finally:
        restartable.stop()
        relay.stop()


# ----------------------------------------------------------------------------- snapshots


def _write_with_snapshots(restartable: RestartableProxy, topic: str, total: int) -> None:
    proxy = restartable.start()
    for start in range(0, total, 500):  # several snapshots: every 100 records
        blind_resend(proxy, topic, "p-snap", range(start, min(start + 500, total)))
        _wait_for_the_snapshotter(restartable, topic)
    listed = proxy_json(restartable, "/v1/snapshots")
    (partition,) = [p for p in listed["partitions"] if p["topic"] == topic]
    assert partition["snapshot_offset"] is not None and partition["next_generation"] >= 2


def _wait_for_the_snapshotter(restartable: RestartableProxy, topic: str) -> None:
    """Until no snapshot of the partition is due: every write settled, and fewer records
    since the last snapshot than take one (the snapshotter looks once a second)."""
    every = int(restartable.settings["DEDUP_PROXY_SNAPSHOT_EVERY_RECORDS"])
    seen: list[dict[str, Any]] = []

    def caught_up() -> bool:
        listed = proxy_json(restartable, "/v1/snapshots")
        seen[:] = [p for p in listed["partitions"] if p["topic"] == topic]
        return any(p["writes_unsettled"] == 0 and p["records_since_snapshot"] < every for p in seen)

    wait_until(caught_up, 30, lambda: f"no snapshot is due: {seen}")


def proxy_json(restartable: RestartableProxy, path: str, method: str = "GET") -> Any:
    import urllib.request

    assert restartable.process is not None
    request = urllib.request.Request(restartable.process.admin_url + path, method=method)
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.load(answer)


def _corrupt(restartable: RestartableProxy, topic: str, generations: list[int]) -> None:
    """Write garbage under the snapshot keys of these generations."""
    producer = Producer({"bootstrap.servers": restartable.env.bootstrap})
    slot = snapshot_partition(topic, 0, 1)
    for generation in generations:
        key = slot_key(topic, 0, generation)
        producer.produce(restartable.snapshot_topic, b"\x00garbage", key=key, partition=slot)
    assert producer.flush(30) == 0


async def _stored_generations(restartable: RestartableProxy, topic: str) -> list[int]:
    store = SnapshotStore(restartable.env.bootstrap, restartable.snapshot_topic)
    try:
        found = (await store.read([(topic, 0)]))[(topic, 0)]
        return [s.generation for s in found.valid]
    finally:
        await store.close()


@pytest.mark.parametrize("damage", ["newest-corrupt", "all-corrupt", "topic-deleted"])
def test_damaged_snapshots_fall_back_and_lose_nothing(
    local_env: EnvInfo, tmp_path: Path, damage: str
) -> None:
    import asyncio

    restartable = recovery_proxy(local_env, tmp_path, DEDUP_PROXY_SNAPSHOT_EVERY_RECORDS="100")
    topic = new_topic(local_env.bootstrap)
    total = 2000
    try:
        _write_with_snapshots(restartable, topic, total)
        restartable.kill()
        redis.Redis.from_url(restartable.redis_url).flushdb()
        generations = asyncio.run(_stored_generations(restartable, topic))
        assert len(generations) == 2, generations
        if damage == "newest-corrupt":
            _corrupt(restartable, topic, generations[:1])
        elif damage == "all-corrupt":
            _corrupt(restartable, topic, generations)
        else:
            admin = AdminClient({"bootstrap.servers": local_env.bootstrap})
            admin.delete_topics([restartable.snapshot_topic])[restartable.snapshot_topic].result(30)
            wait_until(
                lambda: restartable.snapshot_topic not in admin.list_topics(timeout=10).topics,
                30,
                "the snapshot topic is gone from the metadata",
            )
        proxy = restartable.start()
        blind_resend(proxy, topic, "p-snap", range(total))
        assert_topic_is(local_env.bootstrap, topic, total)
        events = "\n".join(restartable.log_events())
        if damage == "newest-corrupt":
            assert "ignoring an unreadable snapshot" in events
            assert "recovering from an older snapshot" in events
        elif damage == "all-corrupt":
            assert "no usable snapshot; replaying from the start of the log" in events
        (after,) = [
            line
            for line in (tmp_path / "proxy-2.log").read_text().splitlines()
            if '"partition recovered"' in line and topic in line
        ]
        if damage != "newest-corrupt":
            assert '"snapshot_offset": null' in after, after
        assert proxy.health() is not None, "recovered, no crash loop"
    finally:
        restartable.stop()


# ----------------------------------------------------------------------------- fencing


async def _describe_writer(bootstrap: str, topic: str) -> tuple[int, int, int]:
    """(producer id, epoch, last sequence) of the partition's latest idempotent writer."""
    import kio.schema.describe_producers.v0.request as describe
    from kio.schema.types import TopicName
    from kio.static.primitive import i32

    from proxy.kafka.topology import Endpoint
    from proxy.kafka.upstream_client import UpstreamClient

    request = describe.DescribeProducersRequest(
        topics=(describe.TopicRequest(name=TopicName(topic), partition_indexes=(i32(0),)),)
    )
    async with UpstreamClient(Endpoint.parse(bootstrap), 10) as client:
        response = await client.request(request)
    (partition,) = response.topics[0].partitions
    latest = max(partition.active_producers, key=lambda p: int(p.last_timestamp))
    return int(latest.producer_id), int(latest.producer_epoch), int(latest.last_sequence)


async def _zombie_write(bootstrap: str, topic: str, writer: tuple[int, int, int]) -> int:
    """What a write of the killed proxy, delivered late, would do: its producer id and
    epoch, the next sequence. Returns Kafka's error code."""
    import datetime

    import kio.schema.produce.v11.request as produce
    from kio.schema.types import TopicName
    from kio.static.primitive import Records, i16, i32, i32Timedelta

    from dedup.batches import IncomingRecord, build_batch
    from proxy.kafka.topology import Endpoint
    from proxy.kafka.upstream_client import UpstreamClient

    producer_id, epoch, last_sequence = writer
    record = IncomingRecord(0, int(time.time() * 1000), None, b"zombie", (), None)
    batch = build_batch(
        [record],
        compression=0,
        timestamp_type=0,
        producer_id=producer_id,
        producer_epoch=epoch,
        base_sequence=last_sequence + 1,
        add_identity_headers=False,
    )
    request = produce.ProduceRequest(
        transactional_id=None,
        acks=i16(-1),
        timeout=i32Timedelta.parse(datetime.timedelta(seconds=10)),
        topic_data=(
            produce.TopicProduceData(
                name=TopicName(topic),
                partition_data=(
                    produce.PartitionProduceData(index=i32(0), records=Records(batch)),
                ),
            ),
        ),
    )
    async with UpstreamClient(Endpoint.parse(bootstrap), 10) as client:
        response = await client.request(request)
    return int(response.responses[0].partition_responses[0].error_code)


def test_a_late_write_of_the_killed_proxy_is_refused_after_the_restart(
    restartable: RestartableProxy, local_env: EnvInfo
) -> None:
    """The fence: once the restarted proxy recovered the partition, a batch the killed one
    still had on its way (its producer id, epoch and next sequence) cannot land."""
    import asyncio

    topic = new_topic(local_env.bootstrap)
    first = restartable.start()
    blind_resend(first, topic, "p-fence", range(100))
    writer = asyncio.run(_describe_writer(local_env.bootstrap, topic))
    restartable.kill()
    restartable.start()
    proxy_json(restartable, f"/v1/topics/{topic}/partitions/0/recover", "POST")
    assert asyncio.run(_zombie_write(local_env.bootstrap, topic, writer)) in (
        47,  # INVALID_PRODUCER_EPOCH
        90,  # PRODUCER_FENCED
    )
    assert b"zombie" not in values(local_env.bootstrap, topic)


@pytest.mark.parametrize(
    "snapshot", ["before the writes", "after the writes", "after the writes, without appends"]
)
def test_a_batch_resent_after_a_crash_is_answered_with_its_originals_offset(
    rare_snapshots: RestartableProxy, local_env: EnvInfo, snapshot: str
) -> None:
    """The proxy killed after writing batches whose answers never left: the restarted one
    answers their re-sends as Kafka's broker answers a duplicate batch, with the
    original's offset and log append time. A Java producer then reports where its records
    are, not -1; librdkafka, which numbers a batch's records from the answer's base, no
    longer reports -1, 0, 1, ... (other records' offsets).
    - A snapshot before the writes: the recovery reads where they are in the log's tail.
    - A snapshot after them: the recovery replays nothing, and the snapshot carries where
      they are (as one taken at a handoff carries it to the next owner).
    - The same with `snapshot_appends` off (a rolling upgrade): answered -1, as before."""
    restartable = rare_snapshots
    without = snapshot.endswith("without appends")
    if without:
        restartable.settings["DEDUP_PROXY_SNAPSHOT_APPENDS"] = "false"
    topic = new_topic(local_env.bootstrap, config={"message.timestamp.type": "LogAppendTime"})

    def send(proxy: ProxyProcess, base: int, count: int) -> Any:
        keys = [f"k{base + i}".encode() for i in range(count)]
        return produce_raw(
            proxy, produce_request(topic, {0: idempotent_batch(keys, 7272, 0, base)})
        )

    def take_snapshot() -> Any:
        return proxy_json(restartable, f"/v1/topics/{topic}/partitions/0/snapshot", "POST")

    first = restartable.start()
    proxy_json(restartable, f"/v1/topics/{topic}/partitions/0/recover", "POST")
    if snapshot == "before the writes":
        assert take_snapshot()["producers"] == 0, "the writes are in the tail alone"
    sent = [send(first, 0, 2), send(first, 2, 3)]
    assert [a.error_code for a in sent] == [0, 0]
    if snapshot.startswith("after the writes"):
        assert take_snapshot()["producers"] == 1
    restartable.kill()
    again = restartable.start()
    resent = [send(again, 0, 2), send(again, 2, 3), send(again, 3, 2)]
    assert [(a.error_code, a.base_offset, a.log_append_time) for a in resent] == (
        [(0, -1, None)] * 3
        if without
        else [
            *[(0, a.base_offset, a.log_append_time) for a in sent],
            (0, sent[1].base_offset + 1, sent[1].log_append_time),  # within the second batch
        ]
    )
    offsets = offsets_by_value(local_env.bootstrap, topic)
    assert [offsets[f"k{i}".encode()] for i in (0, 2, 3)] == [
        sent[0].base_offset,
        sent[1].base_offset,
        sent[1].base_offset + 1,
    ]
    assert values(local_env.bootstrap, topic) == [f"k{i}".encode() for i in range(5)]
    start = {"replayed": 5} if snapshot == "before the writes" else {"snapshot_offset": 5}
    assert recoveries(restartable, topic=topic, **start), "the restart's recovery"


# -------------------------------------------------------------------------- a topic created again


@contextlib.contextmanager
def proxy_that_wrote(
    local_env: EnvInfo, tmp_path: Path, watch_s: int, **settings: str
) -> Iterator[tuple[RestartableProxy, ProxyProcess, str]]:
    """A proxy whose topic watch looks every `watch_s` seconds, and a topic of which it
    wrote producer p-deleted's sequences 0-9 (so it holds its partition); stopped on exit.
    ``settings``: more of the proxy's (DEDUP_PROXY_*)."""
    restartable = recovery_proxy(
        local_env, tmp_path, DEDUP_PROXY_TOPIC_ID_CHECK_S=str(watch_s), **settings
    )
    proxy = restartable.start()
    try:
        topic = new_topic(local_env.bootstrap)
        blind_resend(proxy, topic, "p-deleted", range(10))
        yield restartable, proxy, topic
    finally:
        restartable.stop()


def holds(restartable: RestartableProxy, topic: str) -> bool:
    """Whether the proxy holds the lease of the topic's partition 0."""
    return f"{topic}/0" in proxy_json(restartable, "/v1/ownership")["held"]


def test_a_deleted_topics_partition_is_given_up_and_taken_anew_once_created_again(
    local_env: EnvInfo, tmp_path: Path
) -> None:
    """A topic is deleted under a partition this instance holds. Within the topic watch's
    period (`topic_id_check_s`, 1 s here) its lease is given up; nothing is recovered or
    retried for it, and a request to it is answered UNKNOWN_TOPIC_OR_PARTITION, as Kafka
    answers. Before, its lease was renewed for as long as the proxy ran, and once a
    request had found the topic gone, its recovery failed and was retried every 30 s.
    Created again, the topic starts afresh: the same producer's sequence 0 is new."""
    bootstrap = local_env.bootstrap
    with proxy_that_wrote(local_env, tmp_path, watch_s=1) as (restartable, proxy, topic):
        assert holds(restartable, topic)
        delete_topic(bootstrap, topic)
        wait_until(
            lambda: not holds(restartable, topic), 30, "the deleted topic's partition given up"
        )
        assert metric_total(proxy, "dedup_topic_deleted_total") == 1
        request = produce_request(topic, {0: explicit_batch([("p-deleted", 10)])})
        wait_until(
            lambda: produce_raw(proxy, request).error_code == UNKNOWN_TOPIC_OR_PARTITION,
            30,
            "a request to the deleted topic answered as Kafka answers it",
        )
        time.sleep(3)  # three watch periods, and more than the recoveries' first pauses
        assert not holds(restartable, topic)
        assert metric_total(proxy, 'dedup_recoveries_total{result="failed"}') == 0
        rows = proxy_json(restartable, "/v1/snapshots")["partitions"]
        assert [p["recovery_failing"] for p in rows if p["topic"] == topic] in ([], [None])
        assert metric_total(proxy, "dedup_topic_deleted_total") == 1, "given up once"

        create_again(bootstrap, topic)
        blind_resend(proxy, topic, "p-deleted", range(5))
        assert values(bootstrap, topic) == [str(n).encode() for n in range(5)]


def test_a_deleted_topics_partition_leaves_the_writer_and_comes_back_whole(
    local_env: EnvInfo, tmp_path: Path
) -> None:
    """Topics deleted one after another must not grow the proxy: a deleted topic's
    partition is kept as absent, the writer's producer and sequence for it too, only
    while it is among the latest `max_absent_partitions` (1 here). A request to a partition
    Kafka does not have pushes it out, and the writer forgets it. Created again, the topic
    takes every record of its producer's next writes."""
    bootstrap = local_env.bootstrap
    with proxy_that_wrote(
        local_env, tmp_path, watch_s=1, DEDUP_PROXY_MAX_ABSENT_PARTITIONS="1"
    ) as (restartable, proxy, topic):
        assert metric_total(proxy, "dedup_writer_partitions") == 1
        delete_topic(bootstrap, topic)
        wait_until(
            lambda: not holds(restartable, topic), 30, "the deleted topic's partition given up"
        )
        assert metric_total(proxy, "dedup_writer_partitions") == 1, "the latest absent one"
        other = new_topic(bootstrap)  # one partition: its partition 5 does not exist
        ghost = produce_request(other, {5: explicit_batch([("p-ghost", 0)])})
        assert produce_raw(proxy, ghost).error_code == UNKNOWN_TOPIC_OR_PARTITION
        assert metric_total(proxy, "dedup_writer_partitions") == 0

        create_again(bootstrap, topic)
        blind_resend(proxy, topic, "p-deleted", range(10))
        blind_resend(proxy, topic, "p-deleted", range(15))
        assert values(bootstrap, topic) == [str(n).encode() for n in range(15)]
        assert metric_total(proxy, "dedup_writer_partitions") == 1


def test_a_recovery_that_finds_the_topic_deleted_is_not_retried(
    local_env: EnvInfo, tmp_path: Path
) -> None:
    """With the topic watch out of the way (one look an hour), a request whose records
    are to be dropped finds the topic deleted (its id asked of the leader): it is answered
    UNKNOWN_TOPIC_OR_PARTITION, and the partition's recovery that follows fails for that
    reason and is not tried again, and gives the partition's lease up at once. Before, it
    was retried every 30 s for as long as the proxy ran, and `dedup_recoveries_failing`
    stayed above 0; then, the lease was kept until the watch's next look."""
    with proxy_that_wrote(local_env, tmp_path, watch_s=3600) as (restartable, proxy, topic):
        assert holds(restartable, topic)
        delete_topic(local_env.bootstrap, topic)
        again = produce_request(topic, {0: explicit_batch([("p-deleted", 5)])})  # a duplicate
        assert produce_raw(proxy, again).error_code == UNKNOWN_TOPIC_OR_PARTITION
        wait_until(
            lambda: metric_total(proxy, 'dedup_recoveries_total{result="topic_deleted"}') == 1,
            30,
            "the recovery found the topic deleted",
        )
        wait_until(
            lambda: not holds(restartable, topic), 10, "the deleted topic's partition given up"
        )
        time.sleep(3)  # more than the first retry pauses (0.5 s, doubling)
        assert metric_total(proxy, 'dedup_recoveries_total{result="topic_deleted"}') == 1
        assert metric_total(proxy, 'dedup_recoveries_total{result="failed"}') == 0
        assert metric_total(proxy, "dedup_recoveries_failing") == 0
        assert metric_total(proxy, "dedup_topic_deleted_total") == 1
        assert not holds(restartable, topic)


def test_a_topic_that_does_not_exist_is_answered_unknown_beside_one_that_is_written(
    restartable: RestartableProxy, local_env: EnvInfo
) -> None:
    """One request to a topic and to a topic that does not exist (a client that skipped
    Metadata, or a topic deleted under it): the missing topic's partition is answered
    UNKNOWN_TOPIC_OR_PARTITION, as Kafka answers it, before any lease or recovery (so
    nothing is left retrying); the other's record is written."""
    topic, missing = new_topic(local_env.bootstrap), f"never-created-{uuid.uuid4().hex[:8]}"
    proxy = restartable.start()
    request = produce_request_to(
        {topic: {0: explicit_batch([("p", 0)])}, missing: {0: explicit_batch([("p", 0)])}}
    )
    answers: dict[tuple[str, int], Any] = {}

    def recovered() -> bool:
        answers.update(produce_answers(proxy, request))
        return bool(answers[(topic, 0)].error_code != NOT_LEADER_OR_FOLLOWER)

    wait_until(recovered, timeout_s=60, what="the existing topic's partition recovered")
    assert answers[(topic, 0)].error_code == 0
    assert answers[(missing, 0)].error_code == UNKNOWN_TOPIC_OR_PARTITION
    partitions = proxy_json(restartable, "/v1/snapshots")["partitions"]
    rows = {p["topic"]: (p["recovered"], p["recovery_failing"]) for p in partitions}
    assert (rows[topic], rows[missing]) == ((True, None), (False, None)), "no recovery"
    assert f"{missing}/0" not in proxy_json(restartable, "/v1/ownership")["held"]
    assert len(values(local_env.bootstrap, topic)) == 1


def test_a_request_refused_before_a_partition_exists_is_not_overtaken_once_it_does(
    restartable: RestartableProxy, local_env: EnvInfo
) -> None:
    """A Kafka producer's first request to a partition is refused before the partition
    exists (UNKNOWN_TOPIC_OR_PARTITION: retry), before this instance holds its lease. The
    partition is then created, and the producer's next request arrives, sent before the
    first one's answer was read. It must be refused as a gap until the first is sent again,
    as Kafka's broker would: before, it was written, and the retry of the first then read
    as its duplicate and was dropped while acknowledged."""
    topic = new_topic(local_env.bootstrap)  # one partition; partition 1 comes later
    proxy = restartable.start()

    def send(base: int, count: int) -> Any:
        batch = idempotent_batch([f"k{base + i}".encode() for i in range(count)], 5151, 0, base)
        return produce_once(proxy, produce_request(topic, {1: batch}))

    assert send(0, 2).error_code == UNKNOWN_TOPIC_OR_PARTITION
    admin = AdminClient({"bootstrap.servers": local_env.bootstrap})
    admin.create_partitions([NewPartitions(topic, 2)])[topic].result(timeout=30)
    answers: list[Any] = []

    def past_the_first_use() -> bool:
        # Retry while the proxy does not know the partition yet or is recovering it.
        answers.append(send(2, 2))
        return bool(
            answers[-1].error_code not in (UNKNOWN_TOPIC_OR_PARTITION, NOT_LEADER_OR_FOLLOWER)
        )

    wait_until(past_the_first_use, timeout_s=60, what="partition 1 known to the proxy")
    ahead = answers[-1]
    assert ahead.error_code == NOT_ENOUGH_REPLICAS, ahead
    assert "skips ahead" in (ahead.error_message or ""), ahead.error_message
    assert [(a.error_code, a.base_offset) for a in (send(0, 2), send(2, 2))] == [(0, 0), (0, 2)]
    written = [value for value, _ in read_all(local_env.bootstrap, topic, 1)]
    assert written == [b"k0", b"k1", b"k2", b"k3"]


def test_a_request_reaching_the_new_owner_ahead_of_one_sent_to_the_old_is_refused(
    restartable: RestartableProxy, local_env: EnvInfo
) -> None:
    """A Kafka producer's request for records 2-3 was sent to the partition's owner, which
    was then killed; its next request, for 4-5, reaches the new owner first. The new owner
    knows the producer from the log alone (records 0-1, its implicit identities), as Kafka's
    new leader knows it from its replica, so 4-5 is refused as a gap until 2-3 comes again.
    Before, 4-5 was written, and the re-send of 2-3 then read as duplicates of a producer
    at 5 and was dropped while acknowledged."""
    topic = new_topic(local_env.bootstrap)
    restartable.start()

    def send(base: int, count: int) -> Any:
        assert restartable.process is not None
        batch = idempotent_batch([f"k{base + i}".encode() for i in range(count)], 6161, 0, base)
        return produce_raw(restartable.process, produce_request(topic, {0: batch}))

    assert send(0, 2).error_code == 0
    restartable.kill()  # the request for 2-3 never reaches it
    restartable.start()  # the new owner: takes the partition over and replays its log
    ahead = send(4, 2)
    assert ahead.error_code == NOT_ENOUGH_REPLICAS, ahead
    assert "skips ahead of 2" in (ahead.error_message or ""), ahead.error_message
    assert [(a.error_code, a.base_offset) for a in (send(2, 2), send(4, 2))] == [(0, 3), (0, 5)]
    assert values(local_env.bootstrap, topic) == [f"k{i}".encode() for i in range(6)]


def test_a_producers_first_request_is_not_overtaken_at_the_new_owner(
    restartable: RestartableProxy, local_env: EnvInfo
) -> None:
    """A Kafka producer's first request to the partition (records 0-1) was sent to its
    owner, which was then killed; its second (2-3) reaches the new owner first. The log
    does not name the producer, so nothing says where it is, except that a Kafka producer
    starts a partition at sequence 0: 2-3 is refused until 0-1 comes again. Before, 2-3
    was written, and the re-send of 0-1 then read as duplicates and was dropped while
    acknowledged."""
    topic = new_topic(local_env.bootstrap)
    restartable.start()

    def send(producer_id: int, base: int, count: int) -> Any:
        assert restartable.process is not None
        keys = [f"{producer_id}-{base + i}".encode() for i in range(count)]
        batch = idempotent_batch(keys, producer_id, 0, base)
        return produce_raw(restartable.process, produce_request(topic, {0: batch}))

    assert send(6262, 0, 2).error_code == 0  # another producer: the log is not empty
    restartable.kill()  # the request for 0-1 of producer 7272 never reaches it
    restartable.start()  # the new owner: takes the partition over and replays its log
    ahead = send(7272, 2, 2)
    assert ahead.error_code == NOT_ENOUGH_REPLICAS, ahead
    assert "sequence 0, sent to the owner before, may still come" in (ahead.error_message or "")
    assert send(7272, 2, 2).error_code == NOT_ENOUGH_REPLICAS, "still waiting for 0-1"
    answers = [send(7272, 0, 2), send(7272, 2, 2)]
    assert [(a.error_code, a.base_offset) for a in answers] == [(0, 3), (0, 5)]
    assert values(local_env.bootstrap, topic) == [
        f"{p}-{i}".encode() for p, n in ((6262, 2), (7272, 4)) for i in range(n)
    ]


def test_a_producer_the_log_lost_goes_on_after_the_wait_for_its_first_sequence(
    local_env: EnvInfo, tmp_path: Path
) -> None:
    """The wait is bounded (`first_sequence_wait_s`): a producer whose earlier records the
    log no longer holds (retention, compaction, a state purged as idle) is held up that
    long at a new owner, and then goes on, as Kafka takes a producer it does not know."""
    restartable = recovery_proxy(local_env, tmp_path, DEDUP_PROXY_FIRST_SEQUENCE_WAIT_S="2")
    try:
        topic = new_topic(local_env.bootstrap)
        restartable.start()

        def send(producer_id: int, base: int) -> Any:
            assert restartable.process is not None
            batch = idempotent_batch([f"{producer_id}-{base}".encode()], producer_id, 0, base)
            return produce_raw(restartable.process, produce_request(topic, {0: batch}))

        assert send(6363, 0).error_code == 0
        restartable.kill()
        restartable.start()
        assert send(7373, 40).error_code == NOT_ENOUGH_REPLICAS
        wait_until(lambda: send(7373, 40).error_code == 0, 30, "7373 goes on after the wait")
        assert send(7373, 41).error_code == 0
        assert values(local_env.bootstrap, topic) == [b"6363-0", b"7373-40", b"7373-41"]
    finally:
        restartable.stop()


JAVA_RECORDS = 1500  # VerifiableProducer's values: "0" to "1499", in order
JAVA_RATE = 100  # records a second


def _lose_the_producer_mid_run(
    restartable: RestartableProxy, topic: str, acked: Callable[[], int]
) -> None:
    """Once 300 records are acknowledged: the proxy killed, and the producer's records
    deleted from the log, Redis flushed and the snapshot topic deleted."""
    wait_until(lambda: acked() >= 300, 60, "300 records acknowledged")
    restartable.kill()
    bootstrap = restartable.env.bootstrap
    admin = AdminClient({"bootstrap.servers": bootstrap})
    end = end_offset(bootstrap, topic)
    for future in admin.delete_records([TopicPartition(topic, 0, end)]).values():
        future.result(timeout=30)
    redis.Redis.from_url(restartable.redis_url).flushdb()
    snapshots = restartable.snapshot_topic
    admin.delete_topics([snapshots])[snapshots].result(30)
    wait_until(
        lambda: snapshots not in admin.list_topics(timeout=10).topics,
        30,
        "the snapshot topic is gone from the metadata",
    )


def test_kafkas_java_producer_rides_out_the_wait_for_its_first_sequence(
    local_env: EnvInfo, tmp_path: Path
) -> None:
    """Kafka's own Java producer (VerifiableProducer, idempotent: the settings a Kafka
    3.0+ producer has by default, which the tool turns off unless told) meets the
    first-sequence wait. Mid-run the proxy is killed, and everything that named the
    producer is lost: its records deleted from the log, Redis flushed, the snapshots gone.
    The new owner knows nothing of a producer that goes on at sequence 300 or so: its
    batches are refused, retriable, for the wait (3 s here), and then written. The client
    reports no error, and the log holds every record from its first unacknowledged one
    on, once each, in order."""
    restartable = recovery_proxy(local_env, tmp_path, DEDUP_PROXY_FIRST_SEQUENCE_WAIT_S="3")
    topic = new_topic(local_env.bootstrap)
    try:
        proxy = restartable.start()
        settings = tmp_path / "producer.properties"
        settings.write_text("enable.idempotence=true\nacks=all\nretries=2147483647\n")

        def lose_the_producer(acked: Callable[[], int]) -> None:
            _lose_the_producer_mid_run(restartable, topic, acked)
            restartable.start()

        events = verifiable_producer_during(
            proxy.bootstrap,
            topic,
            JAVA_RECORDS,
            settings,
            lose_the_producer,
            *("--throughput", str(JAVA_RATE)),
        )
        assert sent(events) == (JAVA_RECORDS, [])
        assert restartable.process is not None
        assert metric_total(restartable.process, "dedup_sequence_gaps_total") >= 1, "met"
        # From the log's new start: offset 0 is gone (deleted records).
        earliest = {"auto.offset.reset": "earliest"}
        written = [int(v) for v, _ in read_all(local_env.bootstrap, topic, 0, **earliest)]
        assert written and written[0] <= 400, written[:5]
        assert written == list(range(written[0], JAVA_RECORDS)), "each once, in order"
    finally:
        restartable.stop()


def test_a_topic_created_again_under_a_running_proxy_takes_every_record(
    restartable: RestartableProxy, local_env: EnvInfo
) -> None:
    """Before: the deleted topic's state read the new topic's records as its duplicates,
    dropped them all and answered success; the new topic stayed empty."""
    topic, proxy = new_topic(local_env.bootstrap), restartable.start()
    blind_resend(proxy, topic, "p-again", range(100), prefix="old")
    delete_and_create_again(local_env.bootstrap, topic)
    resuming = DedupProducer(proxy.bootstrap, "p-again", admin_url=proxy.admin_url)
    assert resuming.last_sequence_id(topic) == -1, "a producer resuming starts from 0"
    blind_resend(proxy, topic, "p-again", range(100), prefix="new")
    assert values(local_env.bootstrap, topic) == [f"new{i}".encode() for i in range(100)]
    assert any("deleted and created again" in line for line in restartable.log_events())


def test_an_idle_partition_of_a_topic_created_again_is_rebuilt_without_a_request(
    local_env: EnvInfo, tmp_path: Path
) -> None:
    """The owner's watch (`topic_id_check_s`): no request of the new topic ever drops a
    record here, yet the state (and Redis's copy, which other instances read) becomes the
    new topic's."""
    restartable = recovery_proxy(local_env, tmp_path, DEDUP_PROXY_TOPIC_ID_CHECK_S="0.5")
    try:
        topic = new_topic(local_env.bootstrap)
        blind_resend(restartable.start(), topic, "p-idle", range(10))
        delete_and_create_again(local_env.bootstrap, topic)
        wait_until(
            lambda: len(recoveries(restartable, topic=topic)) == 2,
            30,
            lambda: f"a second recovery of {topic}: {recoveries(restartable, topic=topic)}",
        )
        first, second = recoveries(restartable, topic=topic)
        assert '"producers": 0' in first and '"producers": 0' in second, second
        assert any(
            "deleted and created again" in line and topic in line
            for line in restartable.log_events()
        )
    finally:
        restartable.stop()


def test_a_restart_ignores_the_snapshots_of_a_topic_since_created_again(
    rare_snapshots: RestartableProxy, local_env: EnvInfo
) -> None:
    """The new topic's log reaches past the old topic's snapshot (200 plain records): by
    its offset alone the snapshot would be used, and its producer's 100 sequences would
    drop the new topic's."""
    restartable, topic = rare_snapshots, new_topic(local_env.bootstrap)
    blind_resend(restartable.start(), topic, "p-again", range(100), prefix="old")
    restartable.stop()  # SIGTERM: a snapshot at offset 100, with the topic's id
    delete_and_create_again(local_env.bootstrap, topic)
    plain = Producer({"bootstrap.servers": local_env.bootstrap})
    for i in range(200):
        plain.produce(topic, f"plain{i}".encode())
    assert plain.flush(30) == 0
    blind_resend(restartable.start(), topic, "p-again", range(100), prefix="new")
    written = values(local_env.bootstrap, topic)
    assert written[200:] == [f"new{i}".encode() for i in range(100)]
    assert len(written) == 300
    assert any(
        "ignoring snapshots of an earlier topic" in line for line in restartable.log_events()
    )


# -------------------------------------------------------------------------- past the wrap


def test_a_kafka_producer_past_the_wrap_of_its_sequences_loses_nothing_over_a_crash(
    restartable: RestartableProxy, local_env: EnvInfo
) -> None:
    """Kafka numbers an idempotent producer's records to a partition with int32 sequences
    that wrap from 2^31-1 to 0. Such a producer's batches around the wrap, sent by hand
    (Kafka sees the proxy's own producer id and sequences): before, the records after the
    wrap were dropped as duplicates of the first ones."""
    wrap, topic = 1 << 31, new_topic(local_env.bootstrap)
    restartable.start()

    def send(base: int, count: int) -> Any:
        assert restartable.process is not None
        unwrapped = base if base >= wrap - 4 else wrap + base
        batch = idempotent_batch(
            [f"k{unwrapped - wrap + i}".encode() for i in range(count)], 4242, 3, base
        )
        return produce_raw(restartable.process, produce_request(topic, {0: batch}))

    assert [send(b, c).base_offset for b, c in ((wrap - 4, 2), (wrap - 2, 4), (2, 2))] == [
        0,
        2,
        6,
    ]
    restartable.kill()  # the restart knows the producer only from the log
    restartable.start()
    retried = send(2, 2)
    # A retry: a duplicate, answered with where its records are (the restart read them in
    # the log's tail, their sequences unwrapped as the check compares them).
    assert (retried.error_code, retried.base_offset) == (0, 6), "a retry: a duplicate"
    assert send(4, 2).error_code == 0
    assert values(local_env.bootstrap, topic) == [f"k{i}".encode() for i in range(-4, 6)]


def test_operations_from_the_shell(restartable: RestartableProxy, local_env: EnvInfo) -> None:
    """`dedup-proxy recover`, `snapshot` and `snapshots` against a running proxy."""
    import sys

    topic = new_topic(local_env.bootstrap)
    proxy = restartable.start()

    def run(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "dedup", *args, "--admin-url", proxy.admin_url],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    # A new topic needs no fence: offsets are exactly Kafka's.
    assert f"{topic}/0 recovered up to offset 0" in run("recover", topic, "0")
    blind_resend(proxy, topic, "p-ops", range(10))
    assert "at offset 10 (generation" in run("snapshot", topic, "0")
    listed = json.loads(run("snapshots", "--json-output"))
    (mine,) = [p for p in listed["partitions"] if p["topic"] == topic]
    assert (mine["recovered"], mine["snapshot_offset"], mine["acknowledged_end"]) == (True, 10, 10)
    assert topic in run("snapshots")  # the table
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "dedup",
            "snapshot",
            "no-such-topic",
            "0",
            "--admin-url",
            proxy.admin_url,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode != 0 and "is not recovered by this proxy" in refused.stderr


# ----------------------------------------------------------------------------- producer reset


@pytest.mark.parametrize("snapshot_at", [None, 50, 51], ids=["none", "before", "at-reset"])
def test_a_reset_producer_stays_reset_after_redis_is_lost(
    restartable: RestartableProxy, local_env: EnvInfo, snapshot_at: int | None
) -> None:
    """A forged record of sequence 10^12 silences producer `p` (its next records read as
    duplicates); an operator resets `p`; its records count again; then the proxy is killed
    and Redis flushed, so the state comes back from the log alone: replayed from the start
    (the replay forgets `p` at the reset's offset), or from a snapshot taken before the
    forged record, or from one at the reset's offset but before it."""
    topic = new_topic(local_env.bootstrap)
    proxy = restartable.start()
    blind_resend(proxy, topic, "p", range(50), prefix="a")
    if snapshot_at == 50:
        taken = admin_call(proxy, "POST", f"/v1/topics/{topic}/partitions/0/snapshot")
        assert taken["offset"] == 50
    forged = Producer({"bootstrap.servers": proxy.bootstrap})
    forged.produce(
        topic, b"forged", headers=[("dedup.producer", "p"), ("dedup.sequence", "1000000000000")]
    )
    assert forged.flush(60) == 0
    blind_resend(proxy, topic, "p", range(50, 55), prefix="lost")  # silenced: duplicates
    if snapshot_at == 51:
        taken = admin_call(proxy, "POST", f"/v1/topics/{topic}/partitions/0/snapshot")
        assert taken["offset"] == 51
    reset = admin_call(proxy, "POST", f"/v1/topics/{topic}/partitions/0/producers/p/reset")
    assert reset["offset"] == 51  # the partition's end: 50 records and the forged one
    blind_resend(proxy, topic, "p", range(50, 60), prefix="b")  # new again
    written = values(local_env.bootstrap, topic)
    assert written == [f"a{n}".encode() for n in range(50)] + [b"forged"] + [
        f"b{n}".encode() for n in range(50, 60)
    ]

    restartable.kill()
    redis.Redis.from_url(restartable.redis_url).flushdb()
    if snapshot_at is None:  # the snapshotter's own snapshots go: a replay from the start
        tombstones = Producer({"bootstrap.servers": restartable.env.bootstrap})
        for generation in (0, 1):
            tombstones.produce(
                restartable.snapshot_topic,
                None,
                key=slot_key(topic, 0, generation),
                partition=snapshot_partition(topic, 0, 1),
            )
        assert tombstones.flush(30) == 0
    proxy = restartable.start()
    blind_resend(proxy, topic, "p", range(55, 61), prefix="b")  # 55..59 again, then 60
    assert values(local_env.bootstrap, topic) == [*written, b"b60"]
    recovered = recoveries(restartable, topic=topic)
    assert f'"snapshot_offset": {"null" if snapshot_at is None else snapshot_at}' in recovered[-1]

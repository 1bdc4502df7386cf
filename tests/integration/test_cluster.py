"""A three-broker cluster behind the proxy: the partition leader dies under load and returns;
a consumer that names its rack reads from its rack's replica (each broker has a rack), through
a group of instances, one instance or sidecars; a share group reads through a group.

Runs on its own local environment (own state home and ports), so the single-broker one the
other tests share is left alone; it is stopped again at the end to give back its memory.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient

from deploy import paths
from deploy.config import rack_of
from deploy.launcher import ProxyProcess
from deploy.local import EnvInfo, LocalEnvironment, java_tool_command
from tests.support.kafka_io import assert_exactly_once_in_order, consume_confluent, values
from tests.support.load import BackgroundProducer, SequencedProducer
from tests.support.ports import CLUSTER_ENV, CLUSTER_PROXY, CLUSTER_SIDECARS, ProxyPorts
from tests.support.proxy_api import (
    FETCHES,
    NODE_ID_STRIDE,
    admin_call,
    all_see_each_other,
    metric_total,
)
from tests.support.racks import read_as_rack
from tests.support.topics import new_topic
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def three_brokers() -> Iterator[tuple[LocalEnvironment, EnvInfo]]:
    environment = LocalEnvironment(home=paths.state_home().parent / "test-3", ports=CLUSTER_ENV)
    info = environment.up(brokers=3)
    yield environment, info
    environment.down()


def listeners(proxy: ProxyProcess) -> set[int]:
    health = proxy.health() or {}
    return {int(node) for node in health.get("broker_listeners", {})}


def ownership_story(proxies: list[ProxyProcess], lines: int = 12) -> str:
    """Each proxy's last log lines about leases and handoffs: what a failed wait on
    ownership shows (pytest keeps few temporary directories, so the logs go with it)."""
    words = ("lease", "hand", "fence", "recover", "owner", "leader", "error")
    story = []
    for proxy in proxies:
        log = proxy.log_path.read_text(errors="replace") if proxy.log_path else ""
        relevant = [line for line in log.splitlines() if any(w in line for w in words)]
        story.append(f"--- {proxy.log_path}\n" + "\n".join(relevant[-lines:]))
    return "\n".join(story)


def replicated_topic(info: EnvInfo) -> tuple[str, int]:
    """A topic with replication factor 3, and its partition's leader."""
    topic = new_topic(info.bootstrap, replication_factor=3)  # returns once it has a leader
    admin = AdminClient({"bootstrap.servers": info.bootstrap})
    return topic, admin.list_topics(topic, timeout=30).topics[topic].partitions[0].leader


def cluster_proxy(
    info: EnvInfo,
    log_dir: Path,
    ports: ProxyPorts = CLUSTER_PROXY,
    name: str = "proxy",
    **settings: str,
) -> ProxyProcess:
    """A proxy in front of the three brokers, dedup on, state of this test only (unless
    `settings`, DEDUP_PROXY_* variables, say otherwise)."""
    return ProxyProcess(
        upstream=info.bootstrap,
        listen_port=ports.listen,
        admin_port=ports.admin,
        extra_args=["--broker-port-base", str(ports.broker_base)],
        env={
            "DEDUP_PROXY_METADATA_REFRESH_S": "1",
            "DEDUP_PROXY_REDIS": info.redis,
            "DEDUP_PROXY_REDIS_KEY_PREFIX": f"ha-{uuid.uuid4().hex[:8]}",
            **settings,
        },
        log_path=log_dir / f"{name}.log",
    ).start()


def test_leader_killed_under_load_clients_follow_through_the_proxy(
    three_brokers: tuple[LocalEnvironment, EnvInfo], tmp_path: Path
) -> None:
    environment, info = three_brokers
    topic, leader = replicated_topic(info)
    proxy = cluster_proxy(info, tmp_path)
    try:
        assert listeners(proxy) == {0, 1, 2}
        total = 4000
        producer = BackgroundProducer(proxy.bootstrap, topic, total).start()
        producer.wait_delivered(500)
        environment.kill_broker(leader)
        wait_until(lambda: leader not in listeners(proxy), 60, "the dead broker's listener closes")
        environment.start_broker(leader)
        wait_until(lambda: leader in listeners(proxy), 60, "the listener comes back")
        producer.join()
        values = [m.value() for m in consume_confluent(proxy.bootstrap, topic, total)]
        assert values == [str(i).encode() for i in range(total)]
    finally:
        assert proxy.stop() == 0


def test_leader_killed_under_load_explicit_identities_exactly_once(
    three_brokers: tuple[LocalEnvironment, EnvInfo], tmp_path: Path
) -> None:
    """The dedup path through a leader failover: writes in flight to the dying leader are
    resolved by the proxy's idempotent writer, re-sends are dropped, nothing is lost."""
    environment, info = three_brokers
    topic, leader = replicated_topic(info)
    proxy = cluster_proxy(info, tmp_path)
    try:
        total = 6000
        load = SequencedProducer(proxy.bootstrap, topic, "p-failover", total).start()
        load.wait_delivered(total // 4)
        environment.kill_broker(leader)
        load.wait_delivered(total // 2, timeout_s=120)  # continues on the new leader
        environment.start_broker(leader)
        load.join()
        resend = SequencedProducer(proxy.bootstrap, topic, "p-failover", total, start=total // 3)
        resend.start().join()  # a blind re-send of two thirds: all duplicates
        assert_exactly_once_in_order(values(info.bootstrap, topic), total)
    finally:
        assert proxy.stop() == 0


def test_sidecar_placement_ownership_follows_the_leader_it_is_killed_exactly_once(
    three_brokers: tuple[LocalEnvironment, EnvInfo], tmp_path: Path
) -> None:
    """A sidecar beside each broker owns the partitions its broker leads. The leader dies
    under load: its sidecar hands the partition over, writes go on, and the new leader's
    sidecar takes the partition at its first request after that; every record once, in
    order."""
    environment, info = three_brokers
    topic, leader = replicated_topic(info)
    sidecars = sidecar_group(info, tmp_path)

    def holders() -> list[int]:
        return [
            broker
            for broker, sidecar in enumerate(sidecars)
            if f"{topic}/0" in admin_call(sidecar, "GET", "/v1/ownership")["held"]
        ]

    try:
        # Paced to outlast the failover: some 6 s of load left when the broker dies.
        total = 8000
        other = (leader + 1) % 3  # the producer bootstraps from a sidecar that is not the owner
        bootstrap = sidecars[other].bootstrap
        load = SequencedProducer(bootstrap, topic, "p-sidecar", total, per_second=1000).start()
        load.wait_delivered(total // 4)
        assert holders() == [leader], "the leader's sidecar owns the partition"
        environment.kill_broker(leader)
        load.wait_delivered(total // 2, timeout_s=120)  # continues through the new one
        admin = AdminClient({"bootstrap.servers": info.bootstrap})

        def current_leader() -> int:
            return int(admin.list_topics(topic, timeout=30).topics[topic].partitions[0].leader)

        wait_until(lambda: current_leader() not in (leader, -1), 60, "a new leader")
        new_leader = current_leader()
        wait_until(
            lambda: leader not in holders(),
            30,
            lambda: (
                f"the dead leader's sidecar hands it over; held by {holders()}\n"
                + ownership_story(sidecars)
            ),
        )
        load.join()
        # Ownership is taken at first use: the load may have ended before the handoff, so a
        # few more records make sure a request reaches the partition after it.
        more = total + 200
        SequencedProducer(bootstrap, topic, "p-sidecar", more, start=total).start().join()
        wait_until(
            lambda: holders() == [new_leader],
            30,
            lambda: (
                f"the new leader's sidecar ({new_leader}) owns it; held by {holders()}\n"
                + ownership_story(sidecars)
            ),
        )
        environment.start_broker(leader)
        assert_exactly_once_in_order(values(info.bootstrap, topic), more)
    finally:
        for sidecar in sidecars:
            assert sidecar.stop() == 0


def sidecar_group(info: EnvInfo, log_dir: Path) -> list[ProxyProcess]:
    """A sidecar beside each broker (sidecar placement), each seeing all three: sidecars
    still joining place a partition among the members they know so far (it is handed over
    at their next beat), so the placement is asked of all three first."""
    prefix = f"sidecar-{uuid.uuid4().hex[:8]}"
    sidecars = [
        cluster_proxy(
            info,
            log_dir,
            ports,
            f"sidecar-{broker}",
            DEDUP_PROXY_REDIS_KEY_PREFIX=prefix,
            DEDUP_PROXY_INSTANCE_ID=f"{prefix}-{broker}",
            DEDUP_PROXY_PLACEMENT="sidecar",
            DEDUP_PROXY_LOCAL_BROKER_ID=str(broker),
            DEDUP_PROXY_LEASE_TTL_S="3",
            DEDUP_PROXY_HEARTBEAT_S="0.5",
        )
        for broker, ports in enumerate(CLUSTER_SIDECARS)
    ]
    return joined(sidecars, "every sidecar sees the three")


def test_a_rack_aware_consumer_reads_from_its_racks_replica_through_a_group(
    three_brokers: tuple[LocalEnvironment, EnvInfo], tmp_path: Path
) -> None:
    """KIP-392 through two instances in balanced placement: a consumer that names its rack
    is told, in a Fetch answer, to read from the replica in its rack. The answer names that
    broker by its own id, which no node of the group has; the consumer must be told a node
    it knows, and read everything from the follower through it."""
    _, info = three_brokers
    topic, follower, total = written_with_a_follower(info)
    group = balanced_pair(info, tmp_path, "racks")
    try:
        java = subprocess.run(
            java_tool_command(
                "org.apache.kafka.tools.consumer.ConsoleConsumer",
                "--bootstrap-server",
                group[1].bootstrap,
                "--topic",
                topic,
                "--from-beginning",
                "--max-messages",
                str(total),
                "--timeout-ms",
                "60000",
                "--command-property",
                f"client.rack={rack_of(follower)}",
            ),
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert java.stdout.split() == [str(i) for i in range(total)], java.stderr[-2000:]
        read, fetched_from = read_as_rack(group[1].bootstrap, topic, total, rack_of(follower))
        assert read == [str(i).encode() for i in range(total)]
        assert fetched_from % NODE_ID_STRIDE == follower, (
            f"read from node {fetched_from}, not the follower"
        )
        assert fetched_from >= NODE_ID_STRIDE, "a node of the group, not the broker's own id"
    finally:
        for proxy in group:
            assert proxy.stop() == 0


def test_a_rack_aware_consumer_reads_from_its_racks_replica_through_one_instance(
    three_brokers: tuple[LocalEnvironment, EnvInfo], tmp_path: Path
) -> None:
    """KIP-392 through one instance, which keeps the brokers' own ids: the preferred read
    replica passes as Kafka named it."""
    _, info = three_brokers
    topic, follower, total = written_with_a_follower(info)
    proxy = cluster_proxy(info, tmp_path)
    try:
        read, fetched_from = read_as_rack(proxy.bootstrap, topic, total, rack_of(follower))
        assert read == [str(i).encode() for i in range(total)]
        assert fetched_from == follower, f"read from node {fetched_from}, not the follower"
    finally:
        assert proxy.stop() == 0


def test_a_rack_aware_consumer_reads_from_its_racks_replica_through_sidecars(
    three_brokers: tuple[LocalEnvironment, EnvInfo], tmp_path: Path
) -> None:
    """KIP-392 in sidecar placement, where node b is broker b's sidecar: a consumer that
    names its rack, bootstrapped at the leader's sidecar, is sent to the follower in its
    rack and reads everything from it through that follower's sidecar."""
    _, info = three_brokers
    topic, follower, total = written_with_a_follower(info)
    leader = (follower + 2) % 3  # `written_with_a_follower`'s follower is the leader's next
    sidecars = sidecar_group(info, tmp_path)
    try:
        read, fetched_from = read_as_rack(
            sidecars[leader].bootstrap, topic, total, rack_of(follower)
        )
        assert read == [str(i).encode() for i in range(total)]
        assert fetched_from == follower, f"read from node {fetched_from}, not the follower"
        # Node `follower` is its own sidecar: the fetches went there, none to the third.
        fetches = [metric_total(sidecar, FETCHES) for sidecar in sidecars]
        assert fetches[follower] > 0, fetches
        assert fetches[3 - leader - follower] == 0, fetches
    finally:
        for sidecar in sidecars:
            assert sidecar.stop() == 0


def test_a_share_group_reads_every_record_once_through_a_group(
    three_brokers: tuple[LocalEnvironment, EnvInfo], tmp_path: Path
) -> None:
    """KIP-932 share groups through two instances in balanced placement: Kafka's own
    VerifiableShareConsumer, bootstrapped at one instance, finds its share group's
    coordinator, joins (ShareGroupHeartbeat), fetches each partition from its leader through
    the node the group names for it (ShareFetch) and acknowledges what it read
    (ShareAcknowledge, or the acknowledgements a ShareFetch carries). Every record written
    through the other instance, with dedup, is read and acknowledged exactly once."""
    _, info = three_brokers
    partitions, per_partition = 3, 200
    topic = new_topic(info.bootstrap, partitions=partitions, replication_factor=3)
    group = balanced_pair(info, tmp_path, "share")
    try:
        producer = Producer(
            {"bootstrap.servers": group[0].bootstrap, "enable.idempotence": True, "acks": "all"}
        )
        failed: list[object] = []
        for partition in range(partitions):
            for i in range(per_partition):
                producer.produce(
                    topic,
                    f"{partition}-{i}".encode(),
                    partition=partition,
                    on_delivery=lambda error, _: failed.append(error) if error else None,
                )
        assert producer.flush(60) == 0 and not failed, failed
        java = subprocess.run(
            java_tool_command(
                "org.apache.kafka.tools.VerifiableShareConsumer",
                *("--bootstrap-server", group[1].bootstrap, "--topic", topic),
                *("--group-id", f"share-{uuid.uuid4().hex[:8]}"),
                *("--max-messages", str(partitions * per_partition)),
                *("--offset-reset-strategy", "earliest", "--acknowledgement-mode", "sync"),
            ),
            capture_output=True,
            text=True,
            timeout=120,  # some 10 s when it works
        )
        assert java.returncode == 0, java.stderr[-3000:]
        # The log, read directly: each partition's records once, in order (dedup), and
        # their offsets (a control record, say a fence's marker, takes an offset too).
        in_log: dict[int, list[tuple[int, bytes | None]]] = {}
        for message in consume_confluent(info.bootstrap, topic, partitions * per_partition):
            in_log.setdefault(message.partition() or 0, []).append(
                (message.offset() or 0, message.value())
            )
        for partition in range(partitions):
            assert [value for _, value in sorted(in_log.get(partition, []))] == [
                f"{partition}-{i}".encode() for i in range(per_partition)
            ]
        expected = {p: sorted(offset for offset, _ in found) for p, found in in_log.items()}
        events = [json.loads(line) for line in java.stdout.splitlines() if line.startswith("{")]
        read = offsets_by_partition(events, "records_consumed")
        acknowledged = offsets_by_partition(events, "offsets_acknowledged")
        assert read == expected, f"read {read}; stderr: {java.stderr[-2000:]}"
        assert acknowledged == expected
        assert all(e.get("success", True) for e in events), events
    finally:
        for proxy in group:
            assert proxy.stop() == 0


def offsets_by_partition(events: list[dict[str, Any]], name: str) -> dict[int, list[int]]:
    """The offsets VerifiableShareConsumer reported under `name`, per partition, sorted
    (a record delivered twice appears twice)."""
    offsets: dict[int, list[int]] = {}
    for event in events:
        if event["name"] == name:
            for part in event["partitions"]:
                offsets.setdefault(part["partition"], []).extend(part["offsets"])
    return {partition: sorted(found) for partition, found in sorted(offsets.items())}


def balanced_pair(info: EnvInfo, log_dir: Path, name: str) -> list[ProxyProcess]:
    """Two instances in one group (balanced placement), each seeing the other."""
    prefix = f"{name}-{uuid.uuid4().hex[:8]}"
    group = [
        cluster_proxy(
            info,
            log_dir,
            ports,
            f"inst-{i}",
            DEDUP_PROXY_REDIS_KEY_PREFIX=prefix,
            DEDUP_PROXY_INSTANCE_ID=f"{prefix}-{i}",
            DEDUP_PROXY_HEARTBEAT_S="0.5",
        )
        for i, ports in enumerate([CLUSTER_PROXY, CLUSTER_SIDECARS[0]])
    ]
    return joined(group, "both instances see each other")


def joined(proxies: list[ProxyProcess], what: str) -> list[ProxyProcess]:
    """The instances of one group, once each sees every one of them as a member; stopped
    if they do not within 30 s."""
    try:
        admin_urls = [proxy.admin_url for proxy in proxies]
        wait_until(lambda: all_see_each_other(admin_urls), 30, what)
    except BaseException:
        for proxy in proxies:
            proxy.stop()
        raise
    return proxies


def written_with_a_follower(info: EnvInfo, total: int = 300) -> tuple[str, int, int]:
    """A topic replicated three ways holding ``total`` records, written directly, and a
    follower of its partition."""
    topic, leader = replicated_topic(info)
    producer = Producer({"bootstrap.servers": info.bootstrap, "acks": "all"})
    for i in range(total):
        producer.produce(topic, str(i).encode(), partition=0)
    assert producer.flush(60) == 0
    return topic, (leader + 1) % 3, total

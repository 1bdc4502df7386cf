"""A three-broker cluster behind the proxy: the partition leader dies under load and returns.

Runs on its own local environment (own state home and ports), so the single-broker one the
other tests share is left alone; it is stopped again at the end to give back its memory.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient

from deploy import paths
from deploy.launcher import ProxyProcess
from deploy.local import EnvInfo, LocalEnvironment
from tests.support.kafka_io import assert_exactly_once_in_order, consume_confluent, values
from tests.support.load import BackgroundProducer, SequencedProducer
from tests.support.ports import CLUSTER_ENV, CLUSTER_PROXY
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


def replicated_topic(info: EnvInfo) -> tuple[str, int]:
    """A topic with replication factor 3, and its partition's leader."""
    topic = new_topic(info.bootstrap, replication_factor=3)  # returns once it has a leader
    admin = AdminClient({"bootstrap.servers": info.bootstrap})
    return topic, admin.list_topics(topic, timeout=30).topics[topic].partitions[0].leader


def cluster_proxy(info: EnvInfo, log_dir: Path) -> ProxyProcess:
    """The proxy in front of the three brokers, dedup on, state of this test only."""
    return ProxyProcess(
        upstream=info.bootstrap,
        listen_port=CLUSTER_PROXY.listen,
        admin_port=CLUSTER_PROXY.admin,
        extra_args=["--broker-port-base", str(CLUSTER_PROXY.broker_base)],
        env={
            "DEDUP_PROXY_METADATA_REFRESH_S": "1",
            "DEDUP_PROXY_REDIS": info.redis,
            "DEDUP_PROXY_REDIS_KEY_PREFIX": f"ha-{uuid.uuid4().hex[:8]}",
        },
        log_path=log_dir / "proxy.log",
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

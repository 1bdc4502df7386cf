"""A three-broker cluster behind the proxy: the partition leader dies under load and returns.

Runs on its own local environment (own state home and ports), so the single-broker one the
other tests share is left alone; it is stopped again at the end to give back its memory.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient, NewTopic

from deploy import paths
from deploy.config import Ports
from deploy.local import EnvInfo, LocalEnvironment
from proxy.launcher import ProxyProcess
from tests.integration.load import BackgroundProducer
from tests.integration.test_clients import consume_confluent

pytestmark = pytest.mark.integration

CLUSTER_PORTS = Ports(kafka_base=20092, redis=16479)
PROXY_LISTEN, PROXY_ADMIN, PROXY_BROKER_BASE = 28492, 28480, 28493


@pytest.fixture(scope="module")
def three_brokers() -> Iterator[tuple[LocalEnvironment, EnvInfo]]:
    environment = LocalEnvironment(home=paths.state_home().parent / "test-3", ports=CLUSTER_PORTS)
    info = environment.up(brokers=3)
    yield environment, info
    environment.down()


def listeners(proxy: ProxyProcess) -> set[int]:
    health = proxy.health() or {}
    return {int(node) for node in health.get("broker_listeners", {})}


def wait_until(condition: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if callable(condition) and condition():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s}s waiting until {what}")


def test_leader_killed_under_load_clients_follow_through_the_proxy(
    three_brokers: tuple[LocalEnvironment, EnvInfo], tmp_path: Path
) -> None:
    environment, info = three_brokers
    topic = f"ha-{uuid.uuid4().hex[:10]}"
    admin = AdminClient({"bootstrap.servers": info.bootstrap})
    admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=3)])[topic].result(60)
    leader = admin.list_topics(topic, timeout=30).topics[topic].partitions[0].leader

    proxy = ProxyProcess(
        upstream=info.bootstrap,
        listen_port=PROXY_LISTEN,
        admin_port=PROXY_ADMIN,
        extra_args=["--broker-port-base", str(PROXY_BROKER_BASE)],
        env={"DEDUP_PROXY_METADATA_REFRESH_S": "1"},
        log_path=tmp_path / "proxy.log",
    ).start()
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

"""Three brokers with nothing but secured listeners (`local up --brokers 3 --security
sasl_ssl`): a consumer that names its rack (KIP-392) reads from its rack's replica through
the environment's own proxies, every hop over TLS with SCRAM: client to proxy, proxy to each
broker, broker to broker. In balanced placement (a group of two instances, which name the
brokers by node ids of their own) and in sidecar placement (one instance beside each broker).

Runs on an environment of its own (own state home and ports), removed at the end.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient

from dedup.client import DedupProducer
from deploy.config import rack_of
from deploy.local import EnvInfo, LocalEnvironment, java_tool_command
from deploy.tls import LocalTls
from tests.support.java_clients import client_properties
from tests.support.kafka_io import assert_exactly_once_in_order, read_all
from tests.support.ports import SECURED_CLUSTER_ENV
from tests.support.proxy_api import (
    FETCHES,
    NODE_ID_STRIDE,
    admin_call_at,
    all_see_each_other,
    metrics_at,
    series_total,
)
from tests.support.racks import read_as_rack
from tests.support.topics import new_topic
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration

TOTAL = 300


@pytest.fixture(scope="module")
def environment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEnvironment]:
    env = LocalEnvironment(
        home=tmp_path_factory.mktemp("secured-cluster") / "env", ports=SECURED_CLUSTER_ENV
    )
    try:
        yield env
    finally:
        env.down(purge=True)


def client_config(info: EnvInfo) -> dict[str, str]:
    """User `client` with SCRAM-SHA-256 over TLS (to the proxies as to Kafka)."""
    return info.kafka_config("client", "SCRAM-SHA-256")


def grouped(info: EnvInfo) -> EnvInfo:
    """The environment, once each of its proxies sees every one as a member of its group
    (healthy is not yet that)."""
    admin_urls = [proxy.admin for proxy in info.proxies]
    wait_until(
        lambda: all_see_each_other(admin_urls), 30, "the environment's proxies to see each other"
    )
    return info


def written_through(info: EnvInfo, bootstrap: str) -> tuple[str, int, int]:
    """A topic replicated three ways, ``TOTAL`` records written to it through the proxy at
    ``bootstrap`` by an idempotent producer (so through dedup), and the partition's leader
    and a follower (the leader's next node)."""
    config = client_config(info)
    topic = new_topic(info.bootstrap, replication_factor=3, client_config=config)
    admin = AdminClient({"bootstrap.servers": info.bootstrap, **config})
    leader = admin.list_topics(topic, timeout=30).topics[topic].partitions[0].leader
    producer = Producer(
        {"bootstrap.servers": bootstrap, "enable.idempotence": True, "acks": "all", **config}
    )
    for i in range(TOTAL):
        producer.produce(topic, str(i).encode(), partition=0)
    assert producer.flush(60) == 0
    return topic, leader, (leader + 1) % 3


def fetches(admin_url: str) -> float:
    """The Fetch requests the instance at ``admin_url`` has relayed."""
    return series_total(metrics_at(admin_url), FETCHES)


def test_a_rack_aware_consumer_reads_its_racks_replica_through_a_secured_group(
    environment: LocalEnvironment, tmp_path: Path
) -> None:
    """Written with dedup through one instance, read through the other by Kafka's Java
    consumer and by librdkafka, each in the follower's rack. The Fetch answer names the
    follower by the broker's own id, which no node of the group has: the consumer must be
    told a node of the group that stands for it, and reach the follower through it."""
    info = grouped(environment.up(brokers=3, proxies=2, placement="balanced", security="sasl_ssl"))
    first, second = info.proxies
    topic, _, follower = written_through(info, first.bootstrap)
    properties = client_properties(
        tmp_path / "client.properties", LocalTls(Path(info.tls_dir)), "SCRAM-SHA-256"
    )
    java = subprocess.run(
        java_tool_command(
            "org.apache.kafka.tools.consumer.ConsoleConsumer",
            *("--bootstrap-server", second.bootstrap, "--topic", topic, "--from-beginning"),
            *("--max-messages", str(TOTAL), "--timeout-ms", "60000"),
            *("--command-config", str(properties)),
            *("--command-property", f"client.rack={rack_of(follower)}"),
        ),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert java.stdout.split() == [str(i) for i in range(TOTAL)], java.stderr[-2000:]
    read, fetched_from = read_as_rack(
        second.bootstrap, topic, TOTAL, rack_of(follower), **client_config(info)
    )
    assert read == [str(i).encode() for i in range(TOTAL)]
    assert fetched_from % NODE_ID_STRIDE == follower, (
        f"read from node {fetched_from}, not the follower"
    )
    assert fetched_from >= NODE_ID_STRIDE, "a node of the group, not the broker's own id"


def test_a_killed_instances_partition_is_taken_over_and_fenced_under_the_proxys_acls(
    environment: LocalEnvironment,
) -> None:
    """The instances log in to Kafka as `proxy`, which has only the ACLs the README lists
    for the proxy's principal. The owner of a partition is killed; the other instance
    takes the partition over: it fences the dead instance's transactional id
    (`dedup-proxy-proxy-N`: InitProducerId, `Write` on it) and replays the log (`Read`). A
    producer's re-sends through it are written once."""
    info = grouped(environment.up(brokers=3, proxies=2, placement="balanced", security="sasl_ssl"))
    config = client_config(info)
    topic = new_topic(info.bootstrap, replication_factor=3, client_config=config)
    first = DedupProducer(info.proxies[0].bootstrap, "taken-over", **config)
    for n in range(100):
        first.send(topic, str(n).encode(), sequence_id=n)
    assert first.flush(60) == 0
    (owner,) = [
        i
        for i, proxy in enumerate(info.proxies)
        if f"{topic}/0" in admin_call_at(proxy.admin, "GET", "/v1/ownership")["held"]
    ]
    survivor = 1 - owner
    assert environment.kill_proxy(owner + 1)
    try:
        again = DedupProducer(info.proxies[survivor].bootstrap, "taken-over", **config)
        for n in range(50, 150):  # 50 re-sent, 50 new
            again.send(topic, str(n).encode(), sequence_id=n)
        assert again.flush(120) == 0
        written = [value for value, _ in read_all(info.bootstrap, topic, **config)]
        assert_exactly_once_in_order(written, 150)
        log = (environment.proxy_dir(survivor + 1) / "process.log").read_text().splitlines()
        fenced = [line for line in log if "fencing before takeover" in line]
        assert any(f'"instance": "proxy-{owner + 1}"' in line for line in fenced), fenced
    finally:
        environment.start_proxy(owner + 1)


def test_a_rack_aware_consumer_reads_its_racks_replica_through_secured_sidecars(
    environment: LocalEnvironment,
) -> None:
    """Sidecar placement, where node b is broker b's sidecar: a consumer in the follower's
    rack, bootstrapped at the leader's sidecar, reads everything from the follower through
    the follower's own sidecar, and nothing through the third."""
    info = grouped(environment.up(brokers=3, proxies=3, placement="sidecar", security="sasl_ssl"))
    sidecars = info.proxies  # proxy i + 1 stands beside broker i
    topic, leader, follower = written_through(info, info.proxies[0].bootstrap)
    before = [fetches(sidecar.admin) for sidecar in sidecars]
    read, fetched_from = read_as_rack(
        sidecars[leader].bootstrap, topic, TOTAL, rack_of(follower), **client_config(info)
    )
    assert read == [str(i).encode() for i in range(TOTAL)]
    assert fetched_from == follower, f"read from node {fetched_from}, not the follower"
    relayed = [fetches(sidecar.admin) - was for sidecar, was in zip(sidecars, before, strict=True)]
    assert relayed[follower] > 0, relayed
    assert relayed[3 - leader - follower] == 0, relayed

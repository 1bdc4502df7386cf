"""Independent Kafka clients produce, consume and administer through the proxy.

librdkafka (confluent-kafka and kcat), a pure-Python client (kafka-python) and Kafka's own
Java tools each talk only to the proxy's bootstrap address; the topic is then read back
and checked for exact content and order.
"""

from __future__ import annotations

import json
import subprocess
import uuid

import pytest
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic
from kafka import KafkaConsumer, KafkaProducer
from kafka.admin import KafkaAdminClient
from kafka.admin import NewTopic as KafkaPythonNewTopic

from deploy.launcher import ProxyProcess
from deploy.local import EnvInfo, java_tool_command
from tests.support.kafka_io import consume_confluent
from tests.support.ports import PASSTHROUGH
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration


def produce_confluent(bootstrap: str, topic: str, values: list[bytes], **config: object) -> None:
    errors: list[KafkaError] = []
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, **config})
    for index, value in enumerate(values):
        producer.produce(
            topic,
            value,
            key=str(index).encode(),
            headers=[("index", str(index).encode())],
            on_delivery=lambda err, _msg: errors.append(err) if err else None,
        )
        producer.poll(0)
    assert producer.flush(60) == 0
    assert errors == []


def test_metadata_through_the_proxy_names_only_proxy_addresses(
    proxy: ProxyProcess, local_env: EnvInfo, topic: str
) -> None:
    listing = subprocess.run(
        ["kcat", "-b", proxy.bootstrap, "-L", "-J", "-t", topic],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    metadata = json.loads(listing.stdout)
    advertised = {broker["name"] for broker in metadata["brokers"]}
    expected = {f"127.0.0.1:{PASSTHROUGH.broker_base + node}" for node in local_env.brokers}
    assert advertised == expected
    assert not advertised & set(local_env.brokers.values())
    assert [t["topic"] for t in metadata["topics"]] == [topic]


def test_confluent_kafka_round_trip_with_consumer_group(proxy: ProxyProcess, topic: str) -> None:
    values = [f"value-{i}".encode() * (1 + i % 7) for i in range(2000)]
    produce_confluent(proxy.bootstrap, topic, values, acks="all", **{"enable.idempotence": True})
    group = f"group-{uuid.uuid4().hex[:8]}"
    messages = consume_confluent(proxy.bootstrap, topic, len(values), group=group)
    assert [m.value() for m in messages] == values
    assert [m.headers() for m in messages[:2]] == [[("index", b"0")], [("index", b"1")]]
    # The group's committed offset went through the coordinator the proxy pointed at.
    consumer = Consumer({"bootstrap.servers": proxy.bootstrap, "group.id": group})
    try:
        committed = consumer.committed([TopicPartition(topic, 0)], timeout=30)
    finally:
        consumer.close()
    assert committed[0].offset == len(values)


@pytest.mark.parametrize("codec", ["gzip", "snappy", "lz4", "zstd"])
def test_compression_codecs_pass_through(proxy: ProxyProcess, topic: str, codec: str) -> None:
    values = [(f"{codec}-{i}-" * 20).encode() for i in range(500)]
    produce_confluent(proxy.bootstrap, topic, values, **{"compression.type": codec})
    assert [m.value() for m in consume_confluent(proxy.bootstrap, topic, len(values))] == values


def test_kafka_python_round_trip_and_admin(proxy: ProxyProcess) -> None:
    name = f"kp-{uuid.uuid4().hex[:10]}"
    admin = KafkaAdminClient(bootstrap_servers=proxy.bootstrap, request_timeout_ms=30_000)
    try:
        admin.create_topics([KafkaPythonNewTopic(name, num_partitions=2, replication_factor=1)])
        producer = KafkaProducer(bootstrap_servers=proxy.bootstrap, acks="all", linger_ms=5)
        values = [f"kp-{i}".encode() for i in range(300)]
        for value in values:
            producer.send(name, value=value, partition=0)
        producer.flush(30)
        producer.close()
        consumer = KafkaConsumer(
            name,
            bootstrap_servers=proxy.bootstrap,
            auto_offset_reset="earliest",
            consumer_timeout_ms=10_000,
            group_id=f"kp-group-{uuid.uuid4().hex[:8]}",
        )
        received = [record.value for record in consumer]
        consumer.close()
        assert received == values
    finally:
        admin.delete_topics([name])
        admin.close()


def test_kcat_produce_and_consume(proxy: ProxyProcess, topic: str) -> None:
    lines = [f"kcat-{i}" for i in range(200)]
    subprocess.run(
        ["kcat", "-b", proxy.bootstrap, "-P", "-t", topic, "-z", "zstd"],
        input="\n".join(lines) + "\n",
        text=True,
        timeout=60,
        check=True,
    )
    consumed = subprocess.run(
        ["kcat", "-b", proxy.bootstrap, "-C", "-t", topic, "-e", "-q", "-o", "beginning"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert consumed.stdout.splitlines() == lines


def test_java_verifiable_producer_and_console_consumer(proxy: ProxyProcess, topic: str) -> None:
    produced = subprocess.run(
        java_tool_command(
            "org.apache.kafka.tools.VerifiableProducer",
            "--bootstrap-server",
            proxy.bootstrap,
            "--topic",
            topic,
            "--max-messages",
            "500",
            "--acks",
            "-1",
        ),
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )
    events = [json.loads(line) for line in produced.stdout.splitlines() if line.startswith("{")]
    acked = [e for e in events if e.get("name") == "producer_send_success"]
    assert len(acked) == 500
    assert not [e for e in events if e.get("name") == "producer_send_error"]
    consumed = subprocess.run(
        java_tool_command(
            "org.apache.kafka.tools.consumer.ConsoleConsumer",
            "--bootstrap-server",
            proxy.bootstrap,
            "--topic",
            topic,
            "--from-beginning",
            "--max-messages",
            "500",
            "--timeout-ms",
            "60000",
        ),
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )
    assert consumed.stdout.split() == [str(i) for i in range(500)]


def test_admin_operations_through_the_proxy(proxy: ProxyProcess, local_env: EnvInfo) -> None:
    admin = AdminClient({"bootstrap.servers": proxy.bootstrap})
    name = f"adm-{uuid.uuid4().hex[:10]}"
    admin.create_topics([NewTopic(name, num_partitions=3, replication_factor=-1)])[name].result(30)
    # As Kafka's admin client documents, a topic just created may take a moment to reach
    # the brokers' metadata (measured directly against the local broker: most times the
    # next Metadata still says UNKNOWN_TOPIC_OR_PARTITION).
    wait_until(
        lambda: admin.list_topics(name, timeout=30).topics[name].error is None,
        30,
        "the new topic reaches the broker's metadata",
    )
    assert len(admin.list_topics(name, timeout=30).topics[name].partitions) == 3

    cluster = admin.describe_cluster().result(30)
    addresses = {f"{node.host}:{node.port}" for node in cluster.nodes}
    assert addresses == {f"127.0.0.1:{PASSTHROUGH.broker_base + n}" for n in local_env.brokers}

    admin.delete_topics([name])[name].result(30)
    direct = AdminClient({"bootstrap.servers": local_env.bootstrap})
    wait_until(
        lambda: name not in direct.list_topics(timeout=30).topics,
        10,
        f"{name} is gone from the metadata",
    )
    assert name not in direct.list_topics(timeout=30).topics

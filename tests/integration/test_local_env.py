"""The local environment against the real processes: Kafka in KRaft mode and Redis."""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from confluent_kafka import KafkaError, Message, Producer
from confluent_kafka.admin import AdminClient

from deploy.config import Ports
from deploy.local import EnvInfo, LocalEnvironment, java_tool_command
from deploy.processes import port_open
from tests.support.kafka_io import consume
from tests.support.ports import THREE_NODE_ENV

pytestmark = pytest.mark.integration


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def broker_ids(bootstrap: str) -> set[int]:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    return set(admin.list_topics(timeout=10).brokers)


def produce(bootstrap: str, topic: str, values: list[str]) -> None:
    errors: list[KafkaError] = []

    def on_delivery(err: KafkaError | None, _msg: Message) -> None:
        if err is not None:
            errors.append(err)

    producer = Producer(
        {"bootstrap.servers": bootstrap, "acks": "all", "message.timeout.ms": 30000}
    )
    for value in values:
        producer.produce(topic, value.encode(), on_delivery=on_delivery)
    assert producer.flush(60) == 0, "messages still in flight"
    assert errors == []


def test_up_gives_reachable_kafka_and_redis(local_env: EnvInfo) -> None:
    ports = Ports.from_env()
    assert local_env.bootstrap == f"127.0.0.1:{ports.client(0)}"
    assert local_env.redis == f"redis://127.0.0.1:{ports.redis}/0"
    assert broker_ids(local_env.bootstrap) == {0}
    client = redis.Redis.from_url(local_env.redis)
    try:
        assert client.ping()
        assert client.config_get("appendonly") == {"appendonly": "yes"}
    finally:
        client.close()


def test_up_again_reuses_the_running_processes(
    local_env: EnvInfo, local_environment: LocalEnvironment
) -> None:
    before = local_environment.status()
    started = time.monotonic()
    assert local_environment.up(brokers=1) == local_env
    assert time.monotonic() - started < 10
    after = local_environment.status()
    assert after["nodes"]["0"]["pid"] == before["nodes"]["0"]["pid"]
    assert after["redis_process"]["pid"] == before["redis_process"]["pid"]


def test_killed_broker_comes_back_and_serves(
    local_env: EnvInfo, local_environment: LocalEnvironment
) -> None:
    assert local_environment.kill_broker(0) is True
    status = local_environment.status()
    assert status["nodes"]["0"]["running"] is False
    assert not port_open("127.0.0.1", Ports.from_env().client(0))

    local_environment.start_broker(0)
    assert broker_ids(local_env.bootstrap) == {0}
    topic = unique("after-restart")
    values = [f"v{i}" for i in range(20)]
    produce(local_env.bootstrap, topic, values)
    assert consume(local_env.bootstrap, topic, len(values)) == values


def test_up_restarts_just_a_killed_broker(
    local_env: EnvInfo, local_environment: LocalEnvironment
) -> None:
    redis_pid = local_environment.status()["redis_process"]["pid"]
    local_environment.kill_broker(0)
    assert local_environment.up(brokers=1) == local_env
    status = local_environment.status()
    assert status["nodes"]["0"]["running"] is True
    assert status["redis_process"]["pid"] == redis_pid
    assert broker_ids(local_env.bootstrap) == {0}


def test_killed_redis_comes_back_with_its_aof_data(
    local_env: EnvInfo, local_environment: LocalEnvironment
) -> None:
    key, value = unique("survives-kill"), uuid.uuid4().hex
    client = redis.Redis.from_url(local_env.redis, socket_timeout=2)
    try:
        assert client.set(key, value)
        assert local_environment.kill_redis() is True
        with pytest.raises(redis.ConnectionError):
            client.ping()
        local_environment.start_redis()
        assert client.ping()
        assert client.get(key) == value.encode()
        client.delete(key)
    finally:
        client.close()


def test_java_tools_produce_and_consume(local_env: EnvInfo) -> None:
    topic = unique("java-tools")
    produced = subprocess.run(
        java_tool_command(
            "org.apache.kafka.tools.VerifiableProducer",
            "--bootstrap-server",
            local_env.bootstrap,
            "--topic",
            topic,
            "--max-messages",
            "50",
            "--acks",
            "-1",
        ),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    events = [json.loads(line) for line in produced.stdout.splitlines()]
    acked = [e for e in events if e["name"] == "producer_send_success"]
    assert len(acked) == 50

    consumed = subprocess.run(
        java_tool_command(
            "org.apache.kafka.tools.consumer.ConsoleConsumer",
            "--bootstrap-server",
            local_env.bootstrap,
            "--topic",
            topic,
            "--from-beginning",
            "--max-messages",
            "50",
            "--timeout-ms",
            "60000",
        ),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert consumed.stdout.splitlines() == [str(i) for i in range(50)]


@pytest.fixture
def three_node_environment(tmp_path: Path) -> Iterator[LocalEnvironment]:
    """A second, throwaway environment on other ports: the shared one stays single-node."""
    env = LocalEnvironment(home=tmp_path / "local", ports=THREE_NODE_ENV)
    try:
        yield env
    finally:
        env.down(purge=True)


def test_three_nodes_survive_one_killed_broker(
    three_node_environment: LocalEnvironment,
) -> None:
    env = three_node_environment
    info = env.up(brokers=3)
    assert sorted(info.brokers) == [0, 1, 2]
    assert broker_ids(info.bootstrap) == {0, 1, 2}

    topic = unique("three-nodes")
    produce(info.bootstrap, topic, ["before"])
    env.kill_broker(1)
    # acks=all with min.insync.replicas=2: still writable with two nodes left.
    produce(info.bootstrap, topic, ["during"])
    env.start_broker(1)
    assert broker_ids(info.bootstrap) == {0, 1, 2}
    produce(info.bootstrap, topic, ["after"])
    assert consume(info.bootstrap, topic, 3) == ["before", "during", "after"]

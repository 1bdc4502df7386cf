"""A proxy assembled without dedup (--pass-through): a plain Kafka proxy that needs no Redis,
creates no snapshot topic and serves no dedup API, while clients see Kafka unchanged."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient

from deploy.launcher import ProxyProcess
from deploy.local import EnvInfo
from tests.support.kafka_io import read_all
from tests.support.ports import PASS_THROUGH_ONLY
from tests.support.topics import new_topic

pytestmark = pytest.mark.integration

# Nothing listens here: a proxy that tried Redis would log errors and refuse produce requests.
UNREACHABLE_REDIS = "redis://127.0.0.1:1/0"


@pytest.fixture(scope="module")
def snapshot_topic() -> str:
    return f"__dedup_snapshots-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def plain_proxy(
    local_env: EnvInfo, tmp_path_factory: pytest.TempPathFactory, snapshot_topic: str
) -> Iterator[tuple[ProxyProcess, Path]]:
    log_path = tmp_path_factory.mktemp("pass-through") / "proxy.log"
    process = ProxyProcess(
        upstream=local_env.bootstrap,
        listen_port=PASS_THROUGH_ONLY.listen,
        admin_port=PASS_THROUGH_ONLY.admin,
        extra_args=[
            "--broker-port-base",
            str(PASS_THROUGH_ONLY.broker_base),
            "--pass-through",
            "--redis",
            UNREACHABLE_REDIS,
        ],
        env={"DEDUP_PROXY_SNAPSHOT_TOPIC": snapshot_topic},
        log_path=log_path,
    )
    process.start()
    yield process, log_path
    assert process.stop() == 0, f"proxy did not shut down cleanly; see {log_path}"


def test_records_pass_unchanged_duplicates_included(
    plain_proxy: tuple[ProxyProcess, Path], local_env: EnvInfo
) -> None:
    proxy, _ = plain_proxy
    topic = new_topic(local_env.bootstrap)
    producer = Producer({"bootstrap.servers": proxy.bootstrap, "enable.idempotence": False})
    identity = [("dedup.producer", b"p"), ("dedup.sequence", b"1")]
    for value in (b"a", b"a", b"b"):  # the same identity twice: nothing is deduplicated
        producer.produce(topic, value, headers=identity)
    assert producer.flush(30) == 0
    records = read_all(local_env.bootstrap, topic)
    assert [value for value, _ in records] == [b"a", b"a", b"b"]
    assert all(headers == dict(identity) for _, headers in records), "headers untouched"


def test_no_redis_no_snapshot_topic_no_dedup_api(
    plain_proxy: tuple[ProxyProcess, Path], local_env: EnvInfo, snapshot_topic: str
) -> None:
    proxy, log_path = plain_proxy
    health = proxy.health()
    assert health is not None and health["status"] == "ok"
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{proxy.admin_url}/v1/policies", timeout=10)
    assert refused.value.code == 404
    topics = AdminClient({"bootstrap.servers": local_env.bootstrap}).list_topics(timeout=30)
    assert snapshot_topic not in topics.topics
    lines = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    assert lines, "the proxy logs JSON lines"
    assert not [line for line in lines if "redis" in json.dumps(line).lower()]

"""Fixtures of the integration tests: the session's proxies in front of the local Kafka, and
fresh topics. What the tests share besides fixtures is in `tests.support`."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient

from deploy.launcher import ProxyProcess
from deploy.local import EnvInfo
from tests.support.ports import DEDUP, PASSTHROUGH
from tests.support.raw import MAX_FRAME_BYTES
from tests.support.topics import new_topic


@pytest.fixture(scope="session")
def proxy_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("proxy") / "proxy.log"


@pytest.fixture(scope="session")
def redis_key_prefix() -> str:
    """Dedup state of this test session only: runs never see each other's producers."""
    return f"test-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="session")
def proxy(local_env: EnvInfo, proxy_log: Path, redis_key_prefix: str) -> Iterator[ProxyProcess]:
    """The proxy as a pure pass-through (dedup off): what Kafka clients must see unchanged."""
    process = ProxyProcess(
        upstream=local_env.bootstrap,
        listen_port=PASSTHROUGH.listen,
        admin_port=PASSTHROUGH.admin,
        extra_args=[
            "--broker-port-base",
            str(PASSTHROUGH.broker_base),
            "--log-format",
            "json",
            "--no-dedup",
        ],
        env={
            "DEDUP_PROXY_MAX_FRAME_BYTES": str(MAX_FRAME_BYTES),
            "DEDUP_PROXY_REDIS": local_env.redis,
            # A deployment of its own: instances sharing a key prefix share partition
            # ownership, and this one has dedup off by default.
            "DEDUP_PROXY_REDIS_KEY_PREFIX": f"{redis_key_prefix}-pass",
        },
        log_path=proxy_log,
    )
    process.start()
    yield process
    assert process.stop() == 0, f"proxy did not shut down cleanly; see {proxy_log}"


@pytest.fixture(scope="session")
def dedup_proxy_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dedup-proxy") / "proxy.log"


@pytest.fixture(scope="session")
def dedup_proxy(
    local_env: EnvInfo, dedup_proxy_log: Path, redis_key_prefix: str
) -> Iterator[ProxyProcess]:
    """The proxy with dedup on (the product's default)."""
    process = ProxyProcess(
        upstream=local_env.bootstrap,
        listen_port=DEDUP.listen,
        admin_port=DEDUP.admin,
        extra_args=["--broker-port-base", str(DEDUP.broker_base), "--log-format", "json"],
        env={
            "DEDUP_PROXY_REDIS": local_env.redis,
            "DEDUP_PROXY_REDIS_KEY_PREFIX": redis_key_prefix,
            # Policies re-read for every request: the admission of pipelined requests
            # must keep their order even when each one waits on Redis first.
            "DEDUP_PROXY_POLICY_CACHE_S": "0",
            # A librdkafka wrapper of a name of its own (test_dedup's delivery reports).
            "DEDUP_PROXY_CLIENTS_NUMBERING_FROM_BASE": '["listed-wrapper"]',
        },
        log_path=dedup_proxy_log,
    )
    process.start()
    yield process
    assert process.stop() == 0, f"proxy did not shut down cleanly; see {dedup_proxy_log}"


@pytest.fixture
def topic(local_env: EnvInfo) -> Iterator[str]:
    """A fresh single-partition topic, created directly on Kafka and deleted afterwards."""
    name = new_topic(local_env.bootstrap)
    yield name
    admin = AdminClient({"bootstrap.servers": local_env.bootstrap})
    admin.delete_topics([name])[name].result(30)

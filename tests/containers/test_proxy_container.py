"""The proxy's image in front of the Kafka image: a client on the host produces and
consumes through it with dedup on, and SIGTERM drains it and ends it with status 0."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import pytest
from confluent_kafka import Consumer

from deploy.containers.engine import Engine
from deploy.containers.stack import Backend, backend, logs_tail
from tests.containers import roundtrip

pytestmark = [pytest.mark.docker, pytest.mark.integration, pytest.mark.timeout(900)]

DRAIN_TIMEOUT_S = 10


@pytest.fixture(scope="module")
def kafka(engine: Engine) -> Iterator[Backend]:
    with backend() as started:
        yield started


def dropped_duplicates(metrics: str) -> float:
    match = re.search(r'^dedup_records_total\{verdict="dup"\} (\S+)$', metrics, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_a_client_on_the_host_round_trips_through_the_proxy_container(kafka: Backend) -> None:
    with kafka.proxy() as proxy:
        result = roundtrip.run(proxy.bootstrap, "container-orders", "host-loader", count=300)
        assert result["errors"] == []
        assert result["values"] == list(range(300)), "each record exactly once"
        # Clients are told the proxy's published addresses, never the broker's.
        assert result["brokers"] == [f"127.0.0.1:{proxy.host_port + 1}"]
        assert dropped_duplicates(proxy.metrics_text()) >= len(result["resent"])


def test_sigterm_drains_the_proxy_container_and_ends_it_with_0(kafka: Backend) -> None:
    with kafka.proxy(env={"DEDUP_PROXY_DRAIN_TIMEOUT_S": str(DRAIN_TIMEOUT_S)}) as proxy:
        roundtrip.run(proxy.bootstrap, "container-drain", "drain-loader", count=50)
        # A client still connected when the signal comes.
        consumer = Consumer({"bootstrap.servers": proxy.bootstrap, "group.id": "drain"})
        try:
            consumer.list_topics(timeout=10)
            container = proxy.get_wrapped_container()
            started = time.monotonic()
            # `docker stop`: SIGTERM, then SIGKILL only after a grace well past the drain.
            container.stop(timeout=DRAIN_TIMEOUT_S + 20)
            took = time.monotonic() - started
            status = container.wait(timeout=10)["StatusCode"]
        finally:
            consumer.close()
        assert status == 0, logs_tail(proxy)
        assert took < DRAIN_TIMEOUT_S + 2, f"stopped after {took:.1f} s"
        assert '"event": "shutdown complete"' in logs_tail(proxy, 10)
        # The image logs to stdout (DEDUP_PROXY_LOG_STREAM), where container runtimes look.
        wrapped = proxy.get_wrapped_container()
        assert b'"event": "shutdown complete"' in wrapped.logs(stdout=True, stderr=False)
        assert b'"event"' not in wrapped.logs(stdout=False, stderr=True)

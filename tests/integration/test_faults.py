"""Faults around the proxy: an upstream broker that dies and comes back, and proxy shutdown."""

from __future__ import annotations

import datetime
import socket
import threading
import time
from pathlib import Path

import kio.schema.fetch.v12.request as fetch_v12
import pytest
from kio.schema.types import TopicName
from kio.static.primitive import i32, i32Timedelta, i64

from deploy.launcher import ProxyProcess
from deploy.local import EnvInfo, LocalEnvironment
from proxy.kafka.upstream_client import encode_request
from tests.support.kafka_io import consume_confluent
from tests.support.load import BackgroundProducer
from tests.support.ports import SHUTDOWN
from tests.support.proxy_api import FETCHES, metric_total
from tests.support.raw import correlation_id, read_response
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration

UPSTREAM_DISCONNECTS = 'dedup_proxy_upstream_errors_total{kind="disconnect"}'


def test_broker_restart_under_load_clients_recover_through_the_proxy(
    proxy: ProxyProcess,
    local_environment: LocalEnvironment,
    local_env: EnvInfo,
    topic: str,
    proxy_log: Path,
) -> None:
    total = 3000
    producer = BackgroundProducer(proxy.bootstrap, topic, total).start()
    producer.wait_delivered(500)
    (node_id,) = local_env.brokers
    disconnects = metric_total(proxy, UPSTREAM_DISCONNECTS)
    local_environment.kill_broker(node_id)
    wait_until(
        lambda: metric_total(proxy, UPSTREAM_DISCONNECTS) > disconnects,
        30,
        "the proxy sees its upstream connections end",
    )
    local_environment.start_broker(node_id)
    back = time.monotonic()
    producer.join()
    values = [m.value() for m in consume_confluent(proxy.bootstrap, topic, total)]
    assert values == [str(i).encode() for i in range(total)]
    assert "upstream connection ended" in proxy_log.read_text()
    # Healthy again seconds after the broker is back, however long it was down: a metadata
    # refresh that reached no broker is retried within seconds, not a refresh interval.
    wait_until(
        lambda: proxy.health() is not None,
        max(back + 15 - time.monotonic(), 0.0),
        lambda: f"the proxy reports itself healthy (its /healthz: {proxy.health_answer()})",
    )


def long_poll_fetch(topic: str, wait_ms: int) -> fetch_v12.FetchRequest:
    return fetch_v12.FetchRequest(
        max_wait=i32Timedelta.parse(datetime.timedelta(milliseconds=wait_ms)),
        min_bytes=i32(1),
        topics=(
            fetch_v12.FetchTopic(
                topic=TopicName(topic),
                partitions=(
                    fetch_v12.FetchPartition(
                        partition=i32(0), fetch_offset=i64(0), partition_max_bytes=i32(1 << 20)
                    ),
                ),
            ),
        ),
        forgotten_topics_data=(),
    )


def test_graceful_shutdown_answers_requests_in_flight(
    local_env: EnvInfo, topic: str, tmp_path: Path
) -> None:
    """SIGTERM while a Fetch long-polls upstream: the answer still reaches the client."""
    second = ProxyProcess(
        upstream=local_env.bootstrap,
        listen_port=SHUTDOWN.listen,
        admin_port=SHUTDOWN.admin,
        extra_args=["--broker-port-base", str(SHUTDOWN.broker_base)],
        log_path=tmp_path / "proxy.log",
    ).start()
    with socket.create_connection(("127.0.0.1", second.listen_port), timeout=30) as sock:
        sock.sendall(encode_request(long_poll_fetch(topic, 3000), 41))
        wait_until(  # read and passed on: the request is now waiting inside Kafka
            lambda: metric_total(second, FETCHES) >= 1,
            10,
            "the proxy has passed the Fetch on",
            interval_s=0.05,
        )
        started = time.monotonic()
        stopper = threading.Thread(target=second.stop)
        stopper.start()
        answer = read_response(sock)
        waited = time.monotonic() - started
        assert correlation_id(answer) == 41
        assert waited > 1.5, "the answer came too early to have been a long poll"
        assert sock.recv(1) == b"", "the connection stays open after draining"
        stopper.join(30)
    assert second.stop() == 0
    assert "shutdown complete" in (tmp_path / "proxy.log").read_text()

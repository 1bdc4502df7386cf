"""The proxy at the wire level: pipelining, acks=0, version negotiation, and bad input.

These tests speak raw Kafka frames (encoded with kio) over real sockets to the proxy,
which forwards to the real local Kafka.
"""

from __future__ import annotations

import socket
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import kio.schema.api_versions.v3.request as api_versions_v3
import pytest
from confluent_kafka import Consumer, Producer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deploy.launcher import ProxyProcess
from deploy.local import EnvInfo
from proxy.kafka.schemas import DECODABLE_VERSIONS, response_header_is_flexible
from proxy.kafka.upstream_client import encode_request
from tests.support.raw import (
    MAX_FRAME_BYTES,
    correlation_id,
    metadata_request,
    produce_request,
    read_response,
    record_batch,
)
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration


@contextmanager
def raw_connection(proxy: ProxyProcess) -> Iterator[socket.socket]:
    sock = socket.create_connection(("127.0.0.1", proxy.listen_port), timeout=30)
    try:
        yield sock
    finally:
        sock.close()


def is_closed_by_peer(sock: socket.socket, timeout_s: float = 10) -> bool:
    sock.settimeout(timeout_s)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def client_works(proxy: ProxyProcess) -> bool:
    with raw_connection(proxy) as sock:
        sock.sendall(encode_request(metadata_request(), 77))
        return correlation_id(read_response(sock)) == 77


def test_pipelined_requests_are_answered_in_request_order(proxy: ProxyProcess) -> None:
    requests = [
        api_versions_v3.ApiVersionsRequest(client_software_name="raw", client_software_version="1"),
        metadata_request(),
    ]
    with raw_connection(proxy) as sock:
        sock.sendall(b"".join(encode_request(requests[i % 2], 1000 + i) for i in range(60)))
        answered = [correlation_id(read_response(sock)) for _ in range(60)]
    assert answered == list(range(1000, 1060))


def read_topic(bootstrap: str, topic: str, count: int) -> list[bytes]:
    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": "reader", "auto.offset.reset": "earliest"}
    )
    consumer.subscribe([topic])
    values: list[bytes] = []
    deadline = time.monotonic() + 60
    while len(values) < count and time.monotonic() < deadline:
        values += [m.value() for m in consumer.consume(100, 0.5) if m.error() is None]
    consumer.close()
    return values


def test_acks_zero_produce_gets_no_answer_and_is_written(
    proxy: ProxyProcess, local_env: EnvInfo, topic: str
) -> None:
    with raw_connection(proxy) as sock:
        # Kafka sends nothing back for acks=0; the next answer must be the Metadata one.
        sock.sendall(
            encode_request(
                produce_request(topic, {0: record_batch([(b"fire", []), (b"forget", [])])}, 0), 1
            )
        )
        sock.sendall(encode_request(metadata_request(), 2))
        assert correlation_id(read_response(sock)) == 2
        sock.sendall(encode_request(produce_request(topic, {0: record_batch([(b"acked", [])])}), 3))
        assert correlation_id(read_response(sock)) == 3
    assert read_topic(local_env.bootstrap, topic, 3) == [b"fire", b"forget", b"acked"]


def test_too_new_api_versions_request_is_answered_with_the_supported_range(
    proxy: ProxyProcess,
) -> None:
    supported = DECODABLE_VERSIONS[18]
    too_new = supported.max + 1
    header = (18).to_bytes(2, "big") + too_new.to_bytes(2, "big") + (9).to_bytes(4, "big")
    body = header + b"\x00\x04raw!" + b"\x00"  # client id, then an empty tagged-field block
    with raw_connection(proxy) as sock:
        sock.sendall(len(body).to_bytes(4, "big") + body)
        answer = read_response(sock)
    assert response_header_is_flexible(18, supported.max) is False
    assert correlation_id(answer) == 9
    error_code = int.from_bytes(answer[4:6], "big")
    assert error_code == 35  # UNSUPPORTED_VERSION, with ApiVersions' own range listed
    entries = int.from_bytes(answer[6:10], "big")
    first = answer[10:16]
    assert entries == 1
    assert (int.from_bytes(first[0:2], "big"), int.from_bytes(first[4:6], "big")) == (
        18,
        supported.max,
    )


def client_errors(proxy: ProxyProcess) -> float:
    total = 0.0
    for line in proxy.metrics_text().splitlines():
        if line.startswith("dedup_proxy_client_errors_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


BAD_INPUTS = {
    "garbage": lambda: (20).to_bytes(4, "big") + b"\x7f" * 20,
    "unknown-api-key": lambda: (
        (10).to_bytes(4, "big") + b"\x03\xe7\x00\x00\x00\x00\x00\x01\xff\xff"
    ),
    "unsupported-version": lambda: (
        (10).to_bytes(4, "big") + b"\x00\x00\x00\x01\x00\x00\x00\x01\xff\xff"
    ),
    "oversize": lambda: (MAX_FRAME_BYTES + 1).to_bytes(4, "big") + b"\x00" * 100,
    "negative-size": lambda: (-7).to_bytes(4, "big", signed=True),
    "short-header": lambda: (3).to_bytes(4, "big") + b"\x00\x03\x00",
}


@pytest.mark.parametrize("kind", sorted(BAD_INPUTS))
def test_bad_input_closes_only_that_client(proxy: ProxyProcess, proxy_log: Path, kind: str) -> None:
    before = client_errors(proxy)
    with raw_connection(proxy) as healthy, raw_connection(proxy) as bad:
        healthy.sendall(encode_request(metadata_request(), 1))
        assert correlation_id(read_response(healthy)) == 1
        bad_port = bad.getsockname()[1]
        bad.sendall(BAD_INPUTS[kind]())
        assert is_closed_by_peer(bad), f"{kind}: the proxy kept the connection open"
        healthy.sendall(encode_request(metadata_request(), 2))
        assert correlation_id(read_response(healthy)) == 2
    assert client_errors(proxy) == before + 1
    assert f"127.0.0.1:{bad_port}" in proxy_log.read_text(), "no log line names the client"


def test_client_disconnecting_mid_request_is_logged_and_harmless(
    proxy: ProxyProcess, proxy_log: Path
) -> None:
    with raw_connection(proxy) as sock:
        port = sock.getsockname()[1]
        frame = encode_request(metadata_request(), 5)
        sock.sendall(frame[: len(frame) // 2])
    wait_until(
        lambda: f"127.0.0.1:{port}" in proxy_log.read_text(),
        10,
        "a log line names the client",
        interval_s=0.1,
    )
    assert f"127.0.0.1:{port}" in proxy_log.read_text()
    assert client_works(proxy)


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    api_key=st.sampled_from(sorted(DECODABLE_VERSIONS)),
    version=st.integers(0, 20),
    junk=st.binary(max_size=200),
)
def test_fuzzed_requests_never_hurt_the_proxy(
    proxy: ProxyProcess, api_key: int, version: int, junk: bytes
) -> None:
    """A valid header prefix with a random body: Kafka may refuse it; the proxy must survive."""
    payload = api_key.to_bytes(2, "big") + version.to_bytes(2, "big") + (1).to_bytes(4, "big")
    payload += junk
    with raw_connection(proxy) as sock:
        sock.sendall(len(payload).to_bytes(4, "big") + payload)
        sock.settimeout(1)
        with suppress(TimeoutError, ConnectionResetError):
            sock.recv(65536)
    with urllib.request.urlopen(f"{proxy.admin_url}/healthz", timeout=5) as answer:
        assert answer.status == 200
    assert client_works(proxy)


def test_a_real_client_still_works_after_the_fuzzing(proxy: ProxyProcess, topic: str) -> None:
    producer = Producer({"bootstrap.servers": proxy.bootstrap})
    producer.produce(topic, b"still fine")
    assert producer.flush(30) == 0
    assert read_topic(proxy.bootstrap, topic, 1) == [b"still fine"]

"""SNI routing on real Kafka: one TLS port for the bootstrap and every broker, the broker
chosen by the host name a client asks for in TLS SNI. The names live under
`deploy.tls.SNI_DOMAIN` (the local certificate names ``*.SNI_DOMAIN``); they resolve to
127.0.0.1 only for these clients: kafka-python through a patched ``getaddrinfo``, Kafka's
Java producer through a hosts file (``-Djdk.net.hosts.file``), as a DNS record or a load
balancer's name would for real clients.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kio.schema.api_versions.v0.request as api_versions_v0
import pytest
from kafka import KafkaAdminClient, KafkaProducer

from deploy.launcher import ProxyProcess
from deploy.local import EnvInfo
from deploy.tls import SNI_DOMAIN, LocalTls
from proxy.kafka.upstream_client import encode_request
from tests.support.java_clients import client_properties, sent, verifiable_producer
from tests.support.kafka_io import assert_exactly_once_in_order, read_all
from tests.support.ports import SNI, SNI_GROUP
from tests.support.proxies import own_proxy
from tests.support.proxy_api import admin_call, all_see_each_other
from tests.support.topics import new_topic
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration

BOOTSTRAP = f"bootstrap.{SNI_DOMAIN}"
BROKERS = f"broker-{{node_id}}.{SNI_DOMAIN}"


@pytest.fixture(scope="module")
def certs(local_env: EnvInfo) -> LocalTls:
    return LocalTls(Path(local_env.tls_dir))


@pytest.fixture(scope="module")
def sni_proxy(
    local_env: EnvInfo, certs: LocalTls, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ProxyProcess]:
    home = tmp_path_factory.mktemp("sni")
    process = own_proxy(
        local_env,
        SNI,
        f"sni-{uuid.uuid4().hex[:8]}",
        home / "proxy.log",
        DEDUP_PROXY_INSTANCE_ID=f"sni-{uuid.uuid4().hex[:8]}",
        DEDUP_PROXY_SNAPSHOT_TOPIC=f"__dedup_snapshots_sni_{uuid.uuid4().hex[:8]}",
        DEDUP_PROXY_LISTENER_TLS_CERT_FILE=str(certs.server_cert_file),
        DEDUP_PROXY_LISTENER_TLS_KEY_FILE=str(certs.server_key_file),
        DEDUP_PROXY_SNI_BOOTSTRAP_HOST=BOOTSTRAP,
        DEDUP_PROXY_SNI_BROKER_HOST_PATTERN=BROKERS,
    ).start()
    yield process
    assert process.stop() == 0, f"proxy did not shut down cleanly; see {home / 'proxy.log'}"


@pytest.fixture
def names_resolve_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """Names under SNI_DOMAIN resolve to 127.0.0.1 in this process."""
    real = socket.getaddrinfo

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(host, str) and host.lower().endswith(f".{SNI_DOMAIN}"):
            host = "127.0.0.1"
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


def kafka_python(bootstrap: str, certs: LocalTls) -> KafkaProducer:
    return KafkaProducer(
        bootstrap_servers=bootstrap,
        security_protocol="SSL",
        ssl_cafile=str(certs.ca_file),
        acks="all",
    )


def test_kafka_python_through_one_port_routed_by_name(
    sni_proxy: ProxyProcess, local_env: EnvInfo, certs: LocalTls, names_resolve_here: None
) -> None:
    """kafka-python bootstraps at `bootstrap.<domain>`, is told the brokers as
    `broker-N.<domain>` on the same port, and writes records with explicit identities
    there; a second producer re-sends the first half: every record once, in order."""
    topic = new_topic(local_env.bootstrap)
    port = SNI.listen
    for start, end in ((0, 400), (0, 200)):
        producer = kafka_python(f"{BOOTSTRAP}:{port}", certs)
        try:
            for n in range(start, end):
                headers = [("dedup.producer", b"sni-loader"), ("dedup.sequence", str(n).encode())]
                producer.send(topic, str(n).encode(), headers=headers)
            producer.flush(60)
        finally:
            producer.close(10)
    written = [value for value, _ in read_all(local_env.bootstrap, topic)]
    assert_exactly_once_in_order(written, 400)
    admin = KafkaAdminClient(
        bootstrap_servers=f"{BOOTSTRAP}:{port}",
        security_protocol="SSL",
        ssl_cafile=str(certs.ca_file),
    )
    try:
        brokers = admin.describe_cluster()["brokers"]
    finally:
        admin.close()
    assert brokers and all(
        (b["host"], b["port"]) == (BROKERS.format(node_id=b["broker_id"]), port) for b in brokers
    ), brokers


def test_the_java_producer_through_one_port_routed_by_name(
    sni_proxy: ProxyProcess, local_env: EnvInfo, certs: LocalTls, tmp_path: Path
) -> None:
    """Kafka's VerifiableProducer (idempotent, deduplicated on its producer id), the names
    resolved by a hosts file: every record once, in order."""
    topic = new_topic(local_env.bootstrap)
    hosts = tmp_path / "hosts"
    hosts.write_text(
        f"127.0.0.1 {BOOTSTRAP} " + " ".join(BROKERS.format(node_id=n) for n in range(8)) + "\n"
    )
    config = client_properties(tmp_path / "producer.properties", certs)
    events = verifiable_producer(f"{BOOTSTRAP}:{SNI.listen}", topic, 500, config, hosts_file=hosts)
    assert sent(events) == (500, [])
    written = [value for value, _ in read_all(local_env.bootstrap, topic)]
    assert written == [str(i).encode() for i in range(500)]


def test_two_instances_each_behind_names_of_its_own(
    local_env: EnvInfo, certs: LocalTls, tmp_path: Path, names_resolve_here: None
) -> None:
    """Two instances sharing Redis and a snapshot topic, each routing its own names
    (`a-broker-N`, `b-broker-N`): a client that bootstraps at one is sent to the other for
    the partitions the other owns, by name, and every partition holds each record once."""
    tag = uuid.uuid4().hex[:8]
    shared = {
        "DEDUP_PROXY_SNAPSHOT_TOPIC": f"__dedup_snapshots_sni_{tag}",
        "DEDUP_PROXY_LISTENER_TLS_CERT_FILE": str(certs.server_cert_file),
        "DEDUP_PROXY_LISTENER_TLS_KEY_FILE": str(certs.server_key_file),
    }
    instances = [
        own_proxy(
            local_env,
            ports,
            f"sni-group-{tag}",
            tmp_path / f"{name}.log",
            DEDUP_PROXY_INSTANCE_ID=f"sni-{name}-{tag}",
            DEDUP_PROXY_SNI_BOOTSTRAP_HOST=f"{name}-bootstrap.{SNI_DOMAIN}",
            DEDUP_PROXY_SNI_BROKER_HOST_PATTERN=f"{name}-broker-{{node_id}}.{SNI_DOMAIN}",
            **shared,
        ).start()
        for name, ports in zip("ab", SNI_GROUP, strict=True)
    ]
    # Both members joined before the first write, and enough partitions that the placement
    # gives each some (all 12 to one of two: 1 in 2,048).
    admin_urls = [process.admin_url for process in instances]
    wait_until(lambda: all_see_each_other(admin_urls), 30, "both instances see each other")
    partitions = 12
    topic = new_topic(local_env.bootstrap, partitions=partitions)
    try:
        for start, end in ((0, 60), (0, 30)):
            producer = kafka_python(f"a-bootstrap.{SNI_DOMAIN}:{SNI_GROUP[0].listen}", certs)
            try:
                for n in range(start, end):
                    for partition in range(partitions):
                        headers = [
                            ("dedup.producer", f"sni-{partition}".encode()),
                            ("dedup.sequence", str(n).encode()),
                        ]
                        producer.send(topic, str(n).encode(), partition=partition, headers=headers)
                producer.flush(60)
            finally:
                producer.close(10)
        held = [admin_call(process, "GET", "/v1/ownership")["held"] for process in instances]
        assert all(held), f"each instance owns some of the partitions: {held}"
    finally:
        for process in instances:
            assert process.stop() == 0, f"an instance did not stop cleanly; see {tmp_path}"
    for partition in range(partitions):
        written = [value for value, _ in read_all(local_env.bootstrap, topic, partition)]
        assert_exactly_once_in_order(written, 60)


@pytest.mark.parametrize(
    "server_name", [None, f"nobody.{SNI_DOMAIN}", f"broker-01.{SNI_DOMAIN}"], ids=str
)
def test_a_name_that_routes_nowhere_is_closed(
    sni_proxy: ProxyProcess, certs: LocalTls, server_name: str | None
) -> None:
    """No SNI (a client that connects by address), an unknown name, a node id written
    otherwise than Kafka writes it: the TLS handshake completes, then the connection closes
    without an answer."""
    context = ssl.create_default_context(cafile=str(certs.ca_file))
    context.check_hostname = server_name is not None
    answer = b""
    with (
        socket.create_connection(("127.0.0.1", SNI.listen), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname=server_name) as tls,
    ):
        tls.sendall(encode_request(api_versions_v0.ApiVersionsRequest(), 7))
        with contextlib.suppress(ConnectionResetError, ssl.SSLEOFError):  # closed abruptly
            answer = tls.recv(4)
    assert answer == b""

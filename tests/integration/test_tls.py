"""TLS and SASL end to end, on real Kafka and Redis: clients reach the proxy over TLS (with client
certificates: mutual TLS), the proxy reaches Kafka over TLS only (the brokers' SSL
listeners, `deploy.tls`), its admin API speaks HTTPS, and dedup holds through a SIGKILL of
the proxy in the middle of the stream. Redis too speaks TLS only (and asks for a client
certificate and a password). A second proxy sits in front of the brokers' SASL_SSL
listeners only, with SCRAM credentials of its own, and relays its clients' own SASL; a
third authenticates with OAUTHBEARER tokens from a token endpoint (client credentials),
and its clients with bearer tokens of their own.

The proxy here is given only the brokers' TLS listeners: every connection it opens to
Kafka (the relayed clients', its metadata, its writes, its replay, its snapshots) must speak
TLS or nothing works.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kio.schema.api_versions.v0.request as api_versions_v0
import pytest
from confluent_kafka import KafkaException, Producer

from dedup.batches import HEADER_PRODUCER, HEADER_SEQUENCE
from dedup.client import DedupProducer
from deploy.launcher import ProxyProcess
from deploy.local import EnvInfo
from deploy.processes import port_open
from deploy.tls import LocalTls, unsigned_token
from proxy.kafka.upstream_client import encode_request
from tests.support.java_clients import client_properties, sent, verifiable_producer
from tests.support.kafka_io import (
    assert_exactly_once_in_order,
    offsets_by_value,
    read_all,
    values,
)
from tests.support.oauth import Issuer, token_endpoint
from tests.support.ports import (
    CERT_RELOAD,
    OAUTH,
    OAUTH_FILE,
    SASL,
    TLS,
    TLS_REDIS,
    ProxyPorts,
)
from tests.support.proxies import own_proxy
from tests.support.raw import correlation_id, read_response
from tests.support.topics import new_topic
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration

TOTAL = 3000
REDIS_PASSWORD = "tls-redis-password-0123456789"


@pytest.fixture(scope="module")
def certs(local_env: EnvInfo) -> LocalTls:
    assert local_env.tls_bootstrap, "the local environment has no TLS listeners"
    return LocalTls(Path(local_env.tls_dir))


@pytest.fixture(scope="module")
def tls_redis(certs: LocalTls, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Redis that speaks only TLS, asks for a client certificate and a password; its URL."""
    home = tmp_path_factory.mktemp("tls-redis")
    server = subprocess.Popen(
        [
            "redis-server",
            *("--bind", "127.0.0.1", "--port", "0", "--tls-port", str(TLS_REDIS)),
            *("--tls-cert-file", str(certs.server_cert_file)),
            *("--tls-key-file", str(certs.server_key_file)),
            *("--tls-ca-cert-file", str(certs.ca_file)),
            *("--tls-auth-clients", "yes", "--requirepass", REDIS_PASSWORD),
            *("--save", "", "--appendonly", "no", "--dir", str(home)),
        ],
        stdout=(home / "redis.log").open("wb"),
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 10
        while not port_open("127.0.0.1", TLS_REDIS) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert port_open("127.0.0.1", TLS_REDIS), "the TLS Redis did not start"
        yield f"rediss://:{REDIS_PASSWORD}@127.0.0.1:{TLS_REDIS}/0"
    finally:
        server.terminate()
        server.wait(10)


@pytest.fixture(scope="module")
def tls_proxy(
    local_env: EnvInfo,
    certs: LocalTls,
    tls_redis: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ProxyProcess]:
    """Every hop over TLS: clients (with certificates), Kafka, Redis, the admin API."""
    home = tmp_path_factory.mktemp("tls")
    process = own_proxy(
        local_env,
        TLS,
        f"tls-{uuid.uuid4().hex[:8]}",
        home / "proxy.log",
        upstream=local_env.tls_bootstrap,
        admin_ca_file=certs.ca_file,
        admin_client_cert=(certs.client_cert_file, certs.client_key_file),
        DEDUP_PROXY_REDIS=tls_redis,
        DEDUP_PROXY_REDIS_TLS_CA_FILE=str(certs.ca_file),
        DEDUP_PROXY_REDIS_TLS_CERT_FILE=str(certs.client_cert_file),
        DEDUP_PROXY_REDIS_TLS_KEY_FILE=str(certs.client_key_file),
        DEDUP_PROXY_INSTANCE_ID=f"tls-{uuid.uuid4().hex[:8]}",
        DEDUP_PROXY_SNAPSHOT_TOPIC=f"__dedup_snapshots_tls_{uuid.uuid4().hex[:8]}",
        DEDUP_PROXY_LISTENER_TLS_CERT_FILE=str(certs.server_cert_file),
        DEDUP_PROXY_LISTENER_TLS_KEY_FILE=str(certs.server_key_file),
        DEDUP_PROXY_LISTENER_TLS_CLIENT_CA_FILE=str(certs.ca_file),
        DEDUP_PROXY_UPSTREAM_SECURITY_PROTOCOL="SSL",
        DEDUP_PROXY_UPSTREAM_TLS_CA_FILE=str(certs.ca_file),
        DEDUP_PROXY_ADMIN_TLS_CERT_FILE=str(certs.server_cert_file),
        DEDUP_PROXY_ADMIN_TLS_KEY_FILE=str(certs.server_key_file),
        DEDUP_PROXY_ADMIN_TLS_CLIENT_CA_FILE=str(certs.ca_file),
    ).start()
    yield process
    assert process.stop() == 0, f"proxy did not shut down cleanly; see {home / 'proxy.log'}"
    assert REDIS_PASSWORD not in (home / "proxy.log").read_text(), "a password reached the log"


@pytest.fixture(scope="module")
def sasl_proxy(
    local_env: EnvInfo,
    certs: LocalTls,
    tmp_path_factory: pytest.TempPathFactory,
    redis_key_prefix: str,
) -> Iterator[ProxyProcess]:
    """In front of Kafka's SASL_SSL listeners only, with SCRAM credentials of its own."""
    password = certs.sasl_users["proxy"]
    yield from sasl_ssl_proxy(
        "sasl",
        SASL,
        local_env,
        certs,
        tmp_path_factory,
        redis_key_prefix,
        secret=password,
        DEDUP_PROXY_UPSTREAM_SASL_MECHANISM="SCRAM-SHA-512",
        DEDUP_PROXY_UPSTREAM_SASL_USERNAME="proxy",
        DEDUP_PROXY_UPSTREAM_SASL_PASSWORD=password,
    )


@pytest.fixture(scope="module")
def issuer() -> Iterator[Issuer]:
    """The token endpoint of the proxy's own OAUTHBEARER tokens (they name `proxy`)."""
    with token_endpoint(Issuer("dedup-proxy", "client-secret-0123", subject="proxy")) as served:
        yield served


@pytest.fixture(scope="module")
def oauth_proxy(
    local_env: EnvInfo,
    certs: LocalTls,
    issuer: Issuer,
    tmp_path_factory: pytest.TempPathFactory,
    redis_key_prefix: str,
) -> Iterator[ProxyProcess]:
    """In front of Kafka's SASL_SSL listeners, with OAUTHBEARER tokens of its own for every
    connection it opens (its asyncio ones and its librdkafka clients alike)."""
    yield from sasl_ssl_proxy(
        "oauth",
        OAUTH,
        local_env,
        certs,
        tmp_path_factory,
        redis_key_prefix,
        secret=issuer.client_secret,
        DEDUP_PROXY_UPSTREAM_SASL_MECHANISM="OAUTHBEARER",
        DEDUP_PROXY_UPSTREAM_SASL_OAUTHBEARER_TOKEN_ENDPOINT_URL=issuer.url,
        DEDUP_PROXY_UPSTREAM_SASL_OAUTHBEARER_CLIENT_ID=issuer.client_id,
        DEDUP_PROXY_UPSTREAM_SASL_OAUTHBEARER_CLIENT_SECRET=issuer.client_secret,
    )


def sasl_ssl_proxy(
    name: str,
    ports: ProxyPorts,
    local_env: EnvInfo,
    certs: LocalTls,
    tmp_path_factory: pytest.TempPathFactory,
    redis_key_prefix: str,
    secret: str,
    **credentials: str,
) -> Iterator[ProxyProcess]:
    """A proxy with a TLS listener in front of Kafka's SASL_SSL listeners, authenticating
    with ``credentials``; ``secret`` must never reach its log."""
    home = tmp_path_factory.mktemp(name)
    process = own_proxy(
        local_env,
        ports,
        f"{redis_key_prefix}-{name}",
        home / "proxy.log",
        upstream=local_env.sasl_ssl_bootstrap,
        DEDUP_PROXY_INSTANCE_ID=f"{name}-{uuid.uuid4().hex[:8]}",
        DEDUP_PROXY_SNAPSHOT_TOPIC=f"__dedup_snapshots_{name}_{uuid.uuid4().hex[:8]}",
        DEDUP_PROXY_LISTENER_TLS_CERT_FILE=str(certs.server_cert_file),
        DEDUP_PROXY_LISTENER_TLS_KEY_FILE=str(certs.server_key_file),
        DEDUP_PROXY_UPSTREAM_SECURITY_PROTOCOL="SASL_SSL",
        DEDUP_PROXY_UPSTREAM_TLS_CA_FILE=str(certs.ca_file),
        **credentials,
    ).start()
    yield process
    assert process.stop() == 0, f"proxy did not shut down cleanly; see {home / 'proxy.log'}"
    assert secret not in (home / "proxy.log").read_text(), "a secret reached the log"


def client_oauthbearer(certs: LocalTls, subject: str) -> dict[str, str]:
    """librdkafka with its own unsigned bearer tokens naming ``subject``, over TLS."""
    return {
        "security.protocol": "sasl_ssl",
        "ssl.ca.location": str(certs.ca_file),
        "sasl.mechanism": "OAUTHBEARER",
        "enable.sasl.oauthbearer.unsecure.jwt": "true",
        "sasl.oauthbearer.config": f"principal={subject}",
    }


def client_sasl(certs: LocalTls, mechanism: str) -> dict[str, str]:
    """librdkafka settings of user `client` over TLS, trusting the local CA."""
    return {
        "security.protocol": "sasl_ssl",
        "ssl.ca.location": str(certs.ca_file),
        "sasl.mechanism": mechanism,
        "sasl.username": "client",
        "sasl.password": certs.sasl_users["client"],
    }


def client_tls(certs: LocalTls) -> dict[str, str]:
    """librdkafka settings of a client with a certificate, trusting the local CA."""
    return {
        "security.protocol": "ssl",
        "ssl.ca.location": str(certs.ca_file),
        "ssl.certificate.location": str(certs.client_cert_file),
        "ssl.key.location": str(certs.client_key_file),
    }


def kafka_tls(certs: LocalTls) -> dict[str, str]:
    return {"security.protocol": "ssl", "ssl.ca.location": str(certs.ca_file)}


def test_dedup_over_tls_holds_through_a_proxy_sigkill(
    tls_proxy: ProxyProcess, local_env: EnvInfo, certs: LocalTls
) -> None:
    """librdkafka with a client certificate through the proxy's TLS listener, the proxy to
    Kafka and Redis over TLS."""
    topic = produce_through_a_kill(tls_proxy, local_env, certs, client_tls(certs))
    # The client certificate's subject is the principal its producer name is bound to.
    assert principals(tls_proxy, topic) == {"secured-loader": "User:CN=client"}
    # A producer and the CLI ask the admin API (HTTPS, client certificate) where to resume.
    resumed = DedupProducer(
        tls_proxy.bootstrap,
        "secured-loader",
        admin_url=tls_proxy.admin_url,
        admin_tls=tls_proxy.admin_tls,
        **client_tls(certs),
    )
    assert resumed.last_sequence_id(topic) == TOTAL - 1
    cli = subprocess.run(
        [sys.executable, "-m", "dedup", "producers", topic, "--name", "secured-loader"],
        capture_output=True,
        text=True,
        timeout=60,
        env={
            **os.environ,
            "DEDUP_PROXY_ADMIN_URL": tls_proxy.admin_url,
            "DEDUP_PROXY_ADMIN_CA_FILE": str(certs.ca_file),
            "DEDUP_PROXY_ADMIN_CERT_FILE": str(certs.client_cert_file),
            "DEDUP_PROXY_ADMIN_KEY_FILE": str(certs.client_key_file),
        },
    )
    assert (cli.returncode, cli.stdout.strip()) == (0, str(TOTAL - 1)), cli.stderr


def test_dedup_over_sasl_ssl_holds_through_a_proxy_sigkill(
    sasl_proxy: ProxyProcess, local_env: EnvInfo, certs: LocalTls
) -> None:
    """Kafka's SASL_SSL listeners only: the proxy authenticates its own connections with
    SCRAM-SHA-512 as user `proxy`; the client authenticates itself, through the proxy,
    with SCRAM-SHA-256 as user `client`."""
    topic = produce_through_a_kill(
        sasl_proxy, local_env, certs, client_sasl(certs, "SCRAM-SHA-256")
    )
    assert principals(sasl_proxy, topic) == {"secured-loader": "User:client"}


def test_dedup_with_oauthbearer_holds_through_a_proxy_sigkill(
    oauth_proxy: ProxyProcess, local_env: EnvInfo, certs: LocalTls, issuer: Issuer
) -> None:
    """The proxy's own connections with tokens from its token endpoint (the replay after
    the kill included); the client with a bearer token of its own, whose subject becomes the
    principal its producer name is bound to."""
    topic = produce_through_a_kill(
        oauth_proxy, local_env, certs, client_oauthbearer(certs, "oauth-client")
    )
    assert principals(oauth_proxy, topic) == {"secured-loader": "User:oauth-client"}
    granted = [form for form in issuer.asked if form == {"grant_type": ["client_credentials"]}]
    assert len(granted) >= 2 and issuer.refused == 0  # a token per process run, at least


def test_the_proxy_takes_its_token_from_a_file(
    local_env: EnvInfo, certs: LocalTls, tmp_path: Path, redis_key_prefix: str
) -> None:
    """A token file (what a sidecar or a projected volume renews) for every connection the
    proxy opens, its librdkafka clients' included: dedup holds through a SIGKILL, after
    which the file holds a renewed token (the file is read at every authentication:
    tests/unit/test_oauthbearer.py)."""
    token_file = tmp_path / "token"
    token_file.write_text(unsigned_token("proxy"))
    process = own_proxy(
        local_env,
        OAUTH_FILE,
        f"{redis_key_prefix}-oauth-file",
        tmp_path / "proxy.log",
        upstream=local_env.sasl_ssl_bootstrap,
        DEDUP_PROXY_INSTANCE_ID=f"oauth-file-{uuid.uuid4().hex[:8]}",
        DEDUP_PROXY_SNAPSHOT_TOPIC=f"__dedup_snapshots_oauth_file_{uuid.uuid4().hex[:8]}",
        DEDUP_PROXY_UPSTREAM_SECURITY_PROTOCOL="SASL_SSL",
        DEDUP_PROXY_UPSTREAM_TLS_CA_FILE=str(certs.ca_file),
        DEDUP_PROXY_UPSTREAM_SASL_MECHANISM="OAUTHBEARER",
        DEDUP_PROXY_UPSTREAM_SASL_OAUTHBEARER_TOKEN_FILE=str(token_file),
    ).start()
    topic = new_topic(local_env.bootstrap)
    try:
        for round_, subject in enumerate(["proxy", "renewed"]):
            token_file.write_text(unsigned_token(subject))
            if round_:
                process.kill()
                process.start()
            # The client authenticates itself (PLAIN, to a plaintext listener of the proxy).
            client = client_sasl(certs, "PLAIN") | {"security.protocol": "sasl_plaintext"}
            del client["ssl.ca.location"]
            producer = DedupProducer(process.bootstrap, "filed", **client)
            for n in range(200):
                producer.send(topic, str(n).encode(), sequence_id=n)
            assert producer.flush(60) == 0
    finally:
        assert process.stop() == 0, f"proxy did not stop cleanly; see {tmp_path / 'proxy.log'}"
    written = [value for value, _ in read_all(local_env.tls_bootstrap, topic, **kafka_tls(certs))]
    assert_exactly_once_in_order(written, 200)


def test_a_producer_name_belongs_to_the_principal_that_used_it_first(
    sasl_proxy: ProxyProcess, local_env: EnvInfo, certs: LocalTls
) -> None:
    """User `client` writes as producer `orders`; user `proxy` (another principal) then
    writes records under `orders` with the next sequences: refused, nothing written, while
    its own name works. Once an operator releases `orders`, the next user to write owns it."""
    topic = new_topic(local_env.bootstrap)
    owner = DedupProducer(sasl_proxy.bootstrap, "orders", **client_sasl(certs, "PLAIN"))
    for n in range(10):
        owner.send(topic, f"real-{n}".encode(), sequence_id=n)
    assert owner.flush(60) == 0
    other = client_sasl(certs, "SCRAM-SHA-512") | {
        "sasl.username": "proxy",
        "sasl.password": certs.sasl_users["proxy"],
    }
    failures = send_as(sasl_proxy, other, topic, "orders", range(10, 15))
    assert failures == ["TOPIC_AUTHORIZATION_FAILED"] * 5, failures
    assert send_as(sasl_proxy, other, topic, "audit", range(5)) == []
    written = [value for value, _ in read_all(local_env.tls_bootstrap, topic, **kafka_tls(certs))]
    assert written == [f"real-{n}".encode() for n in range(10)] + [
        f"audit-{n}".encode() for n in range(5)
    ]
    assert principals(sasl_proxy, topic) == {"orders": "User:client", "audit": "User:proxy"}

    with urllib.request.urlopen(
        urllib.request.Request(
            f"{sasl_proxy.admin_url}/v1/topics/{topic}/principals/orders", method="DELETE"
        ),
        timeout=10,
    ) as answer:
        assert json.load(answer)["released"] is True
    assert send_as(sasl_proxy, other, topic, "orders", range(10, 12)) == []
    assert principals(sasl_proxy, topic)["orders"] == "User:proxy"


def test_a_transaction_cannot_commit_records_under_another_principals_name(
    sasl_proxy: ProxyProcess, local_env: EnvInfo, certs: LocalTls
) -> None:
    """Transactional requests pass the proxy unchecked, but a committed record's identity
    counts at the next recovery: user `proxy` must not commit records under `tx-orders`,
    which user `client` owns, or `client`'s own later records would be dropped. The
    request is refused whole (nothing written, the transaction aborts); under a name of its
    own the same transaction commits."""
    topic = new_topic(local_env.bootstrap, partitions=2)
    owner = DedupProducer(sasl_proxy.bootstrap, "tx-orders", **client_sasl(certs, "PLAIN"))
    for n in range(3):
        owner.send(topic, f"real-{n}".encode(), sequence_id=n, partition=0)
    assert owner.flush(60) == 0
    other = client_sasl(certs, "SCRAM-SHA-512") | {
        "sasl.username": "proxy",
        "sasl.password": certs.sasl_users["proxy"],
    }

    def in_transaction(name: str, sequences: range) -> list[str]:
        """A new transactional client (librdkafka keeps a topic it was refused on refused)
        sends ``name``'s sequences to partition 0 and one plain record to partition 1 in one
        transaction, and commits it if every delivery succeeded, else aborts it."""
        failures: list[str] = []
        forger = Producer(
            other
            | {
                "bootstrap.servers": sasl_proxy.bootstrap,
                "transactional.id": f"tx-{uuid.uuid4().hex[:8]}",
            }
        )
        forger.init_transactions(30)

        def on_delivery(error: Any, _message: object) -> None:
            if error is not None:
                failures.append(error.name())

        forger.begin_transaction()
        try:
            for n in sequences:
                headers = [(HEADER_PRODUCER, name.encode()), (HEADER_SEQUENCE, b"%d" % n)]
                value = f"{name}-{n}".encode()
                forger.produce(topic, value, partition=0, headers=headers, on_delivery=on_delivery)
            forger.produce(topic, f"plain-{name}".encode(), partition=1, on_delivery=on_delivery)
            forger.flush(60)
        except KafkaException as exc:  # the transaction failed: no more records taken
            failures.append(exc.args[0].name())
        if failures:
            forger.abort_transaction(30)
        else:
            forger.commit_transaction(30)
        return failures

    refused = in_transaction("tx-orders", range(3, 6))
    assert "TOPIC_AUTHORIZATION_FAILED" in refused, refused
    assert in_transaction("tx-audit", range(2)) == []

    def written(partition: int, isolation: str) -> list[bytes]:
        config = {"isolation.level": isolation, **kafka_tls(certs)}
        return [v for v, _ in read_all(local_env.tls_bootstrap, topic, partition, **config)]

    # Not even an aborted trace: the forged batch never reached Kafka.
    expected = [b"real-0", b"real-1", b"real-2", b"tx-audit-0", b"tx-audit-1"]
    assert written(0, "read_uncommitted") == expected
    assert written(0, "read_committed") == expected
    assert written(1, "read_committed") == [b"plain-tx-audit"]
    assert principals(sasl_proxy, topic) == {
        "tx-orders": "User:client",
        "tx-audit": "User:proxy",
    }


def send_as(
    proxy: ProxyProcess, config: dict[str, str], topic: str, name: str, sequences: range
) -> list[str]:
    """Send ``NAME-SEQ`` values as producer ``name``; the error names of failed deliveries."""
    failures: list[str] = []

    def on_delivery(error: Any, _message: object) -> None:
        if error is not None:
            failures.append(error.name())

    producer = DedupProducer(proxy.bootstrap, name, **config)
    for n in sequences:
        producer.send(topic, f"{name}-{n}".encode(), sequence_id=n, on_delivery=on_delivery)
    assert producer.flush(60) == 0
    return failures


def principals(proxy: ProxyProcess, topic: str) -> dict[str, str]:
    url = f"{proxy.admin_url}/v1/topics/{topic}/principals"
    with urllib.request.urlopen(url, timeout=10, context=proxy.admin_tls) as answer:
        found: dict[str, str] = json.load(answer)["principals"]
        return found


def test_a_recovery_asks_kafka_over_sasl_ssl_when_an_open_transaction_ends(
    sasl_proxy: ProxyProcess, local_env: EnvInfo, certs: LocalTls
) -> None:
    """A transaction open in the log at a recovery: the proxy asks Kafka its deadline
    (DescribeProducers, ListTransactions, DescribeTransactions: `dedup.transaction_deadlines`)
    on its own SCRAM connections, and waits for Kafka to abort it. The client never ends
    it; the re-sends of its sequences are written once."""
    topic = new_topic(local_env.bootstrap)
    client = client_sasl(certs, "SCRAM-SHA-256")
    first = DedupProducer(sasl_proxy.bootstrap, "tx-abandoned", **client)
    for n in range(3):
        first.send(topic, str(n).encode(), sequence_id=n)
    assert first.flush(60) == 0
    abandoned = Producer(
        {
            "bootstrap.servers": local_env.sasl_ssl_bootstrap,
            "transactional.id": f"tx-{uuid.uuid4().hex[:8]}",
            "transaction.timeout.ms": 6000,
            **client,
        }
    )
    abandoned.init_transactions(30)
    abandoned.begin_transaction()
    for n in (3, 4):
        headers = [(HEADER_PRODUCER, b"tx-abandoned"), (HEADER_SEQUENCE, b"%d" % n)]
        abandoned.produce(topic, str(n).encode(), headers=headers)
    assert abandoned.flush(30) == 0
    sasl_proxy.kill()
    sasl_proxy.start()
    again = DedupProducer(sasl_proxy.bootstrap, "tx-abandoned", **client)
    for n in range(5):
        again.send(topic, str(n).encode(), sequence_id=n)
    assert again.flush(120) == 0
    written = [value for value, _ in read_all(local_env.sasl_ssl_bootstrap, topic, **client)]
    assert_exactly_once_in_order(written, 5)
    assert sasl_proxy.log_path is not None
    log_lines = [line for line in sasl_proxy.log_path.read_text().splitlines() if topic in line]
    assert [line for line in log_lines if "waiting for a transaction open" in line], log_lines
    assert not [line for line in log_lines if "deadline is unknown" in line], log_lines


def test_a_client_with_a_wrong_password_is_refused_by_kafka_through_the_proxy(
    sasl_proxy: ProxyProcess, certs: LocalTls
) -> None:
    config = client_sasl(certs, "PLAIN") | {"sasl.password": "not-the-password"}
    failures: list[str] = []
    producer = Producer(
        {
            "bootstrap.servers": sasl_proxy.bootstrap,
            **config,
            "error_cb": lambda error: failures.append(str(error)),
        }
    )
    producer.poll(5)
    assert any("Authentication failed" in failure for failure in failures), failures


@pytest.mark.parametrize(
    ("mechanism", "proxy_fixture"),
    [("SCRAM-SHA-512", "sasl_proxy"), ("OAUTHBEARER", "oauth_proxy")],
)
def test_the_java_producer_with_sasl_over_tls_through_the_proxy(
    mechanism: str,
    proxy_fixture: str,
    request: pytest.FixtureRequest,
    local_env: EnvInfo,
    certs: LocalTls,
    tmp_path: Path,
) -> None:
    """Kafka's own VerifiableProducer (idempotent: the proxy dedups on its producer id and
    sequences), SCRAM-SHA-512 or OAUTHBEARER over TLS through the proxy (itself on SCRAM or
    on OAUTHBEARER); every record once, in order."""
    proxy: ProxyProcess = request.getfixturevalue(proxy_fixture)
    topic = new_topic(local_env.bootstrap)
    config = client_properties(tmp_path / "producer.properties", certs, mechanism)
    assert sent(verifiable_producer(proxy.bootstrap, topic, 500, config)) == (500, [])
    written = [value for value, _ in read_all(local_env.tls_bootstrap, topic, **kafka_tls(certs))]
    assert written == [str(i).encode() for i in range(500)]


def produce_through_a_kill(
    proxy: ProxyProcess, env: EnvInfo, certs: LocalTls, client_config: dict[str, str]
) -> str:
    """A steady stream through `proxy`, which is killed with -9 after 100 records are
    acknowledged and a burst more is on its way, and started again as the same instance;
    the producer retries what was in flight, and a second producer re-sends the first 500.
    The topic, read over Kafka's own TLS listener, holds every record once, in order, and
    each delivery report of the first producer names its record's offset; each of the
    re-sender's names its record's, or none: a re-sent batch that spans the restart's
    fence marker (an offset between its records) has no base offset right for all of them,
    and is answered to librdkafka below zero."""
    topic = new_topic(env.bootstrap)
    producer = DedupProducer(proxy.bootstrap, "secured-loader", **client_config)
    errors: list[str] = []
    delivered = 0
    reported: dict[bytes, int | None] = {}  # the latest report's offset by value (None: none)

    def on_delivery(error: object, message: Any) -> None:
        nonlocal delivered
        delivered += 1
        if error is not None:
            errors.append(str(error))
        else:
            reported[message.value()] = message.offset()

    killed = False
    n = 0
    while n < TOTAL:
        producer.send(topic, str(n).encode(), sequence_id=n, on_delivery=on_delivery)
        n += 1
        if n % 20 == 0:
            producer.poll(0.02)  # a steady stream over seconds, acknowledged as it goes
        if not killed and delivered >= 100:
            # A burst on its way (some on the wire, some queued), then the kill.
            for _ in range(100):
                producer.send(topic, str(n).encode(), sequence_id=n, on_delivery=on_delivery)
                n += 1
            producer.poll(0.003)
            proxy.kill()
            killed = True
            proxy.start()
    assert killed
    assert producer.flush(120) == 0
    assert len(reported) == TOTAL
    first_reports = dict(reported)
    resend = DedupProducer(proxy.bootstrap, "secured-loader", **client_config)
    for n in range(500):
        resend.send(topic, str(n).encode(), sequence_id=n, on_delivery=on_delivery)
    assert resend.flush(60) == 0
    assert errors == []
    written = [value for value, _ in read_all(env.tls_bootstrap, topic, **kafka_tls(certs))]
    assert_exactly_once_in_order(written, TOTAL)
    in_log = offsets_by_value(env.tls_bootstrap, topic, **kafka_tls(certs))
    wrong = [(value, offset) for value, offset in first_reports.items() if offset != in_log[value]]
    assert wrong == [], (len(wrong), wrong[:5])
    assert delivered == TOTAL + 500
    resent = {str(n).encode(): reported[str(n).encode()] for n in range(500)}
    wrong = [(v, at) for v, at in resent.items() if at is not None and at != in_log[v]]
    assert wrong == [], (len(wrong), wrong[:5])
    return topic


def test_a_client_without_a_certificate_is_refused(
    tls_proxy: ProxyProcess, certs: LocalTls
) -> None:
    answered_with_cert = api_versions_over_tls(tls_proxy, certs, with_certificate=True)
    assert answered_with_cert, "a client with a certificate got no answer"
    with pytest.raises((ssl.SSLError, ConnectionError)):
        api_versions_over_tls(tls_proxy, certs, with_certificate=False)


def test_a_plaintext_client_gets_nothing_from_a_tls_listener(
    tls_proxy: ProxyProcess, local_env: EnvInfo
) -> None:
    producer = Producer({"bootstrap.servers": tls_proxy.bootstrap, "socket.timeout.ms": 3000})
    try:
        metadata = None
        with pytest.raises(Exception, match=r"(?i)timed out|transport|disconnect"):
            metadata = producer.list_topics(timeout=3)
        assert metadata is None
    finally:
        producer.flush(1)


def test_renewed_certificates_are_taken_on_sighup(
    local_env: EnvInfo, certs: LocalTls, tmp_path: Path
) -> None:
    """The listener's and the admin API's certificate files are replaced by ones of another
    CA; after SIGHUP new connections get the new certificate, and a client sends records
    over them as before."""
    live = tmp_path / "live"
    live.mkdir()
    for name in ("cert.pem", "key.pem"):
        (live / name).write_bytes(
            (certs.server_cert_file if name == "cert.pem" else certs.server_key_file).read_bytes()
        )
    renewed = LocalTls(tmp_path / "renewed").ensure()  # a CA of its own
    process = own_proxy(
        local_env,
        CERT_RELOAD,
        f"reload-{uuid.uuid4().hex[:8]}",
        tmp_path / "proxy.log",
        admin_ca_file=certs.ca_file,
        DEDUP_PROXY_LISTENER_TLS_CERT_FILE=str(live / "cert.pem"),
        DEDUP_PROXY_LISTENER_TLS_KEY_FILE=str(live / "key.pem"),
        DEDUP_PROXY_ADMIN_TLS_CERT_FILE=str(live / "cert.pem"),
        DEDUP_PROXY_ADMIN_TLS_KEY_FILE=str(live / "key.pem"),
    ).start()
    try:
        assert served_certificate(CERT_RELOAD.listen) == certificate_der(certs.server_cert_file)
        (live / "cert.pem").write_bytes(renewed.server_cert_file.read_bytes())
        (live / "key.pem").write_bytes(renewed.server_key_file.read_bytes())
        os.kill(process.pid, signal.SIGHUP)
        wait_until(
            lambda: (
                served_certificate(CERT_RELOAD.listen) == certificate_der(renewed.server_cert_file)
            ),
            10,
            "the listener serves the renewed certificate",
        )
        assert served_certificate(CERT_RELOAD.admin) == certificate_der(renewed.server_cert_file)
        topic = new_topic(local_env.bootstrap)
        trusting = {"security.protocol": "ssl", "ssl.ca.location": str(renewed.ca_file)}
        producer = DedupProducer(process.bootstrap, "renewed", **trusting)
        for n in range(50):
            producer.send(topic, str(n).encode(), sequence_id=n)
        assert producer.flush(60) == 0
        assert_exactly_once_in_order(values(local_env.bootstrap, topic), 50)
    finally:
        process.admin_ca_file = renewed.ca_file  # for its health checks while stopping
        assert process.stop() == 0, f"proxy did not stop cleanly; see {tmp_path / 'proxy.log'}"


def served_certificate(port: int) -> bytes:
    """The certificate a TLS listener presents (DER), whoever signed it."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        context.wrap_socket(raw) as tls,
    ):
        presented = tls.getpeercert(binary_form=True)
    assert presented is not None
    return presented


def certificate_der(path: Path) -> bytes:
    return ssl.PEM_cert_to_DER_cert(path.read_text())


def test_the_admin_api_speaks_https_only(tls_proxy: ProxyProcess, certs: LocalTls) -> None:
    health = tls_proxy.health()  # over HTTPS, checked against the local CA
    assert health is not None and health["status"] == "ok"
    # Mutual TLS authenticates: without a client certificate only the probes answer.
    anonymous = ssl.create_default_context(cafile=certs.ca_file)
    with urllib.request.urlopen(f"{tls_proxy.admin_url}/healthz", context=anonymous) as answer:
        assert answer.status == 200
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{tls_proxy.admin_url}/v1/ownership", context=anonymous)
    assert refused.value.code == 401
    with urllib.request.urlopen(
        f"{tls_proxy.admin_url}/v1/ownership", context=tls_proxy.admin_tls
    ) as answer:
        assert answer.status == 200
    with socket.create_connection(("127.0.0.1", TLS.admin), timeout=5) as plain:
        plain.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        try:
            answer = plain.recv(4096)
        except (TimeoutError, ConnectionError):
            answer = b""
    assert b'"status"' not in answer  # no JSON over plain HTTP


def api_versions_over_tls(proxy: ProxyProcess, certs: LocalTls, *, with_certificate: bool) -> bytes:
    """ApiVersions v0 over TLS to the bootstrap listener; the raw answer (correlation id
    first). Raises when the connection is refused or closed without an answer."""
    context = ssl.create_default_context(cafile=certs.ca_file)
    if with_certificate:
        context.load_cert_chain(certs.client_cert_file, certs.client_key_file)
    with (
        socket.create_connection(("127.0.0.1", TLS.listen), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        tls.sendall(encode_request(api_versions_v0.ApiVersionsRequest(), 7))
        answer = read_response(tls)
    assert correlation_id(answer) == 7
    return answer

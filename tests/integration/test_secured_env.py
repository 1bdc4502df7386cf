"""A local environment with nothing but secured listeners (`local up --security sasl_ssl`):
Kafka serves SASL_SSL only (replication too), Redis TLS only with client certificates and
a password, and the environment's own proxy speaks TLS to its clients and SCRAM to Kafka.
Nothing reaches either without credentials; dedup holds through a SIGKILL of the proxy for
librdkafka and for Kafka's Java producer, both with SCRAM over TLS through the proxy. Kafka
enforces ACLs, and the proxy's principal has only those the README lists for it
(`deploy.config.acl_grants`): every test here runs the proxy on them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kio.schema.api_versions.v0.request as api_versions_v0
import kio.schema.metadata.v12.request as metadata_v12
import pytest
import redis
from confluent_kafka import KafkaException
from confluent_kafka.admin import (
    AclBinding,
    AclBindingFilter,
    AclOperation,
    AclPermissionType,
    AdminClient,
    ResourcePatternType,
    ResourceType,
)
from kio.schema.errors import ErrorCode

from dedup.client import DedupProducer
from dedup.transaction_deadlines import DeadlineUnknown
from deploy.local import EnvInfo, LocalEnvironment
from deploy.tls import LocalTls
from proxy.kafka.sasl import SaslCredentials
from proxy.kafka.topology import Endpoint
from proxy.kafka.upstream_client import LinkSecurity, UpstreamClient, encode_request
from proxy.runtime.security import UpstreamSecurity
from tests.support.java_clients import client_properties, sent, verifiable_producer
from tests.support.kafka_io import assert_exactly_once_in_order, end_offset, read_all
from tests.support.ports import SECURED_ENV, SECURED_OWN
from tests.support.proxies import own_proxy
from tests.support.raw import (
    correlation_id,
    explicit_batch,
    first_answer,
    produce_request,
    produce_request_to,
    read_response,
)
from tests.support.topics import new_topic
from tests.support.transactions import deadlines, open_transaction
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration

TOTAL = 2000


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalEnvironment, EnvInfo]]:
    env = LocalEnvironment(home=tmp_path_factory.mktemp("secured") / "env", ports=SECURED_ENV)
    try:
        yield env, env.up(brokers=1, proxies=1, security="sasl_ssl")
    finally:
        env.down(purge=True)


def scram_link(info: EnvInfo, user: str) -> LinkSecurity:
    """The proxy's own connections' security, as ``user`` with SCRAM-SHA-512 over TLS."""
    certs = LocalTls(Path(info.tls_dir))
    return UpstreamSecurity(
        "SASL_SSL",
        ca_file=certs.ca_file,
        sasl=SaslCredentials("SCRAM-SHA-512", user, certs.sasl_users[user]),
    ).link()


def client_config(info: EnvInfo) -> dict[str, str]:
    """User `client` with SCRAM-SHA-256 over TLS (to the proxy as to Kafka)."""
    return info.kafka_config("client", "SCRAM-SHA-256")


def test_nothing_answers_without_tls_and_credentials(
    secured: tuple[LocalEnvironment, EnvInfo],
) -> None:
    _, info = secured
    certs = LocalTls(Path(info.tls_dir))
    host, port = info.bootstrap.split(",")[0].split(":")
    request = encode_request(api_versions_v0.ApiVersionsRequest(), 7)
    # Plaintext Kafka: the broker wants a TLS handshake; a Kafka request gets a TLS alert.
    with socket.create_connection((host, int(port)), timeout=10) as plain:
        assert exchange(plain, request)[:1] in (b"", b"\x15")  # nothing, or an alert record
    # TLS without SASL: ApiVersions is answered (clients ask it before SASL), Metadata is not.
    context = ssl.create_default_context(cafile=str(certs.ca_file))
    with (
        socket.create_connection((host, int(port)), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname=host) as tls,
    ):
        tls.sendall(request)
        assert correlation_id(read_response(tls)) == 7
        metadata = metadata_v12.MetadataRequest(
            topics=None, allow_auto_topic_creation=False, include_topic_authorized_operations=False
        )
        tls.sendall(encode_request(metadata, 8))
        assert exchange(tls, b"") == b""
    # Redis: a plaintext client, then a TLS client without the password.
    redis_port = int(info.redis.rsplit(":", 1)[1].split("/")[0])
    with pytest.raises(redis.ConnectionError):
        redis.Redis(port=redis_port, socket_timeout=3).ping()
    anonymous = redis.Redis(
        port=redis_port,
        ssl=True,
        ssl_ca_certs=str(certs.ca_file),
        ssl_certfile=str(certs.client_cert_file),
        ssl_keyfile=str(certs.client_key_file),
        socket_timeout=3,
    )
    with pytest.raises(redis.AuthenticationError):
        anonymous.ping()
    assert redis.Redis.from_url(
        info.redis,
        ssl_ca_certs=str(certs.ca_file),
        ssl_certfile=str(certs.client_cert_file),
        ssl_keyfile=str(certs.client_key_file),
    ).ping()


def exchange(raw: socket.socket, request: bytes) -> bytes:
    """Send a request; the first bytes of the answer (empty: the peer closed)."""
    raw.settimeout(10)
    if request:
        raw.sendall(request)
    try:
        return raw.recv(4)
    except (ConnectionResetError, ssl.SSLEOFError):
        return b""


def test_dedup_holds_through_a_kill_of_the_environments_proxy(
    secured: tuple[LocalEnvironment, EnvInfo],
) -> None:
    """librdkafka with SCRAM over TLS to proxy-1 (TLS listener, SCRAM-SHA-512 to Kafka,
    Redis over TLS), killed with -9 mid-stream and started again; a second producer
    re-sends the first 500. Read back from Kafka over SASL_SSL: every record once, in order."""
    env, info = secured
    proxy = info.proxies[0]
    topic = new_topic(info.bootstrap, client_config=client_config(info))
    producer = DedupProducer(proxy.bootstrap, "secured-env", **client_config(info))
    errors: list[str] = []
    delivered = 0

    def on_delivery(error: Any, _message: object) -> None:
        nonlocal delivered
        delivered += 1
        if error is not None:
            errors.append(str(error))

    def acknowledged(count: int) -> bool:
        producer.poll(0.05)
        return delivered >= count

    killed = False
    for n in range(TOTAL):
        if n == TOTAL // 4 and not killed:
            # The kill must land mid-stream. The partition's first write waits for its
            # recovery and the proxy's first InitProducerId (which on a fresh cluster
            # creates Kafka's transaction log): on a busy box, longer than sending it all.
            wait_until(lambda: acknowledged(100), 120, "the first 100 records acknowledged")
        producer.send(topic, str(n).encode(), sequence_id=n, on_delivery=on_delivery)
        if n % 20 == 0:
            producer.poll(0.02)
        if not killed and delivered >= 100:
            producer.poll(0.003)
            assert env.kill_proxy(1)
            killed = True
            env.start_proxy(1)
    assert killed, "the stream ended before 100 records were acknowledged"
    assert producer.flush(120) == 0
    resend = DedupProducer(proxy.bootstrap, "secured-env", **client_config(info))
    for n in range(500):
        resend.send(topic, str(n).encode(), sequence_id=n, on_delivery=on_delivery)
    assert resend.flush(60) == 0
    assert errors == []
    written = [value for value, _ in read_all(info.bootstrap, topic, **client_config(info))]
    assert_exactly_once_in_order(written, TOTAL)


def test_the_java_producer_with_scram_through_a_kill_of_the_environments_proxy(
    secured: tuple[LocalEnvironment, EnvInfo], tmp_path: Path
) -> None:
    """Kafka's VerifiableProducer (idempotent; the proxy dedups on its producer id and
    sequences) with SCRAM over TLS through proxy-1, which is killed with -9 while it writes
    and started again: every record acknowledged, and written once, in order."""
    env, info = secured
    certs = LocalTls(Path(info.tls_dir))
    topic = new_topic(info.bootstrap, client_config=client_config(info))
    config = client_properties(
        tmp_path / "producer.properties",
        certs,
        "SCRAM-SHA-512",
        "enable.idempotence=true\nacks=all\nretries=2147483647\nlinger.ms=1\nbatch.size=4096\n",
    )
    total = 3000
    events: list[dict[str, Any]] = []
    problems: list[str] = []

    def run() -> None:
        try:
            events.extend(
                verifiable_producer(
                    info.proxies[0].bootstrap, topic, total, config, "--throughput", "600"
                )
            )
        except AssertionError as exc:
            problems.append(str(exc))

    runner = threading.Thread(target=run)
    runner.start()
    wait_until(
        lambda: (
            end_offset(info.bootstrap, topic, **client_config(info)) > 300 or not runner.is_alive()
        ),
        120,
        "the Java producer has written its first records",
    )
    assert runner.is_alive(), f"the producer finished before the kill: {problems}"
    assert env.kill_proxy(1)
    env.start_proxy(1)
    runner.join(300)
    assert problems == []
    assert sent(events) == (total, [])
    written = [value for value, _ in read_all(info.bootstrap, topic, **client_config(info))]
    assert_exactly_once_in_order(written, total)


def test_the_proxys_principal_learns_a_transactions_deadline_only_where_acls_let_it(
    secured: tuple[LocalEnvironment, EnvInfo],
) -> None:
    """Kafka's ACLs as the README lists them for the proxy's principal (`proxy` here, over
    SCRAM and TLS, as the proxy's own connections log in): with `Describe` on a client's
    transactional id, a recovery learns when Kafka will abort its open transaction. Denied
    it (an explicit DENY here), Kafka leaves the transaction out of ListTransactions, so the
    deadline is unknown and the recovery waits `replay_transaction_wait_s`. Denied `Read` on
    the topic, DescribeProducers is refused: unknown too."""
    _, info = secured
    client = client_config(info)
    topic = new_topic(info.bootstrap, partitions=2, client_config=client)
    hidden_id = f"tx-hidden-{uuid.uuid4().hex[:8]}"
    began = time.time()
    told = open_transaction(info.bootstrap, 20, (topic, 0), **client)
    hidden = open_transaction(info.bootstrap, 20, (topic, 1), transactional_id=hidden_id, **client)
    opened = time.time()
    security = scram_link(info, "proxy")
    below = {(topic, 0): 1, (topic, 1): 1}
    admin = AdminClient({"bootstrap.servers": info.bootstrap, **client})
    deny_describe = (ResourceType.TRANSACTIONAL_ID, hidden_id, AclOperation.DESCRIBE)
    deny_read = (ResourceType.TOPIC, topic, AclOperation.READ)
    try:
        found = asyncio.run(deadlines(info.bootstrap, below, security))
        for key in below:  # both told while the ACLs allow it
            deadline = found[key]
            assert not isinstance(deadline, DeadlineUnknown), (key, deadline)
            assert began + 48 <= deadline <= opened + 52, (key, deadline - began)
        for future in admin.create_acls([denial(AclBinding, *deny_describe)]).values():
            future.result(30)

        def told_for(key: tuple[str, int]) -> bool | None:
            answer = asyncio.run(deadlines(info.bootstrap, below, security))[key]
            return not isinstance(answer, DeadlineUnknown)

        wait_until(lambda: told_for((topic, 1)) is False, 30, "the DENY taken")
        found = asyncio.run(deadlines(info.bootstrap, below, security))
        assert not isinstance(found[(topic, 0)], DeadlineUnknown), found
        assert "no broker lists the transaction" in str(found[(topic, 1)]), found
        for future in admin.create_acls([denial(AclBinding, *deny_read)]).values():
            future.result(30)
        wait_until(lambda: told_for((topic, 0)) is False, 30, "the DENY of Read taken")
        found = asyncio.run(deadlines(info.bootstrap, below, security))
        for key in below:
            assert "topic_authorization_failed" in str(found[key]), found
    finally:
        filters = [denial(AclBindingFilter, *deny) for deny in (deny_describe, deny_read)]
        for future in admin.delete_acls(filters).values():  # the module's env is shared
            future.result(30)
        told.abort_transaction(30)
        hidden.abort_transaction(30)


def denial(
    kind: Any,
    resource_type: ResourceType,
    name: str,
    operation: AclOperation,
    user: str = "proxy",
) -> Any:
    """A DENY of ``operation`` on a resource to ``user`` (``kind``: `AclBinding`, or
    `AclBindingFilter` to delete it)."""
    return kind(
        resource_type,
        name,
        ResourcePatternType.LITERAL,
        f"User:{user}",
        "*",
        operation,
        AclPermissionType.DENY,
    )


def test_a_client_kafka_does_not_let_write_a_topic_cannot_write_it_through_dedup(
    secured: tuple[LocalEnvironment, EnvInfo],
) -> None:
    """The proxy writes deduplicated records under its own principal, which may write every
    topic; the client's own right to write is Kafka's to decide. Denied `Write` on one topic
    (an explicit DENY here), a client's records to it through the proxy are refused with
    Kafka's TOPIC_AUTHORIZATION_FAILED and nothing reaches the log, while its records to
    another topic are written; the same client writing straight to Kafka is refused alike."""
    _, info = secured
    client = client_config(info)
    denied, allowed = (new_topic(info.bootstrap, client_config=client) for _ in range(2))
    with write_denied(info, denied) as landed:
        proxy_bootstrap = info.proxies[0].bootstrap
        through = DedupProducer(proxy_bootstrap, "denied", **client)
        assert send_failures(through, denied, range(3)) == ["TOPIC_AUTHORIZATION_FAILED"] * 3
        other = DedupProducer(info.proxies[0].bootstrap, "allowed", **client)
        assert send_failures(other, allowed, range(3)) == []
        # One request to both topics: Kafka writes the one the client may write and refuses
        # the other; so does the proxy.
        for bootstrap, name in ((info.bootstrap, "mixed-direct"), (proxy_bootstrap, "mixed")):
            mixed = produce_request_to(
                {topic: {0: explicit_batch([(name, 0)])} for topic in (allowed, denied)}
            )
            assert error_codes(bootstrap, info, mixed) == {
                allowed: ErrorCode.none,
                denied: ErrorCode.topic_authorization_failed,
            }, bootstrap
    assert end_offset(info.bootstrap, denied, **client) == landed, "nothing through the proxy"
    assert end_offset(info.bootstrap, allowed, **client) == 3 + 2  # the mixed requests' too


def error_codes(bootstrap: str, info: EnvInfo, request: Any) -> dict[str, ErrorCode]:
    """Each topic's error code in the answer to ``request``, sent as user `client` (SCRAM
    over TLS) to the first broker of ``bootstrap``."""
    security = scram_link(info, "client")

    async def ask() -> Any:
        async with UpstreamClient(Endpoint.parse(bootstrap.split(",")[0]), 30, security) as kafka:
            return await kafka.send(request)

    response = asyncio.run(ask())
    return {
        str(topic.name): ErrorCode(partition.error_code)
        for topic in response.responses
        for partition in topic.partition_responses
    }


def test_asked_at_every_request_an_acl_taken_away_refuses_the_next_write_through_dedup(
    secured: tuple[LocalEnvironment, EnvInfo], tmp_path: Path
) -> None:
    """`write_permission_ttl_s = 0`: the proxy asks Kafka before every write, as Kafka
    checks every request, so a `Write` taken away refuses the connection's very next write
    through dedup (kept for 30 s, the default, that write lands). A proxy of the test's own,
    on the environment's SASL_SSL listeners with the proxy's SCRAM user (and its ACLs),
    and a plaintext listener for the client's own SASL, relayed to Kafka."""
    _, info = secured
    client = client_config(info)
    topic = new_topic(info.bootstrap, client_config=client)
    certs = LocalTls(Path(info.tls_dir))
    proxy = own_proxy(
        info,
        SECURED_OWN,
        f"ttl-{uuid.uuid4().hex[:8]}",
        tmp_path / "proxy.log",
        DEDUP_PROXY_REDIS_TLS_CA_FILE=str(certs.ca_file),
        DEDUP_PROXY_REDIS_TLS_CERT_FILE=str(certs.client_cert_file),
        DEDUP_PROXY_REDIS_TLS_KEY_FILE=str(certs.client_key_file),
        DEDUP_PROXY_UPSTREAM_SECURITY_PROTOCOL="SASL_SSL",
        DEDUP_PROXY_UPSTREAM_TLS_CA_FILE=str(certs.ca_file),
        DEDUP_PROXY_UPSTREAM_SASL_MECHANISM="SCRAM-SHA-512",
        DEDUP_PROXY_UPSTREAM_SASL_USERNAME="proxy",
        DEDUP_PROXY_UPSTREAM_SASL_PASSWORD=certs.sasl_users["proxy"],
        DEDUP_PROXY_INSTANCE_ID=f"ttl-{uuid.uuid4().hex[:8]}",
        DEDUP_PROXY_WRITE_PERMISSION_TTL_S="0",
    )
    proxy.start()
    try:
        through = DedupProducer(
            f"127.0.0.1:{SECURED_OWN.listen}",
            "ttl",
            **{**client, "security.protocol": "sasl_plaintext"},
        )
        assert send_failures(through, topic, range(1)) == []
        with write_denied(info, topic) as landed:
            assert send_failures(through, topic, range(1, 2)) == ["TOPIC_AUTHORIZATION_FAILED"]
    finally:
        proxy.stop()
    assert end_offset(info.bootstrap, topic, **client) == landed, "nothing through the proxy"


@contextlib.contextmanager
def write_denied(info: EnvInfo, topic: str) -> Iterator[int]:
    """User `client` denied `Write` on ``topic`` (an explicit DENY) until the block ends,
    once Kafka refuses its writes straight to it: the topic's end offset then (the client's
    writes that landed before the DENY reached the broker's authorizer counted)."""
    client = client_config(info)
    admin = AdminClient({"bootstrap.servers": info.bootstrap, **client})
    deny_write = denial(AclBinding, ResourceType.TOPIC, topic, AclOperation.WRITE, "client")
    for future in admin.create_acls([deny_write]).values():
        future.result(30)
    try:
        direct = DedupProducer(info.bootstrap, f"direct-{uuid.uuid4().hex[:8]}", **client)
        attempts = itertools.count()
        last: list[str] = []

        def refused_directly() -> bool:
            n = next(attempts)
            last[:] = send_failures(direct, topic, range(n, n + 1))
            return last == ["TOPIC_AUTHORIZATION_FAILED"]

        wait_until(
            refused_directly, 30, lambda: f"Kafka refusing the client's writes (last: {last})"
        )
        yield end_offset(info.bootstrap, topic, **client)
    finally:
        filters = [
            denial(AclBindingFilter, ResourceType.TOPIC, topic, AclOperation.WRITE, "client")
        ]
        for future in admin.delete_acls(filters).values():
            future.result(30)


def send_failures(producer: DedupProducer, topic: str, sequences: range) -> list[str]:
    """The error names of the records sent under ``sequences`` (none: all written)."""
    failures: list[str] = []

    def on_delivery(error: Any, _message: object) -> None:
        if error is not None:
            failures.append(error.name())

    for n in sequences:
        try:
            producer.send(topic, str(n).encode(), sequence_id=n, on_delivery=on_delivery)
        except KafkaException as exc:  # librdkafka refuses at once a topic it was refused
            failures.append(exc.args[0].name())
    producer.flush(60)
    return failures


def test_a_client_that_never_authenticated_writes_nothing_through_dedup(
    secured: tuple[LocalEnvironment, EnvInfo],
) -> None:
    """A Produce request through the proxy's TLS listener without SASL first: Kafka would
    close such a connection, and the proxy, which writes under its own principal, must not
    write it either. Asked as this client whether it may write, Kafka closes the
    connection: nothing reaches the log."""
    _, info = secured
    client = client_config(info)
    topic = new_topic(info.bootstrap, client_config=client)
    certs = LocalTls(Path(info.tls_dir))
    host, port = info.proxies[0].bootstrap.split(":")
    context = ssl.create_default_context(cafile=str(certs.ca_file))
    request = encode_request(produce_request(topic, {0: explicit_batch([("sneaky", 0)])}), 11)
    with (
        socket.create_connection((host, int(port)), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname=host) as tls,
    ):
        tls.settimeout(20)
        tls.sendall(request)
        try:
            answer = read_response(tls)
        except (ConnectionError, ssl.SSLError, EOFError):
            answer = b""
    if answer:  # answered: refused, never written
        assert first_answer(answer).error_code != ErrorCode.none
    assert end_offset(info.bootstrap, topic, **client) == 0

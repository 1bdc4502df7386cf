"""Toxiproxy between Kafka clients and a broker: connections cut and slowed for real.

Runs a Toxiproxy server and a single-broker environment of their own (own state home and
ports). The broker listens on KAFKA_BASE and advertises ADVERTISED_BASE, where a Toxiproxy
link forwards to it, so every client connection (bootstrap and the ones made after
metadata discovery) crosses Toxiproxy. Both are stopped at the end.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import KafkaError, Message, Producer
from confluent_kafka.admin import AdminClient

from deploy import paths
from deploy.local import EnvInfo, LocalEnvironment
from deploy.paths import MissingRuntimeError
from deploy.toxiproxy import ToxiproxyServer
from tests.support.group import Group
from tests.support.java_clients import misreported, sent, verifiable_producer_during
from tests.support.kafka_io import assert_exactly_once_in_order, consume, offsets_by_value, values
from tests.support.ports import TOXIPROXY_ADVERTISED_BASE as ADVERTISED_BASE
from tests.support.ports import TOXIPROXY_API, TOXIPROXY_DEDUP, TOXIPROXY_GROUP
from tests.support.ports import TOXIPROXY_ECHO_LISTEN as ECHO_LISTEN
from tests.support.ports import TOXIPROXY_ECHO_UPSTREAM as ECHO_UPSTREAM
from tests.support.ports import TOXIPROXY_ENV as PORTS
from tests.support.ports import TOXIPROXY_KAFKA_BASE as KAFKA_BASE
from tests.support.proxy_api import all_see_each_other, metric_total
from tests.support.restartable import RestartableProxy
from tests.support.topics import new_topic
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration

HOST = "127.0.0.1"
BROKER_LINK = "kafka-0"
ECHO_LINK = "echo"


@pytest.fixture(scope="module")
def toxiproxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ToxiproxyServer]:
    server = ToxiproxyServer(tmp_path_factory.mktemp("toxiproxy"), TOXIPROXY_API)
    try:
        server.start()
    except MissingRuntimeError as exc:
        pytest.fail(f"Toxiproxy cannot start: {exc}", pytrace=False)
    yield server
    server.stop()
    assert not server.is_running()


@pytest.fixture(scope="module")
def kafka(toxiproxy: ToxiproxyServer) -> Iterator[EnvInfo]:
    """The broker, reachable only through Toxiproxy at the addresses it advertises."""
    toxiproxy.link(BROKER_LINK, f"{HOST}:{ADVERTISED_BASE}", f"{HOST}:{KAFKA_BASE}")
    environment = LocalEnvironment(home=paths.state_home().parent / "test-toxiproxy", ports=PORTS)
    info = environment.up(brokers=1)
    yield info
    environment.down()


@pytest.fixture(autouse=True)
def clean_links(toxiproxy: ToxiproxyServer) -> Iterator[None]:
    """Every test finds the broker link enabled and without faults, and leaves it so."""
    toxiproxy.link(BROKER_LINK, f"{HOST}:{ADVERTISED_BASE}", f"{HOST}:{KAFKA_BASE}")
    yield
    toxiproxy.link(BROKER_LINK, f"{HOST}:{ADVERTISED_BASE}", f"{HOST}:{KAFKA_BASE}")


class EchoServer:
    """A TCP echo server that keeps its side of every connection, to watch them end."""

    def __init__(self, port: int) -> None:
        self.listener = socket.create_server((HOST, port), reuse_port=False)
        self.accepted: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.listener.accept()
                with self._lock:
                    self.accepted.append(conn)
                threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := conn.recv(65536):
                conn.sendall(data)

    def wait_accepted(self, count: int) -> list[socket.socket]:
        wait_until(
            lambda: len(self.accepted) >= count,
            5,
            "toxiproxy connects upstream",
            interval_s=0.01,
        )
        with self._lock:
            return list(self.accepted)

    def close(self) -> None:
        # shutdown() wakes the blocked accept(), which would otherwise keep the port bound.
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        for conn in self.accepted:
            conn.close()


@pytest.fixture
def echo(toxiproxy: ToxiproxyServer) -> Iterator[EchoServer]:
    server = EchoServer(ECHO_UPSTREAM)
    toxiproxy.link(ECHO_LINK, f"{HOST}:{ECHO_LISTEN}", f"{HOST}:{ECHO_UPSTREAM}")
    yield server
    toxiproxy.remove(ECHO_LINK)
    server.close()


def roundtrip(conn: socket.socket, payload: bytes = b"ping") -> bytes:
    conn.sendall(payload)
    return conn.recv(len(payload))


def ended(conn: socket.socket) -> bool:
    """Whether the peer closed or reset the connection (waiting up to 5 s for it)."""
    conn.settimeout(5)
    try:
        return conn.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


# --- link control, against a plain TCP server ---------------------------------------------


def test_cut_ends_established_connections_on_both_sides(
    toxiproxy: ToxiproxyServer, echo: EchoServer
) -> None:
    clients = [socket.create_connection((HOST, ECHO_LISTEN), timeout=5) for _ in range(3)]
    for client in clients:
        assert roundtrip(client) == b"ping"
    upstream_sides = echo.wait_accepted(3)

    toxiproxy.cut(ECHO_LINK)

    assert all(ended(client) for client in clients), "a client connection survived the cut"
    assert all(ended(conn) for conn in upstream_sides), "an upstream connection survived"
    link = toxiproxy.get(ECHO_LINK)
    assert link is not None and link.enabled
    with socket.create_connection((HOST, ECHO_LISTEN), timeout=5) as fresh:
        assert roundtrip(fresh, b"again") == b"again"
    for client in clients:
        client.close()


def test_link_keeps_an_identical_link_and_replaces_a_different_one(
    toxiproxy: ToxiproxyServer, echo: EchoServer
) -> None:
    with socket.create_connection((HOST, ECHO_LISTEN), timeout=5) as client:
        assert roundtrip(client) == b"ping"
        toxiproxy.latency(ECHO_LINK, 10)
        same = toxiproxy.link(ECHO_LINK, f"{HOST}:{ECHO_LISTEN}", f"{HOST}:{ECHO_UPSTREAM}")
        assert same.enabled and same.toxics == ()
        assert roundtrip(client, b"still") == b"still"  # the connection was kept

        other = toxiproxy.link(ECHO_LINK, f"{HOST}:{ECHO_LISTEN}", f"{HOST}:{ECHO_UPSTREAM + 1}")
        assert other.upstream == f"{HOST}:{ECHO_UPSTREAM + 1}"
        assert ended(client)  # replacing a link closes its connections
    assert toxiproxy.remove(ECHO_LINK) is True
    assert toxiproxy.remove(ECHO_LINK) is False
    assert toxiproxy.get(ECHO_LINK) is None


def test_cut_for_repeats_until_the_period_ends_or_it_is_stopped(
    toxiproxy: ToxiproxyServer, echo: EchoServer
) -> None:
    started = time.monotonic()
    rounds = toxiproxy.cut_for([ECHO_LINK], 1.0, 0.25)
    took = time.monotonic() - started
    assert 4 <= rounds <= 5, rounds
    assert 0.9 <= took < 3.0, took

    with toxiproxy.cut_in_background([ECHO_LINK], 30.0, 0.1) as cuts:
        time.sleep(0.5)
        cuts.stop()
        stopped_after = cuts.wait(timeout=5)
    assert 2 <= stopped_after <= 10, stopped_after
    link = toxiproxy.get(ECHO_LINK)
    assert link is not None and link.enabled


# --- Kafka behind Toxiproxy -----------------------------------------------------------------


def test_clients_are_sent_to_the_toxiproxy_ports(
    toxiproxy: ToxiproxyServer, kafka: EnvInfo
) -> None:
    assert kafka.bootstrap == f"{HOST}:{ADVERTISED_BASE}"
    metadata = AdminClient({"bootstrap.servers": kafka.bootstrap}).list_topics(timeout=30)
    assert {(b.host, b.port) for b in metadata.brokers.values()} == {(HOST, ADVERTISED_BASE)}
    # The broker's own port still answers, which the environment's readiness check uses.
    direct = AdminClient({"bootstrap.servers": f"{HOST}:{KAFKA_BASE}"}).list_topics(timeout=30)
    assert set(direct.brokers) == {0}


def test_produce_and_consume_through_toxiproxy(kafka: EnvInfo) -> None:
    topic = new_topic(kafka.bootstrap)
    sent = [f"m-{i}" for i in range(200)]
    errors = produce_all(kafka.bootstrap, topic, sent)
    assert errors == []
    assert consume(kafka.bootstrap, topic, len(sent)) == sent


def test_producer_delivers_everything_while_its_connections_are_cut(
    toxiproxy: ToxiproxyServer, kafka: EnvInfo
) -> None:
    topic = new_topic(kafka.bootstrap)
    client_log = ClientLog()
    producer = Producer(
        {"bootstrap.servers": kafka.bootstrap, "enable.idempotence": True, "linger.ms": 5},
        logger=client_log.logger,
    )
    errors: list[KafkaError] = []
    sent = [f"m-{i}" for i in range(400)]

    def delivered(err: KafkaError | None, _msg: Message) -> None:
        if err is not None:
            errors.append(err)

    with toxiproxy.cut_in_background([BROKER_LINK], 4.0, 0.5) as cuts:
        for value in sent:
            producer.produce(topic, value.encode(), on_delivery=delivered)
            producer.poll(0.01)
        rounds = cuts.wait()
    assert producer.flush(60) == 0

    assert rounds >= 8
    assert errors == []
    # The client saw its connections end (librdkafka's per-broker statistics cannot
    # tell: it replaces its broker handles as it reconnects, and their counters restart).
    disconnects = client_log.count("Disconnected")
    assert disconnects >= 4, client_log.messages
    # Idempotence keeps retried batches from being written twice or out of order.
    assert consume(kafka.bootstrap, topic, len(sent)) == sent


def test_latency_slows_every_produce_by_at_least_the_delay(
    toxiproxy: ToxiproxyServer, kafka: EnvInfo
) -> None:
    topic = new_topic(kafka.bootstrap)
    producer = Producer({"bootstrap.servers": kafka.bootstrap, "linger.ms": 0, "acks": "all"})
    baseline = produce_latencies(producer, topic, 10)

    toxiproxy.latency(BROKER_LINK, 100)  # responses delayed
    one_way = produce_latencies(producer, topic, 10)
    toxiproxy.latency(BROKER_LINK, 100, direction="both")  # requests too
    both_ways = produce_latencies(producer, topic, 10)
    toxics = {t.name: t.attributes["latency"] for t in toxiproxy.toxics(BROKER_LINK)}
    toxiproxy.clear(BROKER_LINK)

    # Lower bounds only: a busy machine may add any delay, never remove Toxiproxy's.
    assert min(one_way) >= 0.095, (statistics.median(baseline), one_way)
    assert min(both_ways) >= 0.195, (statistics.median(baseline), both_ways)
    assert toxics == {"latency-downstream": 100, "latency-upstream": 100}
    assert toxiproxy.toxics(BROKER_LINK) == []


# A dedup proxy that takes no snapshot in a test's time: its recovery replays the whole log.
RARE_SNAPSHOTS = {
    "DEDUP_PROXY_SNAPSHOT_EVERY_RECORDS": "100000000",
    "DEDUP_PROXY_SNAPSHOT_EVERY_S": "3600",
}
SHORT_LEASES = {"DEDUP_PROXY_LEASE_TTL_S": "1.5", "DEDUP_PROXY_HEARTBEAT_S": "0.5"}
JAVA_RECORDS = 3000  # sent at 1000 a second, a kill once 1000 are acknowledged
ORIGINAL_OFFSET = 'dedup_duplicate_batches_total{offset="original"'
TAKEN_OVER = 'dedup_lease_events_total{event="taken_over"}'


def test_a_batch_written_before_the_dedup_proxy_was_killed_is_answered_with_its_offset(
    toxiproxy: ToxiproxyServer, kafka: EnvInfo, tmp_path: Path
) -> None:
    """A dedup proxy killed with writes that Kafka appended and never answered: Kafka's
    answers are held back on their way to it (300 ms), so its last writes are all in the
    log when it is killed. Kafka's Java producer sends those batches again to the
    restarted proxy, whose recovery read them in the log's tail (no snapshot since): they
    are answered with their original's offset, as Kafka's broker answers a duplicate batch,
    and every record's delivery report names where it is (before, offset -1 for them)."""
    restartable = RestartableProxy(  # started again within 2 s, before its lease lapses
        kafka, tmp_path, TOXIPROXY_DEDUP, 0, "toxi", **SHORT_LEASES, **RARE_SNAPSHOTS
    )

    def kill_and_restart() -> None:
        kill_with_writes_unanswered(toxiproxy, restartable)
        restartable.start()

    try:
        topic = new_topic(kafka.bootstrap)
        bootstrap = restartable.start().bootstrap
        events = java_producer_through_a_kill(bootstrap, topic, tmp_path, kill_and_restart)
        assert restartable.process is not None
        answered = metric_total(restartable.process, ORIGINAL_OFFSET)
        assert answered >= 1, "batches sent again, found in the log"
        assert_each_record_reported_where_it_is(kafka, topic, events)
    finally:
        restartable.stop()


def test_a_batch_written_by_an_owner_killed_in_a_group_is_answered_with_its_offset(
    toxiproxy: ToxiproxyServer, kafka: EnvInfo, tmp_path: Path
) -> None:
    """As above, in a group of two instances: the partition's owner is killed and stays
    down, the other instance takes the partition over once its lease lapses (fenced), and
    Kafka's Java producer, bootstrapped on both, sends its unanswered batches to it. The
    new owner's recovery read them in the log's tail: it answers them with their
    original's offset too."""
    group = Group(kafka, tmp_path, TOXIPROXY_GROUP, 1, "toxi", **SHORT_LEASES, **RARE_SNAPSHOTS)
    owners: list[int] = []

    def kill_the_owner() -> None:
        owners.append(group.holder(topic, 0))
        kill_with_writes_unanswered(toxiproxy, group.members[owners[0]])

    try:
        group.start()
        wait_until(
            lambda: all_see_each_other([group.proxy(i).admin_url for i in range(2)]),
            30,
            "both instances see each other",
        )
        topic = new_topic(kafka.bootstrap)
        events = java_producer_through_a_kill(group.bootstrap(), topic, tmp_path, kill_the_owner)
        survivor = group.proxy(1 - owners[0])
        assert metric_total(survivor, TAKEN_OVER) >= 1, "taken over, fenced"
        assert metric_total(survivor, ORIGINAL_OFFSET) >= 1, "batches sent again, found in the log"
        assert_each_record_reported_where_it_is(kafka, topic, events)
    finally:
        group.stop()


def kill_with_writes_unanswered(toxiproxy: ToxiproxyServer, member: RestartableProxy) -> None:
    """Kill -9 a dedup proxy whose last 300 ms of writes Kafka appended and never answered."""
    toxiproxy.latency(BROKER_LINK, 300)  # Kafka's answers, from now on
    time.sleep(0.5)
    assert member.process is not None
    os.kill(member.process.pid, signal.SIGSTOP)  # hung: it reads no answer
    toxiproxy.clear(BROKER_LINK)
    member.kill()  # as a supervisor kills a hung process


def java_producer_through_a_kill(
    bootstrap: str, topic: str, tmp_path: Path, kill: Callable[[], None]
) -> list[dict[str, Any]]:
    """Kafka's idempotent Java producer (VerifiableProducer) sends JAVA_RECORDS, with
    `kill()` once 1000 are acknowledged; its events, every send acknowledged."""
    settings = tmp_path / "producer.properties"
    settings.write_text("enable.idempotence=true\nacks=all\nretries=2147483647\nlinger.ms=5\n")

    def during(acked: Callable[[], int]) -> None:
        wait_until(lambda: acked() >= 1000, 60, "1000 records acknowledged")
        kill()

    events = verifiable_producer_during(
        bootstrap, topic, JAVA_RECORDS, settings, during, *("--throughput", "1000")
    )
    assert sent(events) == (JAVA_RECORDS, [])
    return events


def assert_each_record_reported_where_it_is(
    kafka: EnvInfo, topic: str, events: list[dict[str, Any]]
) -> None:
    """Every record once, in order, and each delivery report names its record's offset."""
    assert_exactly_once_in_order(values(kafka.bootstrap, topic), JAVA_RECORDS)
    wrong = misreported(events, offsets_by_value(kafka.bootstrap, topic))
    assert wrong == [], (len(wrong), wrong[:5])


# --- helpers ----------------------------------------------------------------------------------


class ClientLog(logging.Handler):
    """librdkafka's log lines of one client (served from its poll and flush calls)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []
        self.logger = logging.getLogger(f"tests.toxiproxy.{uuid.uuid4().hex[:8]}")
        self.logger.propagate = False
        self.logger.setLevel(logging.DEBUG)
        self.logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def count(self, text: str) -> int:
        return sum(text in message for message in self.messages)


def produce_all(bootstrap: str, topic: str, values: list[str]) -> list[KafkaError]:
    errors: list[KafkaError] = []

    def delivered(err: KafkaError | None, _msg: Message) -> None:
        if err is not None:
            errors.append(err)

    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    for value in values:
        producer.produce(topic, value.encode(), on_delivery=delivered)
    assert producer.flush(60) == 0
    return errors


def produce_latencies(producer: Producer, topic: str, count: int) -> list[float]:
    """Seconds from produce to acknowledgement, one message at a time."""
    producer.produce(topic, b"warm-up")  # connection and metadata set up beforehand
    assert producer.flush(30) == 0
    took = []
    for i in range(count):
        started = time.monotonic()
        producer.produce(topic, f"l-{i}".encode())
        assert producer.flush(30) == 0
        took.append(time.monotonic() - started)
    return took

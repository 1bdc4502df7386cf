"""Input built to hurt, through a real dedup proxy: each bomb is refused with Kafka's error
for it, quickly, and a producer on another connection is answered meanwhile as usual.

The bombs (`tests.support.raw.bomb_batch`): a few kilobytes of zstd that decompress to
512 MiB; one record with 500,000 headers in 209 bytes; 200,000 records in one batch. The
times measured are printed (``pytest -s``) and asserted only against generous ceilings:
the figures are the benchmarks' (`benchmarks/stall.py`), not the tests'.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dedup.batches import HEADER_PRODUCER, HEADER_SEQUENCE
from dedup.chunks import ChunkMeta, chunk_headers
from dedup.client import DedupProducer
from deploy.launcher import ProxyProcess
from deploy.local import EnvInfo
from proxy.kafka.upstream_client import encode_request
from tests.support.kafka_io import assert_exactly_once_in_order, end_offset, read_all, values
from tests.support.ports import FLOOD, JUMP_BOUND, REDIS_RELAY
from tests.support.proxies import own_proxy, rss_bytes
from tests.support.proxy_api import metric_total
from tests.support.raw import (
    bomb_batch,
    damaged,
    explicit_batch,
    first_answer,
    idempotent_batch,
    produce_once,
    produce_pipelined,
    produce_raw,
    produce_request,
    read_response,
    record_batch,
)
from tests.support.relay import relayed_redis
from tests.support.topics import new_topic
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration

CORRUPT_MESSAGE = 2
NOT_ENOUGH_REPLICAS = 19
MESSAGE_TOO_LARGE = 10
UNKNOWN_TOPIC_OR_PARTITION = 3
INVALID_RECORD = 87

BOMBS: dict[str, tuple[Callable[[], bytes], int]] = {
    "zstd-512MiB-value": (lambda: bomb_batch(value_size=512 << 20), MESSAGE_TOO_LARGE),
    "500k-headers": (lambda: bomb_batch(headers_per_record=500_000), INVALID_RECORD),
    "200k-records": (lambda: bomb_batch(records=200_000), MESSAGE_TOO_LARGE),
}


class Bystander:
    """A producer on a connection of its own: one small Produce request at a time, each
    answer awaited, every request's (sent, answered) time kept."""

    def __init__(self, proxy: ProxyProcess, topic: str) -> None:
        self._port = proxy.broker_port()
        self._topic = topic
        self._stop = threading.Event()
        self.times: list[tuple[float, float]] = []
        self.errors: list[int] = []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Bystander:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        assert not self._thread.is_alive(), "the bystander is stuck"

    def _run(self) -> None:
        with socket.create_connection(("127.0.0.1", self._port), timeout=30) as sock:
            sequence = 0
            while not self._stop.is_set():
                batch = explicit_batch([("bystander", sequence)])
                request = produce_request(self._topic, {0: batch})
                sent = time.monotonic()
                sock.sendall(encode_request(request, sequence + 1))
                read_response(sock)
                self.times.append((sent, time.monotonic()))
                sequence += 1
                time.sleep(0.005)

    def longest_wait(self, start: float, end: float) -> float:
        """The longest answer time of the requests in flight at any moment from 50 ms
        before `start` to 50 ms after `end` (a bomb refused at once may fall between two)."""
        overlapping = [b - a for a, b in self.times if b >= start - 0.05 and a <= end + 0.05]
        assert overlapping, "no bystander request near the bomb"
        return max(overlapping)


@pytest.mark.parametrize("bomb", BOMBS)
def test_a_bomb_is_refused_quickly_and_other_connections_go_on(
    bomb: str, dedup_proxy: ProxyProcess, local_env: EnvInfo
) -> None:
    build, code = BOMBS[bomb]
    topic = new_topic(local_env.bootstrap)
    # First use: the partition recovered before anything is measured.
    first = produce_raw(dedup_proxy, produce_request(topic, {0: explicit_batch([("x", 0)])}))
    assert first.error_code == 0, first
    data = build()
    bystander = Bystander(dedup_proxy, topic).start()
    try:
        while len(bystander.times) < 20:
            time.sleep(0.01)
        started = time.monotonic()
        answer = produce_raw(dedup_proxy, produce_request(topic, {0: data}))
        took = time.monotonic() - started
        after = len(bystander.times)
        while len(bystander.times) < after + 20:
            time.sleep(0.01)
    finally:
        bystander.stop()
    waited = bystander.longest_wait(started, started + took)
    print(
        f"\n{bomb}: {len(data):,} bytes refused in {took * 1000:.1f} ms "
        f"(error {answer.error_code}); the bystander's longest wait meanwhile "
        f"{waited * 1000:.1f} ms"
    )
    assert answer.error_code == code, answer
    assert took < 5, f"the bomb took {took:.1f} s to refuse"
    assert waited < 2, f"another connection waited {waited:.1f} s"
    # Nothing of the bomb reached the log: the first record, then the bystander's.
    landed = values(local_env.bootstrap, topic)
    assert landed[0] == b"v0" and all(v.startswith(b"v") for v in landed)
    assert len(landed) == 1 + len(bystander.times)


@pytest.fixture(scope="module")
def jump_bounded(
    local_env: EnvInfo, tmp_path_factory: pytest.TempPathFactory, redis_key_prefix: str
) -> Iterator[ProxyProcess]:
    process = own_proxy(
        local_env,
        JUMP_BOUND,
        f"{redis_key_prefix}-jump",
        tmp_path_factory.mktemp("jump") / "proxy.log",
        DEDUP_PROXY_MAX_SEQUENCE_JUMP="1000",
    ).start()
    yield process
    assert process.stop() == 0


def test_a_forged_huge_sequence_is_refused_and_the_real_producer_goes_on(
    jump_bounded: ProxyProcess, local_env: EnvInfo
) -> None:
    """Without the bound, one record claiming `loader` with sequence 2^63-1 would make every
    later record of the real `loader` read as a duplicate (dropped, answered success)."""
    topic = new_topic(local_env.bootstrap)
    loader = DedupProducer(jump_bounded.bootstrap, "loader")
    for sequence in range(100):
        loader.send(topic, str(sequence).encode(), sequence_id=sequence)
    assert loader.flush(60) == 0
    forged = produce_raw(
        jump_bounded, produce_request(topic, {0: explicit_batch([("loader", 2**63 - 1)])})
    )
    assert forged.error_code == INVALID_RECORD, forged
    assert "max_sequence_jump" in (forged.error_message or "")
    for sequence in range(100, 200):
        loader.send(topic, str(sequence).encode(), sequence_id=sequence)
    assert loader.flush(60) == 0
    assert_exactly_once_in_order(values(local_env.bootstrap, topic), 200)


def test_a_silenced_producer_is_reset_on_every_partition_at_once(
    jump_bounded: ProxyProcess, local_env: EnvInfo
) -> None:
    """`reset-producer TOPIC all NAME`: a producer that restarts its sequences at 0 on each
    of three partitions writes again once it is reset on all of them, with one command."""
    topic = new_topic(local_env.bootstrap, partitions=3)
    loader = DedupProducer(jump_bounded.bootstrap, "restarter")
    for partition in range(3):
        for sequence in range(10):
            value = f"{partition}-{sequence}".encode()
            loader.send(topic, value, sequence_id=sequence, partition=partition)
    assert loader.flush(60) == 0
    command = [sys.executable, "-m", "dedup", "reset-producer", topic, "all", "restarter"]
    env = {**os.environ, "DEDUP_PROXY_ADMIN_URL": jump_bounded.admin_url}
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert [line.split(" at offset ")[0] for line in done.stdout.splitlines()] == [
        f"producer restarter reset on {topic}/{p}" for p in range(3)
    ]
    again = DedupProducer(jump_bounded.bootstrap, "restarter")
    for partition in range(3):
        again.send(topic, f"{partition}-again".encode(), sequence_id=0, partition=partition)
    assert again.flush(60) == 0
    for partition in range(3):
        landed = [value for value, _ in read_all(local_env.bootstrap, topic, partition)]
        assert landed[-1] == f"{partition}-again".encode() and len(landed) == 11


def test_a_partition_that_does_not_exist_is_answered_unknown_and_holds_back_no_other(
    jump_bounded: ProxyProcess, local_env: EnvInfo
) -> None:
    """Any client can name a partition that does not exist: it is answered as Kafka
    answers it (UNKNOWN_TOPIC_OR_PARTITION, at once), with no lease or recovery left
    behind to retry for ever, and the topic's real partition is written. Before, each such
    partition took a lease and a recovery that failed and was retried every 30 s. (Its
    place in line is kept, never recovered: a request of the same producer after a
    retriable refusal must not overtake it if the partition appears meanwhile.)"""
    topic = new_topic(local_env.bootstrap)  # one partition: 0
    started = time.monotonic()
    ghosts = [
        produce_once(jump_bounded, produce_request(topic, {p: explicit_batch([("g", 0)])}))
        for p in range(1, 21)
    ]
    assert {g.error_code for g in ghosts} == {UNKNOWN_TOPIC_OR_PARTITION}
    assert time.monotonic() - started < 20, "answered at once, not after a recovery's wait"
    producer = DedupProducer(jump_bounded.bootstrap, "real")
    for sequence in range(50):
        producer.send(topic, str(sequence).encode(), sequence_id=sequence, partition=0)
    assert producer.flush(60) == 0
    assert_exactly_once_in_order(values(local_env.bootstrap, topic), 50)
    with urllib.request.urlopen(jump_bounded.admin_url + "/v1/snapshots", timeout=30) as r:
        listed = [p for p in json.load(r)["partitions"] if p["topic"] == topic]
    rows = {p["partition"]: (p["recovered"], p["recovery_failing"]) for p in listed}
    assert rows == {0: (True, None)} | {p: (False, None) for p in range(1, 21)}
    assert metric_total(jump_bounded, 'dedup_recoveries_total{result="failed"}') == 0


BURST = 50  # requests a hostile connection pipelines at a time
HONEST_REQUESTS = 300


def honest_beside(
    proxy: ProxyProcess, topic: str, next_burst: Callable[[], list[Any]]
) -> tuple[list[Any], list[tuple[int, int, str | None]]]:
    """One connection pipelines BURST requests (`next_burst`), again and again, while a
    producer on another connection writes HONEST_REQUESTS records to partition 0, one
    request at a time: the answers to the bursts' requests, and every refusal of the
    honest producer's."""
    stop = threading.Event()
    poured: list[Any] = []

    def pour() -> None:
        while not stop.is_set():
            poured.extend(produce_pipelined(proxy, next_burst()))

    hostile = threading.Thread(target=pour, daemon=True)
    hostile.start()
    refused = []
    try:
        while len(poured) < BURST:
            time.sleep(0.01)
        with socket.create_connection(("127.0.0.1", proxy.broker_port()), timeout=30) as sock:
            for sequence in range(HONEST_REQUESTS):
                request = produce_request(topic, {0: explicit_batch([("honest", sequence)])})
                sock.sendall(encode_request(request, sequence + 1))
                answer = first_answer(read_response(sock))
                if answer.error_code:
                    refused.append((sequence, answer.error_code, answer.error_message))
    finally:
        stop.set()
        hostile.join(60)
    assert not hostile.is_alive(), "the hostile connection is stuck"
    print(f"\n{len(poured)} requests poured beside {HONEST_REQUESTS} honest ones")
    assert len(poured) >= 2 * BURST, "the hostile requests kept coming"
    return poured, refused


def records_of(bootstrap: str, topic: str, producers: set[bytes]) -> list[bytes]:
    """The values of the partition's records that name one of the producers, in order."""
    return [
        value
        for value, headers in read_all(bootstrap, topic)
        if headers.get(HEADER_PRODUCER) in producers
    ]


def honest_records(bootstrap: str, topic: str) -> list[bytes]:
    """What the first request (producer x) and the honest producer wrote."""
    return records_of(bootstrap, topic, {b"x", b"honest"})


def skipping_ahead(topic: str) -> Any:
    """A batch of Kafka producer 8282, known at sequence 0 (`before`), at sequence 9."""
    return produce_request(topic, {0: idempotent_batch([b"h9"], 8282, 0, 9)})


def chunk_skipping_ahead(topic: str) -> Any:
    """Chunk 1 of producer h's message 1 (3 chunks), whose chunk 0 never came."""
    meta = ChunkMeta("h-1", 1, 3, 9)
    headers = [(HEADER_PRODUCER.encode(), b"h"), (HEADER_SEQUENCE.encode(), b"1")]
    headers += [(name.encode(), data) for name, data in chunk_headers(meta)]
    return produce_request(topic, {0: record_batch([(b"def", headers)])})


@dataclass(frozen=True)
class Refused:
    """Requests refused for what they are, retriable, that any client can send."""

    request: Callable[[str], Any]  # of the topic
    code: int
    words: str  # in the refusal's message
    before: Callable[[str], Any] | None = None  # sent once first


REFUSED_ALONE = {
    # Kafka's sequence-gap rule: refused alone, as Kafka's broker refuses such a batch.
    "kafka-batch-skipping-ahead": Refused(
        skipping_ahead,
        NOT_ENOUGH_REPLICAS,
        "skips ahead of 1",
        lambda topic: produce_request(topic, {0: idempotent_batch([b"h0"], 8282, 0, 0)}),
    ),
    # Producer unknown: its own connection's requests held back, no other's.
    "damaged-batch": Refused(
        lambda topic: produce_request(topic, {0: damaged(explicit_batch([("h", 0)]))}),
        CORRUPT_MESSAGE,
        "crc",
    ),
    "chunk-skipping-ahead": Refused(
        chunk_skipping_ahead, NOT_ENOUGH_REPLICAS, "the message's chunk 0 was never accepted"
    ),
}


@pytest.mark.parametrize("kind", sorted(REFUSED_ALONE))
def test_refusals_any_client_can_draw_hold_back_no_other_connections_requests(
    kind: str, dedup_proxy: ProxyProcess, local_env: EnvInfo
) -> None:
    """A client pours requests that are refused, retriable, for what they are into a
    partition while a producer on another connection writes there, one request at a time.
    Every one of the honest producer's requests is written at its first attempt. Before,
    each refusal also refused every request admitted behind it on the partition until its
    answer was decided: the client kept every other producer there re-sending.

    A batch that skips ahead of its Kafka producer's sequence holds back nothing behind it
    (Kafka's rule holds back that producer's later batches); a damaged batch, or a chunk
    whose chunk before never came, holds back the requests its own connection sent behind
    it (`dedup.partitions.Reach`)."""
    refused_kind = REFUSED_ALONE[kind]
    topic = new_topic(local_env.bootstrap)
    first = produce_request(topic, {0: explicit_batch([("x", 0)])})
    assert produce_raw(dedup_proxy, first).error_code == 0
    if refused_kind.before is not None:
        assert produce_raw(dedup_proxy, refused_kind.before(topic)).error_code == 0
    burst = [refused_kind.request(topic)] * BURST
    poured, refused = honest_beside(dedup_proxy, topic, lambda: burst)
    assert {a.error_code for a in poured} == {refused_kind.code}
    assert all(refused_kind.words in (a.error_message or "").lower() for a in poured), poured[0]
    assert refused == [], f"the honest producer was refused: {refused[:5]}"
    expected = [b"v0"] + [f"v{n}".encode() for n in range(HONEST_REQUESTS)]
    assert honest_records(local_env.bootstrap, topic) == expected


def test_a_client_resending_records_in_flight_holds_back_no_other_producers_requests(
    dedup_proxy: ProxyProcess, local_env: EnvInfo
) -> None:
    """A client pipelines each of its requests twice in a row, as a client re-sending too
    soon would (or one doing it on purpose): the second meets its records still being
    written and is refused, retriable, and so are the requests of that producer admitted
    behind it. Meanwhile an honest producer on another connection writes one request at
    a time: every one is written at its first attempt. Before, such a refusal refused
    every request admitted behind it on the partition (`dedup.partitions.Reach`)."""
    topic = new_topic(local_env.bootstrap)
    first = produce_request(topic, {0: explicit_batch([("x", 0)])})
    assert produce_raw(dedup_proxy, first).error_code == 0
    sequences = itertools.count()

    def twice_each() -> list[Any]:
        requests = [
            produce_request(topic, {0: explicit_batch([("r", next(sequences))])})
            for _ in range(BURST // 2)
        ]
        return [request for request in requests for _ in (1, 2)]

    poured, refused = honest_beside(dedup_proxy, topic, twice_each)
    refusals = [a for a in poured if a.error_code]
    in_flight = [a for a in refusals if "in flight" in (a.error_message or "")]
    print(f"{len(in_flight)} re-sends met their records in flight, {len(refusals)} refused")
    assert in_flight, "no re-send met its records in flight"
    assert {a.error_code for a in refusals} == {NOT_ENOUGH_REPLICAS}
    assert refused == [], f"the honest producer was refused: {refused[:5]}"
    expected = [b"v0"] + [f"v{n}".encode() for n in range(HONEST_REQUESTS)]
    assert honest_records(local_env.bootstrap, topic) == expected
    # The client's own records: once each, in order (those refused were never re-sent).
    own = [int(value[1:]) for value in records_of(local_env.bootstrap, topic, {b"r"})]
    assert own == sorted(set(own)) and own, own[:20]


FLOOD_REQUESTS = 3000
FLOOD_RECORDS = 20  # per request, 5 KB each: about 100 KB a request, 300 MB in all
FROZEN_S = 3.0


def test_an_acks_0_flood_is_read_only_as_fast_as_it_is_handled(
    local_env: EnvInfo, tmp_path: Path
) -> None:
    """Redis stops answering (a relay holds every byte) while one connection pours 3,000
    acks=0 Produce requests through dedup (300 MB) without waiting for anything. The
    proxy reads a request only once one of the connection's 64 slots is free, so the flood
    waits in the socket, not in the proxy's memory: while Redis is silent the proxy takes
    in a few MB and its RSS stays flat (without the bound it read all 300 MB and held it).
    Once Redis answers, every record lands once. The check runs in Redis here
    (``check_state = "redis"``), so a silent Redis is what holds every request: the bound is
    the runtime's, whatever holds a request."""
    relay, relayed = relayed_redis(local_env.redis, REDIS_RELAY, 0)
    proxy = own_proxy(
        local_env,
        FLOOD,
        f"flood-{uuid.uuid4().hex[:8]}",
        tmp_path / "proxy.log",
        DEDUP_PROXY_REDIS=relayed,
        DEDUP_PROXY_CHECK_STATE="redis",
    ).start()
    try:
        topic = new_topic(local_env.bootstrap)
        first = produce_raw(proxy, produce_request(topic, {0: explicit_batch([("x", 0)])}))
        assert first.error_code == 0, first  # recovered before the flood
        frames = [
            encode_request(produce_request(topic, {0: flood_batch(n)}, acks=0), n + 1)
            for n in range(FLOOD_REQUESTS)
        ]
        flood_bytes = sum(len(frame) for frame in frames)
        baseline = rss_bytes(proxy.pid)
        relay.freeze()
        accepted = 0  # bytes the proxy's socket took
        port = proxy.broker_port()

        def flood() -> None:
            nonlocal accepted
            with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
                for frame in frames:
                    sock.sendall(frame)
                    accepted += len(frame)

        sender = threading.Thread(target=flood, daemon=True)
        sender.start()
        time.sleep(FROZEN_S)
        taken, grown = accepted, rss_bytes(proxy.pid) - baseline
        relay.thaw()
        sender.join(120)
        assert not sender.is_alive(), "the flood was never read"
        total = 1 + FLOOD_RECORDS * FLOOD_REQUESTS
        wait_until(
            lambda: end_offset(local_env.bootstrap, topic) >= total,
            120,
            "the flood's records landed",
        )
    finally:
        relay.thaw()
        assert proxy.stop() == 0
        relay.stop()
    print(
        f"\nacks=0 flood of {flood_bytes / 1e6:.0f} MB, Redis silent {FROZEN_S:g} s: the proxy "
        f"took {taken / 1e6:.1f} MB meanwhile, its RSS grew {grown / 1e6:.1f} MB"
    )
    assert taken < flood_bytes / 10, f"the proxy read {taken / 1e6:.0f} MB it could not handle"
    assert grown < flood_bytes / 10, f"the proxy's memory grew by {grown / 1e6:.0f} MB"
    landed = [value for value, _ in read_all(local_env.bootstrap, topic)]
    assert len(landed) == total and len(set(landed)) == total


def flood_batch(request: int) -> bytes:
    first = request * FLOOD_RECORDS
    return explicit_batch([("flood", first + i) for i in range(FLOOD_RECORDS)], value_size=5000)

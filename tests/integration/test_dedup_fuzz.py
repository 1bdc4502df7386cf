"""Fuzzing the dedup decode path through a real proxy: Produce requests whose record
batches are valid ones mutated (bytes flipped, inserted or cut, the compression codec,
the record count and the lengths changed) with the CRC32C made right again, so the input
gets past the checksum into the batch, record and header readers and the check.

Each input is answered within seconds (whatever the answer) or closes only its own
connection; the proxy stays healthy, its memory bounded, and a real client still works
afterwards. (The pass-through proxy's fuzzing: test_protocol.py.)"""

from __future__ import annotations

import socket
import struct
import time
from contextlib import suppress

import pytest
from confluent_kafka import Producer
from crc32c import crc32c
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deploy.launcher import ProxyProcess
from deploy.local import EnvInfo
from proxy.kafka.upstream_client import encode_request
from tests.support.kafka_io import values
from tests.support.proxies import rss_bytes
from tests.support.raw import explicit_batch, produce_raw, produce_request, read_response
from tests.support.topics import new_topic

pytestmark = pytest.mark.integration

ATTRIBUTES_OFFSET = 21  # what the CRC32C covers starts here (magic 2 batches)
ANSWER_WITHIN_S = 10.0

SEEDS = [
    explicit_batch([("fuzz", n) for n in range(3)]),
    explicit_batch([("fuzz", 7)], value_size=300),
    explicit_batch([(f"p{n}", n) for n in range(20)], value_size=10),
]


@st.composite
def mutated_batches(draw: st.DrawFn) -> bytes:
    batch = bytearray(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["flip", "insert", "cut", "codec", "count", "int"]))
        if kind == "flip":
            at = draw(st.integers(ATTRIBUTES_OFFSET, len(batch) - 1))
            batch[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "insert":
            at = draw(st.integers(ATTRIBUTES_OFFSET, len(batch)))
            batch[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif kind == "cut" and len(batch) > ATTRIBUTES_OFFSET + 2:
            at = draw(st.integers(ATTRIBUTES_OFFSET + 1, len(batch) - 1))
            del batch[at : at + draw(st.integers(1, 16))]
        elif kind == "codec":  # none, gzip, snappy, lz4, zstd, and the undefined ones
            batch[ATTRIBUTES_OFFSET + 1] = (batch[ATTRIBUTES_OFFSET + 1] & 0xF8) | draw(
                st.integers(0, 7)
            )
        elif kind == "count":  # the record count, 57..61
            struct.pack_into(">i", batch, 57, draw(st.integers(-(2**31), 2**31 - 1)))
        elif kind == "int" and len(batch) > ATTRIBUTES_OFFSET + 4:  # any 4 bytes, signed
            at = draw(st.integers(ATTRIBUTES_OFFSET, len(batch) - 4))
            struct.pack_into(">i", batch, at, draw(st.integers(-(2**31), 2**31 - 1)))
    struct.pack_into(">i", batch, 8, len(batch) - 12)  # the batch length, made right again
    struct.pack_into(">I", batch, 17, crc32c(bytes(batch[ATTRIBUTES_OFFSET:])))
    return bytes(batch)


@pytest.fixture(scope="module")
def fuzz_topic(local_env: EnvInfo, dedup_proxy: ProxyProcess) -> str:
    topic = new_topic(local_env.bootstrap)
    first = produce_raw(dedup_proxy, produce_request(topic, {0: explicit_batch([("x", 0)])}))
    assert first.error_code == 0, first  # recovered before the fuzzing starts
    return topic


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(batch=mutated_batches())
def test_a_mutated_batch_is_answered_quickly_and_harms_nothing(
    dedup_proxy: ProxyProcess, fuzz_topic: str, batch: bytes
) -> None:
    port = dedup_proxy.broker_port()
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=ANSWER_WITHIN_S) as sock:
        sock.sendall(encode_request(produce_request(fuzz_topic, {0: batch}), 5))
        with suppress(ConnectionError):
            read_response(sock)  # an answer, or the connection closed: both are fine
    took = time.monotonic() - started
    assert took < ANSWER_WITHIN_S, f"a {len(batch)}-byte batch took {took:.1f} s"
    assert dedup_proxy.health() is not None


def test_the_proxy_is_sound_after_the_fuzzing(
    dedup_proxy: ProxyProcess, fuzz_topic: str, local_env: EnvInfo
) -> None:
    rss = rss_bytes(dedup_proxy.pid)
    assert rss < 1 << 30, f"the proxy holds {rss >> 20} MB after the fuzzing"
    producer = Producer({"bootstrap.servers": dedup_proxy.bootstrap})
    producer.produce(
        fuzz_topic, b"still fine", headers=[("dedup.producer", "after"), ("dedup.sequence", "1")]
    )
    assert producer.flush(30) == 0
    assert values(local_env.bootstrap, fuzz_topic)[-1] == b"still fine"

"""Record batches against real Kafka and real clients, for every codec:

- batches `build_batch` writes (with and without a producer id) are accepted by Kafka 4
  and read back by librdkafka with the same keys, values and headers;
- batches librdkafka and the Java client write (idempotent) are read by `read_batches`,
  with implicit identities equal to the producer's own id, epoch and sequences.

The test runs its own Kafka (`tests.support.ports.BATCHES_ENV`, its own state home) so that
it neither disturbs nor depends on the shared local environment.
"""

from __future__ import annotations

import asyncio
import datetime
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kio.schema.fetch.v12.request as fetch_request
import kio.schema.fetch.v12.response as fetch_response
import kio.schema.init_producer_id.v4.request as init_pid_request
import kio.schema.init_producer_id.v4.response as init_pid_response
import kio.schema.produce.v9.request as produce_request
import kio.schema.produce.v9.response as produce_response
import pytest
from confluent_kafka import Consumer, KafkaError, Producer
from kio.schema.errors import ErrorCode
from kio.schema.types import TopicName
from kio.static.primitive import Records, i16, i32, i32Timedelta, i64

from dedup.batches import (
    CODEC_NAMES,
    HEADER_PRODUCER,
    HEADER_SEQUENCE,
    HEADER_SIZE,
    Identity,
    IncomingBatch,
    IncomingRecord,
    build_batch,
    read_batches,
)
from deploy.local import EnvInfo, LocalEnvironment, java_tool_command
from deploy.topics import create_topic
from proxy.kafka.topology import Endpoint
from proxy.kafka.upstream_client import UpstreamClient
from tests.support.ports import BATCHES_ENV

pytestmark = pytest.mark.integration

CODECS = sorted(CODEC_NAMES)
CODEC_IDS = [CODEC_NAMES[c] for c in CODECS]
TIMEOUT_S = 30.0
PREFIX = 111111111  # VerifiableProducer's --value-prefix is an integer


@pytest.fixture(scope="module")
def own_kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EnvInfo]:
    environment = LocalEnvironment(
        home=tmp_path_factory.mktemp("batches") / "env",
        ports=BATCHES_ENV,
    )
    try:
        yield environment.up(brokers=1)
    finally:
        environment.down(purge=True)


@pytest.fixture
def topic(own_kafka: EnvInfo) -> str:
    name = f"batches-{uuid.uuid4().hex[:12]}"
    return create_topic(own_kafka.bootstrap, name, replication_factor=1, timeout_s=30)


def endpoint(env: EnvInfo) -> Endpoint:
    return Endpoint.parse(env.bootstrap.split(",")[0])


def consume_all(bootstrap: str, topic: str, count: int) -> list[Any]:
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"g-{uuid.uuid4().hex[:8]}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    consumer.subscribe([topic])
    messages: list[Any] = []
    try:
        for _ in range(300):
            if len(messages) >= count:
                break
            message = consumer.poll(0.2)
            if message is None:
                continue
            assert message.error() is None, message.error()
            messages.append(message)
    finally:
        consumer.close()
    assert len(messages) == count
    return messages


async def fetch_log(env: EnvInfo, topic: str, count: int) -> list[IncomingBatch]:
    """The partition's batches as the log holds them (raw bytes through a Fetch v12)."""
    batches: list[IncomingBatch] = []
    offset = 0
    async with UpstreamClient(endpoint(env), TIMEOUT_S) as client:
        for _ in range(50):
            if sum(len(b.records) for b in batches) >= count:
                break
            request = fetch_request.FetchRequest(
                max_wait=i32Timedelta.parse(datetime.timedelta(milliseconds=200)),
                min_bytes=i32(1),
                topics=(
                    fetch_request.FetchTopic(
                        topic=TopicName(topic),
                        partitions=(
                            fetch_request.FetchPartition(
                                partition=i32(0),
                                fetch_offset=i64(offset),
                                partition_max_bytes=i32(1 << 20),
                            ),
                        ),
                    ),
                ),
                forgotten_topics_data=(),
            )
            response: fetch_response.FetchResponse = await client.request(request)
            [partition] = response.responses[0].partitions
            assert partition.error_code == ErrorCode.none
            for batch in read_batches(bytes(partition.records or b""), from_log=True):
                batches.append(batch)
                offset = batch.base_offset + batch.last_offset_delta + 1
    assert sum(len(b.records) for b in batches) == count
    return batches


async def produce_raw(env: EnvInfo, topic: str, batch: bytes) -> int:
    """Send one batch in a Produce v9 request; Kafka's base offset for it."""
    request = produce_request.ProduceRequest(
        transactional_id=None,
        acks=i16(-1),
        timeout=i32Timedelta.parse(datetime.timedelta(seconds=10)),
        topic_data=(
            produce_request.TopicProduceData(
                name=TopicName(topic),
                partition_data=(
                    produce_request.PartitionProduceData(index=i32(0), records=Records(batch)),
                ),
            ),
        ),
    )
    async with UpstreamClient(endpoint(env), TIMEOUT_S) as client:
        response: produce_response.ProduceResponse = await client.request(request)
    [partition] = response.responses[0].partition_responses
    assert partition.error_code == ErrorCode.none, (partition.error_code, partition.error_message)
    return int(partition.base_offset)


async def init_producer_id(env: EnvInfo) -> tuple[int, int]:
    request = init_pid_request.InitProducerIdRequest(
        transactional_id=None,
        transaction_timeout=i32Timedelta.parse(datetime.timedelta(minutes=1)),
    )
    async with UpstreamClient(endpoint(env), TIMEOUT_S) as client:
        for _ in range(60):
            response: init_pid_response.InitProducerIdResponse = await client.request(request)
            if response.error_code == ErrorCode.none:
                return int(response.producer_id), int(response.producer_epoch)
            assert response.error_code.retriable, response.error_code
            await asyncio.sleep(0.5)
    raise AssertionError("InitProducerId kept failing")


def value_of(index: int) -> bytes:
    # Compressible, so that every client keeps the codec.
    return f"value {index} ".encode() * 20


# --------------------------------------------------------------------------- build_batch -> Kafka


def proxy_records(start: int, count: int) -> list[IncomingRecord]:
    """Records as read_batches gives them: explicit, implicit (a client's idempotent
    producer), and without identity; keys, values and header values with None."""
    records = []
    for i in range(start, start + count):
        kind = i % 3
        headers: tuple[tuple[str, bytes | None], ...] = (("ünï", f"h{i}".encode()), ("nul", None))
        identity: Identity | None
        if kind == 0:
            identity = Identity("app-é", 5000 + i)
            headers = (
                *headers,
                (HEADER_PRODUCER, b"app-\xc3\xa9"),
                (HEADER_SEQUENCE, b"%d" % (5000 + i)),
            )
        elif kind == 1:
            identity = Identity("kafka-pid-77-1", i)
        else:
            identity = None
        records.append(
            IncomingRecord(
                offset_delta=i,
                timestamp=1_700_000_000_000 + i,
                key=None if i % 4 == 0 else f"k{i}".encode(),
                value=None if i == 5 else value_of(i),
                headers=headers,
                identity=identity,
            )
        )
    return records


@pytest.mark.parametrize("codec", CODECS, ids=CODEC_IDS)
async def test_kafka_accepts_built_batches(own_kafka: EnvInfo, topic: str, codec: int) -> None:
    producer_id, producer_epoch = await init_producer_id(own_kafka)
    first, second, third = proxy_records(0, 7), proxy_records(7, 5), proxy_records(12, 3)
    common: dict[str, Any] = {
        "compression": codec,
        "timestamp_type": 0,
        "add_identity_headers": True,
    }
    # Two idempotent batches under the proxy's own producer id, then a plain one.
    built = [
        build_batch(
            first, producer_id=producer_id, producer_epoch=producer_epoch, base_sequence=0, **common
        ),
        build_batch(
            second,
            producer_id=producer_id,
            producer_epoch=producer_epoch,
            base_sequence=7,
            **common,
        ),
        build_batch(third, producer_id=-1, producer_epoch=-1, base_sequence=-1, **common),
    ]
    offsets = [await produce_raw(own_kafka, topic, batch) for batch in built]
    assert offsets == [0, 7, 12]

    sent = [*first, *second, *third]
    messages = consume_all(own_kafka.bootstrap, topic, len(sent))
    for message, record in zip(messages, sent, strict=True):
        assert message.key() == record.key
        assert message.value() == record.value
        assert message.timestamp()[1] == record.timestamp
        expected_headers = list(record.headers)
        if record.identity is not None and not any(n == HEADER_PRODUCER for n, _ in record.headers):
            expected_headers += [
                (HEADER_PRODUCER, record.identity.producer.encode()),
                (HEADER_SEQUENCE, str(record.identity.sequence).encode()),
            ]
        assert (message.headers() or []) == expected_headers

    # A replay of the log recovers every identity, the implicit ones included.
    logged = await fetch_log(own_kafka, topic, len(sent))
    assert [b.compression for b in logged] == [codec] * 3
    assert [r.identity for b in logged for r in b.records] == [r.identity for r in sent]


# --------------------------------------------------------------------------- clients -> read


def check_implicit(batches: list[IncomingBatch], explicit: dict[int, Identity], codec: int) -> None:
    """Each batch as the proxy would get it in a Produce request: implicit identities are
    the producer's (id, epoch, sequence = the message's index), explicit ones win."""
    producer_ids = {b.producer_id for b in batches}
    assert len(producer_ids) == 1 and min(producer_ids) >= 0
    index = 0
    for logged in batches:
        assert logged.compression == codec
        assert logged.base_sequence == index
        [batch] = read_batches(logged.raw)  # the exact bytes the client sent, produce checks on
        for record in batch.records:
            expected = explicit.get(
                index, Identity(f"kafka-pid-{batch.producer_id}-{batch.producer_epoch}", index)
            )
            assert record.identity == expected
            index += 1


@pytest.mark.parametrize("codec", CODECS, ids=CODEC_IDS)
async def test_librdkafka_batches_are_read(own_kafka: EnvInfo, topic: str, codec: int) -> None:
    producer = Producer(
        {
            "bootstrap.servers": own_kafka.bootstrap,
            "enable.idempotence": True,
            "compression.type": CODEC_NAMES[codec],
            "linger.ms": 100,
            "batch.num.messages": 7,
        }
    )
    errors: list[KafkaError] = []
    explicit: dict[int, Identity] = {}
    sent: list[tuple[bytes | None, bytes, list[tuple[str, str | bytes | None]]]] = []
    for i in range(30):
        headers: list[tuple[str, str | bytes | None]] = [("ünï", f"h{i}".encode()), ("nul", None)]
        if i % 5 == 0:
            explicit[i] = Identity("app", 1000 + i)
            headers += [(HEADER_PRODUCER, b"app"), (HEADER_SEQUENCE, b"%d" % (1000 + i))]
        key = None if i % 4 == 0 else f"k{i}".encode()
        sent.append((key, value_of(i), headers))
        producer.produce(
            topic,
            value=value_of(i),
            key=key,
            headers=headers,
            on_delivery=lambda err, _msg: errors.append(err) if err else None,
        )
    assert producer.flush(30) == 0
    assert errors == []

    batches = await fetch_log(own_kafka, topic, len(sent))
    assert len(batches) > 1, "expected several batches (batch.num.messages=7)"
    records = [r for b in batches for r in b.records]
    for record, (key, value, headers) in zip(records, sent, strict=True):
        assert (record.key, record.value, list(record.headers)) == (key, value, headers)
    check_implicit(batches, explicit, codec)


@pytest.mark.parametrize("codec", CODECS, ids=CODEC_IDS)
async def test_java_client_batches_are_read(
    own_kafka: EnvInfo, topic: str, codec: int, tmp_path: Path
) -> None:
    config = tmp_path / "producer.properties"
    config.write_text(
        f"compression.type={CODEC_NAMES[codec]}\nlinger.ms=200\nenable.idempotence=true\nretries=5\n"
    )
    count = 40
    result = await asyncio.to_thread(
        subprocess.run,
        java_tool_command(
            "org.apache.kafka.tools.VerifiableProducer",
            "--bootstrap-server",
            own_kafka.bootstrap,
            "--topic",
            topic,
            "--max-messages",
            str(count),
            "--value-prefix",
            str(PREFIX),
            "--command-config",
            str(config),
        ),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    batches = await fetch_log(own_kafka, topic, count)
    values = [r.value for b in batches for r in b.records]
    assert values == [f"{PREFIX}.{i}".encode() for i in range(count)]
    check_implicit(batches, {}, codec)
    if codec == 2:  # the Java client frames snappy the xerial way
        assert all(b.raw[HEADER_SIZE:].startswith(b"\x82SNAPPY\x00") for b in batches)

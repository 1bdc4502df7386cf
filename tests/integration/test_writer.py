"""The proxy's idempotent writer against real Kafka: what `tests/unit/test_writer.py` pins
down against a scripted broker, where only Kafka's own answer tells."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from kafka.record.default_records import DefaultRecordBatchBuilder

from dedup.fencing import Fencer
from dedup.links import UpstreamLinks
from dedup.writer import BatchToWrite, IdempotentWriter
from deploy.local import EnvInfo
from proxy.kafka.topology import Endpoint
from tests.support.kafka_io import values
from tests.support.topics import new_topic

pytestmark = pytest.mark.integration


def batch_of(topic: str, texts: list[str]) -> BatchToWrite:
    """One batch of the records ``texts`` to partition 0, built as the writer asks."""

    def build(producer_id: int, epoch: int, sequence: int) -> bytes:
        builder = DefaultRecordBatchBuilder(
            magic=2,
            compression_type=0,
            is_transactional=False,
            producer_id=producer_id,
            producer_epoch=epoch,
            base_sequence=sequence,
            batch_size=1 << 20,
        )
        now_ms = int(time.time() * 1000)
        for offset, text in enumerate(texts):
            builder.append(offset, now_ms, None, text.encode(), [])
        return bytes(builder.build())

    return BatchToWrite(topic, 0, len(texts), build)


async def written_around_a_forget(bootstrap: str, topic: str) -> list[bool]:
    """Ten records, the partition forgotten, ten more: whether each write was acknowledged."""
    host, port = bootstrap.split(",")[0].rsplit(":", 1)
    broker = Endpoint(host, int(port))

    async def leader_of(topic: str, partition: int) -> Endpoint:
        return broker  # one broker

    links = UpstreamLinks(10.0)
    fencer = Fencer(f"test-writer-{uuid.uuid4().hex[:8]}", lambda: [broker], leader_of, links.get)
    writer = IdempotentWriter(leader_of, fencer, links.get, timeout_s=10.0)
    try:
        (first,) = await writer.write(
            broker, [batch_of(topic, [str(n) for n in range(10)])], 10_000
        )
        assert writer.forget(topic, 0)
        (second,) = await writer.write(
            broker, [batch_of(topic, [str(n) for n in range(10, 20)])], 10_000
        )
        return [first.written, second.written]
    finally:
        await links.close()


def test_a_forgotten_partition_that_kafka_still_has_takes_every_record_of_its_next_write(
    local_env: EnvInfo,
) -> None:
    """The writer forgets a partition whose topic looked deleted, but Kafka still has it
    (a broker's metadata lagged): its log holds the writer's producer at sequence 9. The
    next batch, as many records as the first, must not go under that producer and epoch
    from sequence 0: Kafka would take it for a retry of the first batch, answer it written
    and drop its records. It goes under a new epoch, and the log holds all twenty."""
    topic = new_topic(local_env.bootstrap)
    assert asyncio.run(written_around_a_forget(local_env.bootstrap, topic)) == [True, True]
    assert values(local_env.bootstrap, topic) == [str(n).encode() for n in range(20)]

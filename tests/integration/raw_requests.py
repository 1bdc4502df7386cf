"""Raw Produce requests built with kio, for tests that speak the wire protocol themselves."""

from __future__ import annotations

import datetime
import io
from collections.abc import Mapping, Sequence

import kio.schema.produce.v9.request as produce_v9
from kio.records.schema import NewRecordBatch, Record, RecordHeader
from kio.records.writers import write_new_batch
from kio.schema.types import TopicName
from kio.static.primitive import Records, TZAwareMicros, i8, i16, i32, i32Timedelta, i64

Headers = Sequence[tuple[bytes, bytes]]


def record_batch(records: Sequence[tuple[bytes, Headers]]) -> bytes:
    """One plain (non-idempotent, uncompressed) batch of (value, headers) records."""
    now = TZAwareMicros.parse(datetime.datetime.now(datetime.UTC).replace(microsecond=0))
    batch = io.BytesIO()
    write_new_batch(
        batch,
        NewRecordBatch(
            producer_id=i64(-1),
            producer_epoch=i16(-1),
            base_sequence=i32(-1),
            attributes=i16(0),
            records=tuple(
                Record(
                    attributes=i8(0),
                    timestamp=now,
                    offset=i64(offset),
                    key=None,
                    value=value,
                    headers=tuple(RecordHeader(key=k, value=v) for k, v in headers),
                )
                for offset, (value, headers) in enumerate(records)
            ),
        ),
    )
    return batch.getvalue()


def identity_batch(identities: Sequence[tuple[bytes, bytes]], value_size: int = 0) -> bytes:
    """Records carrying dedup identity headers (raw bytes, so tests can send bad ones);
    each value is ``v<sequence>`` padded with ``value_size`` bytes."""
    return record_batch(
        [
            (
                b"v" + sequence + b"x" * value_size,
                [(b"dedup.producer", producer), (b"dedup.sequence", sequence)],
            )
            for producer, sequence in identities
        ]
    )


def explicit_batch(identities: Sequence[tuple[str, int]], value_size: int = 0) -> bytes:
    return identity_batch([(p.encode(), str(s).encode()) for p, s in identities], value_size)


def produce_request(
    topic: str, batches: Mapping[int, bytes], acks: int = -1
) -> produce_v9.ProduceRequest:
    """A Produce v9 request writing ``batches[partition]`` to each partition of ``topic``."""
    return produce_v9.ProduceRequest(
        transactional_id=None,
        acks=i16(acks),
        timeout=i32Timedelta.parse(datetime.timedelta(seconds=30)),
        topic_data=(
            produce_v9.TopicProduceData(
                name=TopicName(topic),
                partition_data=tuple(
                    produce_v9.PartitionProduceData(index=i32(partition), records=Records(data))
                    for partition, data in sorted(batches.items())
                ),
            ),
        ),
    )

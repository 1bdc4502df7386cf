"""Chunked messages (see `dedup.chunks`) reassembled inside the Spark job, across
micro-batches, so a message of many records arrives in the sink as one row.

Chunks are grouped by (topic, partition, producer): a producer sends the chunks of one
message to one partition, in order, and the proxy lets at most one of its messages be in
progress there. The group's state (Spark's state store, so it survives restarts with the
checkpoint) holds the message in progress and the highest sequence already completed:

- chunk ids below the next expected one, and chunks of a completed sequence, are duplicates
  (re-sends that reached Kafka around the proxy) and are ignored;
- a chunk that contradicts its message (uuid, count or size), skips a chunk id, or starts a
  newer message while one is in progress ends that message as incomplete;
- a message still incomplete `expire_after_s` after its last chunk arrived expires.

An incomplete message is never dropped silently: it becomes a row with a NULL value and
`chunks_missing` > 0 (complete rows have 0), which `dedup-proxy spark verify` counts.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from dedup.chunks import (
    CHUNK_HEADERS,
    HEADER_CHUNK_COUNT,
    HEADER_CHUNK_ID,
    HEADER_TOTAL_SIZE,
    HEADER_UUID,
)
from dedup.spark.rows import header_value

if TYPE_CHECKING:
    import pandas as pd
    from pyspark.sql import DataFrame
    from pyspark.sql.streaming.state import GroupState

DEFAULT_EXPIRE_AFTER_S = 600.0

ROW_SCHEMA = (
    "topic string, partition int, offset long, kafka_timestamp timestamp, key binary, "
    "value binary, headers array<struct<key:string,value:binary>>, producer string, "
    "sequence long, ingested_at timestamp, chunks_missing int"
)
# Scalars only: the state crosses between Python and the JVM by pickling, which carries no
# nested rows or timestamps. `first` is the first chunk's fields as JSON.
_STATE_SCHEMA = (
    "completed long, sequence long, uuid string, chunk_count int, total_size long, "
    "next_chunk int, data binary, first string"
)
_CHUNK_COLUMNS = ("chunk_uuid", "chunk_id", "chunk_count", "total_size")
_CHUNK_HEADERS = frozenset(CHUNK_HEADERS)


def reassemble_chunks(rows: DataFrame, expire_after_s: float = DEFAULT_EXPIRE_AFTER_S) -> DataFrame:
    """`rows` (the job's rows with identity) with chunked messages reassembled; every row
    gains `chunks_missing`."""
    from pyspark.sql import functions as F
    from pyspark.sql.streaming.state import GroupStateTimeout

    with_meta = rows.select(
        "*",
        header_value(HEADER_UUID).alias("chunk_uuid"),
        header_value(HEADER_CHUNK_ID).try_cast("int").alias("chunk_id"),
        header_value(HEADER_CHUNK_COUNT).try_cast("int").alias("chunk_count"),
        header_value(HEADER_TOTAL_SIZE).try_cast("long").alias("total_size"),
    )
    whole = with_meta.where(F.col("chunk_uuid").isNull()).select(
        *rows.columns, F.lit(0).alias("chunks_missing")
    )
    expire_ms = int(expire_after_s * 1000)

    def assemble(
        key: Any, batches: Iterable[pd.DataFrame], state: GroupState
    ) -> Iterator[pd.DataFrame]:
        import pandas as pd

        topic, partition, producer = key
        group = _Group.load(state, topic, partition, producer)
        out: list[dict[str, Any]] = []
        if state.hasTimedOut:
            group.end_incomplete(out)
            state.remove()
        else:
            for batch in batches:
                for chunk in batch.sort_values("offset").to_dict("records"):
                    group.add(chunk, out)
            state.update(group.to_state())
            state.setTimeoutDuration(expire_ms)
        yield pd.DataFrame(out, columns=[c.split()[0] for c in ROW_SCHEMA.split(", ")])

    assembled = (
        with_meta.where(F.col("chunk_uuid").isNotNull())
        .groupBy("topic", "partition", "producer")
        .applyInPandasWithState(
            assemble,
            outputStructType=ROW_SCHEMA,
            stateStructType=_STATE_SCHEMA,
            outputMode="append",
            timeoutConf=GroupStateTimeout.ProcessingTimeTimeout,
        )
    )
    return whole.unionByName(assembled)


@dataclass
class _Group:
    """One producer's chunk progress on one partition."""

    topic: str
    partition: int
    producer: str
    completed: int | None = None  # highest sequence completed (or ended incomplete)
    sequence: int | None = None  # the message in progress, if any
    uuid: str = ""
    chunk_count: int = 0
    total_size: int = 0
    next_chunk: int = 0
    data: bytearray = field(default_factory=bytearray)
    first: dict[str, Any] = field(default_factory=dict)  # the first chunk's row fields

    @classmethod
    def load(cls, state: GroupState, topic: str, partition: int, producer: str) -> _Group:
        if not state.exists:
            return cls(topic, partition, producer)
        s = state.get
        return cls(
            topic,
            partition,
            producer,
            completed=_int(s[0]),
            sequence=_int(s[1]),
            uuid=s[2] or "",
            chunk_count=int(s[3] or 0),
            total_size=int(s[4] or 0),
            next_chunk=int(s[5] or 0),
            data=bytearray(s[6] or b""),
            first=_decode_first(s[7]),
        )

    def to_state(self) -> tuple[Any, ...]:
        return (
            self.completed,
            self.sequence,
            self.uuid,
            self.chunk_count,
            self.total_size,
            self.next_chunk,
            bytes(self.data),
            _encode_first(self.first),
        )

    def add(self, chunk: dict[str, Any], out: list[dict[str, Any]]) -> None:
        sequence = _int(chunk["sequence"])
        chunk_id, count, total = chunk["chunk_id"], chunk["chunk_count"], chunk["total_size"]
        value = bytes(chunk["value"] or b"")
        if sequence is None or _null(chunk_id) or _null(count) or _null(total):
            return  # unreadable chunk headers: the proxy refuses these; nothing to join
        if self.completed is not None and sequence <= self.completed:
            return  # a re-sent chunk of a message already complete (or ended)
        if self.sequence is not None and sequence < self.sequence:
            return  # a re-sent chunk of a message the producer already moved past
        if self.sequence is not None and sequence > self.sequence:
            self.end_incomplete(out)  # a newer message: this one will never finish
        if self.sequence is not None and (
            (chunk["chunk_uuid"], int(count), int(total))
            != (self.uuid, self.chunk_count, self.total_size)
            or int(chunk_id) > self.next_chunk
        ):
            self.end_incomplete(out)
            return
        if self.sequence is None:
            if int(chunk_id) != 0:
                return  # the middle of a message whose start this job never saw
            self.sequence, self.uuid = sequence, chunk["chunk_uuid"]
            self.chunk_count, self.total_size, self.next_chunk = int(count), int(total), 0
            self.data = bytearray()
            self.first = _first_chunk_fields(chunk)
        if int(chunk_id) < self.next_chunk:
            return  # a duplicate chunk
        self.data += value
        self.next_chunk += 1
        if self.next_chunk == self.chunk_count:
            if len(self.data) == self.total_size:
                out.append(self._row(value=bytes(self.data), missing=0))
                self._finish()
            else:
                self.end_incomplete(out)

    def end_incomplete(self, out: list[dict[str, Any]]) -> None:
        if self.sequence is not None:
            missing = max(1, self.chunk_count - self.next_chunk)
            out.append(self._row(value=None, missing=missing))
            self._finish()

    def _finish(self) -> None:
        self.completed = self.sequence
        self.sequence, self.uuid, self.next_chunk = None, "", 0
        self.chunk_count = self.total_size = 0
        self.data = bytearray()
        self.first = {}

    def _row(self, value: bytes | None, missing: int) -> dict[str, Any]:
        return {
            "topic": self.topic,
            "partition": self.partition,
            "producer": self.producer,
            "sequence": self.sequence,
            "value": value,
            "chunks_missing": missing,
            **self.first,
        }


def _first_chunk_fields(chunk: dict[str, Any]) -> dict[str, Any]:
    """What the joined row keeps of its first chunk, as plain Python values (the state is
    pickled to the JVM, which knows no numpy or pandas types)."""
    headers = chunk["headers"]  # a numpy array of dicts, or None
    key = chunk["key"]
    return {
        "offset": int(chunk["offset"]),
        "kafka_timestamp": _datetime(chunk["kafka_timestamp"]),
        "key": None if key is None else bytes(key),
        "headers": [
            (h["key"], None if h["value"] is None else bytes(h["value"]))
            for h in (() if headers is None else headers)
            if h["key"] not in _CHUNK_HEADERS
        ],
        "ingested_at": _datetime(chunk["ingested_at"]),
    }


def _encode_first(first: dict[str, Any]) -> str | None:
    if not first:
        return None
    return json.dumps(
        {
            "offset": first["offset"],
            "kafka_timestamp": _iso(first["kafka_timestamp"]),
            "key": _b64(first["key"]),
            "headers": [(name, _b64(value)) for name, value in first["headers"]],
            "ingested_at": _iso(first["ingested_at"]),
        }
    )


def _decode_first(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    doc = json.loads(text)
    return {
        "offset": doc["offset"],
        "kafka_timestamp": _from_iso(doc["kafka_timestamp"]),
        "key": _from_b64(doc["key"]),
        "headers": [(name, _from_b64(value)) for name, value in doc["headers"]],
        "ingested_at": _from_iso(doc["ingested_at"]),
    }


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def _from_iso(text: str | None) -> datetime | None:
    return None if text is None else datetime.fromisoformat(text)


def _b64(value: bytes | None) -> str | None:
    return None if value is None else base64.b64encode(value).decode()


def _from_b64(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text)


def _datetime(value: Any) -> datetime | None:
    return None if _null(value) else value.to_pydatetime()


def _null(value: Any) -> bool:
    return value is None or value != value  # pandas gives NaN for a NULL number


def _int(value: Any) -> int | None:
    return None if _null(value) else int(value)

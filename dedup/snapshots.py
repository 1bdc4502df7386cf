"""Snapshots of the dedup state, kept in a compacted Kafka topic.

A snapshot of one data topic-partition says "this map covers every record below Kafka offset
``offset``": after losing the state, recovery loads the newest snapshot and replays the data
log from ``offset`` on, instead of the whole log.

Layout of the snapshot topic (``__dedup_snapshots`` by default, ``cleanup.policy=compact``):

- Key ``<topic>/<partition>/<generation % 2>``. Topic names cannot contain ``/``, so the key
  parses back unambiguously. Compaction keeps the last record per key, so two generations
  survive it: the newest snapshot and the one before. When the newest does not decode, recovery
  falls back to the older one (and replays a little more of the log) instead of to nothing.
- Snapshot-topic partition ``crc32("<topic>/<partition>") % partitions``, chosen explicitly:
  both slots of a data partition live in one snapshot-topic partition (their order there is
  the write order), and recovering a few data partitions reads only the partitions holding
  them. The partition count is the topic's real one, read from metadata; like Kafka's own
  ``__consumer_offsets`` it must never be changed afterwards, or keys move to partitions
  nobody reads.
- Value ``DDS1`` (magic and format version) + compact JSON: ``producers`` maps each producer
  to ``[sequence, last_seen_ms]`` (its last complete sequence), ``chunks`` each producer
  with a chunked message in progress (`dedup.chunks`) to ``[sequence, chunk_id,
  chunk_count, total_size, size, uuid, last_seen_ms]``: chunks 0..chunk_id (``size`` bytes)
  are persisted, the last one is not. A producer may be in both, or in ``chunks`` only (its
  first message on the partition is in progress), compressed by the producer
  (zstd), so even hundreds of thousands of producers fit in ``max.message.bytes`` (16 MiB).
  Decoding checks every field: a damaged record is reported, never trusted. ``topic_id``
  (Kafka's id of the topic, `dedup.topic_ids`) is there when known; snapshots written
  before it was recorded have none. ``appends``, when there are any, maps producers to
  their latest appends below ``offset`` that the snapshotting owner knew
  (`dedup.recent_appends`), each ``[first_sequence, records, base_offset,
  log_append_time_ms]``, as Kafka's producer snapshots keep each producer's last batches:
  the next owner answers a re-sent batch from them with its original's offset. A reader
  that predates a field reports such a snapshot as unreadable (an unknown field) and
  falls back, as for any damaged one: safe, a longer replay.

Reading treats the topic as if fully compacted, whether or not the cleaner has run: per key
only the last record counts (a tombstone empties the slot), so what recovery sees does not
depend on compaction timing.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Final

import structlog
from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic, ResourceType

from dedup.chunks import ChunkProgress
from dedup.identity import INT64_MAX, INT64_MIN
from dedup.recent_appends import BATCHES_PER_PRODUCER
from dedup.topic_ids import TOPIC_ID

log = structlog.get_logger(__name__)

MAGIC: Final = b"DDS1"
DEFAULT_TOPIC: Final = "__dedup_snapshots"
MAX_SNAPSHOT_BYTES: Final = 16 * 1024 * 1024  # the topic's max.message.bytes

_INT32_MAX: Final = (1 << 31) - 1
_TOPIC_NAME = re.compile(r"[A-Za-z0-9._-]{1,249}")
_FIELDS: Final = frozenset(
    ("topic", "partition", "offset", "created_ms", "generation", "producers", "chunks")
)
# Not in snapshots written before topic ids were recorded; read as None.
_OPTIONAL_FIELDS: Final = frozenset(("topic_id", "appends"))
APPENDS_PER_PRODUCER: Final = BATCHES_PER_PRODUCER
_SHOW: Final = 60  # characters of a bad value shown in an error message
_KEY_ROOM: Final = 1024  # the record key next to a value of MAX_SNAPSHOT_BYTES
_GRACE_S: Final = 5.0  # past Kafka's own timeouts, for their answer to arrive
_RETRY_S: Final = 0.1

# Only closed segments are compacted: segment.ms bounds how long superseded snapshots wait
# for the cleaner. The dirty ratio is low because the topic is small and every superseded
# record left in it is read again at recovery.
_TOPIC_CONFIG: Final = {
    "cleanup.policy": "compact",
    "max.message.bytes": str(MAX_SNAPSHOT_BYTES),
    "segment.ms": str(3_600_000),
    "segment.bytes": str(100 * 1024 * 1024),
    "min.cleanable.dirty.ratio": "0.1",
    "min.compaction.lag.ms": "0",
}


class CorruptSnapshot(ValueError):
    """Bytes that are not a valid snapshot; the message says what is wrong."""


class SnapshotError(Exception):
    """Writing or reading the snapshot topic failed (Kafka error); the message says why."""


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= _SHOW else text[: _SHOW - 3] + "..."


def _check_int(name: str, value: object, low: int, high: int) -> int:
    # bool is an int in Python but never a valid count, offset or sequence.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, not {type(value).__name__} {_show(value)}")
    if not low <= value <= high:
        raise ValueError(f"{name} {_show(value)} is outside [{low}, {high}]")
    return value


def check_topic_name(topic: object) -> str:
    """A legal Kafka topic name (which also means: no ``/``, so keys parse back)."""
    if not isinstance(topic, str) or not _TOPIC_NAME.fullmatch(topic) or topic in {".", ".."}:
        raise ValueError(f"not a legal Kafka topic name: {_show(topic)}")
    return topic


def slot_key(topic: str, partition: int, generation: int) -> str:
    """The record key of a snapshot: one of two slots per data partition."""
    return f"{topic}/{partition}/{generation % 2}"


def snapshot_partition(topic: str, partition: int, partitions: int) -> int:
    """The snapshot-topic partition holding both slots of a data partition."""
    return zlib.crc32(f"{topic}/{partition}".encode()) % partitions


@dataclass(frozen=True, slots=True)
class ProducerEntry:
    """One producer's highest persisted sequence, and when it was last seen."""

    sequence: int
    last_seen_ms: int

    def __post_init__(self) -> None:
        _check_int("sequence", self.sequence, INT64_MIN, INT64_MAX)
        _check_int("last_seen_ms", self.last_seen_ms, 0, INT64_MAX)


@dataclass(frozen=True, slots=True)
class ChunkEntry:
    """One producer's chunked message in progress (persisted up to a chunk), and when the
    producer was last seen."""

    progress: ChunkProgress
    last_seen_ms: int

    def __post_init__(self) -> None:
        if not isinstance(self.progress, ChunkProgress):
            raise ValueError(f"not a ChunkProgress: {_show(self.progress)}")
        _check_int("last_seen_ms", self.last_seen_ms, 0, INT64_MAX)

    def to_json(self) -> list[Any]:
        p = self.progress
        return [
            p.sequence,
            p.chunk_id,
            p.chunk_count,
            p.total_size,
            p.size,
            p.uuid,
            self.last_seen_ms,
        ]

    @classmethod
    def from_json(cls, value: object) -> ChunkEntry:
        if not isinstance(value, list) or len(value) != 7:
            raise ValueError(
                "expected [sequence, chunk_id, chunk_count, total_size, size, uuid, "
                f"last_seen_ms], got {_show(value)}"
            )
        sequence, chunk_id, count, total, size, uuid, seen = value
        for name, number in (
            ("sequence", sequence),
            ("chunk_id", chunk_id),
            ("chunk_count", count),
            ("total_size", total),
            ("size", size),
        ):
            _check_int(name, number, INT64_MIN, INT64_MAX)
        return cls(ChunkProgress(sequence, uuid, chunk_id, count, total, size), seen)


@dataclass(frozen=True, slots=True)
class AppendEntry:
    """One of a producer's latest appends: its sequences ``first`` .. ``first + count - 1``
    at offsets from ``base_offset`` on (`dedup.recent_appends.Append`, without the token)."""

    first: int
    count: int
    base_offset: int
    log_append_time_ms: int  # -1: create-time timestamps

    def __post_init__(self) -> None:
        _check_int("first", self.first, INT64_MIN, INT64_MAX)
        _check_int("count", self.count, 1, _INT32_MAX)
        _check_int("base_offset", self.base_offset, 0, INT64_MAX)
        _check_int("log_append_time_ms", self.log_append_time_ms, -1, INT64_MAX)

    def to_json(self) -> list[int]:
        return [self.first, self.count, self.base_offset, self.log_append_time_ms]

    @classmethod
    def from_json(cls, value: object) -> AppendEntry:
        if not isinstance(value, list) or len(value) != 4:
            raise ValueError(
                f"expected [first, count, base_offset, log_append_time_ms], got {_show(value)}"
            )
        return cls(*value)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The dedup state of one data partition, covering every record below ``offset``.

    Invalid field values raise ValueError at construction, so whatever `encode` writes,
    `decode` reads back.
    """

    topic: str
    partition: int
    offset: int
    created_ms: int
    generation: int
    producers: Mapping[str, ProducerEntry]
    chunks: Mapping[str, ChunkEntry] = field(default_factory=dict)
    # Kafka's id of the topic the state was rebuilt from (`dedup.topic_ids`); None: not
    # known (a cluster without topic ids, or a snapshot written before they were recorded).
    topic_id: str | None = None
    # Per producer of `producers`, its latest appends below `offset`, oldest first.
    appends: Mapping[str, tuple[AppendEntry, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_topic_name(self.topic)
        if self.topic_id is not None and (
            not isinstance(self.topic_id, str) or not TOPIC_ID.fullmatch(self.topic_id)
        ):
            raise ValueError(f"topic_id is not a lower-case UUID: {_show(self.topic_id)}")
        _check_int("partition", self.partition, 0, _INT32_MAX)
        _check_int("offset", self.offset, 0, INT64_MAX)
        _check_int("created_ms", self.created_ms, 0, INT64_MAX)
        _check_int("generation", self.generation, 0, INT64_MAX)
        if not isinstance(self.producers, Mapping):
            raise ValueError(f"producers must be a mapping, not {type(self.producers).__name__}")
        for name, entry in self.producers.items():
            if not isinstance(name, str):
                raise ValueError(f"producer name must be a string, not {_show(name)}")
            if not isinstance(entry, ProducerEntry):
                raise ValueError(f"producer {_show(name)}: not a ProducerEntry: {_show(entry)}")
        if not isinstance(self.chunks, Mapping):
            raise ValueError(f"chunks must be a mapping, not {type(self.chunks).__name__}")
        for name, chunk in self.chunks.items():
            if not isinstance(name, str):
                raise ValueError(f"chunks key must be a string, not {_show(name)}")
            if not isinstance(chunk, ChunkEntry):
                raise ValueError(f"chunks of {_show(name)}: not a ChunkEntry: {_show(chunk)}")
            known = self.producers.get(name)
            if known is not None and chunk.progress.sequence <= known.sequence:
                raise ValueError(
                    f"chunks of {_show(name)}: sequence {chunk.progress.sequence} in progress "
                    f"is not above its complete sequence {known.sequence}"
                )
        if not isinstance(self.appends, Mapping):
            raise ValueError(f"appends must be a mapping, not {type(self.appends).__name__}")
        for name, appends in self.appends.items():
            if name not in self.producers:
                raise ValueError(f"appends of {_show(name)}: not one of the producers")
            if not isinstance(appends, tuple) or not 1 <= len(appends) <= APPENDS_PER_PRODUCER:
                raise ValueError(
                    f"appends of {_show(name)}: 1 to {APPENDS_PER_PRODUCER} expected, "
                    f"got {_show(appends)}"
                )
            for append in appends:
                if not isinstance(append, AppendEntry):
                    raise ValueError(f"appends of {_show(name)}: not an AppendEntry")
                if append.base_offset + append.count > self.offset:
                    raise ValueError(
                        f"appends of {_show(name)}: {append.count} at {append.base_offset} "
                        f"reach past the snapshot's offset {self.offset}"
                    )

    @property
    def key(self) -> str:
        return slot_key(self.topic, self.partition, self.generation)

    def encode(self) -> bytes:
        """``MAGIC`` + compact JSON."""
        body = {
            "topic": self.topic,
            "partition": self.partition,
            "offset": self.offset,
            "created_ms": self.created_ms,
            "generation": self.generation,
            "producers": {n: [e.sequence, e.last_seen_ms] for n, e in self.producers.items()},
            "chunks": {n: c.to_json() for n, c in self.chunks.items()},
        }
        if self.topic_id is not None:
            body["topic_id"] = self.topic_id
        if self.appends:  # only then: a reader that predates the field reads the rest
            body["appends"] = {n: [a.to_json() for a in r] for n, r in self.appends.items()}
        # ASCII output: any Python string (even a lone surrogate) encodes without error.
        return MAGIC + json.dumps(body, separators=(",", ":"), allow_nan=False).encode("ascii")

    @classmethod
    def decode(cls, data: bytes) -> Snapshot:
        """The snapshot in ``data``; CorruptSnapshot (and only that) for anything else."""
        if not isinstance(data, bytes | bytearray | memoryview):
            raise CorruptSnapshot(f"snapshot must be bytes, not {type(data).__name__}")
        data = bytes(data)
        if not data.startswith(MAGIC):
            if len(data) >= len(MAGIC) and data.startswith(MAGIC[:-1]):
                raise CorruptSnapshot(
                    f"unsupported snapshot format version {data[: len(MAGIC)]!r}, "
                    f"this version reads {MAGIC!r}"
                )
            raise CorruptSnapshot(
                f"not a snapshot: starts with {data[:16]!r}, expected {MAGIC!r} ({len(data)} bytes)"
            )
        try:
            doc = json.loads(
                data[len(MAGIC) :].decode("utf-8"),
                object_pairs_hook=_unique_keys,
                parse_constant=_no_constants,
            )
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
            raise CorruptSnapshot(f"snapshot body is not valid JSON: {exc}") from None
        try:
            return cls._from_json(doc)
        except ValueError as exc:
            raise CorruptSnapshot(f"invalid snapshot: {exc}") from None

    @classmethod
    def _from_json(cls, doc: object) -> Snapshot:
        if not isinstance(doc, dict):
            raise ValueError(f"body is a JSON {type(doc).__name__}, expected an object")
        if missing := _FIELDS - doc.keys():
            raise ValueError(f"missing fields {sorted(missing)}")
        if unknown := doc.keys() - _FIELDS - _OPTIONAL_FIELDS:
            raise ValueError(f"unknown fields {sorted(unknown)}")
        if "topic_id" in doc and not isinstance(doc["topic_id"], str):  # never written null
            raise ValueError(f"topic_id is not a lower-case UUID: {_show(doc['topic_id'])}")
        raw_producers = doc["producers"]
        if not isinstance(raw_producers, dict):
            raise ValueError(f"producers is a JSON {type(raw_producers).__name__}, not an object")
        producers: dict[str, ProducerEntry] = {}
        for name, value in raw_producers.items():
            if not isinstance(value, list) or len(value) != 2:
                raise ValueError(
                    f"producer {_show(name)}: expected [sequence, last_seen_ms], got {_show(value)}"
                )
            try:
                producers[name] = ProducerEntry(value[0], value[1])
            except ValueError as exc:
                raise ValueError(f"producer {_show(name)}: {exc}") from None
        raw_chunks = doc["chunks"]
        if not isinstance(raw_chunks, dict):
            raise ValueError(f"chunks is a JSON {type(raw_chunks).__name__}, not an object")
        chunks: dict[str, ChunkEntry] = {}
        for name, value in raw_chunks.items():
            try:
                chunks[name] = ChunkEntry.from_json(value)
            except ValueError as exc:
                raise ValueError(f"chunks of {_show(name)}: {exc}") from None
        raw_appends = doc.get("appends", {})
        if not isinstance(raw_appends, dict):
            raise ValueError(f"appends is a JSON {type(raw_appends).__name__}, not an object")
        appends: dict[str, tuple[AppendEntry, ...]] = {}
        for name, value in raw_appends.items():
            if not isinstance(value, list):
                raise ValueError(f"appends of {_show(name)}: not a list: {_show(value)}")
            try:
                appends[name] = tuple(AppendEntry.from_json(a) for a in value)
            except (ValueError, TypeError) as exc:
                raise ValueError(f"appends of {_show(name)}: {exc}") from None
        return cls(
            topic=doc["topic"],
            partition=doc["partition"],
            offset=doc["offset"],
            created_ms=doc["created_ms"],
            generation=doc["generation"],
            producers=producers,
            chunks=chunks,
            topic_id=doc.get("topic_id"),
            appends=appends,
        )

    def capped(self, max_producers: int) -> Snapshot:
        """At most ``max_producers`` producers: the most recently seen, as the Redis state
        evicts (least recently seen first, ties by name)."""
        _check_int("max_producers", max_producers, 0, INT64_MAX)
        seen: dict[str, int] = {}
        for name, entry in self.producers.items():
            seen[name] = entry.last_seen_ms
        for name, chunk in self.chunks.items():
            seen[name] = max(seen.get(name, 0), chunk.last_seen_ms)
        if len(seen) <= max_producers:
            return self
        newest = sorted(seen.items(), key=lambda item: (item[1], item[0]), reverse=True)
        kept = {name for name, _ in newest[:max_producers]}
        return self.only(kept)

    def only(self, kept: set[str]) -> Snapshot:
        """The snapshot of the producers in ``kept`` alone."""
        return replace(
            self,
            producers={n: e for n, e in self.producers.items() if n in kept},
            chunks={n: c for n, c in self.chunks.items() if n in kept},
            appends={n: a for n, a in self.appends.items() if n in kept},
        )

    def within_bytes(self, max_bytes: int = MAX_SNAPSHOT_BYTES) -> tuple[Snapshot, bytes]:
        """At most ``max_bytes`` encoded: without appends, then the most recently seen
        producers that fit (long names can make even `capped` too big for the topic, and a
        snapshot that never fits would fail for ever); with its encoding, made once when it
        fits as it is."""
        encoded = self.encode()
        if len(encoded) <= max_bytes:
            return self, encoded
        if self.appends:  # where batches are is worth less than what producers wrote
            return replace(self, appends={}).within_bytes(max_bytes)
        count = len(self.producers.keys() | self.chunks.keys())
        low, high = 0, count  # `low` producers fit; `high` do not
        while high - low > 1:
            middle = (low + high) // 2
            if len(self.capped(middle).encode()) <= max_bytes:
                low = middle
            else:
                high = middle
        fitted = self.capped(low)
        return fitted, fitted.encode()


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # A name given twice would make one of the two entries silently win.
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {_show(key)}")
        result[key] = value
    return result


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a valid number")


@dataclass(frozen=True, slots=True)
class StoredSnapshots:
    """What the snapshot topic holds for one data partition."""

    valid: tuple[Snapshot, ...] = ()  # newest first (by offset, then generation)
    # One description per slot whose latest record does not decode or does not belong there.
    corrupt: tuple[str, ...] = ()
    # Producers reset by an operator: name -> the partition's end offset at the reset.
    # Their records below it no longer count (`dedup.replay`, `dedup.recovery`).
    resets: Mapping[str, int] = field(default_factory=dict)

    @property
    def newest(self) -> Snapshot | None:
        return self.valid[0] if self.valid else None


@dataclass(frozen=True, slots=True)
class _TopicInfo:
    brokers: int
    partitions: int | None  # None: the topic does not exist


_ParsedKey = tuple[str, int, int | None]  # topic, partition, slot (None: the slot is bad)
RESETS_SLOT: Final = -1  # the key `TOPIC/PARTITION/resets`: the partition's producer resets


@dataclass(frozen=True, slots=True)
class _Record:
    partition: int  # of the snapshot topic
    offset: int
    key: bytes
    names: _ParsedKey
    value: bytes | None


_SHOW_SKIPPED: Final = 10  # skipped records described in the log, at most


def decode_resets(value: bytes) -> dict[str, int]:
    """The producer resets a resets record holds (`SnapshotStore.write_resets`)."""
    try:
        data = json.loads(value)
        resets = data["resets"]
        if not isinstance(resets, dict) or not all(
            isinstance(name, str) and type(offset) is int and offset >= 0
            for name, offset in resets.items()
        ):
            raise ValueError("not a map of producer name to offset")
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptSnapshot(f"not a producer resets record: {exc}") from None
    return dict(resets)


def _parse_key(key: bytes | None) -> _ParsedKey | None:
    """The data partition a key names, if it names one; slot None if only that part is bad."""
    if key is None:
        return None
    try:
        topic, partition_text, slot_text = key.decode("utf-8").rsplit("/", 2)
        check_topic_name(topic)
    except ValueError:
        return None
    if not partition_text.isascii() or not partition_text.isdecimal():
        return None
    partition = int(partition_text)
    if partition > _INT32_MAX or str(partition) != partition_text:
        return None
    if slot_text == "resets":
        return topic, partition, RESETS_SLOT
    slot = int(slot_text) if slot_text in {"0", "1"} else None
    return topic, partition, slot


class SnapshotStore:
    """Writes and reads snapshots in the snapshot topic.

    Blocking librdkafka calls run in threads (`asyncio.to_thread`). One idempotent producer
    (acks=all) is created at the first write and reused; every `read` uses its own consumer
    with explicit assignments (no group membership, no commits).
    """

    def __init__(
        self,
        bootstrap: str,
        topic: str = DEFAULT_TOPIC,
        *,
        partitions: int = 1,
        replication_factor: int | None = None,
        timeout_s: float = 30.0,
        kafka_config: Mapping[str, Any] | None = None,
    ) -> None:
        """``kafka_config``: librdkafka settings added to its clients' (security)."""
        self._kafka_config = dict(kafka_config or {})
        if not bootstrap:
            raise ValueError("bootstrap must not be empty")
        check_topic_name(topic)
        _check_int("partitions", partitions, 1, _INT32_MAX)
        if replication_factor is not None:
            _check_int("replication_factor", replication_factor, 1, 32767)
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, not {timeout_s!r}")
        self._bootstrap = bootstrap
        self._topic = topic
        self._partitions_wanted = partitions
        self._replication_factor = replication_factor
        self._timeout_s = timeout_s
        self._admin: AdminClient | None = None
        self._producer: Producer | None = None
        self._partitions: int | None = None  # the topic's real partition count, once known
        self._last_write_failed = False  # then the next write re-reads the partition count
        self._closed = False
        # Held while `ensure_topic` runs: a write meanwhile waits for the topic to exist
        # instead of failing (a proxy's first snapshot can come before its topic is made).
        self._ensuring = asyncio.Lock()

    @property
    def topic(self) -> str:
        return self._topic

    def _common_config(self) -> dict[str, Any]:
        # Kafka's default auto.create.topics.enable=true would otherwise let a metadata
        # request for the missing topic (even the AdminClient's) create it, uncompacted.
        return {
            "bootstrap.servers": self._bootstrap,
            "client.id": "dedup-snapshots",
            "allow.auto.create.topics": False,
            **self._kafka_config,
        }

    def _admin_client(self) -> AdminClient:
        if self._admin is None:
            self._admin = AdminClient(self._common_config())
        return self._admin

    def _get_producer(self) -> Producer:
        if self._producer is None:
            self._producer = Producer(
                {
                    **self._common_config(),
                    "enable.idempotence": True,
                    "acks": "all",
                    "compression.type": "zstd",
                    "message.max.bytes": MAX_SNAPSHOT_BYTES + _KEY_ROOM,
                    "delivery.timeout.ms": int(self._timeout_s * 1000),
                    "linger.ms": 0,
                }
            )
        return self._producer

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the snapshot store is closed")

    async def ensure_topic(self) -> None:
        """Create the snapshot topic if it is missing; leave an existing one as it is.

        Safe when several proxies start at once: losing the creation race is success.
        """
        self._check_open()
        async with self._ensuring:
            await self._ensure_topic()

    async def _ensure_topic(self) -> None:
        info = await asyncio.to_thread(self._topic_info, False)
        if info.partitions is None:
            replication = self._replication_factor or min(3, info.brokers)
            # A majority must acknowledge, but a two-replica topic stays writable with one
            # broker down.
            min_isr = replication // 2 + 1 if replication >= 3 else 1
            new = NewTopic(
                self._topic,
                num_partitions=self._partitions_wanted,
                replication_factor=replication,
                config={**_TOPIC_CONFIG, "min.insync.replicas": str(min_isr)},
            )
            futures = self._admin_client().create_topics(
                [new], request_timeout=self._timeout_s, operation_timeout=self._timeout_s
            )
            try:
                await asyncio.wait_for(
                    asyncio.wrap_future(futures[self._topic]), self._timeout_s + _GRACE_S
                )
                log.info(
                    "created snapshot topic",
                    snapshot_topic=self._topic,
                    partitions=self._partitions_wanted,
                    replication_factor=replication,
                    min_insync_replicas=min_isr,
                )
            except KafkaException as exc:
                error = _kafka_error(exc)
                if error is None or error.code() != KafkaError.TOPIC_ALREADY_EXISTS:
                    raise SnapshotError(
                        f"could not create snapshot topic {self._topic!r}: {_describe(exc)}"
                    ) from exc
                log.info("snapshot topic was created concurrently", snapshot_topic=self._topic)
            except TimeoutError:
                raise SnapshotError(
                    f"creating snapshot topic {self._topic!r} did not finish within "
                    f"{self._timeout_s}s"
                ) from None
            info = await asyncio.to_thread(self._topic_info, True)
        else:
            await self._warn_unless_compacted()
        assert info.partitions is not None
        self._learn_partitions(info.partitions)

    async def _warn_unless_compacted(self) -> None:
        resource = ConfigResource(ResourceType.TOPIC, self._topic)
        futures = self._admin_client().describe_configs([resource], request_timeout=self._timeout_s)
        try:
            configs = await asyncio.wait_for(
                asyncio.wrap_future(futures[resource]), self._timeout_s + _GRACE_S
            )
        except (KafkaException, TimeoutError) as exc:
            log.warning(
                "could not check the snapshot topic's configuration",
                snapshot_topic=self._topic,
                error=_describe(exc),
            )
            return
        entry = configs.get("cleanup.policy")
        policy = entry.value if entry is not None else None
        if policy != "compact":
            # Without compaction the topic grows forever; with deletion, a partition whose
            # snapshots stop changing loses them after retention.ms.
            log.warning(
                "snapshot topic exists but is not purely compacted; leaving it as it is",
                snapshot_topic=self._topic,
                cleanup_policy=policy,
            )

    def _learn_partitions(self, partitions: int) -> None:
        if self._partitions is not None and self._partitions != partitions:
            log.error(
                "snapshot topic's partition count changed; snapshots placed by the old count "
                "are no longer found",
                snapshot_topic=self._topic,
                was=self._partitions,
                now=partitions,
            )
        elif self._partitions is None and partitions != self._partitions_wanted:
            log.info(
                "snapshot topic exists with another partition count; using it",
                snapshot_topic=self._topic,
                partitions=partitions,
                configured=self._partitions_wanted,
            )
        self._partitions = partitions

    def _topic_info(self, just_created: bool) -> _TopicInfo:
        """Brokers and partition count from metadata (blocking). Transient topic errors are
        retried until the timeout; so is, for a topic ``just_created``, being unknown or
        leaderless: brokers learn of a new topic a moment after the controller created it."""
        admin = self._admin_client()
        deadline = time.monotonic() + self._timeout_s
        while True:
            remaining = max(deadline - time.monotonic(), 0.001)
            try:
                metadata = admin.list_topics(self._topic, timeout=remaining)
            except KafkaException as exc:
                raise SnapshotError(
                    f"could not read metadata of snapshot topic {self._topic!r} from "
                    f"{self._bootstrap}: {_describe(exc)}"
                ) from exc
            found = metadata.topics.get(self._topic)
            brokers = len(metadata.brokers)
            error = found.error if found is not None else None
            problem: str | None = None
            if found is None or (
                error is not None and error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART
            ):
                if not just_created:
                    return _TopicInfo(brokers, None)
                problem = "unknown to the broker"
            elif error is not None:
                problem = f"{error.str()} ({error.name()})"
            elif not found.partitions:
                problem = "no partitions in metadata"
            elif just_created and any(p.leader < 0 for p in found.partitions.values()):
                problem = "partitions without a leader"
            if problem is None and found is not None:
                return _TopicInfo(brokers, len(found.partitions))
            if time.monotonic() >= deadline:
                raise SnapshotError(
                    f"snapshot topic {self._topic!r} is not usable after {self._timeout_s}s: "
                    f"{problem}"
                )
            time.sleep(_RETRY_S)

    async def _partition_count(self, refresh: bool) -> int | None:
        if self._partitions is not None and not refresh:
            return self._partitions
        info = await asyncio.to_thread(self._topic_info, False)
        if info.partitions is not None:
            self._learn_partitions(info.partitions)
        return info.partitions

    async def write(self, snapshot: Snapshot, encoded: bytes | None = None) -> None:
        """Write a snapshot into its slot; returns once Kafka acknowledged it (acks=all).
        ``encoded``: its encoding, when the caller has it already."""
        self._check_open()
        value = snapshot.encode() if encoded is None else encoded
        if len(value) > MAX_SNAPSHOT_BYTES:
            raise SnapshotError(
                f"snapshot of {snapshot.topic}/{snapshot.partition} is {len(value)} bytes, "
                f"over {MAX_SNAPSHOT_BYTES}: cap its producers"
            )
        partitions = await self._partition_count(refresh=self._last_write_failed)
        if partitions is None and self._ensuring.locked():
            async with self._ensuring:  # being created: wait for it, then look again
                partitions = await self._partition_count(refresh=True)
        if partitions is None:
            raise SnapshotError(
                f"snapshot topic {self._topic!r} does not exist (ensure_topic creates it)"
            )
        target = snapshot_partition(snapshot.topic, snapshot.partition, partitions)
        producer = self._get_producer()
        started = time.monotonic()
        self._last_write_failed = True
        error = await asyncio.to_thread(self._produce, producer, snapshot.key, value, target)
        if error is not None:
            if error.fatal() and self._producer is producer:
                # A fatal idempotence error poisons this producer; the next write gets a new one.
                self._producer = None
            raise SnapshotError(
                f"writing the snapshot of {snapshot.topic}/{snapshot.partition} (generation "
                f"{snapshot.generation}) to {self._topic}[{target}] failed: {error.str()} "
                f"({error.name()})"
            )
        self._last_write_failed = False
        log.info(
            "snapshot written",
            topic=snapshot.topic,
            partition=snapshot.partition,
            offset=snapshot.offset,
            generation=snapshot.generation,
            producers=len(snapshot.producers),
            bytes=len(value),
            snapshot_partition=target,
            took_ms=round((time.monotonic() - started) * 1000, 1),
        )

    async def write_resets(self, topic: str, partition: int, resets: Mapping[str, int]) -> None:
        """Record a partition's producer resets (all of them: the key is compacted, the
        latest record counts); returns once Kafka acknowledged it (acks=all)."""
        self._check_open()
        partitions = await self._partition_count(refresh=self._last_write_failed)
        if partitions is None:
            raise SnapshotError(f"snapshot topic {self._topic!r} does not exist")
        target = snapshot_partition(topic, partition, partitions)
        producer = self._get_producer()
        value = json.dumps({"resets": dict(sorted(resets.items()))}).encode()
        error = await asyncio.to_thread(
            self._produce, producer, f"{topic}/{partition}/resets", value, target
        )
        if error is not None:
            raise SnapshotError(
                f"writing the producer resets of {topic}/{partition} to "
                f"{self._topic}[{target}] failed: {error.str()} ({error.name()})"
            )

    def _produce(
        self, producer: Producer, key: str, value: bytes, target: int
    ) -> KafkaError | None:
        """Produce one record and wait for its delivery report (blocking)."""
        done = threading.Event()
        outcome: list[KafkaError | None] = []

        def on_delivery(error: KafkaError | None, _message: Message) -> None:
            outcome.append(error)
            done.set()

        try:
            producer.produce(
                self._topic,
                value=value,
                key=key.encode(),
                partition=target,
                on_delivery=on_delivery,
            )
        except (KafkaException, BufferError) as exc:
            raise SnapshotError(
                f"could not queue the snapshot for {self._topic}[{target}]: {_describe(exc)}"
            ) from exc
        # librdkafka gives up by itself after delivery.timeout.ms and reports why; the grace
        # only guards against that report never coming.
        deadline = time.monotonic() + self._timeout_s + _GRACE_S
        while not done.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise SnapshotError(
                    f"no delivery report for the snapshot to {self._topic}[{target}] within "
                    f"{self._timeout_s + _GRACE_S}s"
                )
            producer.poll(min(remaining, _RETRY_S))  # serves the callbacks of every thread
        return outcome[0]

    async def read(
        self, partitions: Iterable[tuple[str, int]]
    ) -> dict[tuple[str, int], StoredSnapshots]:
        """The snapshots of these data partitions, read up to the end of the snapshot topic.

        Every requested partition is in the result (empty when it has no snapshot, or when
        the snapshot topic does not exist). Raises SnapshotError when Kafka does not answer.
        """
        self._check_open()
        wanted = {
            (check_topic_name(t), _check_int("partition", p, 0, _INT32_MAX)) for t, p in partitions
        }
        result = {key: StoredSnapshots() for key in sorted(wanted)}
        if not wanted:
            return result
        count = await self._partition_count(refresh=True)
        if count is None:
            log.info("no snapshot topic; no snapshots", snapshot_topic=self._topic)
            return result
        homes = {(t, p): snapshot_partition(t, p, count) for t, p in wanted}
        targets = set(homes.values())
        started = time.monotonic()
        records, skipped = await asyncio.to_thread(self._read_partitions, homes)
        valid: dict[tuple[str, int], list[Snapshot]] = {key: [] for key in wanted}
        corrupt: dict[tuple[str, int], list[str]] = {key: [] for key in wanted}
        resets: dict[tuple[str, int], dict[str, int]] = {key: {} for key in wanted}
        for record in sorted(records, key=lambda r: (r.partition, r.offset)):
            topic, partition, slot = record.names
            if record.value is None:  # a tombstone: the slot is empty
                continue
            where = f"{self._topic}[{record.partition}]@{record.offset} key {_show(record.key)}"
            if slot == RESETS_SLOT:
                try:
                    resets[topic, partition] = decode_resets(record.value)
                except CorruptSnapshot as exc:  # nothing to fall back to: say it loudly
                    corrupt[topic, partition].append(f"{where}: {exc}")
                    log.error("corrupt producer resets record", where=where, reason=str(exc))
                continue
            try:
                if slot is None:
                    raise CorruptSnapshot("the key's slot is not 0 or 1")
                snapshot = Snapshot.decode(record.value)
                if (snapshot.topic, snapshot.partition) != (topic, partition):
                    raise CorruptSnapshot(
                        f"holds the snapshot of {snapshot.topic}/{snapshot.partition}"
                    )
                if snapshot.generation % 2 != slot:
                    raise CorruptSnapshot(f"holds generation {snapshot.generation} in slot {slot}")
            except CorruptSnapshot as exc:
                corrupt[topic, partition].append(f"{where}: {exc}")
                log.warning(
                    "corrupt snapshot record",
                    topic=topic,
                    partition=partition,
                    snapshot_partition=record.partition,
                    snapshot_offset=record.offset,
                    reason=str(exc),
                )
                continue
            valid[topic, partition].append(snapshot)
        if skipped:
            log.warning(
                "snapshot records skipped",
                snapshot_topic=self._topic,
                count=len(skipped),
                records=skipped[:_SHOW_SKIPPED],
            )
        for key in result:
            result[key] = StoredSnapshots(
                valid=tuple(
                    sorted(valid[key], key=lambda s: (s.offset, s.generation), reverse=True)
                ),
                corrupt=tuple(corrupt[key]),
                resets=resets[key],
            )
        log.info(
            "snapshots read",
            snapshot_topic=self._topic,
            data_partitions=len(wanted),
            snapshot_partitions=sorted(targets),
            found=sum(len(s.valid) for s in result.values()),
            corrupt=sum(len(s.corrupt) for s in result.values()),
            took_ms=round((time.monotonic() - started) * 1000, 1),
        )
        return result

    def _read_partitions(
        self, homes: Mapping[tuple[str, int], int]
    ) -> tuple[list[_Record], list[str]]:
        """The last record of every key naming a wanted data partition, read in the partition
        where such keys live (``homes``) from its beginning to its end; and why records were
        skipped: their key names no data partition, or they are not in their key's partition
        (whose order with the records there is unknown) (blocking)."""
        deadline = time.monotonic() + self._timeout_s
        consumer = Consumer(
            {
                **self._common_config(),
                "group.id": "dedup-snapshot-reader",
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                "enable.partition.eof": True,
                # An end the records do not reach (transaction markers, compacted tail) shows
                # only after an empty fetch: make that fetch short.
                "fetch.wait.max.ms": 100,
                "auto.offset.reset": "earliest",
                "fetch.message.max.bytes": MAX_SNAPSHOT_BYTES + _KEY_ROOM,
            }
        )
        last: dict[bytes, _Record] = {}
        skipped: list[str] = []
        try:
            ends: dict[int, int] = {}  # partition -> high watermark, where there are records
            for target in sorted(set(homes.values())):
                low, high = self._watermarks(consumer, target, deadline)
                if high > low:
                    ends[target] = high
            if ends:
                consumer.assign([TopicPartition(self._topic, p, OFFSET_BEGINNING) for p in ends])
            pending = set(ends)
            last_error: str | None = None
            while pending:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise SnapshotError(
                        f"reading {self._topic} partitions {sorted(pending)} did not reach their "
                        f"end within {self._timeout_s}s"
                        + (f" (last error: {last_error})" if last_error else "")
                    )
                # poll, not consume: consume(n, timeout) waits the whole timeout for n records.
                message = consumer.poll(min(remaining, 0.5))
                if message is None:
                    continue
                partition, offset = message.partition(), message.offset()
                error = message.error()
                if error is not None:
                    if error.code() == KafkaError._PARTITION_EOF and partition is not None:
                        # The end, even when compaction removed the records before it.
                        pending.discard(partition)
                        continue
                    if error.fatal():
                        raise SnapshotError(
                            f"reading {self._topic} failed: {error.str()} ({error.name()})"
                        )
                    last_error = f"{error.str()} ({error.name()})"
                    log.warning("snapshot topic read error; retrying", error=last_error)
                    continue
                assert partition is not None and offset is not None
                key = message.key()
                names = _parse_key(key)
                where = f"{partition}@{offset} key {_show(key)}"
                if key is None or names is None:
                    skipped.append(f"{where}: names no data partition")
                elif (home := homes.get(names[:2])) is None:
                    pass  # another data partition's snapshot
                elif home != partition:
                    skipped.append(f"{where}: belongs in partition {home}")
                else:
                    last[key] = _Record(partition, offset, key, names, message.value())
                if offset + 1 >= ends[partition]:
                    pending.discard(partition)
        finally:
            consumer.close()
        return list(last.values()), skipped

    def _watermarks(self, consumer: Consumer, partition: int, deadline: float) -> tuple[int, int]:
        # A partition whose leader just moved (or was just created) refuses ListOffsets for a
        # moment: retried until the deadline.
        while True:
            remaining = deadline - time.monotonic()
            try:
                low, high = consumer.get_watermark_offsets(
                    TopicPartition(self._topic, partition), timeout=max(min(remaining, 5.0), 0.001)
                )
                return int(low), int(high)
            except KafkaException as exc:
                if time.monotonic() + _RETRY_S >= deadline:
                    raise SnapshotError(
                        f"could not read the offsets of {self._topic}[{partition}]: "
                        f"{_describe(exc)}"
                    ) from exc
                time.sleep(_RETRY_S)

    async def close(self) -> None:
        """Wait for writes still in flight (up to the timeout), then release the clients."""
        if self._closed:
            return
        self._closed = True
        producer, self._producer = self._producer, None
        self._admin = None
        if producer is not None:
            left = await asyncio.to_thread(producer.flush, self._timeout_s)
            if left:
                log.warning("snapshot writes not delivered at close", undelivered=left)


def _kafka_error(exc: KafkaException) -> KafkaError | None:
    error = exc.args[0] if exc.args else None
    return error if isinstance(error, KafkaError) else None


def _describe(exc: BaseException) -> str:
    if isinstance(exc, KafkaException) and (error := _kafka_error(exc)) is not None:
        return f"{error.str()} ({error.name()})"
    return str(exc) or type(exc).__name__

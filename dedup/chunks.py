"""Chunked messages (Pulsar's PIP-37) with dedup per chunk (the chunk-dedup PIP): the header
names, their parsing, the proxy's chunk rule, splitting, and reassembly.

A message larger than a record may be (``max.message.bytes``) is sent as chunks, one record
each, in order, to one partition. Every chunk carries the message's dedup identity
(``dedup.producer`` / ``dedup.sequence``: the SAME sequence for every chunk) and four more
headers, all ASCII decimal except the uuid:

- ``dedup.uuid``: the message's id, UTF-8, non-empty, at most `MAX_UUID_BYTES` bytes
  (`DedupProducer` uses ``<producer>-<sequence>``, as Pulsar does, so a restarted producer
  re-sends a message under the same uuid);
- ``dedup.chunk.id``: 0 .. count-1;
- ``dedup.chunk.count``: 1 .. `MAX_CHUNK_COUNT`;
- ``dedup.total.size``: the message's size in bytes (the chunks' values add up to it),
  0 .. `MAX_TOTAL_SIZE`.

The proxy checks (sequence, chunk id) instead of the sequence alone (`accept_chunk` is the
rule; ``dedup/lua/check.lua`` runs it atomically in Redis): a chunk's position is
(sequence, chunk id), a record without chunk headers is at (sequence, `LAST`), and positions
are compared as pairs. So chunk 2 is new after chunk 1 of the same sequence, a re-sent chunk
is a duplicate, and a sequence counts as persisted only once its last chunk is.

Everything here is pure (no I/O besides structlog), so a Spark job can reuse `Reassembler`
inside ``applyInPandasWithState``; `dedup.chunked_consumer` wraps it around a confluent-kafka
Consumer.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

import structlog

from dedup.identity import INT64_DIGITS

log = structlog.get_logger(__name__)

HEADER_UUID: Final = "dedup.uuid"
HEADER_CHUNK_ID: Final = "dedup.chunk.id"
HEADER_CHUNK_COUNT: Final = "dedup.chunk.count"
HEADER_TOTAL_SIZE: Final = "dedup.total.size"
CHUNK_HEADERS: Final = (HEADER_UUID, HEADER_CHUNK_ID, HEADER_CHUNK_COUNT, HEADER_TOTAL_SIZE)

MAX_UUID_BYTES: Final = 1024
MAX_CHUNK_COUNT: Final = (1 << 31) - 1
MAX_TOTAL_SIZE: Final = (1 << 53) - 1  # exact in the Lua numbers of the check
LAST: Final = 1 << 31  # the chunk position of a whole record: after every chunk

_MAX_DIGITS: Final = INT64_DIGITS  # every bound below fits an int64; caps int()'s work


class ChunkError(ValueError):
    """Chunk headers, or a chunk, that must be refused; the message says why."""


class ChunkGap(ChunkError):
    """A chunk that skips ahead: the chunk before it may still come (retriable)."""


@dataclass(frozen=True, slots=True)
class ChunkMeta:
    """What a record's chunk headers say."""

    uuid: str
    chunk_id: int
    chunk_count: int
    total_size: int

    @property
    def last(self) -> bool:
        return self.chunk_id == self.chunk_count - 1


def _decimal(raw: bytes | None, name: str, low: int, high: int) -> int:
    # Not `dedup.identity.parse_sequence`: these counts take no sign, and a shorter cap.
    if raw is None:
        raise ChunkError(f"has a null {name}")
    if not raw.isdigit() or len(raw) > _MAX_DIGITS or not raw.isascii():
        raise ChunkError(f"has a {name} that is not a decimal number: {raw[:40]!r}")
    value = int(raw)
    if not low <= value <= high:
        raise ChunkError(f"has {name} {value}, outside [{low}, {high}]")
    return value


def parse_chunk_headers(headers: Iterable[tuple[str, bytes | None]] | None) -> ChunkMeta | None:
    """The chunk headers of one record's (name, value) headers (confluent-kafka's
    ``message.headers()``, kafka-python's, or the proxy's), None when it has none of them.
    Raises `ChunkError` when some are there but not all, or one is invalid (as the proxy
    refuses it); the last occurrence of a name counts, as for the identity headers."""
    found: dict[str, bytes | None] = {}
    for name, value in headers or ():
        if name in CHUNK_HEADERS:
            found[name] = value
    if not found:
        return None
    missing = [name for name in CHUNK_HEADERS if name not in found]
    if missing:
        raise ChunkError(f"has {', '.join(sorted(found))} but no {', '.join(missing)}")
    raw_uuid = found[HEADER_UUID]
    if not raw_uuid:
        raise ChunkError(f"has {'a null' if raw_uuid is None else 'an empty'} {HEADER_UUID}")
    if len(raw_uuid) > MAX_UUID_BYTES:
        raise ChunkError(f"has a {HEADER_UUID} of {len(raw_uuid)} bytes, over {MAX_UUID_BYTES}")
    try:
        uuid = raw_uuid.decode("utf-8")
    except UnicodeDecodeError:
        raise ChunkError(f"has a {HEADER_UUID} that is not UTF-8: {raw_uuid[:40]!r}") from None
    count = _decimal(found[HEADER_CHUNK_COUNT], HEADER_CHUNK_COUNT, 1, MAX_CHUNK_COUNT)
    chunk_id = _decimal(found[HEADER_CHUNK_ID], HEADER_CHUNK_ID, 0, MAX_CHUNK_COUNT)
    if chunk_id >= count:
        raise ChunkError(
            f"has {HEADER_CHUNK_ID} {chunk_id}, beyond its {HEADER_CHUNK_COUNT} {count}"
        )
    total = _decimal(found[HEADER_TOTAL_SIZE], HEADER_TOTAL_SIZE, 0, MAX_TOTAL_SIZE)
    return ChunkMeta(uuid, chunk_id, count, total)


def chunk_headers(meta: ChunkMeta) -> list[tuple[str, bytes]]:
    """The four headers of one chunk."""
    return [
        (HEADER_UUID, meta.uuid.encode("utf-8")),
        (HEADER_CHUNK_ID, str(meta.chunk_id).encode()),
        (HEADER_CHUNK_COUNT, str(meta.chunk_count).encode()),
        (HEADER_TOTAL_SIZE, str(meta.total_size).encode()),
    ]


def split_payload(value: bytes, chunk_size: int) -> list[bytes]:
    """``value`` in chunks of ``chunk_size`` bytes (the last one shorter); at least one."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, not {chunk_size}")
    return [value[i : i + chunk_size] for i in range(0, len(value), chunk_size)] or [b""]


# --------------------------------------------------------------------------- the check's rule


@dataclass(frozen=True, slots=True)
class ChunkProgress:
    """A chunked message in progress for one producer on one partition: its chunks
    0..chunk_id are accepted (pushed) or acknowledged (persisted); never the last one."""

    sequence: int
    uuid: str
    chunk_id: int
    chunk_count: int
    total_size: int
    size: int  # bytes of chunks 0..chunk_id

    def __post_init__(self) -> None:
        for name, value, low, high in (
            ("sequence", self.sequence, -(1 << 63), (1 << 63) - 1),
            ("chunk_count", self.chunk_count, 2, MAX_CHUNK_COUNT),
            ("chunk_id", self.chunk_id, 0, self.chunk_count - 2),
            ("total_size", self.total_size, 0, MAX_TOTAL_SIZE),
            ("size", self.size, 0, self.total_size),
        ):
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an integer, not {value!r}")
            if not low <= value <= high:
                raise ValueError(f"{name} {value} is outside [{low}, {high}]")
        if not isinstance(self.uuid, str) or not self.uuid:
            raise ValueError(f"uuid must be a non-empty string, not {self.uuid!r}")
        if len(self.uuid.encode("utf-8", "surrogatepass")) > MAX_UUID_BYTES:
            raise ValueError(f"uuid is longer than {MAX_UUID_BYTES} bytes")

    @property
    def position(self) -> tuple[int, int]:
        return self.sequence, self.chunk_id

    def encode(self) -> str:
        """The form the Redis state keeps (``dedup/lua/check.lua`` reads it): the numbers,
        then the uuid (which may hold spaces) to the end."""
        return (
            f"{self.sequence} {self.chunk_id} {self.chunk_count} {self.total_size} "
            f"{self.size} {self.uuid}"
        )

    @classmethod
    def decode(cls, text: str) -> ChunkProgress:
        sequence, chunk_id, count, total, size, uuid = text.split(" ", 5)
        return cls(int(sequence), uuid, int(chunk_id), int(count), int(total), int(size))


def position(sequence: int, meta: ChunkMeta | None) -> tuple[int, int]:
    """Where a record stands among a producer's records: chunks of a sequence come before
    the sequence is complete (a whole record, or the last chunk)."""
    if meta is None or meta.last:
        return sequence, LAST
    return sequence, meta.chunk_id


def accept_chunk(
    current: ChunkProgress | None, sequence: int, meta: ChunkMeta, size: int
) -> ChunkProgress | None:
    """The proxy's rule for a chunk above the producer's pushed position (which would be
    NotDup): the producer's message in progress afterwards (None: this chunk completed it),
    or `ChunkError` (the partition batch is refused with INVALID_RECORD, nothing written;
    a skip ahead is refused as not written and retriable instead, see below):

    - it continues the message in progress (same sequence): same uuid, count and total
      size, and exactly the next chunk id (a skipped chunk could never be reassembled; but
      the chunk before may still come, in a pipelined request that was refused while its
      partition recovered, or that is being retried, so the client is told to retry);
    - else it starts a message: chunk id 0 (likewise retriable). A new sequence while
      another message is incomplete abandons that one (the producer moved on; its re-sends
      are duplicates now, consumers drop its chunks), as a newer sequence always wins;
    - the chunks' sizes never exceed the total, and the last chunk makes it exact.
    """
    # The messages are the Lua check's, word for word (tests compare them).
    where = f"chunk {meta.chunk_id} of message {meta.uuid} (sequence {sequence})"
    size_so_far = 0
    if current is not None and current.sequence == sequence:
        check_consistent(current, sequence, meta)
        if meta.chunk_id != current.chunk_id + 1:
            raise ChunkGap(f"{where} skips ahead: the next chunk is {current.chunk_id + 1}")
        size_so_far = current.size
    elif meta.chunk_id != 0:
        raise ChunkGap(f"{where} skips ahead: the message's chunk 0 was never accepted")
    total = size_so_far + size
    if total > meta.total_size:
        raise ChunkError(
            f"{where} brings the message to {total} bytes, over its total size {meta.total_size}"
        )
    if meta.last:
        if total != meta.total_size:
            raise ChunkError(
                f"{where} is the last, but the chunks add up to {total} bytes, not the total "
                f"size {meta.total_size}"
            )
        return None
    return ChunkProgress(
        sequence, meta.uuid, meta.chunk_id, meta.chunk_count, meta.total_size, total
    )


def check_consistent(current: ChunkProgress | None, sequence: int, meta: ChunkMeta) -> None:
    """Every chunk of the message in progress, new or re-sent, says the same uuid, count
    and total size."""
    if current is None or current.sequence != sequence:
        return
    if (meta.uuid, meta.chunk_count, meta.total_size) != (
        current.uuid,
        current.chunk_count,
        current.total_size,
    ):
        raise ChunkError(
            f"chunk {meta.chunk_id} of message {meta.uuid} (sequence {sequence}) says uuid "
            f"{meta.uuid}, {meta.chunk_count} chunks, {meta.total_size} bytes, but its chunks "
            f"so far say uuid {current.uuid}, {current.chunk_count} chunks, "
            f"{current.total_size} bytes"
        )


def accept_whole(current: ChunkProgress | None, sequence: int) -> None:
    """The rule for a record without chunk headers above the pushed position: its sequence
    must not be that of the message in progress (one message, sent whole and chunked)."""
    if current is not None and current.sequence == sequence:
        raise ChunkError(
            f"a record without chunk headers has sequence {sequence}, which is the chunked "
            f"message {current.uuid} in progress (chunk {current.chunk_id} of "
            f"{current.chunk_count} accepted)"
        )


# --------------------------------------------------------------------------- reassembly

DEFAULT_MAX_BUFFER_BYTES: Final = 256 * 1024 * 1024
DEFAULT_EXPIRE_AFTER_MS: Final = 60_000


@dataclass(frozen=True, slots=True)
class AssembledMessage:
    """One complete chunked message."""

    producer: str
    sequence: int
    uuid: str
    value: bytes
    chunk_count: int
    partition: int = 0
    contexts: tuple[Any, ...] = ()  # what `add` was given per chunk, in chunk order


@dataclass(frozen=True, slots=True)
class PendingMessage:
    """An incomplete message in the buffer (for commits: its first context)."""

    partition: int
    producer: str
    sequence: int
    uuid: str
    chunk_count: int
    received: int
    size: int
    first_seen_ms: int
    first_context: Any


@dataclass(slots=True)
class ReassemblyStats:
    completed: int = 0
    duplicates: int = 0  # chunks already buffered, or of a sequence already complete
    expired: int = 0  # incomplete messages older than expire_after_ms
    evicted: int = 0  # incomplete messages dropped to keep the buffer under its bound
    abandoned: int = 0  # incomplete messages whose producer completed a later sequence
    inconsistent: int = 0  # chunks that contradict their message (uuid, count, sizes)
    too_large: int = 0  # messages larger than the whole buffer


@dataclass(slots=True)
class _Partial:
    uuid: str
    chunk_count: int
    total_size: int
    first_seen_ms: int
    chunks: dict[int, bytes] = field(default_factory=dict)
    contexts: dict[int, Any] = field(default_factory=dict)
    size: int = 0


_Key = tuple[int, str, int]  # partition, producer, sequence


class Reassembler:
    """Chunks in, complete messages out; a bounded buffer in between.

    Feed every chunk with `add` (in partition order). A chunk that completes its message
    returns it; otherwise None. Tolerated and counted (see `stats`), never fatal:

    - duplicates: a chunk already buffered, or of a sequence the producer already completed
      on that partition (sequences of a producer increase, the proxy keeps them in order);
    - chunks that contradict their message (another uuid, count or total for the same
      sequence, sizes over the total): the partial message is dropped (another uuid, count
      or total starts it anew from this chunk);
    - an incomplete message is dropped when its producer completes a later sequence on the
      partition (abandoned: the proxy never writes its missing chunks any more), when it is
      older than ``expire_after_ms`` (expired), or when the buffer would exceed
      ``max_buffer_bytes`` (evicted, oldest first). A message larger than the whole buffer
      is dropped at once (too_large).

    Each drop is logged (structlog, with producer, sequence, uuid and chunks received).
    ``now_ms`` defaults to the wall clock; pass it for deterministic use (tests, Spark's
    processing time).
    """

    def __init__(
        self,
        max_buffer_bytes: int = DEFAULT_MAX_BUFFER_BYTES,
        expire_after_ms: int = DEFAULT_EXPIRE_AFTER_MS,
    ) -> None:
        if max_buffer_bytes < 1:
            raise ValueError(f"max_buffer_bytes must be at least 1, not {max_buffer_bytes}")
        if expire_after_ms < 1:
            raise ValueError(f"expire_after_ms must be at least 1, not {expire_after_ms}")
        self.max_buffer_bytes = max_buffer_bytes
        self.expire_after_ms = expire_after_ms
        self.stats = ReassemblyStats()
        self._partials: dict[_Key, _Partial] = {}  # insertion order = age order
        self._completed: dict[tuple[int, str], int] = {}  # highest complete sequence
        self._buffered = 0

    @property
    def buffered_bytes(self) -> int:
        return self._buffered

    def add(
        self,
        producer: str,
        sequence: int,
        uuid: str,
        chunk_id: int,
        chunk_count: int,
        total_size: int,
        payload: bytes,
        *,
        partition: int = 0,
        now_ms: int | None = None,
        context: Any = None,
    ) -> AssembledMessage | None:
        """Take one chunk; the message when this chunk completes it."""
        now = _now(now_ms)
        self.expire(now)
        key = (partition, producer, sequence)
        where = {"partition": partition, "producer": producer, "sequence": sequence, "uuid": uuid}
        done = self._completed.get(key[:2])
        if done is not None and sequence <= done:
            self.stats.duplicates += 1
            return None
        if not 0 <= chunk_id < chunk_count or len(payload) > total_size:
            self._inconsistent(key, where, f"chunk {chunk_id} of {chunk_count}, {len(payload)} B")
            return None
        partial = self._partials.get(key)
        if partial is not None and (partial.uuid, partial.chunk_count, partial.total_size) != (
            uuid,
            chunk_count,
            total_size,
        ):
            self._inconsistent(key, where, "uuid, chunk count or total size changed")
            partial = None
        if partial is None:
            if total_size > self.max_buffer_bytes:
                self.stats.too_large += 1
                log.warning(
                    "chunked message larger than the buffer dropped",
                    total_size=total_size,
                    max_buffer_bytes=self.max_buffer_bytes,
                    **where,
                )
                return None
            partial = self._partials[key] = _Partial(uuid, chunk_count, total_size, now)
        if chunk_id in partial.chunks:
            self.stats.duplicates += 1
            return None
        if partial.size + len(payload) > total_size:
            self._inconsistent(key, where, "chunk sizes exceed the total size")
            return None
        partial.chunks[chunk_id] = payload
        partial.contexts[chunk_id] = context
        partial.size += len(payload)
        self._buffered += len(payload)
        if len(partial.chunks) < chunk_count:
            self._bound(keep=key)
            return None
        del self._partials[key]
        self._buffered -= partial.size
        if partial.size != total_size:
            self.stats.inconsistent += 1
            log.warning(
                "chunked message dropped: its chunks do not add up to its total size",
                size=partial.size,
                total_size=total_size,
                **where,
            )
            return None
        self._complete(partition, producer, sequence)
        self.stats.completed += 1
        return AssembledMessage(
            producer,
            sequence,
            uuid,
            b"".join(partial.chunks[i] for i in range(chunk_count)),
            chunk_count,
            partition,
            tuple(partial.contexts[i] for i in range(chunk_count)),
        )

    def add_whole(self, producer: str, sequence: int, *, partition: int = 0) -> bool:
        """A record without chunk headers of this producer: counts as its sequence complete
        (incomplete earlier messages are abandoned). False when it is a duplicate."""
        done = self._completed.get((partition, producer))
        if done is not None and sequence <= done:
            self.stats.duplicates += 1
            return False
        self._complete(partition, producer, sequence)
        return True

    def expire(self, now_ms: int | None = None) -> list[PendingMessage]:
        """Drop the incomplete messages older than ``expire_after_ms``; those dropped."""
        now = _now(now_ms)
        dropped = []
        for key, partial in list(self._partials.items()):
            if now - partial.first_seen_ms < self.expire_after_ms:
                break  # insertion order is age order
            dropped.append(self._drop(key, "expired"))
        return dropped

    def pending(self) -> Iterator[PendingMessage]:
        """The incomplete messages, oldest first."""
        for key, partial in self._partials.items():
            yield _pending(key, partial)

    def _complete(self, partition: int, producer: str, sequence: int) -> None:
        self._completed[(partition, producer)] = sequence
        for key in [
            k for k in self._partials if k[:2] == (partition, producer) and k[2] < sequence
        ]:
            self._drop(key, "abandoned")

    def _bound(self, keep: _Key) -> None:
        for key in list(self._partials):
            if self._buffered <= self.max_buffer_bytes:
                return
            if key != keep:
                self._drop(key, "evicted")
        if self._buffered > self.max_buffer_bytes:
            self._drop(keep, "evicted")

    def _inconsistent(self, key: _Key, where: dict[str, Any], why: str) -> None:
        self.stats.inconsistent += 1
        log.warning("inconsistent chunk", why=why, **where)
        if key in self._partials:
            self._drop(key, None)

    def _drop(self, key: _Key, reason: str | None) -> PendingMessage:
        partial = self._partials.pop(key)
        self._buffered -= partial.size
        pending = _pending(key, partial)
        if reason is not None:
            setattr(self.stats, reason, getattr(self.stats, reason) + 1)
            log.warning(
                f"incomplete chunked message {reason}",
                partition=key[0],
                producer=key[1],
                sequence=key[2],
                uuid=partial.uuid,
                received=len(partial.chunks),
                chunk_count=partial.chunk_count,
                size=partial.size,
                total_size=partial.total_size,
            )
        return pending


def _pending(key: _Key, partial: _Partial) -> PendingMessage:
    first = min(partial.contexts) if partial.contexts else None
    return PendingMessage(
        partition=key[0],
        producer=key[1],
        sequence=key[2],
        uuid=partial.uuid,
        chunk_count=partial.chunk_count,
        received=len(partial.chunks),
        size=partial.size,
        first_seen_ms=partial.first_seen_ms,
        first_context=None if first is None else partial.contexts[first],
    )


def _now(now_ms: int | None) -> int:
    return int(time.time() * 1000) if now_ms is None else now_ms

"""Tail replay: rebuild a partition's ``persisted`` map (the highest sequence per producer) by
reading the partition's log from an offset to an end.

Every record the proxy writes carries its identity in two headers (`dedup.batches`: producer
name, UTF-8, non-empty; sequence, a signed 64-bit integer as ASCII decimal, as Java's
``Long.parseLong`` reads it). So after a crash the records Kafka acknowledged but Redis never
heard of are found in the log itself: read ``[start, end)``, keep per producer the highest
sequence and the newest record timestamp.

How the log is read:

- confluent-kafka's `Consumer` with `assign` (no group membership, no commits; librdkafka
  wants a ``group.id`` all the same), ``isolation.level=read_committed`` up to the last
  stable offset, and a second one, ``read_uncommitted``, from there to the end. So a record
  of a transaction aborted before the replay began does not count: its sequence is not in
  the log for a read_committed consumer, and a re-send of it outside a transaction is
  written. (Counted, as before this split, it read as persisted and the re-send was dropped
  while acknowledged: lost. The proxy forwards transactional requests unchecked, so such an
  identity is in no state on the produce path either.) A transaction open below the end
  holds the last stable offset back; a recovery waits for it to end before it replays
  (`dedup.open_transactions`). Past a last stable offset still below the end, a
  read_committed reader would stop short of the proxy's own later writes (its batches are
  never transactional): there, records of the transactions still open count like any other,
  as a consumer cannot tell them apart (`ReplayResult.uncommitted_from`). Control records
  (transaction markers) are never handed to a consumer. The proxy's own batches are plain
  idempotent ones, which neither isolation level ever skips, whatever its fence's aborted
  transactions (librdkafka and Kafka's Java consumer skip only batches marked
  transactional).
- ``end`` is the caller's: the high watermark as a read_uncommitted client sees it
  (librdkafka's default read_committed reports the last stable offset as "high").
- Offsets are not contiguous (compaction, transaction markers), so the end is found by
  position, never by counting records: the replay is complete when a record at offset
  ``>= end - 1`` was seen or the consumer reports partition EOF at an offset ``>= end``.
- A start below the log start offset (retention, ``DeleteRecords``) begins at the log start
  and says so (`ReplayResult.truncated_start`); so does a log start that moves past the
  replay while it reads (``auto.offset.reset=error`` surfaces it instead of a silent jump).
- Chunked messages (`dedup.chunks`): a chunk that is not its message's last does not raise
  the producer's sequence (a sequence counts once its last chunk is in); the fold follows the
  message in progress instead (`ReplayResult.chunks`: sequence, chunk id, bytes so far),
  continuing the one the snapshot held (``chunks``), so that a proxy that died in the middle
  of a chunked message recovers exactly where the log stands. The log holds only what the
  check accepted, so chunks follow each other there; a chunk that does not follow (written
  around the proxy) still moves the position, its bytes counted from it on. Reading the
  headers of a record with more than two of them looks for chunk headers; a chunk's value
  is measured (``len``), nothing else of it is read.
- Near the end (the last `RUNS_WINDOW` offsets) the fold also follows each producer's runs:
  consecutive sequences at consecutive offsets, of one log append time (`Fold.runs`, its
  latest 5). A batch written before a crash and never answered is in them, so its re-send
  is answered with its original's offset (`dedup.recent_appends`). A chunked message's
  records are in none: its chunks share its sequence.
- Identity rules are `dedup.batches`'s for records read from a log: the last occurrence of a
  header name counts; a record without both headers, with a null or empty or non-UTF-8
  producer, or with a sequence `dedup.identity.parse_sequence` refuses (not an int64 in
  decimal, or over 64 bytes: the proxy never wrote such a record) is skipped and counted.
  Implicit identities need no rule here: the proxy writes them into the forwarded records as
  the same two headers.

Speed (measured with ``benchmarks/recovery.py``, see benchmarks/README.md): librdkafka's
consume and the conversion of each message's headers to Python take most of the time; the
Python loop (`Fold.add`) is a forward scan of the header list with a fast path for exactly
two headers (faster than ``dict(headers)``, a reverse scan or a regular expression), the
sequence rule inlined (``bytes.isdigit`` + ``int``), and producer names kept as bytes, decoded
once per distinct name. ``consume()`` is called for small batches without waiting (100 messages
measured fastest; a call for a batch that cannot fill waits out its timeout), and the fetch
settings (`CONSUMER_SETTINGS`) avoid librdkafka's 1 s fetch back-off, which made a 1M-record
replay about 5x slower with the defaults.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from confluent_kafka import (
    TIMESTAMP_LOG_APPEND_TIME,
    Consumer,
    KafkaError,
    KafkaException,
    TopicPartition,
)

from dedup.batches import DEFAULT_HEADERS, IdentityHeaders
from dedup.chunks import CHUNK_HEADERS, ChunkError, ChunkProgress, parse_chunk_headers
from dedup.identity import INT64_MAX, INT64_MIN, MAX_SEQUENCE_TEXT
from dedup.identity import parse_sequence as parse_sequence  # part of this module's API
from dedup.recent_appends import BATCHES_PER_PRODUCER

GROUP_ID: Final = "dedup-proxy-replay"
CONSUME_BATCH: Final = 100  # messages per consume() call (measured fastest, see above)
POLL_TIMEOUT_S: Final = 0.2
PROGRESS_INTERVAL_S: Final = 0.5

SEQUENCE_MIN: Final = INT64_MIN
SEQUENCE_MAX: Final = INT64_MAX
_NO_SEQUENCE: Final = SEQUENCE_MIN - 1  # a producer seen only in chunks of an incomplete message
_CHUNK_NAMES: Final = frozenset(CHUNK_HEADERS)
# The last offsets of a replay in which each producer's runs are followed (`Fold.runs`): a
# second of a busy partition's traffic, the writes a crash can leave unanswered among them.
RUNS_WINDOW: Final = 100_000
_LOG_APPEND_TIME: Final = TIMESTAMP_LOG_APPEND_TIME  # a record's timestamp is its batch's append

# Fetch settings for reading one partition fast (measured, see benchmarks/README.md):
# fetches of several MB, and a small pre-fetch queue refilled at once (librdkafka's default
# `fetch.queue.backoff.ms` of 1 s idles the fetcher each time the queue was full, which with
# the default queue sizes made a 1M-record replay 4-5x slower). `config` beats these.
CONSUMER_SETTINGS: Final[Mapping[str, str | int | bool]] = {
    "group.id": GROUP_ID,
    "enable.auto.commit": False,
    "enable.auto.offset.store": False,
    "enable.partition.eof": True,
    "isolation.level": "read_committed",  # up to the last stable offset; past it, uncommitted
    "auto.offset.reset": "error",
    "fetch.max.bytes": 50 * 1024 * 1024,
    "max.partition.fetch.bytes": 8 * 1024 * 1024,
    "fetch.wait.max.ms": 50,
    "fetch.queue.backoff.ms": 10,
    "queued.min.messages": 20_000,
    "queued.max.messages.kbytes": 32 * 1024,
    "check.crcs": False,
}


class ReplayError(Exception):
    """The partition could not be read to the requested end."""


@dataclass(frozen=True, slots=True)
class ReplayResult:
    topic: str
    partition: int
    start: int  # the first offset actually read from (> the requested start when truncated)
    end: int  # exclusive: every record below `end` that exists was read
    highest: dict[str, tuple[int, int]]  # producer -> (highest sequence, last seen ms)
    records: int  # records read
    identified: int  # records with a valid identity
    skipped: int  # records without identity or with a bad one
    truncated_start: bool  # the requested start was below the log start offset
    seconds: float
    # producer -> (its chunked message in progress at the end, last seen ms); only messages
    # above the producer's highest complete sequence in the replay
    chunks: dict[str, tuple[ChunkProgress, int]] = field(default_factory=dict)
    # producer -> its latest runs in the replay (`Fold.runs`), the newest last: (first
    # sequence, records, first offset, log append time or -1)
    runs: dict[str, list[tuple[int, int, int, int]]] = field(default_factory=dict)
    # The last stable offset when it was below `end`: records from there on were read
    # uncommitted (a transaction open when the replay asked counts); None: all committed.
    uncommitted_from: int | None = None


def parse_producer(raw: bytes | None) -> str | None:
    """The producer a header value names, or None when it is null, empty or not UTF-8."""
    if not raw:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def record_identity(
    headers: Iterable[tuple[str, bytes | None]] | None, names: IdentityHeaders = DEFAULT_HEADERS
) -> tuple[str, int] | None:
    """(producer, sequence) of one record's headers, or None (the rule of the fold below, one
    record at a time: the reference the fold is tested against)."""
    if not headers:
        return None
    last = dict(headers)
    producer = parse_producer(last.get(names.producer))
    sequence = parse_sequence(last.get(names.sequence))
    if producer is None or sequence is None:
        return None
    return producer, sequence


class Fold:
    """The replay's running state: consumer messages in, highest sequence per producer out.

    `add` takes the messages of one ``consume()`` call; it is the replay's hot loop, so the
    identity rules of `record_identity` are inlined there (and kept equal by the tests:
    tests/unit/test_replay.py, and tests/unit/test_identity.py for the sequence rule).
    """

    __slots__ = (
        "_bad_names",
        "_chunks",
        "_earlier",
        "_entries",
        "_names",
        "_producer",
        "_runs_from",
        "_sequence",
        "end",
        "events",
        "last_offset",
        "records",
        "skipped",
    )

    def __init__(
        self,
        end: int,
        names: IdentityHeaders = DEFAULT_HEADERS,
        chunks: Mapping[str, ChunkProgress] | None = None,
        runs_window: int = RUNS_WINDOW,
    ) -> None:
        self.end = end
        self._runs_from = end - runs_window
        self._producer = names.producer
        self._sequence = names.sequence
        # raw producer name -> [highest complete sequence, max timestamp, and its latest run:
        # first sequence, first offset, records (0: none), log append time]; decoded names
        # alongside. A producer seen only in chunks has _NO_SEQUENCE.
        self._entries: dict[bytes, list[int]] = {}
        self._names: dict[bytes, str] = {}
        # raw producer name -> the runs before its latest, the newest last (Kafka's broker
        # keeps a producer's last 5 batches: `dedup.recent_appends`)
        self._earlier: dict[bytes, deque[tuple[int, int, int, int]]] = {}
        # raw producer name -> its chunked message in progress (from the snapshot: `chunks`)
        self._chunks: dict[bytes, ChunkProgress] = {
            name.encode("utf-8"): progress for name, progress in (chunks or {}).items()
        }
        self._bad_names: set[bytes] = set()
        self.records = 0
        self.skipped = 0
        self.last_offset = -1
        self.events: list[Any] = []  # messages with error() set (partition EOF included)

    def add(self, messages: list[Any]) -> bool:
        """Fold in one batch of consumer messages; True once a record at offset ``>= end-1``
        was seen (the rest is beyond the replay). Messages carrying an error (partition EOF
        too) are not folded: they are appended to `events` for the caller."""
        end = self.end
        last = messages[-1] if messages else None
        if last is not None and last.error() is None and last.offset() < end - 1:
            done = False  # the common case: the whole batch is below the end
        else:
            done, messages = self._cut(messages)
        # Runs are followed only near the end, from the call whose last message is in the
        # last `runs_window` offsets: the batches a crash left unanswered are there, and on a
        # long replay (no snapshot) the records before cost no more than they did.
        # An error event that names no partition (a refused group lookup, say) has no offset.
        last_at = last.offset() if last is not None else None
        runs = last_at is not None and last_at >= self._runs_from
        entries = self._entries
        earlier = self._earlier
        events = self.events
        producer_name = self._producer
        sequence_name = self._sequence
        log_append_time = _LOG_APPEND_TIME
        skipped = 0
        records = 0
        for message in messages:
            headers = message.headers()
            if headers is None:  # no headers, or not a record (an error or partition EOF)
                if message.error() is not None:
                    events.append(message)
                    continue
                records += 1
                skipped += 1
                continue
            records += 1
            in_run = 1  # records it counts in a run: none for a chunked message's last
            if len(headers) == 2:
                (n0, v0), (n1, v1) = headers
                if n0 == producer_name and n1 == sequence_name:
                    producer, raw = v0, v1
                elif n1 == producer_name and n0 == sequence_name:
                    producer, raw = v1, v0
                else:
                    skipped += 1
                    continue
            else:
                producer = raw = None
                chunked = False
                for name, value in headers:  # the last occurrence of a name counts
                    if name == producer_name:
                        producer = value
                    elif name == sequence_name:
                        raw = value
                    elif name in _CHUNK_NAMES:
                        chunked = True
                if chunked and producer and raw and self._chunk(producer, raw, message):
                    continue
                # A message's last chunk: its sequence is also its other chunks', elsewhere.
                in_run = 0 if chunked else 1
            # dedup.identity.parse_sequence, inlined for speed: calling it measured +41 ns a
            # record on this 290 ns loop (+14 %; 200k in-memory confluent Messages, 2 CPUs).
            # tests/unit/test_identity.py checks that both agree on arbitrary bytes.
            if not producer or not raw or len(raw) > MAX_SEQUENCE_TEXT:
                skipped += 1
                continue
            if not raw.isdigit() and not (raw[:1] in b"+-" and raw[1:].isdigit()):
                skipped += 1
                continue
            sequence = int(raw)
            if sequence > INT64_MAX or sequence < INT64_MIN:
                skipped += 1
                continue
            kind, timestamp = message.timestamp()
            entry = entries.get(producer)
            if entry is None:
                if not self._new_producer(producer):
                    skipped += 1
                    continue
                entry = entries[producer] = [sequence, timestamp, 0, 0, 0, -1]
            else:
                if sequence > entry[0]:
                    entry[0] = sequence
                if timestamp > entry[1]:
                    entry[1] = timestamp
            if not runs:
                continue
            # The producer's runs (`runs`), near the end only
            offset = message.offset()
            appended = timestamp if kind == log_append_time else -1
            count = entry[4]
            if (
                in_run
                and sequence == entry[2] + count
                and offset == entry[3] + count
                and appended == entry[5]
            ):
                entry[4] = count + 1
            else:  # a run begins here (or, after a last chunk, none)
                if count:  # the run that ended, among the producer's latest
                    ended = earlier.get(producer)
                    if ended is None:
                        ended = earlier[producer] = deque(maxlen=BATCHES_PER_PRODUCER - 1)
                    ended.append((entry[2], count, entry[3], entry[5]))
                entry[2] = sequence
                entry[3] = offset
                entry[4] = in_run
                entry[5] = appended
        self.records += records
        self.skipped += skipped
        for message in reversed(messages):
            if message.error() is None:
                self.last_offset = message.offset()
                break
        return done

    def _chunk(self, producer: bytes, raw: bytes, message: Any) -> bool:
        """Fold in a chunk that is not its message's last; False when the record is not
        one (a last chunk counts as its whole sequence; bad chunk headers as none)."""
        sequence = parse_sequence(raw)
        if sequence is None:
            return False
        try:
            meta = parse_chunk_headers(message.headers())
        except ChunkError:
            return False
        if meta is None or meta.last:
            return False
        entry = self._entries.get(producer)
        if entry is None:
            if not self._new_producer(producer):
                return False
            entry = self._entries[producer] = [_NO_SEQUENCE, message.timestamp()[1], 0, 0, 0, -1]
        else:
            entry[1] = max(entry[1], message.timestamp()[1])
        if sequence <= entry[0]:
            return True  # of a sequence already complete
        size = len(message.value() or b"")
        current = self._chunks.get(producer)
        if current is not None and current.position >= (sequence, meta.chunk_id):
            return True  # a chunk the state already holds
        if (
            current is not None
            and current.sequence == sequence
            and meta.chunk_id == current.chunk_id + 1
            and (current.uuid, current.chunk_count, current.total_size)
            == (meta.uuid, meta.chunk_count, meta.total_size)
        ):
            size += current.size
        self._chunks[producer] = ChunkProgress(
            sequence,
            meta.uuid,
            meta.chunk_id,
            meta.chunk_count,
            meta.total_size,
            min(size, meta.total_size),
        )
        return True

    def _cut(self, messages: list[Any]) -> tuple[bool, list[Any]]:
        """The messages below the end, and whether the end was reached among them."""
        end = self.end
        for index, message in enumerate(messages):
            if message.error() is None and message.offset() >= end - 1:
                if message.offset() == end - 1:
                    return True, messages[: index + 1]
                return True, messages[:index]
        return False, messages

    def _new_producer(self, raw: bytes) -> bool:
        if raw in self._bad_names:
            return False
        name = parse_producer(raw)
        if name is None:
            self._bad_names.add(raw)
            return False
        self._names[raw] = name
        return True

    @property
    def identified(self) -> int:
        return self.records - self.skipped

    def forget(self, name: str) -> None:
        """Drop a producer (an operator reset it here): what follows counts from nothing."""
        raw = name.encode("utf-8")
        self._entries.pop(raw, None)
        self._earlier.pop(raw, None)
        self._chunks.pop(raw, None)

    def highest(self) -> dict[str, tuple[int, int]]:
        """Per producer its highest complete sequence and newest timestamp."""
        names = self._names
        return {
            names[raw]: (entry[0], entry[1])
            for raw, entry in self._entries.items()
            if entry[0] != _NO_SEQUENCE
        }

    def runs(self) -> dict[str, list[tuple[int, int, int, int]]]:
        """Per producer its latest runs near the end (`RUNS_WINDOW`), up to
        `BATCHES_PER_PRODUCER`, the newest last: the records of its consecutive sequences at
        consecutive offsets (of one log append time, where the topic stamps one), as (first
        sequence, records, first offset, log append time or -1). Where such a producer's
        batch, sent again, lies within one, the log says where its records are."""
        names = self._names
        result = {}
        for raw, entry in self._entries.items():
            runs = list(self._earlier.get(raw, ()))
            if entry[4]:  # none for a producer seen only in chunks, or last in a last chunk
                runs.append((entry[2], entry[4], entry[3], entry[5]))
            if runs:
                result[names[raw]] = runs
        return result

    def chunks(self) -> dict[str, tuple[ChunkProgress, int]]:
        """Per producer its chunked message in progress (above its highest complete
        sequence here) and newest timestamp (-1: not seen in the replay)."""
        result = {}
        for raw, progress in self._chunks.items():
            entry = self._entries.get(raw)
            if entry is not None and progress.sequence <= entry[0]:
                continue  # completed, or abandoned for a later sequence
            name = self._names.get(raw) or raw.decode("utf-8")
            result[name] = (progress, -1 if entry is None else entry[1])
        return result


def replay_partition(
    bootstrap: str,
    topic: str,
    partition: int,
    start: int,
    end: int,
    headers: IdentityHeaders = DEFAULT_HEADERS,
    *,
    progress: Callable[[int, int], None] | None = None,
    timeout_s: float = 60.0,
    config: Mapping[str, Any] | None = None,
    chunks: Mapping[str, ChunkProgress] | None = None,
    resets: Mapping[str, int] | None = None,
    committed_watermarks: tuple[int, int] | None = None,
) -> ReplayResult:
    """Read ``topic``/``partition`` over ``[start, end)`` and return the highest sequence and
    the newest timestamp of every producer found there.

    Blocking (run it with `asyncio.to_thread`). ``end`` is the caller's end of the partition
    (its high watermark, read_uncommitted, when it decided to replay); ``start >= end``
    returns at once without connecting. ``progress(records_read, offset)`` is called at most
    every half second while reading, and once at the end with ``end``. `ReplayError` when
    Kafka reports an error (unknown partition, a start beyond the log, ...) or when the
    position did not advance for ``timeout_s`` before the end was reached. ``config`` is
    added to the consumer's settings (security settings, or to override `CONSUMER_SETTINGS`).
    A negative ``start`` is a `ValueError`. ``chunks`` are the chunked messages in progress
    at ``start`` (the snapshot's), which the replay continues. ``resets`` (producer -> the
    offset an operator reset it at, `SnapshotStore.write_resets`): such a producer's records
    below its offset do not count; the replay forgets it on reaching the offset.
    ``committed_watermarks``: the log start and the last stable offset, when the caller has
    just asked them (a recovery does, to wait for open transactions); else asked here.
    """
    began = time.monotonic()
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    fold = Fold(end, headers, chunks)
    if start >= end:
        return _result(topic, partition, start, end, fold, False, began)
    settings: dict[str, Any] = {"bootstrap.servers": bootstrap, **CONSUMER_SETTINGS}
    settings.update(config or {})
    consumer = Consumer(settings)
    uncommitted: Any = None  # the reader past the last stable offset, when one is needed
    # The replay runs in segments that end where a producer was reset, forgetting it there.
    at: dict[int, list[str]] = {}
    for name, offset in (resets or {}).items():
        if start < offset < end:
            at.setdefault(offset, []).append(name)
    try:
        # read_committed's watermarks: the log start and the last stable offset (a
        # read_uncommitted client's "high" is the high watermark). The last stable offset
        # only grows: everything below it was decided before the replay read it.
        # A log start asked earlier may be stale: `_replay` finds that out (out of range).
        low, stable = committed_watermarks or consumer.get_watermark_offsets(
            TopicPartition(topic, partition), timeout=timeout_s
        )
        uncommitted_from = None if stable >= end else max(start, stable)
        bounds = set(at)
        if uncommitted_from is not None and uncommitted_from > start:
            bounds.add(uncommitted_from)
        first: ReplayResult | None = None
        segment_start = start
        for segment_end in [*sorted(bounds), end]:
            reader = consumer
            if uncommitted_from is not None and segment_start >= uncommitted_from:
                if uncommitted is None:
                    uncommitted = Consumer({**settings, "isolation.level": "read_uncommitted"})
                reader = uncommitted
            fold.end = segment_end
            result = _replay(
                reader,
                topic,
                partition,
                segment_start,
                segment_end,
                fold,
                progress,
                timeout_s,
                began,
                log_start=low if first is None else None,
            )
            first = first or result
            for name in at.get(segment_end, ()):
                fold.forget(name)
            segment_start = segment_end
        assert first is not None
        return _result(
            topic,
            partition,
            first.start,
            end,
            fold,
            first.truncated_start,
            began,
            uncommitted_from,
        )
    except KafkaException as exc:
        raise ReplayError(f"replay of {topic}/{partition} failed: {exc}") from exc
    finally:
        consumer.close()
        if uncommitted is not None:
            uncommitted.close()


def _replay(
    consumer: Any,
    topic: str,
    partition: int,
    start: int,
    end: int,
    fold: Fold,
    progress: Callable[[int, int], None] | None,
    timeout_s: float,
    began: float,
    log_start: int | None = None,
) -> ReplayResult:
    """One segment, ``[start, end)``; ``log_start`` when the caller has just asked it."""
    where = f"{topic}/{partition}"
    truncated = False
    low = log_start
    if low is None:
        low, _high = consumer.get_watermark_offsets(
            TopicPartition(topic, partition), timeout=timeout_s
        )
    if start < low:
        start, truncated = low, True
        if start >= end:
            return _result(topic, partition, start, end, fold, truncated, began)
    first = start
    consumer.assign([TopicPartition(topic, partition, start)])
    position = start  # every record below it has been read
    last_change = time.monotonic()
    next_progress = last_change + PROGRESS_INTERVAL_S
    while True:
        # What is queued, without waiting; when nothing is, wait for the first message
        # only (a batch call would wait out its timeout for a batch that never fills).
        messages = consumer.consume(CONSUME_BATCH, 0) or consumer.consume(1, POLL_TIMEOUT_S)
        done = fold.add(messages)
        before = position
        if fold.last_offset >= position:
            position = fold.last_offset + 1
        for event in fold.events:
            error = event.error()
            code = error.code()
            if code == KafkaError._PARTITION_EOF:
                position = max(position, event.offset())
            elif code == KafkaError.GROUP_AUTHORIZATION_FAILED:
                # The consumer names a group (librdkafka wants one) and looks up its
                # coordinator, but joins it not and commits nothing: the proxy's principal
                # needs no ACL on it, and the refusal changes nothing of the read.
                continue
            elif code == KafkaError._AUTO_OFFSET_RESET or code == KafkaError.OFFSET_OUT_OF_RANGE:
                # The log start moved past the replay's position (retention, DeleteRecords).
                low, _high = consumer.get_watermark_offsets(
                    TopicPartition(topic, partition), timeout=timeout_s
                )
                if low <= position:
                    raise ReplayError(f"replay of {where} at offset {position}: {error.str()}")
                truncated = True
                if fold.records == 0:
                    first = low
                position = low
                if position >= end:
                    done = True
                    break
                consumer.assign([TopicPartition(topic, partition, position)])
            else:
                raise ReplayError(f"replay of {where} at offset {position}: {error.str()}")
        fold.events.clear()
        now = time.monotonic()
        if done or position >= end:
            if progress is not None:
                progress(fold.records, end)
            return _result(topic, partition, first, end, fold, truncated, began)
        if position > before:
            last_change = now
        elif now - last_change > timeout_s:
            raise ReplayError(
                f"replay of {where} stalled at offset {position} for {timeout_s:g} s before "
                f"its end {end} ({fold.records} records read)"
            )
        if progress is not None and now >= next_progress:
            progress(fold.records, position)
            next_progress = now + PROGRESS_INTERVAL_S


def _result(
    topic: str,
    partition: int,
    start: int,
    end: int,
    fold: Fold,
    truncated: bool,
    began: float,
    uncommitted_from: int | None = None,
) -> ReplayResult:
    return ReplayResult(
        topic=topic,
        partition=partition,
        start=start,
        end=end,
        highest=fold.highest(),
        records=fold.records,
        identified=fold.identified,
        skipped=fold.skipped,
        truncated_start=truncated,
        seconds=time.monotonic() - began,
        chunks=fold.chunks(),
        runs=fold.runs(),
        uncommitted_from=uncommitted_from,
    )

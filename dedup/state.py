"""The dedup state in Redis: Pulsar's two sequence maps (PIP-6), shared by every proxy.

Per topic-partition Redis holds, for every producer ``p``:

- ``pushed[p]``: the highest sequence accepted for writing (raised by the check, before Kafka
  has the record);
- ``persisted[p]``: the highest sequence Kafka acknowledged (raised by `mark_persisted`);
- ``seen[p]``: when ``p`` was last seen (ms), for eviction at ``max_producers`` and for purging
  idle producers.

The check, for a record with sequence ``s`` (Pulsar's ``MessageDeduplication.isDuplicate``, per
record rather than per batch):

==========================================  =========  =======================================
condition                                   status     why
==========================================  =========  =======================================
no ``pushed[p]``, or ``s > pushed[p]``      NOT_DUP    never seen: forward it, ``pushed[p]=s``
                                                       (later records of the same batch see it)
``s <= persisted[p]``                       DUP        Kafka acknowledged it: drop, report ok
``s`` was raised into ``pushed[p]`` by an   DUP        its first copy is in this very batch and
earlier record of this batch                           is written (or fails) together with it
``persisted[p] < s <= pushed[p]`` as it     UNKNOWN    an earlier write of it is in flight or
was when the batch started                             failed: it may or may not be in the log.
                                                       The whole partition batch is refused
                                                       (nothing is updated) and retried later
==========================================  =========  =======================================

Chunked messages (`dedup.chunks`): the check is on positions (sequence, chunk id), a
record without chunk headers and a message's last chunk being at (sequence, LAST). So
``pushed[p]`` and ``persisted[p]`` above are positions: they hold the last COMPLETE sequence,
and a message in progress sits beside them in ``pushed_chunk[p]`` / ``persisted_chunk[p]``
(`ChunkProgress`: sequence, uuid, chunk id, count, total size, bytes so far). A chunk that
would be NOT_DUP must follow the chunk rule (`dedup.chunks.accept_chunk`), else the partition
batch is refused as bad input (`PartitionVerdict.bad`) and nothing is updated. A sequence
counts as persisted (`last_sequence`) once its last chunk is.

Forwarding an UNKNOWN record could write it twice; dropping it could lose it. Only time tells:
either the write is acknowledged (``persisted`` rises, the retry is DUP) or it failed and the
engine calls `reset_pushed` (``pushed := persisted``, the retry is NOT_DUP).

How it is stored and run:

- Keys ``<prefix>:{<topic>/<partition>}:pushed`` and ``:persisted`` (hashes producer ->
  sequence), ``:pushed_chunk`` and ``:persisted_chunk`` (producer -> `ChunkProgress.encode`),
  ``:seen`` (sorted set producer -> last seen ms) and ``:token``. The ``{...}`` hash
  tag puts a partition's keys in one Redis Cluster slot, so one Lua script can use them
  atomically.
- ``:token`` is written by the recovery that loaded the partition (`load_recovered`) and
  passed back by the engine on every call. A flushed, restarted-empty or replaced Redis does
  not hold it, so the scripts answer "lost" and change nothing: the proxy notices the loss on
  its next call instead of trusting empty maps, and recovers the partition from the log.
- ``<prefix>:{<topic>}:partitions`` is a set of the partitions that may have state, written in
  the same round trip as the state (before it), so `partitions` needs no SCAN. It lives in
  another slot, so it is not updated atomically with the state: it may name a partition whose
  state is gone (`partitions` filters those out); see `clear` for the one race it has.
  ``<prefix>:{topics}`` is the registry of the topics with such a set, written in the same
  round trip (before them), so `topics` needs no SCAN of the keyspace either (which a Redis
  Cluster could only do node by node).
- Every rule runs inside one Lua script per partition (``dedup/lua/*.lua``), so the check and the
  update are atomic across every proxy instance. All partitions of a call go out in one
  non-transactional pipeline of EVALSHA: one network round trip per call. A NOSCRIPT reply
  (Redis restarted or flushed its script cache) loads the scripts and re-runs just those calls.
- Sequences are signed 64-bit integers. Lua numbers are doubles, exact only to 2^53, so the
  scripts never turn a sequence into a number: it is stored as a decimal string and compared
  exactly by ``seq_cmp`` (``dedup/lua/seq.lua``: sign, then length, then digits).
- A batch without chunks usually goes to the check as runs (`check_runs`: consecutive
  records of one producer whose sequences rise by exactly 1) of (producer, first, last,
  count), so the common case costs a comparison per run, not per record: a run above
  ``pushed[p]`` is NOT_DUP all through. A run that overlaps ``pushed[p]`` gets one status
  when its ends tell (all acknowledged, say), else it is checked record by record inside
  the script up to its first NOT_DUP record, which needs each sequence as a Lua number:
  when the run has sequences of 10^15 or more in magnitude the script answers "expand",
  changing nothing, and that partition is re-sent record by record (a second round trip,
  for partial retries of such sequences only). `CheckEncoding` chooses.
- Needs Redis >= 6.2 (``ZADD GT``, ``COPY``).
"""

from __future__ import annotations

import enum
import hashlib
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any, Final, overload

import redis.asyncio
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError

from dedup.chunks import LAST, ChunkMeta, ChunkProgress
from dedup.held_connection import HeldConnection
from dedup.identity import INT64_MAX, INT64_MIN


def clock_ms() -> int:
    """Wall-clock milliseconds: the ``now_ms`` the state's last-seen times are kept in."""
    return int(time.time() * 1000)


SEQUENCE_MIN: Final = INT64_MIN
SEQUENCE_MAX: Final = INT64_MAX


# The script takes a run's sequences as Lua numbers only below this in magnitude (15 digits,
# check.lua's `small`); a run that overlaps pushed with a larger end is answered "expand".
_EXACT: Final = 10**15


class Status(enum.IntEnum):
    """What the check says about one record."""

    NOT_DUP = 0
    DUP = 1
    UNKNOWN = 2


# The check's status digits, looked up rather than parsed (one per record).
_STATUS_OF_DIGIT: Final = {str(int(status)): status for status in Status}


class CheckEncoding(enum.Enum):
    """How a batch without chunks goes to the check script."""

    RECORDS = "records"  # two arguments per record
    RUNS = "runs"  # four per run (`check_runs`), however short the runs
    AUTO = "auto"  # runs when they hold two records or more on average


# (producer, first sequence, last sequence, count): consecutive records of one producer
# whose sequences rise by exactly 1, so last == first + count - 1.
Run = tuple[str, int, int, int]


class RunIdentities(Sequence[tuple[str, int]]):
    """(producer, sequence) per record given as runs, for a batch whose runs are known
    without looking at each record (`dedup.batches.BatchRun`): its length and its runs
    cost nothing per record; a record's identity is made only when asked for."""

    __slots__ = ("_length", "runs")

    def __init__(self, runs: Sequence[Run]) -> None:
        self.runs = tuple(runs)
        self._length = sum(run[3] for run in self.runs)

    def __len__(self) -> int:
        return self._length

    def __iter__(self) -> Iterator[tuple[str, int]]:
        for producer, first, _, count in self.runs:
            for sequence in range(first, first + count):
                yield producer, sequence

    @overload
    def __getitem__(self, index: int) -> tuple[str, int]: ...
    @overload
    def __getitem__(self, index: slice) -> list[tuple[str, int]]: ...
    def __getitem__(self, index: int | slice) -> tuple[str, int] | list[tuple[str, int]]:
        return list(self)[index]


def check_runs(identities: Iterable[tuple[str, int]]) -> list[Run]:
    """(producer, sequence) per record, in order, as maximal runs. An implicit identity's
    sequence wraps at 2^31 to 0, which is not +1: the wrap ends a run."""
    if isinstance(identities, RunIdentities):
        return _merged(identities.runs)
    runs: list[Run] = []
    producer, first, last = "", 0, 0
    count = 0
    for p, s in identities:
        if count and p == producer and s == last + 1:
            last, count = s, count + 1
            continue
        if count:
            runs.append((producer, first, last, count))
        producer, first, last, count = p, s, s, 1
    if count:
        runs.append((producer, first, last, count))
    return runs


def _merged(given: Sequence[Run]) -> list[Run]:
    """Runs made maximal: a run that goes on where the one before it ends joins it."""
    runs: list[Run] = []
    for run in given:
        if runs and runs[-1][0] == run[0] and run[1] == runs[-1][2] + 1:
            producer, first, _, count = runs[-1]
            runs[-1] = (producer, first, run[2], count + run[3])
        else:
            runs.append(run)
    return runs


@dataclass(frozen=True, slots=True)
class PartitionCheck:
    """The records of one partition batch: (producer, sequence) per record, in batch order;
    ``chunks``, when given, one entry per identity: the chunk headers and value size of a
    chunk, None for a record that is not one."""

    topic: str
    partition: int
    identities: Sequence[tuple[str, int]]
    token: str | None = None  # the recovery token the state must hold; None: any
    chunks: Sequence[tuple[ChunkMeta, int] | None] = ()


@dataclass(frozen=True, slots=True)
class PartitionVerdict:
    """The check of one partition batch."""

    statuses: tuple[Status, ...]  # one per identity, same order; empty when lost or bad
    evicted: tuple[str, ...]  # producers evicted to make room (max_producers)
    lost: bool = False  # the token did not match: nothing checked, the partition must recover
    # Per identity: the bytes of its message so far for a NOT_DUP chunk that is not the
    # last (what `mark_persisted` needs once it is acknowledged), else None.
    sizes: tuple[int | None, ...] = ()
    bad: str | None = None  # a chunk or the jump rule was broken: why (nothing was updated)
    bad_index: int = -1  # and which identity (0-based)
    # The rule broken is only a skip ahead: the chunk before may still come (retriable).
    gap: bool = False
    # The rule broken is max_sequence_jump (not retriable: the same record is refused again).
    jump: bool = False

    @property
    def refused(self) -> bool:
        """Nothing was updated: some record is UNKNOWN (retry later), a chunk is bad, or
        the state was lost."""
        return self.lost or self.bad is not None or Status.UNKNOWN in self.statuses


@dataclass(slots=True)
class Acked:
    """Acknowledged positions that `check_and_push` records before its check (the args of
    `mark_persisted`); `lost` is set once they are recorded: the indexes of the updates whose
    token no longer matched. None: not recorded (the call failed)."""

    updates: list[tuple[str, int, Mapping[str, Persisted]]]
    tokens: list[str | None]
    lost: list[int] | None = None


@dataclass(frozen=True, slots=True)
class ProducerState:
    """One producer's entry in a partition; None where that map has no entry."""

    pushed: int | None
    persisted: int | None
    last_seen_ms: int | None
    pushed_chunk: ChunkProgress | None = None  # the chunked message in progress, if any
    persisted_chunk: ChunkProgress | None = None


@dataclass(frozen=True, slots=True)
class RecoveredState:
    """A partition's persisted state as a snapshot stores it."""

    producers: dict[str, tuple[int, int]]  # producer -> (complete sequence, last seen ms)
    chunks: dict[str, tuple[ChunkProgress, int]]  # producer -> (in progress, last seen ms)


# What Kafka acknowledged for a producer: a complete sequence, or a chunk of one in progress.
Persisted = int | ChunkProgress


def persisted_position(value: Persisted) -> tuple[int, int]:
    """Where an acknowledged position stands (`dedup.chunks.position`), to keep the highest."""
    if isinstance(value, ChunkProgress):
        return value.position
    return value, LAST


@dataclass(frozen=True, slots=True)
class Script:
    name: str
    source: str
    sha: str

    @classmethod
    def load(cls, name: str) -> Script:
        lua = resources.files("dedup") / "lua"
        source = (lua / "seq.lua").read_text() + "\n" + (lua / f"{name}.lua").read_text()
        return cls(name, source, hashlib.sha1(source.encode()).hexdigest())


_CHECK = Script.load("check")
_PERSIST = Script.load("persist")
_RESET = Script.load("reset")
_PURGE = Script.load("purge")
_LOAD = Script.load("load")

# A consistent read of keys of one slot (`producers`, `recovered_state`): a script, as a
# MULTI pipeline on a cluster client depends on the client's version.
_READ = Script.load("read")

# One script call: the script, its keys, its arguments.
_Call = tuple[Script, tuple[str, ...], list[str]]


class DedupState:
    """Pulsar's pushed / persisted maps, per topic-partition, in Redis."""

    def __init__(
        self,
        redis: redis.asyncio.Redis | redis.asyncio.RedisCluster,
        *,
        key_prefix: str = "dedup",
        max_producers: int = 10_000,
        check_encoding: CheckEncoding = CheckEncoding.AUTO,
        max_sequence_jump: int = 0,
    ) -> None:
        if not key_prefix or "{" in key_prefix or "}" in key_prefix:
            # A brace in the prefix would become the Redis Cluster hash tag.
            raise ValueError(f"key_prefix must be non-empty and brace-free: {key_prefix!r}")
        if max_producers < 1:
            raise ValueError(f"max_producers must be at least 1: {max_producers}")
        self._redis = redis
        # The hot path's round trips skip the pool's checkout (`dedup.held_connection`).
        self._held = None if isinstance(redis, RedisCluster) else HeldConnection(redis)
        self._prefix = key_prefix
        self._max_producers = max_producers
        if max_sequence_jump < 0:
            raise ValueError(f"max_sequence_jump must be >= 0 (0: none): {max_sequence_jump}")
        self._max_jump = str(max_sequence_jump)
        self._check_encoding = check_encoding
        # Per token this process loaded: the calls made with it that Redis answered. Redis
        # must count at least as many (see `token_matches` in lua/seq.lua): a Redis that
        # came back without writes it had acknowledged is found out.
        self._calls: dict[str, int] = {}
        self._tokens: dict[tuple[str, int], str] = {}  # the latest token per partition

    # -- the produce path -------------------------------------------------------------------

    async def check_and_push(
        self, checks: Sequence[PartitionCheck], now_ms: int, acked: Acked | None = None
    ) -> list[PartitionVerdict]:
        """Classify every record of every partition batch (see the module's table) and, for
        each partition with no UNKNOWN record, raise pushed[p] and last-seen. One round trip;
        a second, for those partitions only, when a run must be re-sent record by record
        (the script's "expand": a run overlapping pushed[p] with sequences of 10^15 or more).

        `acked`: acknowledged positions to record first (`mark_persisted`), in the same
        round trip, so that the check sees them; their outcome is left in `acked.lost`.

        If this raises (connection lost, timeout), the scripts may or may not have run: treat
        the batches as failed writes (`reset_pushed` once the partition's writes settle),
        and record `acked` again (recording is idempotent).
        """
        # A partition named twice in one call (requests checked together, `group_check`)
        # gets runs only if none can "expand": a re-sent expansion would be checked after
        # the later batch instead of before it.
        named = Counter((c.topic, c.partition) for c in checks)
        calls = [
            self._check_call(c, self._runs_of(c, alone=named[(c.topic, c.partition)] == 1), now_ms)
            for c in checks
        ]
        persist = [] if acked is None else self._persist_calls(acked.updates, now_ms, acked.tokens)
        # A check under a recovery token is of a partition `load` has noted already (a
        # token only exists once it ran, and state lost goes through it again): only an
        # unguarded one notes its partition, which saves two commands a request.
        unguarded = ((c.topic, c.partition) for c in checks if not c.token)
        replies = await self._run([*persist, *calls], self._note_partitions(unguarded))
        if acked is not None:
            acked.lost = self._persisted_outcome(acked.tokens, replies[: len(persist)])
            replies = replies[len(persist) :]
        self._count_checks(checks, replies)  # before a re-send that may raise
        # {'expand'}: a run that overlaps pushed[p] with sequences beyond a Lua number's
        # exact range. Nothing changed and the call was not counted: re-send it per record.
        expand = [i for i, reply in enumerate(replies) if _text(reply[0]) == "expand"]
        if expand:
            again = await self._run([self._check_call(checks[i], None, now_ms) for i in expand])
            self._count_checks([checks[i] for i in expand], again)
            for i, reply in zip(expand, again, strict=True):
                replies[i] = reply
        verdicts = []
        for check, reply in zip(checks, replies, strict=True):
            statuses, *rest = reply
            if _text(statuses) == "lost":
                verdicts.append(PartitionVerdict((), (), lost=True))
                continue
            if _text(statuses) in ("bad", "gap", "jump"):
                number, message = rest
                verdicts.append(
                    PartitionVerdict(
                        (),
                        (),
                        bad=_text(message),
                        bad_index=int(number) - 1,
                        gap=_text(statuses) == "gap",
                        jump=_text(statuses) == "jump",
                    )
                )
                continue
            sizes, *evicted = rest
            verdict = PartitionVerdict(
                tuple(map(_STATUS_OF_DIGIT.__getitem__, _text(statuses))),
                tuple(_text(producer) for producer in evicted),
                sizes=tuple(int(size) if size else None for size in sizes),
            )
            assert len(verdict.statuses) == len(check.identities)
            verdicts.append(verdict)
        return verdicts

    def _count_checks(self, checks: Sequence[PartitionCheck], replies: Sequence[Any]) -> None:
        """Counts the check calls Redis counted: every answer but "lost" and "expand"."""
        for check, reply in zip(checks, replies, strict=True):
            if _text(reply[0]) not in ("lost", "expand"):
                self._counted(check.token)

    def _runs_of(self, check: PartitionCheck, alone: bool = True) -> list[Run] | None:
        """The batch as runs (`check_runs`) when it goes to the script so, else None. Not
        `alone` in its call: only runs the script never answers "expand" to."""
        if check.chunks or self._check_encoding is CheckEncoding.RECORDS:
            return None
        runs = check_runs(check.identities)
        if not alone and not all(first > -_EXACT and last < _EXACT for _, first, last, _ in runs):
            return None
        # Four arguments per run against two per record: runs pay from two records a run.
        if self._check_encoding is CheckEncoding.RUNS or 2 * len(runs) <= len(check.identities):
            return runs
        return None

    def _check_call(self, check: PartitionCheck, runs: list[Run] | None, now_ms: int) -> _Call:
        """The check script's call for one partition batch: per run (stride 4), per record
        (stride 2), or per record with its chunk fields (stride 7)."""
        args = [str(now_ms), str(self._max_producers), self._max_jump, self._guard(check.token)]
        if runs is not None:
            args.append("4")
            for producer, first, last, count in runs:
                args += (producer, _sequence(first), _sequence(last), str(count))
        elif not check.chunks:  # no chunk in the batch: two arguments per record
            args.append("2")
            for producer, sequence in check.identities:
                args += (producer, _sequence(sequence))
        else:
            args.append("7")
            for (producer, sequence), chunk in zip(check.identities, check.chunks, strict=True):
                args += (producer, _sequence(sequence))
                if chunk is None:
                    args += ("", "", "", "", "")
                else:
                    meta, size = chunk
                    args += (
                        str(meta.chunk_id),
                        str(meta.chunk_count),
                        str(meta.total_size),
                        str(size),
                        meta.uuid,
                    )
        return (_CHECK, self._keys(check.topic, check.partition), args)

    async def mark_persisted(
        self,
        updates: Sequence[tuple[str, int, Mapping[str, Persisted]]],
        now_ms: int,
        tokens: Sequence[str | None] | None = None,
    ) -> list[int]:
        """Kafka acknowledged: per (topic, partition, {producer: highest acknowledged
        position}), persisted[p] = max(persisted[p], position) and pushed[p] >= persisted[p].
        A position is a complete sequence, or the `ChunkProgress` of a chunk that is not its
        message's last. One round trip.
        `tokens` (one per update, None = any) are the recovery tokens the partitions must
        hold; returns the indexes of the updates whose token no longer matched: nothing was
        recorded there, their state was lost."""
        tokens = tokens or [None] * len(updates)
        calls = self._persist_calls(updates, now_ms, tokens)
        unguarded = ((t, p) for (t, p, _), token in zip(updates, tokens, strict=True) if not token)
        replies = await self._run(calls, self._note_partitions(unguarded))
        return self._persisted_outcome(tokens, replies)

    def _persist_calls(
        self,
        updates: Sequence[tuple[str, int, Mapping[str, Persisted]]],
        now_ms: int,
        tokens: Sequence[str | None],
    ) -> list[_Call]:
        """The persist script's calls for `mark_persisted`, one per partition."""
        calls: list[_Call] = []
        for (topic, partition, persisted), token in zip(updates, tokens, strict=True):
            args = [str(now_ms), self._guard(token)]
            for producer, position in persisted.items():
                if isinstance(position, ChunkProgress):
                    args += (
                        producer,
                        _sequence(position.sequence),
                        str(position.chunk_id),
                        str(position.chunk_count),
                        str(position.total_size),
                        str(position.size),
                        position.uuid,
                    )
                else:
                    args += (producer, _sequence(position), "", "", "", "", "")
            calls.append((_PERSIST, self._keys(topic, partition), args))
        return calls

    def _persisted_outcome(self, tokens: Sequence[str | None], replies: Sequence[Any]) -> list[int]:
        """Counts the persist calls that ran; the indexes of those whose token no longer
        matched (nothing recorded there: the partition's state was lost)."""
        for token, done in zip(tokens, replies, strict=True):
            if done:
                self._counted(token)
        return [i for i, done in enumerate(replies) if not done]

    async def reset_pushed(self, topic: str, partition: int, token: str | None = None) -> bool:
        """pushed := persisted (Pulsar's resetHighestSequenceIdPushed): after a write that
        definitely failed, once the partition's in-flight writes have settled. False when
        the token no longer matched (state lost): nothing was changed."""
        pushed, persisted, _, token_key, pushed_chunk, persisted_chunk, _ = self._keys(
            topic, partition
        )
        keys = (pushed, persisted, token_key, pushed_chunk, persisted_chunk)
        (done,) = await self._run([(_RESET, keys, [self._guard(token)])])
        if done:
            self._counted(token)
        return bool(done)

    # -- reading ----------------------------------------------------------------------------

    async def last_sequence(self, topic: str, partition: int, producer: str) -> int:
        """persisted[producer] on this partition, -1 when unknown (Pulsar's getLastSequenceId).
        A chunked message counts once its last chunk is persisted."""
        persisted = self._keys(topic, partition)[1]
        pipe = self._redis.pipeline(transaction=False)
        pipe.hget(persisted, producer)
        (value,) = await pipe.execute()
        return -1 if value is None else int(value)

    async def tokens(self, topic: str, partitions: Sequence[int]) -> list[str | None]:
        """Each partition's recovery token (None: no state), as its owner loaded it."""
        pipe = self._redis.pipeline(transaction=False)
        for partition in partitions:
            pipe.get(self._keys(topic, partition)[3])
        found = await pipe.execute()
        return [None if value is None else _text(value).split(" ")[0] for value in found]

    async def producers(self, topic: str, partition: int) -> dict[str, ProducerState]:
        """Every producer the partition tracks, with its pushed, persisted and last seen."""
        pushed_key, persisted_key, seen_key, _, pushed_chunk_key, persisted_chunk_key, _ = (
            self._keys(topic, partition)
        )
        (
            pushed_raw,
            persisted_raw,
            seen_raw,
            pushed_chunk_raw,
            persisted_chunk_raw,
        ) = await self._read(  # one slot: a consistent view
            (pushed_key, "hash"),
            (persisted_key, "hash"),
            (seen_key, "zset"),
            (pushed_chunk_key, "hash"),
            (persisted_chunk_key, "hash"),
        )
        pushed = {_text(p): int(s) for p, s in pushed_raw.items()}
        persisted = {_text(p): int(s) for p, s in persisted_raw.items()}
        seen = {_text(p): int(ms) for p, ms in seen_raw}
        pushed_chunk = _chunks(pushed_chunk_raw)
        persisted_chunk = _chunks(persisted_chunk_raw)
        return {
            p: ProducerState(
                pushed.get(p),
                persisted.get(p),
                seen.get(p),
                pushed_chunk.get(p),
                persisted_chunk.get(p),
            )
            for p in sorted(
                pushed.keys()
                | persisted.keys()
                | seen.keys()
                | pushed_chunk.keys()
                | persisted_chunk.keys()
            )
        }

    async def partitions(self, topic: str) -> list[int]:
        """The topic's partitions that have state, sorted (from the per-topic set, checked)."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.smembers(self._partitions_key(topic))
        (members,) = await pipe.execute()
        candidates = sorted(int(m) for m in members)
        if not candidates:
            return []
        pipe = self._redis.pipeline(transaction=False)
        for partition in candidates:
            pipe.exists(*self._keys(topic, partition)[:6])
        counts = await pipe.execute()
        return [p for p, count in zip(candidates, counts, strict=True) if count]

    async def topics(self) -> list[str]:
        """Topics that have (or had: a superset) dedup state, sorted: the registry of topics
        (`_note_partitions` writes it with the partition sets), without the topics whose
        partition set is gone. For administrative calls, not the produce path."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.smembers(self._topics_key())
        (members,) = await pipe.execute()
        candidates = sorted(_text(m) for m in members)
        if not candidates:
            return []
        pipe = self._redis.pipeline(transaction=False)
        for topic in candidates:
            pipe.exists(self._partitions_key(topic))
        counts = await pipe.execute()
        return [t for t, count in zip(candidates, counts, strict=True) if count]

    # -- administration ---------------------------------------------------------------------

    async def clear(self, topic: str, partition: int | None = None) -> None:
        """Forget one partition's state, or the whole topic's (dedup disabled).

        Not atomic with a concurrent `check_and_push` of the same partition (the per-topic set
        lives in another slot): stop the produce path for the topic first, or a racing push
        may leave state that `partitions` does not list.
        """
        set_key = self._partitions_key(topic)
        if partition is None:
            pipe = self._redis.pipeline(transaction=False)
            pipe.smembers(set_key)
            (members,) = await pipe.execute()
            partitions = [int(m) for m in members]
        else:
            partitions = [partition]
        pipe = self._redis.pipeline(transaction=False)
        for p in partitions:
            pipe.delete(*self._keys(topic, p)[:6])  # the lease's history stays
        if partition is None:
            pipe.delete(set_key)
            pipe.srem(self._topics_key(), topic)
        else:
            pipe.srem(set_key, str(partition))
        await pipe.execute()

    async def forget_producer(self, topic: str, partition: int, producer: str) -> bool:
        """Remove one producer from every map of the partition (an operator's reset);
        whether it was there."""
        return await self.forget_producers(topic, partition, [producer])

    async def forget_producers(self, topic: str, partition: int, producers: Sequence[str]) -> bool:
        """Remove these producers from every map of the partition (a reset, or evicted by
        the maps kept in memory); whether any was there."""
        if not producers:
            return False
        pushed, persisted, seen, _, pushed_chunk, persisted_chunk, _ = self._keys(topic, partition)
        async with self._redis.pipeline(transaction=True) as pipe:  # one slot: MULTI works
            for key in (pushed, persisted, pushed_chunk, persisted_chunk):
                pipe.hdel(key, *producers)
            pipe.zrem(seen, *producers)
            removed = await pipe.execute()
        return any(removed)

    async def purge_idle(self, topic: str, partition: int, older_than_ms: int) -> list[str]:
        """Remove the producers last seen before older_than_ms from every map; their names."""
        (idle,) = await self._run([(_PURGE, self._keys(topic, partition), [str(older_than_ms)])])
        return [_text(p) for p in idle]

    async def load_persisted(
        self, topic: str, partition: int, persisted: Mapping[str, int], now_ms: int
    ) -> None:
        """Both maps become `persisted` (pushed = persisted). Known producers keep their
        last-seen time, new ones get now_ms, producers missing from the map go."""
        await self._load(
            topic, partition, {p: (s, None) for p, s in persisted.items()}, {}, now_ms, ""
        )

    async def load_recovered(
        self,
        topic: str,
        partition: int,
        producers: Mapping[str, tuple[int, int]],
        token: str,
        now_ms: int,
        chunks: Mapping[str, tuple[ChunkProgress, int]] | None = None,
        lease: str = "",
    ) -> bool:
        """Recovery: both maps become {producer: (sequence, last seen ms)} (pushed =
        persisted), both chunk maps {producer: (message in progress, last seen ms)}, a
        producer's last seen is the later of the given and the known one, and the partition
        takes `token`: calls made with an older token answer "lost". `lease` ("owner
        incarnation epoch", `dedup.ownership.leases.Lease.text`) must still hold the
        partition, else nothing is loaded and this returns False; loading opens the lease."""
        if not token:
            raise ValueError("a recovery token must not be empty")
        return await self._load(
            topic, partition, dict(producers), dict(chunks or {}), now_ms, token, lease
        )

    async def recovered_view(
        self, topic: str, partition: int, token: str
    ) -> dict[str, tuple[int, int]] | None:
        """{producer: (persisted sequence, last seen ms)} read atomically; None when the
        partition no longer holds `token` (state lost or recovered by another)."""
        state = await self.recovered_state(topic, partition, token)
        return None if state is None else state.producers

    async def recovered_state(
        self, topic: str, partition: int, token: str
    ) -> RecoveredState | None:
        """The persisted maps (sequences and chunked messages in progress) with last seen
        times, read atomically, for a snapshot; None when the partition no longer holds
        `token` (state lost or recovered by another)."""
        _, persisted_key, seen_key, token_key, _, persisted_chunk_key, _ = self._keys(
            topic, partition
        )
        found, persisted_raw, seen_raw, chunks_raw = await self._read(  # one slot: consistent
            (token_key, "get"),
            (persisted_key, "hash"),
            (seen_key, "zset"),
            (persisted_chunk_key, "hash"),
        )
        if found is None or _text(found).split(" ")[0] != token:
            return None
        seen = {_text(p): int(ms) for p, ms in seen_raw}
        return RecoveredState(
            {_text(p): (int(s), seen.get(_text(p), 0)) for p, s in persisted_raw.items()},
            {p: (chunk, seen.get(p, 0)) for p, chunk in _chunks(chunks_raw).items()},
        )

    async def _load(
        self,
        topic: str,
        partition: int,
        producers: Mapping[str, tuple[int, int | None]],
        chunks: Mapping[str, tuple[ChunkProgress, int]],
        now_ms: int,
        token: str,
        lease: str = "",
    ) -> bool:
        args = [str(now_ms), token, lease]
        for producer in producers.keys() | chunks.keys():
            sequence, seen_ms = producers.get(producer, (None, None))
            chunk, chunk_seen_ms = chunks.get(producer, (None, None))
            if chunk_seen_ms is not None:
                seen_ms = max(seen_ms or 0, chunk_seen_ms)
            args += (
                producer,
                "" if sequence is None else _sequence(sequence),
                "" if seen_ms is None else str(seen_ms),
                "" if chunk is None else chunk.encode(),
            )
        calls: list[_Call] = [(_LOAD, self._keys(topic, partition), args)]
        (loaded,) = await self._run(calls, self._note_partitions([(topic, partition)]))
        if loaded and token:
            previous = self._tokens.pop((topic, partition), None)
            self._calls.pop(previous or "", None)
            self._tokens[(topic, partition)], self._calls[token] = token, 0
        return bool(loaded)

    # -- plumbing ---------------------------------------------------------------------------

    def _guard(self, token: str | None) -> str:
        """What a script checks the partition's token against ("" = nothing)."""
        if not token:
            return ""
        return f"{token} {self._calls.get(token, 0)}"

    def _counted(self, token: str | None) -> None:
        if token and token in self._calls:
            self._calls[token] += 1

    def _keys(self, topic: str, partition: int) -> tuple[str, str, str, str, str, str, str]:
        """The partition's keys, one hash slot: the state's six, then its ownership lease
        (`dedup.ownership.leases`), which outlives `clear`."""
        if partition < 0:
            raise ValueError(f"partition must be >= 0: {partition}")
        base = f"{self._prefix}:{{{topic}/{partition}}}"
        return (
            f"{base}:pushed",
            f"{base}:persisted",
            f"{base}:seen",
            f"{base}:token",
            f"{base}:pushed_chunk",
            f"{base}:persisted_chunk",
            f"{base}:lease",
        )

    partition_keys = _keys

    @property
    def key_prefix(self) -> str:
        return self._prefix

    async def run_scripts(
        self, calls: Sequence[tuple[Script, tuple[str, ...], list[str]]]
    ) -> list[Any]:
        """Run script calls in one round trip (see `_run`): for other users of the keys."""
        return await self._run(calls)

    def _partitions_key(self, topic: str) -> str:
        return f"{self._prefix}:{{{topic}}}:partitions"

    def _topics_key(self) -> str:
        """The registry of topics with a partition set (its own slot; `topics` reads it)."""
        return f"{self._prefix}:{{topics}}"

    def _note_partitions(self, partitions: Iterable[tuple[str, int]]) -> list[tuple[str, ...]]:
        """SADD commands recording which partitions have state, one per topic, after the
        one recording the topics in the registry."""
        by_topic: dict[str, set[str]] = {}
        for topic, partition in partitions:
            by_topic.setdefault(topic, set()).add(str(partition))
        if not by_topic:
            return []
        return [
            ("SADD", self._topics_key(), *sorted(by_topic)),
            *(
                ("SADD", self._partitions_key(topic), *sorted(members))
                for topic, members in by_topic.items()
            ),
        ]

    async def _read(self, *reads: tuple[str, str]) -> list[Any]:
        """(key, how) of one slot read atomically: GET's value, HGETALL's dict, ZRANGE
        WITHSCORES' [(member, score)], as the commands' own replies would be."""
        keys = tuple(key for key, _ in reads)
        (reply,) = await self._run([(_READ, keys, [how for _, how in reads])])
        values: list[Any] = []
        for (_, how), raw in zip(reads, reply, strict=True):
            if how == "get":
                values.append(raw)
            elif how == "hash":
                values.append(dict(zip(raw[::2], raw[1::2], strict=True)))
            else:
                values.append(
                    [(m, float(score)) for m, score in zip(raw[::2], raw[1::2], strict=True)]
                )
        return values

    async def _run(
        self, calls: Sequence[_Call], before: Sequence[tuple[str, ...]] = ()
    ) -> list[Any]:
        """Run the plain commands `before`, then every script call, in ONE round trip (a
        non-transactional pipeline); return the scripts' replies. Calls that got NOSCRIPT are
        re-run once after SCRIPT LOAD: NOSCRIPT means the script did not run.

        On a Redis Cluster the pipeline goes to each slot's primary (one round trip per node,
        in parallel; every call's keys share one slot), and SCRIPT LOAD to the primary of
        each call that got NOSCRIPT: a replica promoted by a failover has no scripts cached."""
        replies: list[Any] = [None] * len(calls)
        pending = list(range(len(calls)))
        for attempt in range(2):
            commands: list[Sequence[Any]] = list(before)
            for i in pending:
                script, keys, args = calls[i]
                commands.append(("EVALSHA", script.sha, len(keys), *keys, *args))
            results = await self._round_trip(commands)
            for result in results[: len(before)]:
                if isinstance(result, Exception):
                    raise result
            script_results, before = results[len(before) :], ()
            missing = []
            for i, result in zip(pending, script_results, strict=True):
                if isinstance(result, NoScriptError) and attempt == 0:
                    missing.append(i)
                elif isinstance(result, Exception):
                    raise result
                else:
                    replies[i] = result
            if not missing:
                break
            if isinstance(self._redis, redis.asyncio.RedisCluster):
                # To the node that serves each call's slot (as the client now knows it): a
                # replica just promoted may still be listed as a replica, so "every
                # primary" can miss it.
                cluster = self._redis
                loads = {}
                for i in missing:
                    script, keys, _ = calls[i]
                    node = cluster.get_node_from_key(keys[0])
                    if node is not None:  # else no known owner: the re-run fails as it did
                        loads[(node.name, script.sha)] = (node, script)
                for node, script in loads.values():
                    await cluster.execute_command("SCRIPT LOAD", script.source, target_nodes=node)
            else:
                pipe = self._redis.pipeline(transaction=False)
                for script in {calls[i][0] for i in missing}:
                    pipe.script_load(script.source)
                await pipe.execute()
            pending = missing
        return replies

    async def _round_trip(self, commands: Sequence[Sequence[Any]]) -> list[Any]:
        """Every command in one round trip (a non-transactional pipeline); an error reply is
        its command's result."""
        if self._held is not None and not self._held.busy:
            return await self._held.round_trip(commands)
        pipe = self._redis.pipeline(transaction=False)
        for command in commands:
            # execute_command: a cluster pipeline blocks the evalsha method, not EVALSHA
            # itself, which it routes by its keys' slot.
            pipe.execute_command(*command)
        return await pipe.execute(raise_on_error=False)


def _sequence(value: int) -> str:
    """A sequence as the canonical decimal string the scripts compare."""
    if not SEQUENCE_MIN <= value <= SEQUENCE_MAX:
        raise ValueError(f"sequence outside signed 64-bit: {value}")
    return str(int(value))


def _chunks(raw: Mapping[bytes | str, bytes | str]) -> dict[str, ChunkProgress]:
    return {_text(p): ChunkProgress.decode(_text(value)) for p, value in raw.items()}


def _text(value: bytes | str) -> str:
    """A reply as text, whether or not the client decodes responses."""
    return value.decode() if isinstance(value, bytes) else value

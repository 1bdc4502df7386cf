"""Rebuilding a partition's dedup state from Kafka: PIP-6's recovery, on a Kafka log.

For a set of partitions, in this order:

0. Take each partition's lease (`dedup.ownership.leases`): a partition another live
   instance holds is not recovered here (`NotOwner`). Taking a lease raises its epoch and
   cuts the previous owner off the state at once.
1. Fence what may still land. The lease names its suspects: every instance that opened
   the partition and did not release it cleanly (a crash, a lost lease). Each suspect's
   transactional id is fenced on the partition (`dedup.fencing`): this instance's own
   through `IdempotentWriter.fence`, another's through a `Fencer` of its id. After that
   every write a suspect left in flight is either below the high watermark or never in the
   log. A partition handed over cleanly has no suspect and needs no fence; nor does one no
   instance ever owned whose log is empty with no state or snapshot: its offsets stay
   exactly Kafka's. One with state but no lease history (Redis lost the lease, or an
   older proxy wrote it) fences this instance and every live one.
2. Read each partition's end (high watermark): final, by 1.
3. Read the stored snapshots (`dedup.snapshots`): the newest readable one whose offset is
   not past the end (a snapshot past the end belongs to a log that has since been
   truncated, so it is not trusted); none: replay from the start of the log.
4. Replay [snapshot offset, end) reading each record's identity headers (`dedup.replay`),
   once the transactions open below the end have ended or a bound has passed
   (`dedup.open_transactions`).
5. Merge (highest sequence and latest last-seen per producer; the chunked message in
   progress, which the replay continued from the snapshot's, where it is above the
   producer's highest complete sequence), keep the most recently seen ``max_producers``, and
   load it into Redis as both maps (pushed = persisted) with a new token.

Partitions are independent after step 1: one failing does not hold back the others.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import structlog
from confluent_kafka import TopicPartition

from dedup import metrics
from dedup.batches import IdentityHeaders
from dedup.chunks import ChunkProgress
from dedup.fencing import Fencer
from dedup.open_transactions import (
    Waited,
    decided,
    wait_for_open_transactions,
    watermarks_consumer,
)
from dedup.ownership.leases import UNKNOWN, Held, Lease, PartitionLeases
from dedup.replay import ReplayResult, replay_partition
from dedup.snapshots import APPENDS_PER_PRODUCER, Snapshot, SnapshotStore, StoredSnapshots
from dedup.state import DedupState, RecoveredState, clock_ms
from dedup.topic_ids import TopicIds, recovery_token
from dedup.transaction_deadlines import DeadlineUnknown, TransactionDeadlines
from dedup.writer import IdempotentWriter

log = structlog.get_logger(__name__)

PROGRESS_LOG_S = 5.0

_Key = tuple[str, int]


@dataclass(frozen=True, slots=True)
class RecoveredPartition:
    topic: str
    partition: int
    token: str  # the token Redis now holds for the partition
    end: int  # the replay ended here: the loaded state covers every record below it
    snapshot: Snapshot | None  # the snapshot the replay started from; None: the log start
    next_generation: int  # for the partition's next snapshot
    replayed: int  # records read by the replay
    producers: int
    seconds: float
    state: RecoveredState  # what was loaded (pushed = persisted)
    topic_id: str | None = None  # Kafka's id of the topic it was rebuilt from (None: unknown)
    # Whether another instance may have written the partition since this one last held it
    # (False: a log no one wrote, or this instance recovering again under its own lease).
    unseen_writes: bool = True
    # Per producer loaded, its latest runs in the replayed tail (`ReplayResult.runs`): where
    # the records of a batch it sends again are, if it lies within one
    runs: Mapping[str, Sequence[tuple[int, int, int, int]]] = field(default_factory=dict)
    # Kafka's log start offset as read with `end` (-1: unknown): a duplicate is answered
    # with it until a write here gets a newer one
    log_start: int = -1


# (partition, its recovery still to finish): one that waits for a transaction open in the
# log is finished apart (`Recovery.run`), so that it holds up no other partition.
Later = Callable[[_Key, Awaitable[RecoveredPartition]], None]


class NotOwner(Exception):
    """Another live instance holds the partition's lease."""

    def __init__(self, owner: str) -> None:
        super().__init__(f"owned by instance {owner}")
        self.owner = owner


class LeaseLost(Exception):
    """The lease was taken over while this instance recovered the partition."""


@dataclass(frozen=True, slots=True)
class Owners:
    """What recovery needs of partition ownership (`dedup.service` builds it)."""

    leases: PartitionLeases
    fencer_for: Callable[[str], Fencer]  # a fencer of another instance's transactional id
    live_instances: Callable[[], list[str]]
    granted: Callable[[Lease], None]  # the lease is this instance's now


class Recovery:
    def __init__(
        self,
        writer: IdempotentWriter,
        store: SnapshotStore,
        state: DedupState,
        bootstrap: str,
        headers: IdentityHeaders,
        owners: Owners,
        topic_ids: TopicIds,
        transaction_deadlines: TransactionDeadlines,
        *,
        max_producers: int,
        parallel_replays: int = 4,
        replay_timeout_s: float = 60.0,
        replay_transaction_wait_s: float = 60.0,
        replay_transaction_wait_max_s: float = 930.0,
        kafka_config: Mapping[str, Any] | None = None,
    ) -> None:
        """``kafka_config``: librdkafka settings added to its consumers' (security)."""
        self._kafka_config = dict(kafka_config or {})
        self._owners = owners
        self._topic_ids = topic_ids
        self._writer = writer
        self._store = store
        self._state = state
        self._bootstrap = bootstrap
        self._headers = headers
        self._max_producers = max_producers
        self._replays = asyncio.Semaphore(parallel_replays)
        self._replay_timeout_s = replay_timeout_s
        self._replay_transaction_wait_s = replay_transaction_wait_s
        self._replay_transaction_wait_max_s = replay_transaction_wait_max_s
        self._transaction_deadlines = transaction_deadlines

    async def run(
        self, partitions: Sequence[_Key], later: Later
    ) -> tuple[dict[_Key, RecoveredPartition], dict[_Key, Exception]]:
        """Recover every partition; those that failed come back with their error. Raises
        only when nothing could be done (the fence or the end offsets failed). A partition
        whose log holds a transaction still open below its end is handed to ``later``
        unfinished: its recovery waits for the transaction to end (up to many minutes), and
        must hold up neither the rest of the batch nor the batches after it."""
        started = time.monotonic()
        failed: dict[_Key, Exception] = {}
        leases: dict[_Key, Lease] = {}
        suspects: dict[_Key, tuple[str, ...]] = {}
        unknown: list[_Key] = []  # no lease history: look at the log first
        seen: set[_Key] = set()  # no other instance can have written them meanwhile
        for key, acquired in (await self._owners.leases.acquire(partitions)).items():
            if isinstance(acquired, Held):
                failed[key] = NotOwner(acquired.owner)
                continue
            leases[key] = acquired.lease
            self._owners.granted(acquired.lease)
            named = tuple(s for s in acquired.suspects if s != UNKNOWN)
            if acquired.opened:  # recovering again (state lost, a write ambiguous)
                suspects[key] = (self._owners.leases.instance_id,)
                seen.add(key)
                metrics.LEASES.labels("recovered_again").inc()
            elif UNKNOWN in acquired.suspects and not acquired.has_state:
                suspects[key] = named
                unknown.append(key)
            elif UNKNOWN in acquired.suspects:  # state without lease history
                suspects[key] = (*named, self._owners.leases.instance_id)
                suspects[key] += tuple(self._owners.live_instances())
                metrics.LEASES.labels("taken_over").inc()
            else:
                suspects[key] = named
                metrics.LEASES.labels("taken_over" if named else "handed_over").inc()
        ids = await self._topic_ids_of(list(leases), failed)
        mine = [key for key in leases if key not in failed]
        if not mine:
            return {}, failed
        stored = await self._store.read(mine)
        if unknown:
            marks = await asyncio.to_thread(self._watermarks, unknown)
            for key in unknown:
                if marks[key][1] == 0 and not stored[key].valid and not stored[key].corrupt:
                    metrics.LEASES.labels("acquired_new").inc()
                    seen.add(key)
                    continue  # a log no one wrote: nothing to fence, offsets stay Kafka's
                suspects[key] += (
                    self._owners.leases.instance_id,
                    *self._owners.live_instances(),
                )
                metrics.LEASES.labels("taken_over").inc()
        await self._fence(suspects)
        marks = await asyncio.to_thread(self._watermarks, mine)
        # Asked after the ends: one at or past a partition's end means no transaction is
        # open below it (the last stable offset only grows).
        stable = await asyncio.to_thread(functools.partial(self._watermarks, mine, committed=True))

        waiting = [key for key in mine if self._waits(marks[key], stable[key])]
        deadline_of = self._deadlines_of({key: marks[key][1] for key in waiting})

        async def recover(key: _Key) -> RecoveredPartition:
            result = await self._recover(
                key,
                marks[key],
                stable[key],
                stored[key],
                started,
                leases[key],
                ids[key[0]],
                deadline_of,
            )
            return replace(result, unseen_writes=key not in seen)

        for key in waiting:
            later(key, recover(key))
        now = [key for key in mine if key not in waiting]
        outcomes = await asyncio.gather(*(recover(key) for key in now), return_exceptions=True)
        recovered: dict[_Key, RecoveredPartition] = {}
        for key, outcome in zip(now, outcomes, strict=True):
            if isinstance(outcome, RecoveredPartition):
                recovered[key] = outcome
            elif isinstance(outcome, Exception):
                failed[key] = outcome
            else:
                raise outcome  # CancelledError and the like
        return recovered, failed

    async def _topic_ids_of(
        self, keys: list[_Key], failed: dict[_Key, Exception]
    ) -> dict[str, str | None]:
        """Each topic's id, asked before its log is read: a topic created again after this
        leaves the state bound to the old id, which the engine finds out (`dedup.topic_ids`).
        Asked after, a state rebuilt from the old log could be bound to the new id. A topic
        that does not exist, or is answered with an error, fails its partitions; no answer
        at all fails the batch. One request for all the topics."""
        answers = await self._topic_ids.answers(sorted({topic for topic, _ in keys}))
        ids: dict[str, str | None] = {}
        for topic, answer in answers.items():
            if isinstance(answer, Exception):
                failed.update((key, answer) for key in keys if key[0] == topic)
            else:
                ids[topic] = answer
        return ids

    async def _fence(self, suspects: dict[_Key, tuple[str, ...]]) -> None:
        """Fence every suspect's transactional id on the partitions it is suspected on."""
        by_suspect: dict[str, list[_Key]] = {}
        for key, names in suspects.items():
            for name in set(names):
                by_suspect.setdefault(name, []).append(key)
        me = self._owners.leases.instance_id
        for name, keys in sorted(by_suspect.items()):
            log.info("fencing before takeover", instance=name, partitions=len(keys))
            if name == me:
                await self._writer.fence(sorted(keys))
            else:
                await self._owners.fencer_for(name).fence(sorted(keys))

    async def _recover(
        self,
        key: _Key,
        marks: tuple[int, int],
        committed_marks: tuple[int, int],  # the log start and the last stable offset
        stored: StoredSnapshots,
        started: float,
        lease: Lease,
        topic_id: str | None,
        deadline_of: Callable[[_Key], Awaitable[float]],
    ) -> RecoveredPartition:
        topic, partition = key
        log_start, end = marks
        for problem in stored.corrupt:
            metrics.CORRUPT_SNAPSHOTS.inc()
            log.warning(
                "ignoring an unreadable snapshot", topic=topic, partition=partition, problem=problem
            )
        snapshot = self._choose(key, end, stored, topic_id)
        start = 0 if snapshot is None else snapshot.offset
        if snapshot is not None:
            snapshot = without_reset(snapshot, stored.resets)
        waited = Waited(*committed_marks, seconds=0.0)
        if self._waits(marks, committed_marks):
            # Outside the replays' limit: it may take until Kafka aborts a dead client's.
            wait_s = await self._transaction_wait_s(topic, partition, deadline_of(key))
            log.info(
                "waiting for a transaction open in the log to end before the replay",
                topic=topic,
                partition=partition,
                last_stable_offset=waited.stable,
                end=end,
                wait_s=round(wait_s, 3),
            )
            waited = await wait_for_open_transactions(
                self._bootstrap,
                self._kafka_config,
                TopicPartition(topic, partition),
                end,
                wait_s,
            )
        async with self._replays:
            replayed = await asyncio.to_thread(
                replay_partition,
                self._bootstrap,
                topic,
                partition,
                start,
                end,
                self._headers,
                progress=_progress_logger(topic, partition, end),
                timeout_s=self._replay_timeout_s,
                config=self._kafka_config,
                resets=stored.resets,
                chunks=None
                if snapshot is None
                else {p: c.progress for p, c in snapshot.chunks.items()},
                # Decided stays decided (the last stable offset only grows): not asked again.
                # Undecided, the replay asks afresh, after its wait for a place among replays.
                committed_watermarks=(waited.log_start, waited.stable)
                if waited.decided(end)
                else None,
            )
        metrics.REPLAYED_RECORDS.inc(replayed.records)
        if replayed.uncommitted_from is not None:
            # Should that transaction abort, a re-send of its sequences is dropped (README).
            metrics.REPLAYS_PAST_OPEN_TRANSACTIONS.inc()
            log.warning(
                "a transaction stayed open past the replay's wait; its records counted",
                topic=topic,
                partition=partition,
                read_uncommitted_from=replayed.uncommitted_from,
                end=end,
                waited_s=round(waited.seconds, 3),
            )
        if replayed.truncated_start:
            log.warning(
                "the log no longer starts at the replay's start; replayed from its start",
                topic=topic,
                partition=partition,
                wanted=start,
                log_start=replayed.start,
            )
            log_start = max(log_start, replayed.start)  # the start moved since it was read
        producers, chunks = self._merge(snapshot, replayed)
        token = recovery_token(f"{lease.owner}.{lease.epoch}", topic_id)
        loaded = await self._state.load_recovered(
            topic, partition, producers, token, clock_ms(), chunks, lease.text
        )
        if not loaded:
            raise LeaseLost(f"{topic}/{partition}: lease taken over during the recovery")
        # What was loaded, with the last-seen times Redis settled on (the later of the
        # given and the one it knew): the maps kept in memory start from exactly that.
        view = await self._state.recovered_state(topic, partition, token)
        if view is None:
            raise LeaseLost(f"{topic}/{partition}: state lost right after the recovery")
        generations = [s.generation for s in stored.valid]
        seconds = time.monotonic() - started
        metrics.RECOVERY_SECONDS.observe(seconds)
        log.info(
            "partition recovered",
            topic=topic,
            partition=partition,
            snapshot_offset=None if snapshot is None else snapshot.offset,
            end=end,
            replayed=replayed.records,
            identified=replayed.identified,
            producers=len(producers),
            chunked_in_progress=len(chunks),
            # From there on an open transaction's records counted (`dedup.replay`).
            read_uncommitted_from=replayed.uncommitted_from,
            waited_for_transactions_s=round(waited.seconds, 3),
            seconds=round(seconds, 3),
        )
        return RecoveredPartition(
            topic,
            partition,
            token,
            end,
            snapshot,
            max(generations, default=-1) + 1,
            replayed.records,
            len(producers),
            seconds,
            view,
            topic_id,
            runs=latest_runs(snapshot, replayed.runs, producers.keys()),
            log_start=log_start,
        )

    def _choose(
        self, key: _Key, end: int, stored: StoredSnapshots, topic_id: str | None
    ) -> Snapshot | None:
        topic, partition = key
        earlier = [s for s in stored.valid if _of_another_topic(s, topic_id)]
        if earlier:
            log.warning(
                "ignoring snapshots of an earlier topic of this name (deleted and created again)",
                topic=topic,
                partition=partition,
                topic_id=topic_id,
                their_topic_ids=sorted({str(s.topic_id) for s in earlier}),
            )
            stored = replace(stored, valid=tuple(s for s in stored.valid if s not in earlier))
        usable = [s for s in stored.valid if s.offset <= end]
        if len(usable) < len(stored.valid):
            log.warning(
                "ignoring snapshots past the end of the partition (the log was truncated)",
                topic=topic,
                partition=partition,
                end=end,
                offsets=[s.offset for s in stored.valid if s.offset > end],
            )
        if not usable:
            log.log(
                logging.WARNING if stored.valid or stored.corrupt else logging.INFO,
                "no usable snapshot; replaying from the start of the log",
                topic=topic,
                partition=partition,
            )
            return None
        if usable[0] is not stored.valid[0] or stored.corrupt:
            log.warning(
                "recovering from an older snapshot",
                topic=topic,
                partition=partition,
                offset=usable[0].offset,
            )
        return usable[0]

    def _merge(
        self, snapshot: Snapshot | None, replayed: ReplayResult
    ) -> tuple[dict[str, tuple[int, int]], dict[str, tuple[ChunkProgress, int]]]:
        merged: dict[str, tuple[int, int]] = {}
        snapshot_seen: dict[str, int] = {}
        if snapshot is not None:
            merged = {p: (e.sequence, e.last_seen_ms) for p, e in snapshot.producers.items()}
            snapshot_seen = {p: c.last_seen_ms for p, c in snapshot.chunks.items()}
        for producer, (sequence, seen_ms) in replayed.highest.items():
            known = merged.get(producer)
            if known is None:
                merged[producer] = (sequence, seen_ms)
            else:
                merged[producer] = (max(known[0], sequence), max(known[1], seen_ms))
        # The replay continued the snapshot's messages in progress: its view is the latest.
        chunks = {
            p: (progress, max(seen_ms, snapshot_seen.get(p, 0)))
            for p, (progress, seen_ms) in replayed.chunks.items()
            if p not in merged or progress.sequence > merged[p][0]
        }
        seen = {p: s for p, (_, s) in merged.items()}
        for p, (_, seen_ms) in chunks.items():
            seen[p] = max(seen.get(p, 0), seen_ms)
        if len(seen) > self._max_producers:  # keep the most recently seen
            newest = sorted(seen.items(), key=lambda item: item[1], reverse=True)
            kept = {p for p, _ in newest[: self._max_producers]}
            merged = {p: v for p, v in merged.items() if p in kept}
            chunks = {p: v for p, v in chunks.items() if p in kept}
        return merged, chunks

    def _waits(self, marks: tuple[int, int], committed_marks: tuple[int, int]) -> bool:
        """Whether a partition's recovery will wait for a transaction open below its end."""
        _, stable = committed_marks
        return not decided(stable, marks[1]) and self._replay_transaction_wait_s > 0

    def _deadlines_of(self, ends: dict[_Key, int]) -> Callable[[_Key], Awaitable[float]]:
        """When Kafka will have ended the transactions open below each waiting partition's
        end: asked once for all of them, as each partition's recovery awaits its own (a
        client that died inside a transaction over many partitions is asked about once).
        Raises what the lookup raised, or `DeadlineUnknown` for that partition."""
        lookup = asyncio.ensure_future(self._transaction_deadlines.latest(ends)) if ends else None
        if lookup is not None:  # its error is read even if every waiter was cancelled
            lookup.add_done_callback(lambda done: done.cancelled() or done.exception())

        async def deadline_of(key: _Key) -> float:
            assert lookup is not None and key in ends, "only a waiting partition asks"
            # Shielded: one partition's recovery cancelled must not cancel the others'.
            answer = (await asyncio.shield(lookup))[key]
            if isinstance(answer, DeadlineUnknown):
                raise answer
            return answer

        return deadline_of

    async def _transaction_wait_s(
        self, topic: str, partition: int, deadline: Awaitable[float]
    ) -> float:
        """How long to wait for the transactions open in the partition: until Kafka will
        have aborted them (``deadline``, when it tells it), within
        ``replay_transaction_wait_max_s``; never less than ``replay_transaction_wait_s``,
        the whole wait when it does not."""
        try:
            until_deadline = (await deadline) - time.time()
        except (DeadlineUnknown, OSError, TimeoutError) as exc:
            log.info(
                "the open transactions' deadline is unknown; waiting replay_transaction_wait_s",
                topic=topic,
                partition=partition,
                reason=str(exc) or type(exc).__name__,
            )
            return self._replay_transaction_wait_s
        until_deadline = min(self._replay_transaction_wait_max_s, until_deadline)
        return max(self._replay_transaction_wait_s, until_deadline)

    def _watermarks(
        self, partitions: Sequence[_Key], *, committed: bool = False
    ) -> dict[_Key, tuple[int, int]]:
        """Each partition's log start offset and high watermark (its end), or with
        ``committed`` its last stable offset instead. The end is the high watermark: a
        client's open transaction must not hide the proxy's own later writes from the
        replay."""
        consumer = watermarks_consumer(self._bootstrap, self._kafka_config, committed=committed)
        try:
            return {
                (topic, partition): consumer.get_watermark_offsets(
                    TopicPartition(topic, partition), timeout=30
                )
                for topic, partition in partitions
            }
        finally:
            consumer.close()


def _of_another_topic(snapshot: Snapshot, topic_id: str | None) -> bool:
    """Whether the snapshot was taken of another topic of the same name; one without an id
    (taken before ids were recorded) is judged by its offset alone, as before."""
    return None not in (snapshot.topic_id, topic_id) and snapshot.topic_id != topic_id


def _progress_logger(topic: str, partition: int, end: int) -> Callable[[int, int], None]:
    last = [time.monotonic()]

    def progress(records: int, offset: int) -> None:
        now = time.monotonic()
        if now - last[0] >= PROGRESS_LOG_S:
            last[0] = now
            log.info(
                "replaying",
                topic=topic,
                partition=partition,
                records=records,
                offset=offset,
                end=end,
            )

    return progress


def latest_runs(
    snapshot: Snapshot | None,
    tail: Mapping[str, Sequence[tuple[int, int, int, int]]],
    loaded: Collection[str],
) -> dict[str, list[tuple[int, int, int, int]]]:
    """Per producer loaded, where its latest batches are, oldest first: the appends the
    snapshot carries (below its offset), then the runs the replay followed in the tail
    after it; the latest `APPENDS_PER_PRODUCER`, as (first sequence, records, base
    offset, log append time)."""
    runs: dict[str, list[tuple[int, int, int, int]]] = {}
    if snapshot is not None:
        for producer, appends in snapshot.appends.items():
            if producer in loaded:
                runs[producer] = [
                    (a.first, a.count, a.base_offset, a.log_append_time_ms) for a in appends
                ]
    for producer, followed in tail.items():
        if producer in loaded:
            runs[producer] = [*runs.get(producer, ()), *followed][-APPENDS_PER_PRODUCER:]
    return runs


def without_reset(snapshot: Snapshot, resets: Mapping[str, int]) -> Snapshot:
    """The snapshot without the producers an operator reset at or past its offset: what it
    holds of them may predate the reset (one taken at the reset's offset after the reset
    holds nothing of them; one taken past it holds only what followed the reset)."""
    gone = {name for name, offset in resets.items() if offset >= snapshot.offset}
    names = snapshot.producers.keys() | snapshot.chunks.keys()
    if not gone & names:
        return snapshot
    return snapshot.only(names - gone)

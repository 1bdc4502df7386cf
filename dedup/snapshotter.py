"""Taking snapshots of the partitions this proxy writes, off the produce path.

A partition is snapshotted when ``every_records`` written records have settled since its
last snapshot, or when it changed and ``every_s`` has passed (so a quiet partition still
gets one: Pulsar's issue 8237), and once right after each recovery that replayed anything
(so the next recovery starts there). One snapshot at a time per partition; a failure is
counted, logged and retried with a growing pause.

A snapshot claims "covers every record below O". O is the partition's `AckCursor`
position taken *before* waiting for the acknowledged sequences to reach Redis: every write
below O has settled by then and its sequences are in Redis after the flush, so the map read
next covers them (it may cover later records too, which a replay from O only repeats).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

import structlog
from redis.exceptions import RedisError

from dedup import metrics
from dedup.engine import DedupEngine
from dedup.partitions import PartitionState
from dedup.snapshots import (
    AppendEntry,
    ChunkEntry,
    ProducerEntry,
    Snapshot,
    SnapshotError,
    SnapshotStore,
)
from dedup.state import DedupState, clock_ms
from proxy.runtime import background

log = structlog.get_logger(__name__)

_Key = tuple[str, int]


@dataclass(frozen=True, slots=True)
class SnapshotPolicy:
    every_records: int = 1000
    every_s: float = 120.0
    max_producers: int = 10_000
    appends: bool = True  # each producer's latest batches, for the next owner's answers
    tick_s: float = 1.0
    retry_s: tuple[float, float] = (1.0, 60.0)  # first and longest pause after a failure


class Snapshotter:
    def __init__(
        self,
        engine: DedupEngine,
        state: DedupState,
        store: SnapshotStore,
        policy: SnapshotPolicy,
    ) -> None:
        self._engine = engine
        self._state = state
        self._store = store
        self._policy = policy
        self._task: asyncio.Task[None] | None = None
        self._running: set[asyncio.Task[bool]] = set()

    def start(self) -> None:
        self._task = background.start(self._loop(), "snapshotter")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for task in list(self._running):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def snapshot_changed(self) -> int:
        """A snapshot of every partition changed since its last one (at shutdown, so the
        next start has little to replay); how many were taken."""
        due = [
            (key, state)
            for key, state in self._engine.partition_states().items()
            if state.recovered and self._changed(state)
        ]
        taken = await asyncio.gather(*(self._take_logged(key, state) for key, state in due))
        return sum(taken)

    async def snapshot_now(self, key: _Key) -> Snapshot | None:
        """Take one now (operator request); None when the partition is not recovered."""
        state = self._engine.partition_states().get(key)
        if state is None or not state.recovered:
            return None
        return await self._take(key, state)

    # ------------------------------------------------------------------ the loop

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._policy.tick_s)
            with background.one_pass("snapshotter"):
                self._start_due()

    def _start_due(self) -> None:
        """One pass: a snapshot started for each partition that is due one."""
        now = time.monotonic()
        oldest_ms: int | None = None
        for key, state in list(self._engine.partition_states().items()):
            if not state.recovered:
                continue
            if state.snapshot_ms is not None:
                oldest_ms = min(oldest_ms or state.snapshot_ms, state.snapshot_ms)
            if (
                not state.snapshot_lock.locked()
                and now >= state.snapshot_retry_at
                and self._due(state)
            ):
                task = asyncio.create_task(self._take_logged(key, state))
                self._running.add(task)
                task.add_done_callback(self._running.discard)
        metrics.SNAPSHOT_AGE.set(0 if oldest_ms is None else (clock_ms() - oldest_ms) / 1000)

    def _due(self, state: PartitionState) -> bool:
        if state.snapshot_due:
            return True
        if not self._changed(state):
            return False
        if state.snapshot_offset is None or state.snapshot_ms is None:
            return True  # recovered without a snapshot, or replayed a tail: bound the next one
        if state.cursor.records_settled - state.snapshot_records >= self._policy.every_records:
            return True
        return clock_ms() - state.snapshot_ms >= self._policy.every_s * 1000

    @staticmethod
    def _changed(state: PartitionState) -> bool:
        return (
            state.cursor.records_settled > state.snapshot_records
            or state.snapshot_offset != state.cursor.safe_end
        )

    async def _take_logged(self, key: _Key, state: PartitionState) -> bool:
        try:
            await self._take(key, state)
            state.snapshot_failures = 0
            return True
        except (SnapshotError, RedisError, OSError) as exc:
            metrics.SNAPSHOTS.labels("failed").inc()
            state.snapshot_failures += 1
            first, longest = self._policy.retry_s
            pause = min(first * 2 ** (state.snapshot_failures - 1), longest)
            state.snapshot_retry_at = time.monotonic() + pause
            log.warning(
                "snapshot failed; will retry",
                topic=key[0],
                partition=key[1],
                error=f"{type(exc).__name__}: {exc}",
                retry_in_s=pause,
            )
            return False

    async def _take(self, key: _Key, state: PartitionState) -> Snapshot | None:
        topic, partition = key
        async with state.snapshot_lock:
            token = state.token
            offset = state.cursor.safe_end  # before the flush: see the module's docstring
            records = state.cursor.records_settled
            await self._engine.flush_persisted()
            view = await self._state.recovered_state(topic, partition, token)
            if view is None or state.token != token or not state.recovered:
                return None  # lost or being recovered: the recovery takes its own
            if state.sequences is not None and state.sequences.token == token:
                # The maps the owner keeps: Redis still holds the token (this instance
                # still owns the partition), but its copy may lag in last-seen times.
                view = state.sequences.persisted_state()
            # Where the producers' latest batches are: the next owner answers their re-sends
            appends = {}
            if self._policy.appends:
                appends = self._engine.latest_appends(key, token, offset)
            snapshot = Snapshot(
                topic=topic,
                partition=partition,
                offset=offset,
                created_ms=clock_ms(),
                generation=state.snapshot_generation,
                producers={p: ProducerEntry(s, seen) for p, (s, seen) in view.producers.items()},
                # Chunked messages in progress: a recovery continues them exactly.
                chunks={p: ChunkEntry(c, seen) for p, (c, seen) in view.chunks.items()},
                topic_id=state.topic_id,
                appends={
                    p: tuple(
                        AppendEntry(a.first, a.count, a.base_offset, a.log_append_time_ms)
                        for a in latest
                    )
                    for p, latest in appends.items()
                    if p in view.producers
                },
            ).capped(self._policy.max_producers)
            fitted, encoded = snapshot.within_bytes()
            if fitted is not snapshot:
                metrics.SNAPSHOT_PRODUCERS_DROPPED.inc(
                    len(snapshot.producers)
                    + len(snapshot.chunks)
                    - len(fitted.producers)
                    - len(fitted.chunks)
                )
                log.warning(
                    "snapshot over its byte bound: the least recently seen producers left out",
                    topic=topic,
                    partition=partition,
                    kept=len(fitted.producers),
                    of=len(snapshot.producers),
                )
                snapshot = fitted
            await self._store.write(snapshot, encoded)
            state.snapshot_generation += 1
            state.snapshot_offset = offset
            state.snapshot_ms = snapshot.created_ms
            state.snapshot_records = records
            state.snapshot_due = False
            metrics.SNAPSHOTS.labels("taken").inc()
            log.info(
                "snapshot taken",
                topic=topic,
                partition=partition,
                offset=offset,
                generation=snapshot.generation,
                producers=len(snapshot.producers),
            )
            return snapshot

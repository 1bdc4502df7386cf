"""Recording what Kafka acknowledged (``persisted``) off the client's path.

The client's answer does not wait for Redis: acknowledged sequences are queued, merged
(the highest per producer) and written by one background flusher, so under load many
requests share one round trip and the hot path keeps a single Redis round trip (the
check). The flusher lingers a moment (`linger_s`, 5 ms by default) before it writes, so that
a producer's pipelined requests share one write instead of one each; and the check of a
partition takes that partition's updates with it (`take`, recorded first in the check's
own round trip), so a re-send right after an acknowledgement reads as the duplicate it
is. Under load that halves the proxy's Redis calls. Until an update lands, a re-send of an
acknowledged record reads as UNKNOWN (refused, retried), never as new; every reader that
needs the exact value (the reset after a failed write, the admin API, shutdown, a snapshot)
calls `flush` first.

Each update carries the partition's recovery token. If Redis no longer holds it (flushed,
restarted empty, replaced), nothing is recorded and `on_lost` is told: the recovery that
follows reads those sequences back from the log, which holds them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping

import structlog
from redis.exceptions import RedisError

from dedup.ports import Clock, PersistedStore, SystemClock
from dedup.state import Acked, Persisted, persisted_position

log = structlog.get_logger(__name__)


_Key = tuple[str, int, str]  # topic, partition, token ("" = any)


class PersistedRecorder:
    def __init__(
        self,
        state: PersistedStore,
        retry_backoff_s: float = 0.1,
        on_lost: Callable[[str, int, str], None] | None = None,
        *,
        clock: Clock | None = None,
        linger_s: float = 0.005,
    ) -> None:
        self._state = state
        self._retry_backoff_s = retry_backoff_s
        self._linger_s = linger_s
        self._hurry = asyncio.Event()  # set by `flush`: a reader waits, write without lingering
        self._on_lost = on_lost
        self._clock = clock or SystemClock()
        self._pending: dict[_Key, dict[str, Persisted]] = {}
        self._taken: dict[int, list[_Key]] = {}  # id(Acked) -> its keys, on their way
        self._writing: dict[_Key, dict[str, Persisted]] = {}  # the flusher's write under way
        self._flusher: asyncio.Task[None] | None = None
        self._idle = asyncio.Event()
        self._idle.set()

    def add(
        self, topic: str, partition: int, highest: Mapping[str, Persisted], token: str = ""
    ) -> None:
        """Queue ``persisted[p] = max(persisted[p], s)`` for each producer of a write, if
        the partition still holds `token` (s: a sequence, or a chunk's position)."""
        if not highest:
            return
        self._merge({(topic, partition, token): dict(highest)})
        self._ensure_flusher()

    def _ensure_flusher(self) -> None:
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush_all(), name="persisted-flusher")

    def _settle(self) -> None:
        """Idle once nothing is queued, being written, or on its way with a check."""
        flushing = self._flusher is not None and not self._flusher.done()
        if not self._pending and not self._taken and not flushing:
            self._hurry.clear()
            self._idle.set()

    def take(self, partitions: set[tuple[str, int]]) -> Acked | None:
        """The updates queued for these partitions, for a check to record first (hand the
        result back with `taken_done`); None when there is none. Those of the flusher's
        write under way go too (a copy): that write may land after the check."""
        taken = {key: self._writing[key] for key in self._writing if key[:2] in partitions}
        for key in [key for key in self._pending if key[:2] in partitions]:
            taken[key] = _highest(taken.get(key, {}), self._pending.pop(key))
        if not taken:
            return None
        keys = list(taken)
        acked = Acked(
            [
                (topic, partition, taken[(topic, partition, token)])
                for topic, partition, token in keys
            ],
            [token or None for _, _, token in keys],
        )
        self._taken[id(acked)] = keys
        return acked

    def taken_done(self, acked: Acked) -> None:
        """What became of updates handed out by `take`: recorded (`acked.lost` set), or
        queued again for the flusher (recording twice is harmless)."""
        keys = self._taken.pop(id(acked))
        if acked.lost is None:
            self._merge(
                {key: highest for key, (_, _, highest) in zip(keys, acked.updates, strict=True)}
            )
            self._ensure_flusher()
        elif self._on_lost is not None:
            for i in acked.lost:
                self._on_lost(*keys[i])
        self._settle()

    async def flush(self) -> None:
        """Return once everything added so far is in Redis."""
        if not self._idle.is_set():
            self._hurry.set()
        await self._idle.wait()

    def _merge(self, updates: Mapping[_Key, Mapping[str, Persisted]]) -> None:
        self._idle.clear()
        for key, highest in updates.items():
            self._pending[key] = _highest(self._pending.get(key, {}), highest)

    async def _linger(self) -> None:
        """Let the acks of requests already in flight join this write (unless a reader
        waits for it)."""
        if self._linger_s <= 0 or self._hurry.is_set():
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._hurry.wait(), self._linger_s)

    async def _flush_all(self) -> None:
        delay = self._retry_backoff_s
        while self._pending:
            await self._linger()
            if not self._pending:  # taken meanwhile by checks (`take`)
                break
            batch, self._pending = self._pending, {}
            self._writing = batch
            keys = list(batch)
            try:
                lost = await self._state.mark_persisted(
                    [
                        (topic, partition, batch[(topic, partition, t)])
                        for topic, partition, t in keys
                    ],
                    self._clock.clock_ms(),
                    [token or None for _, _, token in keys],
                )
                delay = self._retry_backoff_s
                self._writing = {}
            except RedisError as exc:
                self._writing = {}
                # Never dropped: until it lands, re-sends are refused, not duplicated.
                log.error("could not record persisted sequences; retrying", error=str(exc))
                self._merge(batch)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            if self._on_lost is not None:
                for i in lost:
                    self._on_lost(*keys[i])
        self._flusher = None  # done: `_settle` must not wait for this very task
        self._settle()


def _highest(known: Mapping[str, Persisted], more: Mapping[str, Persisted]) -> dict[str, Persisted]:
    """Both updates in one: the highest position per producer."""
    merged = dict(known)
    for producer, position in more.items():
        have = merged.get(producer)
        if have is None or persisted_position(position) > persisted_position(have):
            merged[producer] = position
    return merged

"""Recording what Kafka acknowledged (``persisted``) off the client's path.

The client's answer does not wait for Redis: acknowledged sequences are queued, merged
(the highest per producer) and written by one background flusher, so under load many
requests share one round trip and the hot path keeps a single Redis round trip (the
check). The flusher lingers a moment (`linger_s`, 5 ms by default) before it writes, so that
a producer's pipelined requests share one write instead of one each: under load that
halves the proxy's Redis calls. Until a flush lands, a re-send of an acknowledged record
reads as UNKNOWN (refused, retried), never as new; every reader that needs the exact value
(the reset after a failed write, the admin API, shutdown, a snapshot) calls `flush` first.

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
from dedup.state import Persisted, persisted_position

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
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush_all(), name="persisted-flusher")

    async def flush(self) -> None:
        """Return once everything added so far is in Redis."""
        if not self._idle.is_set():
            self._hurry.set()
        await self._idle.wait()

    def _merge(self, updates: Mapping[_Key, Mapping[str, Persisted]]) -> None:
        self._idle.clear()
        for key, highest in updates.items():
            merged = self._pending.setdefault(key, {})
            for producer, position in highest.items():
                known = merged.get(producer)
                if known is None or persisted_position(position) > persisted_position(known):
                    merged[producer] = position

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
            batch, self._pending = self._pending, {}
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
            except RedisError as exc:
                # Never dropped: until it lands, re-sends are refused, not duplicated.
                log.error("could not record persisted sequences; retrying", error=str(exc))
                self._merge(batch)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            if self._on_lost is not None:
                for i in lost:
                    self._on_lost(*keys[i])
        self._hurry.clear()
        self._idle.set()

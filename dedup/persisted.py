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
calls `flush` first, which waits for what was queued before it only (each queued entry
carries a future resolved once it is in Redis), so a steady stream of acknowledgements
never holds a reader back.

Each update carries the partition's recovery token. If Redis no longer holds it (flushed,
restarted empty, replaced), nothing is recorded and `on_lost` is told: the recovery that
follows reads those sequences back from the log, which holds them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable, Mapping

import structlog
from redis.exceptions import RedisError

from dedup.ports import Clock, PersistedStore, SystemClock
from dedup.state import Acked, Persisted, persisted_position
from proxy.runtime.metrics import BACKGROUND_PASS_ERRORS

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
        # What is queued, per partition and token, and the future resolved once it is in
        # Redis (by the flusher, or by a check that took it).
        self._pending: dict[_Key, dict[str, Persisted]] = {}
        self._pending_done: dict[_Key, asyncio.Future[None]] = {}
        self._writing: dict[_Key, dict[str, Persisted]] = {}  # the flusher's write under way
        self._writing_done: list[asyncio.Future[None]] = []
        # id(Acked) -> its keys, and the futures of those it took from the queue
        self._taken: dict[int, tuple[list[_Key], dict[_Key, asyncio.Future[None]]]] = {}
        self._flusher: asyncio.Task[None] | None = None

    def add(
        self, topic: str, partition: int, highest: Mapping[str, Persisted], token: str = ""
    ) -> None:
        """Queue ``persisted[p] = max(persisted[p], s)`` for each producer of a write, if
        the partition still holds `token` (s: a sequence, or a chunk's position)."""
        if not highest:
            return
        self._queue((topic, partition, token), highest, None)
        self._ensure_flusher()

    def take(self, partitions: set[tuple[str, int]]) -> Acked | None:
        """The updates queued for these partitions, for a check to record first (hand the
        result back with `taken_done`); None when there is none. Those of the flusher's
        write under way go too (a copy): that write may land after the check."""
        taken = {key: self._writing[key] for key in self._writing if key[:2] in partitions}
        done: dict[_Key, asyncio.Future[None]] = {}
        for key in [key for key in self._pending if key[:2] in partitions]:
            taken[key] = _highest(taken.get(key, {}), self._pending.pop(key))
            done[key] = self._pending_done.pop(key)
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
        self._taken[id(acked)] = (keys, done)
        return acked

    def taken_done(self, acked: Acked) -> None:
        """What became of updates handed out by `take`: recorded (`acked.lost` set), or
        queued again for the flusher (recording twice is harmless)."""
        keys, done = self._taken.pop(id(acked))
        if acked.lost is None:
            # Queued again: their readers now wait for the flusher's write of them.
            for key, (_, _, highest) in zip(keys, acked.updates, strict=True):
                self._queue(key, highest, done.get(key))
            self._ensure_flusher()
            return
        if self._on_lost is not None:
            for i in acked.lost:
                self._on_lost(*keys[i])
        _resolve(done.values())

    async def flush(self) -> None:
        """Return once everything added so far is in Redis (what is added meanwhile is not
        waited for)."""
        waits = [
            *self._pending_done.values(),
            *self._writing_done,
            *(f for _, done in self._taken.values() for f in done.values()),
        ]
        if waits:
            self._hurry.set()
            # asyncio.wait, not gather: a reader that gives up (a timeout) must not cancel
            # futures other readers wait on.
            await asyncio.wait(waits)

    def _queue(
        self, key: _Key, highest: Mapping[str, Persisted], done: asyncio.Future[None] | None
    ) -> None:
        self._pending[key] = _highest(self._pending.get(key, {}), highest)
        if key not in self._pending_done:
            self._pending_done[key] = asyncio.get_running_loop().create_future()
        if done is not None:
            _chain(self._pending_done[key], done)

    def _ensure_flusher(self) -> None:
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush_all(), name="persisted-flusher")

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
            self._hurry.clear()
            batch, self._pending = self._pending, {}
            done, self._pending_done = self._pending_done, {}
            self._writing, self._writing_done = batch, list(done.values())
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
            except Exception as exc:
                # Never dropped: until it lands, re-sends are refused, not duplicated. An
                # error nobody foresaw is retried too: ending the flusher would leave the
                # readers waiting for this write (a snapshot, a handoff) waiting forever.
                if isinstance(exc, RedisError):
                    log.error("could not record persisted sequences; retrying", error=str(exc))
                else:
                    BACKGROUND_PASS_ERRORS.labels("persisted-flusher").inc()
                    log.exception("recording persisted sequences failed unexpectedly; retrying")
                self._writing, self._writing_done = {}, []
                for key, highest in batch.items():
                    self._queue(key, highest, done[key])
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            self._writing, self._writing_done = {}, []
            delay = self._retry_backoff_s
            if self._on_lost is not None:
                for i in lost:
                    self._on_lost(*keys[i])
            _resolve(done.values())


def _chain(source: asyncio.Future[None], target: asyncio.Future[None]) -> None:
    """`target` resolves when `source` does."""
    source.add_done_callback(lambda _: _resolve([target]))


def _resolve(futures: Iterable[asyncio.Future[None]]) -> None:
    for future in futures:
        if not future.done():
            future.set_result(None)


def _highest(known: Mapping[str, Persisted], more: Mapping[str, Persisted]) -> dict[str, Persisted]:
    """Both updates in one: the highest position per producer."""
    merged = dict(known)
    for producer, position in more.items():
        have = merged.get(producer)
        if have is None or persisted_position(position) > persisted_position(have):
            merged[producer] = position
    return merged

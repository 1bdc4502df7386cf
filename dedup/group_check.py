"""Checks that arrive while one is on its way to Redis go together in the next round trip.

A partition's requests are checked in their order of arrival: the check of request n+1
must see what the check of request n pushed. Waiting for n's answer before sending n+1's
makes the round trip to Redis the pace of a partition (one request per round trip, however
many a client pipelines). Here the checks queue instead: while one round trip is under
way, every check that arrives waits, and all of them go in the next one, in the order they
were queued. Redis runs a round trip's scripts one after the other, so each check still
sees what the ones before it pushed, exactly as if each had waited for the one before.

What a check must not see is what the engine decides *after* an earlier verdict (a request
refused, so those behind it must be refused too): the engine applies that to the later
verdicts when they come back (`DedupEngine._judge`), and undoes what such a check pushed
by resetting the partition, as it does for a write that failed.

Acknowledged positions not yet in Redis for the round trip's partitions go first in it
(`PersistedRecorder.take`), so a re-send of a record just acknowledged reads as the
duplicate it is.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

from dedup import metrics
from dedup.persisted import PersistedRecorder
from dedup.ports import Clock, StateStore
from dedup.state import PartitionCheck, PartitionVerdict

_Waiting = tuple[Sequence[PartitionCheck], "asyncio.Future[list[PartitionVerdict]]"]


class GroupCheck:
    def __init__(self, state: StateStore, persisted: PersistedRecorder, clock: Clock) -> None:
        self._state = state
        self._persisted = persisted
        self._clock = clock
        self._waiting: list[_Waiting] = []
        self._sender: asyncio.Task[None] | None = None

    def queue(self, checks: Sequence[PartitionCheck]) -> asyncio.Future[list[PartitionVerdict]]:
        """Queue these checks behind every one queued before (synchronous: the order of
        calls is the order Redis runs them); their verdicts, in the same order, or the
        round trip's exception (`RedisError`: the scripts may or may not have run)."""
        verdicts: asyncio.Future[list[PartitionVerdict]] = (
            asyncio.get_running_loop().create_future()
        )
        self._waiting.append((checks, verdicts))
        if self._sender is None:
            self._sender = asyncio.create_task(self._send_while_waiting())
        return verdicts

    async def close(self) -> None:
        """Stop: a round trip under way is abandoned, its callers and those queued are
        cancelled (as on any shutdown, the next start recovers what they touched)."""
        sender = self._sender
        if sender is not None:
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sender

    async def _send_while_waiting(self) -> None:
        group: list[_Waiting] = []
        try:
            while self._waiting:
                group, self._waiting = self._waiting, []
                await self._send(group)
                group = []
        finally:
            self._sender = None
            for _, verdicts in [*group, *self._waiting]:  # only when cancelled (shutdown)
                verdicts.cancel()
            self._waiting = []

    async def _send(self, group: list[_Waiting]) -> None:
        checks = [check for queued, _ in group for check in queued]
        acked = self._persisted.take({(c.topic, c.partition) for c in checks})
        metrics.CHECK_ROUND_TRIPS.inc()
        metrics.CHECKED_REQUESTS.inc(len(group))
        try:
            verdicts = await self._state.check_and_push(checks, self._clock.clock_ms(), acked)
        except Exception as exc:  # every caller gets it, and decides
            for _, waiting in group:
                if not waiting.done():
                    waiting.set_exception(exc)
            return
        finally:
            if acked is not None:
                self._persisted.taken_done(acked)
        at = 0
        for queued, waiting in group:
            if not waiting.done():  # a caller that gave up (cancelled) is not told
                waiting.set_result(verdicts[at : at + len(queued)])
            at += len(queued)

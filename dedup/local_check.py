"""The check against the maps the owner keeps in memory (`dedup.sequences`).

The same interface as `dedup.group_check.GroupCheck` (the check in Redis), so the engine
runs either the same way: `queue` takes a request's checks in its place in line and gives
back their verdicts, here at once, with no round trip. The maps of a partition are the ones
its latest recovery loaded here (`opened`); a check under an older token, or of a
partition not recovered here, is answered "lost", as Redis answers one whose token it no
longer holds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from dedup import metrics
from dedup.partitions import Key, PartitionStates
from dedup.ports import Clock
from dedup.recovery import RecoveredPartition
from dedup.sequences import PartitionSequences
from dedup.state import PartitionCheck, PartitionVerdict

_LOST = PartitionVerdict((), (), lost=True)


class LocalCheck:
    def __init__(
        self,
        partitions: PartitionStates,
        clock: Clock,
        *,
        max_producers: int = 10_000,
        max_sequence_jump: int = 0,
    ) -> None:
        self._partitions = partitions
        self._clock = clock
        self._max_producers = max_producers
        self._max_jump = max_sequence_jump

    def opened(self, key: Key, recovered: RecoveredPartition) -> None:
        """A recovery loaded the partition: its maps, under the recovery's token."""
        self._partitions.of(key).sequences = PartitionSequences.recovered(
            recovered.token,
            recovered.state.producers,
            recovered.state.chunks,
            max_producers=self._max_producers,
            max_jump=self._max_jump,
        )

    def queue(self, checks: Sequence[PartitionCheck]) -> asyncio.Future[list[PartitionVerdict]]:
        """Check now, in the caller's place in line; the verdicts, in the same order."""
        now_ms = self._clock.clock_ms()
        verdicts = []
        for check in checks:
            state = self._partitions.get((check.topic, check.partition))
            table = None if state is None else state.sequences
            verdicts.append(_LOST if table is None else table.check(check, now_ms))
        metrics.CHECKED_REQUESTS.inc()
        answered: asyncio.Future[list[PartitionVerdict]] = (
            asyncio.get_running_loop().create_future()
        )
        answered.set_result(verdicts)
        return answered

    async def close(self) -> None:
        """Nothing under way: every check was answered when it was queued."""

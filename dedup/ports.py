"""What the dedup engine needs of the world, as small Protocols.

The composition root (`dedup.service`) passes the real ones: `dedup.state.DedupState`,
`dedup.writer.IdempotentWriter`, `dedup.recovery.Recovery`, `dedup.policies.PolicyStore`,
`dedup.topic_ids.TopicIds`,
`SystemClock`. Unit tests pass in-memory fakes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Protocol

from dedup.ownership.owner import Redirect
from dedup.partitions import Key
from dedup.policies import PolicySnapshot
from dedup.recovery import Later, RecoveredPartition
from dedup.state import Acked, PartitionCheck, PartitionVerdict, Persisted, clock_ms
from dedup.writer import BatchToWrite, WriteResult
from proxy.kafka.topology import Endpoint


class PersistedStore(Protocol):
    """Where acknowledged positions are recorded (`dedup.persisted.PersistedRecorder`)."""

    async def mark_persisted(
        self,
        updates: Sequence[tuple[str, int, Mapping[str, Persisted]]],
        now_ms: int,
        tokens: Sequence[str | None] | None = None,
    ) -> list[int]: ...


class StateStore(PersistedStore, Protocol):
    """The pushed / persisted maps (`dedup.state.DedupState`): the check and its undo."""

    async def check_and_push(
        self, checks: Sequence[PartitionCheck], now_ms: int, acked: Acked | None = None
    ) -> list[PartitionVerdict]: ...

    async def reset_pushed(self, topic: str, partition: int, token: str | None = None) -> bool: ...

    async def forget_producers(
        self, topic: str, partition: int, producers: Sequence[str]
    ) -> bool: ...


class Writer(Protocol):
    """The proxy's idempotent producer (`dedup.writer.IdempotentWriter`)."""

    async def submit(
        self, broker: Endpoint, batches: Sequence[BatchToWrite], timeout_ms: int
    ) -> asyncio.Future[list[WriteResult]]: ...

    def forget(self, topic: str, partition: int) -> bool: ...


class PartitionRecovery(Protocol):
    """Rebuilding partitions' state from the log (`dedup.recovery.Recovery`)."""

    async def run(
        self, partitions: Sequence[Key], later: Later
    ) -> tuple[dict[Key, RecoveredPartition], dict[Key, Exception]]: ...


class TopicIdLookup(Protocol):
    """Kafka's id of a topic, asked now (`dedup.topic_ids.TopicIds`)."""

    async def of(self, topic: str, broker: Endpoint | None = None) -> str | None: ...

    async def answers(
        self, topics: Sequence[str], broker: Endpoint | None = None
    ) -> dict[str, str | Exception | None]:
        """Each topic's id, None, or its error (`dedup.topic_ids.UnknownTopic`: deleted)."""


class Policies(Protocol):
    """The dedup mode of every topic (`dedup.policies.PolicyStore`)."""

    async def snapshot(self) -> PolicySnapshot: ...


class Owners(Protocol):
    """Which instance owns each partition (`dedup.ownership.owner.Ownership`)."""

    def ready(self) -> bool: ...

    def serves_here(self, key: Key) -> bool: ...

    def holds(self, key: Key) -> bool: ...

    def lease_valid(self, key: Key) -> bool: ...

    def redirect(self, key: Key, holder: str | None = None) -> Redirect | None: ...

    async def learn_leader(self, key: Key) -> tuple[int, int] | None:
        """Raises `proxy.runtime.cluster.NoSuchPartition` (Kafka has no such partition)."""

    def let_go(self, key: Key) -> bool:
        """Give up the partition's lease (its topic was deleted); whether that started now."""


class Clock(Protocol):
    """Wall-clock milliseconds, the last-seen times the state keeps."""

    def clock_ms(self) -> int: ...


class SystemClock:
    def clock_ms(self) -> int:
        return clock_ms()

"""Everything dedup needs at run time, built from the proxy's settings and closed in order."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import cast

import redis.asyncio
import structlog

from dedup.batches import IdentityHeaders
from dedup.engine import DedupEngine
from dedup.policies import Mode, PolicyStore
from dedup.state import DedupState, clock_ms
from dedup.writer import IdempotentWriter, LeaderLookup
from proxy.config import ProxySettings
from proxy.topology import Endpoint

log = structlog.get_logger(__name__)

PURGE_INTERVAL_S = 300.0


class DedupService:
    def __init__(
        self,
        settings: ProxySettings,
        bootstrap: Callable[[], Sequence[Endpoint]],
        leader_of: LeaderLookup,
    ) -> None:
        self.settings = settings
        self.redis = redis.asyncio.from_url(settings.redis)
        prefix = settings.redis_key_prefix
        self.state = DedupState(
            self.redis, key_prefix=prefix, max_producers=settings.max_producers_per_partition
        )
        self.policies = PolicyStore(
            self.redis,
            Mode.ENABLED if settings.dedup else Mode.DISABLED,
            key_prefix=prefix,
            cache_s=settings.policy_cache_s,
        )
        self.writer = IdempotentWriter(
            bootstrap, leader_of, timeout_s=settings.upstream_connect_timeout_s
        )
        self.engine = DedupEngine(
            self.state,
            self.policies,
            self.writer,
            IdentityHeaders(settings.dedup_producer_header, settings.dedup_sequence_header),
        )
        self._purge_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        try:
            await cast(Awaitable[bool], self.redis.ping())
        except redis.RedisError as exc:
            # Not fatal: produce requests are refused (retriable) until Redis answers.
            log.error("Redis not reachable at start", redis=self.settings.redis, error=str(exc))
        self._purge_task = asyncio.create_task(self._purge_loop(), name="purge-idle-producers")

    async def close(self) -> None:
        try:
            await asyncio.wait_for(self.engine.flush_persisted(), 10)
        except TimeoutError:
            log.error("shutting down with acknowledged sequences not yet recorded in Redis")
        if self._purge_task is not None:
            self._purge_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._purge_task
        await self.writer.close()
        await self.redis.aclose()

    async def _purge_loop(self) -> None:
        idle_ms = int(self.settings.producer_idle_timeout_s * 1000)
        while True:
            await asyncio.sleep(min(PURGE_INTERVAL_S, self.settings.producer_idle_timeout_s))
            for topic, partition in self.engine.partitions():
                try:
                    purged = await self.state.purge_idle(topic, partition, clock_ms() - idle_ms)
                except redis.RedisError as exc:
                    log.warning("idle producer purge failed", error=str(exc))
                    break
                if purged:
                    log.info(
                        "purged idle producers", topic=topic, partition=partition, producers=purged
                    )

"""Dedup policies: Pulsar's broker flag, namespace and topic policies, on Kafka topic names.

A policy is one of three modes:

- ``enabled``: records with an identity are deduplicated, records without one pass.
- ``require``: like enabled, and a record without identity is refused (INVALID_RECORD).
- ``disabled``: everything passes untouched.

The most specific policy wins: a topic's own, then the longest matching topic prefix (the
namespace analogue), then the global one stored in Redis, then the proxy's start-up
default (enabled; ``serve --no-dedup`` makes it disabled). Policies live in Redis so that
every proxy instance sees a change within ``cache_s`` seconds, without a restart.

A value in Redis that is no mode (written there by hand) is ignored, as a Kafka broker
ignores an invalid dynamic config: the next less specific policy applies, the proxy logs
it once, and the admin API lists it under ``invalid`` until it is fixed or cleared.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from typing import cast

import structlog
from redis.asyncio import Redis, RedisCluster
from redis.exceptions import RedisError

log = structlog.get_logger(__name__)


class Mode(enum.StrEnum):
    ENABLED = "enabled"
    REQUIRE = "require"
    DISABLED = "disabled"


@dataclass(frozen=True, slots=True)
class PolicySnapshot:
    default: Mode
    global_mode: Mode | None = None
    prefixes: Mapping[str, Mode] = field(default_factory=dict)
    topics: Mapping[str, Mode] = field(default_factory=dict)
    # Values in Redis that are no mode, by scope ("global", "prefix <p>", "topic <t>").
    invalid: Mapping[str, str] = field(default_factory=dict)

    def mode_for(self, topic: str) -> Mode:
        if topic in self.topics:
            return self.topics[topic]
        matching = [prefix for prefix in self.prefixes if topic.startswith(prefix)]
        if matching:
            return self.prefixes[max(matching, key=len)]
        return self.global_mode if self.global_mode is not None else self.default

    @property
    def dedup_anywhere(self) -> bool:
        """Whether any topic at all can have dedup on (else Produce needs no decoding)."""
        fallback = self.global_mode if self.global_mode is not None else self.default
        return any(
            mode is not Mode.DISABLED
            for mode in (fallback, *self.prefixes.values(), *self.topics.values())
        )

    def to_json(self) -> dict[str, object]:
        return {
            "default": self.default.value,
            "global": None if self.global_mode is None else self.global_mode.value,
            "prefixes": {k: v.value for k, v in sorted(self.prefixes.items())},
            "topics": {k: v.value for k, v in sorted(self.topics.items())},
            "invalid": dict(sorted(self.invalid.items())),
        }


class PolicyStore:
    def __init__(
        self,
        redis: Redis | RedisCluster,
        default: Mode,
        key_prefix: str = "dedup",
        cache_s: float = 1.0,
    ) -> None:
        self._redis = redis
        self._default = default
        self._global_key = f"{key_prefix}:policy:global"
        self._prefixes_key = f"{key_prefix}:policy:prefixes"
        self._topics_key = f"{key_prefix}:policy:topics"
        self._cache_s = cache_s
        self._cached: PolicySnapshot | None = None
        self._cached_at = 0.0
        self._invalid_logged: Mapping[str, str] = {}

    async def snapshot(self, fresh: bool = False) -> PolicySnapshot:
        """The policies, read again once older than ``cache_s`` (``fresh``: now).

        When Redis does not answer, the policies last read serve on: the check needs Redis
        too, so nothing is written meanwhile and the client is answered "retry" by the
        engine rather than disconnected here. ``fresh`` (the admin API) and a proxy that
        has not read them yet raise instead."""
        now = time.monotonic()
        if fresh or self._cached is None or now - self._cached_at > self._cache_s:
            try:
                read = await self._read()
            except RedisError:
                if fresh or self._cached is None:
                    raise
                return self._cached
            self._cached, self._cached_at = read, now
        return self._cached

    async def _read(self) -> PolicySnapshot:
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.get(self._global_key)
            pipe.hgetall(self._prefixes_key)
            pipe.hgetall(self._topics_key)
            global_raw, prefixes, topics = await pipe.execute()
        invalid: dict[str, str] = {}
        global_modes = _modes("global", {} if global_raw is None else {"": global_raw}, invalid)
        snapshot = PolicySnapshot(
            default=self._default,
            global_mode=global_modes.get(""),
            prefixes=_modes("prefix", prefixes, invalid),
            topics=_modes("topic", topics, invalid),
            invalid=invalid,
        )
        self._log_invalid_once(invalid)
        return snapshot

    def _log_invalid_once(self, invalid: Mapping[str, str]) -> None:
        """Log the invalid values when they change, not on every read (every second)."""
        if invalid == self._invalid_logged:
            return
        self._invalid_logged = invalid
        if invalid:
            log.error(
                "invalid dedup policies in Redis are ignored; the next less specific applies",
                invalid=dict(invalid),
                modes=[mode.value for mode in Mode],
            )
        else:
            log.info("no invalid dedup policies in Redis any more")

    async def mode_for(self, topic: str) -> Mode:
        return (await self.snapshot()).mode_for(topic)

    async def set_global(self, mode: Mode | None) -> None:
        if mode is None:
            await self._redis.delete(self._global_key)
        else:
            await self._redis.set(self._global_key, mode.value)
        self._cached = None

    async def set_prefix(self, prefix: str, mode: Mode | None) -> None:
        await self._set_field(self._prefixes_key, prefix, mode)

    async def set_topic(self, topic: str, mode: Mode | None) -> None:
        await self._set_field(self._topics_key, topic, mode)

    async def _set_field(self, key: str, name: str, mode: Mode | None) -> None:
        if not name:
            raise ValueError("a policy needs a non-empty topic or prefix")
        if mode is None:
            await cast(Awaitable[int], self._redis.hdel(key, name))
        else:
            await cast(Awaitable[int], self._redis.hset(key, name, mode.value))
        self._cached = None


def _modes(
    scope: str, raw: Mapping[bytes | str, bytes | str], invalid: dict[str, str]
) -> dict[str, Mode]:
    """The valid modes of one scope's entries; the others go to ``invalid``."""
    modes: dict[str, Mode] = {}
    for name, value in raw.items():
        name_text, value_text = _text(name), _text(value)
        try:
            modes[name_text] = Mode(value_text)
        except ValueError:
            invalid[f"{scope} {name_text}" if name_text else scope] = value_text
    return modes


def _text(value: bytes | str) -> str:
    return value.decode(errors="backslashreplace") if isinstance(value, bytes) else value

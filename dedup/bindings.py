"""Producer names bound to principals: on a topic, a producer name belongs to the
principal whose client first used it (or, for names under a configured prefix, to the
principal the prefix names), so an authenticated client cannot write under another
client's producer name (and make its records read as duplicates).

Only authenticated connections (SASL, or a client certificate: `proxy.filters.principal`)
are checked and bind names; an anonymous connection is not checked. The binding lives in
Redis, one hash per topic (name -> principal), shared by every instance of a group and set
with HSETNX, so two instances that see a new name at once agree on its owner. Bindings are
cached in memory for `cache_s`: they change only when an operator releases one (`release`;
releases one, other instances notice within `cache_s`), so a known name costs nothing on
the hot path.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

# Beyond this many cached names, the cache starts over (the Redis hash keeps them all).
MAX_CACHED = 200_000


class ProducerBindings:
    def __init__(
        self,
        redis: Redis | RedisCluster,
        key_prefix: str = "dedup",
        cache_s: float = 30.0,
        prefixes: Mapping[str, str] | None = None,
    ) -> None:
        """``prefixes``: name prefix -> the principal every name starting with it belongs
        to, whoever used it first (the longest prefix wins; other names: first use)."""
        self._redis = redis
        self._key_prefix = key_prefix
        self._cache_s = cache_s
        self._prefixes = sorted((prefixes or {}).items(), key=lambda item: -len(item[0]))
        self._owners: dict[tuple[str, str], tuple[str, float]] = {}  # -> owner, read at

    def key(self, topic: str) -> str:
        return f"{self._key_prefix}:principals:{topic}"

    async def foreign(self, topic: str, names: Iterable[str], principal: str) -> dict[str, str]:
        """Of ``names`` used by ``principal`` on ``topic``: those bound to another
        principal (name -> owner). Names seen for the first time are bound to
        ``principal``. Raises RedisError when Redis does not answer."""
        names = set(names)
        foreign: dict[str, str] = {}
        for name in list(names):
            owner = self.configured_owner(name)
            if owner is not None:
                names.discard(name)
                if owner != principal:
                    foreign[name] = owner
        now = time.monotonic()
        unknown = [
            name
            for name in names
            if (cached := self._owners.get((topic, name))) is None
            or now - cached[1] > self._cache_s
        ]
        if unknown:
            key = self.key(topic)
            async with self._redis.pipeline(transaction=False) as pipe:
                for name in unknown:
                    pipe.hsetnx(key, name, principal)
                pipe.hmget(key, unknown)
                *_, owners = await pipe.execute()
            if len(self._owners) + len(unknown) > MAX_CACHED:
                self._owners.clear()
            for name, owner in zip(unknown, owners, strict=True):
                self._owners[(topic, name)] = (_text(owner), now)
        for name in names:
            if (owner := self._owners[(topic, name)][0]) != principal:
                foreign[name] = owner
        return foreign

    def configured_owner(self, name: str) -> str | None:
        """The principal a configured prefix gives ``name`` to, if any."""
        for prefix, owner in self._prefixes:
            if name.startswith(prefix):
                return owner
        return None

    async def owners(self, topic: str) -> dict[str, str]:
        """Every binding of the topic (the admin API)."""
        raw = await self._redis.hgetall(self.key(topic))  # type: ignore[misc]
        return {_text(name): _text(owner) for name, owner in raw.items()}

    async def release(self, topic: str, name: str) -> bool:
        """Unbind a name (an operator's decision); the next principal to use it owns it.
        Other instances follow within `cache_s`."""
        self._owners.pop((topic, name), None)
        return bool(await self._redis.hdel(self.key(topic), name))  # type: ignore[misc]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value

"""The proxy's own connections to the brokers, shared by its writes (`dedup.writer`) and its
fencing (`dedup.fencing`), opened on first use and again after one closes.

A broker gets up to ``lanes`` connections (lane 0 first). Kafka handles one request of a
connection at a time: it reads the next only once it has answered the one before, and a
Produce request with acks=all is answered only when the followers have it. On one shared
connection, a client's 100 MB request, or a partition whose followers lag, would hold
every other client's writes to that broker. The writer keeps each partition on one lane
while it has batches in flight (Kafka's sequence checks need them in order) and puts the
others on the least loaded lane.
"""

from __future__ import annotations

import asyncio

from proxy.kafka.topology import Endpoint
from proxy.kafka.upstream_client import PLAINTEXT, LinkSecurity, UpstreamClient


class UpstreamLinks:
    def __init__(self, timeout_s: float, security: LinkSecurity = PLAINTEXT) -> None:
        self._timeout_s = timeout_s
        self._security = security
        self._links: dict[tuple[Endpoint, int], UpstreamClient] = {}
        self._locks: dict[tuple[Endpoint, int], asyncio.Lock] = {}

    async def get(self, endpoint: Endpoint, lane: int = 0) -> UpstreamClient:
        """An open connection to ``endpoint`` on ``lane`` (raises OSError or TimeoutError)."""
        key = (endpoint, lane)
        link = self._links.get(key)
        if link is not None and link.is_open:
            return link
        async with self._locks.setdefault(key, asyncio.Lock()):  # one connect at a time
            link = self._links.get(key)
            if link is None or not link.is_open:
                link = await UpstreamClient(endpoint, self._timeout_s, self._security).connect()
                self._links[key] = link
            return link

    async def close(self) -> None:
        for link in self._links.values():
            await link.close()
        self._links.clear()

"""The proxy's own connections to the brokers: one per broker, shared by its writes
(`dedup.writer`) and its fencing (`dedup.fencing`), opened on first use and again after
one closes."""

from __future__ import annotations

import asyncio

from proxy.kafka.topology import Endpoint
from proxy.kafka.upstream_client import PLAINTEXT, LinkSecurity, UpstreamClient


class UpstreamLinks:
    def __init__(self, timeout_s: float, security: LinkSecurity = PLAINTEXT) -> None:
        self._timeout_s = timeout_s
        self._security = security
        self._links: dict[Endpoint, UpstreamClient] = {}
        self._locks: dict[Endpoint, asyncio.Lock] = {}

    async def get(self, endpoint: Endpoint) -> UpstreamClient:
        """An open connection to ``endpoint`` (raises OSError or TimeoutError)."""
        link = self._links.get(endpoint)
        if link is not None and link.is_open:
            return link
        async with self._locks.setdefault(endpoint, asyncio.Lock()):  # one connect at a time
            link = self._links.get(endpoint)
            if link is None or not link.is_open:
                link = await UpstreamClient(endpoint, self._timeout_s, self._security).connect()
                self._links[endpoint] = link
            return link

    async def close(self) -> None:
        for link in self._links.values():
            await link.close()
        self._links.clear()

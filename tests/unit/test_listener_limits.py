"""A listener keeps at most ``max_connections_per_listener`` client connections open; one
more is closed at once and counted (loopback sockets; the upstream is a silent stand-in)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from proxy.kafka.topology import Endpoint
from proxy.runtime import metrics
from proxy.runtime.chain import FilterChain
from proxy.runtime.server import ProxyServer, topology_of
from proxy.runtime.settings import ProxySettings

pytestmark = pytest.mark.unit


async def test_a_listener_closes_the_connection_past_its_limit() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # a broker that never answers: client connections stay open

    broker = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = broker.sockets[0].getsockname()[1]
    settings = ProxySettings(upstream=f"127.0.0.1:{port}", max_connections_per_listener=2)
    server = ProxyServer(
        settings,
        SimpleNamespace(topology=topology_of(settings)),
        FilterChain([]),  # type: ignore[arg-type]
    )

    async def resolve() -> list[Endpoint]:
        return [Endpoint("127.0.0.1", port)]

    listener = await asyncio.start_server(server._acceptor("limited", resolve), "127.0.0.1", 0)
    address = listener.sockets[0].getsockname()[:2]
    refused = metrics.CONNECTIONS_REFUSED.labels("limited")
    before = refused._value.get()
    clients = []
    try:
        for _ in range(2):
            clients.append(await asyncio.open_connection(*address))
        await asyncio.sleep(0.1)
        third = await asyncio.open_connection(*address)
        assert await asyncio.wait_for(third[0].read(), 5) == b"", "closed at once"
        assert refused._value.get() == before + 1
        for reader, _ in clients:  # the first two are still open
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(reader.read(1), 0.1)
        clients[0][1].close()  # one closes: a new one is taken again
        await asyncio.sleep(0.1)
        clients.append(await asyncio.open_connection(*address))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(clients[-1][0].read(1), 0.2)
        assert refused._value.get() == before + 1
    finally:
        for _, writer in clients:
            writer.close()
        listener.close()
        broker.close()

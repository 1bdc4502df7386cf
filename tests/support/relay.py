"""A loopback TCP relay whose connections a test can cut at any moment (with a reset).

Clients reach the proxy only through it: the proxy advertises the relay's ports, the relay
forwards each port to the proxy's. ``cut()`` resets every open connection in both
directions, mid-request, the way a failing network does; new connections keep working.
``freeze()`` blackholes it: connections stay open (and new ones are accepted) but no byte
goes through, in either direction, until ``thaw()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from collections.abc import Mapping
from urllib.parse import urlsplit


class Relay:
    def __init__(self, ports: Mapping[int, int], host: str = "127.0.0.1") -> None:
        self._ports = dict(ports)  # listen port -> target port
        self._host = host
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._servers: list[asyncio.Server] = []
        self._open: set[asyncio.StreamWriter] = set()
        self._flowing: asyncio.Event | None = None  # made on the relay's loop
        self.cuts = 0

    def start(self) -> Relay:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(10)
        return self

    def cut(self) -> int:
        """Reset every open connection; returns how many were cut."""
        count: int = asyncio.run_coroutine_threadsafe(self._cut(), self._loop).result(10)
        self.cuts += 1
        return count

    def freeze(self) -> None:
        """Hold every byte from now on (a blackholed network), until `thaw`."""
        self._loop.call_soon_threadsafe(self._gate().clear)

    def thaw(self) -> None:
        """Forward again, held bytes first."""
        self._loop.call_soon_threadsafe(self._gate().set)

    def _gate(self) -> asyncio.Event:
        assert self._flowing is not None, "start() the relay first"
        return self._flowing

    def stop(self) -> None:
        self.thaw()
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _listen(self) -> None:
        self._flowing = asyncio.Event()
        self._flowing.set()
        for listen_port, target_port in self._ports.items():

            async def handle(
                reader: asyncio.StreamReader,
                writer: asyncio.StreamWriter,
                target: int = target_port,
            ) -> None:
                await self._pipe(reader, writer, target)

            self._servers.append(await asyncio.start_server(handle, self._host, listen_port))

    async def _pipe(
        self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter, target: int
    ) -> None:
        try:
            await self._gate().wait()
            upstream_reader, upstream_writer = await asyncio.open_connection(self._host, target)
        except OSError:
            client_writer.close()
            return
        self._open.update({client_writer, upstream_writer})

        async def copy(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while chunk := await source.read(65536):
                    await self._gate().wait()
                    sink.write(chunk)
                    await sink.drain()
            _reset(sink)

        await asyncio.gather(
            copy(client_reader, upstream_writer), copy(upstream_reader, client_writer)
        )
        self._open.difference_update({client_writer, upstream_writer})

    async def _cut(self) -> int:
        victims = list(self._open)
        for writer in victims:
            _reset(writer)
        self._open.clear()
        return len(victims) // 2

    async def _stop(self) -> None:
        await self._cut()
        for server in self._servers:
            server.close()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with RST instead of FIN: the peer sees a broken connection, not a clean end."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def relayed_redis(redis_url: str, listen: int, db: int) -> tuple[Relay, str]:
    """A started relay on ``listen`` in front of the Redis of ``redis_url``, and the URL of
    database ``db`` through it (a test can then `Relay.freeze` Redis)."""
    port = urlsplit(redis_url).port
    assert port is not None, f"no port in {redis_url}"
    return Relay({listen: port}).start(), f"redis://127.0.0.1:{listen}/{db}"

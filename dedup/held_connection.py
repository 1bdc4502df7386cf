"""One Redis connection held out of the pool for the dedup state's round trips.

A redis-py pipeline takes a connection from the pool for every round trip, and the pool
first polls it for stray data with a zero timeout, which costs an event-loop iteration and
a cancelled read each time; the pipeline's bookkeeping then wraps every reply. On the
proxy's hot path (one round trip per group of checks) that was some 60 µs of a lone
request's latency (measured: 754 µs to 692 µs from its frame to its answer), and the
checkout alone about 3 % of the proxy's CPU under load. This connection is taken from the
pool once and kept: commands are packed, sent and read back on it directly.

The connection never holds a stray reply: redis-py drops it (disconnects) when a send or a
read fails or is cancelled half-way, and the next round trip connects again as the pool
would (for a Sentinel-managed primary, to whichever the Sentinels name then). An error
reply is one command's result, as in a pipeline with ``raise_on_error=False``; a
connection error or timeout fails the whole round trip, as it does a pipeline's.

One round trip at a time: a caller that finds it busy uses the pool (`busy`). The client's
``aclose`` closes it with the pool's other connections. Not for a Redis Cluster, whose
commands go to each slot's node.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis.asyncio
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ResponseError


class HeldConnection:
    def __init__(self, client: redis.asyncio.Redis) -> None:
        self._pool = client.connection_pool
        self._connection: AbstractConnection | None = None
        self.busy = False

    async def round_trip(self, commands: Sequence[Sequence[Any]]) -> list[Any]:
        """Every command's reply, in order; an error reply is returned, not raised."""
        if self.busy:
            raise RuntimeError("the held connection is in use: check `busy` first")
        self.busy = True
        try:
            connection = self._connection
            if connection is None:
                pooled = self._pool.get_connection()  # type: ignore[no-untyped-call]
                connection = self._connection = await pooled
            elif _closed_by_server(connection):
                # As the pool would: connect again rather than fail this round trip.
                await connection.disconnect()
            if not connection.is_connected:
                # `connect`, as the pool does: a Sentinel-managed connection asks the
                # Sentinels for the primary there (a send would reconnect to the old one).
                await connection.connect()
            await connection.send_packed_command(connection.pack_commands(commands))
            replies: list[Any] = []
            for _ in commands:
                try:
                    replies.append(await connection.read_response())
                except ResponseError as error:  # read whole: the next reply follows
                    replies.append(error)
            return replies
        finally:
            self.busy = False


def _closed_by_server(connection: AbstractConnection) -> bool:
    """Whether Redis closed the connection since its last round trip (restarted, or timed
    the idle connection out): the event loop has read its end already. The pool finds that
    out with a read; its stream says it without one."""
    stream = connection._reader
    return stream is not None and (stream.at_eof() or stream.exception() is not None)

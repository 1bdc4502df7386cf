"""One client connection over loopback sockets, with a scripted upstream: what the filter
chain decides reaches the wire, and answers go back in request order whoever makes them."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import kio.schema.api_versions.v0.response as api_versions_v0
import pytest
from kio.schema.errors import ErrorCode
from kio.static.primitive import i16
from kio.static.protocol import ResponsePayload

from proxy.kafka.api_keys import ApiKey
from proxy.kafka.topology import Endpoint, Topology
from proxy.kafka.upstream_client import encode_request
from proxy.runtime.chain import (
    Close,
    FilterChain,
    FilterContext,
    Forward,
    RequestDecision,
    RequestFrame,
    Respond,
    encode_response,
)
from proxy.runtime.connection import ClientConnection, ConnectionSettings
from tests.support.raw import explicit_batch, produce_request

pytestmark = pytest.mark.unit

SETTINGS = ConnectionSettings(max_frame_bytes=1 << 20, max_in_flight=16, connect_timeout_s=5)


def metadata_request(correlation_id: int) -> bytes:
    """A Metadata v12 request: header v2, then a body the runtime never needs to read."""
    header = struct.pack(">hhih", ApiKey.METADATA, 12, correlation_id, -1) + b"\x00"
    return header + b"\x01\x00\x00\x00"  # no topics, no auto-create, no authorized ops


def framed(payload: bytes) -> bytes:
    return len(payload).to_bytes(4, "big") + payload


async def read_framed(reader: asyncio.StreamReader) -> bytes:
    size = int.from_bytes(await reader.readexactly(4), "big")
    return await reader.readexactly(size)


class Upstream:
    """A broker stand-in: records each request and answers it after ``delay_s``."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.received: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                payload = await read_framed(reader)
                self.received.append(payload)
                await asyncio.sleep(self.delay_s)
                writer.write(framed(payload[4:8] + b"\x00" + b"upstream"))  # header v1, body
                await writer.drain()
        except asyncio.IncompleteReadError:
            writer.close()


@asynccontextmanager
async def proxied(
    chain: FilterChain, upstream: Upstream, settings: ConnectionSettings = SETTINGS
) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    broker = await asyncio.start_server(upstream.handle, "127.0.0.1", 0)
    broker_port = broker.sockets[0].getsockname()[1]
    topology = Topology([Endpoint("127.0.0.1", broker_port)], "127.0.0.1", broker_port_base=1)

    async def resolve() -> list[Endpoint]:
        return [Endpoint("127.0.0.1", broker_port)]

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await ClientConnection(reader, writer, "test", resolve, chain, topology, settings).serve()

    proxy = await asyncio.start_server(accept, "127.0.0.1", 0)
    client = await asyncio.open_connection("127.0.0.1", proxy.sockets[0].getsockname()[1])
    try:
        yield client
    finally:
        client[1].close()
        proxy.close()
        broker.close()


class Deciding:
    """Decides per correlation id; forwards the rest."""

    request_keys = frozenset({ApiKey.METADATA})

    def __init__(self, decide: dict[int, Callable[[], Awaitable[RequestDecision]]]) -> None:
        self.decide = decide

    async def on_request(self, frame: RequestFrame, ctx: FilterContext) -> RequestDecision:
        make = self.decide.get(frame.header.correlation_id)
        return await make() if make else Forward()


def local_answer() -> api_versions_v0.ApiVersionsResponse:
    return api_versions_v0.ApiVersionsResponse(
        error_code=ErrorCode.none,
        api_keys=(
            api_versions_v0.ApiVersion(api_key=i16(3), min_version=i16(0), max_version=i16(0)),
        ),
    )


async def respond_now() -> RequestDecision:
    return Respond.now(local_answer())


async def test_forwarded_requests_and_their_answers_pass_byte_for_byte() -> None:
    upstream = Upstream()
    async with proxied(FilterChain([Deciding({})]), upstream) as (reader, writer):
        requests = [metadata_request(n) for n in (1, 2, 3)]
        writer.write(b"".join(framed(r) for r in requests))
        answers = [await read_framed(reader) for _ in requests]
    assert upstream.received == requests
    assert answers == [r[4:8] + b"\x00upstream" for r in requests]


async def test_answers_keep_request_order_whoever_makes_them() -> None:
    # Kafka answers slowly; the proxy's own answer to request 2 is ready at once, yet the
    # client must get 1, 2, 3: the order Kafka promises per connection.
    upstream = Upstream(delay_s=0.2)
    chain = FilterChain([Deciding({2: respond_now})])
    async with proxied(chain, upstream) as (reader, writer):
        writer.write(b"".join(framed(metadata_request(n)) for n in (1, 2, 3)))
        answers = [await read_framed(reader) for _ in range(3)]
    assert [int.from_bytes(a[:4], "big") for a in answers] == [1, 2, 3]
    assert answers[1] == encode_response(2, local_answer())
    assert [int.from_bytes(r[4:8], "big") for r in upstream.received] == [1, 3]


async def test_an_answer_made_later_still_goes_in_its_place() -> None:
    loop = asyncio.get_running_loop()
    later: asyncio.Future[ResponsePayload] = loop.create_future()

    async def respond_later() -> RequestDecision:
        loop.call_later(0.2, later.set_result, local_answer())
        return Respond(later)

    async with proxied(FilterChain([Deciding({1: respond_later})]), Upstream()) as (
        reader,
        writer,
    ):
        writer.write(framed(metadata_request(1)) + framed(metadata_request(2)))
        answers = [await read_framed(reader) for _ in range(2)]
    assert [int.from_bytes(a[:4], "big") for a in answers] == [1, 2]


async def test_a_close_decision_closes_the_client_and_forwards_nothing() -> None:
    async def close() -> RequestDecision:
        return Close("not allowed")

    upstream = Upstream()
    async with proxied(FilterChain([Deciding({1: close})]), upstream) as (reader, writer):
        writer.write(framed(metadata_request(1)) + framed(metadata_request(2)))
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed, nothing answered
    assert upstream.received == []


async def test_requests_without_an_answer_take_a_slot_until_their_work_is_done() -> None:
    """acks=0 Produce requests the proxy handles itself get no answer, but each holds one of
    the connection's in-flight slots until its work is done: a flood of them waits in the
    socket, not in memory."""
    loop = asyncio.get_running_loop()
    works = [loop.create_future() for _ in range(4)]
    started: list[int] = []

    class Producing:
        request_keys = frozenset({ApiKey.PRODUCE})

        async def on_request(self, frame: RequestFrame, ctx: FilterContext) -> RequestDecision:
            started.append(frame.header.correlation_id)
            return Respond(works[len(started) - 1])

    settings = ConnectionSettings(max_frame_bytes=1 << 20, max_in_flight=2, connect_timeout_s=5)
    request = produce_request("t", {0: explicit_batch([("p", 0)])}, acks=0)
    async with proxied(FilterChain([Producing()]), Upstream(), settings) as (_, writer):
        writer.write(b"".join(encode_request(request, n) for n in (1, 2, 3, 4)))
        await asyncio.sleep(0.2)
        assert started == [1, 2], "two slots: the third request is not read yet"
        works[0].set_result(local_answer())
        await asyncio.sleep(0.2)
        assert started == [1, 2, 3]
        works[1].set_result(local_answer())
        works[2].set_exception(RuntimeError("failed work frees its slot too"))
        await asyncio.sleep(0.2)
        assert started == [1, 2, 3, 4]

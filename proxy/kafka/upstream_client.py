"""The proxy's own requests to an upstream broker, encoded with kio.

Client traffic never goes through here: this is what the proxy itself asks (metadata
refresh, and the idempotent writer's InitProducerId and Produce requests). Requests are
pipelined on one connection; Kafka answers them in order, so a FIFO of futures matches
each answer to its request.

A Produce request carrying `QUEUED_FROM_BYTES` of records or more is written in pieces,
and the requests sent after it wait for it: framing and writing 32 MB at once held the
event loop (and so every other connection of the proxy) for some 30 ms. The writer's
request is never joined into one frame: its parts (the records among them, as they are, or
as `RecordPieces`) go to the socket a megabyte at a time. Requests keep their order on the
wire either way.
"""

from __future__ import annotations

import asyncio
import io
import itertools
import ssl
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from kio.schema.metadata.v12.request import MetadataRequest
from kio.schema.metadata.v12.response import MetadataResponse
from kio.serial import entity_writer
from kio.static.primitive import i32

from proxy.kafka.api_keys import ApiKey
from proxy.kafka.produce_codec import (
    RecordBytes,
    RecordPieces,
    WriterProduceRequest,
    produce_request_v11_frame,
    produce_request_v11_parts,
)
from proxy.kafka.sasl import Credentials, authenticate
from proxy.kafka.schemas import decode_response_body, response_header_is_flexible
from proxy.kafka.topology import Endpoint
from proxy.kafka.wire import FrameError, correlation_id_of, read_frame, response_body_start

CLIENT_ID = "dedup-proxy"
_MAX_RESPONSE_BYTES = 1 << 30
QUEUED_FROM_BYTES = 1 << 20
_PIECE_BYTES = 1 << 20  # what one write of a queued request hands the transport
# How much of a broker's answers the stream buffers ahead of the reader before it stops
# reading the socket (twice this, per upstream connection; asyncio's default is 64 KiB,
# at which a Fetch answer of 1 MiB stops and restarts the socket's reading some eight
# times). With `PIECEWISE_FRAME_BYTES`, 17-28 % less of the pass-through's CPU per Fetch
# answer (benchmarks/README.md, "Fetch answers read at once").
UPSTREAM_READ_AHEAD_BYTES = 1 << 20


class LinkClosed(ConnectionError):
    """The connection ended before the answer came: the request may or may not have run."""


def records_for_request(parts: Sequence[bytes | memoryview]) -> RecordBytes:
    """A partition's records for the writer's Produce request: from `QUEUED_FROM_BYTES` on
    left in pieces (such a request is written unjoined), else one bytes object."""
    if sum(map(len, parts)) >= QUEUED_FROM_BYTES:
        return RecordPieces(parts)
    return b"".join(parts)


def decode_answer(request: Any, frame: bytes) -> Any:
    """Kafka's answer to a request entity, decoded: ``frame`` is the response without its
    size."""
    api_key, version = int(request.__api_key__), int(request.__version__)
    body_start = response_body_start(frame, response_header_is_flexible(api_key, version))
    return decode_response_body(api_key, version, frame, body_start)


def encode_request(payload: Any, correlation_id: int, client_id: str = CLIENT_ID) -> bytes:
    """A whole request frame (size, header, body) for a kio request entity."""
    if type(payload) is WriterProduceRequest:  # the writer's Produce: the same bytes, faster
        return produce_request_v11_frame(payload, correlation_id, client_id)
    header_type = payload.__header_schema__
    header = header_type(
        request_api_key=payload.__api_key__,
        request_api_version=payload.__version__,
        correlation_id=i32(correlation_id),
        client_id=client_id,
    )
    # One buffer for the size, header and body: a large Produce request is copied once into
    # it, not again by joining the parts (a copy of 32 MB is some 15 ms of the event loop).
    buffer = io.BytesIO()
    buffer.write(bytes(4))  # the size, once known
    entity_writer(header_type)(buffer, header)
    entity_writer(type(payload))(buffer, payload)
    size = buffer.tell() - 4
    with buffer.getbuffer() as view:
        view[:4] = size.to_bytes(4, "big")
    return buffer.getvalue()


@dataclass(frozen=True, slots=True)
class LinkSecurity:
    """How the proxy's own connections to Kafka are secured: TLS, and SASL credentials."""

    tls: ssl.SSLContext | None = None
    sasl: Credentials | None = None


PLAINTEXT = LinkSecurity()


class UpstreamClient:
    """One connection to one broker with pipelined kio requests."""

    def __init__(
        self,
        endpoint: Endpoint,
        timeout_s: float,
        security: LinkSecurity = PLAINTEXT,
        queued_from_bytes: int = QUEUED_FROM_BYTES,
    ) -> None:
        self.endpoint = endpoint
        self._timeout_s = timeout_s
        self._security = security
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._waiting: deque[tuple[int, Any, asyncio.Future[Any]]] = deque()
        self._correlation = itertools.count(1)
        self._closed: BaseException | None = None
        self._queued_from = queued_from_bytes
        # (payload, correlation id, whether it is large: written in pieces, never joined)
        self._queued: deque[tuple[Any, int, bool]] = deque()
        self._queue_task: asyncio.Task[None] | None = None

    async def connect(self) -> UpstreamClient:
        # asyncio.timeout, not wait_for, here and below: on Python 3.11 wait_for loses a
        # cancellation that arrives as the awaited work completes (CPython gh-86296).
        async with asyncio.timeout(self._timeout_s):
            reader, self._writer = await open_upstream(self.endpoint, self._security.tls)
        self._reader_task = asyncio.create_task(self._read_answers(reader))
        if self._security.sasl is not None:
            try:
                await authenticate(self.request, self._security.sasl, str(self.endpoint))
            except BaseException:
                await self.close()
                raise
        return self

    @property
    def is_open(self) -> bool:
        return self._writer is not None and self._closed is None

    async def __aenter__(self) -> UpstreamClient:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        self._fail_all(LinkClosed(f"connection to {self.endpoint} closed"))
        if self._reader_task is not None:
            self._reader_task.cancel()
        if self._queue_task is not None:
            self._queue_task.cancel()
        self._queued.clear()
        if self._writer is not None:
            self._writer.close()

    def send(self, payload: Any) -> asyncio.Future[Any]:
        """Send a request, its place on the wire taken now (synchronously, so callers
        control the order), and return the future of its decoded answer. A large Produce
        request, and whatever is sent while it is being written, is written by a task."""
        if self._writer is None or self._closed is not None:
            raise LinkClosed(f"connection to {self.endpoint} is closed")
        correlation_id = next(self._correlation)
        answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting.append((correlation_id, payload, answer))
        large = _records_bytes(payload) >= self._queued_from
        if self._queued or large:
            self._queued.append((payload, correlation_id, large))
            if self._queue_task is None:
                self._queue_task = asyncio.create_task(self._write_queued())
        else:
            self._writer.write(encode_request(payload, correlation_id))
        return answer

    async def _write_queued(self) -> None:
        """Write the queued requests in order; a large one in its parts, never joined, handed
        to the transport a piece at a time as the socket takes them."""
        writer = self._writer
        assert writer is not None
        try:
            while self._queued:
                payload, correlation_id, large = self._queued[0]
                if large:
                    await _write_in_pieces(writer, _request_parts(payload, correlation_id))
                else:
                    writer.write(encode_request(payload, correlation_id))
                self._queued.popleft()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the link cannot go on: a later request would be misread
            self._fail_all(LinkClosed(f"writing to {self.endpoint} failed: {exc!r}"))
            self._queued.clear()
            writer.close()
        finally:
            self._queue_task = None

    async def request(self, payload: Any) -> Any:
        answer = self.send(payload)
        assert self._writer is not None
        await self._writer.drain()
        async with asyncio.timeout(self._timeout_s):
            return await answer

    async def _read_answers(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                frame = await read_frame(reader, _MAX_RESPONSE_BYTES)
                if frame is None:
                    raise LinkClosed(f"{self.endpoint} closed the connection")
                if not self._waiting:
                    raise FrameError(f"{self.endpoint} answered no request")
                correlation_id, payload, answer = self._waiting.popleft()
                if correlation_id_of(frame) != correlation_id:
                    raise FrameError(f"{self.endpoint} answered out of order")
                if not answer.done():
                    answer.set_result(decode_answer(payload, frame))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # any failure ends the link; every waiter learns why
            self._fail_all(exc if isinstance(exc, LinkClosed) else LinkClosed(str(exc)))
            if self._writer is not None:
                self._writer.close()

    def _fail_all(self, error: LinkClosed) -> None:
        self._closed = self._closed or error
        while self._waiting:
            _, _, answer = self._waiting.popleft()
            if not answer.done():
                answer.set_exception(error)
                answer.exception()  # retrieved: a waiter that gave up must not warn


def _request_parts(payload: Any, correlation_id: int) -> list[bytes | memoryview]:
    """A request frame in parts: the writer's Produce unjoined, any other whole."""
    if type(payload) is WriterProduceRequest:
        return produce_request_v11_parts(payload, correlation_id, CLIENT_ID)
    return [encode_request(payload, correlation_id)]


async def _write_in_pieces(
    writer: asyncio.StreamWriter, parts: Sequence[bytes | memoryview]
) -> None:
    """Hand the parts to the transport about `_PIECE_BYTES` at a time (small parts
    together, large ones cut), waiting for the socket to take each: no copy of the
    records is made here, and the event loop serves other connections in between."""
    chunk: list[memoryview] = []
    size = 0
    for part in parts:
        view = memoryview(part)
        for start in range(0, len(view), _PIECE_BYTES):
            piece = view[start : start + _PIECE_BYTES]
            chunk.append(piece)
            size += len(piece)
            if size >= _PIECE_BYTES:
                writer.writelines(chunk)
                chunk, size = [], 0
                await _socket_took_it(writer)
    if chunk:
        writer.writelines(chunk)
        await writer.drain()


async def _socket_took_it(writer: asyncio.StreamWriter) -> None:
    """Until the transport is below its high-water mark, and at least one turn of the loop:
    `drain` returns without one while the socket keeps taking what it is given (loopback
    takes megabytes at once), and the loop would write the whole request in one go."""
    await writer.drain()
    await asyncio.sleep(0)


def _records_bytes(payload: Any) -> int:
    """The record bytes a Produce request carries (0 for any other request)."""
    topics = getattr(payload, "topic_data", None) if payload.__api_key__ == ApiKey.PRODUCE else None
    if not topics:
        return 0
    return sum(
        len(part.records) for topic in topics for part in topic.partition_data if part.records
    )


async def open_upstream(
    endpoint: Endpoint, tls: ssl.SSLContext | None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to a broker, over TLS when ``tls`` is given (the broker's host name is
    what its certificate is checked against)."""
    if tls is None:
        return await asyncio.open_connection(
            endpoint.host, endpoint.port, limit=UPSTREAM_READ_AHEAD_BYTES
        )
    return await asyncio.open_connection(
        endpoint.host,
        endpoint.port,
        ssl=tls,
        server_hostname=endpoint.host,
        limit=UPSTREAM_READ_AHEAD_BYTES,
    )


async def fetch_brokers(
    endpoint: Endpoint, timeout_s: float, security: LinkSecurity = PLAINTEXT
) -> list[tuple[int, str, int]]:
    """The brokers of the cluster as one broker reports them (a Metadata request, no topics)."""
    request = MetadataRequest(
        topics=(),
        allow_auto_topic_creation=False,
        include_topic_authorized_operations=False,
    )
    async with UpstreamClient(endpoint, timeout_s, security) as client:
        response = cast(MetadataResponse, await client.request(request))
    return [(int(b.node_id), b.host, int(b.port)) for b in response.brokers]

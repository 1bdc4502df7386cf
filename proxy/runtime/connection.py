"""One client connection and the upstream connection that serves it.

Requests are forwarded as soon as they arrive (pipelining is kept: the client's own
max.in.flight decides, bounded by ``max_in_flight_per_connection``). Every request that
expects an answer gets a future in an ordered queue, and a single writer sends the
answers back in request order, which is the order Kafka promises per connection.
What a request or response becomes is the filter chain's decision (`proxy.runtime.chain`);
this module knows no API: requests and responses of keys no filter handles pass
byte-for-byte.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

import structlog
from kio.static.protocol import RequestPayload, ResponsePayload

from proxy.kafka.topology import Endpoint, Topology
from proxy.kafka.upstream_client import decode_answer, encode_request, open_upstream
from proxy.kafka.wire import (
    FrameError,
    RequestHeader,
    correlation_id_of,
    expects_response,
    parse_request_header,
    read_frame,
)
from proxy.runtime import metrics
from proxy.runtime.chain import (
    ClientIdentity,
    Close,
    FilterChain,
    FilterContext,
    Forward,
    LocalAnswer,
    RequestFrame,
    encode_response,
)

log = structlog.get_logger(__name__)

# Responses are bounded by the client's own fetch sizes, not by the request limit.
MAX_RESPONSE_BYTES = 1 << 30
# The correlation id of the proxy's own requests on a client's connection (`_ask_as_client`):
# answers are matched by their order, so any id will do; a negative one tells them apart in
# a capture.
ASKED_CORRELATION_ID = -7
_WRITE_BUFFER_HIGH = 4 << 20


class UpstreamClosed(ConnectionError):
    """The upstream broker connection ended; requests still waiting get no answer."""


class UpstreamUnavailable(Exception):
    """No upstream broker could be reached for a new client connection."""


@dataclass(slots=True)
class ConnectionSettings:
    max_frame_bytes: int
    max_in_flight: int
    connect_timeout_s: float
    upstream_tls: ssl.SSLContext | None = None


UpstreamResolver = Callable[[], Awaitable[list[Endpoint]]]


class ClientClosedByFilter(Exception):
    """A request filter decided to close the client connection."""


@dataclass(slots=True)
class _Pending:
    header: RequestHeader
    # Kafka's answer (raw payload), or else the answer a filter makes itself (an entity, or
    # its body written already)
    upstream: asyncio.Future[bytes] | None
    local: asyncio.Future[LocalAnswer] | None = None
    started: float = field(default_factory=time.perf_counter)


class ClientConnection:
    """Relays one client's requests to one upstream broker and the answers back."""

    def __init__(
        self,
        client_reader: asyncio.StreamReader,
        client_writer: asyncio.StreamWriter,
        listener: str,
        resolve_upstream: UpstreamResolver,
        chain: FilterChain,
        topology: Topology,
        settings: ConnectionSettings,
    ) -> None:
        self._client_reader = client_reader
        self._client_writer = client_writer
        self._listener = listener
        self._resolve_upstream = resolve_upstream
        self._chain = chain
        self._context = FilterContext(
            topology,
            listener=listener,
            identity=ClientIdentity(certificate_principal(client_writer)),
        )
        self._settings = settings
        self._in_flight = asyncio.Semaphore(settings.max_in_flight)
        self._answers: asyncio.Queue[_Pending | None] = asyncio.Queue()
        self._awaiting_upstream: deque[_Pending] = deque()
        self._draining = False
        self._request_task: asyncio.Task[None] | None = None
        self._upstream_writer: asyncio.StreamWriter | None = None
        peer = client_writer.get_extra_info("peername")
        self.log = log.bind(listener=listener, client=f"{peer[0]}:{peer[1]}" if peer else "?")

    async def serve(self) -> None:
        metrics.CONNECTIONS.labels(self._listener).inc()
        active = metrics.CONNECTIONS_ACTIVE.labels(self._listener)
        active.inc()
        try:
            await self._serve()
        finally:
            active.dec()

    async def _serve(self) -> None:
        try:
            upstream_reader, upstream_writer = await self._connect_upstream()
        except UpstreamUnavailable as exc:
            metrics.UPSTREAM_ERRORS.labels("connect").inc()
            self.log.warning("closing client: no upstream broker reachable", reason=str(exc))
            await self._close_client()
            return
        if self._draining:  # shutdown began while connecting: nothing was taken yet
            upstream_writer.close()
            await self._close_client()
            return
        _limit_write_buffer(self._client_writer)
        _limit_write_buffer(upstream_writer)
        self._request_task = asyncio.create_task(
            self._relay_requests(upstream_writer), name="client"
        )
        upstream_task = asyncio.create_task(self._relay_upstream(upstream_reader), name="upstream")
        answer_task = asyncio.create_task(self._send_answers(), name="answers")
        tasks = {self._request_task, upstream_task, answer_task}
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            if self._request_task in done and self._draining:
                # Graceful shutdown: no new requests, but answer the ones already taken.
                self._answers.put_nowait(None)
                done, _ = await asyncio.wait(
                    {answer_task, upstream_task}, return_when=asyncio.FIRST_COMPLETED
                )
            for task in done:
                self._log_end(task)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._fail_waiting(UpstreamClosed("connection closed"))
            upstream_writer.close()
            await self._close_client()

    def drain(self) -> None:
        """Stop taking requests; answers already owed are still sent (graceful shutdown)."""
        self._draining = True
        if self._request_task is not None:
            self._request_task.cancel()

    async def _connect_upstream(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        candidates = await self._resolve_upstream()
        errors = []
        for endpoint in candidates:
            try:
                # asyncio.timeout: 3.11's wait_for can lose a shutdown's cancellation.
                async with asyncio.timeout(self._settings.connect_timeout_s):
                    streams = await open_upstream(endpoint, self._settings.upstream_tls)
                self._upstream_writer = streams[1]
                self._context = replace(
                    self._context, upstream=endpoint, ask_as_client=self._ask_as_client
                )
                return streams
            except (OSError, TimeoutError) as exc:
                errors.append(f"{endpoint}: {exc or type(exc).__name__}")
        raise UpstreamUnavailable("; ".join(errors) or "no upstream broker known")

    async def _relay_requests(self, upstream: asyncio.StreamWriter) -> None:
        reader = self._client_reader
        chain = self._chain
        while True:
            payload = await read_frame(reader, self._settings.max_frame_bytes)
            if payload is None:
                return
            header = parse_request_header(payload)
            metrics.for_api(header.api_key).request(len(payload) + 4)
            expects_answer = expects_response(header, payload)
            filtered = chain.filters_request(header.api_key)
            # A slot before any work on the request: one the proxy handles itself without an
            # answer (acks=0 through dedup) keeps it until that work is done, so a flood of
            # them waits in the socket, not in memory.
            if expects_answer or filtered:
                await self._in_flight.acquire()
            if filtered:
                frame = RequestFrame(header, payload)
                decision = await chain.on_request(frame, self._context)
                if isinstance(decision, Close):
                    raise ClientClosedByFilter(decision.reason)
                if not isinstance(decision, Forward):  # the filter answers the client itself
                    if expects_answer:
                        self._answers.put_nowait(_Pending(header, None, decision.answer))
                    else:
                        decision.answer.add_done_callback(self._unanswered_done)
                    continue
                payload = chain.encode_request(frame, decision)
            if expects_answer:
                pending = _Pending(header, asyncio.get_running_loop().create_future())
                self._awaiting_upstream.append(pending)
                self._answers.put_nowait(pending)
            elif filtered:  # forwarded without an answer: Kafka's to handle
                self._in_flight.release()
            # One call, one send: two writes cost two system calls per frame.
            upstream.writelines((len(payload).to_bytes(4, "big"), payload))
            await upstream.drain()

    async def _relay_upstream(self, upstream: asyncio.StreamReader) -> None:
        while True:
            payload = await read_frame(upstream, MAX_RESPONSE_BYTES)
            if payload is None:
                raise UpstreamClosed("upstream broker closed the connection")
            if not self._awaiting_upstream:
                raise FrameError("upstream sent a response to no request")
            pending = self._awaiting_upstream.popleft()
            correlation_id = correlation_id_of(payload)
            if correlation_id != pending.header.correlation_id:
                raise FrameError(
                    f"upstream answered correlation id {correlation_id}, "
                    f"expected {pending.header.correlation_id}"
                )
            assert pending.upstream is not None  # only those wait on upstream
            pending.upstream.set_result(payload)

    async def _send_answers(self) -> None:
        client = self._client_writer
        while True:
            pending = await self._answers.get()
            if pending is None:
                return
            header = pending.header
            if pending.upstream is not None:
                payload = await self._chain.on_response(
                    header, await pending.upstream, self._context
                )
            else:
                assert pending.local is not None
                payload = encode_response(header.correlation_id, await pending.local)
            if client.is_closing():
                raise ConnectionResetError("client connection closed")
            client.writelines((len(payload).to_bytes(4, "big"), payload))
            metrics.for_api(header.api_key).response(
                len(payload) + 4, time.perf_counter() - pending.started
            )
            self._in_flight.release()
            await client.drain()

    async def _ask_as_client(self, request: RequestPayload, timeout_s: float) -> ResponsePayload:
        """A request of the proxy's own, in line with the client's on its upstream
        connection: Kafka answers it in order, and the answer goes to the caller only."""
        upstream = self._upstream_writer
        if upstream is None or upstream.is_closing():
            raise UpstreamClosed("the client's upstream connection is not open")
        frame = encode_request(request, ASKED_CORRELATION_ID)
        header = parse_request_header(frame[4:])
        pending = _Pending(header, asyncio.get_running_loop().create_future())
        assert pending.upstream is not None
        # Queued and written with no await between: no other frame can come in between.
        self._awaiting_upstream.append(pending)
        upstream.write(frame)
        async with asyncio.timeout(timeout_s):  # shielded: a late answer is still read
            answer = await asyncio.shield(pending.upstream)
        response: ResponsePayload = decode_answer(request, answer)
        return response

    def _unanswered_done(self, answer: asyncio.Future[LocalAnswer]) -> None:
        """A request the client expects no answer to (acks=0) is done: its slot is free."""
        self._in_flight.release()
        if not answer.cancelled() and answer.exception() is not None:
            log.error("a request answered by the proxy failed", error=repr(answer.exception()))

    def _fail_waiting(self, error: Exception) -> None:
        for pending in self._awaiting_upstream:
            answer = pending.upstream
            if answer is not None and not answer.done():
                answer.set_exception(error)
                answer.exception()  # mark retrieved: nobody waits any more
        self._awaiting_upstream.clear()

    def _log_end(self, task: asyncio.Task[None]) -> None:
        """One log line that says why the connection ended and whose side it was."""
        if task.cancelled():
            return
        error = task.exception()
        side = task.get_name()
        if error is None:
            self.log.debug("client closed the connection")
        elif side == "client" and isinstance(error, FrameError):
            metrics.CLIENT_ERRORS.labels(type(error).__name__).inc()
            self.log.warning("closing client after bad input", error=str(error))
        elif side == "client" and isinstance(error, ClientClosedByFilter):
            metrics.CLIENT_ERRORS.labels(type(error).__name__).inc()
            self.log.warning("closing client as a filter decided", reason=str(error))
        elif side == "upstream" and isinstance(error, UpstreamClosed | ConnectionError):
            metrics.UPSTREAM_ERRORS.labels("disconnect").inc()
            self.log.info("upstream connection ended; closing client", error=str(error))
        elif side == "upstream" or isinstance(error, FrameError):
            metrics.UPSTREAM_ERRORS.labels("protocol").inc()
            self.log.error("closing client after a bad upstream response", error=str(error))
        elif isinstance(error, ConnectionError):
            self.log.info("client connection lost", error=str(error))
        else:
            self.log.error("connection failed", error=repr(error), exc_info=error)

    async def _close_client(self) -> None:
        self._client_writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await self._client_writer.wait_closed()


def _limit_write_buffer(writer: asyncio.StreamWriter) -> None:
    transport = writer.transport
    if isinstance(transport, asyncio.WriteTransport):
        transport.set_write_buffer_limits(high=_WRITE_BUFFER_HIGH)


def certificate_principal(writer: asyncio.StreamWriter) -> str | None:
    """Kafka's principal of a client that presented a certificate (mutual TLS): its
    subject's distinguished name, most specific part first (RFC 2253), as Kafka names it."""
    certificate = writer.get_extra_info("peercert")
    if not certificate:
        return None
    parts = [
        f"{_RDN_NAMES.get(name, name)}={value}"
        for rdn in certificate.get("subject", ())
        for name, value in rdn
    ]
    return "User:" + ",".join(reversed(parts)) if parts else None


_RDN_NAMES = {
    "commonName": "CN",
    "organizationName": "O",
    "organizationalUnitName": "OU",
    "countryName": "C",
    "stateOrProvinceName": "ST",
    "localityName": "L",
    "domainComponent": "DC",
}

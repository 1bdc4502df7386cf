"""The filter chain: the only places where the proxy changes what a client or Kafka said.

A filter is one small class per concern that declares the API keys it handles. The
runtime hands it only those, and hides the plumbing (frames, correlation ids, response
headers, ordering of answers):

- a **request filter** sees each client request of its keys, in arrival order on the
  connection, and decides: `Forward` it (as received, or changed), `Respond` to the client
  itself (Kafka never sees the request), or `Close` the connection;
- a **response filter** sees each upstream response of its keys and may rewrite it. It
  first takes a cheap look at the raw bytes (`wants_response`), so a response is decoded
  only when some filter needs it, and re-encoded only when one changed it: everything else
  passes byte-for-byte.

Request filters run in chain order; response filters in reverse chain order, so the
filter nearest the client sees the request first and the response last. Answers that a
filter makes itself go back to the client as they are: no response filter runs on them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from kio.static.protocol import RequestPayload, ResponsePayload

from proxy.kafka.api_keys import ApiKey
from proxy.kafka.fetch_names import NONE_NAMED, BrokerNames, fetch_broker_names
from proxy.kafka.schemas import (
    api_name,
    decode_request_body,
    decode_response_body,
    encode_body,
)
from proxy.kafka.topology import Endpoint, Topology
from proxy.kafka.wire import FrameError, RequestHeader, response_body_start
from proxy.runtime import metrics


class BrokerNamesLook:
    """Whether the response being filtered may name brokers (KIP-951 endpoints, or ids
    alone), looked at once however many filters ask: a Fetch response can be megabytes,
    several filters ask."""

    __slots__ = ("_answer", "_payload", "_start")

    def __init__(self) -> None:
        self._payload: bytes | None = None
        self._start = -1
        self._answer = NONE_NAMED

    def may_name_brokers(
        self, topology: Topology, api_key: int, version: int, payload: bytes, start: int
    ) -> BrokerNames:
        if payload is not self._payload or start != self._start:
            self._answer = _may_name_brokers(topology, api_key, version, payload, start)
            self._payload, self._start = payload, start
        return self._answer

    def forget(self) -> None:
        self._payload = None  # the response is not kept alive by the connection


def _may_name_brokers(
    topology: Topology, api_key: int, version: int, payload: bytes, start: int
) -> BrokerNames:
    if api_key == ApiKey.FETCH:  # walked by its structure, per partition, not per byte
        walked = fetch_broker_names(version, payload, start)
        if walked is not None:
            return walked
    # Elsewhere an id comes with its broker's endpoint (KIP-951): one search says both.
    named = topology.names_upstream_host(payload, start)
    return BrokerNames(endpoints=named, ids=named)


class AskAsClient(Protocol):
    """Kafka's answer to a request sent as the client (`FilterContext.ask_as_client`);
    raises OSError (ConnectionError) when the connection is closed or closes, TimeoutError
    when Kafka does not answer within ``timeout_s``."""

    async def __call__(self, request: RequestPayload, timeout_s: float) -> ResponsePayload: ...


@dataclass(slots=True)
class ClientIdentity:
    """Who the client of a connection is, once it proved it: Kafka's principal name
    (``User:alice`` for SASL, ``User:CN=alice,O=...`` for a client certificate), or None."""

    principal: str | None = None
    # The SASL exchange under way (`proxy.filters.principal`).
    mechanism: str | None = None
    user: str | None = None
    rounds: int = 0
    # What Kafka told of the client's right to write each topic, and until when that is
    # taken as true (`dedup.write_permissions`).
    may_write: dict[str, tuple[bool, float]] = field(default_factory=dict)


@dataclass(slots=True)
class ClientSoftware:
    """What the client of a connection says it is (KIP-511: ApiVersions v3 and later), as
    `proxy.filters.api_versions` reads it; empty before, or from an older client."""

    name: str = ""  # "apache-kafka-java", "librdkafka", "confluent-kafka-python", ...
    version: str = ""  # "2.6.1-rdkafka-2.6.1" (Python's); Go's, .NET's: librdkafka's "2.6.1"


@dataclass(frozen=True, slots=True)
class FilterContext:
    """What a filter may know of the connection a message travels on."""

    topology: Topology
    upstream: Endpoint | None = None  # the broker this connection relays to
    listener: str = ""
    look: BrokerNamesLook = field(default_factory=BrokerNamesLook, compare=False, repr=False)
    identity: ClientIdentity = field(default_factory=ClientIdentity, compare=False)
    software: ClientSoftware = field(default_factory=ClientSoftware, compare=False)
    # Stands for the client connection, one per connection (kept by `replace`).
    connection: object = field(default_factory=object, compare=False, repr=False)
    # Sends a request of the proxy's own on the client's upstream connection, so Kafka
    # answers it as the client (its principal, its session), and returns Kafka's answer;
    # the client never sees either. None until that connection is open.
    ask_as_client: AskAsClient | None = field(default=None, compare=False, repr=False)

    def may_name_brokers(
        self, api_key: int, version: int, payload: bytes, start: int, by_id: bool = False
    ) -> bool:
        """Whether the raw response from ``start`` on may carry broker endpoints to rewrite
        (the cheap test before decoding one, KIP-951); ``by_id``: or name a broker by id
        alone (a Fetch answer's preferred read replica, KIP-392), for filters that rename
        nodes."""
        names = self.look.may_name_brokers(self.topology, api_key, version, payload, start)
        return names.endpoints or (by_id and names.ids)


class RequestFrame:
    """One client request: its header, its raw bytes, and its body decoded on first ask."""

    __slots__ = ("_decoded", "header", "payload")

    def __init__(self, header: RequestHeader, payload: bytes) -> None:
        self.header = header
        self.payload = payload  # header + body, without the size prefix
        self._decoded: RequestPayload | None = None

    @property
    def decoded(self) -> RequestPayload | None:
        """The body's kio entity if it was decoded already."""
        return self._decoded

    def keep_decoded(self, body: RequestPayload) -> None:
        """Take the body as decoded another way (off the event loop, by hand)."""
        self._decoded = body

    def decode(self) -> RequestPayload:
        """The kio entity of the body; a request that cannot be decoded is bad input."""
        if self._decoded is None:
            header = self.header
            try:
                self._decoded = decode_request_body(
                    header.api_key, header.api_version, self.payload, header.body_offset
                )
            except Exception as exc:
                raise FrameError(f"malformed {api_name(header.api_key)} request: {exc}") from exc
        return self._decoded


@dataclass(frozen=True, slots=True)
class Forward:
    """Send the request on to Kafka: as received, or ``request`` in its place."""

    request: RequestPayload | None = None


@dataclass(frozen=True, slots=True)
class EncodedResponse:
    """A response body a filter wrote itself: the bytes its kio entity encodes to, without
    the entity (`dedup.produce_filter`: one answer per client Produce)."""

    body: bytes
    flexible_header: bool  # the response header version's: tagged fields or not


LocalAnswer = ResponsePayload | EncodedResponse


@dataclass(frozen=True, slots=True)
class Respond:
    """Answer the client without Kafka. The answer may come later (the future); answers
    still go back in request order. An entity's own class fixes its version and header;
    an `EncodedResponse` says which header it takes."""

    answer: asyncio.Future[LocalAnswer]

    @staticmethod
    def now(response: LocalAnswer) -> Respond:
        answer: asyncio.Future[LocalAnswer] = asyncio.get_running_loop().create_future()
        answer.set_result(response)
        return Respond(answer)


@dataclass(frozen=True, slots=True)
class Close:
    """Close the client connection at once, as after bad input (answers still owed are
    not sent: the client retries them on a new connection, as after any disconnect)."""

    reason: str


RequestDecision = Forward | Respond | Close


@runtime_checkable
class RequestFilter(Protocol):
    request_keys: frozenset[int]

    async def on_request(self, frame: RequestFrame, context: FilterContext) -> RequestDecision:
        """Called in arrival order per connection; the next request waits for the decision."""
        ...


@runtime_checkable
class ResponseFilter(Protocol):
    response_keys: frozenset[int]

    def wants_response(
        self, version: int, payload: bytes, body_start: int, context: FilterContext
    ) -> bool:
        """A cheap look at the raw response: does it need decoding at all?"""
        ...

    async def on_response(
        self, version: int, response: ResponsePayload, context: FilterContext
    ) -> ResponsePayload:
        """The response to send on (the same object if unchanged)."""
        ...


@runtime_checkable
class DrainingFilter(Protocol):
    async def drain(self) -> None:
        """Wait for the work the filter took on (graceful shutdown)."""
        ...


class FilterChain:
    def __init__(self, filters: Sequence[object]) -> None:
        self.filters = list(filters)
        self._requests: dict[int, list[RequestFilter]] = {}
        self._responses: dict[int, list[ResponseFilter]] = {}
        for f in self.filters:
            if not isinstance(f, RequestFilter | ResponseFilter):
                raise TypeError(f"{type(f).__name__} is neither a request nor a response filter")
            if isinstance(f, RequestFilter):
                for key in f.request_keys:
                    self._requests.setdefault(key, []).append(f)
            if isinstance(f, ResponseFilter):
                for key in f.response_keys:
                    self._responses.setdefault(key, []).insert(0, f)  # reverse chain order

    def filters_request(self, api_key: int) -> bool:
        return api_key in self._requests

    async def on_request(self, frame: RequestFrame, context: FilterContext) -> RequestDecision:
        """Run the request through its filters; the first that does not forward decides."""
        changed: RequestPayload | None = None
        for request_filter in self._requests.get(frame.header.api_key, ()):
            decision = await request_filter.on_request(frame, context)
            if not isinstance(decision, Forward):
                return decision
            if decision.request is not None:
                changed = decision.request
                frame._decoded = changed  # the next filter sees the changed request
        return Forward(changed)

    def encode_request(self, frame: RequestFrame, decision: Forward) -> bytes:
        """The payload to send upstream: the original bytes unless a filter changed it."""
        if decision.request is None:
            return frame.payload
        return frame.payload[: frame.header.body_offset] + encode_body(decision.request)

    async def on_response(
        self, header: RequestHeader, payload: bytes, context: FilterContext
    ) -> bytes:
        """Run one upstream response (header + body, no size prefix) through its filters.

        The response header bytes are kept verbatim; the body is re-encoded only when a
        filter changed it, so untouched responses stay byte-for-byte what Kafka sent.
        """
        response_filters = self._responses.get(header.api_key)
        if not response_filters:
            return payload
        version = header.api_version
        body_start = response_body_start(payload, header.flexible_response)
        response: ResponsePayload | None = None
        changed = False
        try:
            for response_filter in response_filters:
                if not response_filter.wants_response(version, payload, body_start, context):
                    continue
                if response is None:
                    response = _decode_response(header, payload, body_start)
                rewritten = await response_filter.on_response(version, response, context)
                if rewritten is not response:
                    response, changed = rewritten, True
        finally:
            context.look.forget()
        if not changed or response is None:
            return payload
        metrics.REWRITES.labels(api_name(header.api_key)).inc()
        return payload[:body_start] + encode_body(response)

    async def drain(self) -> None:
        for f in self.filters:
            if isinstance(f, DrainingFilter):
                await f.drain()


def _decode_response(header: RequestHeader, payload: bytes, body_start: int) -> ResponsePayload:
    try:
        response: ResponsePayload = decode_response_body(
            header.api_key, header.api_version, payload, body_start
        )
    except Exception as exc:
        # Passing it on could hand the client an upstream address and bypass the proxy.
        raise FrameError(
            f"cannot decode {api_name(header.api_key)} v{header.api_version} response: {exc}"
        ) from exc
    return response


def encode_response(correlation_id: int, response: LocalAnswer) -> bytes:
    """A whole response payload (header + body): the header version is the entity's own."""
    if isinstance(response, EncodedResponse):
        tagged = b"\x00" if response.flexible_header else b""
        return correlation_id.to_bytes(4, "big", signed=True) + tagged + response.body
    tagged = b"\x00" if type(response).__header_schema__.__flexible__ else b""
    return correlation_id.to_bytes(4, "big", signed=True) + tagged + encode_body(response)

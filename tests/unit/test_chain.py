"""The filter chain's contract: who sees what, in which order, and what reaches the wire."""

from __future__ import annotations

import asyncio
import datetime
from dataclasses import replace
from typing import Any

import kio.schema.api_versions.v0.response as api_versions_v0
import kio.schema.metadata.v12.request as metadata_request_v12
import kio.schema.metadata.v12.response as metadata_v12
import kio.schema.produce.v9.response as produce_v9
import pytest
from kio.schema.errors import ErrorCode
from kio.schema.types import BrokerId, TopicName
from kio.static.primitive import i16, i32, i32Timedelta
from kio.static.protocol import ResponsePayload

from proxy.kafka.api_keys import ApiKey
from proxy.kafka.schemas import decode_request_body, decode_response_body, encode_body
from proxy.kafka.topology import Endpoint, Topology
from proxy.kafka.wire import FrameError, RequestHeader, parse_request_header
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

pytestmark = pytest.mark.unit

NO_THROTTLE = i32Timedelta.parse(datetime.timedelta(0))


def context() -> FilterContext:
    return FilterContext(Topology([Endpoint("kafka", 9092)], "proxy", broker_port_base=40000))


def test_a_context_stands_for_its_connection_for_as_long_as_it_lasts() -> None:
    """Each connection's context is told apart from every other's (`connection`), and
    keeps that once its upstream is known (`replace`)."""
    first, second = context(), context()
    assert first.connection is not second.connection
    assert replace(first, upstream=Endpoint("kafka", 9092)).connection is first.connection


def metadata_request_frame(topic: str = "orders") -> RequestFrame:
    request = metadata_request_v12.MetadataRequest(
        topics=(metadata_request_v12.MetadataRequestTopic(topic_id=None, name=TopicName(topic)),),
        allow_auto_topic_creation=False,
        include_topic_authorized_operations=False,
    )
    # Request header v2: api key, version, correlation id, client id, no tagged fields.
    header = (
        i16(3).to_bytes(2, "big")
        + i16(12).to_bytes(2, "big")
        + (77).to_bytes(4, "big")
        + (4).to_bytes(2, "big")
        + b"test"
        + b"\x00"
    )
    payload = header + encode_body(request)
    return RequestFrame(parse_request_header(payload), payload)


class Recording:
    """A request filter that records the calls and decides as it is told."""

    def __init__(self, name: str, calls: list[str], decide: RequestDecision | None = None):
        self.name, self.calls, self.decide = name, calls, decide
        self.request_keys = frozenset({ApiKey.METADATA})

    async def on_request(self, frame: RequestFrame, ctx: FilterContext) -> RequestDecision:
        self.calls.append(self.name)
        return self.decide if self.decide is not None else Forward()


class Renaming:
    """Forwards the Metadata request with its topic renamed."""

    request_keys = frozenset({ApiKey.METADATA})

    def __init__(self, to: str) -> None:
        self.to = to

    async def on_request(self, frame: RequestFrame, ctx: FilterContext) -> RequestDecision:
        request: Any = frame.decode()
        topics = tuple(replace(t, name=TopicName(self.to)) for t in request.topics)
        return Forward(replace(request, topics=topics))


async def test_requests_of_keys_no_filter_handles_are_not_looked_at() -> None:
    chain = FilterChain([Recording("a", [])])
    assert chain.filters_request(ApiKey.METADATA)
    assert not chain.filters_request(ApiKey.FETCH)


async def test_forward_unchanged_keeps_the_very_bytes() -> None:
    calls: list[str] = []
    chain = FilterChain([Recording("a", calls), Recording("b", calls)])
    frame = metadata_request_frame()
    decision = await chain.on_request(frame, context())
    assert isinstance(decision, Forward)
    assert calls == ["a", "b"]
    assert chain.encode_request(frame, decision) is frame.payload


async def test_a_changed_request_is_re_encoded_behind_the_original_header() -> None:
    calls: list[str] = []
    chain = FilterChain([Renaming("renamed"), Recording("after", calls)])
    frame = metadata_request_frame("orders")
    decision = await chain.on_request(frame, context())
    assert isinstance(decision, Forward)
    out = chain.encode_request(frame, decision)
    offset = frame.header.body_offset
    assert out[:offset] == frame.payload[:offset]
    decoded: Any = decode_request_body(ApiKey.METADATA, 12, out, offset)
    assert [str(t.name) for t in decoded.topics] == ["renamed"]
    assert calls == ["after"]


async def test_a_later_filter_sees_the_request_an_earlier_one_changed() -> None:
    seen: list[str] = []

    class Reader:
        request_keys = frozenset({ApiKey.METADATA})

        async def on_request(self, frame: RequestFrame, ctx: FilterContext) -> RequestDecision:
            request: Any = frame.decode()
            seen.extend(str(t.name) for t in request.topics)
            return Forward()

    chain = FilterChain([Renaming("renamed"), Reader()])
    decision = await chain.on_request(metadata_request_frame("orders"), context())
    assert seen == ["renamed"]
    assert isinstance(decision, Forward) and decision.request is not None


async def test_the_first_filter_that_answers_or_closes_decides() -> None:
    for decision in (
        Close("no"),
        Respond.now(api_versions_v0.ApiVersionsResponse(error_code=ErrorCode.none, api_keys=())),
    ):
        calls: list[str] = []
        chain = FilterChain(
            [Recording("a", calls), Recording("b", calls, decision), Recording("c", calls)]
        )
        assert await chain.on_request(metadata_request_frame(), context()) is decision
        assert calls == ["a", "b"]


async def test_a_request_that_cannot_be_decoded_is_bad_input() -> None:
    frame = metadata_request_frame()
    broken = RequestFrame(frame.header, frame.payload[: frame.header.body_offset + 3])
    with pytest.raises(FrameError, match="malformed metadata request"):
        broken.decode()


def test_an_answer_gets_the_response_header_of_its_own_version() -> None:
    # ApiVersions answers always use response header v0 (no tagged fields)...
    api_versions = api_versions_v0.ApiVersionsResponse(error_code=ErrorCode.none, api_keys=())
    out = encode_response(-5, api_versions)
    assert out[:4] == (-5).to_bytes(4, "big", signed=True)
    assert out[4:] == encode_body(api_versions)
    # ...while a flexible Produce version carries an empty tagged-field section.
    produce = produce_v9.ProduceResponse(responses=(), throttle_time=NO_THROTTLE)
    out = encode_response(9, produce)
    assert out[4:5] == b"\x00"
    assert decode_response_body(ApiKey.PRODUCE, 9, out, 5) == produce


def metadata_response_payload(host: str = "kafka-1") -> bytes:
    response = metadata_v12.MetadataResponse(
        throttle_time=NO_THROTTLE,
        brokers=(
            metadata_v12.MetadataResponseBroker(
                node_id=BrokerId(1), host=host, port=i32(9092), rack=None
            ),
        ),
        cluster_id="c",
        controller_id=BrokerId(1),
        topics=(),
    )
    return (77).to_bytes(4, "big") + b"\x00" + encode_body(response)


class Suffixing:
    """Appends its mark to the first broker's host, if it wants the response at all."""

    response_keys = frozenset({ApiKey.METADATA})

    def __init__(self, mark: str, order: list[str], wants: bool = True) -> None:
        self.mark, self.order, self.wants = mark, order, wants

    def wants_response(
        self, version: int, payload: bytes, body_start: int, ctx: FilterContext
    ) -> bool:
        return self.wants

    async def on_response(
        self, version: int, response: ResponsePayload, ctx: FilterContext
    ) -> ResponsePayload:
        self.order.append(self.mark)
        entity: Any = response
        broker = entity.brokers[0]
        changed: ResponsePayload = replace(
            entity, brokers=(replace(broker, host=broker.host + self.mark),)
        )
        return changed


METADATA_HEADER = RequestHeader(ApiKey.METADATA, 12, 77, None, 0)


async def test_response_filters_run_in_reverse_chain_order() -> None:
    order: list[str] = []
    chain = FilterChain([Suffixing("-a", order), Suffixing("-b", order)])
    out = await chain.on_response(METADATA_HEADER, metadata_response_payload(), context())
    assert order == ["-b", "-a"]
    decoded: Any = decode_response_body(ApiKey.METADATA, 12, out, 5)
    assert decoded.brokers[0].host == "kafka-1-b-a"
    assert out[:5] == metadata_response_payload()[:5]


async def test_a_response_no_filter_wants_passes_as_the_very_bytes() -> None:
    order: list[str] = []
    chain = FilterChain([Suffixing("-a", order, wants=False)])
    payload = metadata_response_payload()
    assert await chain.on_response(METADATA_HEADER, payload, context()) is payload
    assert order == []
    fetch = RequestHeader(ApiKey.FETCH, 16, 77, None, 0)
    assert await chain.on_response(fetch, b"anything", context()) == b"anything"


async def test_a_response_that_cannot_be_decoded_is_never_passed_on() -> None:
    chain = FilterChain([Suffixing("-a", [])])
    with pytest.raises(FrameError, match="cannot decode metadata v12 response"):
        await chain.on_response(METADATA_HEADER, metadata_response_payload()[:-3], context())


class CountingTopology(Topology):
    def __init__(self) -> None:
        super().__init__([Endpoint("kafka", 9092)], "proxy", broker_port_base=40000)
        self.scans = 0

    def names_upstream_host(self, payload: bytes, start: int) -> bool:
        self.scans += 1
        return super().names_upstream_host(payload, start)


class Scanning(Suffixing):
    """Wants the response when it may name brokers, as the KIP-951 filters do."""

    def wants_response(
        self, version: int, payload: bytes, body_start: int, ctx: FilterContext
    ) -> bool:
        return ctx.may_name_brokers(ApiKey.METADATA, version, payload, body_start)


async def test_a_response_is_scanned_for_upstream_hosts_once_however_many_filters_ask() -> None:
    topology = CountingTopology()
    await topology.observe([(1, "kafka-1", 9092)], True)
    ctx = FilterContext(topology)
    order: list[str] = []
    chain = FilterChain([Scanning("-a", order), Scanning("-b", order)])
    plain = metadata_response_payload("elsewhere")
    assert await chain.on_response(METADATA_HEADER, plain, ctx) is plain
    assert topology.scans == 1 and order == []
    named = metadata_response_payload("kafka-1")
    out = await chain.on_response(METADATA_HEADER, named, ctx)
    assert topology.scans == 2, "a new response is scanned anew"
    assert order == ["-b", "-a"]
    decoded: Any = decode_response_body(ApiKey.METADATA, 12, out, 5)
    assert decoded.brokers[0].host == "kafka-1-b-a"


def test_the_chain_refuses_what_is_not_a_filter() -> None:
    with pytest.raises(TypeError, match="neither a request nor a response filter"):
        FilterChain([object()])


async def test_drain_waits_for_the_filters_that_took_work() -> None:
    finished: list[str] = []

    class Busy:
        request_keys = frozenset({ApiKey.PRODUCE})

        async def on_request(self, frame: RequestFrame, ctx: FilterContext) -> RequestDecision:
            return Forward()

        async def drain(self) -> None:
            await asyncio.sleep(0)
            finished.append("busy")

    await FilterChain([Busy(), Recording("a", [])]).drain()
    assert finished == ["busy"]

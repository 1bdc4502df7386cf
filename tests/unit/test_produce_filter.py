"""How the dedup filter decodes a Produce request: a large one in a worker thread by the
hand decoder, the same entity kio makes; a small one, or one the hand decoder leaves to
kio, by kio on the event loop."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace
from typing import Any, cast

import pytest

from dedup.engine import PartitionAnswer
from dedup.produce_filter import DECODE_OFF_LOOP_BYTES, DedupProduceFilter, _decoded
from proxy.kafka.schemas import decode_request_body
from proxy.kafka.topology import Endpoint
from proxy.kafka.upstream_client import encode_request
from proxy.kafka.wire import FrameError, parse_request_header
from proxy.runtime.chain import RequestFrame, Respond
from tests.support.raw import produce_request
from tests.support.threads import record_to_thread

pytestmark = pytest.mark.unit

BROKER = Endpoint("127.0.0.1", 9092)


def frame_of(records: bytes, tail: bytes = b"") -> RequestFrame:
    request = produce_request("t", {0: records})
    payload = encode_request(request, 7)[4:]
    if tail:  # replace the body's empty tagged fields
        payload = payload[:-1] + tail
    return RequestFrame(parse_request_header(payload), payload)


def kio_decode(frame: RequestFrame) -> Any:
    header = frame.header
    return decode_request_body(0, header.api_version, frame.payload, header.body_offset)


def test_a_large_request_is_decoded_in_a_worker_thread_as_kio_would(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ran_in = record_to_thread(monkeypatch)
    frame = frame_of(bytes(range(256)) * (DECODE_OFF_LOOP_BYTES // 256))
    decoded = asyncio.run(_decoded(frame))
    assert len(ran_in) == 1 and ran_in[0] != threading.get_ident()
    assert decoded == kio_decode(frame)
    assert frame.decode() is decoded, "kept on the frame"


def test_a_small_request_is_decoded_by_kio_on_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    ran_in = record_to_thread(monkeypatch)
    frame = frame_of(b"abc")
    assert asyncio.run(_decoded(frame)) == kio_decode(frame)
    assert ran_in == []


def test_a_large_request_the_hand_decoder_leaves_is_kios_to_refuse() -> None:
    frame = frame_of(bytes(DECODE_OFF_LOOP_BYTES), tail=b"\x01\x05\x01\x00")  # a tagged field
    with pytest.raises(FrameError, match="malformed produce request"):
        asyncio.run(_decoded(frame))


class _HeldEngine:
    """An engine whose every request is written when the test says (or fails with `error`)."""

    def __init__(self, error: Exception | None = None) -> None:
        self.release = asyncio.Event()
        self.written = 0
        self.error = error
        self.connections: list[object | None] = []  # each admitted request's

    async def dedup_anywhere(self) -> bool:
        return True

    async def admit(
        self, request: Any, principal: str | None = None, connection: object | None = None
    ) -> object:
        self.connections.append(connection)
        return object()

    async def produce(self, request: Any, admission: Any, broker: Any) -> dict[Any, Any]:
        await self.release.wait()
        if self.error is not None:
            raise self.error
        self.written += 1
        return {("t", 0): PartitionAnswer(base_offset=5)}


async def _responded(engine: _HeldEngine) -> tuple[DedupProduceFilter, Respond]:
    """The filter over `engine`, and its decision on one Produce request (a `Respond`)."""
    produce_filter = DedupProduceFilter(cast(Any, engine))
    context = SimpleNamespace(
        identity=SimpleNamespace(principal=None), upstream=BROKER, connection=CONNECTION
    )
    decision = await produce_filter.on_request(frame_of(b"records"), cast(Any, context))
    assert isinstance(decision, Respond)
    return produce_filter, decision


CONNECTION = object()  # stands for the client connection of `_responded`'s request


def test_the_engine_is_told_the_connection_a_request_came_on() -> None:
    """Refusals about one request alone hold back only its connection's requests behind it
    (`dedup.partitions.Reach`): the engine must know which connection that is."""

    async def scenario() -> list[object | None]:
        engine = _HeldEngine()
        produce_filter, _ = await _responded(engine)
        engine.release.set()
        await produce_filter.drain()
        return engine.connections

    assert asyncio.run(scenario()) == [CONNECTION]


def test_the_answer_is_the_produce_response_of_the_write() -> None:
    async def scenario() -> Any:
        engine = _HeldEngine()
        _, decision = await _responded(engine)
        engine.release.set()
        return await decision.answer

    response = asyncio.run(scenario())
    (topic,) = response.responses
    (partition,) = topic.partition_responses
    assert (str(topic.name), int(partition.index), int(partition.base_offset)) == ("t", 0, 5)


def test_a_connection_that_stops_waiting_leaves_the_write_running() -> None:
    async def scenario() -> int:
        engine = _HeldEngine()
        produce_filter, decision = await _responded(engine)
        decision.answer.cancel()  # the client's connection went away
        await asyncio.sleep(0)
        engine.release.set()
        await produce_filter.drain()
        return engine.written

    assert asyncio.run(scenario()) == 1


def test_a_failed_write_fails_the_answer_with_its_error() -> None:
    async def scenario() -> None:
        engine = _HeldEngine(error=RuntimeError("boom"))
        _, decision = await _responded(engine)
        engine.release.set()
        with pytest.raises(RuntimeError, match="boom"):
            await decision.answer

    asyncio.run(scenario())

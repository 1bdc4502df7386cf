"""The proxy's own connection to a broker: large Produce requests written off the event loop,
and the order on the wire kept. Against a loopback socket that records what it receives
(the framing and ordering logic only; the integration tests run it against Kafka)."""

from __future__ import annotations

import asyncio
import datetime
import threading

import kio.schema.produce.v11.request as produce_v11
import pytest
from kio.schema.types import TopicName
from kio.static.primitive import Records, i16, i32, i32Timedelta

from proxy.kafka import upstream_client
from proxy.kafka.topology import Endpoint
from proxy.kafka.upstream_client import LinkClosed, UpstreamClient, encode_request
from proxy.kafka.wire import read_frame
from tests.support.threads import record_to_thread

pytestmark = pytest.mark.unit

QUEUED_FROM = 1000  # record bytes from which a request is written by the queue


def produce(records: bytes) -> produce_v11.ProduceRequest:
    return produce_v11.ProduceRequest(
        transactional_id=None,
        acks=i16(-1),
        timeout=i32Timedelta.parse(datetime.timedelta(seconds=5)),
        topic_data=(
            produce_v11.TopicProduceData(
                name=TopicName("t"),
                partition_data=(
                    produce_v11.PartitionProduceData(index=i32(0), records=Records(records)),
                ),
            ),
        ),
    )


def request_correlation_id(payload: bytes) -> int:
    return int.from_bytes(payload[4:8], "big")  # after api_key and api_version


class Recorder:
    """A loopback server that keeps every frame it reads and never answers."""

    def __init__(self) -> None:
        self.frames: list[bytes] = []
        self.got = asyncio.Event()
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> Endpoint:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return Endpoint("127.0.0.1", port)

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while (payload := await read_frame(reader, 1 << 30)) is not None:
                self.frames.append(payload)
                self.got.set()
        except (asyncio.CancelledError, ConnectionError):
            pass
        finally:
            writer.close()

    async def wait_for(self, count: int) -> None:
        async with asyncio.timeout(10):
            while len(self.frames) < count:
                self.got.clear()
                await self.got.wait()


def test_large_requests_are_framed_in_a_thread_and_keep_their_place_on_the_wire(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Pieces of 7 bytes: a large request goes to the transport in many writes.
    monkeypatch.setattr(upstream_client, "_PIECE_BYTES", 7)
    framed_in = record_to_thread(monkeypatch)
    payloads = [
        produce(b"L" * 5000),  # queued
        produce(b"s" * 10),  # behind it: queued too, though small
        produce(b"M" * 3000),
        produce(b"t" * 20),
    ]

    async def scenario() -> tuple[list[bytes], list[bytes]]:
        recorder = Recorder()
        async with recorder as endpoint:
            client = await UpstreamClient(endpoint, 5.0, queued_from_bytes=QUEUED_FROM).connect()
            for payload in payloads:
                client.send(payload)
            await recorder.wait_for(len(payloads))
            # The queue is empty again: a small request is written at once.
            last = produce(b"u")
            client.send(last)
            assert client._queue_task is None
            await recorder.wait_for(len(payloads) + 1)
            await client.close()
        expected = [encode_request(p, n)[4:] for n, p in enumerate([*payloads, last], start=1)]
        return recorder.frames, expected

    frames, expected = asyncio.run(scenario())
    assert [request_correlation_id(f) for f in frames] == [1, 2, 3, 4, 5]
    assert frames == expected, "every frame whole, byte for byte, in the order sent"
    main = threading.get_ident()
    assert len(framed_in) == 2 and main not in framed_in, "the two large ones, off the loop"


def test_closing_with_requests_queued_fails_their_answers() -> None:
    async def scenario() -> list[BaseException | None]:
        recorder = Recorder()
        async with recorder as endpoint:
            client = await UpstreamClient(endpoint, 5.0, queued_from_bytes=QUEUED_FROM).connect()
            answers = [client.send(produce(b"x" * 4000)), client.send(produce(b"y"))]
            await client.close()
            await asyncio.sleep(0)
            with pytest.raises(LinkClosed):
                client.send(produce(b"z"))
            return [answer.exception() for answer in answers]

    errors = asyncio.run(scenario())
    assert all(isinstance(error, LinkClosed) for error in errors)

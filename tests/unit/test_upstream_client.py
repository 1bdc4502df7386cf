"""The proxy's own connection to a broker: large Produce requests written in pieces and
never joined whole, and the order on the wire kept. Against a loopback socket that records
what it receives (the framing and ordering logic only; the integration tests run it against
Kafka)."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest

from proxy.kafka import upstream_client
from proxy.kafka.produce_codec import (
    RecordPieces,
    WriterPartitionData,
    WriterProduceRequest,
    WriterTopicData,
)
from proxy.kafka.topology import Endpoint
from proxy.kafka.upstream_client import (
    QUEUED_FROM_BYTES,
    LinkClosed,
    UpstreamClient,
    encode_request,
    records_for_request,
)
from proxy.kafka.wire import read_frame

pytestmark = pytest.mark.unit

QUEUED_FROM = 1000  # record bytes from which a request is written by the queue


def produce(records: bytes | RecordPieces) -> WriterProduceRequest:
    """A Produce request as the proxy's writer sends it."""
    partition = WriterPartitionData(0, records)
    return WriterProduceRequest(5_000, (WriterTopicData("t", (partition,)),))


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


def test_large_requests_go_out_unjoined_in_pieces_and_keep_their_place_on_the_wire(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Pieces of 7 bytes: a large request goes to the transport in many writes.
    monkeypatch.setattr(upstream_client, "_PIECE_BYTES", 7)
    framed_whole: list[int] = []
    frame_whole = upstream_client.produce_request_v11_frame

    def spy(request: Any, correlation_id: int, client_id: str | None) -> bytes:
        framed_whole.append(correlation_id)
        return frame_whole(request, correlation_id, client_id)

    monkeypatch.setattr(upstream_client, "produce_request_v11_frame", spy)
    header = b"H" * 61
    pieces = RecordPieces([header, memoryview(b"xL" * 2500)[1:]])  # a view, as the writer's
    payloads = [
        produce(b"L" * 5000),  # queued
        produce(b"s" * 10),  # behind it: queued too, though small
        produce(pieces),
        produce(b"t" * 20),
    ]

    async def scenario() -> list[bytes]:
        recorder = Recorder()
        async with recorder as endpoint:
            client = await UpstreamClient(endpoint, 5.0, queued_from_bytes=QUEUED_FROM).connect()
            for payload in payloads:
                client.send(payload)
            await recorder.wait_for(len(payloads))
            # The queue is empty again: a small request is written at once.
            client.send(produce(b"u"))
            assert client._queue_task is None
            await recorder.wait_for(len(payloads) + 1)
            await client.close()
        return recorder.frames

    frames = asyncio.run(scenario())
    joined = [*payloads[:2], produce(bytes(pieces)), payloads[3], produce(b"u")]
    expected = [frame_whole(p, n, upstream_client.CLIENT_ID)[4:] for n, p in enumerate(joined, 1)]
    assert [request_correlation_id(f) for f in frames] == [1, 2, 3, 4, 5]
    assert frames == expected, "every frame whole, byte for byte, in the order sent"
    assert framed_whole == [2, 4, 5], "only the small ones are framed as one bytes object"


def test_the_loop_turns_between_the_pieces_of_a_large_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Loopback takes megabytes at once, so `drain` alone never waits: without a turn of
    the loop per piece, one request would be written whole while every connection waits."""
    monkeypatch.setattr(upstream_client, "_PIECE_BYTES", 1000)
    turns: list[int] = []  # the pieces written so far, at each turn of the loop
    written = 0
    real_writelines = asyncio.StreamWriter.writelines

    def counting(self: asyncio.StreamWriter, data: Any) -> None:
        nonlocal written
        written += 1
        real_writelines(self, data)

    async def ticking() -> None:
        while True:
            turns.append(written)
            await asyncio.sleep(0)

    async def scenario() -> None:
        recorder = Recorder()
        async with recorder as endpoint:
            client = await UpstreamClient(endpoint, 5.0, queued_from_bytes=QUEUED_FROM).connect()
            ticker = asyncio.create_task(ticking())
            monkeypatch.setattr(asyncio.StreamWriter, "writelines", counting)
            client.send(produce(b"L" * 50_000))  # some 50 pieces
            await recorder.wait_for(1)
            ticker.cancel()
            await client.close()

    asyncio.run(scenario())
    assert written >= 50
    steps = [b - a for a, b in itertools.pairwise(turns)]
    assert max(steps) <= 1, "at most one piece between two turns of the loop"


def test_records_stay_in_pieces_from_the_queueing_size_on() -> None:
    small = records_for_request([b"h" * 10, memoryview(b"r" * 100)])
    assert type(small) is bytes and small == b"h" * 10 + b"r" * 100
    large = records_for_request([b"h" * 61, memoryview(b"r" * QUEUED_FROM_BYTES)])
    assert isinstance(large, RecordPieces) and len(large) == 61 + QUEUED_FROM_BYTES
    assert bytes(large) == b"h" * 61 + b"r" * QUEUED_FROM_BYTES
    assert encode_request(produce(large), 9) == encode_request(produce(bytes(large)), 9)


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


def test_a_brokers_answer_of_a_mebibyte_is_buffered_without_pausing_the_socket() -> None:
    """asyncio's streams stop reading the socket at 128 KiB unread (their default limit,
    twice): a Fetch answer of 1 MiB would stop and restart it some eight times, each a
    turn of the proxy's loop between Kafka's answer and the client's next request."""
    answer = b"f" * (3 << 19)  # 1.5 MiB: under twice the read-ahead, over asyncio's default
    sent = asyncio.Event()

    async def answering(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(answer)
        await writer.drain()
        sent.set()
        await asyncio.sleep(30)  # open until the reader is done

    async def scenario() -> tuple[int, bool]:
        server = await asyncio.start_server(answering, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await upstream_client.open_upstream(Endpoint("127.0.0.1", port), None)
        await asyncio.wait_for(sent.wait(), 10)
        await asyncio.sleep(0.3)  # the loopback's bytes into the stream's buffer
        still_reading = writer.transport.is_reading()
        first = await reader.read(len(answer))  # what the stream holds, at most that
        writer.close()
        server.close()
        return len(first), still_reading

    buffered, still_reading = asyncio.run(scenario())
    assert still_reading, "the socket is still read with 1.5 MiB unread"
    assert buffered == len(answer), "the whole answer was read ahead, in one piece"

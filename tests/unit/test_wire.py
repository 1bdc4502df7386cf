"""Frame and header codec: property tests against kio's own encoders, and fuzzing."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import io
import threading
from typing import Any

import kio.schema.request_header.v1.header as header_v1
import kio.schema.request_header.v2.header as header_v2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kio.index import load_request_schema
from kio.serial import entity_writer
from kio.static.primitive import i16, i32, i32Timedelta

from proxy.kafka.schemas import DECODABLE_VERSIONS, request_header_is_flexible
from proxy.kafka.wire import (
    FrameError,
    UnsupportedRequest,
    frame,
    parse_request_header,
    produce_acks,
    read_frame,
    response_body_start,
)
from tests.support.threads import record_to_thread

pytestmark = pytest.mark.unit

api_and_version = st.sampled_from(sorted(DECODABLE_VERSIONS.items())).flatmap(
    lambda item: st.tuples(st.just(item[0]), st.integers(item[1].min, item[1].max))
)
client_ids = st.none() | st.text(max_size=40)


def encode_header(api_key: int, version: int, correlation_id: int, client_id: str | None) -> bytes:
    header_type = (
        header_v2.RequestHeader
        if request_header_is_flexible(api_key, version)
        else header_v1.RequestHeader
    )
    buffer = io.BytesIO()
    entity_writer(header_type)(
        buffer,
        header_type(
            request_api_key=i16(api_key),
            request_api_version=i16(version),
            correlation_id=i32(correlation_id),
            client_id=client_id,
        ),
    )
    return buffer.getvalue()


def feed(chunks: list[bytes]) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    for chunk in chunks:
        reader.feed_data(chunk)
    reader.feed_eof()
    return reader


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


@given(
    payloads=st.lists(st.binary(max_size=300), max_size=5),
    cuts=st.lists(st.integers(0, 10_000), max_size=8),
)
def test_frames_round_trip_whatever_the_chunking(payloads: list[bytes], cuts: list[int]) -> None:
    stream = b"".join(frame(p) for p in payloads)

    async def read_all() -> list[bytes]:
        reader = feed(split_at(stream, cuts))
        out = []
        while (payload := await read_frame(reader, 1000)) is not None:
            out.append(payload)
        return out

    assert asyncio.run(read_all()) == payloads


@given(
    payloads=st.lists(st.binary(max_size=300), max_size=5),
    cuts=st.lists(st.integers(0, 10_000), max_size=8),
    piecewise_from=st.integers(1, 64),
)
def test_large_frames_read_in_pieces_round_trip_whatever_the_chunking(
    payloads: list[bytes], cuts: list[int], piecewise_from: int
) -> None:
    stream = b"".join(frame(p) for p in payloads)

    async def read_all() -> list[bytes]:
        reader = feed(split_at(stream, cuts))
        out = []
        while (payload := await read_frame(reader, 1000, piecewise_from)) is not None:
            assert isinstance(payload, bytes)
            out.append(payload)
        return out

    assert asyncio.run(read_all()) == payloads


@given(
    payload=st.binary(min_size=1, max_size=50),
    cut=st.integers(1, 53),
    piecewise_from=st.sampled_from([1, 8, 10_000]),
)
def test_truncated_frame_is_a_frame_error_not_an_end(
    payload: bytes, cut: int, piecewise_from: int
) -> None:
    data = frame(payload)
    cut = min(cut, len(data) - 1)

    async def read() -> bytes | None:
        return await read_frame(feed([data[:cut]]), 1000, piecewise_from)

    with pytest.raises(FrameError):
        asyncio.run(read())


def test_a_frame_trickled_a_byte_at_a_time_is_gathered_into_few_pieces(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    payload = bytes(range(256)) * 16
    joined: list[int] = []
    real_to_thread = asyncio.to_thread

    async def count_pieces(func: Any, pieces: list[bytes]) -> Any:
        joined.append(len(pieces))
        return await real_to_thread(func, pieces)

    monkeypatch.setattr(asyncio, "to_thread", count_pieces)
    data = frame(payload)

    async def read() -> bytes | None:
        reader = asyncio.StreamReader()

        async def trickle() -> None:  # one byte, then the reader reads it, and so on
            for i in range(len(data)):
                reader.feed_data(data[i : i + 1])
                await asyncio.sleep(0)
            reader.feed_eof()

        feeding = asyncio.create_task(trickle())
        payload = await read_frame(reader, 1 << 20, 1024)
        await feeding
        return payload

    assert asyncio.run(read()) == payload
    # 4096 bytes read one at a time, gathered into pieces of 1024 // 16 bytes.
    assert joined == [4096 // 64]


def test_a_frame_read_in_pieces_is_joined_off_the_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    payload = bytes(range(256)) * 64
    main = threading.get_ident()
    joined_in = record_to_thread(monkeypatch)

    async def read() -> bytes | None:
        return await read_frame(feed(split_at(frame(payload), [100, 5000, 9000])), 1 << 20, 1024)

    assert asyncio.run(read()) == payload
    assert len(joined_in) == 1 and joined_in[0] != main, "joined once, in a worker thread"


def test_oversize_and_negative_frames_are_refused_before_reading_them() -> None:
    async def read(size: int) -> bytes | None:
        return await read_frame(feed([size.to_bytes(4, "big", signed=True)]), 100)

    with pytest.raises(FrameError, match="exceeds the limit of 100"):
        asyncio.run(read(101))
    with pytest.raises(FrameError, match="negative"):
        asyncio.run(read(-5))


@given(api=api_and_version, correlation_id=st.integers(-(2**31), 2**31 - 1), client_id=client_ids)
def test_request_header_matches_kio_encoding(
    api: tuple[int, int], correlation_id: int, client_id: str | None
) -> None:
    api_key, version = api
    encoded = encode_header(api_key, version, correlation_id, client_id)
    header = parse_request_header(encoded + b"body")
    assert (header.api_key, header.api_version) == api
    assert header.correlation_id == correlation_id
    assert header.client_id == client_id
    assert header.body_offset == len(encoded)


def test_unknown_api_key_and_unsupported_versions_are_refused() -> None:
    with pytest.raises(UnsupportedRequest, match="unknown API key 999"):
        parse_request_header(b"\x03\xe7\x00\x00" + bytes(4) + b"\xff\xff")
    produce = DECODABLE_VERSIONS[0]
    with pytest.raises(UnsupportedRequest, match="produce"):
        parse_request_header(b"\x00\x00" + (produce.max + 1).to_bytes(2, "big") + bytes(8))
    # A too-new ApiVersions request is legal: Kafka answers it with its supported range.
    header = parse_request_header(b"\x00\x12\x00\x63" + bytes(4) + b"\xff\xff")
    assert (header.api_key, header.api_version) == (18, 99)


@given(data=st.binary(max_size=64))
def test_garbage_headers_raise_only_frame_errors(data: bytes) -> None:
    with contextlib.suppress(FrameError):
        parse_request_header(data)


@given(
    version=st.integers(DECODABLE_VERSIONS[0].min, DECODABLE_VERSIONS[0].max),
    acks=st.sampled_from([-1, 0, 1]),
    transactional_id=st.none() | st.text(max_size=30),
)
def test_produce_acks_read_from_kio_encoded_requests(
    version: int, acks: int, transactional_id: str | None
) -> None:
    schema = load_request_schema(0, version)
    request = schema(  # type: ignore[call-arg]
        transactional_id=transactional_id,
        acks=i16(acks),
        timeout=i32Timedelta.parse(datetime.timedelta(seconds=30)),
        topic_data=(),
    )
    buffer = io.BytesIO()
    entity_writer(schema)(buffer, request)
    payload = encode_header(0, version, 7, "p") + buffer.getvalue()
    assert produce_acks(payload, parse_request_header(payload)) == acks


@settings(max_examples=300)
@given(data=st.binary(max_size=40), flexible=st.booleans())
def test_response_body_start_never_overruns(data: bytes, flexible: bool) -> None:
    try:
        start = response_body_start(b"\x00\x00\x00\x01" + data, flexible)
    except FrameError:
        return
    assert 4 <= start <= len(data) + 4

"""Kafka frames and message headers on the wire.

A frame is a 4-byte big-endian size followed by that many bytes. A request starts with
api_key, api_version and correlation_id (the same in every header version), then the
client id and, for flexible versions, tagged fields. The proxy reads only what it routes
on and forwards the frame's bytes untouched.
"""

from __future__ import annotations

import asyncio
import struct
from dataclasses import dataclass

from kio.serial.errors import DecodeError
from kio.serial.readers import (
    read_compact_string_nullable,
    read_int16,
    read_nullable_legacy_string,
    read_unsigned_varint,
)

from proxy.kafka.api_keys import ApiKey
from proxy.kafka.schemas import (
    DECODABLE_VERSIONS,
    api_name,
    request_header_is_flexible,
    response_header_is_flexible,
)

_SIZE = struct.Struct(">i")
_REQUEST_PREFIX = struct.Struct(">hhi")
_DECODE_ERRORS = (DecodeError, ValueError, IndexError, UnicodeDecodeError)


# A frame from this size on is read in pieces and the pieces joined in a worker thread
# (bytes.join lets go of the GIL for a large join): `readexactly` copies the whole frame
# out of the stream's buffer on the event loop, some 20 ms for 32 MB, during which the
# proxy serves no other connection. Below it the copy is cheaper than the pieces and the
# thread: a frame of 4 MiB is copied in about 0.4 ms, and a consumer's Fetch answers of
# about 1 MiB (Kafka's default `max.partition.fetch.bytes`) read at once, with a larger
# read-ahead (`upstream_client.UPSTREAM_READ_AHEAD_BYTES`), cost the pass-through 17-28 %
# less CPU (benchmarks/README.md, "Fetch answers read at once").
PIECEWISE_FRAME_BYTES = 4 << 20


class FrameError(Exception):
    """The peer sent bytes that are not a valid Kafka frame; the connection must close."""


class UnsupportedRequest(FrameError):
    """An API key or version the proxy cannot handle; Kafka closes the connection too."""


async def read_frame(
    reader: asyncio.StreamReader, max_bytes: int, piecewise_from: int = PIECEWISE_FRAME_BYTES
) -> bytes | None:
    """Read one frame's payload, or None on a clean end of stream between frames. A payload
    of `piecewise_from` bytes or more is read in pieces (see `PIECEWISE_FRAME_BYTES`)."""
    try:
        size_bytes = await reader.readexactly(4)
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise FrameError("connection closed inside a frame size") from exc
        return None
    (size,) = _SIZE.unpack(size_bytes)
    if size < 0:
        raise FrameError(f"negative frame size {size}")
    if size > max_bytes:
        raise FrameError(f"frame of {size} bytes exceeds the limit of {max_bytes} bytes")
    if size >= piecewise_from:
        return await _read_in_pieces(reader, size, piecewise_from)
    try:
        return await reader.readexactly(size)
    except asyncio.IncompleteReadError as exc:
        raise FrameError(
            f"connection closed after {len(exc.partial)} of {size} frame bytes"
        ) from exc


async def _read_in_pieces(reader: asyncio.StreamReader, size: int, piece_bytes: int) -> bytes:
    # Pieces under a sixteenth of `piece_bytes` are gathered first: a peer that trickles
    # its bytes one segment at a time must not cost an object per segment.
    least = max(1, piece_bytes // 16)
    pieces: list[bytes] = []
    small = bytearray()
    missing = size
    while missing:
        piece = await reader.read(min(missing, piece_bytes))  # what has arrived, up to that
        if not piece:
            raise FrameError(f"connection closed after {size - missing} of {size} frame bytes")
        missing -= len(piece)
        if len(piece) >= least and not small:
            pieces.append(piece)
            continue
        small += piece
        if len(small) >= least or not missing:
            pieces.append(bytes(small))
            small.clear()
    if len(pieces) == 1:
        return pieces[0]
    return await asyncio.to_thread(b"".join, pieces)


def frame(payload: bytes) -> bytes:
    return _SIZE.pack(len(payload)) + payload


@dataclass(frozen=True, slots=True)
class RequestHeader:
    api_key: int
    api_version: int
    correlation_id: int
    client_id: str | None
    body_offset: int  # where the request body starts in the frame payload

    @property
    def flexible_response(self) -> bool:
        return response_header_is_flexible(self.api_key, self.api_version)


def parse_request_header(payload: bytes) -> RequestHeader:
    """Parse a request header; raises FrameError for anything Kafka would not accept."""
    if len(payload) < _REQUEST_PREFIX.size + 2:
        raise FrameError(f"request of {len(payload)} bytes is shorter than a request header")
    api_key, api_version, correlation_id = _REQUEST_PREFIX.unpack_from(payload)
    supported = DECODABLE_VERSIONS.get(api_key)
    if supported is None:
        raise UnsupportedRequest(f"unknown API key {api_key}")
    # A too-new ApiVersions request is legal: it is answered with version negotiation.
    too_new_api_versions = api_key == ApiKey.API_VERSIONS and api_version > supported.max
    if api_version not in supported and not too_new_api_versions:
        raise UnsupportedRequest(f"{api_name(api_key)} v{api_version} is not supported")
    offset = _REQUEST_PREFIX.size
    try:
        # The client id stays a legacy nullable string even in flexible header v2.
        client_id, size = read_nullable_legacy_string(payload, offset)
        offset += size
        if not too_new_api_versions and request_header_is_flexible(api_key, api_version):
            offset = _skip_tagged_fields(payload, offset)
    except _DECODE_ERRORS as exc:
        raise FrameError(f"malformed request header: {exc}") from exc
    if offset > len(payload):
        raise FrameError("request header runs past the end of the frame")
    return RequestHeader(api_key, api_version, correlation_id, client_id, offset)


def _skip_tagged_fields(buffer: bytes, offset: int) -> int:
    count, size = read_unsigned_varint(buffer, offset)
    offset += size
    for _ in range(count):
        _tag, size = read_unsigned_varint(buffer, offset)
        offset += size
        length, size = read_unsigned_varint(buffer, offset)
        offset += size + length
    return offset


def expects_response(header: RequestHeader, payload: bytes) -> bool:
    """Whether Kafka answers this request: every request does, except Produce with acks=0."""
    return header.api_key != ApiKey.PRODUCE or produce_acks(payload, header) != 0


def produce_acks(payload: bytes, header: RequestHeader) -> int:
    """The acks of a Produce request: acks=0 requests get no response from Kafka."""
    offset = header.body_offset
    try:
        if header.api_version >= 3:  # transactional_id comes first from v3 on
            if header.api_version >= 9:
                _txn, size = read_compact_string_nullable(payload, offset)
            else:
                _txn, size = read_nullable_legacy_string(payload, offset)
            offset += size
        acks, _ = read_int16(payload, offset)
    except _DECODE_ERRORS as exc:
        raise FrameError(f"malformed produce request: {exc}") from exc
    return int(acks)


def response_body_start(payload: bytes, flexible_header: bool) -> int:
    """Where the body of a response starts: after the correlation id and any tagged fields."""
    end = 4
    if flexible_header:
        try:
            end = _skip_tagged_fields(payload, 4)
        except _DECODE_ERRORS as exc:
            raise FrameError(f"malformed response header: {exc}") from exc
    if end > len(payload):
        raise FrameError("response header runs past the end of the frame")
    return end


def correlation_id_of(payload: bytes) -> int:
    (correlation_id,) = _SIZE.unpack_from(payload)
    return int(correlation_id)

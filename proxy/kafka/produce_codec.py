"""Produce requests and responses encoded by hand, to the byte what kio writes.

kio's generic entity writer walks every field of every nested entity through isinstance
checks and Phantom types; for a small Produce that walk costs most of the encoding, and the
proxy encodes one request per upstream write and one response per client Produce. These
encoders write the same bytes (tests/unit/test_produce_codec.py checks them against kio for
every version) and hand what they do not know (another layout, tagged fields set) to kio.
"""

from __future__ import annotations

import io
import struct
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from datetime import datetime, timedelta
from typing import Any, ClassVar, Final

from kio.index import load_response_schema
from kio.schema.index import api_key_map, schema_name_map
from kio.serial import entity_writer
from kio.static.constants import EntityType

from proxy.kafka.api_keys import ApiKey

_INT16 = struct.Struct(">h")
_INT32 = struct.Struct(">i")
_REQUEST_HEADER = struct.Struct(">hhi")  # api_key, api_version, correlation_id
_ACKS_TIMEOUT = struct.Struct(">hi")
_PARTITION_V3 = struct.Struct(">ihqq")  # index, error_code, base_offset, log_append_time
_PARTITION_V5 = struct.Struct(">ihqqq")  # the same and log_start_offset
_NO_TAGS = b"\x00"  # an empty tagged-field section; also a null compact string or array
_SMALL_UVARINTS = tuple(bytes((n,)) for n in range(0x80))


def _uvarint(value: int) -> bytes:
    if value < 0x80:
        return _SMALL_UVARINTS[value]
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _compact_string(value: str | None) -> bytes:
    if value is None:
        return _NO_TAGS
    data = value.encode()
    return _uvarint(len(data) + 1) + data


def _legacy_string(value: str | None) -> bytes:
    if value is None:
        return b"\xff\xff"
    data = value.encode()
    return _INT16.pack(len(data)) + data


def _compact_length(items: Sequence[object] | None) -> bytes:
    return _NO_TAGS if items is None else _uvarint(len(items) + 1)


def _legacy_length(items: Sequence[object] | None) -> bytes:
    return b"\xff\xff\xff\xff" if items is None else _INT32.pack(len(items))


# kio's own conversions, float arithmetic and all, so that the milliseconds always agree.
def _millis(value: timedelta) -> int:
    return round(value.total_seconds() * 1000)


def _timestamp_millis(value: datetime | None) -> int:
    return -1 if value is None else round(value.timestamp() * 1000)


def _field_names(entity_type: type[Any]) -> tuple[str, ...]:
    return tuple(field.name for field in fields(entity_type))


def _kio_body(entity: Any) -> bytes:
    buffer = io.BytesIO()
    entity_writer(type(entity))(buffer, entity)
    return buffer.getvalue()


# --- ProduceRequest v11, the one the proxy's idempotent writer sends upstream ---------------


class RecordPieces:
    """A partition's record bytes kept in pieces (a batch's new header, a view of the
    client's records), for a request that is written to the socket piece by piece: joined,
    a 32 MB batch is a copy of some 25 ms on the event loop. In a `WriterPartitionData` in
    place of bytes; the encoder below writes the pieces in a row."""

    __slots__ = ("pieces", "size")

    def __init__(self, pieces: Sequence[bytes | memoryview]) -> None:
        self.pieces = tuple(pieces)
        self.size = sum(map(len, self.pieces))  # byte views: their length is their bytes

    def __len__(self) -> int:
        return self.size

    def __bytes__(self) -> bytes:
        return b"".join(self.pieces)


RecordBytes = bytes | RecordPieces


@dataclass(slots=True)
class WriterPartitionData:
    """One partition of a `WriterProduceRequest`, under kio's field names."""

    index: int
    records: RecordBytes


@dataclass(slots=True)
class WriterTopicData:
    name: str
    partition_data: tuple[WriterPartitionData, ...]


@dataclass(slots=True)
class WriterProduceRequest:
    """The Produce request (v11) the proxy's idempotent writer sends upstream, one per write:
    kio's fields and names with plain values. kio's entities validate every field, which
    the writer's values need not (a partition of a request already decoded, the writer's
    own bytes); three of them and a timeout object cost a request some microseconds more.
    Written by `produce_request_v11_parts` to the bytes kio writes for its `ProduceRequest`
    of the same values (tests/unit/test_produce_codec.py)."""

    __api_key__: ClassVar[ApiKey] = ApiKey.PRODUCE
    __version__: ClassVar[int] = 11
    transactional_id: ClassVar[None] = None  # the writer is idempotent, not transactional
    acks: ClassVar[int] = -1  # idempotent writes require acks=all

    timeout_ms: int
    topic_data: tuple[WriterTopicData, ...]


def produce_request_v11_frame(
    request: WriterProduceRequest, correlation_id: int, client_id: str | None
) -> bytes:
    """A whole frame: size, request header v2 and body, as kio writes them."""
    # One join copies the records once (a 32 MB copy is some 15 ms of the event loop).
    return b"".join(produce_request_v11_parts(request, correlation_id, client_id))


def produce_request_v11_parts(
    request: WriterProduceRequest, correlation_id: int, client_id: str | None
) -> list[bytes | memoryview]:
    """The frame in parts, the records (or their pieces) among them as they are."""
    parts: list[bytes | memoryview] = [
        b"",  # the size, once known
        _REQUEST_HEADER.pack(request.__api_key__, request.__version__, correlation_id),
        _legacy_string(client_id),  # client_id is a legacy string in every header version
        _NO_TAGS,
    ]
    _append_produce_request_v11(parts, request)
    parts[0] = _INT32.pack(sum(map(len, parts)))
    return parts


def encode_produce_request_v11(request: WriterProduceRequest) -> bytes:
    """The request body alone."""
    parts: list[bytes | memoryview] = []
    _append_produce_request_v11(parts, request)
    return b"".join(parts)


def _append_produce_request_v11(
    parts: list[bytes | memoryview], request: WriterProduceRequest
) -> None:
    append = parts.append
    append(_compact_string(request.transactional_id))
    append(_ACKS_TIMEOUT.pack(request.acks, request.timeout_ms))
    append(_compact_length(request.topic_data))
    for topic in request.topic_data:
        append(_compact_string(topic.name))
        append(_compact_length(topic.partition_data))
        for partition in topic.partition_data:
            append(_INT32.pack(partition.index))
            records = partition.records
            # The records as they are (pieces in a row): no copy before the final join.
            append(_uvarint(len(records) + 1))
            if isinstance(records, RecordPieces):
                parts.extend(records.pieces)
            else:
                append(records)
            append(_NO_TAGS)
        append(_NO_TAGS)
    append(_NO_TAGS)


# --- ProduceResponse, every version whose layout is known -----------------------------------


@dataclass(frozen=True, slots=True)
class _ResponseLayout:
    """What a ProduceResponse version has, and how it writes strings and arrays."""

    string: Callable[[str | None], bytes]
    length: Callable[[Sequence[object] | None], bytes]
    end: bytes  # an entity's (empty) tagged fields: flexible versions only
    log_start_offset: bool  # v5+
    record_errors: bool  # v8+: record_errors and error_message
    tagged: bool  # v10+: current_leader and node_endpoints, kio writes them when set
    no_leader: object  # current_leader's default, which kio leaves out


def _response_layout(version: int) -> tuple[type[Any], _ResponseLayout] | None:
    """The version's layout, or None if kio's entities are not the layout expected."""
    response_type = load_response_schema(ApiKey.PRODUCE, version)
    module = sys.modules[response_type.__module__]
    flexible = bool(response_type.__flexible__)
    tagged = version >= 10
    partition_fields = ["index", "error_code", "base_offset", "log_append_time"]
    partition_fields += ["log_start_offset"] if version >= 5 else []
    partition_fields += ["record_errors", "error_message"] if version >= 8 else []
    partition_fields += ["current_leader"] if tagged else []
    partition_type = module.PartitionProduceResponse
    known = (
        flexible == (version >= 9)
        and _field_names(response_type)
        == ("responses", "throttle_time", *(("node_endpoints",) if tagged else ()))
        and _field_names(module.TopicProduceResponse) == ("name", "partition_responses")
        and _field_names(partition_type) == tuple(partition_fields)
        and (
            version < 8
            or _field_names(module.BatchIndexAndErrorMessage)
            == ("batch_index", "batch_index_error_message")
        )
    )
    if not known:
        return None
    defaults = {field.name: field.default for field in fields(partition_type)}
    return response_type, _ResponseLayout(
        string=_compact_string if flexible else _legacy_string,
        length=_compact_length if flexible else _legacy_length,
        end=_NO_TAGS if flexible else b"",
        log_start_offset=version >= 5,
        record_errors=version >= 8,
        tagged=tagged,
        no_leader=defaults.get("current_leader"),
    )


def _response_layouts() -> dict[type[Any], _ResponseLayout]:
    versions = schema_name_map[api_key_map[ApiKey.PRODUCE]]
    layouts = (
        _response_layout(version)
        for version, entities in versions.items()
        if EntityType.response in entities
    )
    return dict(layout for layout in layouts if layout is not None)


_RESPONSE_LAYOUTS: Final = _response_layouts()
_LAYOUTS_BY_VERSION: Final = {int(t.__version__): layout for t, layout in _RESPONSE_LAYOUTS.items()}
# The ProduceResponse types encode_produce_response writes itself (Produce v13 is not one).
LEAN_PRODUCE_RESPONSES: Final = frozenset(_RESPONSE_LAYOUTS)

PartitionRow = tuple[int, int, int, int, int, Sequence[tuple[int, str | None]] | None, str | None]
"""One partition of a ProduceResponse: index, error code, base offset, log append time
(milliseconds, -1 for none), log start offset, record errors (batch index and message),
error message. What a version does not have is not written."""


def encode_produce_response(response: Any) -> bytes:
    """A ProduceResponse body of any version: kio's bytes, by hand where the layout is known."""
    layout = _RESPONSE_LAYOUTS.get(type(response))
    parts = None if layout is None else _response_parts(response, layout)
    return _kio_body(response) if parts is None else b"".join(parts)


def encode_produce_answers(
    version: int, topics: Sequence[tuple[str, Sequence[PartitionRow]]]
) -> bytes | None:
    """A ProduceResponse body of ``version`` written from plain values, no throttle time and
    no tagged field: the bytes kio writes for the same entity (the proxy's own answers,
    without an entity each). None for a version whose layout is not known here."""
    layout = _LAYOUTS_BY_VERSION.get(version)
    return None if layout is None else b"".join(_body_parts(layout, topics, 0))


def _response_parts(response: Any, layout: _ResponseLayout) -> list[bytes] | None:
    """The body's parts; None when a tagged field is set (kio encodes those)."""
    # kio writes a tagged field unless it equals its default; the same test here.
    if layout.tagged and response.node_endpoints != ():
        return None
    # kio's arrays are never None, but a None is written as a null array, as kio would.
    topics: list[tuple[str, list[PartitionRow] | None]] | None = None
    if response.responses is not None:
        topics = []
        for topic in response.responses:
            if topic.partition_responses is None:
                topics.append((topic.name, None))
                continue
            rows: list[PartitionRow] = []
            for partition in topic.partition_responses:
                if layout.tagged and partition.current_leader != layout.no_leader:
                    return None
                rows.append(_row(partition, layout))
            topics.append((topic.name, rows))
    return _body_parts(layout, topics, _millis(response.throttle_time))


def _row(partition: Any, layout: _ResponseLayout) -> PartitionRow:
    errors = None
    if layout.record_errors and partition.record_errors is not None:
        errors = [(e.batch_index, e.batch_index_error_message) for e in partition.record_errors]
    return (
        partition.index,
        partition.error_code,
        partition.base_offset,
        _timestamp_millis(partition.log_append_time),
        partition.log_start_offset if layout.log_start_offset else -1,
        errors,
        partition.error_message if layout.record_errors else None,
    )


def _body_parts(
    layout: _ResponseLayout,
    topics: Sequence[tuple[str, Sequence[PartitionRow] | None]] | None,
    throttle_ms: int,
) -> list[bytes]:
    string, length, end = layout.string, layout.length, layout.end
    parts = [length(topics)]
    append = parts.append
    for name, rows in topics or ():
        append(string(name))
        append(length(rows))
        for index, code, base_offset, append_ms, start_offset, errors, message in rows or ():
            if layout.log_start_offset:
                append(_PARTITION_V5.pack(index, code, base_offset, append_ms, start_offset))
            else:
                append(_PARTITION_V3.pack(index, code, base_offset, append_ms))
            if layout.record_errors:
                append(length(errors))
                for batch_index, batch_message in errors or ():
                    append(_INT32.pack(batch_index))
                    append(string(batch_message))
                    append(end)
                append(string(message))
            append(end)
        append(end)
    append(_INT32.pack(throttle_ms))
    append(end)
    return parts

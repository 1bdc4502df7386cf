"""The hand-written Produce encoders against kio's generic writer: the same bytes, always."""

from __future__ import annotations

import datetime
import io
import sys
import uuid
from types import ModuleType
from typing import Any

import kio.schema.produce.v11.request as produce_v11
import kio.schema.request_header.v2.header as header_v2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kio.index import load_response_schema
from kio.schema.errors import ErrorCode
from kio.schema.index import schema_name_map
from kio.schema.types import BrokerId, TopicName
from kio.serial import entity_writer
from kio.serial.readers import tz_aware_from_i64
from kio.static.constants import EntityType
from kio.static.primitive import Records, i16, i32, i32Timedelta, i64

from proxy.kafka import produce_codec
from proxy.kafka.api_keys import ApiKey
from proxy.kafka.produce_codec import (
    LEAN_PRODUCE_RESPONSES,
    RecordPieces,
    WriterPartitionData,
    WriterProduceRequest,
    WriterTopicData,
    encode_produce_request_v11,
    encode_produce_response,
    produce_request_v11_frame,
)
from proxy.kafka.schemas import DECODABLE_VERSIONS, decode_response_body, encode_body
from proxy.kafka.upstream_client import encode_request

pytestmark = pytest.mark.unit

RESPONSE_VERSIONS = sorted(
    version
    for version, entities in schema_name_map["produce"].items()
    if EntityType.response in entities
)


def kio_bytes(entity: Any) -> bytes:
    buffer = io.BytesIO()
    entity_writer(type(entity))(buffer, entity)
    return buffer.getvalue()


def kio_frame(request: Any, correlation_id: int, client_id: str | None) -> bytes:
    header = header_v2.RequestHeader(
        request_api_key=request.__api_key__,
        request_api_version=request.__version__,
        correlation_id=i32(correlation_id),
        client_id=client_id,
    )
    body = kio_bytes(header) + kio_bytes(request)
    return len(body).to_bytes(4, "big") + body


names = st.text(max_size=30)  # any Unicode but lone surrogates, which kio cannot encode
optional_names = st.none() | names
int32s = st.integers(-(2**31), 2**31 - 1)
int64s = st.integers(-(2**63), 2**63 - 1)
# Whole milliseconds: what survives kio's decoding (sub-millisecond rounding has its own test).
millis = st.builds(lambda ms: i32Timedelta.parse(datetime.timedelta(milliseconds=ms)), int32s)
# What kio decodes a timestamp to, shown in any time zone (the same instant, equal).
_MAX_TIMESTAMP_MS = int(datetime.datetime(9999, 12, 30, tzinfo=datetime.UTC).timestamp()) * 1000
log_append_times = st.none() | st.builds(
    lambda ms, tz: tz_aware_from_i64(i64(ms)).astimezone(tz),
    st.integers(0, _MAX_TIMESTAMP_MS),
    st.sampled_from([datetime.UTC, datetime.timezone(datetime.timedelta(hours=5, minutes=30))]),
)


# The writer's records: bytes, or pieces (a new batch header and a view of the client's
# records) that are written one after the other.
writer_records = st.binary(max_size=300) | st.lists(st.binary(max_size=100), max_size=3).map(
    lambda pieces: RecordPieces([memoryview(piece) for piece in pieces])
)


@st.composite
def writer_requests(
    draw: st.DrawFn,
) -> tuple[WriterProduceRequest, produce_v11.ProduceRequest]:
    """A writer's request, and kio's request of the same values."""
    timeout_ms = draw(int32s)
    topics = draw(
        st.lists(st.tuples(names, st.lists(st.tuples(int32s, writer_records), max_size=4)))
    )
    ours = WriterProduceRequest(
        timeout_ms,
        tuple(
            WriterTopicData(name, tuple(WriterPartitionData(i, data) for i, data in parts))
            for name, parts in topics
        ),
    )
    kios = produce_v11.ProduceRequest(
        transactional_id=None,
        acks=i16(-1),
        timeout=i32Timedelta.parse(datetime.timedelta(milliseconds=timeout_ms)),
        topic_data=tuple(
            produce_v11.TopicProduceData(
                name=TopicName(name),
                partition_data=tuple(
                    produce_v11.PartitionProduceData(index=i32(i), records=Records(bytes(data)))
                    for i, data in parts
                ),
            )
            for name, parts in topics
        ),
    )
    return ours, kios


@settings(max_examples=300, deadline=None)
@given(requests=writer_requests(), correlation_id=int32s, client_id=optional_names)
def test_the_writers_request_is_written_as_kio_writes_its_produce_request(
    requests: tuple[WriterProduceRequest, produce_v11.ProduceRequest],
    correlation_id: int,
    client_id: str | None,
) -> None:
    ours, kios = requests
    expected = kio_frame(kios, correlation_id, client_id)
    assert produce_request_v11_frame(ours, correlation_id, client_id) == expected
    assert encode_produce_request_v11(ours) == kio_bytes(kios)
    # The proxy's own path: encode_request takes the hand encoder for the writer's request.
    assert encode_request(ours, correlation_id, client_id or "") == kio_frame(
        kios, correlation_id, client_id or ""
    )


def test_large_records_and_names_get_multibyte_lengths() -> None:
    records = bytes(range(256)) * 300
    pieces = RecordPieces([records[:9], records[9:]])  # a new header, the client's records
    partition = WriterPartitionData(7, pieces)
    ours = WriterProduceRequest(30_000, (WriterTopicData("ü" * 150, (partition,)),))
    kios = produce_v11.ProduceRequest(
        transactional_id=None,
        acks=i16(-1),
        timeout=i32Timedelta.parse(datetime.timedelta(seconds=30)),
        topic_data=(
            produce_v11.TopicProduceData(
                name=TopicName("ü" * 150),
                partition_data=(
                    produce_v11.PartitionProduceData(index=i32(7), records=Records(records)),
                ),
            ),
        ),
    )
    assert produce_request_v11_frame(ours, 42, "dedup-proxy") == kio_frame(kios, 42, "dedup-proxy")


@pytest.mark.parametrize("micros", [1_500, 2_500, 499, 500, -1_500, 123_456_789])
def test_sub_millisecond_durations_round_as_kio_rounds(micros: int) -> None:
    delta = i32Timedelta.parse(datetime.timedelta(microseconds=micros))
    module = response_module(9)
    response = module.ProduceResponse(responses=(), throttle_time=delta)
    assert encode_produce_response(response) == kio_bytes(response)


def response_module(version: int) -> ModuleType:
    return sys.modules[load_response_schema(ApiKey.PRODUCE, version).__module__]


@st.composite
def produce_responses(draw: st.DrawFn, version: int, tagged: bool) -> Any:
    """A random ProduceResponse of this version; tagged fields set only when ``tagged``."""
    module = response_module(version)

    def partition() -> Any:
        fields: dict[str, Any] = {
            "index": i32(draw(int32s)),
            "error_code": draw(st.sampled_from(list(ErrorCode))),
            "base_offset": i64(draw(int64s)),
            "log_append_time": draw(log_append_times),
        }
        if version >= 5:
            fields["log_start_offset"] = i64(draw(int64s))
        if version >= 8:
            record_errors = st.builds(
                module.BatchIndexAndErrorMessage,
                batch_index=int32s.map(i32),
                batch_index_error_message=optional_names,
            )
            fields["record_errors"] = tuple(draw(st.lists(record_errors, max_size=3)))
            fields["error_message"] = draw(optional_names)
        if version >= 10 and tagged and draw(st.booleans()):
            fields["current_leader"] = module.LeaderIdAndEpoch(
                leader_id=BrokerId(draw(int32s)), leader_epoch=i32(draw(int32s))
            )
        return module.PartitionProduceResponse(**fields)

    def topic() -> Any:
        partitions = tuple(partition() for _ in range(draw(st.integers(0, 3))))
        if version >= 13:
            return module.TopicProduceResponse(
                topic_id=draw(st.uuids()), partition_responses=partitions
            )
        return module.TopicProduceResponse(
            name=TopicName(draw(names)), partition_responses=partitions
        )

    fields: dict[str, Any] = {
        "responses": tuple(topic() for _ in range(draw(st.integers(0, 3)))),
        "throttle_time": draw(millis),
    }
    if version >= 10 and tagged:
        endpoints = st.builds(
            module.NodeEndpoint,
            node_id=int32s.map(BrokerId),
            host=names,
            port=int32s.map(i32),
            rack=optional_names,
        )
        fields["node_endpoints"] = tuple(draw(st.lists(endpoints, max_size=2)))
    return module.ProduceResponse(**fields)


@pytest.mark.parametrize("version", RESPONSE_VERSIONS)
@pytest.mark.parametrize("tagged", [False, True], ids=["untagged", "tagged"])
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_a_produce_response_is_the_one_kio_writes(
    version: int, tagged: bool, data: st.DataObject
) -> None:
    response = data.draw(produce_responses(version, tagged))
    encoded = encode_produce_response(response)
    assert encoded == kio_bytes(response)
    assert encode_body(response) == encoded  # the runtime's path
    assert decode_response_body(ApiKey.PRODUCE, version, encoded, 0) == response


def test_every_produce_version_the_proxy_answers_is_encoded_by_hand() -> None:
    answered = DECODABLE_VERSIONS[ApiKey.PRODUCE]
    lean = {response_type.__version__ for response_type in LEAN_PRODUCE_RESPONSES}
    assert set(range(answered.min, answered.max + 1)) <= lean


def _spy_on_kio(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    used: list[Any] = []
    kio_body = produce_codec._kio_body

    def spy(entity: Any) -> bytes:
        used.append(entity)
        return kio_body(entity)

    monkeypatch.setattr(produce_codec, "_kio_body", spy)
    return used


def test_tagged_fields_and_unknown_layouts_go_to_kio(monkeypatch: pytest.MonkeyPatch) -> None:
    used = _spy_on_kio(monkeypatch)
    v11 = response_module(11)
    no_throttle = i32Timedelta.parse(datetime.timedelta(0))
    redirected = v11.ProduceResponse(
        responses=(
            v11.TopicProduceResponse(
                name=TopicName("t"),
                partition_responses=(
                    v11.PartitionProduceResponse(
                        index=i32(0),
                        error_code=ErrorCode.not_leader_or_follower,
                        base_offset=i64(-1),
                        record_errors=(),
                        current_leader=v11.LeaderIdAndEpoch(
                            leader_id=BrokerId(4), leader_epoch=i32(9)
                        ),
                    ),
                ),
            ),
        ),
        throttle_time=no_throttle,
        node_endpoints=(v11.NodeEndpoint(node_id=BrokerId(4), host="kafka-4", port=i32(9092)),),
    )
    endpoints_only = v11.ProduceResponse(
        responses=(),
        throttle_time=no_throttle,
        node_endpoints=(v11.NodeEndpoint(node_id=BrokerId(1), host="k", port=i32(1)),),
    )
    v13 = response_module(13)
    by_topic_id = v13.ProduceResponse(
        responses=(v13.TopicProduceResponse(topic_id=uuid.uuid4(), partition_responses=()),),
        throttle_time=no_throttle,
    )
    for response in (redirected, endpoints_only, by_topic_id):
        assert encode_produce_response(response) == kio_bytes(response)
    assert used == [redirected, endpoints_only, by_topic_id]
    # The common case never touches kio.
    plain = response_module(9).ProduceResponse(responses=(), throttle_time=no_throttle)
    assert encode_produce_response(plain) == kio_bytes(plain)
    assert len(used) == 3

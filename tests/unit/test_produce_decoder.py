"""The hand-written Produce request decoder against kio's: the same entities, always, or
None where it leaves the request to kio."""

from __future__ import annotations

import datetime
import io
import sys
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kio.index import load_request_schema
from kio.schema.types import TopicName, TransactionalId
from kio.serial import entity_writer
from kio.static.primitive import Records, i16, i32, i32Timedelta

from dedup.batches import copy_of
from proxy.kafka.api_keys import ApiKey
from proxy.kafka.produce_decoder import decode_produce_request
from proxy.kafka.schemas import decode_request_body

pytestmark = pytest.mark.unit

VERSIONS = range(3, 13)


def slicing(data: bytes, start: int, end: int) -> bytes:
    return data[start:end]


def kio_body(entity: Any) -> bytes:
    buffer = io.BytesIO()
    entity_writer(type(entity))(buffer, entity)
    return buffer.getvalue()


names = st.text(max_size=20)
millis = st.integers(-(2**31), 2**31 - 1)


@st.composite
def requests(draw: st.DrawFn, version: int) -> Any:
    module = sys.modules[load_request_schema(ApiKey.PRODUCE, version).__module__]
    topics = tuple(
        module.TopicProduceData(
            name=TopicName(draw(names)),
            partition_data=tuple(
                module.PartitionProduceData(
                    index=i32(draw(st.integers(-(2**31), 2**31 - 1))),
                    records=draw(st.none() | st.binary(max_size=300).map(Records)),
                )
                for _ in range(draw(st.integers(0, 3)))
            ),
        )
        for _ in range(draw(st.integers(0, 3)))
    )
    transactional_id = draw(st.none() | names.map(TransactionalId))
    return module.ProduceRequest(
        transactional_id=transactional_id,
        acks=i16(draw(st.integers(-(2**15), 2**15 - 1))),
        timeout=i32Timedelta.parse(datetime.timedelta(milliseconds=draw(millis))),
        topic_data=topics,
    )


@settings(max_examples=60, deadline=None)
@given(st.data(), st.sampled_from(VERSIONS), st.binary(max_size=8))
def test_every_version_decodes_to_kios_entity(
    data: st.DataObject, version: int, pad: bytes
) -> None:
    request = data.draw(requests(version))
    payload = pad + kio_body(request)  # the body after some header bytes
    expected = decode_request_body(ApiKey.PRODUCE, version, payload, len(pad))
    assert expected == request
    for copy in (slicing, copy_of):
        assert decode_produce_request(version, payload, len(pad), copy) == expected


@settings(max_examples=60, deadline=None)
@given(st.data(), st.sampled_from(VERSIONS))
def test_a_cut_or_extended_body_is_left_to_kio(data: st.DataObject, version: int) -> None:
    payload = kio_body(data.draw(requests(version)))
    cut = data.draw(st.integers(0, len(payload) - 1))
    assert decode_produce_request(version, payload[:cut], 0, slicing) is None
    assert decode_produce_request(version, payload + b"\x00", 0, slicing) is None


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(VERSIONS), st.binary(max_size=200))
def test_any_bytes_decode_to_kios_entity_or_are_left_to_it(version: int, payload: bytes) -> None:
    decoded = decode_produce_request(version, payload, 0, slicing)
    if decoded is not None:
        assert decoded == decode_request_body(ApiKey.PRODUCE, version, payload, 0)


def test_tagged_fields_are_left_to_kio() -> None:
    module = sys.modules[load_request_schema(ApiKey.PRODUCE, 11).__module__]
    request = module.ProduceRequest(
        transactional_id=None,
        acks=i16(-1),
        timeout=i32Timedelta.parse(datetime.timedelta(seconds=1)),
        topic_data=(),
    )
    body = kio_body(request)
    assert body[-1:] == b"\x00"
    tagged = body[:-1] + b"\x01\x05\x01\x00"  # one unknown tag (5) of one byte
    assert decode_produce_request(11, tagged, 0, slicing) is None
    with pytest.raises(KeyError, match="tag"):  # kio's word on it, as for any request
        decode_request_body(ApiKey.PRODUCE, 11, tagged, 0)


def test_versions_outside_3_to_12_are_left_to_kio() -> None:
    assert decode_produce_request(2, b"", 0, slicing) is None
    assert decode_produce_request(13, b"", 0, slicing) is None


def test_the_records_are_the_copy_functions() -> None:
    module = sys.modules[load_request_schema(ApiKey.PRODUCE, 9).__module__]
    request = module.ProduceRequest(
        transactional_id=None,
        acks=i16(1),
        timeout=i32Timedelta.parse(datetime.timedelta(seconds=1)),
        topic_data=(
            module.TopicProduceData(
                name=TopicName("t"),
                partition_data=(module.PartitionProduceData(index=i32(0), records=b"abc"),),
            ),
        ),
    )
    spans: list[tuple[int, int]] = []

    def copy(data: bytes, start: int, end: int) -> bytes:
        spans.append((start, end))
        return b"ABC"

    body = kio_body(request)
    decoded = decode_produce_request(9, body, 0, copy)
    assert decoded.topic_data[0].partition_data[0].records == b"ABC"
    assert [body[a:b] for a, b in spans] == [b"abc"]

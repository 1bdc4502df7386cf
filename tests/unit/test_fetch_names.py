"""The Fetch response walk against kio's own encoding, in every version that can name a
broker: it finds the KIP-951 endpoints, and the ids named alone (a preferred read replica,
a current leader), exactly when kio wrote them, and never fails on any bytes."""

from __future__ import annotations

import dataclasses
import datetime
import importlib
import uuid
from types import ModuleType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kio.schema.errors import ErrorCode
from kio.schema.types import BrokerId, ProducerId, TopicName
from kio.static.primitive import i32, i32Timedelta, i64

from proxy.kafka.fetch_names import NONE_NAMED, BrokerNames, fetch_broker_names
from proxy.kafka.schemas import encode_body

pytestmark = pytest.mark.unit

VERSIONS = tuple(range(11, 18))
i32s = st.integers(-(2**31), 2**31 - 1)
i64s = st.integers(-(2**63), 2**63 - 1)


def schema(version: int) -> ModuleType:
    return importlib.import_module(f"kio.schema.fetch.v{version}.response")


def fields_of(entity: type) -> set[str]:
    return {f.name for f in dataclasses.fields(entity)}  # type: ignore[arg-type]


@st.composite
def partitions(draw: st.DrawFn, module: Any) -> Any:
    tagged = {}
    if "current_leader" in fields_of(module.PartitionData):  # v12+: tagged fields
        # Tagged fields: default values are left out of the encoding, others written.
        tagged = {
            "diverging_epoch": module.EpochEndOffset(
                epoch=i32(draw(st.sampled_from([-1, 3]))),
                end_offset=i64(draw(st.sampled_from([-1, 9]))),
            ),
            "current_leader": module.LeaderIdAndEpoch(
                leader_id=BrokerId(draw(st.sampled_from([-1, 2]))),
                leader_epoch=i32(draw(st.sampled_from([-1, 5]))),
            ),
            "snapshot_id": module.SnapshotId(
                end_offset=i64(draw(st.sampled_from([-1, 7]))),
                epoch=i32(draw(st.sampled_from([-1, 1]))),
            ),
        }
    return module.PartitionData(
        partition_index=i32(draw(i32s)),
        error_code=draw(st.sampled_from([ErrorCode.none, ErrorCode.not_leader_or_follower])),
        high_watermark=i64(draw(i64s)),
        last_stable_offset=i64(draw(i64s)),
        log_start_offset=i64(draw(i64s)),
        **tagged,
        aborted_transactions=draw(
            st.none()
            | st.lists(
                st.builds(
                    module.AbortedTransaction,
                    producer_id=st.builds(ProducerId, i64s),
                    first_offset=st.builds(i64, i64s),
                ),
                max_size=3,
            ).map(tuple)
        ),
        preferred_read_replica=BrokerId(draw(st.sampled_from([-1, -1, 0, 2, 2**31 - 1]))),
        records=draw(st.none() | st.binary(max_size=300)),
    )


@st.composite
def fetch_responses(draw: st.DrawFn) -> tuple[int, Any]:
    version = draw(st.sampled_from(VERSIONS))
    module = schema(version)
    if "topic_id" in fields_of(module.FetchableTopicResponse):  # v13+
        topic_field = {"topic_id": st.builds(uuid.UUID, st.uuids().map(str))}
    else:
        topic_field = {"topic": st.builds(TopicName, st.text(max_size=20))}
    topics = draw(
        st.lists(
            st.builds(
                module.FetchableTopicResponse,
                **topic_field,
                partitions=st.lists(partitions(module), max_size=4).map(tuple),
            ),
            max_size=3,
        ).map(tuple)
    )
    endpoints = {}
    if "node_endpoints" in fields_of(module.FetchResponse):  # v16+
        endpoints["node_endpoints"] = draw(
            st.lists(
                st.builds(
                    module.NodeEndpoint,
                    node_id=st.builds(BrokerId, st.integers(0, 10)),
                    host=st.text(max_size=20),
                    port=st.builds(i32, st.integers(1, 65535)),
                    rack=st.none() | st.text(max_size=5),
                ),
                max_size=3,
            ).map(tuple)
        )
    response = module.FetchResponse(
        throttle_time=i32Timedelta.parse(datetime.timedelta(milliseconds=draw(st.integers(0, 99)))),
        error_code=ErrorCode.none,
        session_id=i32(draw(i32s)),
        responses=topics,
        **endpoints,
    )
    return version, response


def names_by_id(response: Any) -> bool:
    """What the walk should find by id: a preferred read replica, or a current leader
    that kio wrote (one that is not the default, -1 and -1)."""
    for topic in response.responses:
        for part in topic.partitions:
            if part.preferred_read_replica >= 0:
                return True
            leader = getattr(part, "current_leader", None)
            if leader is not None and (leader.leader_id, leader.leader_epoch) != (-1, -1):
                return True
    return False


def payload_of(body: bytes) -> tuple[bytes, int]:
    """As the chain sees it: the response header (correlation id, no tags) then the body."""
    header = (42).to_bytes(4, "big") + b"\x00"
    return header + body, len(header)


@settings(max_examples=500)
@given(fetch_responses())
def test_the_walk_finds_what_names_brokers_exactly_when_kio_wrote_it(
    drawn: tuple[int, Any],
) -> None:
    version, response = drawn
    payload, start = payload_of(encode_body(response))
    assert fetch_broker_names(version, payload, start) == BrokerNames(
        endpoints=bool(getattr(response, "node_endpoints", ())), ids=names_by_id(response)
    )


@settings(max_examples=300)
@given(fetch_responses(), st.data())
def test_damaged_bytes_never_raise_and_a_cut_response_does_not_walk(
    drawn: tuple[int, Any], data: st.DataObject
) -> None:
    version, response = drawn
    payload, start = payload_of(encode_body(response))
    cut = data.draw(st.integers(start, len(payload) - 1))
    assert fetch_broker_names(version, payload[:cut], start) is None
    flipped = bytearray(payload)
    where = data.draw(st.integers(start, len(payload) - 1))
    flipped[where] ^= data.draw(st.integers(1, 255))
    assert fetch_broker_names(version, bytes(flipped), start) in ANSWERS


ANSWERS = (None, *(BrokerNames(e, i) for e in (False, True) for i in (False, True)))


@given(st.sampled_from(VERSIONS), st.binary(max_size=200))
def test_any_bytes_give_an_answer_or_none(version: int, data: bytes) -> None:
    assert fetch_broker_names(version, data, 0) in ANSWERS


def test_versions_before_11_name_no_broker() -> None:
    assert fetch_broker_names(10, b"", 0) == NONE_NAMED


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("current_leader", [False, True])
def test_the_walk_reads_lengths_of_several_bytes(version: int, current_leader: bool) -> None:
    """Counts and sizes past one varint byte in the flexible versions (130 aborted
    transactions, 20 kB of records), over many partitions; a current leader named only in
    the last one (v12+) is found."""
    module = schema(version)
    aborted = tuple(
        module.AbortedTransaction(producer_id=ProducerId(i), first_offset=i64(i))
        for i in range(130)
    )
    leads = "current_leader" in fields_of(module.PartitionData)
    parts = tuple(
        module.PartitionData(
            partition_index=i32(p),
            error_code=ErrorCode.none,
            high_watermark=i64(9),
            last_stable_offset=i64(9),
            log_start_offset=i64(0),
            aborted_transactions=aborted if p % 2 else None,
            preferred_read_replica=BrokerId(-1),
            records=bytes(20_000) if p % 3 else None,
            **(
                {
                    "current_leader": module.LeaderIdAndEpoch(
                        leader_id=BrokerId(2), leader_epoch=i32(5)
                    )
                }
                if leads and current_leader and p == 199
                else {}
            ),
        )
        for p in range(200)
    )
    topic = {"topic_id": uuid.uuid4()} if version >= 13 else {"topic": TopicName("t")}
    response = module.FetchResponse(
        throttle_time=i32Timedelta.parse(datetime.timedelta(0)),
        error_code=ErrorCode.none,
        session_id=i32(1),
        responses=(module.FetchableTopicResponse(**topic, partitions=parts),),
    )
    payload, start = payload_of(encode_body(response))
    assert fetch_broker_names(version, payload, start) == BrokerNames(
        endpoints=False, ids=leads and current_leader
    )
    assert fetch_broker_names(version, payload[:-1], start) is None

"""Response filters: every broker address a client can learn is the proxy's, nothing else moves.

Responses are built with kio, encoded to bytes, run through the same function the
runtime uses, and decoded again.
"""

from __future__ import annotations

import asyncio
import datetime
import uuid
from typing import Any

import kio.schema.api_versions.v2.request as api_versions_v2_request
import kio.schema.api_versions.v3.request as api_versions_v3_request
import kio.schema.api_versions.v3.response as api_versions_v3
import kio.schema.describe_cluster.v1.response as describe_cluster_v1
import kio.schema.fetch.v17.response as fetch_v17
import kio.schema.find_coordinator.v3.response as find_coordinator_v3
import kio.schema.find_coordinator.v4.response as find_coordinator_v4
import kio.schema.metadata.v12.response as metadata_v12
import kio.schema.produce.v11.response as produce_v11
import pytest
from kio.schema.errors import ErrorCode
from kio.schema.types import BrokerId, TopicName
from kio.static.primitive import i8, i16, i32, i32Timedelta, i64

from proxy.filters import standard_filters
from proxy.filters.api_versions import ApiVersionsFilter
from proxy.kafka.schemas import DECODABLE_VERSIONS, decode_response_body, encode_body
from proxy.kafka.topology import Endpoint, Topology
from proxy.kafka.upstream_client import encode_request
from proxy.kafka.wire import RequestHeader, parse_request_header
from proxy.runtime.chain import FilterChain, FilterContext, Forward, RequestFrame, ResponseFilter

pytestmark = pytest.mark.unit

NO_THROTTLE = i32Timedelta.parse(datetime.timedelta(0))
CORRELATION = (1234).to_bytes(4, "big")
FLEXIBLE_HEADER = CORRELATION + b"\x00"  # response header v1: no tagged fields


class Recorder:
    def __init__(self) -> None:
        self.calls: list[set[int]] = []

    async def __call__(self, node_ids: set[int]) -> None:
        self.calls.append(node_ids)


def make_context() -> tuple[FilterContext, Topology, Recorder]:
    topology = Topology([Endpoint("kafka-a", 9092)], "proxy.example", broker_port_base=40000)
    recorder = Recorder()
    topology.on_brokers_changed(recorder)
    return FilterContext(topology), topology, recorder


def response_filter_for(api_key: int) -> ResponseFilter:
    found = [
        f
        for f in standard_filters()
        if isinstance(f, ResponseFilter) and api_key in f.response_keys
    ]
    assert len(found) == 1
    return found[0]


def run_filter(
    context: FilterContext, response: Any, header: bytes = FLEXIBLE_HEADER
) -> tuple[bytes, Any]:
    api_key, version = int(response.__api_key__), int(response.__version__)
    payload = header + encode_body(response)
    request = RequestHeader(api_key, version, 1234, None, 0)
    assert request.flexible_response == (header != CORRELATION)
    out = asyncio.run(FilterChain(standard_filters()).on_response(request, payload, context))
    assert out[: len(header)] == header, "the response header is kept verbatim"
    return out, decode_response_body(api_key, version, out, len(header))


def test_metadata_brokers_become_proxy_listeners_and_topology_learns_upstream() -> None:
    context, topology, recorder = make_context()
    brokers = tuple(
        metadata_v12.MetadataResponseBroker(
            node_id=BrokerId(n), host=f"kafka-{n}.internal", port=i32(9092), rack="r1"
        )
        for n in (1, 2)
    )
    topic = metadata_v12.MetadataResponseTopic(
        error_code=ErrorCode.none,
        name=TopicName("orders"),
        topic_id=uuid.uuid4(),
        partitions=(
            metadata_v12.MetadataResponsePartition(
                error_code=ErrorCode.none,
                partition_index=i32(0),
                leader_id=BrokerId(2),
                replica_nodes=(BrokerId(1), BrokerId(2)),
                isr_nodes=(BrokerId(2),),
            ),
        ),
    )
    response = metadata_v12.MetadataResponse(
        throttle_time=NO_THROTTLE,
        brokers=brokers,
        cluster_id="c1",
        controller_id=BrokerId(1),
        topics=(topic,),
    )
    _, out = run_filter(context, response)
    assert [(b.node_id, b.host, b.port, b.rack) for b in out.brokers] == [
        (1, "proxy.example", 40001, "r1"),
        (2, "proxy.example", 40002, "r1"),
    ]
    assert out.topics == response.topics and out.cluster_id == "c1"
    assert topology.upstream(2) == Endpoint("kafka-2.internal", 9092)
    assert recorder.calls == [{1, 2}]


def test_find_coordinator_single_and_batched_shapes() -> None:
    context, topology, _ = make_context()
    v3 = find_coordinator_v3.FindCoordinatorResponse(
        throttle_time=NO_THROTTLE,
        error_code=ErrorCode.none,
        error_message=None,
        node_id=BrokerId(3),
        host="kafka-3",
        port=i32(19092),
    )
    _, out3 = run_filter(context, v3)
    assert (out3.node_id, out3.host, out3.port) == (3, "proxy.example", 40003)
    assert topology.upstream(3) == Endpoint("kafka-3", 19092)

    v4 = find_coordinator_v4.FindCoordinatorResponse(
        throttle_time=NO_THROTTLE,
        coordinators=(
            find_coordinator_v4.Coordinator(
                key="group-a",
                node_id=BrokerId(5),
                host="kafka-5",
                port=i32(9092),
                error_code=ErrorCode.none,
                error_message=None,
            ),
            find_coordinator_v4.Coordinator(
                key="group-b",
                node_id=BrokerId(-1),
                host="",
                port=i32(-1),
                error_code=ErrorCode.coordinator_not_available,
                error_message="not yet",
            ),
        ),
    )
    _, out4 = run_filter(context, v4)
    assert [(c.key, c.node_id, c.host, c.port) for c in out4.coordinators] == [
        ("group-a", 5, "proxy.example", 40005),
        ("group-b", -1, "", -1),
    ]


def test_describe_cluster_rewrites_brokers_but_not_controllers() -> None:
    context, _, _ = make_context()
    broker = describe_cluster_v1.DescribeClusterBroker(
        broker_id=BrokerId(0), host="kafka-0", port=i32(9092)
    )
    response = describe_cluster_v1.DescribeClusterResponse(
        throttle_time=NO_THROTTLE,
        error_code=ErrorCode.none,
        cluster_id="c1",
        controller_id=BrokerId(0),
        brokers=(broker,),
    )
    _, out = run_filter(context, response)
    assert (out.brokers[0].host, out.brokers[0].port) == ("proxy.example", 40000)

    controllers = describe_cluster_v1.DescribeClusterResponse(
        throttle_time=NO_THROTTLE,
        error_code=ErrorCode.none,
        endpoint_type=i8(2),
        cluster_id="c1",
        controller_id=BrokerId(0),
        brokers=(broker,),
    )
    raw, _ = run_filter(context, controllers)
    assert raw == FLEXIBLE_HEADER + encode_body(controllers)


def fetch_response(endpoints: tuple[Any, ...], records: bytes) -> Any:
    return fetch_v17.FetchResponse(
        throttle_time=NO_THROTTLE,
        error_code=ErrorCode.none,
        responses=(
            fetch_v17.FetchableTopicResponse(
                topic_id=uuid.uuid4(),
                partitions=(
                    fetch_v17.PartitionData(
                        partition_index=i32(0),
                        error_code=ErrorCode.not_leader_or_follower,
                        high_watermark=i64(10),
                        aborted_transactions=None,
                        records=records,
                    ),
                ),
            ),
        ),
        node_endpoints=endpoints,
    )


def test_fetch_node_endpoints_rewritten_and_records_untouched() -> None:
    context, topology, _ = make_context()
    asyncio.run(topology.observe([(7, "kafka-7", 9092)], complete=True))
    endpoint = fetch_v17.NodeEndpoint(node_id=BrokerId(7), host="kafka-7", port=i32(9092))
    records = bytes(range(256)) * 8
    _, out = run_filter(context, fetch_response((endpoint,), records))
    assert [(e.node_id, e.host, e.port) for e in out.node_endpoints] == [
        (7, "proxy.example", 40007)
    ]
    assert out.responses[0].partitions[0].records == records


def test_fetch_without_upstream_host_is_not_decoded() -> None:
    context, topology, _ = make_context()
    asyncio.run(topology.observe([(7, "kafka-7", 9092)], complete=True))
    response = fetch_response((), b"\x00" * 64)
    payload = FLEXIBLE_HEADER + encode_body(response)
    fetch_filter = response_filter_for(1)
    assert not fetch_filter.wants_response(17, payload, len(FLEXIBLE_HEADER), context)


def test_fetch_whose_records_name_an_upstream_host_is_not_decoded() -> None:
    """The Fetch walk looks for the endpoints field, not for host names in record bytes
    (a log line naming a broker host would otherwise cost a decode)."""
    context, topology, _ = make_context()
    asyncio.run(topology.observe([(7, "kafka-7", 9092)], complete=True))
    response = fetch_response((), b"connected to kafka-7:9092" * 10)
    payload = FLEXIBLE_HEADER + encode_body(response)
    fetch_filter = response_filter_for(1)
    assert not fetch_filter.wants_response(17, payload, len(FLEXIBLE_HEADER), context)
    out = asyncio.run(
        FilterChain(standard_filters()).on_response(
            RequestHeader(1, 17, 1234, None, 0), payload, context
        )
    )
    assert out is payload


def test_the_host_search_follows_the_brokers_the_topology_knows() -> None:
    """The host names searched for are kept with the brokers (not built per response): a
    broker added by a partial list is searched for, one a complete list drops is not."""
    topology = Topology([Endpoint("kafka-a", 9092)], "proxy.example", broker_port_base=40000)
    payload = b"..kafka-4..kafka-5.."
    assert not topology.names_upstream_host(payload, 0)  # no broker seen yet
    asyncio.run(topology.observe([(4, "kafka-4", 9092)], complete=True))
    assert topology.names_upstream_host(payload, 0)
    assert not topology.names_upstream_host(payload, payload.index(b"kafka-5"))
    asyncio.run(topology.observe([(5, "kafka-5", 9092)], complete=False))
    assert topology.names_upstream_host(payload, payload.index(b"kafka-5"))
    asyncio.run(topology.observe([(6, "kafka-6", 9093), (7, "kafka-6", 9094)], complete=True))
    assert topology.names_upstream_host(b"..kafka-6..", 0)
    assert not topology.names_upstream_host(payload, 0)


def test_produce_node_endpoints_rewritten() -> None:
    context, topology, _ = make_context()
    asyncio.run(topology.observe([(4, "kafka-4", 9092)], complete=True))
    response = produce_v11.ProduceResponse(
        responses=(),
        throttle_time=NO_THROTTLE,
        node_endpoints=(
            produce_v11.NodeEndpoint(node_id=BrokerId(4), host="kafka-4", port=i32(9092)),
        ),
    )
    _, out = run_filter(context, response)
    assert (out.node_endpoints[0].host, out.node_endpoints[0].port) == ("proxy.example", 40004)


def test_api_versions_intersected_with_what_the_proxy_decodes() -> None:
    context, _, _ = make_context()
    produce = DECODABLE_VERSIONS[0]
    response = api_versions_v3.ApiVersionsResponse(
        error_code=ErrorCode.none,
        api_keys=(
            api_versions_v3.ApiVersion(
                api_key=i16(0), min_version=i16(0), max_version=i16(produce.max + 5)
            ),
            api_versions_v3.ApiVersion(api_key=i16(3), min_version=i16(0), max_version=i16(1)),
            api_versions_v3.ApiVersion(api_key=i16(999), min_version=i16(0), max_version=i16(3)),
        ),
        throttle_time=NO_THROTTLE,
    )
    # ApiVersions responses always use header v0, whatever the request's version.
    _, out = run_filter(context, response, header=CORRELATION)
    kept = {(a.api_key, a.min_version, a.max_version) for a in out.api_keys}
    metadata = DECODABLE_VERSIONS[3]
    assert kept == {
        (0, produce.min, produce.max),
        (3, metadata.min, min(1, metadata.max)),
    }


def test_api_versions_request_tells_the_connection_what_software_the_client_is() -> None:
    """KIP-511: from ApiVersions v3 on, a client names itself; the connection's filters
    read it (`dedup.produce_filter` answers librdkafka's clients in their terms)."""
    context, _, _ = make_context()
    v3 = api_versions_v3_request.ApiVersionsRequest(
        client_software_name="confluent-kafka-python", client_software_version="2.6.1-rdkafka-2.6.1"
    )
    payload = encode_request(v3, 7)[4:]
    frame = RequestFrame(parse_request_header(payload), payload)
    decision = asyncio.run(ApiVersionsFilter().on_request(frame, context))
    assert isinstance(decision, Forward)
    assert (context.software.name, context.software.version) == (
        "confluent-kafka-python",
        "2.6.1-rdkafka-2.6.1",
    )
    older, _, _ = make_context()  # v2 and before carry no name
    payload = encode_request(api_versions_v2_request.ApiVersionsRequest(), 8)[4:]
    frame = RequestFrame(parse_request_header(payload), payload)
    assert isinstance(asyncio.run(ApiVersionsFilter().on_request(frame, older)), Forward)
    assert (older.software.name, older.software.version) == ("", "")

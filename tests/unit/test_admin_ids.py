"""Admin requests that name brokers by node id, translated for Kafka and back
(`dedup.ownership.admin_ids`), and DescribeTopicPartitions answers named by the nodes
clients know: kio entities in, kio entities out, no sockets."""

from __future__ import annotations

import datetime
import uuid
from typing import Any

import kio.schema.alter_partition_reassignments.v0.request as alter_reassignments
import kio.schema.create_partitions.v3.request as create_partitions
import kio.schema.create_topics.v7.request as create_topics
import kio.schema.describe_configs.v4.request as describe_configs
import kio.schema.describe_configs.v4.response as describe_configs_response
import kio.schema.describe_topic_partitions.v0.response as topic_partitions
import kio.schema.list_partition_reassignments.v0.response as list_reassignments
import kio.schema.unregister_broker.v0.request as unregister_broker
import pytest
from kio.schema.errors import ErrorCode
from kio.schema.types import BrokerId, TopicName
from kio.static.primitive import i8, i16, i32, i32Timedelta

from dedup.ownership.admin_ids import (
    AlterReassignmentsFilter,
    BrokerConfigsFilter,
    ListReassignmentsFilter,
    ReplicaAssignmentsFilter,
    UnregisterBrokerFilter,
)
from dedup.ownership.filters import OwnedTopicPartitionsFilter
from dedup.policies import Mode, PolicySnapshot
from proxy.kafka.schemas import encode_body
from proxy.kafka.wire import RequestHeader
from proxy.runtime.chain import Forward, RequestFrame
from tests.unit.test_ownership import A, B, _Policies, ownership_of

BROKER, BROKER_LOGGER, TOPIC = 4, 8, 2
NO_TIME = i32Timedelta.parse(datetime.timedelta(0))
# Members a (slot 1) and b (slot 2), this instance a: broker 1 is node 1001 here, 2001 at b.
GROUP = ownership_of(A, [A, B])


async def forwarded(filter_: Any, request: Any, ownership: Any = GROUP) -> Any:
    """What the filter sends Kafka in place of ``request`` (None: the request as it came)."""
    frame = RequestFrame(RequestHeader(int(request.__api_key__), 0, 1, None, 0), b"")
    frame.keep_decoded(request)
    decision = await type(filter_)(ownership).on_request(frame, None)  # type: ignore[arg-type]
    assert isinstance(decision, Forward)
    if decision.request is not None:
        encode_body(decision.request)  # Kafka's schema still holds
    return decision.request


def configs_request(*resources: tuple[int, str]) -> describe_configs.DescribeConfigsRequest:
    return describe_configs.DescribeConfigsRequest(
        resources=tuple(
            describe_configs.DescribeConfigsResource(
                resource_type=i8(kind), resource_name=name, configuration_keys=None
            )
            for kind, name in resources
        )
    )


async def test_a_brokers_configs_named_by_node_go_to_kafka_by_the_brokers_id() -> None:
    request = configs_request(
        (BROKER, "2001"),  # broker 1 through b
        (BROKER_LOGGER, "1001"),  # broker 1 through a
        (BROKER, ""),  # the cluster's default: no broker named
        (TOPIC, "1001"),  # a topic whose name is digits
        (BROKER, "5001"),  # no member has slot 5: for Kafka to refuse
        (BROKER, "1"),  # the broker's own id, no node of this group: as it is
    )
    sent = await forwarded(BrokerConfigsFilter(GROUP), request)
    assert [r.resource_name for r in sent.resources] == ["1", "1", "", "1001", "5001", "1"]


async def test_kafkas_answer_names_this_instances_node_for_the_broker() -> None:
    response = describe_configs_response.DescribeConfigsResponse(
        throttle_time=NO_TIME,
        results=tuple(
            describe_configs_response.DescribeConfigsResult(
                error_code=ErrorCode.none,
                error_message=None,
                resource_type=i8(kind),
                resource_name=name,
                configs=(),
            )
            for kind, name in ((BROKER, "1"), (TOPIC, "1"), (BROKER, ""))
        ),
    )
    answer: Any = await BrokerConfigsFilter(GROUP).on_response(4, response, None)  # type: ignore[arg-type]
    assert [r.resource_name for r in answer.results] == ["1001", "1", ""]
    encode_body(answer)


async def test_nothing_changes_where_node_ids_are_the_brokers_own() -> None:
    alone = ownership_of(A, [A])  # one instance: the brokers' own ids
    assert (
        await forwarded(BrokerConfigsFilter(alone), configs_request((BROKER, "1")), alone) is None
    )
    assert not BrokerConfigsFilter(alone).wants_response(4, b"", 0, None)  # type: ignore[arg-type]
    assert BrokerConfigsFilter(GROUP).wants_response(4, b"", 0, None)  # type: ignore[arg-type]


async def test_replica_assignments_name_the_brokers() -> None:
    topics = create_topics.CreateTopicsRequest(
        topics=(
            create_topics.CreatableTopic(
                name=TopicName("t"),
                num_partitions=i32(-1),
                replication_factor=i16(-1),
                assignments=tuple(
                    create_topics.CreatableReplicaAssignment(
                        partition_index=i32(p), broker_ids=(BrokerId(1001), BrokerId(2000))
                    )
                    for p in (0, 1)
                ),
                configs=(),
            ),
        ),
        timeout=NO_TIME,
    )
    sent = await forwarded(ReplicaAssignmentsFilter(GROUP), topics)
    assert [[int(b) for b in a.broker_ids] for a in sent.topics[0].assignments] == [[1, 0]] * 2

    partitions = create_partitions.CreatePartitionsRequest(
        topics=(
            create_partitions.CreatePartitionsTopic(
                name=TopicName("t"),
                count=i32(3),
                assignments=(
                    create_partitions.CreatePartitionsAssignment(broker_ids=(BrokerId(2001),)),
                ),
            ),
            create_partitions.CreatePartitionsTopic(
                name=TopicName("u"), count=i32(3), assignments=None
            ),
        ),
        timeout=NO_TIME,
        validate_only=False,
    )
    sent = await forwarded(ReplicaAssignmentsFilter(GROUP), partitions)
    assert [int(b) for b in sent.topics[0].assignments[0].broker_ids] == [1]
    assert sent.topics[1].assignments is None, "Kafka places them"


async def test_a_reassignment_names_the_brokers_and_a_cancellation_stays_one() -> None:
    request = alter_reassignments.AlterPartitionReassignmentsRequest(
        timeout=NO_TIME,
        topics=(
            alter_reassignments.ReassignableTopic(
                name=TopicName("t"),
                partitions=(
                    alter_reassignments.ReassignablePartition(
                        partition_index=i32(0), replicas=(BrokerId(1000), BrokerId(2001))
                    ),
                    alter_reassignments.ReassignablePartition(
                        partition_index=i32(1), replicas=None
                    ),
                ),
            ),
        ),
    )
    sent = await forwarded(AlterReassignmentsFilter(GROUP), request)
    first, cancelled = sent.topics[0].partitions
    assert [int(b) for b in first.replicas] == [0, 1]
    assert cancelled.replicas is None


async def test_ongoing_reassignments_name_this_instances_nodes() -> None:
    response = list_reassignments.ListPartitionReassignmentsResponse(
        throttle_time=NO_TIME,
        error_code=ErrorCode.none,
        error_message=None,
        topics=(
            list_reassignments.OngoingTopicReassignment(
                name=TopicName("t"),
                partitions=(
                    list_reassignments.OngoingPartitionReassignment(
                        partition_index=i32(0),
                        replicas=(BrokerId(0), BrokerId(1)),
                        adding_replicas=(BrokerId(1),),
                        removing_replicas=(BrokerId(0),),
                    ),
                ),
            ),
        ),
    )
    answer: Any = await ListReassignmentsFilter(GROUP).on_response(0, response, None)  # type: ignore[arg-type]
    part = answer.topics[0].partitions[0]
    assert [int(b) for b in part.replicas] == [1000, 1001]
    assert [int(b) for b in part.adding_replicas] == [1001]
    assert [int(b) for b in part.removing_replicas] == [1000]
    encode_body(answer)


async def test_a_broker_unregistered_by_node_is_the_broker() -> None:
    request = unregister_broker.UnregisterBrokerRequest(broker_id=BrokerId(2001))
    sent = await forwarded(UnregisterBrokerFilter(GROUP), request)
    assert int(sent.broker_id) == 1


@pytest.mark.parametrize("deduped", [True, False])
async def test_describe_topic_partitions_names_the_nodes_metadata_names(deduped: bool) -> None:
    """Kafka's admin client describes topics with DescribeTopicPartitions (KIP-966): its
    leaders and replicas must be the nodes Metadata names, or tools compare broker ids
    with node ids (`kafka-reassign-partitions --verify`)."""
    mode = Mode.ENABLED if deduped else Mode.DISABLED
    filter_ = OwnedTopicPartitionsFilter(GROUP, _Policies(PolicySnapshot(mode)))  # type: ignore[arg-type]
    response = topic_partitions.DescribeTopicPartitionsResponse(
        throttle_time=NO_TIME,
        topics=(
            topic_partitions.DescribeTopicPartitionsResponseTopic(
                error_code=ErrorCode.none,
                name=TopicName("orders"),
                topic_id=uuid.uuid4(),
                partitions=tuple(
                    topic_partitions.DescribeTopicPartitionsResponsePartition(
                        error_code=ErrorCode.none,
                        partition_index=i32(p),
                        leader_id=BrokerId(1),
                        leader_epoch=i32(3),
                        replica_nodes=(BrokerId(0), BrokerId(1)),
                        isr_nodes=(BrokerId(1),),
                        eligible_leader_replicas=(BrokerId(0),),
                        last_known_elr=None,
                        offline_replicas=(),
                    )
                    for p in range(8)
                ),
                topic_authorized_operations=i32(-2147483648),
            ),
        ),
    )
    answer: Any = await filter_.on_response(0, response, None)  # type: ignore[arg-type]
    encode_body(answer)
    partitions = answer.topics[0].partitions
    for part in partitions:
        assert [int(n) for n in part.replica_nodes] == [1000, 1001]
        assert [int(n) for n in part.isr_nodes] == [1001]
        assert [int(n) for n in part.eligible_leader_replicas] == [1000]
        assert part.last_known_elr is None
    leaders = {int(p.leader_id) for p in partitions}
    assert leaders == ({1001, 2001} if deduped else {1001}), "owners' nodes, as in Metadata"

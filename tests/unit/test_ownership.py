"""Placement and node naming for several instances: pure functions, no Redis."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import importlib
import uuid
from collections import Counter
from typing import Any

import kio.schema.metadata.v12.response as metadata_v12
import pytest
import structlog.testing
from hypothesis import given
from hypothesis import strategies as st
from kio.schema.errors import ErrorCode
from kio.schema.types import BrokerId, TopicName
from kio.static.primitive import i32, i32Timedelta, i64

from dedup.ownership.filters import (
    OwnedLeaderHintsFilter,
    OwnedMetadataFilter,
    ownership_filters,
)
from dedup.ownership.leases import Lease
from dedup.ownership.members import Member, Membership
from dedup.ownership.nodes import NodeMap
from dedup.ownership.owner import Ownership
from dedup.ownership.placement import broker_owner, partition_owner, rendezvous
from dedup.policies import Mode, PolicySnapshot
from proxy.kafka.api_keys import ApiKey
from proxy.kafka.schemas import encode_body
from proxy.kafka.topology import Endpoint, Topology
from proxy.runtime.chain import FilterContext
from proxy.runtime.cluster import NoSuchPartition


def member(name: str, slot: int, broker: int | None = None, port_base: int = 9100) -> Member:
    return Member(name, "inc", slot, f"{name}-host", port_base, 0, broker)


A, B, C, D = (member(n, s) for n, s in (("a", 1), ("b", 2), ("c", 3), ("d", 4)))
PARTITIONS = [("t", p) for p in range(600)]


def owners(members: list[Member]) -> dict[tuple[str, int], str]:
    found = {}
    for topic, partition in PARTITIONS:
        owner = partition_owner("balanced", topic, partition, None, members)
        assert owner is not None
        found[(topic, partition)] = owner.instance_id
    return found


def test_balanced_placement_spreads_partitions_over_the_members() -> None:
    counts = Counter(owners([A, B, C]).values())
    assert set(counts) == {"a", "b", "c"}
    assert min(counts.values()) > 600 / 3 * 0.75, counts


def test_a_member_joining_takes_only_partitions_it_wins_and_leaving_moves_only_its_own() -> None:
    before, after = owners([A, B, C]), owners([A, B, C, D])
    moved = [key for key in PARTITIONS if before[key] != after[key]]
    assert moved and all(after[key] == "d" for key in moved), "only to the newcomer"
    gone = owners([A, C])  # b left
    assert all(gone[key] == before[key] for key in PARTITIONS if before[key] != "b")


@given(st.permutations([A, B, C, D]))
def test_every_instance_agrees_whatever_order_it_lists_the_members_in(
    members: list[Member],
) -> None:
    assert rendezvous("t/7", members) == rendezvous("t/7", [A, B, C, D])


def test_sidecar_placement_follows_the_leader_and_covers_a_broker_without_sidecar() -> None:
    s1, s2 = member("s1", 1, broker=1), member("s2", 2, broker=2)
    assert partition_owner("sidecar", "t", 0, 1, [s1, s2]) == s1
    assert partition_owner("sidecar", "t", 0, 2, [s1, s2]) == s2
    orphan = broker_owner(3, [s1, s2])
    assert orphan in (s1, s2)
    assert all(broker_owner(3, [s1, s2]) == orphan for _ in range(3)), "one stable stand-in"
    assert partition_owner("sidecar", "t", 0, None, [s1, s2]) is None, "leader unknown"


def test_balanced_nodes_are_one_per_member_and_broker_and_the_same_from_every_member() -> None:
    seen_from_a = NodeMap("balanced", A, [A, B], stride=1000)
    seen_from_b = NodeMap("balanced", B, [A, B], stride=1000)
    assert seen_from_a.all([1, 2]) == seen_from_b.all([1, 2])
    ids = {n.node_id: n.endpoint for n in seen_from_a.all([1, 2])}
    assert ids == {
        1001: Endpoint("a-host", 9101),
        1002: Endpoint("a-host", 9102),
        2001: Endpoint("b-host", 9101),
        2002: Endpoint("b-host", 9102),
    }
    assert seen_from_a.local(2).node_id == 1002 and seen_from_b.local(2).node_id == 2002
    assert seen_from_a.broker_of(2002) == 2


def test_sidecar_nodes_keep_the_brokers_ids_and_point_at_each_brokers_sidecar() -> None:
    s1, s2 = member("s1", 1, broker=1), member("s2", 2, broker=2, port_base=9200)
    nodes = NodeMap("sidecar", s1, [s1, s2], stride=1000)
    assert [(n.node_id, n.endpoint) for n in nodes.all([1, 2])] == [
        (1, Endpoint("s1-host", 9101)),
        (2, Endpoint("s2-host", 9202)),
    ]
    assert nodes.local(2).endpoint == Endpoint("s2-host", 9202), "the same from s1 as from s2"
    assert nodes.broker_of(2) == 2


def test_a_broker_id_beyond_the_stride_is_refused_clearly() -> None:
    nodes = NodeMap("balanced", A, [A, B], stride=1000)
    with pytest.raises(ValueError, match="node_id_stride"):
        nodes.local(1000)


def test_member_entries_round_trip() -> None:
    s = member("s1", 4, broker=2)
    assert Member.parse("s1", f"inc 4 {s.info()}") == s


# ----------------------------------------------------------------------------- the filters


class _Policies:
    def __init__(self, snapshot: PolicySnapshot) -> None:
        self._snapshot = snapshot

    async def snapshot(self) -> PolicySnapshot:
        return self._snapshot


class _Prefix:
    key_prefix = "test"


def ownership_of(me: Member, members: list[Member]) -> Ownership:
    owner = Ownership(
        Membership(_Prefix(), me, 6.0),  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        placement="balanced",
        node_id_stride=1000,
        heartbeat_s=1.0,
        ttl_s=6.0,
        leader_lookup=lambda topic, partition: asyncio.sleep(0, None),
    )
    owner.members = members
    return owner


def metadata_response(topics: dict[str, int]) -> metadata_v12.MetadataResponse:
    """Brokers 0 and 1 (addresses already this instance's), every partition led by 1."""
    return metadata_v12.MetadataResponse(
        throttle_time=i32Timedelta.parse(datetime.timedelta(0)),
        brokers=tuple(
            metadata_v12.MetadataResponseBroker(
                node_id=BrokerId(b), host="me", port=i32(9100 + b), rack=None
            )
            for b in (0, 1)
        ),
        cluster_id="c",
        controller_id=BrokerId(0),
        topics=tuple(
            metadata_v12.MetadataResponseTopic(
                error_code=ErrorCode.none,
                name=TopicName(name),
                topic_id=uuid.uuid4(),
                is_internal=False,
                partitions=tuple(
                    metadata_v12.MetadataResponsePartition(
                        error_code=ErrorCode.none,
                        partition_index=i32(p),
                        leader_id=BrokerId(1),
                        leader_epoch=i32(4),
                        replica_nodes=(BrokerId(0), BrokerId(1)),
                        isr_nodes=(BrokerId(0), BrokerId(1)),
                        offline_replicas=(),
                    )
                    for p in range(count)
                ),
                topic_authorized_operations=i32(-2147483648),
            )
            for name, count in topics.items()
        ),
    )


async def test_metadata_names_each_dedup_partitions_owner_and_this_instance_for_the_rest() -> None:
    owner = ownership_of(A, [A, B])
    policies = PolicySnapshot(Mode.ENABLED, topics={"plain": Mode.DISABLED})
    filter_ = OwnedMetadataFilter(owner, _Policies(policies))  # type: ignore[arg-type]
    response: Any = await filter_.on_response(
        12,
        metadata_response({"orders": 16, "plain": 4}),
        None,  # type: ignore[arg-type]
    )
    assert [(int(b.node_id), b.host, int(b.port)) for b in response.brokers] == [
        (1000, "a-host", 9100),
        (1001, "a-host", 9101),
        (2000, "b-host", 9100),
        (2001, "b-host", 9101),
    ]
    assert int(response.controller_id) == 1000
    orders, plain = response.topics
    leaders = {int(p.leader_id) for p in orders.partitions}
    assert leaders == {1001, 2001}, "the owner's node for broker 1, both owners in use"
    for p in orders.partitions:
        expected = owner.owner_of(("orders", int(p.partition_index)))
        assert expected is not None and int(p.leader_id) == expected.slot * 1000 + 1
        assert [int(n) for n in p.replica_nodes] == [1000, 1001], "replicas: this instance"
    assert {int(p.leader_id) for p in plain.partitions} == {1001}, "no dedup: any instance"
    assert owner.leader(("orders", 3)) == (1, 4), "leaders are learned from metadata"


async def test_a_held_partition_kafka_no_longer_has_is_not_warned_of_every_beat() -> None:
    """Sidecar placement asks the leaders of held partitions every heartbeat: a topic
    deleted under one is the topic watch's to act on (it lets the partition go), not a
    warning a second."""
    owner = ownership_of(A, [A])

    async def lookup(topic: str, partition: int) -> tuple[int, int] | None:
        if topic == "deleted":
            raise NoSuchPartition(f"topic {topic} does not exist")
        raise OSError("no broker answered")

    owner._leader_lookup = lookup
    with structlog.testing.capture_logs() as logs:
        await owner._learn_leaders([("deleted", 0), ("unreachable", 0)])
    assert [(e["event"], e["topic"]) for e in logs] == [
        ("partition leader not learned", "unreachable")
    ]


async def test_a_partition_let_go_is_handed_over_once_then_no_longer_held() -> None:
    """Its topic deleted: the lease is given up as in a handoff (settled, released, the
    scheduler told), once, however often it is asked for."""
    owner = ownership_of(A, [A])
    released: list[tuple[tuple[str, int], bool]] = []
    lost: list[tuple[str, int]] = []

    class Leases:
        async def release(self, lease: Lease, clean: bool) -> None:
            released.append((lease.key, clean))

    async def settled(lease: Lease) -> bool:
        return True

    owner.leases = Leases()  # type: ignore[assignment]
    owner.bind(on_lost=lost.append, handoff=settled)
    owner.granted(Lease("deleted", 0, "a", "i", 1))
    owner.observe_leader(("deleted", 0), 1, 4)
    assert owner.let_go(("deleted", 0)) is True
    assert owner.leader(("deleted", 0)) is None, "its next request asks Kafka"
    assert owner.let_go(("deleted", 0)) is False, "under way already"
    await asyncio.gather(*owner._handoffs)
    assert released == [(("deleted", 0), True)]
    assert lost == [("deleted", 0)]
    assert not owner.holds(("deleted", 0))
    assert owner.let_go(("deleted", 0)) is False, "not held"


async def test_the_leaders_of_a_topics_held_partitions_are_asked_at_once() -> None:
    """So that their lookups share one Metadata request; topics one after another."""
    owner = ownership_of(A, [A])
    under_way: list[str] = []
    most: dict[str, int] = {}

    async def lookup(topic: str, partition: int) -> tuple[int, int] | None:
        under_way.append(topic)
        most[topic] = max(most.get(topic, 0), under_way.count(topic))
        assert set(under_way) == {topic}, "one topic at a time"
        await asyncio.sleep(0)
        under_way.remove(topic)
        return 1, 2

    owner._leader_lookup = lookup
    await owner._learn_leaders([("a", 0), ("b", 1), ("a", 1), ("b", 0), ("a", 2)])
    assert most == {"a": 3, "b": 2}
    assert owner.leader(("b", 1)) == (1, 2)


def fetch_response(version: int, preferred: int, endpoints: int = 0) -> Any:
    """One partition of one topic, naming ``preferred`` as its preferred read replica (-1:
    none), with ``endpoints`` KIP-951 node endpoints (v16+)."""
    module: Any = importlib.import_module(f"kio.schema.fetch.v{version}.response")
    topic = {"topic_id": uuid.uuid4()} if version >= 13 else {"topic": TopicName("t")}
    extra = {}
    if version >= 16:
        extra["node_endpoints"] = tuple(
            module.NodeEndpoint(node_id=BrokerId(b), host="me", port=i32(9100 + b), rack=None)
            for b in range(endpoints)
        )
    return module.FetchResponse(
        throttle_time=i32Timedelta.parse(datetime.timedelta(0)),
        error_code=ErrorCode.none,
        session_id=i32(0),
        responses=(
            module.FetchableTopicResponse(
                **topic,
                partitions=(
                    module.PartitionData(
                        partition_index=i32(0),
                        error_code=ErrorCode.none,
                        high_watermark=i64(10),
                        last_stable_offset=i64(10),
                        log_start_offset=i64(0),
                        aborted_transactions=None,
                        preferred_read_replica=BrokerId(preferred),
                        records=None,
                    ),
                ),
            ),
        ),
        **extra,
    )


def fetch_hints(owner: Ownership) -> OwnedLeaderHintsFilter:
    return OwnedLeaderHintsFilter(owner, ApiKey.FETCH, first_version=16, first_id_version=11)


def wants(filter_: OwnedLeaderHintsFilter, version: int, response: Any) -> bool:
    header = (7).to_bytes(4, "big") + (b"\x00" if version >= 12 else b"")
    context = FilterContext(Topology([Endpoint("kafka", 9092)], "proxy", broker_port_base=40000))
    payload = header + encode_body(response)
    return filter_.wants_response(version, payload, len(header), context)


@pytest.mark.parametrize("version", [11, 12, 13, 16, 17])
async def test_a_preferred_read_replica_is_named_by_this_instances_node_in_a_group(
    version: int,
) -> None:
    """KIP-392: a Fetch answer sends a consumer to the replica in its rack, by the broker's
    own id. Through a group, no node has that id: it must be this instance's node."""
    filter_ = fetch_hints(ownership_of(B, [A, B]))
    redirect = fetch_response(version, preferred=2)
    assert wants(filter_, version, redirect), "decoded: it names a broker by id"
    assert not wants(filter_, version, fetch_response(version, preferred=-1))
    out: Any = await filter_.on_response(version, redirect, None)  # type: ignore[arg-type]
    assert int(out.responses[0].partitions[0].preferred_read_replica) == 2002
    untouched: Any = await filter_.on_response(
        version,
        fetch_response(version, preferred=-1),
        None,  # type: ignore[arg-type]
    )
    assert int(untouched.responses[0].partitions[0].preferred_read_replica) == -1


async def test_alone_the_brokers_own_ids_stand_and_no_fetch_answer_is_decoded_for_them() -> None:
    filter_ = fetch_hints(ownership_of(A, [A]))
    assert not wants(filter_, 11, fetch_response(11, preferred=2)), "v11: not even walked"
    assert not wants(filter_, 16, fetch_response(16, preferred=2)), "no endpoints to rename"
    with_endpoints = fetch_response(16, preferred=2, endpoints=2)
    assert wants(filter_, 16, with_endpoints)
    out: Any = await filter_.on_response(16, with_endpoints, None)  # type: ignore[arg-type]
    assert int(out.responses[0].partitions[0].preferred_read_replica) == 2
    assert [int(e.node_id) for e in out.node_endpoints] == [0, 1]


def build(entity: Any, **values: Any) -> Any:
    """An entity of one API version, given the values of those of its fields it has."""
    return entity(**{f.name: values[f.name] for f in dataclasses.fields(entity)})


@pytest.mark.parametrize("api", ["share_fetch", "share_acknowledge"])
async def test_share_group_answers_name_the_new_leader_by_this_instances_node(api: str) -> None:
    """KIP-932's ShareFetch and ShareAcknowledge carry KIP-951 hints as Fetch does."""
    module: Any = importlib.import_module(f"kio.schema.{api}.v1.response")
    kind = "Fetch" if api == "share_fetch" else "Acknowledge"
    part = build(
        module.PartitionData,
        partition_index=i32(0),
        error_code=ErrorCode.not_leader_or_follower,
        error_message=None,
        acknowledge_error_code=ErrorCode.none,
        acknowledge_error_message=None,
        current_leader=module.LeaderIdAndEpoch(leader_id=BrokerId(1), leader_epoch=i32(6)),
        records=None,
        acquired_records=(),
    )
    topic = getattr(module, f"Share{'Fetchable' if kind == 'Fetch' else kind}TopicResponse")
    response = build(
        getattr(module, f"Share{kind}Response"),
        throttle_time=i32Timedelta.parse(datetime.timedelta(0)),
        error_code=ErrorCode.none,
        error_message=None,
        acquisition_lock_timeout=i32(30000),
        responses=(topic(topic_id=uuid.uuid4(), partitions=(part,)),),
        node_endpoints=(
            module.NodeEndpoint(node_id=BrokerId(1), host="me", port=i32(9101), rack=None),
        ),
    )
    owner = ownership_of(B, [A, B])
    policies: Any = _Policies(PolicySnapshot(Mode.ENABLED))
    (filter_,) = [
        f
        for f in ownership_filters(owner, policies)
        if getattr(f, "response_keys", ()) == {ApiKey[api.upper()]}
    ]
    out: Any = await filter_.on_response(1, response, None)  # type: ignore[attr-defined]
    assert int(out.responses[0].partitions[0].current_leader.leader_id) == 2001
    assert [(int(e.node_id), e.host, int(e.port)) for e in out.node_endpoints] == [
        (2001, "b-host", 9101)
    ]

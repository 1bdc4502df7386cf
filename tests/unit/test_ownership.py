"""Placement and node naming for several instances: pure functions, no Redis."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dedup.ownership.members import Member
from dedup.ownership.nodes import NodeMap
from dedup.ownership.placement import broker_owner, partition_owner, rendezvous
from proxy.kafka.topology import Endpoint


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

"""The node ids and addresses clients are told, when several instances serve one cluster.

A client must reach each partition's owner by itself, the way it reaches a leader: the
metadata it gets names, as the partition's leader, a node that is the owner's listener for
the leader broker. Every instance must describe the same node the same way, whichever the
client asked, so the mapping is a pure function of the member list:

- ``balanced``: node ``slot * stride + broker`` is member ``slot``'s listener for
  ``broker`` (every member lists a node per broker; broker ids must be below ``stride``);
- ``sidecar``: node ids are the brokers' own; node ``b`` is the listener for ``b`` of the
  member that owns broker ``b``'s partitions (`dedup.ownership.placement.broker_owner`).
  Admin requests that name brokers by id work unchanged; with balanced placement they are
  translated (`dedup.ownership.admin_ids`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from dedup.ownership.members import Member
from dedup.ownership.placement import broker_owner
from proxy.kafka.topology import Endpoint


@dataclass(frozen=True, slots=True)
class Node:
    node_id: int
    endpoint: Endpoint


class NodeMap:
    def __init__(self, placement: str, me: Member, members: Sequence[Member], stride: int) -> None:
        self.placement = placement
        self.me = me
        self.members = list(members) or [me]
        self.stride = stride

    def of(self, member: Member, broker_id: int) -> Node:
        """The node a client uses to reach ``broker_id`` through ``member``."""
        if self.placement == "sidecar":
            owner = broker_owner(broker_id, self.members) or member
            return Node(broker_id, owner.endpoint_for(broker_id))
        if not 0 <= broker_id < self.stride:
            raise ValueError(
                f"broker node id {broker_id} is not below node_id_stride {self.stride}"
            )
        return Node(member.slot * self.stride + broker_id, member.endpoint_for(broker_id))

    def local(self, broker_id: int) -> Node:
        """The node for a broker in a response this instance relays."""
        return self.of(self.me, broker_id)

    def local_id(self, broker_id: int) -> int:
        """`local`'s node id; a negative id (no broker) stays as it is."""
        return broker_id if broker_id < 0 else self.local(broker_id).node_id

    def all(self, brokers: Iterable[int]) -> list[Node]:
        """Every node of every member for these brokers, once each, by id."""
        brokers = list(brokers)
        nodes = {n.node_id: n for m in self.members for b in brokers for n in [self.of(m, b)]}
        return [nodes[i] for i in sorted(nodes)]

    def broker_of(self, node_id: int) -> int:
        """The upstream broker behind a node id clients send (e.g. in an admin request,
        `dedup.ownership.admin_ids`); an id that is no member's node passes unchanged."""
        if self.placement == "sidecar" or node_id < 0:
            return node_id
        slot, broker = divmod(node_id, self.stride)
        return broker if any(m.slot == slot for m in self.members) else node_id

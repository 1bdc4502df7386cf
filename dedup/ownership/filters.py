"""Responses that name nodes, rewritten so clients reach each partition's owner.

The runtime's address filters (`proxy.filters.addresses`) have already put this instance's
listener in place of every broker; these run after them (earlier in the chain: response
filters run in reverse) and describe the nodes of every live instance instead
(`dedup.ownership.nodes`). In a Metadata response, a partition of a topic with dedup on is
led by its owner's node for the leader broker; everything else (replicas, coordinators,
the controller, KIP-951 endpoints in Produce, Fetch and share-group answers, a Fetch
answer's preferred read replica) by this instance's node for the broker, so consumers and
admin clients keep working through any instance. Admin requests that name brokers by
those ids are translated back (`dedup.ownership.admin_ids`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kio.schema.types import BrokerId
from kio.static.primitive import i32
from kio.static.protocol import ResponsePayload

from dedup.ownership.admin_ids import admin_id_filters
from dedup.ownership.nodes import NodeMap
from dedup.ownership.owner import Ownership
from dedup.policies import Mode, PolicyStore
from proxy.kafka.api_keys import ApiKey
from proxy.runtime.chain import FilterContext

BROKER_ENDPOINT_TYPE = 1  # DescribeCluster v1+: 1 = brokers, 2 = controllers
# The broker lists of a partition in Metadata and DescribeTopicPartitions answers
_REPLICA_LISTS = (
    "replica_nodes",
    "isr_nodes",
    "offline_replicas",
    "eligible_leader_replicas",
    "last_known_elr",
)


class _NodesFilter:
    def __init__(self, ownership: Ownership) -> None:
        self._ownership = ownership

    def wants_response(
        self, version: int, payload: bytes, body_start: int, context: FilterContext
    ) -> bool:
        return True

    async def on_response(
        self, version: int, response: ResponsePayload, context: FilterContext
    ) -> ResponsePayload:
        rewritten: ResponsePayload = await self._rewrite(version, response)
        return rewritten

    async def _rewrite(self, version: int, response: Any) -> Any:
        raise NotImplementedError

    def _broker(self, entity: Any, node_id: int, id_field: str = "node_id") -> Any:
        node = self._ownership.nodes().local(node_id)
        return replace(
            entity,
            **{id_field: BrokerId(node.node_id)},
            host=node.endpoint.host,
            port=i32(node.endpoint.port),
        )

    def _local_id(self, node_id: int) -> int:
        return self._ownership.nodes().local_id(node_id)


class OwnedMetadataFilter(_NodesFilter):
    response_keys = frozenset({ApiKey.METADATA})

    def __init__(self, ownership: Ownership, policies: PolicyStore) -> None:
        super().__init__(ownership)
        self._policies = policies

    async def _rewrite(self, version: int, response: Any) -> Any:
        nodes = self._ownership.nodes()
        brokers = _every_node(nodes, response.brokers, "node_id")
        top: dict[str, Any] = {
            "brokers": brokers,
            "topics": await self._topics(nodes, response.topics),
        }
        if hasattr(response, "controller_id"):  # v1+
            top["controller_id"] = BrokerId(self._local_id(int(response.controller_id)))
        return replace(response, **top)

    async def _topics(self, nodes: NodeMap, topics: Any) -> tuple[Any, ...]:
        """Each partition led by its owner's node (dedup on) or this instance's, and its
        replicas named by this instance's nodes."""
        policies = await self._policies.snapshot()
        rewritten = []
        for topic in topics:
            name = None if topic.name is None else str(topic.name)
            deduped = name is not None and policies.mode_for(name) is not Mode.DISABLED
            partitions = []
            for part in topic.partitions:
                leader = int(part.leader_id)
                key = (name or "", int(part.partition_index))
                if name is not None:
                    epoch = int(getattr(part, "leader_epoch", -1))
                    self._ownership.observe_leader(key, leader, epoch)
                owner = self._ownership.owner_of(key) if deduped and leader >= 0 else None
                leader_node = (
                    nodes.of(owner, leader).node_id if owner is not None else self._local_id(leader)
                )
                changes: dict[str, Any] = {"leader_id": BrokerId(leader_node)}
                for field in _REPLICA_LISTS:
                    ids = getattr(part, field, None)  # offline_replicas: v5+; ELR: nullable
                    if ids is not None:
                        changes[field] = tuple(BrokerId(self._local_id(int(n))) for n in ids)
                partitions.append(replace(part, **changes))
            rewritten.append(replace(topic, partitions=tuple(partitions)))
        return tuple(rewritten)


class OwnedTopicPartitionsFilter(OwnedMetadataFilter):
    """DescribeTopicPartitions (KIP-966), which Kafka's admin client describes topics
    with: the partitions of Metadata's answer, without the brokers."""

    response_keys = frozenset({ApiKey.DESCRIBE_TOPIC_PARTITIONS})

    async def _rewrite(self, version: int, response: Any) -> Any:
        nodes = self._ownership.nodes()
        return replace(response, topics=await self._topics(nodes, response.topics))


class OwnedDescribeClusterFilter(_NodesFilter):
    response_keys = frozenset({ApiKey.DESCRIBE_CLUSTER})

    async def _rewrite(self, version: int, response: Any) -> Any:
        if getattr(response, "endpoint_type", BROKER_ENDPOINT_TYPE) != BROKER_ENDPOINT_TYPE:
            return response
        nodes = self._ownership.nodes()
        brokers = _every_node(nodes, response.brokers, "broker_id")
        return replace(
            response,
            brokers=brokers,
            controller_id=BrokerId(self._local_id(int(response.controller_id))),
        )


class OwnedCoordinatorFilter(_NodesFilter):
    response_keys = frozenset({ApiKey.FIND_COORDINATOR})

    async def _rewrite(self, version: int, response: Any) -> Any:
        if version < 4:
            if response.node_id < 0:
                return response
            return self._broker(response, int(response.node_id))
        return replace(
            response,
            coordinators=tuple(
                self._broker(c, int(c.node_id)) if c.node_id >= 0 else c
                for c in response.coordinators
            ),
        )


class OwnedLeaderHintsFilter(_NodesFilter):
    """Answers that name brokers outside Metadata, all named by this instance's node for
    the broker: KIP-951's node endpoints and each partition's ``current_leader`` in
    Produce (v10+), Fetch (v16+) and the share-group ShareFetch and ShareAcknowledge
    (KIP-932); and a Fetch partition's ``preferred_read_replica`` (v11+, KIP-392: the
    replica in the consumer's rack). A preferred read replica named by the broker's own
    id, which no node of a group has, would leave the consumer asking for a node it cannot
    find, and reading nothing. Decoded only when the raw answer may name brokers
    (`FilterContext.may_name_brokers`); by ids alone only while the nodes are renamed."""

    def __init__(
        self, ownership: Ownership, api_key: ApiKey, first_version: int, first_id_version: int
    ) -> None:
        super().__init__(ownership)
        self.response_keys = frozenset({api_key})
        self._api_key = api_key
        self._first_version = first_version
        self._first_id_version = first_id_version
        self._partitions = "partition_responses" if api_key is ApiKey.PRODUCE else "partitions"

    def wants_response(
        self, version: int, payload: bytes, body_start: int, context: FilterContext
    ) -> bool:
        by_id = self._ownership.renames_nodes()
        if version < (self._first_id_version if by_id else self._first_version):
            return False
        return context.may_name_brokers(self._api_key, version, payload, body_start, by_id)

    async def _rewrite(self, version: int, response: Any) -> Any:
        topics = []
        for topic in response.responses:
            parts = tuple(self._partition(p) for p in getattr(topic, self._partitions))
            topics.append(replace(topic, **{self._partitions: parts}))
        endpoints = getattr(response, "node_endpoints", ())
        changes: dict[str, Any] = {"responses": tuple(topics)}
        if endpoints:
            changes["node_endpoints"] = tuple(self._broker(e, int(e.node_id)) for e in endpoints)
        return replace(response, **changes)

    def _partition(self, part: Any) -> Any:
        changes: dict[str, Any] = {}
        leader = getattr(part, "current_leader", None)  # Produce v10+, Fetch v12+
        if leader is not None and int(leader.leader_id) >= 0:
            local = BrokerId(self._local_id(int(leader.leader_id)))
            changes["current_leader"] = replace(leader, leader_id=local)
        replica = int(getattr(part, "preferred_read_replica", -1))  # Fetch v11+
        if replica >= 0:
            changes["preferred_read_replica"] = BrokerId(self._local_id(replica))
        return replace(part, **changes) if changes else part


def _every_node(nodes: NodeMap, brokers: Any, id_field: str) -> tuple[Any, ...]:
    """The broker list of a response as every member's nodes for those brokers (each keeps
    its broker's rack)."""
    if not brokers:
        return ()
    racks = {int(getattr(b, id_field)): b.rack for b in brokers}
    return tuple(
        replace(
            brokers[0],
            **{id_field: BrokerId(node.node_id)},
            host=node.endpoint.host,
            port=i32(node.endpoint.port),
            rack=racks.get(nodes.broker_of(node.node_id)),
        )
        for node in nodes.all(racks)
    )


def ownership_filters(ownership: Ownership, policies: PolicyStore) -> list[object]:
    """In chain order, placed before the runtime's filters (so they run after them)."""
    return [
        OwnedMetadataFilter(ownership, policies),
        OwnedTopicPartitionsFilter(ownership, policies),
        OwnedDescribeClusterFilter(ownership),
        OwnedCoordinatorFilter(ownership),
        OwnedLeaderHintsFilter(ownership, ApiKey.PRODUCE, first_version=10, first_id_version=10),
        OwnedLeaderHintsFilter(ownership, ApiKey.FETCH, first_version=16, first_id_version=11),
        OwnedLeaderHintsFilter(ownership, ApiKey.SHARE_FETCH, first_version=0, first_id_version=0),
        OwnedLeaderHintsFilter(
            ownership, ApiKey.SHARE_ACKNOWLEDGE, first_version=0, first_id_version=0
        ),
        *admin_id_filters(ownership),
    ]

"""Admin requests that name brokers by id, where several instances renamed the nodes.

With balanced placement and several instances, clients know broker ``b`` as node
``slot * node_id_stride + b``, one per instance (`dedup.ownership.nodes`); Kafka knows it
as ``b``. So a request that names a broker by the id a client was told (a broker's
configs, a replica assignment, a broker to unregister) would reach Kafka under an id it
has never heard of ("Unexpected broker id"). These filters put the broker's own id in its
place on the way to Kafka, and in answers that name brokers (a broker's config resource,
the replicas of ongoing reassignments) put this instance's node for the broker back: the
node a client sends such a request to, so its answer matches what it asked.

An id that is no member's node passes unchanged, for Kafka to refuse. With sidecar
placement, or one instance, node ids are the brokers' own and nothing changes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from kio.schema.types import BrokerId
from kio.static.protocol import ResponsePayload

from dedup.ownership.nodes import NodeMap
from dedup.ownership.owner import Ownership
from proxy.kafka.api_keys import ApiKey
from proxy.runtime.chain import FilterContext, Forward, RequestDecision, RequestFrame

# Config resources named by a broker id (Kafka's ConfigResource.Type)
BROKER_RESOURCES = frozenset({4, 8})  # BROKER, BROKER_LOGGER

_Ids = Callable[[int], int]  # a node or broker id, translated


class _AdminIdsFilter:
    """The translation both ways; a subclass says where its API names brokers."""

    request_keys: frozenset[ApiKey] = frozenset()
    response_keys: frozenset[ApiKey] = frozenset()

    def __init__(self, ownership: Ownership) -> None:
        self._ownership = ownership

    def _renamed(self) -> NodeMap | None:
        """The node map while clients see nodes renamed; else None (nothing to do)."""
        return self._ownership.nodes() if self._ownership.renames_nodes() else None

    async def on_request(self, frame: RequestFrame, context: FilterContext) -> RequestDecision:
        nodes = self._renamed()
        if nodes is None:
            return Forward()
        request: Any = frame.decode()
        translated = self._request(request, nodes.broker_of)
        return Forward(None if translated == request else translated)

    def wants_response(
        self, version: int, payload: bytes, body_start: int, context: FilterContext
    ) -> bool:
        return self._renamed() is not None

    async def on_response(
        self, version: int, response: ResponsePayload, context: FilterContext
    ) -> ResponsePayload:
        nodes = self._renamed()
        if nodes is None:
            return response
        rewritten: ResponsePayload = self._response(response, _local_node(nodes))
        return rewritten

    def _request(self, request: Any, upstream: _Ids) -> Any:
        return request

    def _response(self, response: Any, local: _Ids) -> Any:
        return response


def _local_node(nodes: NodeMap) -> _Ids:
    """This instance's node for a broker; an id no node can stand for passes unchanged."""
    return lambda broker_id: broker_id if broker_id >= nodes.stride else nodes.local_id(broker_id)


def _ids(ids: Sequence[int], translate: _Ids) -> tuple[BrokerId, ...]:
    return tuple(BrokerId(translate(int(i))) for i in ids)


def _resource_name(resource: Any, translate: _Ids) -> Any:
    """A broker config resource renamed (its empty name, the cluster default, stays)."""
    name = resource.resource_name
    if int(resource.resource_type) not in BROKER_RESOURCES or not name.isdecimal():
        return resource
    return replace(resource, resource_name=str(translate(int(name))))


class BrokerConfigsFilter(_AdminIdsFilter):
    """DescribeConfigs, AlterConfigs and IncrementalAlterConfigs: a broker's configs are
    named by its id, and Kafka's answer names it again."""

    request_keys = frozenset(
        {ApiKey.DESCRIBE_CONFIGS, ApiKey.ALTER_CONFIGS, ApiKey.INCREMENTAL_ALTER_CONFIGS}
    )
    response_keys = request_keys

    def _request(self, request: Any, upstream: _Ids) -> Any:
        resources = tuple(_resource_name(r, upstream) for r in request.resources)
        return replace(request, resources=resources)

    def _response(self, response: Any, local: _Ids) -> Any:
        field = "results" if hasattr(response, "results") else "responses"  # DescribeConfigs'
        return replace(
            response, **{field: tuple(_resource_name(r, local) for r in getattr(response, field))}
        )


class ReplicaAssignmentsFilter(_AdminIdsFilter):
    """CreateTopics and CreatePartitions with their replicas named (``--replica-assignment``;
    CreatePartitions' null: Kafka places them)."""

    request_keys = frozenset({ApiKey.CREATE_TOPICS, ApiKey.CREATE_PARTITIONS})

    def _request(self, request: Any, upstream: _Ids) -> Any:
        return _each(
            request, "assignments", lambda a: replace(a, broker_ids=_ids(a.broker_ids, upstream))
        )


class AlterReassignmentsFilter(_AdminIdsFilter):
    """A reassignment names the partition's new replicas (null cancels one)."""

    request_keys = frozenset({ApiKey.ALTER_PARTITION_REASSIGNMENTS})

    def _request(self, request: Any, upstream: _Ids) -> Any:
        return _each(
            request,
            "partitions",
            lambda p: p if p.replicas is None else replace(p, replicas=_ids(p.replicas, upstream)),
        )


class ListReassignmentsFilter(_AdminIdsFilter):
    """Ongoing reassignments name their replicas: as the nodes clients know."""

    response_keys = frozenset({ApiKey.LIST_PARTITION_REASSIGNMENTS})

    def _response(self, response: Any, local: _Ids) -> Any:
        return _each(
            response,
            "partitions",
            lambda p: replace(
                p,
                replicas=_ids(p.replicas, local),
                adding_replicas=_ids(p.adding_replicas, local),
                removing_replicas=_ids(p.removing_replicas, local),
            ),
        )


def _each(entity: Any, field: str, change: Callable[[Any], Any]) -> Any:
    """``entity`` with ``change`` made to every item of each of its topics' ``field`` (a
    null list stays null)."""
    topics = tuple(
        topic
        if getattr(topic, field) is None
        else replace(topic, **{field: tuple(change(item) for item in getattr(topic, field))})
        for topic in entity.topics
    )
    return replace(entity, topics=topics)


class UnregisterBrokerFilter(_AdminIdsFilter):
    request_keys = frozenset({ApiKey.UNREGISTER_BROKER})

    def _request(self, request: Any, upstream: _Ids) -> Any:
        return replace(request, broker_id=BrokerId(upstream(int(request.broker_id))))


def admin_id_filters(ownership: Ownership) -> list[object]:
    return [
        BrokerConfigsFilter(ownership),
        ReplicaAssignmentsFilter(ownership),
        AlterReassignmentsFilter(ownership),
        ListReassignmentsFilter(ownership),
        UnregisterBrokerFilter(ownership),
    ]

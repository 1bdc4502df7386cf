"""Broker-address rewriting: the responses that tell a client where brokers are.

Each filter replaces an upstream broker's host and port with the proxy listener that
stands for that broker, and tells the topology about the brokers it saw so that the
listener exists before the client connects to it. kio has one class per API version; the
fields a filter touches have the same names in all of them, hence the untyped entity
inside each method.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kio.static.primitive import i32
from kio.static.protocol import ResponsePayload

from proxy.kafka.api_keys import ApiKey
from proxy.runtime.chain import FilterContext

BROKER_ENDPOINT_TYPE = 1  # DescribeCluster v1+: 1 = brokers, 2 = controllers


class _AddressFilter:
    async def on_response(
        self, version: int, response: ResponsePayload, context: FilterContext
    ) -> ResponsePayload:
        rewritten: ResponsePayload = await self._rewrite(version, response, context)
        return rewritten

    async def _rewrite(self, version: int, response: Any, context: FilterContext) -> Any:
        raise NotImplementedError


def _to_proxy(entity: Any, node_id: int, context: FilterContext) -> Any:
    endpoint = context.topology.proxy_endpoint(node_id)
    return replace(entity, host=endpoint.host, port=i32(endpoint.port))


class MetadataFilter(_AddressFilter):
    response_keys = frozenset({ApiKey.METADATA})

    def wants_response(
        self, version: int, payload: bytes, body_start: int, context: FilterContext
    ) -> bool:
        return True

    async def _rewrite(self, version: int, response: Any, context: FilterContext) -> Any:
        brokers = response.brokers
        await context.topology.observe(((b.node_id, b.host, b.port) for b in brokers), True)
        return replace(response, brokers=tuple(_to_proxy(b, b.node_id, context) for b in brokers))


class FindCoordinatorFilter(_AddressFilter):
    """v0-3 carry one coordinator at the top level; v4+ a list of them (KIP-699)."""

    response_keys = frozenset({ApiKey.FIND_COORDINATOR})

    def wants_response(
        self, version: int, payload: bytes, body_start: int, context: FilterContext
    ) -> bool:
        return True

    async def _rewrite(self, version: int, response: Any, context: FilterContext) -> Any:
        if version < 4:
            if response.node_id < 0:  # an error answer carries no coordinator
                return response
            await context.topology.observe(
                [(response.node_id, response.host, response.port)], False
            )
            return _to_proxy(response, response.node_id, context)
        found = [c for c in response.coordinators if c.node_id >= 0]
        await context.topology.observe(((c.node_id, c.host, c.port) for c in found), False)
        return replace(
            response,
            coordinators=tuple(
                _to_proxy(c, c.node_id, context) if c.node_id >= 0 else c
                for c in response.coordinators
            ),
        )


class DescribeClusterFilter(_AddressFilter):
    response_keys = frozenset({ApiKey.DESCRIBE_CLUSTER})

    def wants_response(
        self, version: int, payload: bytes, body_start: int, context: FilterContext
    ) -> bool:
        return True

    async def _rewrite(self, version: int, response: Any, context: FilterContext) -> Any:
        # Controllers (KIP-919 bootstrap) are not proxied; their addresses pass as they are.
        if getattr(response, "endpoint_type", BROKER_ENDPOINT_TYPE) != BROKER_ENDPOINT_TYPE:
            return response
        brokers = response.brokers
        await context.topology.observe(((b.broker_id, b.host, b.port) for b in brokers), True)
        return replace(response, brokers=tuple(_to_proxy(b, b.broker_id, context) for b in brokers))


class NodeEndpointsFilter(_AddressFilter):
    """KIP-951: responses that name the new leader's endpoint after a leadership change.

    These are large responses (Fetch carries records), so they are decoded only when they
    may name brokers: a Fetch response's structure is walked to its endpoints field, any
    other is searched for an upstream host name (`FilterContext.may_name_brokers`).
    """

    def __init__(self, api_key: ApiKey, first_version: int) -> None:
        self.response_keys = frozenset({api_key})
        self._api_key = api_key
        self.first_version = first_version

    def wants_response(
        self, version: int, payload: bytes, body_start: int, context: FilterContext
    ) -> bool:
        if version < self.first_version:
            return False
        return context.may_name_brokers(self._api_key, version, payload, body_start)

    async def _rewrite(self, version: int, response: Any, context: FilterContext) -> Any:
        endpoints = getattr(response, "node_endpoints", ())
        if not endpoints:
            return response
        await context.topology.observe(((e.node_id, e.host, e.port) for e in endpoints), False)
        return replace(
            response,
            node_endpoints=tuple(_to_proxy(e, e.node_id, context) for e in endpoints),
        )

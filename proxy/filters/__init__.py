"""The runtime's built-in filters: broker-address rewriting, the ApiVersions cap, and the
client's principal read off its SASL exchange."""

from __future__ import annotations

from proxy.filters.addresses import (
    DescribeClusterFilter,
    FindCoordinatorFilter,
    MetadataFilter,
    NodeEndpointsFilter,
)
from proxy.filters.api_versions import ApiVersionsFilter
from proxy.filters.principal import SaslPrincipalFilter
from proxy.kafka.api_keys import ApiKey


def standard_filters() -> list[object]:
    """The filters every proxy needs to keep clients on the proxy, in chain order."""
    return [
        ApiVersionsFilter(),
        SaslPrincipalFilter(),
        MetadataFilter(),
        FindCoordinatorFilter(),
        DescribeClusterFilter(),
        NodeEndpointsFilter(ApiKey.PRODUCE, first_version=10),
        NodeEndpointsFilter(ApiKey.FETCH, first_version=16),
        NodeEndpointsFilter(ApiKey.SHARE_FETCH, first_version=0),
        NodeEndpointsFilter(ApiKey.SHARE_ACKNOWLEDGE, first_version=0),
    ]


__all__ = ["standard_filters"]

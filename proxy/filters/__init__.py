"""Response filters by API key: the only places where the proxy changes what Kafka said."""

from __future__ import annotations

from collections.abc import Mapping

from proxy.filters.addresses import (
    FETCH_KEY,
    PRODUCE_KEY,
    SHARE_ACKNOWLEDGE_KEY,
    SHARE_FETCH_KEY,
    DescribeClusterFilter,
    FindCoordinatorFilter,
    MetadataFilter,
    NodeEndpointsFilter,
)
from proxy.filters.api_versions import ApiVersionsFilter
from proxy.filters.base import FilterContext, ResponseFilter
from proxy.kafka.schemas import api_name, decode_response_body, encode_body
from proxy.kafka.wire import FrameError, response_body_start
from proxy.runtime import metrics


def default_response_filters() -> Mapping[int, ResponseFilter]:
    filters: list[ResponseFilter] = [
        ApiVersionsFilter(),
        MetadataFilter(),
        FindCoordinatorFilter(),
        DescribeClusterFilter(),
        NodeEndpointsFilter(PRODUCE_KEY, first_version=10),
        NodeEndpointsFilter(FETCH_KEY, first_version=16),
        NodeEndpointsFilter(SHARE_FETCH_KEY, first_version=0),
        NodeEndpointsFilter(SHARE_ACKNOWLEDGE_KEY, first_version=0),
    ]
    return {f.api_key: f for f in filters}


async def apply_response_filter(
    response_filter: ResponseFilter,
    context: FilterContext,
    version: int,
    flexible_header: bool,
    payload: bytes,
) -> bytes:
    """Run one response (header + body, no size prefix) through its filter.

    The header bytes are kept verbatim; the body is re-encoded only when the filter
    changed it, so untouched responses stay byte-for-byte what Kafka sent.
    """
    body_start = response_body_start(payload, flexible_header)
    if not response_filter.wants(version, payload, body_start, context):
        return payload
    api_key = response_filter.api_key
    try:
        response = decode_response_body(api_key, version, payload, body_start)
    except Exception as exc:
        # Passing it on could hand the client an upstream address and bypass the proxy.
        raise FrameError(f"cannot decode {api_name(api_key)} v{version} response: {exc}") from exc
    rewritten = await response_filter.rewrite(version, response, context)
    if rewritten is response:
        return payload
    metrics.REWRITES.labels(api_name(api_key)).inc()
    return payload[:body_start] + encode_body(rewritten)


__all__ = [
    "FilterContext",
    "ResponseFilter",
    "apply_response_filter",
    "default_response_filters",
]

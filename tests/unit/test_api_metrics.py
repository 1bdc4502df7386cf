"""The per-API request metrics (`proxy.runtime.metrics.ApiMetrics`, plain numbers exported at
scrape time) expose what prometheus_client's own Counter and Histogram would, sample for
sample."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from proxy.runtime.metrics import (
    BYTES_HELP,
    REQUESTS_HELP,
    SECONDS_BOUNDS,
    SECONDS_HELP,
    ApiCollector,
    ApiMetrics,
)

pytestmark = pytest.mark.unit

# (api key, request frame bytes, response frame bytes, seconds); bounds hit exactly too.
_exchanges = st.lists(
    st.tuples(
        st.sampled_from([0, 1, 3, 18]),
        st.integers(min_value=4, max_value=1 << 30),
        st.integers(min_value=4, max_value=1 << 30),
        st.one_of(
            st.sampled_from([float(bound) for bound in SECONDS_BOUNDS]),
            st.floats(min_value=0.0, max_value=100.0, allow_nan=False),
        ),
    ),
    max_size=40,
)


def _without_created(exposition: bytes) -> list[str]:
    return [line for line in exposition.decode().splitlines() if "_created" not in line]


@given(_exchanges)
def test_the_exposition_is_prometheus_clients(exchanges: list[tuple[int, int, int, float]]) -> None:
    reference = CollectorRegistry()
    requests = Counter("dedup_proxy_requests", REQUESTS_HELP, ["api"], registry=reference)
    frame_bytes = Counter("dedup_proxy_bytes", BYTES_HELP, ["api", "direction"], registry=reference)
    seconds = Histogram(
        "dedup_proxy_request_seconds",
        SECONDS_HELP,
        ["api"],
        buckets=SECONDS_BOUNDS,
        registry=reference,
    )
    by_api: dict[int, ApiMetrics] = {}
    ours = CollectorRegistry()
    ours.register(ApiCollector(by_api))
    for api_key, request_bytes, response_bytes, took in exchanges:
        api = by_api.setdefault(api_key, ApiMetrics(api_key))
        api.request(request_bytes)
        api.response(response_bytes, took)
        requests.labels(api.name).inc()
        frame_bytes.labels(api.name, "request").inc(request_bytes)
        frame_bytes.labels(api.name, "response").inc(response_bytes)
        seconds.labels(api.name).observe(took)
    assert _without_created(generate_latest(ours)) == _without_created(generate_latest(reference))


def test_created_is_exposed_for_every_series() -> None:
    by_api = {0: ApiMetrics(0)}
    registry = CollectorRegistry()
    registry.register(ApiCollector(by_api))
    created = [
        line for line in generate_latest(registry).decode().splitlines() if "_created{" in line
    ]
    assert len(created) == 4  # requests, bytes in and out, seconds

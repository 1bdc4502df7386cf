"""Prometheus metrics of the proxy (served on the admin port at /metrics)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from proxy.kafka.schemas import api_name

REQUESTS = Counter("dedup_proxy_requests_total", "Requests received from clients, by API", ["api"])
BYTES = Counter(
    "dedup_proxy_bytes_total",
    "Frame bytes by API and direction (request: client to proxy, response: proxy to client)",
    ["api", "direction"],
)
REQUEST_SECONDS = Histogram(
    "dedup_proxy_request_seconds",
    "Time from a request's arrival to its response leaving the proxy, by API",
    ["api"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
CONNECTIONS_ACTIVE = Gauge(
    "dedup_proxy_connections_active", "Open client connections, by listener", ["listener"]
)
CONNECTIONS = Counter(
    "dedup_proxy_connections_total", "Client connections accepted, by listener", ["listener"]
)
CONNECTIONS_REFUSED = Counter(
    "dedup_proxy_connections_refused_total",
    "Client connections closed at once: the listener had max_connections_per_listener open",
    ["listener"],
)
CLIENT_ERRORS = Counter(
    "dedup_proxy_client_errors_total",
    "Client connections closed for bad input, by reason",
    ["reason"],
)
UPSTREAM_ERRORS = Counter(
    "dedup_proxy_upstream_errors_total", "Failures talking to upstream brokers, by kind", ["kind"]
)
BROKER_LISTENERS = Gauge("dedup_proxy_broker_listeners", "Broker listeners currently open")
EVENT_LOOP_LAG = Histogram(
    "dedup_proxy_event_loop_lag_seconds",
    "How late the event loop woke a 10 ms timer: how long one piece of work held it, and so "
    "every connection of the process",
    buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5),
)
REWRITES = Counter(
    "dedup_proxy_response_rewrites_total", "Responses decoded and rewritten, by API", ["api"]
)


class ApiMetrics:
    """Metric children of one API, resolved once: label lookups are too slow per request."""

    __slots__ = ("bytes_in", "bytes_out", "requests", "seconds")

    def __init__(self, api_key: int) -> None:
        name = api_name(api_key)
        self.requests = REQUESTS.labels(name)
        self.bytes_in = BYTES.labels(name, "request")
        self.bytes_out = BYTES.labels(name, "response")
        self.seconds = REQUEST_SECONDS.labels(name)


_by_api: dict[int, ApiMetrics] = {}


def for_api(api_key: int) -> ApiMetrics:
    metrics = _by_api.get(api_key)
    if metrics is None:
        metrics = _by_api[api_key] = ApiMetrics(api_key)
    return metrics

"""Prometheus metrics of the proxy (served on the admin port at /metrics)."""

from __future__ import annotations

import bisect
import itertools
import time
from collections.abc import Iterator

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from proxy.kafka.schemas import api_name

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
BACKGROUND_FAILURES = Counter(
    "dedup_proxy_background_task_failures_total",
    "Background tasks that ended with an error (the process is unhealthy from then on), by task",
    ["task"],
)
BACKGROUND_PASS_ERRORS = Counter(
    "dedup_proxy_background_pass_errors_total",
    "Passes of a background loop that failed with an error they did not expect (the loop "
    "goes on), by task",
    ["task"],
)
REWRITES = Counter(
    "dedup_proxy_response_rewrites_total", "Responses decoded and rewritten, by API", ["api"]
)


# Per API and request: the counts every request updates (`ApiMetrics`). They are plain
# numbers, exported at scrape time (`ApiCollector`) as a Counter and a Histogram would be:
# a prometheus_client child takes a lock and a few calls per update, four updates a request.
REQUESTS_HELP = "Requests received from clients, by API"
BYTES_HELP = (
    "Frame bytes by API and direction (request: client to proxy, response: proxy to client)"
)
SECONDS_HELP = "Time from a request's arrival to its response leaving the proxy, by API"
SECONDS_BOUNDS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
)


class ApiMetrics:
    """What the proxy counts of one API's requests (updated on the event loop only)."""

    __slots__ = ("buckets", "bytes_in", "bytes_out", "created", "name", "requests", "seconds")

    def __init__(self, api_key: int) -> None:
        self.name = api_name(api_key)
        self.created = time.time()
        self.requests = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.buckets = [0] * (len(SECONDS_BOUNDS) + 1)  # the last: above every bound (+Inf)
        self.seconds = 0.0

    def request(self, frame_bytes: int) -> None:
        self.requests += 1
        self.bytes_in += frame_bytes

    def response(self, frame_bytes: int, seconds: float) -> None:
        self.bytes_out += frame_bytes
        # A histogram bucket counts values at or below its bound, as prometheus_client's.
        self.buckets[bisect.bisect_left(SECONDS_BOUNDS, seconds)] += 1
        self.seconds += seconds


_by_api: dict[int, ApiMetrics] = {}


def for_api(api_key: int) -> ApiMetrics:
    metrics = _by_api.get(api_key)
    if metrics is None:
        metrics = _by_api[api_key] = ApiMetrics(api_key)
    return metrics


class ApiCollector(Collector):
    """`ApiMetrics` as prometheus_client's Counter and Histogram would expose them."""

    def __init__(self, by_api: dict[int, ApiMetrics]) -> None:
        self._by_api = by_api

    def collect(self) -> Iterator[Metric]:
        requests, frame_bytes, seconds = _families()
        for api in list(self._by_api.values()):
            requests.add_metric([api.name], api.requests, created=api.created)
            frame_bytes.add_metric([api.name, "request"], api.bytes_in, created=api.created)
            frame_bytes.add_metric([api.name, "response"], api.bytes_out, created=api.created)
            cumulative = itertools.accumulate(api.buckets)
            buckets = list(zip(_BUCKET_LABELS, cumulative, strict=True))
            seconds.add_metric([api.name], buckets, api.seconds)
            seconds.samples.append(
                Sample("dedup_proxy_request_seconds_created", {"api": api.name}, api.created)
            )
        yield requests
        yield frame_bytes
        yield seconds

    def describe(self) -> Iterator[Metric]:
        yield from _families()


def _families() -> tuple[CounterMetricFamily, CounterMetricFamily, HistogramMetricFamily]:
    """The three families, empty: requests, frame bytes, seconds."""
    return (
        CounterMetricFamily("dedup_proxy_requests", REQUESTS_HELP, labels=["api"]),
        CounterMetricFamily("dedup_proxy_bytes", BYTES_HELP, labels=["api", "direction"]),
        HistogramMetricFamily("dedup_proxy_request_seconds", SECONDS_HELP, labels=["api"]),
    )


# The `le` label of each bucket as prometheus_client writes these bounds (its
# floatToGoString is the same for them; the test compares the expositions).
_BUCKET_LABELS: list[str] = [*(repr(float(bound)) for bound in SECONDS_BOUNDS), "+Inf"]

REGISTRY.register(ApiCollector(_by_api))

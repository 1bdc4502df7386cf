"""A running proxy's admin API: JSON calls and Prometheus metrics."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

from dedup.settings import DedupSettings
from deploy.launcher import ProxyProcess

FETCHES = 'dedup_proxy_requests_total{api="fetch"}'
# Balanced placement's default: clients see broker b behind instance slot s as node s * it + b.
NODE_ID_STRIDE: int = DedupSettings.model_fields["node_id_stride"].default


def admin_call(
    proxy: ProxyProcess, method: str, path: str, body: dict[str, Any] | None = None
) -> Any:
    return admin_call_at(proxy.admin_url, method, path, body)


def admin_call_at(
    admin_url: str, method: str, path: str, body: dict[str, Any] | None = None
) -> Any:
    """As `admin_call`, to the plain-HTTP admin API at ``admin_url``."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{admin_url}{path}", data=data, method=method)
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.load(answer)


def all_see_each_other(admin_urls: list[str]) -> bool:
    """Whether the instance at each of ``admin_urls`` lists every one of them as a member
    of its group (healthy is not yet that)."""
    return all(
        len(admin_call_at(url, "GET", "/v1/ownership")["members"]) == len(admin_urls)
        for url in admin_urls
    )


def metric_total(proxy: ProxyProcess, series: str) -> float:
    """The sum of every sample whose line starts with ``series`` (a metric name and the
    start of its labels, e.g. ``dedup_proxy_requests_total{api="Fetch"``)."""
    return series_total(proxy.metrics_text(), series)


def metrics_at(admin_url: str) -> str:
    """The metrics of the proxy whose plain-HTTP admin API is at ``admin_url`` (one that
    this test did not start, e.g. a local environment's)."""
    with urllib.request.urlopen(f"{admin_url}/metrics", timeout=10) as answer:
        text: str = answer.read().decode()
        return text


def series_total(metrics_text: str, series: str) -> float:
    """As `metric_total`, of metrics already read."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics_text.splitlines()
        if line.startswith(series)
    )

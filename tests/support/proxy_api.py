"""A running proxy's admin API: JSON calls and Prometheus metrics."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

from deploy.launcher import ProxyProcess


def admin_call(
    proxy: ProxyProcess, method: str, path: str, body: dict[str, Any] | None = None
) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{proxy.admin_url}{path}", data=data, method=method)
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.load(answer)


def metric_total(proxy: ProxyProcess, series: str) -> float:
    """The sum of every sample whose line starts with ``series`` (a metric name and the
    start of its labels, e.g. ``dedup_proxy_requests_total{api="Fetch"``)."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in proxy.metrics_text().splitlines()
        if line.startswith(series)
    )

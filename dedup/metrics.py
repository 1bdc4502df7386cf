"""Prometheus metrics of the dedup engine (served with the proxy's on the admin port)."""

from __future__ import annotations

from prometheus_client import Counter

RECORDS = Counter(
    "dedup_records_total",
    "Records checked, by verdict (not_dup: forwarded, dup: dropped, unknown: refused)",
    ["verdict"],
)
BAD_INPUT = Counter(
    "dedup_bad_input_total", "Partition batches refused for bad input, by error", ["error"]
)
EVICTIONS = Counter(
    "dedup_producer_evictions_total",
    "Producers evicted because a partition tracked its maximum number of producers",
)

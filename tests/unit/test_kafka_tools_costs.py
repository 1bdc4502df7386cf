"""What `kafka_tools` reports a proxy spends per Produce request: the figure that bounds a
producer's throughput with a core of its own (benchmarks/README.md)."""

from __future__ import annotations

import pytest

from benchmarks.kafka_tools import ToolRow, cpu_us_per_request

pytestmark = pytest.mark.unit


def test_a_producer_rows_cpu_is_spread_over_the_requests_the_proxy_received() -> None:
    row = ToolRow("producer", 1000, "dedup", "median", proxy_cpu_s=2.0, produce_requests=10_000)
    assert cpu_us_per_request(row) == pytest.approx(200.0)


@pytest.mark.parametrize(
    "row",
    [
        None,
        ToolRow("producer", 1000, "direct", "median"),  # no proxy: nothing measured
        ToolRow("producer", 1000, "dedup", "median", proxy_cpu_s=2.0, produce_requests=0),
        ToolRow("consumer", 100, "passthrough", "median", proxy_cpu_s=2.0, produce_requests=5),
    ],
)
def test_nothing_is_reported_without_produce_requests_measured(row: ToolRow | None) -> None:
    assert cpu_us_per_request(row) is None

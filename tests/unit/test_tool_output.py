"""The summaries of Kafka's performance tools, as the kafka_tools benchmark reads them."""

from __future__ import annotations

import pytest

from benchmarks.tool_output import (
    ToolOutputError,
    consumer_summary,
    parse_producer_line,
    producer_summary,
)

pytestmark = pytest.mark.unit

PRODUCER_OUTPUT = """\
Warmup first 50000 records. Steady state results will print after the complete test summary.
127105 records sent, 25421.0 records/sec (24.24 MB/sec), 1066.7 ms avg latency, \
1805.0 ms max latency.
500000 records sent, 115928.587990 records/sec (11.06 MB/sec), 625.62 ms avg latency, \
1001.00 ms max latency, 660 ms 50th, 833 ms 95th, 960 ms 99th, 997 ms 99.9th.
450000 steady state records sent, 165502.022803 records/sec (15.78 MB/sec), 656.31 ms avg \
latency, 1001.00 ms max latency, 670 ms 50th, 837 ms 95th, 965 ms 99th, 997 ms 99.9th.
"""

CONSUMER_OUTPUT = """\
start.time, end.time, data.consumed.in.MB, MB.sec, data.consumed.in.nMsg, nMsg.sec, \
rebalance.time.ms, fetch.time.ms, fetch.MB.sec, fetch.nMsg.sec
2026-11-24 13:59:08:013, 2026-11-24 13:59:10:356, 47.6837, 20.3516, 500000, 213401.6219, \
1264, 1079, 44.1925, 463392.0297
"""


def test_the_steady_state_line_wins() -> None:
    summary = producer_summary(PRODUCER_OUTPUT)
    assert summary.steady_state
    assert summary.records == 450_000
    assert summary.records_per_s == pytest.approx(165502.022803)
    assert summary.mib_per_s == pytest.approx(15.78)
    assert (summary.avg_ms, summary.max_ms) == (656.31, 1001.0)
    assert (summary.p50_ms, summary.p95_ms, summary.p99_ms, summary.p999_ms) == (
        670,
        837,
        965,
        997,
    )


def test_without_warm_up_the_whole_run_is_the_summary() -> None:
    lines = PRODUCER_OUTPUT.splitlines()
    summary = producer_summary("\n".join(lines[:3]))
    assert not summary.steady_state
    assert summary.records == 500_000


def test_progress_lines_are_not_summaries() -> None:
    assert parse_producer_line(PRODUCER_OUTPUT.splitlines()[1]) is None
    with pytest.raises(ToolOutputError):
        producer_summary(PRODUCER_OUTPUT.splitlines()[1])


def test_consumer_values_by_header_name() -> None:
    summary = consumer_summary("a warning\n" + CONSUMER_OUTPUT)
    assert summary.records == 500_000
    assert summary.mib == pytest.approx(47.6837)
    assert summary.mib_per_s == pytest.approx(20.3516)
    assert summary.records_per_s == pytest.approx(213401.6219)
    assert (summary.rebalance_ms, summary.fetch_ms) == (1264, 1079)
    assert summary.fetch_mib_per_s == pytest.approx(44.1925)
    assert summary.fetch_records_per_s == pytest.approx(463392.0297)


def test_consumer_output_without_values_is_an_error() -> None:
    with pytest.raises(ToolOutputError):
        consumer_summary(CONSUMER_OUTPUT.splitlines()[0])

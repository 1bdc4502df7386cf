"""The summaries Kafka's own performance tools print, parsed.

`org.apache.kafka.tools.ProducerPerformance` ends with one line for the whole run and, with
``--warmup-records``, a second for the records after the warm-up ("steady state"):

    450000 steady state records sent, 165502.022803 records/sec (15.78 MB/sec), 656.31 ms
    avg latency, 1001.00 ms max latency, 670 ms 50th, 837 ms 95th, 965 ms 99th, 997 ms 99.9th.

(one line). `org.apache.kafka.tools.ConsumerPerformance` prints a header line and one line
of comma-separated values (``start.time, end.time, data.consumed.in.MB, MB.sec, ...``).
The tools' "MB" is 2^20 bytes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_NUMBER = r"([0-9]+(?:\.[0-9]+)?)"
_PRODUCER_SUMMARY = re.compile(
    rf"^(\d+) (steady state )?records sent, {_NUMBER} records/sec \({_NUMBER} MB/sec\), "
    rf"{_NUMBER} ms avg latency, {_NUMBER} ms max latency, {_NUMBER} ms 50th, "
    rf"{_NUMBER} ms 95th, {_NUMBER} ms 99th, {_NUMBER} ms 99\.9th\.?$"
)


class ToolOutputError(ValueError):
    """A tool's output did not hold the summary expected."""


@dataclass(frozen=True)
class ProducerSummary:
    """ProducerPerformance's final figures (latency: send to acknowledgement, in ms)."""

    records: int
    records_per_s: float
    mib_per_s: float
    avg_ms: float
    max_ms: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    p999_ms: float
    steady_state: bool


@dataclass(frozen=True)
class ConsumerSummary:
    """ConsumerPerformance's figures; ``fetch_*`` leave out the group join (rebalance)."""

    mib: float
    mib_per_s: float
    records: int
    records_per_s: float
    rebalance_ms: float
    fetch_ms: float
    fetch_mib_per_s: float
    fetch_records_per_s: float


def parse_producer_line(line: str) -> ProducerSummary | None:
    """One of ProducerPerformance's final summary lines; None for any other line (the
    progress lines every 5 s have no percentiles)."""
    match = _PRODUCER_SUMMARY.match(line.strip())
    if match is None:
        return None
    records, steady, *numbers = match.groups()
    rate, mib, avg, top, p50, p95, p99, p999 = (float(n) for n in numbers)
    return ProducerSummary(int(records), rate, mib, avg, top, p50, p95, p99, p999, bool(steady))


def producer_summary(output: str) -> ProducerSummary:
    """The steady-state summary of ProducerPerformance's output, or the whole run's when it
    ran without a warm-up."""
    found = [s for s in map(parse_producer_line, output.splitlines()) if s is not None]
    if not found:
        raise ToolOutputError("no ProducerPerformance summary line in the output")
    steady = [s for s in found if s.steady_state]
    return (steady or found)[-1]


_CONSUMER_FIELDS = {
    "data.consumed.in.MB": "mib",
    "MB.sec": "mib_per_s",
    "data.consumed.in.nMsg": "records",
    "nMsg.sec": "records_per_s",
    "rebalance.time.ms": "rebalance_ms",
    "fetch.time.ms": "fetch_ms",
    "fetch.MB.sec": "fetch_mib_per_s",
    "fetch.nMsg.sec": "fetch_records_per_s",
}


def consumer_summary(output: str) -> ConsumerSummary:
    """The values under ConsumerPerformance's header line (the last such pair)."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for index in range(len(lines) - 2, -1, -1):
        names = [n.strip() for n in lines[index].split(",")]
        if "data.consumed.in.nMsg" not in names:
            continue
        values = [v.strip() for v in lines[index + 1].split(",")]
        if len(values) < len(names):
            break
        row = dict(zip(names, values, strict=False))
        try:
            figures = {attr: float(row[name]) for name, attr in _CONSUMER_FIELDS.items()}
        except (KeyError, ValueError) as exc:
            raise ToolOutputError(f"unreadable ConsumerPerformance values: {exc}") from exc
        records = int(figures.pop("records"))
        return ConsumerSummary(records=records, **figures)
    raise ToolOutputError("no ConsumerPerformance header and values in the output")

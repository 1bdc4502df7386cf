"""Kafka's own performance tools against Kafka directly, through the proxy as a
pass-through (``--no-dedup``) and through the proxy with dedup on.

    .venv/bin/python -m benchmarks.kafka_tools [--quick] [--rounds N] [--out DIR] [--profile]

- Producer: ``org.apache.kafka.tools.ProducerPerformance`` (the tools jar on the cached
  classpath), idempotent, ``acks=all``, no headers: through the dedup proxy such records are
  keyed by the client's producer id (``kafka-pid-<id>-<epoch>``). 1000 B and 100 B records.
- Consumer: ``org.apache.kafka.tools.ConsumerPerformance`` reading 100 B records written
  beforehand (directly), in a new consumer group per measurement.

The targets are interleaved (direct, pass-through, dedup, direct, ...) for R rounds; the
summary is the median per target and its ratio to direct. Around every measurement the
proxy's CPU (from /proc) and, for dedup, Redis' CPU (INFO cpu) and EVALSHA calls are read.
``--profile`` then records a py-spy flame graph of each proxy (dedup, pass-through) under the
producer load.
The environment, proxies, probes and output helpers are `benchmarks.passthrough`'s.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, fields
from datetime import datetime
from pathlib import Path
from typing import Any

from benchmarks.flame import ProfilerError, flame_graph
from benchmarks.passthrough import (
    COLORS,
    DEDUP,
    DIRECT,
    LABELS,
    PASSTHROUGH,
    PRODUCE_REQUESTS,
    PROXY_TARGETS,
    RECOVERIES,
    RESULTS_DIR,
    SHORT,
    TARGETS,
    BenchmarkError,
    ProxyTarget,
    RedisStats,
    parse_metrics,
    process_cpu_seconds,
    verdict_metric,
    write_csv,
)
from benchmarks.pinning import check_pin_argument
from benchmarks.stage import (
    Stage,
    add_stage_arguments,
    git_commit,
    python_loop_s,
    stage_settings,
)
from benchmarks.tool_output import (
    ConsumerSummary,
    ProducerSummary,
    ToolOutputError,
    consumer_summary,
    producer_summary,
)

MIB = 1 << 20  # the tools' "MB"
PRODUCER_TOOL = "org.apache.kafka.tools.ProducerPerformance"
CONSUMER_TOOL = "org.apache.kafka.tools.ConsumerPerformance"
PRODUCER, CONSUMER = "producer", "consumer"

# Producer settings besides the tool's and the client's defaults (batch.size 16384,
# linger.ms 5, buffer.memory 32 MiB, 5 requests in flight).
PRODUCER_PROPERTIES = ("acks=all", "enable.idempotence=true")
RECORD_SIZES = (1000, 100)
CONSUMER_RECORD_BYTES = 100
WARMUP_FRACTION = 10  # --warmup-records: a tenth of each producer run, left out of its figures

DEFAULT_ROUNDS = 3
DEFAULT_PRODUCER_RECORDS = {1000: 700_000, 100: 2_000_000}
DEFAULT_CONSUMER_RECORDS = 5_000_000
QUICK_ROUNDS = 2
QUICK_PRODUCER_RECORDS = {1000: 50_000, 100: 200_000}
QUICK_CONSUMER_RECORDS = 300_000
WARMUP_PASS_RECORDS = 30_000  # one unrecorded 1000 B producer run per target first

TOOL_TIMEOUT_S = 600.0
CONSUMER_IDLE_TIMEOUT_MS = 60_000

DEFAULT_PORTS = {
    PASSTHROUGH: (24212, 24200, 24213),  # listen, admin, broker port base
    DEDUP: (24312, 24300, 24313),
}


# ----------------------------------------------------------------------------- model


@dataclass
class ToolRow:
    """One CSV row: a measurement (round 1..R) or a summary (round "median")."""

    kind: str  # producer | consumer
    record_bytes: int
    target: str  # direct | passthrough | dedup
    round: str
    records: int = 0  # measured (producer: after the tool's warm-up)
    records_total: int = 0  # sent or read in the run, warm-up included
    records_per_s: float | None = None
    mib_per_s: float | None = None  # the tool's MB/sec (2^20 B of record payload)
    avg_ms: float | None = None  # producer: send to acknowledgement
    p50_ms: float | None = None
    p99_ms: float | None = None
    max_ms: float | None = None
    rebalance_ms: float | None = None  # consumer: joining the group
    fetch_mib_per_s: float | None = None  # consumer: without the group join
    fetch_records_per_s: float | None = None
    wall_s: float | None = None  # the tool's process, JVM start included
    ratio_vs_direct: float | None = None  # summary rows: records/s (consumer: fetch) / direct
    proxy_cpu_s: float | None = None
    proxy_cpu_ms_per_mib: float | None = None  # proxy CPU per MiB of payload (warm-up incl.)
    redis_cpu_s: float | None = None  # dedup: Redis' CPU meanwhile
    redis_cpu_us_per_record: float | None = None
    redis_evalsha: int | None = None
    produce_requests: int | None = None
    checked_not_dup: int | None = None  # dedup: records the proxy found new
    landed_records: int | None = None  # producer: growth of the topic's end offsets
    note: str = ""


COLUMNS = [f.name for f in fields(ToolRow)]


@dataclass
class Settings:
    out: Path
    rounds: int
    producer_records: dict[int, int]
    consumer_records: int
    bootstrap: str | None
    redis: str | None
    keep_env: bool
    ports: dict[str, tuple[int, int, int]]
    profile: bool
    quick: bool
    tools: tuple[str, ...] = (PRODUCER, CONSUMER)  # which of the two tools to run
    pin: bool = False  # `benchmarks.pinning`


# ----------------------------------------------------------------------------- tools


def run_tool(main_class: str, args: list[str], log: Path) -> tuple[str, float]:
    """Run one of Kafka's Java tools to its end: (stdout, wall seconds). Its stderr (the
    clients' warnings) is appended to `log`."""
    from deploy.local import java_tool_command

    command = java_tool_command(main_class, *args)
    started = time.monotonic()
    with log.open("a") as errors:
        errors.write(f"\n$ {' '.join(command)}\n")
        errors.flush()
        try:
            done = subprocess.run(
                command, stdout=subprocess.PIPE, stderr=errors, text=True, timeout=TOOL_TIMEOUT_S
            )
        except subprocess.TimeoutExpired as exc:
            raise BenchmarkError(f"{main_class} ran over {TOOL_TIMEOUT_S:.0f} s") from exc
    wall = time.monotonic() - started
    if done.returncode != 0:
        raise BenchmarkError(f"{main_class} exited with {done.returncode}; see {log}")
    with log.open("a") as output:
        output.write(done.stdout)
    return done.stdout, wall


def producer_args(bootstrap: str, topic: str, records: int, size: int, client: str) -> list[str]:
    return [
        *("--bootstrap-server", bootstrap, "--topic", topic),
        *("--num-records", str(records), "--record-size", str(size), "--throughput", "-1"),
        *("--warmup-records", str(records // WARMUP_FRACTION)),
        *("--command-property", *PRODUCER_PROPERTIES, f"client.id={client}"),
    ]


def consumer_args(bootstrap: str, topic: str, records: int, group: str) -> list[str]:
    return [
        *("--bootstrap-server", bootstrap, "--topic", topic),
        *("--num-records", str(records), "--group", group),
        *("--timeout", str(CONSUMER_IDLE_TIMEOUT_MS)),
    ]


def run_producer(
    bootstrap: str, topic: str, records: int, size: int, client: str, log: Path
) -> tuple[ProducerSummary, float]:
    output, wall = run_tool(
        PRODUCER_TOOL, producer_args(bootstrap, topic, records, size, client), log
    )
    try:
        return producer_summary(output), wall
    except ToolOutputError as exc:
        raise BenchmarkError(f"{exc}; see {log}") from exc


def run_consumer(
    bootstrap: str, topic: str, records: int, group: str, log: Path
) -> tuple[ConsumerSummary, float]:
    output, wall = run_tool(CONSUMER_TOOL, consumer_args(bootstrap, topic, records, group), log)
    try:
        return consumer_summary(output), wall
    except ToolOutputError as exc:
        raise BenchmarkError(f"{exc}; see {log}") from exc


def producer_row(
    size: int, target: str, total: int, summary: ProducerSummary, wall: float
) -> ToolRow:
    return ToolRow(
        kind=PRODUCER,
        record_bytes=size,
        target=target,
        round="",
        records=summary.records,
        records_total=total,
        records_per_s=summary.records_per_s,
        mib_per_s=summary.mib_per_s,
        avg_ms=summary.avg_ms,
        p50_ms=summary.p50_ms,
        p99_ms=summary.p99_ms,
        max_ms=summary.max_ms,
        wall_s=wall,
    )


def consumer_row(target: str, summary: ConsumerSummary, wall: float) -> ToolRow:
    return ToolRow(
        kind=CONSUMER,
        record_bytes=CONSUMER_RECORD_BYTES,
        target=target,
        round="",
        records=summary.records,
        records_total=summary.records,
        records_per_s=summary.records_per_s,
        mib_per_s=summary.mib_per_s,
        rebalance_ms=summary.rebalance_ms,
        fetch_mib_per_s=summary.fetch_mib_per_s,
        fetch_records_per_s=summary.fetch_records_per_s,
        wall_s=wall,
    )


# ----------------------------------------------------------------------------- probes


@dataclass
class Probe:
    """What is read before and after a measurement."""

    offsets: int | None = None
    proxy_cpu_s: float = 0.0
    metrics: dict[str, float] | None = None
    redis_cpu_s: float = 0.0
    evalsha: int = 0


def probe(
    proxy: ProxyTarget | None, redis: RedisStats | None, offsets: Callable[[], int] | None
) -> Probe:
    snap = Probe(offsets=offsets() if offsets is not None else None)
    if proxy is not None:
        snap.proxy_cpu_s = process_cpu_seconds(proxy.process.pid)
        snap.metrics = parse_metrics(proxy.process.metrics_text())
    if redis is not None:
        snap.redis_cpu_s = redis.cpu_seconds()
        snap.evalsha = redis.snapshot().get("evalsha", (0, 0))[0]
    return snap


def fill_costs(row: ToolRow, before: Probe, after: Probe, proxy: ProxyTarget | None) -> None:
    """The row's proxy CPU, Redis CPU and sanity counts from the probes around it."""
    if before.offsets is not None and after.offsets is not None:
        row.landed_records = after.offsets - before.offsets
    payload_mib = row.records_total * row.record_bytes / MIB
    if proxy is not None and before.metrics is not None and after.metrics is not None:
        row.proxy_cpu_s = after.proxy_cpu_s - before.proxy_cpu_s
        row.proxy_cpu_ms_per_mib = row.proxy_cpu_s * 1000 / payload_mib if payload_mib else None
        metrics_before, metrics_after = before.metrics, after.metrics

        def delta(name: str) -> int:
            return round(metrics_after.get(name, 0.0) - metrics_before.get(name, 0.0))

        row.produce_requests = delta(PRODUCE_REQUESTS)
        if proxy.target == DEDUP:
            row.checked_not_dup = delta(verdict_metric("not_dup"))
            if row.landed_records is not None:
                # a partition's first write through the proxy fences it: one marker offset
                row.landed_records -= delta(RECOVERIES)
    if proxy is not None and proxy.target == DEDUP:
        row.redis_cpu_s = after.redis_cpu_s - before.redis_cpu_s
        row.redis_evalsha = after.evalsha - before.evalsha
        if row.records_total:
            row.redis_cpu_us_per_record = row.redis_cpu_s * 1e6 / row.records_total


def oddities_of(row: ToolRow) -> list[str]:
    """What a measurement got wrong (not: slow)."""
    what = f"{row.kind} {row.record_bytes} B round {row.round} {row.target}"
    found = []
    if row.kind == PRODUCER and row.landed_records not in (None, row.records_total):
        found.append(f"{what}: topic grew by {row.landed_records:,}, {row.records_total:,} sent")
    if row.kind == PRODUCER and row.target == DEDUP and row.checked_not_dup != row.records_total:
        found.append(f"{what}: dedup found {row.checked_not_dup} of {row.records_total:,} new")
    if row.kind == CONSUMER and row.records != row.records_total:
        found.append(f"{what}: read {row.records:,} records")
    return found


# ----------------------------------------------------------------------------- run


class Bench:
    """One measurement at a time on the stage, with the probes around it."""

    def __init__(self, settings: Settings, stage: Stage) -> None:
        self.settings = settings
        self.stage = stage
        self.log = settings.out / "tools.log"

    def measured(self, target: str, topic: str | None, measure: Callable[[], ToolRow]) -> ToolRow:
        """Run one measurement with the probes around it."""
        topics = self.stage.topics
        proxy = self.stage.proxies.get(target)
        redis = self.stage.redis if target == DEDUP else None
        offsets = (lambda: topics.end_offsets(topic, 1)) if topic is not None else None
        before = probe(proxy, redis, offsets)
        row = measure()
        after = probe(proxy, redis, offsets)
        fill_costs(row, before, after, proxy)
        return row

    def producer(self, target: str, topic: str, size: int, records: int, tag: str) -> ToolRow:
        def measure() -> ToolRow:
            client = f"bench-kt-{tag}-{target}"
            summary, wall = run_producer(
                self.stage.bootstraps[target], topic, records, size, client, self.log
            )
            return producer_row(size, target, records, summary, wall)

        return self.measured(target, topic, measure)

    def consumer(self, target: str, topic: str, records: int, tag: str) -> ToolRow:
        def measure() -> ToolRow:
            group = f"{self.stage.topic_prefix}-{tag}-{target}"
            summary, wall = run_consumer(
                self.stage.bootstraps[target], topic, records, group, self.log
            )
            return consumer_row(target, summary, wall)

        return self.measured(target, None, measure)


def interleaved(rounds: int) -> Iterable[tuple[int, str]]:
    for round_no in range(1, rounds + 1):
        for target in TARGETS:
            yield round_no, target


def run(bench: Bench, rows: list[ToolRow]) -> None:
    warm_up(bench)
    if PRODUCER in bench.settings.tools:
        for size in RECORD_SIZES:
            produce(bench, rows, size)
    if CONSUMER in bench.settings.tools:
        consume(bench, rows)
    if bench.settings.profile:
        profile(bench)


def produce(bench: Bench, rows: list[ToolRow], size: int) -> None:
    """ProducerPerformance with `size` B records, interleaved rounds, one topic."""
    records = bench.settings.producer_records[size]
    topic = bench.stage.create_topic(f"produce-{size}b")
    for round_no, target in interleaved(bench.settings.rounds):
        keep(bench, rows, bench.producer(target, topic, size, records, f"r{round_no}"), round_no)
    bench.stage.topics.delete(topic)


def consume(bench: Bench, rows: list[ToolRow]) -> None:
    """ConsumerPerformance over records written directly beforehand, interleaved rounds."""
    records = bench.settings.consumer_records
    topic = bench.stage.create_topic("consume-100b")
    bench.stage.say(f"writing {records:,} records of {CONSUMER_RECORD_BYTES} B to read back")
    direct = bench.stage.bootstraps[DIRECT]
    run_producer(direct, topic, records, CONSUMER_RECORD_BYTES, "bench-kt-fill", bench.log)
    for target in TARGETS:  # unrecorded: each path's first read
        bench.consumer(target, topic, min(records, 100_000), "warmup")
    for round_no, target in interleaved(bench.settings.rounds):
        keep(bench, rows, bench.consumer(target, topic, records, f"r{round_no}"), round_no)
    bench.stage.topics.delete(topic)


def warm_up(bench: Bench) -> None:
    """One unrecorded producer run per target: Kafka's JVM, both proxies, the page cache."""
    topic = bench.stage.create_topic("warmup")
    for target in TARGETS:
        row = bench.producer(target, topic, 1000, WARMUP_PASS_RECORDS, "warmup")
        bench.stage.say(
            f"[dim]warm-up, not recorded: {SHORT[target]:<12} {row.records_per_s:>10,.0f} rec/s[/]"
        )
    bench.stage.topics.delete(topic)


def keep(bench: Bench, rows: list[ToolRow], row: ToolRow, round_no: int) -> None:
    row.round = str(round_no)
    rows.append(row)
    oddities = oddities_of(row)
    bench.stage.meta.setdefault("oddities", []).extend(oddities)
    bench.stage.say(progress_text(row) + "".join(f"  [red]{o}[/]" for o in oddities))


def progress_text(row: ToolRow) -> str:
    text = (
        f"{row.kind:<8} {row.record_bytes:>4} B round {row.round}  {SHORT[row.target]:<12} "
        f"{row.records_per_s or 0:>10,.0f} rec/s {row.mib_per_s or 0:7.2f} MB/s"
    )
    if row.kind == PRODUCER:
        text += f"  p50 {row.p50_ms:g} ms p99 {row.p99_ms:g} ms"
    else:
        text += f"  fetch {row.fetch_mib_per_s or 0:7.2f} MB/s"
    if row.proxy_cpu_ms_per_mib is not None:
        text += f"  proxy {row.proxy_cpu_ms_per_mib:.1f} CPU-ms/MB"
    if row.redis_cpu_us_per_record is not None:
        text += f"  Redis {row.redis_cpu_us_per_record:.2f} CPU-µs/record"
    return text


def profile(bench: Bench) -> None:
    """A flame graph of each proxy, dedup and pass-through, under each producer load (not a
    measurement): the pass-through's shows what relaying alone costs, below dedup's."""
    for target, label in ((DEDUP, "dedup"), (PASSTHROUGH, "passthrough")):
        proxy = bench.stage.proxies[target]
        for size in RECORD_SIZES:
            topic = bench.stage.create_topic(f"profile-{label}-{size}b")
            svg = bench.settings.out / f"flame-{label}-{size}b.svg"
            records = bench.settings.producer_records[size]
            try:
                with flame_graph(proxy.process.pid, svg, bench.settings.out / "py-spy.log"):
                    summary, _ = run_producer(
                        bench.stage.bootstraps[target],
                        topic,
                        records,
                        size,
                        "bench-kt-profile",
                        bench.log,
                    )
            except ProfilerError as exc:
                raise BenchmarkError(str(exc)) from exc
            bench.stage.meta.setdefault("profiles", {})[svg.name] = asdict(summary)
            bench.stage.say(
                f"flame graph {svg.name}: {label} at {summary.records_per_s:,.0f} rec/s"
                " while sampled"
            )
            bench.stage.topics.delete(topic)


# ----------------------------------------------------------------------------- summary

_MEDIAN_FIELDS = (
    "records",
    "records_total",
    "records_per_s",
    "mib_per_s",
    "avg_ms",
    "p50_ms",
    "p99_ms",
    "max_ms",
    "rebalance_ms",
    "fetch_mib_per_s",
    "fetch_records_per_s",
    "wall_s",
    "proxy_cpu_s",
    "proxy_cpu_ms_per_mib",
    "redis_cpu_s",
    "redis_cpu_us_per_record",
    "redis_evalsha",
    "produce_requests",
)


def median_of(values: Iterable[Any]) -> Any:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def cases(rows: list[ToolRow]) -> list[tuple[str, int]]:
    return list(dict.fromkeys((r.kind, r.record_bytes) for r in rows))


def mib_rate(row: ToolRow) -> float:
    """MB/s as the tools print it (a consumer's without its group join)."""
    value = row.fetch_mib_per_s if row.kind == CONSUMER else row.mib_per_s
    return value or 0.0


def rate(row: ToolRow) -> float:
    """The figure a ratio compares: records/s (a consumer's without its group join)."""
    value = row.fetch_records_per_s if row.kind == CONSUMER else row.records_per_s
    return value or 0.0


def summarize(rows: list[ToolRow]) -> list[ToolRow]:
    """Median per case and target, and its ratio to direct."""
    summary: list[ToolRow] = []
    for kind, size in cases(rows):
        medians: dict[str, ToolRow] = {}
        for target in TARGETS:
            runs = [r for r in rows if (r.kind, r.record_bytes, r.target) == (kind, size, target)]
            if not runs:
                continue
            row = ToolRow(kind=kind, record_bytes=size, target=target, round="median")
            for name in _MEDIAN_FIELDS:
                setattr(row, name, median_of(getattr(r, name) for r in runs))
            row.note = f"median of {len(runs)} rounds"
            medians[target] = row
        direct = medians.get(DIRECT)
        for row in medians.values():
            if direct is not None and rate(direct):
                row.ratio_vs_direct = rate(row) / rate(direct)
        summary += medians.values()
    return summary


def pick(summary: list[ToolRow], kind: str, size: int, target: str) -> ToolRow | None:
    return next(
        (r for r in summary if (r.kind, r.record_bytes, r.target) == (kind, size, target)), None
    )


def per_request(row: ToolRow | None, count: float) -> float | None:
    """`count` per Produce request the proxy received (None without requests)."""
    if row is None or not row.produce_requests:
        return None
    return count / row.produce_requests


def cpu_us_per_request(row: ToolRow | None) -> float | None:
    """The proxy's CPU-µs per Produce request it received (producer rows only)."""
    if row is None or row.kind != PRODUCER or row.proxy_cpu_s is None:
        return None
    return per_request(row, row.proxy_cpu_s * 1e6)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_summary(console: Any, summary: list[ToolRow]) -> None:
    from rich.table import Table

    table = Table(
        title="Kafka's performance tools (medians of rounds; MB = 2^20 B)",
        caption="consumer: fetch rates (the tool's fetch.*, without the group join); "
        "ratio: records/s over direct's",
    )
    for column in (
        "tool",
        "record",
        "target",
        "records/s",
        "MB/s",
        "ratio",
        "latency p50 / p99 ms",
    ):
        table.add_column(column, justify="left" if column in ("tool", "target") else "right")
    for kind, size in cases(summary):
        for target in TARGETS:
            row = pick(summary, kind, size, target)
            if row is None:
                continue
            mib = row.fetch_mib_per_s if kind == CONSUMER else row.mib_per_s
            latency = (
                f"{_fmt(row.p50_ms, 'g')} / {_fmt(row.p99_ms, 'g')}" if kind == PRODUCER else "-"
            )
            table.add_row(
                kind,
                f"{size} B",
                SHORT[target],
                _fmt(rate(row), ",.0f"),
                _fmt(mib, ".2f"),
                _fmt(row.ratio_vs_direct, ".2f"),
                latency,
            )
    console.print(table)
    costs = Table(title="What the proxies and Redis spend (medians; warm-up records included)")
    for column in (
        "tool",
        "record",
        "pass-through CPU-ms/MB",
        "dedup CPU-ms/MB",
        "dedup records/request",
        "CPU-µs/request pass / dedup",
        "Redis CPU-µs/record",
        "EVALSHA/request",
    ):
        costs.add_column(column, justify="right")
    for kind, size in cases(summary):
        passthrough = pick(summary, kind, size, PASSTHROUGH)
        dedup = pick(summary, kind, size, DEDUP)
        produced = dedup if dedup is not None and kind == PRODUCER else None
        costs.add_row(
            kind,
            f"{size} B",
            _fmt(passthrough.proxy_cpu_ms_per_mib if passthrough else None, ".1f"),
            _fmt(dedup.proxy_cpu_ms_per_mib if dedup else None, ".1f"),
            _fmt(per_request(produced, produced.records_total if produced else 0), ",.0f"),
            # A proxy's turn per request, beside Kafka's: in series with it (benchmarks/README.md)
            f"{_fmt(cpu_us_per_request(passthrough), ',.0f')} / "
            f"{_fmt(cpu_us_per_request(produced), ',.0f')}",
            _fmt(produced.redis_cpu_us_per_record if produced else None, ".2f"),
            _fmt(per_request(produced, produced.redis_evalsha or 0 if produced else 0), ".2f"),
        )
    console.print(costs)


# ----------------------------------------------------------------------------- plot


def plot(path: Path, rows: list[ToolRow], summary: list[ToolRow], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(1, 3, figsize=(16, 5.5))
    every = cases(summary)
    producers = [c for c in every if c[0] == PRODUCER]
    panels: list[tuple[Any, str, list[tuple[str, int]], Callable[[ToolRow], float]]] = [
        (axes[0], "MB/s (2^20 B; median, dots: rounds; ratio to direct)", every, mib_rate),
        (axes[1], "producer latency p99 ms (median)", producers, lambda r: r.p99_ms or 0.0),
        (
            axes[2],
            "proxy CPU-ms per MB of payload (median)",
            every,
            lambda r: r.proxy_cpu_ms_per_mib or 0.0,
        ),
    ]
    for ax, label, groups, value in panels:
        _bars(ax, groups, rows, summary, value)
        ax.set_title(label, fontsize=10)
    handles = [Patch(color=COLORS[t], label=LABELS[t]) for t in TARGETS]
    fig.legend(handles=handles, loc="upper center", ncol=3, bbox_to_anchor=(0.5, 0.95))
    fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _bars(
    ax: Any,
    groups: list[tuple[str, int]],
    rows: list[ToolRow],
    summary: list[ToolRow],
    value: Callable[[ToolRow], float],
) -> None:
    width = 0.27
    for index, target in enumerate(TARGETS):
        offset = (index - 1) * width
        for x, (kind, size) in enumerate(groups):
            median = pick(summary, kind, size, target)
            if median is None or not value(median):
                continue
            ax.bar(x + offset, value(median), width, color=COLORS[target])
            if median.ratio_vs_direct is not None and value is mib_rate and target != DIRECT:
                ax.annotate(
                    f"{median.ratio_vs_direct:.2f}",
                    (x + offset, value(median)),
                    ha="center",
                    va="bottom",
                    fontsize=8,
                )
            points = [
                value(r) for r in rows if (r.kind, r.record_bytes, r.target) == (kind, size, target)
            ]
            ax.scatter([x + offset] * len(points), points, s=10, color="black", zorder=3)
    ax.set_xticks(range(len(groups)), [f"{kind}\n{size} B" for kind, size in groups])
    ax.grid(axis="y", alpha=0.3)


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> Settings:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.kafka_tools",
        description="Kafka's ProducerPerformance and ConsumerPerformance direct to Kafka, "
        "through the proxy as a pass-through and through the proxy with dedup on.",
    )
    parser.add_argument("--quick", action="store_true", help="a small smoke run (under 2 min)")
    parser.add_argument("--out", type=Path, help="output directory (default: results/<time>)")
    parser.add_argument("--rounds", type=int, help=f"interleaved rounds (default {DEFAULT_ROUNDS})")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="then record py-spy flame graphs of both proxies (SVG)",
    )
    parser.add_argument(
        "--only",
        choices=(PRODUCER, CONSUMER),
        help="run only ProducerPerformance or only ConsumerPerformance (default: both)",
    )
    add_stage_arguments(parser, DEFAULT_PORTS)
    args = parser.parse_args(argv)
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else DEFAULT_ROUNDS)
    if rounds < 1:
        parser.error("--rounds must be positive")
    if args.bootstrap and not args.redis:
        parser.error("--bootstrap needs --redis (the dedup proxy keeps its state there)")
    check_pin_argument(parser, args)
    ports = {PASSTHROUGH: args.passthrough_ports, DEDUP: args.dedup_ports}
    if len({p for t in PROXY_TARGETS for p in ports[t]}) != 6:
        parser.error("the two proxies need six different ports")
    return Settings(
        out=args.out or RESULTS_DIR / datetime.now().strftime("%Y%m%d-%H%M%S-kafka-tools"),
        rounds=rounds,
        producer_records=dict(QUICK_PRODUCER_RECORDS if args.quick else DEFAULT_PRODUCER_RECORDS),
        consumer_records=QUICK_CONSUMER_RECORDS if args.quick else DEFAULT_CONSUMER_RECORDS,
        bootstrap=args.bootstrap,
        redis=args.redis,
        keep_env=args.keep_env,
        ports=ports,
        profile=args.profile,
        quick=args.quick,
        tools=(args.only,) if args.only else (PRODUCER, CONSUMER),
        pin=args.pin,
    )


def describe(settings: Settings) -> dict[str, Any]:
    import confluent_kafka

    from deploy.paths import KAFKA_VERSION

    return {
        "started": datetime.now().isoformat(timespec="seconds"),
        "settings": {k: str(v) for k, v in asdict(settings).items()},
        "producer_properties": list(PRODUCER_PROPERTIES),
        "warmup_records": f"1/{WARMUP_FRACTION} of each producer run (--warmup-records)",
        "kafka": KAFKA_VERSION,
        "librdkafka": confluent_kafka.libversion()[0],
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
        "python_loop_s_start": python_loop_s(),
        "commit": git_commit(),
    }


def write_outputs(
    settings: Settings, rows: list[ToolRow], meta: dict[str, Any], console: Any
) -> None:
    summary = summarize(rows)
    write_csv(settings.out / "kafka_tools.csv", rows + summary, COLUMNS)
    title = (
        f"Kafka {meta['kafka']} ProducerPerformance / ConsumerPerformance: direct vs proxy "
        f"pass-through vs dedup ({os.cpu_count()} CPUs, {settings.rounds} rounds, "
        f"{meta['started']}, {meta['commit']})"
    )
    plot(settings.out / "kafka_tools.png", rows, summary, title)
    meta["loadavg_end"] = os.getloadavg()
    meta["python_loop_s_end"] = python_loop_s()
    (settings.out / "kafka_tools_meta.json").write_text(
        json.dumps(meta, indent=2, default=str) + "\n"
    )
    print_summary(console, summary)
    for oddity in meta.get("oddities", []):
        console.print(f"[yellow]note:[/] {oddity}", highlight=False)


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else 160)
    settings = parse_args(argv)
    settings.out.mkdir(parents=True, exist_ok=True)
    meta = describe(settings)
    stage = Stage(
        stage_settings(settings),
        console,
        meta,
        "kt",
    )
    rows: list[ToolRow] = []
    try:
        with stage.opened():
            run(Bench(settings, stage), rows)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted; proxies stopped[/]")
        write_csv(settings.out / "kafka_tools.partial.csv", rows, COLUMNS)
        return 130
    except (BenchmarkError, OSError) as exc:
        console.print(f"[red]benchmark failed:[/] {exc}", highlight=False)
        write_csv(settings.out / "kafka_tools.partial.csv", rows, COLUMNS)
        return 1
    meta["seconds"] = round(time.monotonic() - stage.started, 1)
    write_outputs(settings, rows, meta, console)
    console.print(f"took {meta['seconds']:.0f} s; results in {settings.out}", highlight=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())

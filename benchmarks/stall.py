"""How long one huge Produce request holds up everyone else on the proxy.

    .venv/bin/python -m benchmarks.stall [--quick] [--rounds N] [--big-mb 32] [--out DIR]

Per target (direct, pass-through, dedup) and round: a small producer (confluent-kafka,
idempotent, ``acks=all``, ``linger.ms=0``) sends one 100 B record at a time to a topic of its
own and waits for each acknowledgement, all along. After a few seconds alone, a second
producer (its own process and connection) flushes one Produce request of ``--big-mb`` MB
(default 32; 1000 B records in one batch, to another topic whose ``max.message.bytes`` allows it).
The small producer's latencies are reported for the calm before (baseline) and for every
record in flight while the big request was (sent to acknowledged): p50, p99, maximum.
A proxy that handles a request on its event loop without yielding shows it as the small
producer's maximum.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from datetime import datetime
from pathlib import Path
from typing import Any

from benchmarks.passthrough import (
    COLORS,
    DEDUP,
    LABELS,
    MB,
    PASSTHROUGH,
    PRODUCE_REQUEST_BYTES,
    PRODUCE_REQUESTS,
    RESULTS_DIR,
    SHORT,
    TARGETS,
    BenchmarkError,
    WorkerPool,
    parse_metrics,
    percentile,
    process_cpu_seconds,
    write_csv,
)
from benchmarks.pinning import check_pin_argument
from benchmarks.stage import Stage, add_stage_arguments, git_commit, stage_settings

BIG_RECORD_BYTES = 1000
SMALL_RECORD_BYTES = 100
# 32 MB is what the proxy takes in one batch by default (max_batch_records 50,000, and
# max_batch_decompressed_bytes 32 MiB, which counts an uncompressed batch's records too). A
# larger request raises the dedup proxy's limits to fit (`proxy_limits`). The local broker
# has the direct memory such requests need (deploy/config.py).
DEFAULT_BIG_MB = 32
DEFAULT_ROUNDS = 3
QUICK_BIG_MB = 16
QUICK_ROUNDS = 1
BASELINE_S = 3.0  # the small producer alone before the big request
TAIL_S = 1.0  # and after it
BIG_TIMEOUT_S = 300.0
BIG_TOPIC_MAX_MESSAGE_BYTES = 110_000_000

DEFAULT_PORTS = {
    PASSTHROUGH: (24252, 24240, 24253),  # listen, admin, broker port base
    DEDUP: (24352, 24340, 24353),
}

SMALL_PRODUCER_SETTINGS: dict[str, Any] = {
    "acks": "all",
    "enable.idempotence": True,
    "linger.ms": 0,
}
# One batch, one request: nothing leaves before flush() (linger), and the batch and the
# request may hold all of it.
BIG_PRODUCER_SETTINGS: dict[str, Any] = {
    "acks": "all",
    "enable.idempotence": True,
    "linger.ms": 120_000,
    "batch.size": 100_000_000,
    "batch.num.messages": 1_000_000,
    "message.max.bytes": 100_000_000,
    "queue.buffering.max.messages": 2_000_000,
    "queue.buffering.max.kbytes": 2_000_000,
    "request.timeout.ms": 120_000,
    "message.timeout.ms": 300_000,
}


@dataclass
class StallRow:
    """One CSV row: one target and round (or "max" over the rounds)."""

    target: str
    round: str
    big_mb: float = 0.0  # the big request's record payload
    big_s: float | None = None  # flush() of the big request: sent to acknowledged
    big_requests: int | None = None  # Produce requests the proxy got meanwhile (small incl.)
    big_request_mb: float | None = None  # their bytes (the big one is nearly all of it)
    proxy_cpu_s: float | None = None  # during the big request
    # Every event-loop lag of the proxy during the big request was at most this (the
    # smallest bucket of `dedup_proxy_event_loop_lag_seconds` holding them all)
    loop_lag_max_ms: float | None = None
    baseline_records: int = 0
    baseline_p50_ms: float | None = None
    baseline_p99_ms: float | None = None
    baseline_max_ms: float | None = None
    during_records: int = 0  # small records in flight while the big request was
    during_p50_ms: float | None = None
    during_p99_ms: float | None = None
    during_max_ms: float | None = None
    errors: int = 0
    note: str = ""


COLUMNS = [f.name for f in fields(StallRow)]


@dataclass
class Settings:
    out: Path
    rounds: int
    big_mb: int
    bootstrap: str | None
    redis: str | None
    keep_env: bool
    ports: dict[str, tuple[int, int, int]]
    quick: bool
    pin: bool = False  # `benchmarks.pinning`


# ----------------------------------------------------------------------------- big producer


def _big_worker(bootstrap: str, topic: str, records: int, go: Any, results: Any) -> None:
    """Queue `records` records in one batch, say so, and on `go` flush them as one request."""
    try:
        from confluent_kafka import Producer

        failures: list[str] = []

        def on_delivery(err: Any, _msg: Any) -> None:
            if err is not None:
                failures.append(str(err))

        producer = Producer(
            {"bootstrap.servers": bootstrap, "on_delivery": on_delivery, **BIG_PRODUCER_SETTINGS}
        )
        producer.produce(topic, b"prime", partition=0)  # producer id, connections, partition
        if producer.flush(60) > 0 or failures:
            raise RuntimeError(f"the priming record failed: {failures}")
        payload = os.urandom(BIG_RECORD_BYTES)
        for _ in range(records):
            producer.produce(topic, payload, partition=0)
        results.put({"ready": True})
        if not go.wait(120):
            raise TimeoutError("never told to go")
        start = time.monotonic()
        left = producer.flush(BIG_TIMEOUT_S)
        end = time.monotonic()
        results.put({"start": start, "end": end, "undelivered": left, "errors": failures[:3]})
    except BaseException as exc:
        results.put({"fatal": f"{type(exc).__name__}: {exc}"})


# ----------------------------------------------------------------------------- small producer


class SmallProducer(threading.Thread):
    """One record at a time; (sent, acknowledged) per record, CLOCK_MONOTONIC seconds."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        super().__init__(daemon=True)
        from confluent_kafka import Producer

        self.producer = Producer({"bootstrap.servers": bootstrap, **SMALL_PRODUCER_SETTINGS})
        self.topic = topic
        self.samples: list[tuple[float, float]] = []
        self.errors: list[str] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        payload = os.urandom(SMALL_RECORD_BYTES)
        done: list[Any] = []
        while not self.stopping.is_set():
            done.clear()
            sent = time.monotonic()
            self.producer.produce(
                self.topic, payload, partition=0, on_delivery=lambda e, _m: done.append(e)
            )
            while not done:
                self.producer.poll(0.5)
                if time.monotonic() - sent > 120:
                    self.errors.append("no acknowledgement within 120 s")
                    return
            if done[0] is not None:
                self.errors.append(str(done[0]))
            else:
                self.samples.append((sent, time.monotonic()))

    def stop(self) -> None:
        self.stopping.set()
        self.join(130)
        self.producer.flush(10)


def latency_figures(
    samples: Iterable[tuple[float, float]],
) -> tuple[int, float | None, float | None, float | None]:
    """(count, p50, p99, max) of acknowledgement latencies in ms."""
    latencies = [(acked - sent) * 1000 for sent, acked in samples]
    if not latencies:
        return 0, None, None, None
    return (
        len(latencies),
        percentile(latencies, 0.50),
        percentile(latencies, 0.99),
        max(latencies),
    )


def split_samples(
    samples: list[tuple[float, float]], calm_from: float, start: float, end: float
) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(baseline: acknowledged before the big request started, after `calm_from`;
    during: in flight at any moment of [start, end])."""
    baseline = [s for s in samples if calm_from <= s[0] and s[1] < start]
    during = [s for s in samples if s[0] <= end and s[1] >= start]
    return baseline, during


# ----------------------------------------------------------------------------- run


def measure(
    stage: Stage, pool: WorkerPool, target: str, topics: tuple[str, str], big_mb: int
) -> StallRow:
    big_topic, small_topic = topics
    bootstrap = stage.bootstraps[target]
    records = big_records(big_mb)
    go = pool.ctx.Event()
    results = pool.ctx.Queue()
    pool.start(_big_worker, (bootstrap, big_topic, records, go, results))
    try:
        (ready,) = pool.collect(results, 1, 180)
        if "fatal" in ready:
            raise BenchmarkError(f"big producer: {ready['fatal']}")
        small = SmallProducer(bootstrap, small_topic)
        small.start()
        try:
            calm_from = time.monotonic() + 0.5
            time.sleep(BASELINE_S)
            proxy = stage.proxies.get(target)
            before = _proxy_probe(proxy)
            go.set()
            (done,) = pool.collect(results, 1, BIG_TIMEOUT_S + 60)
            after = _proxy_probe(proxy)
            time.sleep(TAIL_S)
        finally:
            small.stop()
    except BaseException:
        pool.terminate()
        raise
    pool.reap()
    if "fatal" in done:
        raise BenchmarkError(f"big producer: {done['fatal']}")
    baseline, during = split_samples(small.samples, calm_from, done["start"], done["end"])
    row = StallRow(target=target, round="", big_mb=records * BIG_RECORD_BYTES / MB)
    row.big_s = done["end"] - done["start"]
    row.baseline_records, row.baseline_p50_ms, row.baseline_p99_ms, row.baseline_max_ms = (
        latency_figures(baseline)
    )
    row.during_records, row.during_p50_ms, row.during_p99_ms, row.during_max_ms = latency_figures(
        during
    )
    if done["undelivered"] or done["errors"]:
        # The big request is what is measured: a refused one has no time worth a row.
        raise BenchmarkError(
            f"{target}: the big request failed ({done['undelivered']} undelivered): "
            f"{'; '.join(done['errors']) or 'no delivery report'}"
        )
    row.errors = len(small.errors)
    row.note = "; ".join(small.errors[:2])
    _fill_proxy(row, before, after)
    return row


def big_records(big_mb: int) -> int:
    """Records of `BIG_RECORD_BYTES` in the big request."""
    return big_mb * MB // BIG_RECORD_BYTES


def proxy_limits(big_mb: int) -> dict[str, str]:
    """The dedup proxy's settings for a big request above its default batch limit: a
    request that the proxy refuses by its limits (MESSAGE_TOO_LARGE) measures nothing."""
    if big_mb <= DEFAULT_BIG_MB:
        return {}
    return {
        "DEDUP_PROXY_MAX_BATCH_RECORDS": str(max(big_records(big_mb), 50_000)),
        # The batch's records as they are (uncompressed) count too: the topic's limit.
        "DEDUP_PROXY_MAX_BATCH_DECOMPRESSED_BYTES": str(BIG_TOPIC_MAX_MESSAGE_BYTES),
    }


def _proxy_probe(proxy: Any) -> tuple[float, dict[str, float]] | None:
    if proxy is None:
        return None
    return process_cpu_seconds(proxy.process.pid), parse_metrics(proxy.process.metrics_text())


def _fill_proxy(row: StallRow, before: Any, after: Any) -> None:
    if before is None or after is None:
        return
    row.proxy_cpu_s = after[0] - before[0]
    row.big_requests = round(after[1].get(PRODUCE_REQUESTS, 0) - before[1].get(PRODUCE_REQUESTS, 0))
    request_bytes = after[1].get(PRODUCE_REQUEST_BYTES, 0) - before[1].get(PRODUCE_REQUEST_BYTES, 0)
    row.big_request_mb = request_bytes / MB
    row.loop_lag_max_ms = loop_lag_bound_ms(before[1], after[1])


LOOP_LAG_BUCKET = 'dedup_proxy_event_loop_lag_seconds_bucket{le="'


def loop_lag_bound_ms(before: dict[str, float], after: dict[str, float]) -> float | None:
    """The smallest lag bucket bound (ms) that holds every lag observed between the two
    scrapes; None without observations (or without the metric)."""
    bounds = sorted(
        (float(name[len(LOOP_LAG_BUCKET) : -2]), name)
        for name in after
        if name.startswith(LOOP_LAG_BUCKET) and not name.endswith('+Inf"}')
    )
    total = after.get(LOOP_LAG_BUCKET + '+Inf"}', 0) - before.get(LOOP_LAG_BUCKET + '+Inf"}', 0)
    if total <= 0:
        return None
    for bound, name in bounds:
        if after[name] - before.get(name, 0) >= total:
            return bound * 1000
    return float("inf")


def run(stage: Stage, settings: Settings, rows: list[StallRow]) -> None:
    pool = WorkerPool()
    config = {"max.message.bytes": str(BIG_TOPIC_MAX_MESSAGE_BYTES)}
    try:
        topics = {
            t: (stage.create_topic(f"big-{t}", config), stage.create_topic(f"small-{t}"))
            for t in TARGETS
        }
        for round_no in range(1, settings.rounds + 1):
            for target in TARGETS:
                row = measure(stage, pool, target, topics[target], settings.big_mb)
                row.round = str(round_no)
                rows.append(row)
                stage.say(progress_text(row))
    finally:
        pool.terminate()


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def progress_text(row: StallRow) -> str:
    text = (
        f"round {row.round} {SHORT[row.target]:<12} big {row.big_mb:.0f} MB in {row.big_s:.2f} s; "
        f"small producer p50/p99/max ms: calm {_ms(row.baseline_p50_ms)} / "
        f"{_ms(row.baseline_p99_ms)} / {_ms(row.baseline_max_ms)}, during "
        f"{_ms(row.during_p50_ms)} / {_ms(row.during_p99_ms)} / {_ms(row.during_max_ms)} "
        f"({row.during_records} records)"
    )
    if row.big_requests is not None:
        text += f"; proxy {row.big_requests} requests, {row.big_request_mb:.1f} MB, "
        text += f"{row.proxy_cpu_s:.2f} CPU-s, event-loop lag <= {_ms(row.loop_lag_max_ms)} ms"
    if row.errors:
        text += f" [red]{row.errors} errors: {row.note}[/]"
    return text


# ----------------------------------------------------------------------------- summary


def summarize(rows: list[StallRow]) -> list[StallRow]:
    """Per target, the worst round (the largest stall) and the calm rounds' worst too."""
    summary = []
    for target in TARGETS:
        runs = [r for r in rows if r.target == target]
        if not runs:
            continue
        worst = max(runs, key=lambda r: r.during_max_ms or 0.0)
        row = StallRow(**{**asdict(worst), "round": "max"})
        row.baseline_max_ms = max((r.baseline_max_ms or 0.0) for r in runs)
        row.baseline_p99_ms = max((r.baseline_p99_ms or 0.0) for r in runs)
        row.during_p99_ms = max((r.during_p99_ms or 0.0) for r in runs)
        lags = [r.loop_lag_max_ms for r in runs if r.loop_lag_max_ms is not None]
        row.loop_lag_max_ms = max(lags) if lags else None
        row.errors = sum(r.errors for r in runs)
        row.note = f"worst of {len(runs)} rounds (by the maximum during the big request)"
        summary.append(row)
    return summary


def print_summary(console: Any, rows: list[StallRow], summary: list[StallRow]) -> None:
    from rich.table import Table

    table = Table(
        title="Small producer's acknowledgement latency (ms), calm vs during the big request",
        caption="per round; calm: alone before it; during: in flight while it was",
    )
    for column in (
        "target",
        "round",
        "big request s",
        "calm p50",
        "calm p99",
        "calm max",
        "during p50",
        "during p99",
        "during max",
        "records during",
        "proxy loop lag <=",
    ):
        table.add_column(column, justify="left" if column == "target" else "right")
    for row in rows + summary:
        table.add_row(
            SHORT[row.target],
            row.round,
            _ms(row.big_s),
            _ms(row.baseline_p50_ms),
            _ms(row.baseline_p99_ms),
            _ms(row.baseline_max_ms),
            _ms(row.during_p50_ms),
            _ms(row.during_p99_ms),
            _ms(row.during_max_ms),
            str(row.during_records),
            _ms(row.loop_lag_max_ms),
        )
    console.print(table)


def plot(path: Path, rows: list[StallRow], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5))
    figures = ("baseline_p99_ms", "baseline_max_ms", "during_p99_ms", "during_max_ms")
    labels = ("calm p99", "calm max", "during p99", "during max")
    width = 0.27
    for index, target in enumerate(TARGETS):
        runs = [r for r in rows if r.target == target]
        for x, name in enumerate(figures):
            values = [getattr(r, name) or 0.0 for r in runs]
            if not values:
                continue
            offset = x + (index - 1) * width
            ax.bar(
                offset,
                max(values),
                width,
                color=COLORS[target],
                label=LABELS[target] if x == 0 else None,
            )
            ax.scatter([offset] * len(values), values, s=10, color="black", zorder=3)
    ax.set_yscale("log")
    ax.set_xticks(range(len(figures)), labels)
    ax.set_ylabel("small producer ack latency, ms (bar: worst round; dots: rounds)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> Settings:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.stall",
        description="Acknowledgement latency of a small producer while another connection "
        "sends one huge Produce request: direct, through a pass-through and a dedup proxy.",
    )
    parser.add_argument("--quick", action="store_true", help=f"one round of {QUICK_BIG_MB} MB")
    parser.add_argument("--out", type=Path, help="output directory (default: results/<time>)")
    parser.add_argument("--rounds", type=int, help=f"rounds (default {DEFAULT_ROUNDS})")
    parser.add_argument(
        "--big-mb", type=int, help=f"payload of the big request, MB (default {DEFAULT_BIG_MB})"
    )
    add_stage_arguments(parser, DEFAULT_PORTS)
    args = parser.parse_args(argv)
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else DEFAULT_ROUNDS)
    big_mb = args.big_mb or (QUICK_BIG_MB if args.quick else DEFAULT_BIG_MB)
    if rounds < 1 or not 0 < big_mb <= 95:
        parser.error("--rounds must be positive and --big-mb within 1..95")
    if args.bootstrap and not args.redis:
        parser.error("--bootstrap needs --redis (the dedup proxy keeps its state there)")
    check_pin_argument(parser, args)
    return Settings(
        out=args.out or RESULTS_DIR / datetime.now().strftime("%Y%m%d-%H%M%S-stall"),
        rounds=rounds,
        big_mb=big_mb,
        bootstrap=args.bootstrap,
        redis=args.redis,
        keep_env=args.keep_env,
        ports={PASSTHROUGH: args.passthrough_ports, DEDUP: args.dedup_ports},
        quick=args.quick,
        pin=args.pin,
    )


def main(argv: list[str] | None = None) -> int:
    import confluent_kafka
    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else 160)
    settings = parse_args(argv)
    settings.out.mkdir(parents=True, exist_ok=True)
    meta: dict[str, Any] = {
        "started": datetime.now().isoformat(timespec="seconds"),
        "settings": {k: str(v) for k, v in asdict(settings).items()},
        "small_producer": SMALL_PRODUCER_SETTINGS,
        "big_producer": BIG_PRODUCER_SETTINGS,
        "librdkafka": confluent_kafka.libversion()[0],
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
        "commit": git_commit(),
    }
    stage_config = stage_settings(settings)
    stage_config.proxy_env = proxy_limits(settings.big_mb)
    meta["proxy_env"] = stage_config.proxy_env
    stage = Stage(
        stage_config,
        console,
        meta,
        "stall",
    )
    rows: list[StallRow] = []
    try:
        with stage.opened():
            run(stage, settings, rows)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]")
        return 130
    except (BenchmarkError, OSError) as exc:
        console.print(f"[red]benchmark failed:[/] {exc}", highlight=False)
        with contextlib.suppress(OSError):
            write_csv(settings.out / "stall.partial.csv", rows, COLUMNS)
        return 1
    summary = summarize(rows)
    write_csv(settings.out / "stall.csv", rows + summary, COLUMNS)
    meta["loadavg_end"] = os.getloadavg()
    (settings.out / "stall_meta.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    title = (
        f"A {settings.big_mb} MB Produce request beside a one-record-at-a-time producer "
        f"({os.cpu_count()} CPUs, {settings.rounds} rounds, {meta['started']})"
    )
    plot(settings.out / "stall.png", rows, title)
    print_summary(console, rows, summary)
    console.print(f"results in {settings.out}", highlight=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())

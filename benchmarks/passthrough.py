"""What the proxy costs a producer: the same producers direct to Kafka, through the proxy as
a pure pass-through (``--no-dedup``), and through the proxy with dedup on.

    .venv/bin/python -m benchmarks.passthrough [--quick] [--out DIR]

Throughput: for each case (record size x producer processes) the same workload runs
direct, pass-through, dedup, direct, pass-through, dedup... for R rounds, so machine noise
hits every target alike; the summary is the median per target and its ratio to direct.
Every record carries the dedup identity headers (``dedup.producer``, ``dedup.sequence``),
whatever the target, so the three see the same bytes. Latency: one producer sends one
record at a time (linger.ms=0) and waits for its delivery report, again interleaved by
rounds. Per measurement the topic's end offsets must have grown by exactly the records
sent; for the dedup target the Redis EVALSHA calls per Produce request are counted.
Results go to benchmarks/results/<timestamp>/ (or --out): a CSV, a PNG and both proxies'
logs. Timing targets are informational: the exit code is 0 whatever the figures (the
machine is shared and noisy); it is non-zero only when the benchmark itself could not run.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import functools
import json
import logging
import math
import multiprocessing as mp
import os
import platform
import queue
import signal
import socket
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from datetime import datetime
from multiprocessing.context import SpawnContext, SpawnProcess
from pathlib import Path
from typing import Any, cast

from benchmarks.errors import BenchmarkError
from benchmarks.pinning import add_pin_argument, check_pin_argument, pinned
from dedup.identity import DEFAULT_PRODUCER_HEADER, DEFAULT_SEQUENCE_HEADER
from deploy.config import HOST
from deploy.processes import port_bindable

MB = 1_000_000  # throughput is reported in decimal megabytes of record payload per second
RESULTS_DIR = Path(__file__).resolve().parent / "results"

# The three targets, in the order each round runs them.
DIRECT, PASSTHROUGH, DEDUP = "direct", "passthrough", "dedup"
TARGETS = (DIRECT, PASSTHROUGH, DEDUP)
PROXY_TARGETS = (PASSTHROUGH, DEDUP)
LABELS = {
    DIRECT: "direct to Kafka",
    PASSTHROUGH: "proxy, pass-through (--no-dedup)",
    DEDUP: "proxy, dedup on",
}
SHORT = {DIRECT: "direct", PASSTHROUGH: "pass-through", DEDUP: "dedup"}

# Targets the summary checks (informational only): throughput as a fraction of direct,
# by target and record size, and the added median latency of the pass-through.
TARGET_THROUGHPUT_RATIO = {PASSTHROUGH: {1000: 0.90, 100: 0.90}, DEDUP: {1000: 0.70, 100: 0.50}}
TARGET_ADDED_P50_MS = 1.0

# Ports of the benchmark's own proxies, away from the defaults (29092/29080) other proxies
# use and below Linux's ephemeral range (32768-60999), so no outgoing connection holds them.
DEFAULT_PORTS = {
    PASSTHROUGH: (27492, 27480, 27493),  # listen, admin, broker port base
    DEDUP: (27592, 27580, 27593),
}

# The identity headers every record carries (the proxy's defaults).
PRODUCER_HEADER = DEFAULT_PRODUCER_HEADER
SEQUENCE_HEADER = DEFAULT_SEQUENCE_HEADER

RECORD_SIZES = (1000, 100)
PRODUCER_COUNTS = (1, 4)
# Payload bytes per throughput measurement, by record size (scaled by --scale / --quick).
DEFAULT_BYTES = {1000: 200 * MB, 100: 50 * MB}
DEFAULT_ROUNDS = 3
DEFAULT_LATENCY_RECORDS = 2000
LATENCY_WARMUP = 200

QUICK_SCALE = 0.1
QUICK_ROUNDS = 2
QUICK_LATENCY_RECORDS = 200

WARMUP_PASS_BYTES = 100 * MB  # one unrecorded 1000 B measurement per target first

MEASUREMENT_TIMEOUT_S = 180.0
PORT_WAIT_S = 75.0

# Settings shared by every producer, whatever the target.
THROUGHPUT_PRODUCER_SETTINGS: dict[str, Any] = {
    "acks": "all",
    "enable.idempotence": False,
    "linger.ms": 5,
    "batch.size": 1_000_000,  # generous: the broker's default max.message.bytes is ~1 MiB
    "batch.num.messages": 100_000,  # so that 100 B records fill batches by bytes too
    "compression.type": "none",
    "delivery.report.only.error": True,  # no per-record Python callback on success
}
LATENCY_PRODUCER_SETTINGS: dict[str, Any] = {
    "acks": "all",
    "enable.idempotence": False,
    "linger.ms": 0,
    "compression.type": "none",
}


# ----------------------------------------------------------------------------- model


@dataclass(frozen=True)
class Case:
    record_bytes: int
    producers: int
    total_bytes: int

    @property
    def partitions(self) -> int:
        # One partition per producer; producer i writes partition i.
        return self.producers

    @property
    def name(self) -> str:
        noun = "producer" if self.producers == 1 else "producers"
        return f"{self.record_bytes} B x {self.producers} {noun}"

    @property
    def slug(self) -> str:
        return f"{self.record_bytes}b-x{self.producers}"

    @property
    def records_per_producer(self) -> int:
        return max(1, self.total_bytes // self.record_bytes // self.producers)

    @property
    def warmup_per_producer(self) -> int:
        return max(500, self.records_per_producer // 10)


@dataclass
class Row:
    """One CSV row: a measurement (round 1..R) or a summary (round "median" / "all")."""

    kind: str  # throughput | latency
    case: str
    record_bytes: int
    producers: int
    partitions: int
    target: str  # direct | passthrough | dedup
    round: str
    records: int = 0  # measured records (warm-up not included)
    bytes: int = 0
    seconds: float | None = None
    mb_per_s: float | None = None
    records_per_s: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    ratio_vs_direct: float | None = None
    added_p50_ms: float | None = None
    warmup_records: int = 0
    landed_records: int | None = None  # growth of the topic's end offsets (incl. warm-up)
    missing_records: int | None = None  # sent (incl. warm-up) + markers - landed: must be 0
    fence_markers: int = 0  # dedup: one transaction marker per partition recovery (fence)
    proxy_cpu_s: float | None = None  # CPU the proxy used for the whole measurement
    proxy_mb_per_cpu_s: float | None = None  # payload relayed (incl. warm-up) per CPU second
    produce_requests: int | None = None  # Produce requests the proxy received (incl. warm-up)
    redis_evalsha: int | None = None  # EVALSHA calls Redis ran meanwhile
    redis_evalsha_usec: int | None = None  # Redis' own time in those calls
    redis_commands: int | None = None  # all Redis commands meanwhile (the benchmark's INFO not)
    evalsha_per_request: float | None = None
    checked_not_dup: int | None = None  # dedup_records_total by verdict, during the measurement
    checked_dup: int | None = None
    checked_unknown: int | None = None
    errors: int = 0  # failed deliveries
    note: str = ""


CSV_COLUMNS = [f.name for f in fields(Row)]


def throughput_target(target: str, record_bytes: int) -> float:
    return TARGET_THROUGHPUT_RATIO[target][record_bytes]


# ----------------------------------------------------------------------------- workers
# Workers run in spawned processes (a fresh interpreter each: no GIL sharing, no librdkafka
# state inherited through fork). They ignore SIGINT; the parent terminates them on Ctrl-C.


def _worker_setup() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _throughput_worker(
    index: int,
    bootstrap: str,
    topic: str,
    partition: int,
    producer_name: str,
    record_bytes: int,
    records: int,
    warmup: int,
    barrier: Any,
    results: Any,
) -> None:
    _worker_setup()
    try:
        from confluent_kafka import Producer

        failures: list[str] = []

        def on_delivery(err: Any, _msg: Any) -> None:
            if err is not None:
                failures.append(str(err))

        producer = Producer(
            {
                "bootstrap.servers": bootstrap,
                "client.id": f"bench-throughput-{index}",
                "on_delivery": on_delivery,
                **THROUGHPUT_PRODUCER_SETTINGS,
            }
        )
        payload = os.urandom(record_bytes)

        def send(first_sequence: int, count: int) -> None:
            # Sequences run on from the warm-up into the measurement: one producer identity
            # per process and measurement, sequences 0, 1, 2, ... with no gap or repeat.
            produce = producer.produce
            for sequence in range(first_sequence, first_sequence + count):
                headers = {PRODUCER_HEADER: producer_name, SEQUENCE_HEADER: str(sequence)}
                while True:
                    try:
                        produce(topic, payload, partition=partition, headers=headers)
                        break
                    except BufferError:
                        producer.poll(0.005)
                if sequence % 20_000 == 0:
                    producer.poll(0)

        send(0, warmup)
        if producer.flush(MEASUREMENT_TIMEOUT_S) > 0:
            raise RuntimeError("warm-up records not delivered in time")
        warmup_failures = len(failures)
        failures.clear()
        barrier.wait(MEASUREMENT_TIMEOUT_S)
        start = time.monotonic()  # CLOCK_MONOTONIC: comparable across processes
        send(warmup, records)
        undelivered = producer.flush(MEASUREMENT_TIMEOUT_S)
        end = time.monotonic()
        results.put(
            {
                "index": index,
                "start": start,
                "end": end,
                "records": records,
                "errors": len(failures) + undelivered,
                "warmup_errors": warmup_failures,
                "error": failures[0] if failures else "",
            }
        )
    except BaseException as exc:
        with contextlib.suppress(Exception):
            barrier.abort()
        results.put({"index": index, "fatal": f"{type(exc).__name__}: {exc}"})


def _latency_worker(
    bootstrap: str,
    topic: str,
    producer_name: str,
    record_bytes: int,
    records: int,
    warmup: int,
    results: Any,
) -> None:
    _worker_setup()
    try:
        from confluent_kafka import Producer

        producer = Producer(
            {
                "bootstrap.servers": bootstrap,
                "client.id": "bench-latency",
                **LATENCY_PRODUCER_SETTINGS,
            }
        )
        payload = os.urandom(record_bytes)
        state: dict[str, Any] = {}

        def on_delivery(err: Any, _msg: Any) -> None:
            state["done"] = time.perf_counter()
            state["err"] = err

        samples: list[float] = []
        errors = 0
        first_error = ""
        for i in range(warmup + records):
            state.clear()
            headers = {PRODUCER_HEADER: producer_name, SEQUENCE_HEADER: str(i)}
            sent = time.perf_counter()
            producer.produce(topic, payload, partition=0, headers=headers, on_delivery=on_delivery)
            deadline = sent + 30.0
            while "done" not in state:
                producer.poll(1.0)
                if time.perf_counter() > deadline:
                    raise TimeoutError("no delivery report within 30 s")
            if state["err"] is not None:
                errors += 1
                first_error = first_error or str(state["err"])
            elif i >= warmup:
                samples.append(state["done"] - sent)
        producer.flush(10)
        results.put({"samples": samples, "errors": errors, "error": first_error})
    except BaseException as exc:
        results.put({"fatal": f"{type(exc).__name__}: {exc}"})


# ----------------------------------------------------------------------------- runner


class WorkerPool:
    """Spawns measurement processes and makes sure none outlives the benchmark."""

    def __init__(self) -> None:
        self.ctx: SpawnContext = mp.get_context("spawn")
        self._alive: list[SpawnProcess] = []

    def start(self, target: Any, args: tuple[Any, ...]) -> SpawnProcess:
        process = self.ctx.Process(target=target, args=args, daemon=True)
        process.start()
        self._alive.append(process)
        return process

    def collect(self, results: Any, count: int, timeout_s: float) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout_s
        answers: list[dict[str, Any]] = []
        while len(answers) < count:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BenchmarkError(f"measurement did not finish within {timeout_s:.0f} s")
            try:
                answers.append(results.get(timeout=min(left, 1.0)))
            except queue.Empty:
                if not any(p.is_alive() for p in self._alive) and results.empty():
                    raise BenchmarkError("measurement processes exited without a result") from None
        return answers

    def reap(self, timeout_s: float = 10.0) -> None:
        """Wait for processes that delivered their result to exit, then end any left."""
        deadline = time.monotonic() + timeout_s
        for process in self._alive:
            process.join(max(0.0, deadline - time.monotonic()))
        self.terminate()

    def terminate(self) -> None:
        for process in self._alive:
            if process.is_alive():
                process.terminate()
        for process in self._alive:
            process.join(5)
            if process.is_alive():
                process.kill()
                process.join()
        self._alive.clear()


def measure_throughput(
    pool: WorkerPool, bootstrap: str, topic: str, case: Case, producer_prefix: str
) -> Row:
    ctx = pool.ctx
    barrier = ctx.Barrier(case.producers)
    results = ctx.Queue()
    for index in range(case.producers):
        pool.start(
            _throughput_worker,
            (
                index,
                bootstrap,
                topic,
                index,
                f"{producer_prefix}-p{index}",
                case.record_bytes,
                case.records_per_producer,
                case.warmup_per_producer,
                barrier,
                results,
            ),
        )
    try:
        answers = pool.collect(results, case.producers, MEASUREMENT_TIMEOUT_S * 2.5)
    except BaseException:
        pool.terminate()  # Ctrl-C or a failure: do not wait for the producers to finish
        raise
    pool.reap()
    fatal = [a["fatal"] for a in answers if "fatal" in a]
    if fatal:
        raise BenchmarkError(f"producer failed: {fatal[0]}")
    seconds = max(a["end"] for a in answers) - min(a["start"] for a in answers)
    records = sum(a["records"] for a in answers)
    errors = sum(a["errors"] for a in answers)
    note = next((a["error"] for a in answers if a["error"]), "")
    warmup_errors = sum(a["warmup_errors"] for a in answers)
    if warmup_errors:
        note = f"{warmup_errors} warm-up deliveries failed; {note}".rstrip("; ")
    size = records * case.record_bytes
    return Row(
        kind="throughput",
        case=case.name,
        record_bytes=case.record_bytes,
        producers=case.producers,
        partitions=case.partitions,
        target="",
        round="",
        records=records,
        bytes=size,
        seconds=seconds,
        mb_per_s=size / MB / seconds,
        records_per_s=records / seconds,
        warmup_records=case.warmup_per_producer * case.producers,
        errors=errors,
        note=note,
    )


def measure_latency(
    pool: WorkerPool,
    bootstrap: str,
    topic: str,
    producer_name: str,
    record_bytes: int,
    records: int,
) -> tuple[list[float], int, str]:
    results = pool.ctx.Queue()
    pool.start(
        _latency_worker,
        (bootstrap, topic, producer_name, record_bytes, records, LATENCY_WARMUP, results),
    )
    try:
        (answer,) = pool.collect(results, 1, MEASUREMENT_TIMEOUT_S)
    except BaseException:
        pool.terminate()
        raise
    pool.reap()
    if "fatal" in answer:
        raise BenchmarkError(f"latency producer failed: {answer['fatal']}")
    return answer["samples"], answer["errors"], answer["error"]


def percentile(samples: list[float], fraction: float) -> float:
    """Nearest-rank percentile (samples need not be sorted)."""
    ordered = sorted(samples)
    rank = max(1, math.ceil(fraction * len(ordered)))
    return ordered[rank - 1]


# ----------------------------------------------------------------------------- Kafka


class Topics:
    """The benchmark's topics: created fresh per case, deleted afterwards."""

    def __init__(self, bootstrap: str, prefix: str) -> None:
        from confluent_kafka.admin import AdminClient

        # librdkafka's own log lines (e.g. disconnects as Kafka stops) stay out of the output;
        # failures still surface as exceptions from the admin calls.
        quiet = logging.getLogger("benchmarks.passthrough.admin")
        quiet.propagate = False
        quiet.addHandler(logging.NullHandler())
        self.admin = AdminClient({"bootstrap.servers": bootstrap}, logger=quiet)
        self.bootstrap = bootstrap
        self.prefix = prefix
        self.created: list[str] = []
        cluster = self.admin.list_topics(timeout=15)
        self.replication = 1
        self.brokers = len(cluster.brokers)

    def create(self, slug: str, partitions: int, config: dict[str, str] | None = None) -> str:
        from deploy.topics import create_topic

        topic = f"{self.prefix}-{slug}"
        self.created.append(topic)
        try:
            return create_topic(
                self.bootstrap,
                topic,
                partitions=partitions,
                replication_factor=self.replication,
                config=config,
            )
        except TimeoutError as exc:
            raise BenchmarkError(str(exc)) from exc

    def end_offsets(self, topic: str, partitions: int) -> int:
        from confluent_kafka import KafkaException, TopicPartition
        from confluent_kafka.admin import OffsetSpec

        request = {TopicPartition(topic, p): OffsetSpec.latest() for p in range(partitions)}
        deadline = time.monotonic() + 30
        while True:
            futures = self.admin.list_offsets(request, request_timeout=30)
            try:
                return sum(f.result(60).offset for f in futures.values())
            except KafkaException:
                # Right after creation a partition's leader epoch may not have reached every
                # broker's metadata yet (UNKNOWN_LEADER_EPOCH and the like): ask again.
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def delete(self, topic: str) -> None:
        with contextlib.suppress(Exception):
            self.admin.delete_topics([topic], operation_timeout=30)[topic].result(60)
        with contextlib.suppress(ValueError):
            self.created.remove(topic)

    def delete_all(self) -> None:
        for topic in list(self.created):
            self.delete(topic)


# ----------------------------------------------------------------------------- probes


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc; 0 where unavailable)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    parts = stat.rpartition(")")[2].split()
    # After the command name: state is field 3, utime 14 and stime 15 (1-based).
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text: sample name with its labels (as printed) -> value."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        with contextlib.suppress(ValueError):
            samples[name] = float(value)
    return samples


PRODUCE_REQUESTS = 'dedup_proxy_requests_total{api="produce"}'
PRODUCE_REQUEST_BYTES = 'dedup_proxy_bytes_total{api="produce",direction="request"}'
VERDICTS = ("not_dup", "dup", "unknown")


def verdict_metric(verdict: str) -> str:
    return f'dedup_records_total{{verdict="{verdict}"}}'


RECOVERIES = 'dedup_recoveries_total{result="ok"}'


class RedisStats:
    """Commands Redis ran, from INFO commandstats (cumulative since Redis started)."""

    def __init__(self, url: str) -> None:
        import redis

        self.client = redis.Redis.from_url(url, socket_timeout=10)
        self.client.ping()

    def cpu_seconds(self) -> float:
        """Redis' own CPU so far (INFO cpu: used_cpu_sys + used_cpu_user, all threads)."""
        stats = cast(dict[str, Any], self.client.info("cpu"))
        return float(stats["used_cpu_sys"]) + float(stats["used_cpu_user"])

    def snapshot(self) -> dict[str, tuple[int, int]]:
        """command -> (calls, usec)."""
        stats = self.client.info("commandstats")
        return {
            name.removeprefix("cmdstat_"): (int(v.get("calls", 0)), int(v.get("usec", 0)))
            for name, v in stats.items()
        }

    def delete_prefix(self, prefix: str) -> int:
        """Remove every key under `prefix:` (the benchmark's dedup state and policies)."""
        removed = 0
        batch: list[bytes] = []
        for key in self.client.scan_iter(match=f"{prefix}:*", count=1000):
            batch.append(key)
            if len(batch) >= 500:
                removed += int(self.client.delete(*batch))
                batch.clear()
        if batch:
            removed += int(self.client.delete(*batch))
        return removed


@dataclass
class ProxyTarget:
    """One of the benchmark's proxies and what it relayed."""

    target: str
    process: Any  # deploy.launcher.ProxyProcess
    key_prefix: str
    ports: tuple[int, int, int]
    relayed_payload_bytes: int = 0


@dataclass
class Snapshot:
    offsets: int
    cpu_s: float = 0.0
    metrics: dict[str, float] | None = None
    redis: dict[str, tuple[int, int]] | None = None


def take_snapshot(
    topics: Topics,
    topic: str,
    partitions: int,
    proxy: ProxyTarget | None,
    redis_stats: RedisStats | None,
) -> Snapshot:
    snap = Snapshot(topics.end_offsets(topic, partitions))
    if proxy is not None:
        snap.cpu_s = process_cpu_seconds(proxy.process.pid)
        snap.metrics = parse_metrics(proxy.process.metrics_text())
        if redis_stats is not None:
            snap.redis = redis_stats.snapshot()
    return snap


def record_deltas(row: Row, before: Snapshot, after: Snapshot, proxy: ProxyTarget | None) -> None:
    """Fill the row's per-measurement checks from the snapshots around it."""
    row.landed_records = after.offsets - before.offsets
    row.missing_records = row.records + row.warmup_records - row.landed_records
    if proxy is None or before.metrics is None or after.metrics is None:
        return
    relayed = row.bytes + row.warmup_records * row.record_bytes
    row.proxy_cpu_s = after.cpu_s - before.cpu_s
    if row.proxy_cpu_s > 0:
        row.proxy_mb_per_cpu_s = relayed / MB / row.proxy_cpu_s

    metrics_before, metrics_after = before.metrics, after.metrics

    def delta(name: str) -> int:
        return round(metrics_after.get(name, 0.0) - metrics_before.get(name, 0.0))

    row.produce_requests = delta(PRODUCE_REQUESTS)
    if proxy.target == DEDUP:
        # Each recovery fences its partition with a transaction marker: one offset, no record.
        row.fence_markers = delta(RECOVERIES)
        row.missing_records += row.fence_markers
        row.checked_not_dup = delta(verdict_metric("not_dup"))
        row.checked_dup = delta(verdict_metric("dup"))
        row.checked_unknown = delta(verdict_metric("unknown"))
    if before.redis is not None and after.redis is not None:
        calls = {
            name: after.redis[name][0] - before.redis.get(name, (0, 0))[0] for name in after.redis
        }
        row.redis_evalsha = calls.get("evalsha", 0)
        row.redis_evalsha_usec = (
            after.redis.get("evalsha", (0, 0))[1] - before.redis.get("evalsha", (0, 0))[1]
        )
        # INFO is the benchmark's own probe, not the proxy's work.
        row.redis_commands = sum(count for name, count in calls.items() if name != "info")
        if row.produce_requests:
            row.evalsha_per_request = row.redis_evalsha / row.produce_requests


def check_row(row: Row, meta: dict[str, Any]) -> None:
    """Note a measurement whose records did not all land, or that dedup did not check."""
    oddities: list[str] = meta.setdefault("oddities", [])
    what = f"{row.case} round {row.round} {row.target}"
    sent = row.records + row.warmup_records
    failed = False
    if row.landed_records is not None and row.landed_records != sent + row.fence_markers:
        failed = True
        lost = ""
        if row.landed_records < sent and row.errors == 0:
            lost = ", every delivery reported success: records lost"
        oddities.append(
            f"{what}: the topic grew by {row.landed_records:,} records, {sent:,} were sent "
            f"({row.errors} failed deliveries{lost})"
        )
    verdicts = (row.checked_not_dup, row.checked_dup, row.checked_unknown)
    if row.target == DEDUP and verdicts != (sent, 0, 0):
        failed = True
        oddities.append(
            f"{what}: dedup verdicts not_dup={verdicts[0]} dup={verdicts[1]} "
            f"unknown={verdicts[2]} for {sent:,} records sent, every sequence new (expected "
            f"not_dup={sent} dup=0 unknown=0)"
        )
    meta["failed_checks"] = meta.get("failed_checks", 0) + int(failed)


# ----------------------------------------------------------------------------- proxies


def port_listening(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def start_proxy(proxy: Any, ports: Iterable[int], say: Any, attempts: int = 5) -> None:
    """Start the proxy, retrying while one of its ports is held by another socket.
    The last port is the broker listener's, which opens after the first metadata answer."""
    ports = list(ports)
    for attempt in range(1, attempts + 1):
        deadline = time.monotonic() + PORT_WAIT_S
        if not all(port_bindable(HOST, p) for p in ports):
            busy = [p for p in ports if not port_bindable(HOST, p)]
            say(f"port(s) {busy} held by another socket; waiting up to {PORT_WAIT_S:.0f} s")
        while not all(port_bindable(HOST, p) for p in ports) and time.monotonic() < deadline:
            time.sleep(0.5)
        busy = [p for p in ports if not port_bindable(HOST, p)]
        if busy:
            raise BenchmarkError(f"port(s) {busy} in use: choose others (see --help)")
        try:
            proxy.start()
        except (RuntimeError, TimeoutError) as exc:
            proxy.stop()
            if attempt == attempts:
                raise BenchmarkError(f"the proxy did not start: {exc}") from exc
            time.sleep(1)
            continue
        deadline = time.monotonic() + 10
        while not port_listening(ports[-1]) and time.monotonic() < deadline:
            time.sleep(0.2)
        if port_listening(ports[-1]):
            return
        proxy.stop()
        if attempt == attempts:
            raise BenchmarkError(f"the proxy opened no broker listener on port {ports[-1]}")


@dataclass
class Environment:
    bootstrap: str
    redis: str
    description: str
    stop_on_exit: bool = False


def open_environment(bootstrap: str | None, redis_url: str | None, keep_env: bool) -> Environment:
    if bootstrap:
        assert redis_url is not None  # parse_args requires --redis with --bootstrap
        return Environment(bootstrap, redis_url, f"external Kafka at {bootstrap}")
    from deploy.local import LocalEnvironment

    env = LocalEnvironment()
    status = env.status()
    nodes = status.get("nodes", {})
    redis_running = status.get("redis_process", {}).get("running", False)
    was_running = any(n["running"] for n in nodes.values()) or redis_running
    # Keep the recorded cluster shape: a different broker count would recreate the cluster.
    brokers = len(nodes) if status.get("created") and nodes else 1
    try:
        info = env.up(brokers=brokers)
    except BaseException:  # Ctrl-C or a failed start: leave the environment as it was
        if not was_running and not keep_env:
            with contextlib.suppress(Exception):
                env.down()
        raise
    how = "already running" if was_running else "started by the benchmark"
    return Environment(
        info.bootstrap,
        redis_url or info.redis,
        f"local environment ({brokers} broker(s), {how}) at {info.bootstrap}, "
        f"Redis {info.redis}, home {env.home}",
        stop_on_exit=not was_running and not keep_env,
    )


def close_environment(environment: Environment) -> None:
    if environment.stop_on_exit:
        from deploy.local import LocalEnvironment

        LocalEnvironment().down()


def make_proxies(
    ports: Mapping[str, tuple[int, int, int]],
    out: Path,
    environment: Environment,
    run_id: str,
    extra_env: Mapping[str, str] | None = None,
) -> list[ProxyTarget]:
    """The pass-through and the dedup proxy (not started), on `ports[target]`
    (LISTEN, ADMIN, BROKER_BASE), logging to `out`/proxy-<target>.log."""
    from deploy.launcher import ProxyProcess

    proxies = []
    for target in PROXY_TARGETS:
        listen, admin, broker_base = ports[target]
        # Both proxies get the run's Redis and a key prefix of their own: no policy or state
        # left by anything else can switch dedup on or off under the benchmark, and the
        # pass-through proxy does not reach for the default Redis (its policy store reads it).
        key_prefix = f"bench-{target}-{run_id}"
        extra = ["--broker-port-base", str(broker_base)]
        if target == PASSTHROUGH:
            extra.append("--no-dedup")
        process = ProxyProcess(
            upstream=environment.bootstrap,
            listen_port=listen,
            admin_port=admin,
            log_path=out / f"proxy-{target}.log",
            extra_args=extra,
            env={
                "DEDUP_PROXY_REDIS": environment.redis,
                "DEDUP_PROXY_REDIS_KEY_PREFIX": key_prefix,
                **(extra_env or {}),
            },
        )
        proxies.append(ProxyTarget(target, process, key_prefix, (listen, admin, broker_base)))
    return proxies


# ----------------------------------------------------------------------------- run


@dataclass
class Settings:
    out: Path
    rounds: int
    scale: float
    latency_records: int
    bootstrap: str | None
    redis: str | None
    keep_env: bool
    ports: dict[str, tuple[int, int, int]]
    quick: bool
    pin: bool = False  # `benchmarks.pinning`


class Progress:
    def __init__(self, console: Any, total: int) -> None:
        self.console = console
        self.total = total
        self.done = 0
        self.started = time.monotonic()

    def line(self, text: str) -> None:
        self.done += 1
        width = len(str(self.total))
        elapsed = time.monotonic() - self.started
        self.console.print(
            f"[dim]{elapsed:6.1f}s[/] [{self.done:>{width}}/{self.total}] {text}",
            highlight=False,
        )


def build_cases(scale: float) -> list[Case]:
    return [
        Case(size, producers, max(size * producers * 100, int(DEFAULT_BYTES[size] * scale)))
        for size in RECORD_SIZES
        for producers in PRODUCER_COUNTS
    ]


def run(settings: Settings, console: Any, rows: list[Row], meta: dict[str, Any]) -> None:
    cases = build_cases(settings.scale)
    per_round = len(cases) + len(RECORD_SIZES)
    total = per_round * settings.rounds * len(TARGETS)
    for target in PROXY_TARGETS:
        for port in settings.ports[target]:
            if port_listening(port):
                raise BenchmarkError(
                    f"port {port} has a listener (another proxy?): choose other ports "
                    f"(--{target}-ports LISTEN,ADMIN,BROKER_BASE)"
                )
    oddities: list[str] = meta.setdefault("oddities", [])
    meta["failed_checks"] = 0

    console.print("bringing up Kafka and Redis ...", highlight=False)
    environment = open_environment(settings.bootstrap, settings.redis, settings.keep_env)
    meta["environment"] = environment.description
    meta["redis"] = environment.redis
    console.print(environment.description, highlight=False)
    run_id = f"{os.getpid()}-{int(time.time())}"
    pool = WorkerPool()
    topics: Topics | None = None
    redis_stats: RedisStats | None = None
    proxies = make_proxies(settings.ports, settings.out, environment, run_id)
    by_target: dict[str, ProxyTarget] = {p.target: p for p in proxies}
    pinning = contextlib.ExitStack()
    try:
        redis_stats = RedisStats(environment.redis)
        topics = Topics(environment.bootstrap, f"bench-passthrough-{run_id}")
        meta["brokers"] = topics.brokers
        for proxy in proxies:
            start_proxy(
                proxy.process,
                proxy.ports,
                lambda text: console.print(f"[yellow]{text}[/]", highlight=False),
            )
            console.print(
                f"{LABELS[proxy.target]}: pid {proxy.process.pid} on {proxy.process.bootstrap} "
                f"(brokers from port {proxy.ports[2]}), Redis key prefix {proxy.key_prefix}, "
                f"log {proxy.process.log_path}",
                highlight=False,
            )
        if settings.pin:
            pids = [proxy.process.pid for proxy in proxies]
            say = functools.partial(console.print, highlight=False)
            meta["pinning"] = pinning.enter_context(pinned(pids, say)).describe()
        meta["proxies"] = {
            p.target: {
                "bootstrap": p.process.bootstrap,
                "admin": p.process.admin_url,
                "broker_port_base": p.ports[2],
                "args": p.process.extra_args,
                "redis_key_prefix": p.key_prefix,
            }
            for p in proxies
        }
        bootstraps = {DIRECT: environment.bootstrap}
        bootstraps.update({p.target: p.process.bootstrap for p in proxies})
        progress = Progress(console, total)

        def measured(target: str, topic: str, partitions: int, measure: Callable[[], Row]) -> Row:
            """Run one measurement with the per-measurement probes around it."""
            assert topics is not None
            proxy = by_target.get(target)
            stats = redis_stats if target == DEDUP else None
            before = take_snapshot(topics, topic, partitions, proxy, stats)
            row = measure()
            after = take_snapshot(topics, topic, partitions, proxy, stats)
            record_deltas(row, before, after, proxy)
            if proxy is not None:
                proxy.relayed_payload_bytes += row.bytes + row.warmup_records * row.record_bytes
            return row

        # A freshly started Kafka runs its first seconds on a cold JVM: without this pass
        # the first direct measurement of the first case would pay for it alone. It also
        # warms both proxies (imports, upstream connections, the dedup scripts in Redis).
        warmup_case = Case(1000, 1, max(1000 * 100, int(WARMUP_PASS_BYTES * settings.scale)))
        topic = topics.create("warmup", 1)
        for target in TARGETS:
            row = measured(
                target,
                topic,
                1,
                lambda t=target, topic=topic: measure_throughput(
                    pool, bootstraps[t], topic, warmup_case, f"bench-{run_id}-warmup-{t}"
                ),
            )
            row.target, row.round = target, "warm-up"
            check_row(row, meta)
            console.print(
                f"[dim]warm-up pass, not recorded: {SHORT[target]:<12} {row.mb_per_s:8.1f} MB/s[/]",
                highlight=False,
            )
        topics.delete(topic)

        for case in cases:
            topic = topics.create(case.slug, case.partitions)
            for round_no in range(1, settings.rounds + 1):
                for target in TARGETS:
                    name = f"bench-{run_id}-{case.slug}-{target}-r{round_no}"
                    row = measured(
                        target,
                        topic,
                        case.partitions,
                        lambda t=target, n=name, topic=topic, case=case: measure_throughput(
                            pool, bootstraps[t], topic, case, n
                        ),
                    )
                    row.target, row.round = target, str(round_no)
                    rows.append(row)
                    check_row(row, meta)
                    progress.line(
                        f"{case.name:<22} round {round_no}/{settings.rounds}  "
                        f"{SHORT[target]:<12} {row.mb_per_s:8.1f} MB/s "
                        f"{row.records_per_s:>11,.0f} rec/s {row.seconds:6.2f} s"
                        + extra_progress(row)
                    )
            topics.delete(topic)

        for size in RECORD_SIZES:
            topic = topics.create(f"latency-{size}b", 1)
            for round_no in range(1, settings.rounds + 1):
                for target in TARGETS:
                    name = f"bench-{run_id}-latency-{size}b-{target}-r{round_no}"
                    result: dict[str, Any] = {}

                    def latency(
                        t: str = target,
                        n: str = name,
                        topic: str = topic,
                        size: int = size,
                        out: dict[str, Any] = result,
                    ) -> Row:
                        samples, errors, first_error = measure_latency(
                            pool, bootstraps[t], topic, n, size, settings.latency_records
                        )
                        out["samples"] = samples
                        row = latency_row(size, t, "", samples, errors, first_error)
                        row.warmup_records = LATENCY_WARMUP
                        return row

                    row = measured(target, topic, 1, latency)
                    row.round = str(round_no)
                    rows.append(row)
                    check_row(row, meta)
                    progress.line(
                        f"{row.case:<22} round {round_no}/{settings.rounds}  "
                        f"{SHORT[target]:<12} p50 {row.p50_ms:6.3f} ms  p99 {row.p99_ms:6.3f} ms "
                        f"({row.records} records)" + extra_progress(row)
                    )
                    meta.setdefault("latency_samples", {}).setdefault(
                        f"{size}:{target}", []
                    ).extend(result["samples"])
            topics.delete(topic)

        sanity: dict[str, Any] = {}
        for proxy in proxies:
            with contextlib.suppress(Exception):
                samples = parse_metrics(proxy.process.metrics_text())
                relayed = samples.get(PRODUCE_REQUEST_BYTES)
                sanity[proxy.target] = {
                    "produce_request_bytes": relayed,
                    "payload_bytes_sent": proxy.relayed_payload_bytes,
                    **{f"dedup_records_{v}": samples.get(verdict_metric(v)) for v in VERDICTS},
                }
                if relayed is not None and relayed < proxy.relayed_payload_bytes:
                    oddities.append(
                        f"the {SHORT[proxy.target]} proxy saw {relayed / MB:.1f} MB of Produce "
                        f"requests, less than the {proxy.relayed_payload_bytes / MB:.1f} MB of "
                        f"payload sent through it"
                    )
                if proxy.target == PASSTHROUGH and samples.get(verdict_metric("not_dup")):
                    oddities.append("the pass-through proxy checked records for duplicates")
        meta["sanity"] = sanity
    finally:
        pinning.close()
        pool.terminate()
        for proxy in proxies:
            code = proxy.process.stop()
            if code not in (0, None):
                oddities.append(f"the {SHORT[proxy.target]} proxy exited with code {code}")
        if topics is not None:
            topics.delete_all()
        if redis_stats is not None:
            for proxy in proxies:
                with contextlib.suppress(Exception):
                    redis_stats.delete_prefix(proxy.key_prefix)
            with contextlib.suppress(Exception):
                redis_stats.client.close()
        close_environment(environment)


def extra_progress(row: Row) -> str:
    text = ""
    if row.evalsha_per_request is not None:
        text += f"  {row.evalsha_per_request:.2f} EVALSHA/request"
    if row.errors:
        text += f"  [red]{row.errors} errors: {row.note}[/]"
    sent = row.records + row.warmup_records
    if row.landed_records is not None and row.landed_records != sent + row.fence_markers:
        text += f"  [red]{row.landed_records} of {sent} records landed[/]"
    if row.checked_dup or row.checked_unknown:
        text += f"  [red]dup {row.checked_dup} unknown {row.checked_unknown}[/]"
    return text


def latency_row(
    size: int, target: str, round_label: str, samples: list[float], errors: int, note: str
) -> Row:
    return Row(
        kind="latency",
        case=f"latency {size} B",
        record_bytes=size,
        producers=1,
        partitions=1,
        target=target,
        round=round_label,
        records=len(samples),
        bytes=len(samples) * size,
        seconds=sum(samples),
        p50_ms=percentile(samples, 0.50) * 1000 if samples else None,
        p99_ms=percentile(samples, 0.99) * 1000 if samples else None,
        errors=errors,
        note=note,
    )


def _median_or_none(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _sum_or_none(values: Iterable[int | None]) -> int | None:
    present = [v for v in values if v is not None]
    return sum(present) if present else None


def _pool_redis(summary: Row, runs: list[Row]) -> None:
    """Redis and request counts of a summary row: totals over its rounds, EVALSHA per
    request as total / total (so a short round does not weigh as much as a long one)."""
    summary.produce_requests = _sum_or_none(r.produce_requests for r in runs)
    summary.redis_evalsha = _sum_or_none(r.redis_evalsha for r in runs)
    summary.redis_evalsha_usec = _sum_or_none(r.redis_evalsha_usec for r in runs)
    summary.redis_commands = _sum_or_none(r.redis_commands for r in runs)
    summary.checked_not_dup = _sum_or_none(r.checked_not_dup for r in runs)
    summary.checked_dup = _sum_or_none(r.checked_dup for r in runs)
    summary.checked_unknown = _sum_or_none(r.checked_unknown for r in runs)
    summary.landed_records = _sum_or_none(r.landed_records for r in runs)
    summary.missing_records = _sum_or_none(r.missing_records for r in runs)
    summary.warmup_records = sum(r.warmup_records for r in runs)
    if summary.redis_evalsha is not None and summary.produce_requests:
        summary.evalsha_per_request = summary.redis_evalsha / summary.produce_requests


def summarize(rows: list[Row], meta: dict[str, Any]) -> list[Row]:
    """Median throughput per case and target (with ratio to direct), pooled latency per size."""
    summary: list[Row] = []
    measured = [r for r in rows if r.kind == "throughput"]
    for case in dict.fromkeys(r.case for r in measured):
        medians: dict[str, Row] = {}
        for target in TARGETS:
            runs = [r for r in measured if r.case == case and r.target == target]
            if not runs:
                continue
            good = [r for r in runs if r.errors == 0] or runs
            first = runs[0]
            medians[target] = row = Row(
                kind="throughput",
                case=case,
                record_bytes=first.record_bytes,
                producers=first.producers,
                partitions=first.partitions,
                target=target,
                round="median",
                records=int(statistics.median(r.records for r in good)),
                bytes=int(statistics.median(r.bytes for r in good)),
                seconds=statistics.median(r.seconds or 0.0 for r in good),
                mb_per_s=statistics.median(r.mb_per_s or 0.0 for r in good),
                records_per_s=statistics.median(r.records_per_s or 0.0 for r in good),
                proxy_cpu_s=_median_or_none(r.proxy_cpu_s for r in good),
                proxy_mb_per_cpu_s=_median_or_none(r.proxy_mb_per_cpu_s for r in good),
                errors=sum(r.errors for r in runs),
                note=f"median of {len(good)} rounds; counts summed over {len(runs)}",
            )
            _pool_redis(row, runs)
        direct = medians.get(DIRECT)
        for target in PROXY_TARGETS:
            if direct is not None and direct.mb_per_s and target in medians:
                medians[target].ratio_vs_direct = (medians[target].mb_per_s or 0.0) / (
                    direct.mb_per_s
                )
        summary += medians.values()
    samples = meta.get("latency_samples", {})
    for size in RECORD_SIZES:
        pooled: dict[str, Row] = {}
        for target in TARGETS:
            values = samples.get(f"{size}:{target}", [])
            if not values:
                continue
            runs = [
                r
                for r in rows
                if r.kind == "latency" and r.record_bytes == size and r.target == target
            ]
            errors = sum(r.errors for r in runs)
            row = latency_row(size, target, "all", values, errors, "all rounds pooled")
            _pool_redis(row, runs)
            pooled[target] = row
        direct = pooled.get(DIRECT)
        if direct is not None and direct.p50_ms is not None:
            for target in PROXY_TARGETS:
                if target in pooled:
                    pooled[target].added_p50_ms = (pooled[target].p50_ms or 0.0) - direct.p50_ms
        summary += pooled.values()
    return summary


# ----------------------------------------------------------------------------- output


def write_csv(path: Path, rows: Sequence[Any], columns: Sequence[str] = CSV_COLUMNS) -> None:
    """One line per row (dataclass instances with `columns` as fields); floats to 6 digits."""
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(columns))
        writer.writeheader()
        for row in rows:
            record = asdict(row)
            for key, value in record.items():
                if value is None:
                    record[key] = ""
                elif isinstance(value, float):
                    record[key] = f"{value:.6g}" if key != "seconds" else f"{value:.4f}"
            writer.writerow(record)


COLORS = {DIRECT: "#4c72b0", PASSTHROUGH: "#dd8452", DEDUP: "#55a868"}
BAR_WIDTH = 0.27


def _offsets() -> dict[str, float]:
    middle = (len(TARGETS) - 1) / 2
    return {t: (i - middle) * BAR_WIDTH for i, t in enumerate(TARGETS)}


def plot(path: Path, rows: list[Row], summary: list[Row], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(2, 2, figsize=(14, 10))
    for size, ax in zip(RECORD_SIZES, axes[0], strict=True):
        _plot_throughput(ax, size, rows, summary)
    for stat, ax in zip(("p50", "p99"), axes[1], strict=True):
        _plot_latency(ax, stat, summary)
    handles: list[Any] = [Patch(color=COLORS[t], label=LABELS[t]) for t in TARGETS]
    handles.append(
        Line2D([], [], marker="o", color="black", linestyle="", markersize=4, label="rounds")
    )
    fig.legend(handles=handles, loc="upper center", ncol=4, bbox_to_anchor=(0.5, 0.955))
    fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _ratio_color(met: bool) -> str:
    return "green" if met else "red"


def _mb(value: float | None) -> str:
    value = value or 0.0
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def _plot_throughput(ax: Any, size: int, rows: list[Row], summary: list[Row]) -> None:
    medians = [r for r in summary if r.kind == "throughput" and r.record_bytes == size]
    runs = [r for r in rows if r.kind == "throughput" and r.record_bytes == size]
    cases = list(dict.fromkeys(r.case for r in medians))
    top = max((r.mb_per_s or 0.0 for r in runs), default=1.0) or 1.0
    for target, offset in _offsets().items():
        for i, case in enumerate(cases):
            median = next((r for r in medians if r.case == case and r.target == target), None)
            if median is None:
                continue
            x = i + offset
            ax.bar(x, median.mb_per_s or 0.0, BAR_WIDTH, color=COLORS[target])
            points = [r.mb_per_s for r in runs if r.case == case and r.target == target]
            ax.scatter([x] * len(points), points, s=14, color="black", zorder=3)
    for i, case in enumerate(cases):
        values = [
            f"{SHORT[target].split('-')[0]} {_mb(row.mb_per_s)}"
            for target in TARGETS
            for row in medians
            if row.case == case and row.target == target
        ]
        lines = [(" · ".join(values) + " MB/s", "black")]
        for target in PROXY_TARGETS:
            row = next((r for r in medians if r.case == case and r.target == target), None)
            if row is None or row.ratio_vs_direct is None:
                continue
            goal = throughput_target(target, size)
            met = row.ratio_vs_direct >= goal and not row.errors and not row.missing_records
            text = f"{SHORT[target]}/direct {row.ratio_vs_direct:.0%} (target >= {goal:.0%})"
            lines.append((text, _ratio_color(met)))
            if row.missing_records:
                lines.append((f"{SHORT[target]}: {row.missing_records:,} records LOST", "red"))
        for line_no, (text, color) in enumerate(lines):
            ax.annotate(
                text,
                (i, top * 1.05),
                xytext=(0, 12 * (len(lines) - 1 - line_no)),
                textcoords="offset points",
                ha="center",
                fontsize=9,
                color=color,
            )
    producers = [next(r.producers for r in medians if r.case == c) for c in cases]
    ax.set_xticks(
        range(len(cases)),
        [
            f"{p} producer{'s' if p > 1 else ''}\n({p} partition{'s' if p > 1 else ''})"
            for p in producers
        ],
    )
    ax.set_xlim(-0.6, len(cases) - 0.4)
    ax.set_ylim(0, top * 1.4)
    ax.set_ylabel("MB/s of record payload (10^6 B/s), median")
    ax.set_title(f"Throughput, {size} B records (acks=all, linger.ms=5), median", fontsize=10)
    ax.grid(axis="y", alpha=0.3)


def _plot_latency(ax: Any, stat: str, summary: list[Row]) -> None:
    pooled = [r for r in summary if r.kind == "latency"]
    top = max((getattr(r, f"{stat}_ms") or 0.0 for r in pooled), default=1.0) or 1.0
    for target, offset in _offsets().items():
        values = []
        for size in RECORD_SIZES:
            row = next((r for r in pooled if r.record_bytes == size and r.target == target), None)
            values.append((getattr(row, f"{stat}_ms") if row else None) or 0.0)
        xs = [i + offset for i in range(len(RECORD_SIZES))]
        bars = ax.bar(xs, values, BAR_WIDTH, color=COLORS[target])
        ax.bar_label(bars, fmt="%.3f", padding=2, fontsize=8)
    for i, size in enumerate(RECORD_SIZES):
        direct = next((r for r in pooled if r.record_bytes == size and r.target == DIRECT), None)
        if direct is None:
            continue
        lines = []
        for target in PROXY_TARGETS:
            row = next((r for r in pooled if r.record_bytes == size and r.target == target), None)
            if row is None:
                continue
            added = (getattr(row, f"{stat}_ms") or 0.0) - (getattr(direct, f"{stat}_ms") or 0.0)
            color = "black"
            text = f"{SHORT[target]}: added {added:+.3f} ms"
            if stat == "p50" and target == PASSTHROUGH:
                color = _ratio_color(added <= TARGET_ADDED_P50_MS)
                text += f" (<= {TARGET_ADDED_P50_MS:g})"
            lines.append((text, color))
        for line_no, (text, color) in enumerate(lines):
            ax.annotate(
                text,
                (i, top * 1.08),
                xytext=(0, 12 * (len(lines) - 1 - line_no)),
                textcoords="offset points",
                ha="center",
                fontsize=9,
                color=color,
            )
    ax.set_xticks(range(len(RECORD_SIZES)), [f"{size} B records" for size in RECORD_SIZES])
    ax.set_xlim(-0.6, len(RECORD_SIZES) - 0.4)
    ax.set_ylim(0, top * 1.3)
    ax.set_ylabel(f"{stat} ms, produce to delivery report")
    ax.set_title(
        f"Latency {stat}, one record at a time (linger.ms=0, acks=all), all rounds pooled",
        fontsize=10,
    )
    ax.grid(axis="y", alpha=0.3)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_summary(console: Any, summary: list[Row], meta: dict[str, Any]) -> None:
    from rich.table import Table

    def verdict(ok: bool) -> str:
        return "[green]met[/]" if ok else "[red]not met[/]"

    def pick(rows: list[Row], target: str, **match: Any) -> Row | None:
        return next(
            (
                r
                for r in rows
                if r.target == target and all(getattr(r, k) == v for k, v in match.items())
            ),
            None,
        )

    medians = [r for r in summary if r.kind == "throughput"]
    throughput = Table(
        title="Throughput (median of rounds, MB/s of record payload)",
        caption="producer i writes partition i; targets: pass-through >= 90 % of direct, "
        "dedup >= 70 % (1000 B) / 50 % (100 B)",
    )
    for column in (
        "case",
        "direct",
        "pass-through",
        "pass/direct",
        "dedup",
        "dedup/direct",
        "pass-through target",
        "dedup target",
    ):
        throughput.add_column(column, justify="left" if column == "case" else "right")
    met_all = {PASSTHROUGH: True, DEDUP: True}
    for case in dict.fromkeys(r.case for r in medians):
        direct = pick(medians, DIRECT, case=case)
        cells: dict[str, tuple[str, str, str]] = {}
        for target in PROXY_TARGETS:
            row = pick(medians, target, case=case)
            if row is None or direct is None:
                cells[target] = ("-", "-", "-")
                met_all[target] = False
                continue
            ratio = row.ratio_vs_direct or 0.0
            errors = row.errors + direct.errors
            missing = row.missing_records or 0
            met = ratio >= throughput_target(target, row.record_bytes) and not errors
            met &= not missing
            met_all[target] &= met
            flags = " (errors)" if errors else ""
            flags += f" ({missing:,} records missing)" if missing else ""
            cells[target] = (f"{row.mb_per_s:.1f}", f"{ratio:.1%}", verdict(met) + flags)
        throughput.add_row(
            case,
            _fmt(direct.mb_per_s if direct else None, ".1f"),
            cells[PASSTHROUGH][0],
            cells[PASSTHROUGH][1],
            cells[DEDUP][0],
            cells[DEDUP][1],
            cells[PASSTHROUGH][2],
            cells[DEDUP][2],
        )
    console.print(throughput)

    cost = Table(
        title="What the proxy spends (throughput cases, warm-up included)",
        caption="MB per CPU-s: payload relayed per second of the proxy's own CPU (median of "
        "rounds); requests, records and Redis calls summed over the rounds. Each producer "
        "writes one partition, so a Produce request carries one partition batch",
    )
    cost.add_column("case", no_wrap=True)
    for column in (
        "pass MB per CPU-s",
        "dedup MB per CPU-s",
        "dedup Produce requests",
        "records per request",
        "EVALSHA per request",
        "Redis µs per EVALSHA",
        "dup / unknown",
    ):
        cost.add_column(column, justify="right")
    for case in dict.fromkeys(r.case for r in medians):
        passthrough = pick(medians, PASSTHROUGH, case=case)
        dedup = pick(medians, DEDUP, case=case)
        requests = dedup.produce_requests if dedup else None
        records_per_request = None
        usec_per_call = None
        if dedup is not None and requests and dedup.checked_not_dup is not None:
            records_per_request = (
                dedup.checked_not_dup + (dedup.checked_dup or 0) + (dedup.checked_unknown or 0)
            ) / requests
        if dedup is not None and dedup.redis_evalsha and dedup.redis_evalsha_usec is not None:
            usec_per_call = dedup.redis_evalsha_usec / dedup.redis_evalsha
        bad = dedup is not None and bool(dedup.checked_dup or dedup.checked_unknown)
        cost.add_row(
            case,
            _fmt(passthrough.proxy_mb_per_cpu_s if passthrough else None, ".0f"),
            _fmt(dedup.proxy_mb_per_cpu_s if dedup else None, ".0f"),
            _fmt(requests, ","),
            _fmt(records_per_request, ",.0f"),
            _fmt(dedup.evalsha_per_request if dedup else None, ".3f"),
            _fmt(usec_per_call, ".1f"),
            ("[red]" if bad else "")
            + (f"{dedup.checked_dup} / {dedup.checked_unknown}" if dedup else "-")
            + ("[/]" if bad else ""),
        )
    console.print(cost)

    latency = Table(
        title="Latency per record (all rounds pooled, ms)",
        caption="target: pass-through added p50 <= 1 ms; the dedup figures are informational",
    )
    for column in (
        "record size",
        "direct p50",
        "pass p50",
        "dedup p50",
        "pass added",
        "dedup added",
        "direct p99",
        "pass p99",
        "dedup p99",
        "dedup EVALSHA per req",
        "target",
    ):
        latency.add_column(column, justify="right")
    pooled = [r for r in summary if r.kind == "latency"]
    latency_met = True
    for size in RECORD_SIZES:
        direct = pick(pooled, DIRECT, record_bytes=size)
        passthrough = pick(pooled, PASSTHROUGH, record_bytes=size)
        dedup = pick(pooled, DEDUP, record_bytes=size)
        if direct is None or passthrough is None:
            latency_met = False
            continue
        met = (passthrough.added_p50_ms or 0.0) <= TARGET_ADDED_P50_MS
        latency_met &= met
        latency.add_row(
            f"{size} B",
            _fmt(direct.p50_ms, ".3f"),
            _fmt(passthrough.p50_ms, ".3f"),
            _fmt(dedup.p50_ms if dedup else None, ".3f"),
            _fmt(passthrough.added_p50_ms, "+.3f"),
            _fmt(dedup.added_p50_ms if dedup else None, "+.3f"),
            _fmt(direct.p99_ms, ".3f"),
            _fmt(passthrough.p99_ms, ".3f"),
            _fmt(dedup.p99_ms if dedup else None, ".3f"),
            _fmt(dedup.evalsha_per_request if dedup else None, ".3f"),
            verdict(met),
        )
    console.print(latency)
    console.print(
        f"pass-through throughput >= 90% of direct in every case: {verdict(met_all[PASSTHROUGH])}",
        highlight=False,
    )
    console.print(
        f"dedup throughput >= 70% of direct at 1000 B and >= 50% at 100 B: "
        f"{verdict(met_all[DEDUP])}",
        highlight=False,
    )
    console.print(
        f"pass-through added median latency <= {TARGET_ADDED_P50_MS:g} ms for every record "
        f"size: {verdict(latency_met)}",
        highlight=False,
    )
    console.print(
        "[dim]informational: the machine is shared and noisy, the exit code does not depend "
        "on these figures[/]"
    )
    for target, figures in meta.get("sanity", {}).items():
        relayed = figures.get("produce_request_bytes")
        if relayed is not None:
            console.print(
                f"[dim]sanity: the {SHORT[target]} proxy relayed {relayed / MB:,.1f} MB of "
                f"Produce requests for {figures['payload_bytes_sent'] / MB:,.1f} MB of record "
                f"payload sent through it[/]",
                highlight=False,
            )
    oddities = meta.get("oddities", [])
    if not meta.get("failed_checks"):
        console.print(
            "[dim]sanity: after every measurement the topic had grown by exactly the records "
            "sent, and the dedup proxy had found every record new (no dup, no unknown)[/]",
            highlight=False,
        )
    for oddity in oddities:
        console.print(f"[yellow]note:[/] {oddity}", highlight=False)


# ----------------------------------------------------------------------------- main


def _ports(text: str) -> tuple[int, int, int]:
    parts = [int(p) for p in text.split(",")]
    if len(parts) != 3 or not all(0 < p < 65536 for p in parts):
        raise argparse.ArgumentTypeError("expected LISTEN,ADMIN,BROKER_BASE, three ports")
    return parts[0], parts[1], parts[2]


def parse_args(argv: list[str] | None) -> Settings:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.passthrough",
        description="Throughput and latency of producers direct to Kafka, through the proxy "
        "as a pass-through (--no-dedup) and through the proxy with dedup on.",
    )
    parser.add_argument("--quick", action="store_true", help="a small smoke run (under a minute)")
    parser.add_argument("--out", type=Path, help="output directory (default: results/<time>)")
    parser.add_argument("--rounds", type=int, help=f"interleaved rounds (default {DEFAULT_ROUNDS})")
    parser.add_argument(
        "--scale", type=float, help="multiply the data per throughput measurement (default 1)"
    )
    parser.add_argument(
        "--latency-records",
        type=int,
        help=f"records per latency measurement (default {DEFAULT_LATENCY_RECORDS})",
    )
    parser.add_argument(
        "--bootstrap", help="benchmark this Kafka instead of the local environment (HOST:PORT)"
    )
    parser.add_argument(
        "--redis",
        help="Redis URL for the proxies (default: the local environment's; required with "
        "--bootstrap)",
    )
    parser.add_argument(
        "--keep-env",
        action="store_true",
        help="leave the local environment running if the benchmark had to start it",
    )
    add_pin_argument(parser)
    for target in PROXY_TARGETS:
        default = DEFAULT_PORTS[target]
        parser.add_argument(
            f"--{target}-ports",
            type=_ports,
            default=default,
            metavar="LISTEN,ADMIN,BROKER_BASE",
            help=f"ports of the {SHORT[target]} proxy (default {','.join(map(str, default))}; "
            "broker node n listens on BROKER_BASE + n)",
        )
    args = parser.parse_args(argv)
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else DEFAULT_ROUNDS)
    scale = args.scale or (QUICK_SCALE if args.quick else 1.0)
    latency_records = args.latency_records or (
        QUICK_LATENCY_RECORDS if args.quick else DEFAULT_LATENCY_RECORDS
    )
    if rounds < 1 or scale <= 0 or latency_records < 1:
        parser.error("--rounds, --scale and --latency-records must be positive")
    if args.bootstrap and not args.redis:
        parser.error("--bootstrap needs --redis (the dedup proxy keeps its state there)")
    check_pin_argument(parser, args)
    ports = {PASSTHROUGH: args.passthrough_ports, DEDUP: args.dedup_ports}
    every_port = [p for target in PROXY_TARGETS for p in ports[target]]
    if len(set(every_port)) != len(every_port):
        parser.error("the two proxies need six different ports")
    out = args.out or RESULTS_DIR / datetime.now().strftime("%Y%m%d-%H%M%S")
    return Settings(
        out=out,
        rounds=rounds,
        scale=scale,
        latency_records=latency_records,
        bootstrap=args.bootstrap,
        redis=args.redis,
        keep_env=args.keep_env,
        ports=ports,
        quick=args.quick,
        pin=args.pin,
    )


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C, so the teardown in `finally` blocks runs."""

    def interrupt(_signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else 140)
    settings = parse_args(argv)
    settings.out.mkdir(parents=True, exist_ok=True)
    import confluent_kafka

    meta: dict[str, Any] = {
        "started": datetime.now().isoformat(timespec="seconds"),
        "settings": {k: str(v) for k, v in asdict(settings).items()},
        "targets": {t: LABELS[t] for t in TARGETS},
        "throughput_producer": THROUGHPUT_PRODUCER_SETTINGS,
        "latency_producer": LATENCY_PRODUCER_SETTINGS,
        "record_headers": f"{PRODUCER_HEADER} (one name per producer process and "
        f"measurement), {SEQUENCE_HEADER} (0, 1, 2, ... from the warm-up on), every target",
        "partitions": "1 per producer; producer i writes partition i",
        "replication_factor": 1,
        "confluent_kafka": confluent_kafka.__version__,
        "librdkafka": confluent_kafka.libversion()[0],
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
    }
    cases = build_cases(settings.scale)
    console.print(
        f"[bold]proxy cost benchmark[/]: {', '.join(SHORT[t] for t in TARGETS)}; "
        f"{settings.rounds} interleaved rounds per case, results in {settings.out}",
        highlight=False,
    )
    for case in cases:
        console.print(
            f"  {case.name:<22} {case.partitions} partition(s), "
            f"{case.records_per_producer * case.producers:,} records "
            f"({case.records_per_producer * case.producers * case.record_bytes / MB:.0f} MB) "
            f"+ {case.warmup_per_producer * case.producers:,} warm-up per measurement",
            highlight=False,
        )
    console.print(
        f"  latency: {settings.latency_records:,} records per round one at a time "
        f"(+{LATENCY_WARMUP} warm-up), sizes {', '.join(f'{s} B' for s in RECORD_SIZES)}",
        highlight=False,
    )
    rows: list[Row] = []
    started = time.monotonic()
    try:
        with sigterm_as_interrupt():
            run(settings, console, rows, meta)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted; proxies and workers stopped[/]")
        if rows:
            write_csv(settings.out / "passthrough.partial.csv", rows)
        return 130
    except Exception as exc:
        if not isinstance(exc, BenchmarkError):
            console.print_exception()
        console.print(f"[red]benchmark failed:[/] {type(exc).__name__}: {exc}", highlight=False)
        if rows:
            write_csv(settings.out / "passthrough.partial.csv", rows)
        return 1

    summary = summarize(rows, meta)
    meta["seconds"] = round(time.monotonic() - started, 1)
    meta["loadavg_end"] = os.getloadavg()
    meta.pop("latency_samples", None)
    csv_path = settings.out / "passthrough.csv"
    png_path = settings.out / "passthrough.png"
    write_csv(csv_path, rows + summary)
    title = (
        f"Kafka producer: direct vs proxy pass-through vs proxy with dedup "
        f"({meta.get('brokers', '?')} broker(s), {os.cpu_count()} CPUs, librdkafka "
        f"{meta['librdkafka']}, {settings.rounds} rounds, {meta['started']})"
    )
    plot(png_path, rows, summary, title)
    (settings.out / "meta.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    print_summary(console, summary, meta)
    console.print(
        f"took {meta['seconds']:.0f} s; wrote {csv_path}, {png_path}, "
        f"{settings.out / 'meta.json'}, proxy-{PASSTHROUGH}.log, proxy-{DEDUP}.log",
        highlight=False,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

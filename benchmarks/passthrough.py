"""Pass-through cost of the proxy: the same producers, direct to Kafka and through the proxy.

    .venv/bin/python -m benchmarks.passthrough [--quick] [--out DIR]

Throughput: for each case (record size x producer processes) the same workload runs
direct, proxy, direct, proxy... for R rounds, so machine noise hits both targets alike;
the summary is the median per target and the ratio proxy/direct. Latency: one producer
sends one record at a time (linger.ms=0) and waits for its delivery report, again
interleaved by rounds. Results go to benchmarks/results/<timestamp>/ (or --out): a CSV,
a PNG and the proxy's log. Timing targets are informational: the exit code is 0 whatever
the figures (the machine is shared and noisy); it is non-zero only when the benchmark
itself could not run.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
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
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, fields
from datetime import datetime
from multiprocessing.context import SpawnContext, SpawnProcess
from pathlib import Path
from typing import Any

MB = 1_000_000  # throughput is reported in decimal megabytes of record payload per second
RESULTS_DIR = Path(__file__).resolve().parent / "results"

# Targets the summary checks (informational only).
TARGET_THROUGHPUT_RATIO = 0.90
TARGET_ADDED_P50_MS = 1.0

# Ports of the benchmark's own proxy, away from the defaults (29092/29080) other proxies use.
DEFAULT_LISTEN_PORT = 27492
DEFAULT_ADMIN_PORT = 27480
DEFAULT_BROKER_PORT_BASE = 27493

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

# Settings shared by every producer, direct or through the proxy.
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

TARGETS = ("direct", "proxy")


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
    target: str  # direct | proxy
    round: str
    records: int = 0
    bytes: int = 0
    seconds: float | None = None
    mb_per_s: float | None = None
    records_per_s: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    ratio_vs_direct: float | None = None
    added_p50_ms: float | None = None
    proxy_cpu_s: float | None = None  # CPU the proxy used for the whole measurement
    proxy_mb_per_cpu_s: float | None = None  # payload relayed (incl. warm-up) per CPU second
    errors: int = 0
    note: str = ""


CSV_COLUMNS = [f.name for f in fields(Row)]


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

        def send(count: int) -> None:
            produce = producer.produce
            for i in range(count):
                while True:
                    try:
                        produce(topic, payload, partition=partition)
                        break
                    except BufferError:
                        producer.poll(0.005)
                if i % 20_000 == 0:
                    producer.poll(0)

        send(warmup)
        if producer.flush(MEASUREMENT_TIMEOUT_S) > 0:
            raise RuntimeError("warm-up records not delivered in time")
        failures.clear()
        barrier.wait(MEASUREMENT_TIMEOUT_S)
        start = time.monotonic()  # CLOCK_MONOTONIC: comparable across processes
        send(records)
        undelivered = producer.flush(MEASUREMENT_TIMEOUT_S)
        end = time.monotonic()
        results.put(
            {
                "index": index,
                "start": start,
                "end": end,
                "records": records,
                "errors": len(failures) + undelivered,
                "error": failures[0] if failures else "",
            }
        )
    except BaseException as exc:
        with contextlib.suppress(Exception):
            barrier.abort()
        results.put({"index": index, "fatal": f"{type(exc).__name__}: {exc}"})


def _latency_worker(
    bootstrap: str, topic: str, record_bytes: int, records: int, warmup: int, results: Any
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
            sent = time.perf_counter()
            producer.produce(topic, payload, partition=0, on_delivery=on_delivery)
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


class BenchmarkError(RuntimeError):
    """The benchmark could not run (not: the figures were bad)."""


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


def measure_throughput(pool: WorkerPool, bootstrap: str, topic: str, case: Case) -> Row:
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
        errors=errors,
        note=note,
    )


def measure_latency(
    pool: WorkerPool, bootstrap: str, topic: str, record_bytes: int, records: int
) -> tuple[list[float], int, str]:
    results = pool.ctx.Queue()
    pool.start(_latency_worker, (bootstrap, topic, record_bytes, records, LATENCY_WARMUP, results))
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
        self.prefix = prefix
        self.created: list[str] = []
        cluster = self.admin.list_topics(timeout=15)
        self.replication = 1
        self.brokers = len(cluster.brokers)

    def create(self, slug: str, partitions: int) -> str:
        from confluent_kafka.admin import NewTopic

        topic = f"{self.prefix}-{slug}"
        futures = self.admin.create_topics(
            [NewTopic(topic, num_partitions=partitions, replication_factor=self.replication)],
            operation_timeout=30,
        )
        futures[topic].result(60)
        self.created.append(topic)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until every partition has a leader
            meta = self.admin.list_topics(topic, timeout=10).topics.get(topic)
            if (
                meta is not None
                and meta.error is None
                and len(meta.partitions) == partitions
                and all(p.leader >= 0 for p in meta.partitions.values())
            ):
                return topic
            time.sleep(0.1)
        raise BenchmarkError(f"topic {topic} has no leaders after 30 s")

    def end_offsets(self, topic: str, partitions: int) -> int:
        from confluent_kafka import TopicPartition
        from confluent_kafka.admin import OffsetSpec

        request = {TopicPartition(topic, p): OffsetSpec.latest() for p in range(partitions)}
        futures = self.admin.list_offsets(request, request_timeout=30)
        return sum(f.result(60).offset for f in futures.values())

    def delete(self, topic: str) -> None:
        with contextlib.suppress(Exception):
            self.admin.delete_topics([topic], operation_timeout=30)[topic].result(60)
        with contextlib.suppress(ValueError):
            self.created.remove(topic)

    def delete_all(self) -> None:
        for topic in list(self.created):
            self.delete(topic)


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc; 0 where unavailable)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    parts = stat.rpartition(")")[2].split()
    # After the command name: state is field 3, utime 14 and stime 15 (1-based).
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def port_listening(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def port_bindable(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a listener could bind the port now. Ports in the ephemeral range (as the
    defaults are) can be briefly held by the local end of some outgoing connection."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def start_proxy(proxy: Any, ports: list[int], say: Any, attempts: int = 5) -> None:
    """Start the proxy, retrying while one of its ports is held by another socket (an
    outgoing connection's local end, or its TIME_WAIT, which lasts 60 s on Linux).
    The last port is the broker listener's, which opens after the first metadata answer."""
    for attempt in range(1, attempts + 1):
        deadline = time.monotonic() + PORT_WAIT_S
        if not all(port_bindable(p) for p in ports):
            busy = [p for p in ports if not port_bindable(p)]
            say(f"port(s) {busy} held by another socket; waiting up to {PORT_WAIT_S:.0f} s")
        while not all(port_bindable(p) for p in ports) and time.monotonic() < deadline:
            time.sleep(0.5)
        busy = [p for p in ports if not port_bindable(p)]
        if busy:
            raise BenchmarkError(
                f"port(s) {busy} in use: choose others with --listen-port, --admin-port "
                f"and --broker-port-base"
            )
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
    description: str
    stop_on_exit: bool = False


def open_environment(bootstrap: str | None, keep_env: bool) -> Environment:
    if bootstrap:
        return Environment(bootstrap, f"external Kafka at {bootstrap}")
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
        f"local environment ({brokers} broker(s), {how}) at {info.bootstrap}, home {env.home}",
        stop_on_exit=not was_running and not keep_env,
    )


def close_environment(environment: Environment) -> None:
    if environment.stop_on_exit:
        from deploy.local import LocalEnvironment

        LocalEnvironment().down()


def produce_request_bytes(metrics_text: str) -> float | None:
    """Produce request bytes the proxy received, from its Prometheus text."""
    for line in metrics_text.splitlines():
        if (
            line.startswith("dedup_proxy_bytes_total{")
            and 'direction="request"' in line
            and 'api="produce"' in line.lower()
        ):
            return float(line.rsplit(" ", 1)[1])
    return None


# ----------------------------------------------------------------------------- run


@dataclass
class Settings:
    out: Path
    rounds: int
    scale: float
    latency_records: int
    bootstrap: str | None
    keep_env: bool
    listen_port: int
    admin_port: int
    broker_port_base: int
    quick: bool


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
    from proxy.launcher import ProxyProcess

    cases = build_cases(settings.scale)
    total = len(cases) * settings.rounds * 2 + len(RECORD_SIZES) * settings.rounds * 2
    for port in (settings.listen_port, settings.admin_port, settings.broker_port_base):
        if port_listening(port):
            raise BenchmarkError(
                f"port {port} has a listener (another proxy?): choose other ports with "
                f"--listen-port, --admin-port and --broker-port-base"
            )

    console.print("bringing up Kafka ...", highlight=False)
    environment = open_environment(settings.bootstrap, settings.keep_env)
    meta["environment"] = environment.description
    console.print(environment.description, highlight=False)
    pool = WorkerPool()
    topics: Topics | None = None
    proxy = ProxyProcess(
        upstream=environment.bootstrap,
        listen_port=settings.listen_port,
        admin_port=settings.admin_port,
        log_path=settings.out / "proxy.log",
        extra_args=["--broker-port-base", str(settings.broker_port_base)],
    )
    try:
        topics = Topics(
            environment.bootstrap, f"bench-passthrough-{os.getpid()}-{int(time.time())}"
        )
        meta["brokers"] = topics.brokers
        start_proxy(
            proxy,
            [settings.listen_port, settings.admin_port, settings.broker_port_base],
            lambda text: console.print(f"[yellow]{text}[/]", highlight=False),
        )
        console.print(
            f"proxy pid {proxy.pid} on {proxy.bootstrap} (brokers from port "
            f"{settings.broker_port_base}), log {proxy.log_path}",
            highlight=False,
        )
        bootstraps = {"direct": environment.bootstrap, "proxy": proxy.bootstrap}
        progress = Progress(console, total)
        proxied_bytes = 0

        # A freshly started Kafka runs its first seconds on a cold JVM: without this pass
        # the first direct measurement of the first case would pay for it alone.
        warmup_case = Case(1000, 1, max(1000 * 100, int(WARMUP_PASS_BYTES * settings.scale)))
        topic = topics.create("warmup", 1)
        for target in TARGETS:
            row = measure_throughput(pool, bootstraps[target], topic, warmup_case)
            if target == "proxy":
                warm = warmup_case.warmup_per_producer * warmup_case.producers
                proxied_bytes += row.bytes + warm * warmup_case.record_bytes
            console.print(
                f"[dim]warm-up pass, not recorded: {target:<6} {row.mb_per_s:8.1f} MB/s[/]",
                highlight=False,
            )
        topics.delete(topic)

        for case in cases:
            topic = topics.create(case.slug, case.partitions)
            sent = 0
            for round_no in range(1, settings.rounds + 1):
                for target in TARGETS:
                    cpu_before = process_cpu_seconds(proxy.pid)
                    row = measure_throughput(pool, bootstraps[target], topic, case)
                    row.target, row.round = target, str(round_no)
                    rows.append(row)
                    warm = case.warmup_per_producer * case.producers
                    sent += row.records + warm
                    if target == "proxy":
                        relayed_bytes = row.bytes + warm * case.record_bytes
                        proxied_bytes += relayed_bytes
                        row.proxy_cpu_s = process_cpu_seconds(proxy.pid) - cpu_before
                        if row.proxy_cpu_s > 0:
                            row.proxy_mb_per_cpu_s = relayed_bytes / MB / row.proxy_cpu_s
                    failed = f"  [red]{row.errors} errors: {row.note}[/]" if row.errors else ""
                    progress.line(
                        f"{case.name:<22} round {round_no}/{settings.rounds}  {target:<6} "
                        f"{row.mb_per_s:8.1f} MB/s {row.records_per_s:>11,.0f} rec/s "
                        f"{row.seconds:6.2f} s{failed}"
                    )
            landed = topics.end_offsets(topic, case.partitions)
            if landed != sent:
                meta.setdefault("oddities", []).append(
                    f"{case.name}: {landed} records in the topic, {sent} sent"
                )
            topics.delete(topic)

        for size in RECORD_SIZES:
            topic = topics.create(f"latency-{size}b", 1)
            for round_no in range(1, settings.rounds + 1):
                for target in TARGETS:
                    samples, errors, first_error = measure_latency(
                        pool, bootstraps[target], topic, size, settings.latency_records
                    )
                    row = latency_row(size, target, str(round_no), samples, errors, first_error)
                    rows.append(row)
                    progress.line(
                        f"{row.case:<22} round {round_no}/{settings.rounds}  {target:<6} "
                        f"p50 {row.p50_ms:6.3f} ms  p99 {row.p99_ms:6.3f} ms "
                        f"({len(samples)} records)"
                        + (f"  [red]{errors} errors: {first_error}[/]" if errors else "")
                    )
                    meta.setdefault("latency_samples", {}).setdefault(
                        f"{size}:{target}", []
                    ).extend(samples)
            topics.delete(topic)

        with contextlib.suppress(Exception):
            relayed = produce_request_bytes(proxy.metrics_text())
            meta["proxy_produce_request_bytes"] = relayed
            meta["payload_bytes_sent_through_proxy"] = proxied_bytes
            if relayed is not None and relayed < proxied_bytes:
                meta.setdefault("oddities", []).append(
                    f"the proxy saw {relayed / MB:.1f} MB of Produce requests, less than the "
                    f"{proxied_bytes / MB:.1f} MB of payload sent through it"
                )
    finally:
        pool.terminate()
        code = proxy.stop()
        if code not in (0, None):
            meta.setdefault("oddities", []).append(f"the proxy exited with code {code}")
        if topics is not None:
            topics.delete_all()
        close_environment(environment)


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


def summarize(rows: list[Row], meta: dict[str, Any]) -> list[Row]:
    """Median throughput per case and target (with proxy/direct), pooled latency per size."""
    summary: list[Row] = []
    measured = [r for r in rows if r.kind == "throughput"]
    for case in dict.fromkeys(r.case for r in measured):
        medians: dict[str, Row] = {}
        for target in TARGETS:
            runs = [r for r in measured if r.case == case and r.target == target]
            good = [r for r in runs if r.errors == 0] or runs
            first = runs[0]
            medians[target] = Row(
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
                note=f"median of {len(good)} rounds",
            )
        direct, proxied = medians["direct"], medians["proxy"]
        if direct.mb_per_s:
            proxied.ratio_vs_direct = (proxied.mb_per_s or 0.0) / direct.mb_per_s
        summary += [direct, proxied]
    samples = meta.get("latency_samples", {})
    for size in RECORD_SIZES:
        pooled: dict[str, Row] = {}
        for target in TARGETS:
            values = samples.get(f"{size}:{target}", [])
            if not values:
                continue
            errors = sum(
                r.errors
                for r in rows
                if r.kind == "latency" and r.record_bytes == size and r.target == target
            )
            row = latency_row(size, target, "all", values, errors, "all rounds pooled")
            pooled[target] = row
        if len(pooled) == 2 and pooled["direct"].p50_ms is not None:
            proxied = pooled["proxy"]
            proxied.added_p50_ms = (proxied.p50_ms or 0.0) - pooled["direct"].p50_ms
        summary += pooled.values()
    return summary


# ----------------------------------------------------------------------------- output


def write_csv(path: Path, rows: list[Row]) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for row in rows:
            record = asdict(row)
            for key, value in record.items():
                if value is None:
                    record[key] = ""
                elif isinstance(value, float):
                    record[key] = f"{value:.6g}" if key != "seconds" else f"{value:.4f}"
            writer.writerow(record)


COLORS = {"direct": "#4c72b0", "proxy": "#dd8452"}


def plot(path: Path, rows: list[Row], summary: list[Row], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    for size, ax in zip(RECORD_SIZES, axes[0], strict=True):
        _plot_throughput(ax, size, rows, summary)
    for stat, ax in zip(("p50", "p99"), axes[1], strict=True):
        _plot_latency(ax, stat, summary)
    handles = [
        Patch(color=COLORS["direct"], label="direct to Kafka"),
        Patch(color=COLORS["proxy"], label="through the proxy"),
        Line2D([], [], marker="o", color="black", linestyle="", markersize=4, label="rounds"),
    ]
    fig.legend(handles=handles, loc="upper center", ncol=3, bbox_to_anchor=(0.5, 0.955))
    fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_throughput(ax: Any, size: int, rows: list[Row], summary: list[Row]) -> None:
    width = 0.38
    medians = [r for r in summary if r.kind == "throughput" and r.record_bytes == size]
    runs = [r for r in rows if r.kind == "throughput" and r.record_bytes == size]
    cases = list(dict.fromkeys(r.case for r in medians))
    top = max((r.mb_per_s or 0.0 for r in runs), default=1.0) or 1.0
    for offset, target in ((-width / 2, "direct"), (width / 2, "proxy")):
        for i, case in enumerate(cases):
            median = next(r for r in medians if r.case == case and r.target == target)
            x = i + offset
            ax.bar(x, median.mb_per_s or 0.0, width, color=COLORS[target])
            points = [r.mb_per_s for r in runs if r.case == case and r.target == target]
            ax.scatter([x] * len(points), points, s=14, color="black", zorder=3)
    for i, case in enumerate(cases):
        direct = next(r for r in medians if r.case == case and r.target == "direct")
        proxied = next(r for r in medians if r.case == case and r.target == "proxy")
        ratio = proxied.ratio_vs_direct
        met = ratio is not None and ratio >= TARGET_THROUGHPUT_RATIO
        label = f"direct {direct.mb_per_s:.0f} / proxy {proxied.mb_per_s:.0f} MB/s"
        label += f"\nproxy/direct {ratio:.1%}" if ratio is not None else ""
        ax.annotate(
            label, (i, top * 1.04), ha="center", fontsize=9, color="green" if met else "red"
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
    ax.set_ylim(0, top * 1.25)
    ax.set_ylabel("MB/s of record payload (10^6 B/s), median")
    ax.set_title(
        f"Throughput, {size} B records (acks=all, linger.ms=5); "
        f"target >= {TARGET_THROUGHPUT_RATIO:.0%} of direct",
        fontsize=10,
    )
    ax.grid(axis="y", alpha=0.3)


def _plot_latency(ax: Any, stat: str, summary: list[Row]) -> None:
    width = 0.38
    pooled = [r for r in summary if r.kind == "latency"]
    top = max((getattr(r, f"{stat}_ms") or 0.0 for r in pooled), default=1.0) or 1.0
    for offset, target in ((-width / 2, "direct"), (width / 2, "proxy")):
        values = []
        for size in RECORD_SIZES:
            row = next((r for r in pooled if r.record_bytes == size and r.target == target), None)
            values.append((getattr(row, f"{stat}_ms") if row else None) or 0.0)
        xs = [i + offset for i in range(len(RECORD_SIZES))]
        bars = ax.bar(xs, values, width, color=COLORS[target])
        ax.bar_label(bars, fmt="%.3f", padding=2, fontsize=8)
    for i, size in enumerate(RECORD_SIZES):
        direct = next((r for r in pooled if r.record_bytes == size and r.target == "direct"), None)
        proxied = next((r for r in pooled if r.record_bytes == size and r.target == "proxy"), None)
        if direct is None or proxied is None:
            continue
        added = (getattr(proxied, f"{stat}_ms") or 0.0) - (getattr(direct, f"{stat}_ms") or 0.0)
        color = "black"
        if stat == "p50":
            color = "green" if added <= TARGET_ADDED_P50_MS else "red"
        ax.annotate(f"added {added:+.3f} ms", (i, top * 1.1), ha="center", fontsize=9, color=color)
    ax.set_xticks(range(len(RECORD_SIZES)), [f"{size} B records" for size in RECORD_SIZES])
    ax.set_xlim(-0.6, len(RECORD_SIZES) - 0.4)
    ax.set_ylim(0, top * 1.25)
    ax.set_ylabel(f"{stat} ms, produce to delivery report")
    target = f"; target: added p50 <= {TARGET_ADDED_P50_MS:g} ms" if stat == "p50" else ""
    ax.set_title(
        f"Latency {stat}, one record at a time (linger.ms=0, acks=all){target}", fontsize=10
    )
    ax.grid(axis="y", alpha=0.3)


def print_summary(console: Any, summary: list[Row], meta: dict[str, Any]) -> None:
    from rich.table import Table

    def verdict(ok: bool) -> str:
        return "[green]met[/]" if ok else "[red]not met[/]"

    throughput = Table(
        title="Throughput (median of rounds, MB/s of record payload)",
        caption="producer i writes partition i; proxy MB per CPU-s: payload the proxy relayed "
        "(warm-up included) per second of its own CPU time",
    )
    columns = (
        "case",
        "partitions",
        "direct MB/s",
        "proxy MB/s",
        "proxy/direct",
        "proxy MB per CPU-s",
        "target",
    )
    for column in columns:
        throughput.add_column(column, justify="left" if column == "case" else "right")
    all_met = True
    medians = [r for r in summary if r.kind == "throughput"]
    for case in dict.fromkeys(r.case for r in medians):
        direct = next(r for r in medians if r.case == case and r.target == "direct")
        proxied = next(r for r in medians if r.case == case and r.target == "proxy")
        ratio = proxied.ratio_vs_direct or 0.0
        met = ratio >= TARGET_THROUGHPUT_RATIO and not (direct.errors or proxied.errors)
        all_met &= met
        throughput.add_row(
            case,
            str(direct.partitions),
            f"{direct.mb_per_s:.1f}",
            f"{proxied.mb_per_s:.1f}",
            f"{ratio:.1%}",
            f"{proxied.proxy_mb_per_cpu_s:.0f}" if proxied.proxy_mb_per_cpu_s else "-",
            verdict(met) + (" (errors)" if direct.errors or proxied.errors else ""),
        )
    console.print(throughput)

    latency = Table(title="Latency per record (all rounds pooled, ms)")
    for column in (
        "record size",
        "direct p50",
        "proxy p50",
        "added p50",
        "direct p99",
        "proxy p99",
        "target",
    ):
        latency.add_column(column, justify="right")
    pooled = [r for r in summary if r.kind == "latency"]
    latency_met = True
    for size in RECORD_SIZES:
        lat_direct = next(
            (r for r in pooled if r.record_bytes == size and r.target == "direct"), None
        )
        lat_proxy = next(
            (r for r in pooled if r.record_bytes == size and r.target == "proxy"), None
        )
        if lat_direct is None or lat_proxy is None:
            continue
        added = lat_proxy.added_p50_ms or 0.0
        met = added <= TARGET_ADDED_P50_MS
        latency_met &= met
        latency.add_row(
            f"{size} B",
            f"{lat_direct.p50_ms:.3f}",
            f"{lat_proxy.p50_ms:.3f}",
            f"{added:+.3f}",
            f"{lat_direct.p99_ms:.3f}",
            f"{lat_proxy.p99_ms:.3f}",
            verdict(met),
        )
    console.print(latency)
    console.print(
        f"pass-through throughput >= {TARGET_THROUGHPUT_RATIO:.0%} of direct in every case: "
        f"{verdict(all_met)}",
        highlight=False,
    )
    console.print(
        f"added median latency <= {TARGET_ADDED_P50_MS:g} ms for every record size: "
        f"{verdict(latency_met)}",
        highlight=False,
    )
    console.print(
        "[dim]informational: the machine is shared and noisy, the exit code does not depend "
        "on these figures[/]"
    )
    relayed = meta.get("proxy_produce_request_bytes")
    if relayed is not None:
        sent = meta["payload_bytes_sent_through_proxy"]
        console.print(
            f"[dim]sanity: the proxy relayed {relayed / MB:,.1f} MB of Produce requests for "
            f"{sent / MB:,.1f} MB of record payload sent through it[/]",
            highlight=False,
        )
    if not any("records in the topic" in o for o in meta.get("oddities", [])):
        console.print(
            "[dim]sanity: every topic's end offsets matched the records sent to it[/]",
            highlight=False,
        )
    for oddity in meta.get("oddities", []):
        console.print(f"[yellow]note:[/] {oddity}", highlight=False)


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> Settings:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.passthrough",
        description="Throughput and latency of producers direct to Kafka vs through the proxy.",
    )
    parser.add_argument("--quick", action="store_true", help="a small smoke run (~1 minute)")
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
        "--keep-env",
        action="store_true",
        help="leave the local environment running if the benchmark had to start it",
    )
    parser.add_argument("--listen-port", type=int, default=DEFAULT_LISTEN_PORT)
    parser.add_argument("--admin-port", type=int, default=DEFAULT_ADMIN_PORT)
    parser.add_argument("--broker-port-base", type=int, default=DEFAULT_BROKER_PORT_BASE)
    args = parser.parse_args(argv)
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else DEFAULT_ROUNDS)
    scale = args.scale or (QUICK_SCALE if args.quick else 1.0)
    latency_records = args.latency_records or (
        QUICK_LATENCY_RECORDS if args.quick else DEFAULT_LATENCY_RECORDS
    )
    if rounds < 1 or scale <= 0 or latency_records < 1:
        parser.error("--rounds, --scale and --latency-records must be positive")
    out = args.out or RESULTS_DIR / datetime.now().strftime("%Y%m%d-%H%M%S")
    return Settings(
        out=out,
        rounds=rounds,
        scale=scale,
        latency_records=latency_records,
        bootstrap=args.bootstrap,
        keep_env=args.keep_env,
        listen_port=args.listen_port,
        admin_port=args.admin_port,
        broker_port_base=args.broker_port_base,
        quick=args.quick,
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

    console = Console(width=None if sys.stdout.isatty() else 120)
    settings = parse_args(argv)
    settings.out.mkdir(parents=True, exist_ok=True)
    import confluent_kafka

    meta: dict[str, Any] = {
        "started": datetime.now().isoformat(timespec="seconds"),
        "settings": {k: str(v) for k, v in asdict(settings).items()},
        "throughput_producer": THROUGHPUT_PRODUCER_SETTINGS,
        "latency_producer": LATENCY_PRODUCER_SETTINGS,
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
        f"[bold]pass-through benchmark[/]: {settings.rounds} interleaved rounds per case, "
        f"results in {settings.out}",
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
        console.print("[yellow]interrupted; proxy and workers stopped[/]")
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
        f"Kafka producer direct vs through the proxy ({meta.get('brokers', '?')} broker(s), "
        f"{os.cpu_count()} CPUs, librdkafka {meta['librdkafka']}, {settings.rounds} rounds, "
        f"{meta['started']})"
    )
    plot(png_path, rows, summary, title)
    (settings.out / "meta.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    print_summary(console, summary, meta)
    console.print(
        f"took {meta['seconds']:.0f} s; wrote {csv_path}, {png_path}, "
        f"{settings.out / 'meta.json'}, {settings.out / 'proxy.log'}",
        highlight=False,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

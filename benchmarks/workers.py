"""Dedup throughput through `serve --workers W`, for several W side by side in one run.

    .venv/bin/python -m benchmarks.workers --workers 1,2,4 [--quick] [--out DIR]

One dedup proxy per W runs for the whole benchmark (`deploy/launcher.py`: `python -m dedup
serve --workers W`, every worker on the shared bootstrap port, broker ports 10 apart). Per
round, the same workload (P producer processes, one partition each, identity headers on
every record, the producer settings of `benchmarks.passthrough`, a fresh topic each time)
goes through each proxy in turn: W=1, W=2, W=4, W=1, ... so machine noise hits all alike;
the summary is the median per W and its ratio to the first W. Producers connect through
the bootstrap port, so the kernel spreads them over the workers (SO_REUSEPORT): per
measurement the benchmark records how many Produce requests each worker took, and the
workers' CPU seconds. The topic's end offsets must grow by exactly the records sent (plus
at most one fence marker per partition recovery). Results go to --out: workers.csv, workers.png,
meta.json and the proxies' logs. The exit code is 0 whatever the figures; it is non-zero
only when the benchmark itself could not run.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import platform
import statistics
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, fields
from datetime import datetime
from pathlib import Path
from typing import Any

from benchmarks.passthrough import (
    MB,
    PRODUCE_REQUESTS,
    RECOVERIES,
    RESULTS_DIR,
    THROUGHPUT_PRODUCER_SETTINGS,
    BenchmarkError,
    Case,
    RedisStats,
    Topics,
    WorkerPool,
    close_environment,
    measure_throughput,
    open_environment,
    parse_metrics,
    process_cpu_seconds,
    sigterm_as_interrupt,
    start_proxy,
)

DEFAULT_WORKERS = (1, 2, 4)
DEFAULT_PRODUCERS = 4
DEFAULT_RECORD_BYTES = 1000
DEFAULT_TOTAL_BYTES = 100 * MB
DEFAULT_ROUNDS = 3
QUICK_TOTAL_BYTES = 20 * MB
QUICK_ROUNDS = 2
# Proxy k (for the k-th W) owns the 100 ports from PORT_BASE + 100 k: admin ports first
# (one per worker), the bootstrap port 12 above, broker ports from there, 10 per worker.
PORT_BASE = 27680
WORKER_PORT_STRIDE = 10
MAX_WORKERS = 8


@dataclass
class Row:
    workers: int
    round: str  # 1..R, or "median"
    records: int = 0
    bytes: int = 0
    seconds: float | None = None
    mb_per_s: float | None = None
    records_per_s: float | None = None
    ratio_vs_first: float | None = None  # summary rows: median / the first W's median
    warmup_records: int = 0
    landed_records: int | None = None  # records + warmup_records, + up to one per recovery
    # Partition recoveries meanwhile: each may fence with a transaction marker (an offset).
    recoveries: int = 0
    cpu_s: float | None = None  # the workers' CPU over the measurement (warm-up included)
    mb_per_cpu_s: float | None = None
    produce_requests: str = ""  # per worker, e.g. "812/790"
    errors: int = 0
    note: str = ""


@dataclass
class Proxy:
    workers: int
    process: Any  # deploy.launcher.ProxyProcess
    key_prefix: str
    ports: tuple[int, int, int]  # listen, admin, broker base

    def worker_pids(self) -> list[int]:
        return [pid for pid in self.process.worker_pids() if pid is not None]

    def produce_requests(self) -> list[float]:
        """Produce requests each worker has received so far (0 where it did not answer)."""
        return [_metric(url, PRODUCE_REQUESTS) for url in self.process.worker_admin_urls()]

    def recoveries(self) -> float:
        """Partition recoveries of all workers so far: each fences with one marker."""
        return sum(_metric(url, RECOVERIES) for url in self.process.worker_admin_urls())

    def cpu_seconds(self) -> float:
        return sum(process_cpu_seconds(pid) for pid in self.worker_pids())


def _metric(admin_url: str, name: str) -> float:
    try:
        with urllib.request.urlopen(f"{admin_url}/metrics", timeout=5) as answer:
            return parse_metrics(answer.read().decode()).get(name, 0.0)
    except OSError:
        return 0.0


def proxy_ports(index: int) -> tuple[int, int, int]:
    admin = PORT_BASE + 100 * index
    return admin + 12, admin, admin + 13


def make_proxy(index: int, workers: int, bootstrap: str, redis: str, out: Path, run: str) -> Proxy:
    from deploy.launcher import ProxyProcess

    listen, admin, broker_base = proxy_ports(index)
    key_prefix = f"bench-workers{workers}-{run}"
    process = ProxyProcess(
        upstream=bootstrap,
        listen_port=listen,
        admin_port=admin,
        workers=workers,
        log_path=out / f"proxy-w{workers}.log",
        extra_args=[
            "--broker-port-base",
            str(broker_base),
            "--instance-id",
            f"bench-{run}-{index}",
        ],
        env={
            "DEDUP_PROXY_REDIS": redis,
            "DEDUP_PROXY_REDIS_KEY_PREFIX": key_prefix,
            "DEDUP_PROXY_WORKER_PORT_STRIDE": str(WORKER_PORT_STRIDE),
        },
    )
    return Proxy(workers, process, key_prefix, (listen, admin, broker_base))


def measure(
    pool: WorkerPool, topics: Topics, topic: str, case: Case, proxy: Proxy, name: str
) -> Row:
    offsets = topics.end_offsets(topic, case.partitions)
    requests, cpu, recoveries = proxy.produce_requests(), proxy.cpu_seconds(), proxy.recoveries()
    measured = measure_throughput(pool, proxy.process.bootstrap, topic, case, name)
    landed = topics.end_offsets(topic, case.partitions) - offsets
    cpu_s = proxy.cpu_seconds() - cpu
    per_worker = [round(b - a) for a, b in zip(requests, proxy.produce_requests(), strict=True)]
    relayed = measured.bytes + measured.warmup_records * case.record_bytes
    return Row(
        workers=proxy.workers,
        round="",
        records=measured.records,
        bytes=measured.bytes,
        seconds=measured.seconds,
        mb_per_s=measured.mb_per_s,
        records_per_s=measured.records_per_s,
        warmup_records=measured.warmup_records,
        landed_records=landed,
        recoveries=round(proxy.recoveries() - recoveries),
        cpu_s=cpu_s,
        mb_per_cpu_s=relayed / MB / cpu_s if cpu_s > 0 else None,
        produce_requests="/".join(str(n) for n in per_worker),
        errors=measured.errors,
        note=measured.note,
    )


@dataclass
class Settings:
    workers: list[int]
    rounds: int
    producers: int
    record_bytes: int
    total_bytes: int
    out: Path
    bootstrap: str | None
    redis: str | None
    keep_env: bool


def run(settings: Settings, say: Any, rows: list[Row], meta: dict[str, Any]) -> None:
    environment = open_environment(settings.bootstrap, settings.redis, settings.keep_env)
    meta["environment"] = environment.description
    run_id = f"{os.getpid()}-{int(time.time())}"
    proxies = [
        make_proxy(i, w, environment.bootstrap, environment.redis, settings.out, run_id)
        for i, w in enumerate(settings.workers)
    ]
    topics = Topics(environment.bootstrap, f"bench-workers-{run_id}")
    pool = WorkerPool()
    case = Case(settings.record_bytes, settings.producers, settings.total_bytes)
    try:
        for proxy in proxies:
            listen, admin, broker_base = proxy.ports
            start_proxy(proxy.process, [listen, admin, broker_base], say)
            say(f"proxy with {proxy.workers} worker(s) up: pids {proxy.worker_pids()}")
        # A fresh topic per measurement: a partition is only ever written through one
        # worker of one proxy (several proxies with their own Redis prefixes, or workers
        # taking a partition over from each other, would be measuring recoveries).
        warm = Case(case.record_bytes, case.producers, max(case.total_bytes // 5, MB))
        for proxy in proxies:  # unrecorded: warms Kafka, each worker's path and Redis
            slug = f"warm-w{proxy.workers}"
            topic = topics.create(slug, case.partitions)
            measure(pool, topics, topic, warm, proxy, f"bench-{run_id}-{slug}")
            topics.delete(topic)
        for round_index in range(1, settings.rounds + 1):
            for proxy in proxies:
                name = f"bench-{run_id}-w{proxy.workers}-r{round_index}"
                topic = topics.create(f"w{proxy.workers}-r{round_index}", case.partitions)
                row = measure(pool, topics, topic, case, proxy, name)
                topics.delete(topic)
                row.round = str(round_index)
                rows.append(row)
                sent = row.records + row.warmup_records
                landed = row.landed_records or 0
                if not sent <= landed <= sent + row.recoveries:
                    meta.setdefault("oddities", []).append(
                        f"W={row.workers} round {round_index}: the topic grew by "
                        f"{row.landed_records} records, {sent} were sent "
                        f"(and {row.recoveries} recoveries, each at most one fence marker)"
                    )
                say(
                    f"W={row.workers} round {round_index}: {row.mb_per_s:.1f} MB/s, "
                    f"{row.records_per_s:,.0f} records/s, Produce requests per worker "
                    f"{row.produce_requests}, workers' CPU {row.cpu_s:.1f} s"
                )
    finally:
        pool.terminate()
        for proxy in proxies:
            proxy.process.stop()
        topics.delete_all()
        with contextlib.suppress(Exception):
            stats = RedisStats(environment.redis)
            for proxy in proxies:
                stats.delete_prefix(proxy.key_prefix)
        close_environment(environment)


def summarize(rows: list[Row]) -> list[Row]:
    summary: list[Row] = []
    for workers in dict.fromkeys(r.workers for r in rows):
        runs = [r for r in rows if r.workers == workers]
        cpu = [r.mb_per_cpu_s for r in runs if r.mb_per_cpu_s is not None]
        summary.append(
            Row(
                workers=workers,
                round="median",
                records=sum(r.records for r in runs),
                bytes=sum(r.bytes for r in runs),
                seconds=statistics.median(r.seconds or 0.0 for r in runs),
                mb_per_s=statistics.median(r.mb_per_s or 0.0 for r in runs),
                records_per_s=statistics.median(r.records_per_s or 0.0 for r in runs),
                mb_per_cpu_s=statistics.median(cpu) if cpu else None,
                errors=sum(r.errors for r in runs),
            )
        )
    first = summary[0].mb_per_s if summary else None
    for row in summary:
        if first and row.mb_per_s is not None:
            row.ratio_vs_first = row.mb_per_s / first
    return summary


def write_csv(path: Path, rows: list[Row]) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=[f.name for f in fields(Row)])
        writer.writeheader()
        for row in rows:
            writer.writerow(asdict(row))


def plot(path: Path, rows: list[Row], summary: list[Row], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    labels = [str(r.workers) for r in summary]
    medians = [r.mb_per_s or 0.0 for r in summary]
    bars = ax.bar(labels, medians, color="#4c72b0", width=0.6)
    for i, row in enumerate(summary):
        dots = [r.mb_per_s or 0.0 for r in rows if r.workers == row.workers]
        ax.plot([i] * len(dots), dots, "o", color="black", markersize=4)
        ratio = f"\n{row.ratio_vs_first:.2f}x" if row.ratio_vs_first is not None else ""
        ax.annotate(
            f"{row.mb_per_s:.1f} MB/s{ratio}",
            (bars[i].get_x() + bars[i].get_width() / 2, max([medians[i], *dots])),
            ha="center",
            va="bottom",
            fontsize=9,
        )
    ax.set_xlabel("serve --workers")
    ax.set_ylabel("dedup throughput, MB/s of payload (median; dots = rounds)")
    ax.set_ylim(0, max([*medians, *(r.mb_per_s or 0.0 for r in rows)], default=1) * 1.25)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> Settings:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--workers", default=",".join(map(str, DEFAULT_WORKERS)))
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--producers", type=int, default=DEFAULT_PRODUCERS)
    parser.add_argument("--record-bytes", type=int, default=DEFAULT_RECORD_BYTES)
    parser.add_argument(
        "--mb", type=float, default=None, help="payload MB per measurement (default 100)"
    )
    parser.add_argument("--quick", action="store_true", help="20 MB per measurement, 2 rounds")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--bootstrap", default=None, help="an external Kafka (with --redis)")
    parser.add_argument("--redis", default=None)
    parser.add_argument("--keep-env", action="store_true")
    args = parser.parse_args(argv)
    workers = [int(part) for part in args.workers.split(",") if part.strip()]
    if not workers or any(not 1 <= w <= MAX_WORKERS for w in workers):
        parser.error(f"--workers: a list of counts in 1..{MAX_WORKERS}")
    if len(set(workers)) != len(workers):
        parser.error("--workers: each count once")
    if args.bootstrap and not args.redis:
        parser.error("--bootstrap needs --redis")
    total = QUICK_TOTAL_BYTES if args.quick else DEFAULT_TOTAL_BYTES
    if args.mb is not None:
        total = int(args.mb * MB)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return Settings(
        workers=workers,
        rounds=args.rounds or (QUICK_ROUNDS if args.quick else DEFAULT_ROUNDS),
        producers=args.producers,
        record_bytes=args.record_bytes,
        total_bytes=total,
        out=args.out or RESULTS_DIR / f"{stamp}-workers",
        bootstrap=args.bootstrap,
        redis=args.redis,
        keep_env=args.keep_env,
    )


def main(argv: list[str] | None = None) -> int:
    settings = parse_args(argv)
    settings.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()

    def say(text: str) -> None:
        print(f"{time.monotonic() - started:6.1f}s {text}", flush=True)

    meta: dict[str, Any] = {
        "started": datetime.now().isoformat(timespec="seconds"),
        "settings": {k: str(v) for k, v in asdict(settings).items()},
        "producer": THROUGHPUT_PRODUCER_SETTINGS,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
        "worker_port_stride": WORKER_PORT_STRIDE,
    }
    say(
        f"dedup throughput by --workers {settings.workers}: {settings.producers} producer(s) "
        f"of {settings.record_bytes} B records, {settings.total_bytes / MB:.0f} MB per "
        f"measurement, {settings.rounds} interleaved rounds; results in {settings.out}"
    )
    rows: list[Row] = []
    try:
        with sigterm_as_interrupt():
            run(settings, say, rows, meta)
    except KeyboardInterrupt:
        say("interrupted; proxies and producers stopped")
        if rows:
            write_csv(settings.out / "workers.partial.csv", rows)
        return 130
    except BenchmarkError as exc:
        say(f"benchmark failed: {exc}")
        if rows:
            write_csv(settings.out / "workers.partial.csv", rows)
        return 1
    summary = summarize(rows)
    meta["seconds"] = round(time.monotonic() - started, 1)
    meta["loadavg_end"] = os.getloadavg()
    meta["summary"] = [asdict(r) for r in summary]
    write_csv(settings.out / "workers.csv", rows + summary)
    title = (
        f"Dedup throughput through serve --workers W\n({settings.producers} producers x "
        f"{settings.record_bytes} B records, {os.cpu_count()} CPUs, {settings.rounds} rounds, "
        f"{meta['started']})"
    )
    plot(settings.out / "workers.png", rows, summary, title)
    (settings.out / "meta.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    print()
    print(f"{'workers':>8} {'MB/s':>8} {'records/s':>11} {'vs first':>9} {'MB/CPU-s':>9}")
    for row in summary:
        ratio = f"{row.ratio_vs_first:.2f}" if row.ratio_vs_first is not None else "-"
        per_cpu = f"{row.mb_per_cpu_s:.1f}" if row.mb_per_cpu_s is not None else "-"
        print(
            f"{row.workers:>8} {row.mb_per_s or 0:>8.1f} {row.records_per_s or 0:>11,.0f} "
            f"{ratio:>9} {per_cpu:>9}"
        )
    for oddity in meta.get("oddities", []):
        print(f"oddity: {oddity}")
    say(f"wrote {settings.out}/workers.csv, workers.png, meta.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())

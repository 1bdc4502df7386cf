"""Recovery through a real dedup proxy, and what snapshots cost the produce path.

Two measurements on one local environment (a private one: see benchmarks/README.md):

- **Recovery time versus tail length.** For each tail length a fresh topic gets that many
  records with identity headers (1000 producers), written straight to Kafka, then the
  proxy is asked to recover the partition (``POST .../recover``, timed by the caller).
  No snapshot exists, so this is the whole path: fence, end offset, snapshot read, replay
  of the full tail, Redis load.
- **Snapshot cost.** Two dedup proxies side by side, one snapshotting every 1000 records
  (the default), one with snapshots effectively off; the same producer load (100 B
  records, one partition, acks=all) goes through each in interleaved rounds.

    DEDUP_LOCAL_HOME=/tmp/bench-e2e DEDUP_LOCAL_KAFKA_PORT=26292 DEDUP_LOCAL_REDIS_PORT=17279 \\
        .venv/bin/python -m benchmarks.recovery_e2e --out /tmp/bench-e2e-out [--quick]
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient

from dedup.identity import DEFAULT_PRODUCER_HEADER, DEFAULT_SEQUENCE_HEADER
from deploy.launcher import ProxyProcess
from deploy.local import EnvInfo, LocalEnvironment
from deploy.topics import create_topic

TAILS = (1_000, 10_000, 100_000, 1_000_000)
QUICK_TAILS = (1_000, 10_000, 100_000)
PRODUCERS = 1000
SNAPSHOTS_ON = {"DEDUP_PROXY_SNAPSHOT_EVERY_RECORDS": "1000"}
SNAPSHOTS_OFF = {
    "DEDUP_PROXY_SNAPSHOT_EVERY_RECORDS": "1000000000",
    "DEDUP_PROXY_SNAPSHOT_EVERY_S": "1000000",
}
# (listen, admin, broker base) per proxy: below the ephemeral range, away from the tests.
PORTS = {"snapshots-on": (26492, 26480, 26493), "snapshots-off": (26592, 26580, 26593)}


@dataclass(frozen=True)
class RecoveryRow:
    tail_records: int
    round: int
    seconds: float
    records_per_s: float


@dataclass(frozen=True)
class ProduceRow:
    target: str
    round: int
    records: int
    seconds: float
    records_per_s: float
    snapshots_taken: float


@contextmanager
def dedup_proxy(
    info: EnvInfo, name: str, settings: dict[str, str], logs: Path
) -> Iterator[ProxyProcess]:
    listen, admin, base = PORTS[name]
    process = ProxyProcess(
        upstream=info.bootstrap,
        listen_port=listen,
        admin_port=admin,
        extra_args=["--broker-port-base", str(base)],
        env={
            "DEDUP_PROXY_REDIS": info.redis,
            "DEDUP_PROXY_REDIS_KEY_PREFIX": f"bench-{name}-{uuid.uuid4().hex[:6]}",
            "DEDUP_PROXY_INSTANCE_ID": f"bench-{name}-{uuid.uuid4().hex[:6]}",
            "DEDUP_PROXY_REPLAY_TIMEOUT_S": "600",
            **settings,
        },
        log_path=logs / f"{name}.log",
    ).start()
    try:
        yield process
    finally:
        process.stop()


def _producer(bootstrap: str) -> Producer:
    return Producer(
        {
            "bootstrap.servers": bootstrap,
            "acks": "all",
            "linger.ms": 5,
            "batch.size": 1_000_000,
            "batch.num.messages": 100_000,
            "queue.buffering.max.messages": 1_000_000,
        }
    )


def _produce(producer: Producer, topic: str, count: int, run: str) -> None:
    value = b"x" * 100
    for i in range(count):
        headers = [
            (DEFAULT_PRODUCER_HEADER, f"{run}-{i % PRODUCERS}".encode()),
            (DEFAULT_SEQUENCE_HEADER, str(i // PRODUCERS).encode()),
        ]
        while True:
            try:
                producer.produce(topic, value, headers=headers, partition=0)
                break
            except BufferError:
                producer.poll(0.05)
        if i % 10_000 == 0:
            producer.poll(0)
    assert producer.flush(300) == 0


def _admin(proxy: ProxyProcess, method: str, path: str, timeout_s: float = 900) -> object:
    request = urllib.request.Request(proxy.admin_url + path, method=method)
    with urllib.request.urlopen(request, timeout=timeout_s) as answer:
        return json.load(answer)


def measure_recovery(
    info: EnvInfo, proxy: ProxyProcess, tails: tuple[int, ...], rounds: int
) -> list[RecoveryRow]:
    rows = []
    direct = _producer(info.bootstrap)
    admin = AdminClient({"bootstrap.servers": info.bootstrap})
    for tail in tails:
        for round_ in range(rounds):
            topic = create_topic(info.bootstrap)
            _produce(direct, topic, tail, f"r{round_}")
            started = time.perf_counter()
            _admin(proxy, "POST", f"/v1/topics/{topic}/partitions/0/recover?wait_s=900")
            seconds = time.perf_counter() - started
            rows.append(RecoveryRow(tail, round_, seconds, tail / seconds))
            rate = tail / seconds
            print(f"recovery  tail {tail:>9,}  round {round_}  {seconds:7.3f} s  {rate:>11,.0f}/s")
            admin.delete_topics([topic])[topic].result(60)
    return rows


def _snapshots_taken(proxy: ProxyProcess) -> float:
    for line in proxy.metrics_text().splitlines():
        if line.startswith('dedup_snapshots_total{result="taken"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def measure_snapshot_cost(
    info: EnvInfo, proxies: dict[str, ProxyProcess], records: int, rounds: int
) -> list[ProduceRow]:
    rows = []
    admin = AdminClient({"bootstrap.servers": info.bootstrap})  # kept: its futures need it
    for round_ in range(rounds):
        for name, proxy in proxies.items():  # interleaved: a noisy moment hits both
            topic = create_topic(info.bootstrap)
            producer = _producer(proxy.bootstrap)
            _produce(producer, topic, 2_000, f"warm-{round_}")  # recovery and first snapshot
            before = _snapshots_taken(proxy)
            started = time.perf_counter()
            _produce(producer, topic, records, f"{name}-{round_}")
            seconds = time.perf_counter() - started
            taken = _snapshots_taken(proxy) - before
            rows.append(ProduceRow(name, round_, records, seconds, records / seconds, taken))
            rate = records / seconds
            print(f"produce   {name:13}  round {round_}  {rate:>9,.0f}/s  snapshots {taken:.0f}")
            admin.delete_topics([topic])[topic].result(60)
    return rows


def write_outputs(
    out: Path, recovery: list[RecoveryRow], produce: list[ProduceRow]
) -> dict[str, object]:
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("recovery_e2e.csv", recovery), ("snapshot_cost.csv", produce)):
        with (out / name).open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
            writer.writeheader()
            writer.writerows(asdict(r) for r in rows)
    summary: dict[str, object] = {
        "recovery_median_s": {
            str(t): statistics.median(r.seconds for r in recovery if r.tail_records == t)
            for t in sorted({r.tail_records for r in recovery})
        }
    }
    medians = {
        n: statistics.median(r.records_per_s for r in produce if r.target == n)
        for n in ("snapshots-on", "snapshots-off")
    }
    summary["produce_median_records_per_s"] = medians
    summary["snapshots_on_over_off"] = medians["snapshots-on"] / medians["snapshots-off"]
    (out / "recovery_e2e_summary.json").write_text(json.dumps(summary, indent=2))
    _plot(out / "recovery_e2e.png", recovery, produce)
    return summary


def _plot(path: Path, recovery: list[RecoveryRow], produce: list[ProduceRow]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    tails = sorted({r.tail_records for r in recovery})
    left.plot(
        [r.tail_records for r in recovery],
        [r.seconds for r in recovery],
        "o",
        alpha=0.5,
        label="rounds",
    )
    left.plot(
        tails,
        [statistics.median(r.seconds for r in recovery if r.tail_records == t) for t in tails],
        "-",
        label="median",
    )
    left.set_xscale("log")
    left.set_yscale("log")
    left.set_xlabel("tail records replayed")
    left.set_ylabel("recovery time (s): fence + replay + load")
    left.set_title("Recovery through the proxy")
    left.legend()
    names = ["snapshots-on", "snapshots-off"]
    right.boxplot([[r.records_per_s for r in produce if r.target == n] for n in names])
    right.set_xticks([1, 2], names)
    right.set_ylabel("records/s through the dedup proxy")
    right.set_title("Snapshot cost on produce (100 B, 1 partition)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for CSV, JSON, PNG")
    parser.add_argument("--quick", action="store_true", help="tails up to 100k, fewer records")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--keep-env", action="store_true", help="leave Kafka and Redis up")
    args = parser.parse_args(argv)
    tails = QUICK_TAILS if args.quick else TAILS
    records = 50_000 if args.quick else 200_000
    environment = LocalEnvironment()
    info = environment.up(brokers=1)
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        with (
            dedup_proxy(info, "snapshots-on", SNAPSHOTS_ON, args.out) as on,
            dedup_proxy(info, "snapshots-off", SNAPSHOTS_OFF, args.out) as off,
        ):
            recovery = measure_recovery(info, off, tails, args.rounds)
            produce = measure_snapshot_cost(
                info, {"snapshots-on": on, "snapshots-off": off}, records, args.rounds
            )
    finally:
        if not args.keep_env:
            environment.down()
    summary = write_outputs(args.out, recovery, produce)
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

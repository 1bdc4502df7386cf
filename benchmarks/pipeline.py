"""The whole pipeline: producer → (proxy →) Kafka → Spark's Kafka source → Parquet sink.

The same pipeline twice, side by side in interleaved rounds: producers writing straight to
Kafka ("direct"), and producers writing through the dedup proxy ("proxy"). Spark runs one
streaming query per round (trigger: as fast as it can) on a fresh topic; the producer
starts once the query runs.

One unrecorded warm-up round per path comes first.

- **Throughput:** N records sent as fast as one producer can; the clock runs from the
  first send to the commit of the micro-batch that holds the last record.
- **Latency:** records at a steady rate both paths sustain; per record, the time from its
  Kafka timestamp (set by the producer at send) to the write of the sink file holding it.
  Percentiles over every record of the round.

    DEDUP_LOCAL_HOME=/tmp/bench-pipeline DEDUP_LOCAL_KAFKA_PORT=26692 \\
        DEDUP_LOCAL_REDIS_PORT=17379 \\
        .venv/bin/python -m benchmarks.pipeline --out /tmp/bench-pipeline-out [--quick]

Writes pipeline.csv, pipeline_summary.json and pipeline.png to --out. The exit code does
not depend on the figures (a shared, noisy machine); it is non-zero only when a round's
sink does not hold exactly the records sent.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, TopicPartition

from dedup.client import DedupProducer
from dedup.spark.job import JobConfig, Trigger, start_query
from dedup.spark.runtime import start_session
from deploy.launcher import ProxyProcess
from deploy.local import LocalEnvironment
from deploy.topics import create_topic

MODES = ("direct", "proxy")
PROXY_PORTS = (26992, 26980, 26993)  # listen, admin, broker base: away from the tests


@dataclass(frozen=True)
class Row:
    mode: str
    phase: str  # throughput | latency
    round: int
    records: int
    seconds: float
    records_per_s: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    max_ms: float


def produce(bootstrap: str, topic: str, records: int, rate: float | None) -> float:
    """Sends `records` (paced at `rate` per second when given); returns the start time."""
    producer = DedupProducer(bootstrap, f"bench-{uuid.uuid4().hex[:6]}", **{"linger.ms": 5})
    value = b"x" * 100
    started = time.time()
    for sequence in range(records):
        producer.send(topic, value, sequence_id=sequence)
        if rate is not None:
            ahead = (sequence + 1) / rate - (time.time() - started)
            if ahead > 0.002:
                time.sleep(ahead)
    assert producer.flush(600) == 0
    return started


@dataclass(frozen=True)
class Round:
    mode: str  # direct | proxy
    phase: str  # throughput | latency
    index: int
    records: int
    rate: float | None  # records/s; None: as fast as the producer goes


def run_round(
    spark: Any, kafka: str, producer_bootstrap: str, work: Path, plan: Round, reassemble: bool
) -> Row:
    from pyspark.sql import functions as F

    mode, phase, index, records = plan.mode, plan.phase, plan.index, plan.records
    topic = create_topic(kafka, partitions=3)
    directory = work / f"{mode}-{phase}-{index}"
    config = JobConfig(
        bootstrap=kafka,
        topic=topic,
        output=directory / "sink",
        checkpoint=directory / "checkpoint",
        trigger=Trigger.CONTINUOUS,
        interval_s=0,
        reassemble=reassemble,
    )
    query = start_query(spark, config)
    while not (config.checkpoint / "metadata").exists():
        time.sleep(0.05)
    started = produce(producer_bootstrap, topic, records, plan.rate)
    # Done when a committed micro-batch reached the end of every partition. (Counting input
    # rows would not do: the chunk reassembly scans the source twice per micro-batch.)
    ends = end_offsets(kafka, topic)
    deadline = time.monotonic() + 600
    while not reached(query.lastProgress, topic, ends):
        assert time.monotonic() < deadline, f"{mode}/{phase}: the sink did not reach {ends}"
        time.sleep(0.05)
    commits = sorted((config.checkpoint / "commits").glob("[0-9]*"), key=lambda f: int(f.name))
    finished = commits[-1].stat().st_mtime
    query.stop()
    rows = spark.read.parquet(str(config.output))
    if rows.count() != records:
        raise RuntimeError(f"{mode}/{phase} round {index}: sink holds {rows.count()} of {records}")
    files = rows.select(F.input_file_name().alias("file"), "kafka_timestamp").toPandas()
    written = {f: os.stat(f.removeprefix("file:")).st_mtime for f in files["file"].unique()}
    latencies = sorted(
        (written[f] - ts.timestamp()) * 1000
        for f, ts in zip(files["file"], files["kafka_timestamp"], strict=True)
    )
    seconds = finished - started
    return Row(
        mode=mode,
        phase=phase,
        round=index,
        records=records,
        seconds=seconds,
        records_per_s=records / seconds,
        p50_ms=_percentile(latencies, 0.50),
        p95_ms=_percentile(latencies, 0.95),
        p99_ms=_percentile(latencies, 0.99),
        max_ms=latencies[-1],
    )


def end_offsets(bootstrap: str, topic: str) -> dict[str, int]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "bench-pipeline"})
    try:
        partitions = consumer.list_topics(topic, timeout=30).topics[topic].partitions
        return {
            str(p): consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1]
            for p in partitions
        }
    finally:
        consumer.close()


def reached(progress: Any, topic: str, ends: dict[str, int]) -> bool:
    if progress is None or not progress["sources"]:
        return False
    raw = progress["sources"][0]["endOffset"]  # {topic: {partition: offset}}, maybe as text
    end = (json.loads(raw) if isinstance(raw, str) else raw).get(topic, {})
    return all(end.get(p, -1) >= offset for p, offset in ends.items())


def _percentile(sorted_values: list[float], fraction: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(fraction * len(sorted_values)))]


def summarize(rows: list[Row]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for phase, field in (("throughput", "records_per_s"), ("latency", "p50_ms")):
        medians = {
            mode: statistics.median(
                getattr(r, field) for r in rows if r.mode == mode and r.phase == phase
            )
            for mode in MODES
        }
        summary[phase] = {
            "median_" + field: medians,
            "proxy_over_direct": medians["proxy"] / medians["direct"],
        }
    for mode in MODES:
        latency = [r for r in rows if r.mode == mode and r.phase == "latency"]
        summary["latency"][mode] = {
            stat: statistics.median(getattr(r, stat) for r in latency)
            for stat in ("p50_ms", "p95_ms", "p99_ms", "max_ms")
        }
    return summary


def plot(path: Path, rows: list[Row]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.boxplot(
        [[r.records_per_s for r in rows if r.mode == m and r.phase == "throughput"] for m in MODES]
    )
    left.set_xticks([1, 2], ["direct to Kafka", "through the proxy"])
    left.set_ylabel("records/s, producer to Spark's sink")
    left.set_title("Pipeline throughput (100 B records)")
    stats = ("p50_ms", "p95_ms", "p99_ms")
    for offset, mode in enumerate(MODES):
        latency = [r for r in rows if r.mode == mode and r.phase == "latency"]
        values = [statistics.median(getattr(r, s) for r in latency) for s in stats]
        right.bar([i + (offset - 0.5) * 0.38 for i in range(len(stats))], values, 0.38, label=mode)
    right.set_xticks(range(len(stats)), ["p50", "p95", "p99"])
    right.set_ylabel("ms, Kafka timestamp to sink file")
    right.set_title("End-to-end latency at a steady rate")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for CSV, JSON, PNG")
    parser.add_argument("--quick", action="store_true", help="fewer records, 2 rounds")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--keep-env", action="store_true", help="leave Kafka and Redis up")
    parser.add_argument(
        "--no-reassemble", action="store_true", help="the job without chunk reassembly"
    )
    args = parser.parse_args(argv)
    reassemble = not args.no_reassemble
    rounds = 2 if args.quick else args.rounds
    throughput_records = 30_000 if args.quick else 150_000
    latency_rate, latency_seconds = 1_000.0, (10 if args.quick else 20)
    environment = LocalEnvironment()
    info = environment.up(brokers=1)
    args.out.mkdir(parents=True, exist_ok=True)
    listen, admin, base = PROXY_PORTS
    proxy = ProxyProcess(
        upstream=info.bootstrap,
        listen_port=listen,
        admin_port=admin,
        extra_args=["--broker-port-base", str(base)],
        env={
            "DEDUP_PROXY_REDIS": info.redis,
            "DEDUP_PROXY_REDIS_KEY_PREFIX": f"bench-pipeline-{uuid.uuid4().hex[:6]}",
            "DEDUP_PROXY_INSTANCE_ID": f"bench-pipeline-{uuid.uuid4().hex[:6]}",
        },
        log_path=args.out / "proxy.log",
    ).start()
    spark = start_session()
    rows: list[Row] = []
    try:
        for mode in MODES:  # warm-up, not recorded: JIT, first connections, caches
            bootstrap = info.bootstrap if mode == "direct" else proxy.bootstrap
            warmup = Round(mode, "warmup", 0, 20_000, None)
            run_round(spark, info.bootstrap, bootstrap, args.out, warmup, reassemble)
        for index in range(rounds):
            for phase, records, rate in (
                ("throughput", throughput_records, None),
                ("latency", int(latency_rate * latency_seconds), latency_rate),
            ):
                for mode in MODES:
                    bootstrap = info.bootstrap if mode == "direct" else proxy.bootstrap
                    plan = Round(mode, phase, index, records, rate)
                    row = run_round(spark, info.bootstrap, bootstrap, args.out, plan, reassemble)
                    rows.append(row)
                    print(json.dumps(asdict(row)), flush=True)
    finally:
        spark.stop()
        proxy.stop()
        if not args.keep_env:
            environment.down()
    with (args.out / "pipeline.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)
    summary = summarize(rows)
    (args.out / "pipeline_summary.json").write_text(json.dumps(summary, indent=2))
    plot(args.out / "pipeline.png", rows)
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

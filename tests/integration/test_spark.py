"""The Spark job on real Kafka: Spark's own Kafka source over a deduplicated topic, the
exactly-once Parquet sink, restarts from the checkpoint after SIGKILL, the second line of
dedup, and the verifier. The control topic, written around the proxy, must show the
duplicates the proxy removes: that is how these tests can fail."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import Producer
from pyspark.sql import SparkSession

from dedup.chunks import ChunkMeta, chunk_headers, split_payload
from dedup.client import DedupProducer
from dedup.spark.job import JobConfig, SecondLine, run_query, start_query
from dedup.spark.runtime import start_session
from dedup.spark.verify import SinkReport, summarize_sink
from deploy.demo.processes import SparkJob
from deploy.launcher import ProxyProcess
from deploy.local import EnvInfo
from tests.support.spark_checkpoint import committed_batches, wait_for_commits
from tests.support.topics import new_topic

pytestmark = pytest.mark.integration

PRODUCERS = ("orders-a", "orders-b", "orders-c")
PER_PRODUCER = 2000
RESENT = range(500, 1500)  # what each producer sends again after a "restart"


@pytest.fixture(scope="module")
def spark() -> Iterator[SparkSession]:
    session = start_session()
    yield session
    session.stop()


def load_with_resends(bootstrap: str, topic: str) -> None:
    """Each producer sends 0..PER_PRODUCER-1, then restarts and sends RESENT again."""
    for name in PRODUCERS:
        producer = DedupProducer(bootstrap, name)
        for sequence in range(PER_PRODUCER):
            producer.send(topic, f"{name}:{sequence}".encode(), key=name, sequence_id=sequence)
        assert producer.flush(120) == 0
    for name in PRODUCERS:
        restarted = DedupProducer(bootstrap, name)
        for sequence in RESENT:
            restarted.send(topic, f"{name}:{sequence}".encode(), key=name, sequence_id=sequence)
        assert restarted.flush(120) == 0


def run_available_now(spark: SparkSession, config: JobConfig) -> SinkReport:
    run_query(start_query(spark, config))
    return summarize_sink(spark, config.output)


def job_config(bootstrap: str, topic: str, work: Path, **options: object) -> JobConfig:
    return JobConfig(
        bootstrap=bootstrap,
        topic=topic,
        output=work / "sink",
        checkpoint=work / "checkpoint",
        **options,  # type: ignore[arg-type]
    )


def test_spark_reads_each_record_once_from_the_deduplicated_topic(
    spark: SparkSession, dedup_proxy: ProxyProcess, local_env: EnvInfo, tmp_path: Path
) -> None:
    topic = new_topic(local_env.bootstrap, partitions=3)
    load_with_resends(dedup_proxy.bootstrap, topic)

    report = run_available_now(spark, job_config(local_env.bootstrap, topic, tmp_path))

    assert report.rows == len(PRODUCERS) * PER_PRODUCER
    assert (report.duplicates, report.gaps, report.rows_without_identity) == (0, 0, 0)
    assert [(p.producer, p.rows, p.min_sequence, p.max_sequence) for p in report.producers] == [
        (name, PER_PRODUCER, 0, PER_PRODUCER - 1) for name in PRODUCERS
    ]
    rows = spark.read.parquet(str(tmp_path / "sink")).select("producer", "sequence", "value")
    assert sorted((r.producer, r.sequence, bytes(r.value)) for r in rows.collect()) == sorted(
        (name, s, f"{name}:{s}".encode()) for name in PRODUCERS for s in range(PER_PRODUCER)
    )


def test_the_control_topic_written_around_the_proxy_shows_the_duplicates(
    spark: SparkSession, local_env: EnvInfo, tmp_path: Path
) -> None:
    topic = new_topic(local_env.bootstrap, partitions=3)
    load_with_resends(local_env.bootstrap, topic)  # straight into Kafka

    report = run_available_now(spark, job_config(local_env.bootstrap, topic, tmp_path))

    assert report.rows == len(PRODUCERS) * (PER_PRODUCER + len(RESENT))
    assert report.duplicates == len(PRODUCERS) * len(RESENT)
    assert all(p.duplicates == len(RESENT) for p in report.producers)
    verify = verify_cli(tmp_path / "sink")
    assert verify.returncode == 1, verify.stdout


def test_job_killed_mid_stream_and_restarted_from_its_checkpoint_is_exact(
    local_env: EnvInfo, tmp_path: Path
) -> None:
    """SIGKILL to the job (driver and JVM) twice while it streams; each restart continues
    from the checkpoint; the sink ends with every record exactly once."""
    topic = new_topic(local_env.bootstrap, partitions=2)
    total = 30_000
    producer = Producer({"bootstrap.servers": local_env.bootstrap, "linger.ms": 20})
    for sequence in range(total):
        headers = [("dedup.producer", b"p"), ("dedup.sequence", str(sequence).encode())]
        producer.produce(topic, str(sequence).encode(), headers=headers)
        if sequence % 10_000 == 0:
            producer.flush()
    assert producer.flush(60) == 0

    sink, checkpoint = tmp_path / "sink", tmp_path / "checkpoint"
    common = [
        *("--bootstrap", local_env.bootstrap, "--topic", topic),
        *("--output", str(sink), "--checkpoint", str(checkpoint)),
    ]
    streaming = [*common, "--trigger", "continuous", "--interval-s", "0.1"]
    streaming += ["--max-offsets-per-trigger", "1500"]  # 20 micro-batches in all
    job = SparkJob(streaming, tmp_path / "spark.log", tmp_path / "ready")
    commits_at_kill = []
    for kill_after in (3, 8):
        job.start()
        job.wait_ready(180)
        wait_for_commits(checkpoint, kill_after)
        job.kill()
        commits_at_kill.append(committed_batches(checkpoint))
    assert commits_at_kill[-1] < total // 1500, "the job finished before it was killed"

    finish = SparkJob([*common, "--trigger", "available-now"], job.log_path, job.ready_file)
    finish.start()
    assert finish.wait(300) == 0, (tmp_path / "spark.log").read_text()[-3000:]

    verify = verify_cli(sink, "--expect-rows", str(total), "--json", str(tmp_path / "v.json"))
    assert verify.returncode == 0, verify.stdout
    checked = json.loads((tmp_path / "v.json").read_text())
    assert (checked["rows"], checked["distinct"], checked["duplicates"]) == (total, total, 0)


def test_second_line_drops_repeats_of_a_key_within_the_watermark(
    spark: SparkSession, local_env: EnvInfo, tmp_path: Path
) -> None:
    """Requests retried by an HTTP client reach Kafka as new messages (new sequence ids)
    that carry the same idempotency key; only Spark's dedup on that key can drop them."""
    topic = new_topic(local_env.bootstrap)
    producer = Producer({"bootstrap.servers": local_env.bootstrap})
    keys = [f"req-{i}" for i in range(300)] + [f"req-{i}" for i in range(100, 200)]
    for sequence, key in enumerate(keys):
        headers = [
            ("dedup.producer", b"gateway"),
            ("dedup.sequence", str(sequence).encode()),
            ("idempotency-key", key.encode()),
        ]
        producer.produce(topic, key.encode(), headers=headers)
    assert producer.flush(60) == 0

    plain = run_available_now(spark, job_config(local_env.bootstrap, topic, tmp_path / "plain"))
    assert plain.rows == 400  # every sequence id is new: nothing for the proxy to drop

    second_line = SecondLine(within="1 hour", key_header="idempotency-key")
    config = job_config(local_env.bootstrap, topic, tmp_path / "keyed", second_line=second_line)
    run_query(start_query(spark, config))
    rows = spark.read.parquet(str(config.output)).select("value").collect()
    assert sorted(bytes(r.value).decode() for r in rows) == sorted(f"req-{i}" for i in range(300))


def test_verify_refuses_a_directory_that_is_not_a_sink(tmp_path: Path) -> None:
    result = verify_cli(tmp_path)
    assert result.returncode == 2
    assert "is not the output of a Spark file sink" in result.stderr


def verify_cli(sink: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dedup", "spark", "verify", "--output", str(sink), *extra],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def chunk_record(
    producer: str, sequence: int, uuid: str, chunk_id: int, count: int, total: int
) -> list[tuple[str, bytes]]:
    return [
        ("dedup.producer", producer.encode()),
        ("dedup.sequence", str(sequence).encode()),
        *chunk_headers(ChunkMeta(uuid, chunk_id, count, total)),
    ]


def test_chunked_messages_arrive_as_one_row_across_micro_batches(
    spark: SparkSession, local_env: EnvInfo, tmp_path: Path
) -> None:
    """A 6 MB message in 7 chunks, one chunk per micro-batch, with a chunk written twice
    (a re-send around the proxy), between whole records; and a message whose last chunk
    never comes, which ends as an incomplete row when the producer moves on."""
    topic = new_topic(local_env.bootstrap)
    big = bytes(range(256)) * (6 * 1024 * 1024 // 256)
    chunks = split_payload(big, 900 * 1024)
    producer = Producer({"bootstrap.servers": local_env.bootstrap, "linger.ms": 0})

    def send(value: bytes, headers: list[tuple[str, bytes]]) -> None:
        producer.produce(topic, value, headers=headers)
        producer.flush(30)

    send(b"whole-9", [("dedup.producer", b"p"), ("dedup.sequence", b"9")])
    for chunk_id, chunk in enumerate(chunks):
        meta = chunk_record("p", 10, "p-10", chunk_id, len(chunks), len(big))
        send(chunk, meta)
        if chunk_id == 3:
            send(chunk, meta)  # the same chunk again
    send(b"ab", chunk_record("p", 11, "p-11", 0, 3, 5))  # 2 of 3 chunks, then moves on
    send(b"cd", chunk_record("p", 11, "p-11", 1, 3, 5))
    send(b"whole-12", [("dedup.producer", b"p"), ("dedup.sequence", b"12")])
    send(b"xyz", chunk_record("p", 13, "p-13", 0, 2, 4))
    send(b"w", chunk_record("p", 13, "p-13", 1, 2, 4))

    config = job_config(local_env.bootstrap, topic, tmp_path, max_offsets_per_trigger=1)
    run_query(start_query(spark, config))
    rows = {
        r.sequence: r
        for r in spark.read.parquet(str(config.output))
        .select("sequence", "value", "chunks_missing", "offset", "headers")
        .collect()
    }
    assert sorted(rows) == [9, 10, 11, 12, 13]
    assert bytes(rows[10].value) == big and rows[10].chunks_missing == 0
    assert {h.key for h in rows[10].headers} == {"dedup.producer", "dedup.sequence"}
    assert rows[10].offset == 1  # the message's first chunk
    assert rows[11].value is None and rows[11].chunks_missing == 1
    assert bytes(rows[13].value) == b"xyzw"
    assert (bytes(rows[9].value), bytes(rows[12].value)) == (b"whole-9", b"whole-12")


def test_a_6_mb_message_sent_twice_through_the_proxy_is_one_row_in_the_sink(
    spark: SparkSession, dedup_proxy: ProxyProcess, local_env: EnvInfo, tmp_path: Path
) -> None:
    """The whole path: DedupProducer chunks the message, the proxy keeps each chunk once
    (the re-send adds nothing), Spark joins the chunks into one row."""
    topic = new_topic(local_env.bootstrap, partitions=2)
    message = bytes(range(251)) * (6_000_000 // 251)
    for _ in range(2):  # the second producer is the first one restarted
        producer = DedupProducer(dedup_proxy.bootstrap, "big-files")
        producer.send(topic, b"before", key="k", sequence_id=9)
        producer.send(topic, message, key="k", sequence_id=10)
        producer.send(topic, b"after", key="k", sequence_id=11)
        assert producer.flush(120) == 0

    report = run_available_now(spark, job_config(local_env.bootstrap, topic, tmp_path))

    assert (report.rows, report.duplicates, report.incomplete) == (3, 0, 0)
    rows = spark.read.parquet(str(tmp_path / "sink")).orderBy("sequence").collect()
    assert [r.sequence for r in rows] == [9, 10, 11]
    assert bytes(rows[1].value) == message

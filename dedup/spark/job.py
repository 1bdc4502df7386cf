"""The Structured Streaming job: a deduplicated topic, read with Spark's own Kafka source,
written exactly once to Parquet files.

Why this is exactly once end to end (the consumer half of PIP-6, the seed's "effectively
once" reader): the proxy keeps each (producer, sequence) once in the topic; Spark's Kafka
source records the offsets of every micro-batch in the checkpoint before running it, and the
file sink commits a batch's files in its own log (`_spark_metadata`) under the batch id. A
job killed at any point re-runs the last batch from the same offsets, and the sink ignores
a batch id it already committed: no row is lost or written twice. Readers must read the
sink through Spark (which honours `_spark_metadata`), not by listing its files.

Rows keep the producer and sequence from the record headers (`includeHeaders`), so any
reader can check for duplicates and gaps (`dedup-proxy spark verify`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

from dedup.batches import DEFAULT_HEADERS, IdentityHeaders
from dedup.spark.chunks import DEFAULT_EXPIRE_AFTER_S, reassemble_chunks
from dedup.spark.rows import header_value, with_identity

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.streaming.query import StreamingQuery


class Trigger(StrEnum):
    AVAILABLE_NOW = "available-now"  # everything in the topic now, then stop
    CONTINUOUS = "continuous"  # a micro-batch every interval until stopped


@dataclass(frozen=True)
class SecondLine:
    """Spark-side dedup on a key within an event-time watermark, for sources the proxy
    cannot cover (re-sends that carry a new sequence, such as HTTP requests retried with an
    idempotency key). Bounded by the watermark: a copy arriving later than `within` after
    the newest event seen is not recognised, and its state lives that long."""

    within: str  # a Spark interval, e.g. "10 minutes"
    key_header: str | None = None  # a header holding the key; None: (producer, sequence)


@dataclass(frozen=True)
class JobConfig:
    bootstrap: str
    topic: str  # one topic, or a comma-separated list
    output: Path  # the Parquet sink
    checkpoint: Path
    trigger: Trigger = Trigger.AVAILABLE_NOW
    interval_s: float = 2.0  # for Trigger.CONTINUOUS
    starting_offsets: str = "earliest"
    max_offsets_per_trigger: int | None = None
    second_line: SecondLine | None = None
    # Chunked messages joined into one row each (adds the `chunks_missing` column).
    reassemble: bool = True
    chunk_expire_s: float = DEFAULT_EXPIRE_AFTER_S
    identity: IdentityHeaders = DEFAULT_HEADERS
    # Extra options for the Kafka source, e.g. {"kafka.security.protocol": "SSL"}.
    kafka_options: Mapping[str, str] = field(default_factory=dict)

    @property
    def query_name(self) -> str:
        return "dedup_sink_" + "".join(c if c.isalnum() else "_" for c in self.topic)


def read_topic(spark: SparkSession, config: JobConfig) -> DataFrame:
    """The topic as Spark's Kafka source gives it, headers included. `failOnDataLoss`
    stays on: a record deleted before the job read it must stop the job, not vanish."""
    reader = (
        spark.readStream.format("kafka")
        .option("kafka.bootstrap.servers", config.bootstrap)
        .option("subscribe", config.topic)
        .option("startingOffsets", config.starting_offsets)
        .option("includeHeaders", "true")
        .option("failOnDataLoss", "true")
    )
    if config.max_offsets_per_trigger is not None:
        reader = reader.option("maxOffsetsPerTrigger", str(config.max_offsets_per_trigger))
    for name, value in config.kafka_options.items():
        reader = reader.option(name, value)
    return reader.load()


def drop_duplicates_within(rows: DataFrame, second_line: SecondLine) -> DataFrame:
    keyed = rows
    keys = ["producer", "sequence"]
    if second_line.key_header is not None:
        keyed = rows.withColumn("dedup_key", header_value(second_line.key_header))
        keys = ["dedup_key"]
    return keyed.withWatermark("kafka_timestamp", second_line.within).dropDuplicatesWithinWatermark(
        keys
    )


Transform = Callable[["DataFrame"], "DataFrame"]


def build_rows(spark: SparkSession, config: JobConfig, *steps: Transform) -> DataFrame:
    """The rows the sink receives: identity columns, chunked messages joined, then any
    extra steps, then the optional second line of dedup."""
    rows = with_identity(read_topic(spark, config), config.identity)
    if config.reassemble:
        rows = reassemble_chunks(rows, config.chunk_expire_s)
    for step in steps:
        rows = step(rows)
    if config.second_line is not None:
        rows = drop_duplicates_within(rows, config.second_line)
    return rows


def start_query(spark: SparkSession, config: JobConfig, *steps: Transform) -> StreamingQuery:
    writer = (
        build_rows(spark, config, *steps)
        .writeStream.format("parquet")
        .queryName(config.query_name)
        .outputMode("append")
        .option("path", str(config.output))
        .option("checkpointLocation", str(config.checkpoint))
    )
    if config.trigger is Trigger.AVAILABLE_NOW:
        writer = writer.trigger(availableNow=True)
    else:
        writer = writer.trigger(processingTime=f"{config.interval_s} seconds")
    return writer.start()


ProgressCallback = Callable[[dict[str, object]], None]


def run_query(
    query: StreamingQuery,
    on_progress: ProgressCallback | None = None,
    should_stop: Callable[[], bool] | None = None,
    poll_s: int = 1,
) -> None:
    """Wait for the query, reporting each new micro-batch's progress. A continuous query
    runs until `should_stop` says so; it is then stopped between micro-batches' commits
    (a stop mid-batch is safe too: the batch is re-run from the checkpoint)."""
    last_batch = -1
    while query.isActive:
        if should_stop is not None and should_stop():
            query.stop()
            break
        query.awaitTermination(poll_s)
        progress = query.lastProgress
        if progress is not None and on_progress is not None:
            batch = int(progress["batchId"])
            if batch != last_batch:
                last_batch = batch
                on_progress(dict(progress))
    # Raises the query's own failure, if it failed.
    exception = query.exception()
    if exception is not None:
        raise exception

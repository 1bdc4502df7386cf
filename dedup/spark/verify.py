"""What the sink holds: rows, duplicates per (producer, sequence) and gaps per producer.

Read through Spark, so that only committed micro-batches count (the file sink's
`_spark_metadata` log), exactly what any downstream Spark reader sees.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


class Scope(StrEnum):
    """Where a producer's sequence ids are unique. DedupProducer numbers per topic;
    identities taken from Kafka's idempotent producer (`kafka-pid-…`) number per partition."""

    TOPIC = "topic"
    PARTITION = "partition"


@dataclass(frozen=True)
class ProducerSummary:
    topic: str
    partition: int | None  # None in Scope.TOPIC
    producer: str
    rows: int
    distinct: int
    duplicates: int  # rows - distinct
    min_sequence: int
    max_sequence: int
    gaps: int  # sequence ids missing between min and max


@dataclass(frozen=True)
class SinkReport:
    rows: int
    distinct: int
    duplicates: int
    gaps: int
    rows_without_identity: int
    incomplete: int  # chunked messages that ended without all their chunks
    producers: list[ProducerSummary]

    @property
    def clean(self) -> bool:
        return not any((self.duplicates, self.gaps, self.rows_without_identity, self.incomplete))

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "clean": self.clean}

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")


def summarize_sink(
    spark: SparkSession,
    sink: Path,
    scope: Scope = Scope.TOPIC,
    topics: Sequence[str] | None = None,
) -> SinkReport:
    """The report of the sink's rows, or of the rows of `topics` only (a job reading
    several topics writes them all to one sink)."""
    from pyspark.sql import functions as F

    if not (sink / "_spark_metadata").is_dir():
        raise FileNotFoundError(f"{sink} is not the output of a Spark file sink")
    if not any((sink / "_spark_metadata").iterdir()):
        return SinkReport(0, 0, 0, 0, 0, 0, [])  # no micro-batch committed yet
    rows = spark.read.parquet(str(sink))
    if topics:
        rows = rows.where(F.col("topic").isin(list(topics)))
    identified = rows.where(F.col("producer").isNotNull() & F.col("sequence").isNotNull())
    group = ["topic", "producer"] if scope is Scope.TOPIC else ["topic", "partition", "producer"]
    per_producer = (
        identified.groupBy(*group)
        .agg(
            F.count(F.lit(1)).alias("rows"),
            F.count_distinct("sequence").alias("distinct"),
            F.min("sequence").alias("min_sequence"),
            F.max("sequence").alias("max_sequence"),
        )
        .orderBy(*group)
        .collect()
    )
    summaries = [
        ProducerSummary(
            topic=row["topic"],
            partition=row["partition"] if scope is Scope.PARTITION else None,
            producer=row["producer"],
            rows=row["rows"],
            distinct=row["distinct"],
            duplicates=row["rows"] - row["distinct"],
            min_sequence=row["min_sequence"],
            max_sequence=row["max_sequence"],
            gaps=row["max_sequence"] - row["min_sequence"] + 1 - row["distinct"],
        )
        for row in per_producer
    ]
    total = rows.count()
    without_identity = total - sum(s.rows for s in summaries)
    incomplete = (
        rows.where(F.col("chunks_missing") > 0).count() if "chunks_missing" in rows.columns else 0
    )
    return SinkReport(
        rows=total,
        distinct=sum(s.distinct for s in summaries),
        duplicates=sum(s.duplicates for s in summaries),
        gaps=sum(s.gaps for s in summaries),
        rows_without_identity=without_identity,
        incomplete=incomplete,
        producers=summaries,
    )

"""The shape of the job's rows: Kafka's columns plus the dedup identity from the headers."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dedup.batches import DEFAULT_HEADERS, IdentityHeaders

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame


def header_value(name: str) -> Column:
    """The last value of header `name` as a string, NULL when absent."""
    from pyspark.sql import functions as F

    matching = F.filter(F.col("headers"), lambda h: h["key"] == F.lit(name))
    return F.try_element_at(matching, F.lit(-1))["value"].cast("string")


def with_identity(raw: DataFrame, identity: IdentityHeaders = DEFAULT_HEADERS) -> DataFrame:
    """Source rows plus `producer` and `sequence` from the identity headers, and the time
    the row entered its micro-batch (for end-to-end latency)."""
    from pyspark.sql import functions as F

    return raw.select(
        F.col("topic"),
        F.col("partition"),
        F.col("offset"),
        F.col("timestamp").alias("kafka_timestamp"),
        F.col("key"),
        F.col("value"),
        F.col("headers"),
        header_value(identity.producer).alias("producer"),
        header_value(identity.sequence).try_cast("bigint").alias("sequence"),
        F.current_timestamp().alias("ingested_at"),
    )

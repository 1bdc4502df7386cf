"""The consumer half of end-to-end exactly-once: a Spark Structured Streaming job that reads
a deduplicated topic with Spark's own Kafka source and writes it through an exactly-once
sink (Parquet files and a checkpoint), and a verifier of that sink."""

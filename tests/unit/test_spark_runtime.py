"""Which of the cached Kafka source jars the Spark job hands to Spark."""

from __future__ import annotations

from pathlib import Path

import pyspark
import pytest

from dedup.spark.runtime import _artifact, kafka_source_jars
from deploy.paths import SPARK_VERSION, MissingRuntimeError

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("file_name", "artifact"),
    [
        ("spark-sql-kafka-0-10_2.13-4.0.0.jar", "spark-sql-kafka-0-10_2.13"),
        ("kafka-clients-3.9.0.jar", "kafka-clients"),
        ("scala-library-2.13.15.jar", "scala-library"),
        ("hadoop-client-runtime-3.4.1.jar", "hadoop-client-runtime"),
        ("snappy-java-1.1.10.5.jar", "snappy-java"),
        ("zstd-jni-1.5.6-9.jar", "zstd-jni"),
        ("spark-core_2.13-4.0.0-preview2.jar", "spark-core_2.13"),
        ("no-version.jar", "no-version.jar"),
    ],
)
def test_artifact_name_drops_the_version(file_name: str, artifact: str) -> None:
    assert _artifact(file_name) == artifact


def test_jars_pyspark_already_ships_are_left_out(tmp_path: Path) -> None:
    """A second copy of a class on the classpath (here scala-library, another version) is
    how Spark jobs break; only what pyspark lacks is added."""
    names = [
        f"spark-sql-kafka-0-10_2.13-{SPARK_VERSION}.jar",
        f"spark-token-provider-kafka-0-10_2.13-{SPARK_VERSION}.jar",
        "kafka-clients-3.9.0.jar",
        "commons-pool2-2.12.0.jar",
        "scala-library-2.13.1.jar",
        "hadoop-client-api-3.0.0.jar",
        "slf4j-api-1.7.36.jar",
    ]
    for name in names:
        (tmp_path / name).write_bytes(b"")
    chosen = {jar.name for jar in kafka_source_jars(tmp_path)}
    assert chosen == set(names[:4])
    shipped = {_artifact(j.name) for j in (Path(pyspark.__file__).parent / "jars").glob("*.jar")}
    assert {"scala-library", "hadoop-client-api", "slf4j-api"} <= shipped


def test_a_missing_kafka_source_says_how_to_get_it(tmp_path: Path) -> None:
    with pytest.raises(MissingRuntimeError, match=r"deploy/setup\.sh"):
        kafka_source_jars(tmp_path)

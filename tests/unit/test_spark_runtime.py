"""Which of the cached Kafka source jars the Spark job hands to Spark, and the session's
settings on a local and a standalone master."""

from __future__ import annotations

from pathlib import Path

import pyspark
import pytest

from dedup.spark.runtime import (
    SparkResources,
    _artifact,
    kafka_source_jars,
    master_on_this_host,
    session_conf,
)
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


@pytest.mark.parametrize(
    ("master", "here"),
    [
        ("local[2]", True),
        ("local", True),
        ("local-cluster[2,1,1024]", True),
        ("spark://127.0.0.1:30700", True),
        ("spark://localhost:7077,127.0.0.1:7078", True),
        ("spark://spark-master:7077", False),
        ("spark://127.0.0.1:7077,10.0.0.2:7077", False),
        ("yarn", False),
        ("k8s://https://10.0.0.1:6443", False),
    ],
)
def test_the_driver_stays_on_loopback_only_when_every_process_is_on_this_host(
    master: str, here: bool
) -> None:
    assert master_on_this_host(master) is here


def test_executor_sizes_are_sparks_defaults_unless_given() -> None:
    jars = [Path("/cache/a.jar"), Path("/cache/b.jar")]
    default = session_conf(SparkResources(), jars)
    assert default["spark.jars"] == "/cache/a.jar,/cache/b.jar"
    assert "spark.executor.memory" not in default and "spark.executor.cores" not in default
    sized = SparkResources(
        master="spark://127.0.0.1:30700",
        executor_memory="768m",
        executor_cores=1,
        extra_conf=(("spark.cores.max", "2"), ("spark.sql.shuffle.partitions", "4")),
    )
    conf = session_conf(sized, jars)
    assert (conf["spark.executor.memory"], conf["spark.executor.cores"]) == ("768m", "1")
    # Extra settings come last, so they can override the job's own.
    assert (conf["spark.cores.max"], conf["spark.sql.shuffle.partitions"]) == ("2", "4")

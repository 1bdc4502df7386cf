"""The Spark session the job runs in: pinned pyspark, Spark's Kafka source from the local
cache (no network at start), sized for a small machine unless told otherwise."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

# A directory holding Spark's Kafka source and its dependencies, instead of the cache.
JARS_DIR_ENV = "DEDUP_SPARK_JARS_DIR"
INSTALL_HINT = "install it with: pip install 'kafka-dedup-proxy[spark]'"
JARS_HINT = (
    f"resolve them there (`bash deploy/setup.sh` in a checkout of the project does), or point "
    f"{JARS_DIR_ENV} at a directory holding spark-sql-kafka-0-10 and its dependencies"
)


class MissingRuntimeError(RuntimeError):
    """Something needed at run time and installed apart from this package (pyspark, Spark's
    Kafka source, a program) is missing."""


def cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The project's cache: ``${XDG_CACHE_HOME or ~/.cache}/kafka-dedup-proxy``."""
    env = os.environ if environ is None else environ
    value = env.get("XDG_CACHE_HOME", "")
    # XDG says relative values are invalid and must be ignored.
    base = Path(value) if value and os.path.isabs(value) else Path.home() / ".cache"
    return base / "kafka-dedup-proxy"


def spark_version() -> str:
    """The installed pyspark's version, the version of the Kafka source the job loads."""
    try:
        import pyspark
    except ImportError as exc:
        raise MissingRuntimeError(f"pyspark is not installed: {INSTALL_HINT}") from exc
    return str(pyspark.__version__)


def spark_jars_dir(environ: Mapping[str, str] | None = None, version: str | None = None) -> Path:
    """Where the job finds Spark's Kafka source: $DEDUP_SPARK_JARS_DIR, else
    ``<cache_dir>/spark-<version>/jars`` (version: the installed pyspark's)."""
    env = os.environ if environ is None else environ
    explicit = env.get(JARS_DIR_ENV, "")
    if explicit:
        return Path(explicit).expanduser()
    return cache_dir(env) / f"spark-{version or spark_version()}" / "jars"


# artifactId-version.jar; a version has a dot (so "-0-10_2.13" stays in the artifact id).
_JAR_NAME = re.compile(r"^(?P<artifact>.+?)-(?P<version>\d+(?:\.\d+)+(?:[-.][A-Za-z0-9]+)*)\.jar$")


@dataclass(frozen=True)
class SparkResources:
    """Where and how big the job runs. `master` and the Kafka bootstrap (in the job's
    config) are the only things that must change on a cluster; the executor sizes are
    Spark's defaults unless given (a standalone worker runs an executor only if it has the
    memory and cores one asks for)."""

    master: str = "local[2]"
    driver_memory: str = "1g"
    shuffle_partitions: int = 2
    app_name: str = "kafka-dedup-spark"
    executor_memory: str | None = None  # spark.executor.memory
    executor_cores: int | None = None  # spark.executor.cores
    # Any other Spark setting, e.g. ("spark.cores.max", "4"); applied last.
    extra_conf: tuple[tuple[str, str], ...] = ()


_LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "[::1]"})


def master_on_this_host(master: str) -> bool:
    """Whether every process of the job runs on this host: a local master, or a standalone
    master (``spark://host:port``, several for standby masters) on a loopback address."""
    if master.startswith("local"):  # local, local[N], local-cluster[...]
        return True
    if not master.startswith("spark://"):
        return False
    hosts = [hp.rpartition(":")[0] for hp in master.removeprefix("spark://").split(",")]
    return all(host in _LOOPBACK_HOSTS for host in hosts)


def session_conf(settings: SparkResources, jars: list[Path]) -> dict[str, str]:
    """The Spark settings of the job's session (the master aside)."""
    conf = {
        # Shipped to the executors by the driver on any master: a worker has none of them.
        "spark.jars": ",".join(str(jar) for jar in jars),
        "spark.driver.memory": settings.driver_memory,
        "spark.sql.shuffle.partitions": str(settings.shuffle_partitions),
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        # Micro-batches only for new data. With them on, the chunk reassembly's
        # processing-time timeout asks for a batch after every batch, so an availableNow
        # query would never end; timeouts are then processed when data arrives.
        "spark.sql.streaming.noDataMicroBatches.enabled": "false",
        # One state store instance per partition is plenty here, and RocksDB keeps the
        # state off the JVM heap when the job meets big chunked messages.
        "spark.sql.streaming.stateStore.providerClass": (
            "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
        ),
    }
    if settings.executor_memory is not None:
        conf["spark.executor.memory"] = settings.executor_memory
    if settings.executor_cores is not None:
        conf["spark.executor.cores"] = str(settings.executor_cores)
    conf.update(settings.extra_conf)
    return conf


def kafka_source_jars(jars_dir: Path | None = None) -> list[Path]:
    """The Kafka source's jars that pyspark does not already ship (same artifact, maybe
    another version: two copies of a class on one classpath is how Spark jobs break)."""
    version = spark_version()
    import pyspark

    directory = jars_dir or spark_jars_dir(version=version)
    source = directory / f"spark-sql-kafka-0-10_2.13-{version}.jar"
    if not source.is_file():
        raise MissingRuntimeError(
            f"Spark {version}'s Kafka source not found in {directory}: {JARS_HINT}"
        )
    shipped_dir = Path(pyspark.__file__).parent / "jars"
    shipped = {_artifact(jar.name) for jar in shipped_dir.glob("*.jar")}
    return sorted(jar for jar in directory.glob("*.jar") if _artifact(jar.name) not in shipped)


def _artifact(file_name: str) -> str:
    match = _JAR_NAME.match(file_name)
    return match.group("artifact") if match else file_name


def start_session(resources: SparkResources | None = None) -> SparkSession:
    """A Spark session with the Kafka source on its classpath. Python workers, the
    executors' included, run this interpreter, so they see the same packages (pandas,
    pyarrow, this one) as the driver: on a cluster the same path must hold the same
    environment on every worker."""
    spark_version()  # pyspark is installed, or the error says how to install it
    from pyspark.sql import SparkSession

    settings = resources or SparkResources()
    conf = session_conf(settings, kafka_source_jars())
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    if master_on_this_host(settings.master):
        # Everything is on this host: the driver stays on loopback, where the executors
        # reach it, instead of looking for a routable address.
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    builder = SparkSession.builder.master(settings.master).appName(settings.app_name)
    for name, value in conf.items():
        builder = builder.config(name, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("WARN")
    return session

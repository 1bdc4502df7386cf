"""Where the local environment's pieces live: the Kafka jars, Spark's Kafka source and the
Toxiproxy server (a cache outside the repo, filled by deploy/setup.sh), the state home, the
packaged config files, the executables; and the pinned versions, each written once: Kafka's
in kafka/pom.xml, Spark's in spark/pom.xml (equal to the product's pyspark pin), the rest in
versions.env. deploy/setup.sh reads the same files."""

from __future__ import annotations

import os
import shutil
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from pathlib import Path

from dedup.spark.runtime import MissingRuntimeError as MissingRuntimeError
from dedup.spark.runtime import cache_dir as cache_dir
from dedup.spark.runtime import spark_jars_dir as _product_spark_jars_dir

HERE = Path(__file__).resolve().parent
RESOURCES = HERE / "kafka"
KAFKA_POM = RESOURCES / "pom.xml"
SPARK_POM = HERE / "spark" / "pom.xml"
VERSIONS_ENV = HERE / "versions.env"
KAFKA_LOG4J2_CONFIG = RESOURCES / "log4j2.properties"
TOOLS_LOG4J2_CONFIG = RESOURCES / "tools-log4j2.properties"
SETUP_HINT = "run `bash deploy/setup.sh` first"


def pom_property(pom: Path, name: str) -> str:
    """A property of a Maven descriptor (``<properties><name>value</name>``)."""
    root = ET.parse(pom).getroot()
    namespace = root.tag.partition("}")[0] + "}" if root.tag.startswith("{") else ""
    value = root.findtext(f"{namespace}properties/{namespace}{name}")
    if not value or not value.strip():
        raise ValueError(f"{pom} has no property {name}")
    return value.strip()


def env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines (comments and blank lines skipped), as deploy/setup.sh sources them."""
    values: dict[str, str] = {}
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{path}:{number}: not KEY=VALUE: {raw!r}")
        values[key.strip()] = value.strip()
    return values


KAFKA_VERSION = pom_property(KAFKA_POM, "kafka.version")
# The pinned pyspark's version; deploy/setup.sh resolves Spark's Kafka source at it.
SPARK_VERSION = pom_property(SPARK_POM, "spark.version")
TOXIPROXY_VERSION = env_file(VERSIONS_ENV)["TOXIPROXY_VERSION"]


def kafka_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    return cache_dir(environ) / f"kafka-{KAFKA_VERSION}"


def toxiproxy_dir(environ: Mapping[str, str] | None = None) -> Path:
    return cache_dir(environ) / f"toxiproxy-{TOXIPROXY_VERSION}"


def spark_jars_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where the Spark job looks for Spark's Kafka source (the product's rule)."""
    return _product_spark_jars_dir(environ, version=SPARK_VERSION)


def kafka_libs_dir(environ: Mapping[str, str] | None = None) -> Path:
    return kafka_cache_dir(environ) / "libs"


def state_home(environ: Mapping[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    explicit = env.get("DEDUP_LOCAL_HOME", "")
    if explicit:
        return Path(explicit).expanduser().resolve()
    value = env.get("XDG_STATE_HOME", "")
    # XDG says relative values are invalid and must be ignored.
    base = Path(value) if value and os.path.isabs(value) else Path.home() / ".local" / "state"
    return base / "kafka-dedup-proxy" / "local"


def kafka_classpath() -> str:
    """The JVM classpath of the cached jars (a wildcard, expanded by the JVM itself)."""
    libs = kafka_libs_dir()
    if not (libs / f"kafka_2.13-{KAFKA_VERSION}.jar").is_file():
        raise MissingRuntimeError(f"Kafka {KAFKA_VERSION} jars not found in {libs}: {SETUP_HINT}")
    return f"{libs}/*"


def java_executable() -> str:
    java_home = os.environ.get("JAVA_HOME", "")
    if java_home:
        candidate = Path(java_home) / "bin" / "java"
        if os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("java")
    if found is None:
        raise MissingRuntimeError(f"java (>= 17) not found: {SETUP_HINT}")
    return found


def redis_server_executable() -> str:
    found = shutil.which("redis-server")
    if found is None:
        raise MissingRuntimeError(f"redis-server not found: {SETUP_HINT}")
    return found


def toxiproxy_server() -> str:
    """The Toxiproxy server the chaos tests put between clients, the proxy and Kafka."""
    binary = toxiproxy_dir() / "toxiproxy-server"
    if not os.access(binary, os.X_OK):
        raise MissingRuntimeError(
            f"Toxiproxy {TOXIPROXY_VERSION} not found at {binary}: {SETUP_HINT} "
            f"(it builds Toxiproxy from source, which needs Go)"
        )
    return str(binary)

"""Where the local environment's pieces live: the Kafka jars, Spark's Kafka source and the
Toxiproxy server (a cache outside the repo, filled by deploy/setup.sh), the state home, the
packaged config files, the executables."""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path

KAFKA_VERSION = "4.3.1"
# deploy/setup.sh builds this release with Go; keep the two in step.
TOXIPROXY_VERSION = "2.12.0"
# The pinned pyspark's version; deploy/setup.sh resolves Spark's Kafka source at it.
SPARK_VERSION = "4.0.0"
RESOURCES = Path(__file__).resolve().parent / "kafka"
KAFKA_LOG4J2_CONFIG = RESOURCES / "log4j2.properties"
TOOLS_LOG4J2_CONFIG = RESOURCES / "tools-log4j2.properties"
SETUP_HINT = "run `bash deploy/setup.sh` first"


class MissingRuntimeError(RuntimeError):
    """A program or the Kafka jars the local environment needs are not installed."""


def _xdg(env: Mapping[str, str], name: str, fallback: str) -> Path:
    value = env.get(name, "")
    # XDG says relative values are invalid and must be ignored.
    if value and os.path.isabs(value):
        return Path(value)
    return Path.home() / fallback


def cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    return _xdg(env, "XDG_CACHE_HOME", ".cache") / "kafka-dedup-proxy"


def kafka_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    return cache_dir(environ) / f"kafka-{KAFKA_VERSION}"


def toxiproxy_dir(environ: Mapping[str, str] | None = None) -> Path:
    return cache_dir(environ) / f"toxiproxy-{TOXIPROXY_VERSION}"


def spark_jars_dir(environ: Mapping[str, str] | None = None) -> Path:
    return cache_dir(environ) / f"spark-{SPARK_VERSION}" / "jars"


def kafka_libs_dir(environ: Mapping[str, str] | None = None) -> Path:
    return kafka_cache_dir(environ) / "libs"


def state_home(environ: Mapping[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    explicit = env.get("DEDUP_LOCAL_HOME", "")
    if explicit:
        return Path(explicit).expanduser().resolve()
    return _xdg(env, "XDG_STATE_HOME", ".local/state") / "kafka-dedup-proxy" / "local"


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

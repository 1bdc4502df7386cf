"""The product's wheel holds the product only (no lab), and each pinned version is written
once: Kafka's in deploy/kafka/pom.xml, Spark's in pyproject.toml's pyspark pin (which
deploy/spark/pom.xml must equal), Toxiproxy's in deploy/versions.env."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

from dedup.spark import runtime
from deploy import paths

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = {"proxy", "dedup"}
LAB = {"deploy", "benchmarks", "tests"}
# What is never source: copying it would only slow the build down.
NOT_SOURCE = shutil.ignore_patterns(
    ".venv", ".git", "__pycache__", "*.egg-info", "build", "dist", ".*_cache", ".hypothesis"
)


@pytest.fixture(scope="module")
def product_wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    """The wheel pip builds from a copy of the work tree (a build in place would leave
    build/ and egg-info behind, and stale files in build/ leak into later wheels)."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "src"
    shutil.copytree(ROOT, source, ignore=NOT_SOURCE)
    built = subprocess.run(
        [
            *(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps"),
            *("--no-build-isolation", "--no-index", "--wheel-dir", str(tmp / "out"), str(source)),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (tmp / "out").glob("kafka_dedup_proxy-*.whl")
    return zipfile.ZipFile(wheel)


def test_the_product_wheel_ships_no_lab(product_wheel: zipfile.ZipFile) -> None:
    names = product_wheel.namelist()
    top = {name.split("/", 1)[0] for name in names if ".dist-info/" not in name}
    assert top == PRODUCT
    assert not [name for name in names if name.split("/", 1)[0] in LAB]
    lua = {f"dedup/lua/{script.name}" for script in (ROOT / "dedup" / "lua").glob("*.lua")}
    assert lua and lua <= set(names)
    assert {"dedup/app/cli.py", "dedup/app/plugins.py", "dedup/spark/job.py"} <= set(names)


def test_spark_is_an_extra_and_the_product_draws_no_charts(
    product_wheel: zipfile.ZipFile,
) -> None:
    (metadata_name,) = (n for n in product_wheel.namelist() if n.endswith(".dist-info/METADATA"))
    metadata = Parser().parsestr(product_wheel.read(metadata_name).decode())
    requires = metadata.get_all("Requires-Dist") or []
    unconditional = {_name(r) for r in requires if "extra ==" not in r}
    assert not unconditional & {"pyspark", "pandas", "pyarrow", "matplotlib"}
    spark = {_name(r) for r in requires if re.search(r"extra == ['\"]spark['\"]", r)}
    assert {"pyspark", "pandas", "pyarrow"} <= spark
    assert not any(_name(r) == "matplotlib" for r in requires)


def test_the_spark_pom_resolves_the_pinned_pyspark() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = [r for r in project["optional-dependencies"]["spark"] if _name(r) == "pyspark"]
    assert pins == [f"pyspark=={paths.SPARK_VERSION}"], (
        "pyproject.toml's pyspark pin and deploy/spark/pom.xml's spark.version differ"
    )


@pytest.mark.parametrize(
    ("version", "home"),
    [
        (paths.KAFKA_VERSION, "deploy/kafka/pom.xml"),
        (paths.SPARK_VERSION, "pyproject.toml"),
        (paths.TOXIPROXY_VERSION, "deploy/versions.env"),
    ],
)
def test_each_pinned_version_is_written_once(version: str, home: str) -> None:
    """Outside its home (and the Spark pom, which must repeat pyspark's), no build or
    setup file nor lab module names the version: they read it."""
    literal = re.compile(rf"(?<![\d.]){re.escape(version)}(?![\d.])")
    places = ["pyproject.toml", "deploy/pyproject.toml", "deploy/setup.sh", "deploy/test.sh"]
    places += ["deploy/versions.env", "deploy/kafka/pom.xml", "deploy/spark/pom.xml"]
    places += [str(p.relative_to(ROOT)) for p in (ROOT / "deploy").rglob("*.py")]
    places += [str(p.relative_to(ROOT)) for p in (ROOT / "dedup" / "spark").rglob("*.py")]
    repeats = {"deploy/spark/pom.xml"} if home == "pyproject.toml" else set()
    found = {place for place in places if literal.search(_without_xml_namespace(ROOT / place))}
    assert found == {home} | repeats


def test_the_product_finds_spark_jars_where_setup_puts_them(tmp_path: Path) -> None:
    """dedup.spark computes the directory itself (deploy/setup.sh fills the same one); an
    environment variable points it elsewhere."""
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    expected = tmp_path / "kafka-dedup-proxy" / f"spark-{paths.SPARK_VERSION}" / "jars"
    assert runtime.spark_jars_dir(env, version=paths.SPARK_VERSION) == expected
    assert paths.spark_jars_dir(env) == expected
    relative = {"XDG_CACHE_HOME": "cache"}  # XDG: a relative value is ignored
    assert runtime.cache_dir(relative) == Path.home() / ".cache" / "kafka-dedup-proxy"
    elsewhere = {**env, runtime.JARS_DIR_ENV: str(tmp_path / "jars")}
    assert runtime.spark_jars_dir(elsewhere) == tmp_path / "jars"
    assert paths.spark_jars_dir(elsewhere) == tmp_path / "jars"


def _name(requirement: str) -> str:
    match = re.match(r"[A-Za-z0-9._-]+", requirement)
    assert match is not None, requirement
    return match.group(0).lower().replace("_", "-")


def _without_xml_namespace(path: Path) -> str:
    # Maven's POM 4.0.0 schema (namespace, modelVersion) is no pinned version of ours.
    text = path.read_text()
    return re.sub(r"POM/4\.0\.0|maven-4\.0\.0\.xsd|<modelVersion>4\.0\.0<", "", text)

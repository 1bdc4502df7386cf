"""The images engine.sh builds: each labelled with the hash of its inputs and rebuilt only
when they change; the proxy's image holds the product and nothing else, runs as a user of
its own, checks its health and stops on SIGTERM."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from deploy.containers import engine as containers
from deploy.containers.engine import Engine
from deploy.paths import toxiproxy_dir

pytestmark = [pytest.mark.docker, pytest.mark.integration, pytest.mark.timeout(900)]

# The runtime image: Debian's python3 and a virtualenv of the wheel and its dependencies.
MAX_PROXY_IMAGE_BYTES = 300 * 1024 * 1024
RUN_PYTHON = ["docker", "run", "--rm", "--network", "none", "--entrypoint", "python"]


def inspect(image: str) -> dict[str, object]:
    raw = subprocess.run(
        ["docker", "image", "inspect", image], capture_output=True, text=True, check=True
    ).stdout
    found: dict[str, object] = json.loads(raw)[0]
    return found


def images() -> list[str]:
    names = [containers.KAFKA_IMAGE, containers.REDIS_IMAGE, containers.PROXY_IMAGE]
    if (toxiproxy_dir() / "toxiproxy-server").is_file():
        names.append(containers.TOXIPROXY_IMAGE)
    return names


def test_every_image_carries_the_hash_of_its_inputs(engine: Engine) -> None:
    for image in images():
        config = inspect(image)["Config"]
        assert isinstance(config, dict)
        labels = config["Labels"]
        assert len(labels.get(containers.INPUTS_LABEL, "")) == 64, image


def test_engine_up_again_is_quick(engine: Engine) -> None:
    started = time.monotonic()
    again = containers.ensure()
    took = time.monotonic() - started
    assert again.docker_host == engine.docker_host
    assert took < 30, f"engine.sh up took {took:.1f} s with nothing to build"


def test_the_proxy_image_is_the_product_alone(engine: Engine) -> None:
    found = inspect(containers.PROXY_IMAGE)
    config = found["Config"]
    assert isinstance(config, dict)
    assert config["User"] == "10001:10001"
    assert config["Entrypoint"][:2] == ["/opt/dedup-proxy/bin/dedup-proxy", "serve"]
    assert config["Healthcheck"]["Test"][0] == "CMD"
    assert config["StopSignal"] == "SIGTERM"
    size = found["Size"]
    assert isinstance(size, int) and size < MAX_PROXY_IMAGE_BYTES, f"{size / 2**20:.0f} MB"
    probe = (
        "import importlib.util, json, os; print(json.dumps({'uid': os.getuid(), 'modules': "
        "[m for m in ('proxy', 'dedup', 'confluent_kafka', 'uvloop', 'pyspark', 'pandas', "
        "'matplotlib', 'deploy', 'pip') if importlib.util.find_spec(m)]}))"
    )
    output = subprocess.run(
        [*RUN_PYTHON, containers.PROXY_IMAGE, "-c", probe],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    assert json.loads(output) == {
        "uid": 10001,
        "modules": ["proxy", "dedup", "confluent_kafka", "uvloop"],
    }

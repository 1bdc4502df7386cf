"""The sidecar deployment (deploy/containers/compose.yaml): three Kafka nodes, each with a
proxy in its network namespace, Redis and a client container. Records go through one
sidecar (the topic's writer) and come back through another, from the client container and
from the host, each exactly once; clients only ever learn sidecar addresses."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.containers import compose
from deploy.containers.compose import ComposeDeployment
from deploy.containers.engine import Engine

pytestmark = [pytest.mark.docker, pytest.mark.integration, pytest.mark.timeout(900)]

ROUNDTRIP = Path(__file__).with_name("roundtrip.py")
COUNT = 300


@pytest.fixture(scope="module")
def deployment(engine: Engine) -> Iterator[ComposeDeployment]:
    with ComposeDeployment() as up:
        yield up


def beside_each_broker() -> set[str]:
    """Sidecar placement: node N is broker N's sidecar, whichever sidecar a client asked
    (sidecar ``kafka-N`` serves broker N on its base + 93 + N - 1)."""
    return {
        f"{sidecar}:{base + 93 + n}" for n, (sidecar, base) in enumerate(compose.SIDECARS.items())
    }


def check(result: dict[str, object]) -> None:
    assert result["errors"] == []
    assert result["values"] == list(range(COUNT)), "each record exactly once"
    brokers = result["brokers"]
    assert isinstance(brokers, list)
    assert set(brokers) == beside_each_broker()


def roundtrip_args(topic: str, writer: str, reader: str) -> list[str]:
    return [
        *("--bootstrap", compose.bootstrap(writer), "--read-bootstrap", compose.bootstrap(reader)),
        *("--topic", topic, "--producer", f"{topic}-loader", "--count", str(COUNT)),
        *("--partitions", "3", "--replication-factor", "3"),
    ]


def test_every_sidecar_serves_the_whole_cluster(deployment: ComposeDeployment) -> None:
    for sidecar in compose.SIDECARS:
        with urllib.request.urlopen(f"{compose.admin_url(sidecar)}/healthz", timeout=10) as answer:
            health = json.load(answer)
        assert health["status"] == "ok"
        assert health["upstream_brokers"] == [1, 2, 3]


def test_a_round_trip_from_the_client_container(deployment: ComposeDeployment) -> None:
    output = deployment.exec(
        "client",
        ["python", "-", *roundtrip_args("compose-client", "kafka-1", "kafka-3")],
        stdin=ROUNDTRIP.read_bytes(),
    )
    check(json.loads(output))


def test_a_round_trip_from_the_host(deployment: ComposeDeployment, tmp_path: Path) -> None:
    reason = compose.host_names_unavailable()
    if reason:
        pytest.skip(f"the host cannot resolve the sidecars' names: {reason}")
    argv = compose.with_host_names(
        [sys.executable, str(ROUNDTRIP), *roundtrip_args("compose-host", "kafka-2", "kafka-1")],
        list(compose.SIDECARS),
        tmp_path / "hosts",
    )
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    check(json.loads(done.stdout))

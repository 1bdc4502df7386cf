"""The chaos suite's port plan for a group of instances, and which backends run what."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from deploy.chaos.cli import chaos_app
from deploy.chaos.scenarios import SCENARIOS
from deploy.chaos.topology import (
    BROKERS,
    KAFKA_ADVERTISED_BASE,
    KAFKA_BASE,
    MULTI_INSTANCES,
    REDIS_PORT,
    TOXIPROXY_API,
    InstancePorts,
    instance_links,
    instance_ports,
)

pytestmark = pytest.mark.unit


def _ports(ports: InstancePorts) -> set[int]:
    return {
        ports.listen,
        ports.admin,
        ports.client_bootstrap,
        *(ports.broker_base + n for n in range(BROKERS)),
        *(ports.client_broker_base + n for n in range(BROKERS)),
    }


@pytest.mark.parametrize("shift", [0, 1000])
def test_every_instance_of_a_group_has_ports_of_its_own(shift: int) -> None:
    def port(p: int) -> int:
        return p + shift

    planned = [_ports(instance_ports(i, port)) for i in range(MULTI_INSTANCES)]
    assert all(len(p) == 3 + 2 * BROKERS for p in planned), "no port used twice by one"
    everything = set().union(*planned)
    assert len(everything) == sum(len(p) for p in planned), "none shared between instances"
    environment = {
        *(port(KAFKA_BASE) + n for n in range(BROKERS)),
        *(port(KAFKA_BASE) + 100 + n for n in range(BROKERS)),  # controllers
        *(port(KAFKA_BASE) + 50 + n for n in range(BROKERS)),  # replication
        *(port(KAFKA_ADVERTISED_BASE) + n for n in range(BROKERS)),
        port(REDIS_PORT),
        port(TOXIPROXY_API),
    }
    assert not everything & environment
    assert max(everything) < 32768, "below the ephemeral range"


def test_every_instance_has_links_of_its_own() -> None:
    links = [link for i in range(MULTI_INSTANCES) for link in instance_links(i)]
    assert len(links) == len(set(links)) == MULTI_INSTANCES * (1 + BROKERS)
    assert instance_links(0) == ["client-bootstrap", "proxy-0", "proxy-1", "proxy-2"]


def test_kill_proxy_multi_is_a_group_on_local_processes_only() -> None:
    scenario = SCENARIOS["kill-proxy-multi"]
    assert scenario.instances == MULTI_INSTANCES
    assert scenario.backends == ("local",)
    assert all(s.instances == 1 for name, s in SCENARIOS.items() if name != "kill-proxy-multi")


def test_the_containers_backend_refuses_kill_proxy_multi() -> None:
    result = CliRunner().invoke(
        chaos_app,
        [
            *("--scenario", "kill-proxy-multi", "--backend", "containers"),
            *("--runs", "1", "--messages", "20000", "--fail-at", "12000"),
        ],
    )
    assert result.exit_code == 2
    text = " ".join(result.output.replace("│", " ").split())  # unwrapped from rich's box
    assert "'kill-proxy-multi' cannot run on the containers backend" in text

"""The tests' fixed ports (tests/support/ports.py) never collide: no two tests, and no test
and the session's own environment, listen on one port. A collision fails a run only when
both listen at once, which makes it a rare, order-dependent failure; this finds it at once."""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from deploy.config import Ports, plan_proxies, redis_listen_ports
from deploy.spark_cluster import ClusterPorts
from tests.support import ports as registry
from tests.support.ports import ProxyPorts

pytestmark = pytest.mark.unit

# Per-broker listeners a proxy opens: one per broker of the largest environment it fronts.
MOST_BROKERS = 3
# Environments of more than one broker, and Redis bases of another topology than single.
BROKERS = {"CLUSTER_ENV": 3, "THREE_NODE_ENV": 3, "SECURED_CLUSTER_ENV": 3}
TOPOLOGIES = {
    "SENTINEL_REDIS": "sentinel",
    "TLS_SENTINEL_REDIS": "sentinel",
    "CLUSTER_REDIS": "cluster",
    "TLS_CLUSTER_REDIS": "cluster",
}
# Environments that run local proxies (`local up --proxies N`), and how many.
LOCAL_PROXIES = {"LOCAL_PROXIES_ENV": 2, "SECURED_ENV": 1, "SECURED_CLUSTER_ENV": 3}
# Names that only repeat a port another entry already counts.
PARTS_OF_OTHERS = {
    "LOCAL_PROXY_BASE",  # LOCAL_PROXIES_ENV.proxy_base
    "TOXIPROXY_KAFKA_BASE",  # TOXIPROXY_ENV
    "TOXIPROXY_ADVERTISED_BASE",  # TOXIPROXY_ENV
    "TOXIPROXY_REDIS",  # TOXIPROXY_ENV
}


def proxy_ports(proxy: ProxyPorts, brokers: int = MOST_BROKERS) -> list[int]:
    return [proxy.listen, proxy.admin, *(proxy.broker_base + i for i in range(brokers))]


def environment_ports(name: str, ports: Ports) -> list[int]:
    brokers = BROKERS.get(name, 1)
    nodes = [port for node in range(brokers) for port in ports.node_ports(node)]
    advertised = [ports.advertised(n) for n in range(brokers)] if ports.advertises_elsewhere else []
    proxies = plan_proxies(LOCAL_PROXIES.get(name, 0), ports, brokers)
    local = [port for proxy in proxies for port in proxy.ports()]
    return [*nodes, *advertised, *redis_listen_ports("single", ports.redis), *local]


def spark_ports(cluster: ClusterPorts, workers: int = 2) -> list[int]:
    each = [(cluster.worker(i), cluster.worker_ui(i)) for i in range(workers)]
    return [cluster.master, cluster.master_ui, *(port for pair in each for port in pair)]


def ports_of(name: str, entry: object) -> list[int]:
    """Every port the registry entry `name` stands for."""
    if name == "WORKERS":  # worker i: admin + i, brokers from broker_base + 100 * i
        assert isinstance(entry, ProxyPorts)
        shifted = [
            ProxyPorts(entry.listen, entry.admin + i, entry.broker_base + 100 * i) for i in (0, 1)
        ]
        return sorted({port for worker in shifted for port in proxy_ports(worker)})
    if isinstance(entry, ProxyPorts):
        return proxy_ports(entry)
    if isinstance(entry, list):
        return [port for proxy in entry for port in proxy_ports(proxy)]
    if isinstance(entry, Ports):
        return environment_ports(name, entry)
    if isinstance(entry, ClusterPorts):
        return spark_ports(entry)
    assert isinstance(entry, int), f"{name}: a kind of entry this test does not know"
    return redis_listen_ports(TOPOLOGIES.get(name, "single"), entry)


def registry_entries() -> Iterable[tuple[str, object]]:
    for name, entry in vars(registry).items():
        if name.isupper() and name not in PARTS_OF_OTHERS:
            yield name, entry


def owners_by_port(entries: Iterable[tuple[str, object]]) -> dict[int, list[str]]:
    owners: dict[int, list[str]] = {}
    for name, entry in entries:
        for port in ports_of(name, entry):
            owners.setdefault(port, []).append(name)
    return owners


def shared_ports(entries: Iterable[tuple[str, object]]) -> dict[int, list[str]]:
    return {port: names for port, names in owners_by_port(entries).items() if len(names) > 1}


# The session's environment runs on the defaults (tests/conftest.py).
EVERY_ENTRY = [*registry_entries(), ("the session's environment", Ports())]


def test_no_two_entries_share_a_port() -> None:
    assert shared_ports(EVERY_ENTRY) == {}


def test_every_port_is_below_the_ephemeral_range() -> None:
    # Above 32767 an outgoing connection of any process may be holding the port.
    assert max(owners_by_port(EVERY_ENTRY)) < 32768


def test_a_collision_is_found() -> None:
    # An environment whose first SASL_SSL listener falls on the session proxy's.
    clash = Ports(kafka_base=registry.PASSTHROUGH.listen - 40, redis=16499)
    entries = [("PASSTHROUGH", registry.PASSTHROUGH), ("THREE_NODE_ENV", clash)]
    both = ["PASSTHROUGH", "THREE_NODE_ENV"]
    listen = registry.PASSTHROUGH.listen  # SASL_SSL of node 0; nodes 1, 2 on its brokers'
    assert shared_ports(entries) == {listen: both, listen + 1: both, listen + 2: both}

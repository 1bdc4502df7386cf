"""SNI routing (`proxy.kafka.topology.SniRouting`): which server names reach the bootstrap
or a broker, with hypothesis over node ids and names; the settings that enable it; the
names several instances publish to each other. (End to end: tests/integration/test_sni.py.)"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dedup.ownership.members import Member
from deploy.tls import LocalTls
from proxy.kafka.topology import Endpoint, SniRouting, Topology
from proxy.runtime.settings import ConfigError, ProxySettings, load_settings

pytestmark = pytest.mark.unit

ROUTING = SniRouting("bootstrap.kafka.example.com", "broker-{node_id}.kafka.example.com", 9093)


@given(st.integers(min_value=0, max_value=2**31 - 1))
def test_every_broker_name_routes_to_its_node(node_id: int) -> None:
    name = ROUTING.broker_host(node_id)
    assert ROUTING.node_of(name) == node_id
    assert ROUTING.node_of(name.upper()) == node_id  # host names compare without case
    assert not ROUTING.is_bootstrap(name)


@given(st.text(max_size=60))
def test_any_other_name_routes_nowhere_or_to_one_place(name: str) -> None:
    node = ROUTING.node_of(name)
    assert node is None or ROUTING.broker_host(node).lower() == name.lower()


@pytest.mark.parametrize(
    "name",
    [
        "broker-01.kafka.example.com",  # Kafka writes node ids without leading zeros
        "broker--1.kafka.example.com",
        "broker-.kafka.example.com",
        "broker-1.kafka.example.com.evil.net",
        "xbroker-1.kafka.example.com",
        "broker-1xkafka.example.com",  # the dot is not a wildcard
        "bootstrap.kafka.example.org",
    ],
)
def test_names_that_are_not_a_broker(name: str) -> None:
    assert ROUTING.node_of(name) is None and not ROUTING.is_bootstrap(name)


def test_the_bootstrap_name() -> None:
    assert ROUTING.is_bootstrap("Bootstrap.Kafka.Example.Com")


@pytest.mark.parametrize(
    ("bootstrap", "pattern", "port", "message"),
    [
        ("b.example", "broker.example", 9093, "must hold"),
        ("b.example", "{node_id}-{node_id}.example", 9093, "must hold"),
        ("b.example", "b-{node_id}.{domain}", 9093, "must hold"),
        ("b-1.example", "b-{node_id}.example", 9093, "matches the broker pattern"),
        ("b.example", "b-{node_id}.example", 0, "not a valid port"),
    ],
)
def test_routing_that_cannot_work_is_refused(
    bootstrap: str, pattern: str, port: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        SniRouting(bootstrap, pattern, port)


def test_clients_are_told_each_brokers_name_on_the_one_port() -> None:
    topology = Topology([Endpoint("kafka", 9092)], "proxy", 40000, sni=ROUTING)
    assert topology.proxy_endpoint(7) == Endpoint("broker-7.kafka.example.com", 9093)


def test_members_publish_their_broker_names() -> None:
    sni = Member("a", "inc", 1, "a-host", 9093, 0, None, "broker-{node_id}.a.example.com")
    assert Member.parse("a", f"inc 1 {sni.info()}") == sni
    assert sni.endpoint_for(4) == Endpoint("broker-4.a.example.com", 9093)
    ports = Member("b", "inc", 2, "b-host", 9100, 0)
    assert Member.parse("b", f"inc 2 {ports.info()}") == ports
    assert "sni_host_pattern" not in ports.info()  # members of older versions read it alike
    assert ports.endpoint_for(4) == Endpoint("b-host", 9104)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> LocalTls:
    return LocalTls(tmp_path_factory.mktemp("certs")).ensure()


def test_settings_turn_it_on_with_tls_only(certs: LocalTls) -> None:
    tls = {
        "listener_tls_cert_file": certs.server_cert_file,
        "listener_tls_key_file": certs.server_key_file,
    }
    names = {
        "sni_bootstrap_host": "bootstrap.kafka.example.com",
        "sni_broker_host_pattern": "broker-{node_id}.kafka.example.com",
    }
    settings = load_settings(ProxySettings, listen="0.0.0.0:9093", **tls, **names)
    assert settings.sni_routing == ROUTING
    assert load_settings(ProxySettings, **tls).sni_routing is None
    with pytest.raises(ConfigError, match="SNI routing needs TLS"):
        load_settings(ProxySettings, **names)
    with pytest.raises(ConfigError, match="go together"):
        load_settings(ProxySettings, **tls, sni_bootstrap_host="bootstrap.kafka.example.com")
    with pytest.raises(ConfigError, match="must hold"):
        load_settings(ProxySettings, **tls, **names | {"sni_broker_host_pattern": "b.example"})
    with pytest.raises(ConfigError, match="without SNI routing"):
        load_settings(ProxySettings, **tls, sni_advertised_port=443)
    moved = load_settings(ProxySettings, **tls, **names, sni_advertised_port=443).sni_routing
    assert moved is not None and moved.advertised_port == 443

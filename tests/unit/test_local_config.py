"""Configuration of the local environment, generated without starting anything."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from deploy import config, paths
from deploy.config import Ports
from deploy.local import EnvInfo, LocalEnvironment, ProxyInfo
from deploy.paths import MissingRuntimeError
from deploy.processes import ManagedProcess
from deploy.tls import LocalTls

pytestmark = pytest.mark.unit

DATA = Path("/tmp/kafka-node/data")


def props(node_id: int, brokers: int, ports: Ports | None = None) -> dict[str, str]:
    text = config.render_properties(
        config.server_properties(node_id, brokers, ports or Ports(), DATA), "header"
    )
    return config.parse_properties(text)


def test_single_node_is_a_combined_kraft_node_with_replication_one() -> None:
    p = props(0, 1)
    assert p["process.roles"] == "broker,controller"
    assert p["node.id"] == "0"
    assert p["controller.quorum.voters"] == "0@127.0.0.1:19192"
    assert p["listeners"] == "PLAINTEXT://127.0.0.1:19092,CONTROLLER://127.0.0.1:19192"
    assert p["advertised.listeners"] == "PLAINTEXT://127.0.0.1:19092"
    assert p["controller.listener.names"] == "CONTROLLER"
    assert p["inter.broker.listener.name"] == "PLAINTEXT"
    assert p["log.dirs"] == str(DATA)
    for key in (
        "default.replication.factor",
        "min.insync.replicas",
        "offsets.topic.replication.factor",
        "transaction.state.log.replication.factor",
        "transaction.state.log.min.isr",
        "share.coordinator.state.topic.replication.factor",
        "share.coordinator.state.topic.min.isr",
    ):
        assert p[key] == "1", key


def test_common_settings() -> None:
    for brokers in (1, 3):
        p = props(0, brokers)
        assert p["auto.create.topics.enable"] == "true"
        assert p["num.partitions"] == "1"
        assert p["group.initial.rebalance.delay.ms"] == "0"
        assert int(p["broker.heartbeat.interval.ms"]) < int(p["broker.session.timeout.ms"])


def test_three_nodes_replicate_three_ways_and_need_two_in_sync() -> None:
    for node in range(3):
        p = props(node, 3)
        assert p["node.id"] == str(node)
        assert p["controller.quorum.voters"] == (
            "0@127.0.0.1:19192,1@127.0.0.1:19193,2@127.0.0.1:19194"
        )
        assert p["listeners"] == (
            f"PLAINTEXT://127.0.0.1:{19092 + node},CONTROLLER://127.0.0.1:{19192 + node}"
        )
        assert p["default.replication.factor"] == "3"
        assert p["min.insync.replicas"] == "2"
        assert p["offsets.topic.replication.factor"] == "3"
        assert p["transaction.state.log.replication.factor"] == "3"
        assert p["transaction.state.log.min.isr"] == "2"
        assert p["share.coordinator.state.topic.replication.factor"] == "3"
        assert p["share.coordinator.state.topic.min.isr"] == "2"


def test_several_nodes_each_have_a_rack_and_fetch_by_rack() -> None:
    racks = {props(node, 3)["broker.rack"] for node in range(3)}
    assert racks == {"rack-0", "rack-1", "rack-2"}
    assert props(2, 3)["replica.selector.class"] == (
        "org.apache.kafka.common.replica.RackAwareReplicaSelector"
    )
    assert "broker.rack" not in props(0, 1), "one node: no rack, as Kafka's own default"


def test_port_base_moves_every_listener() -> None:
    p = props(1, 3, Ports(kafka_base=29092))
    assert p["listeners"] == "PLAINTEXT://127.0.0.1:29093,CONTROLLER://127.0.0.1:29193"
    assert p["controller.quorum.voters"].startswith("0@127.0.0.1:29192,")


def test_ports_from_environment() -> None:
    assert Ports.from_env({}) == Ports(kafka_base=19092, redis=16379)
    env = {"DEDUP_LOCAL_KAFKA_PORT": "29092", "DEDUP_LOCAL_REDIS_PORT": "26379"}
    assert Ports.from_env(env) == Ports(kafka_base=29092, redis=26379)
    with pytest.raises(ValueError, match="DEDUP_LOCAL_KAFKA_PORT"):
        Ports.from_env({"DEDUP_LOCAL_KAFKA_PORT": "kafka"})
    with pytest.raises(ValueError, match="DEDUP_LOCAL_REDIS_PORT"):
        Ports.from_env({"DEDUP_LOCAL_REDIS_PORT": "80"})


@pytest.mark.parametrize("brokers", [0, 2, 4])
def test_unsupported_broker_counts_are_refused(brokers: int) -> None:
    with pytest.raises(ValueError, match="brokers"):
        config.server_properties(0, brokers, Ports(), DATA)


def test_node_id_must_be_in_the_cluster() -> None:
    with pytest.raises(ValueError, match="node id"):
        config.server_properties(3, 3, Ports(), DATA)


def test_cluster_id_looks_like_a_kafka_uuid() -> None:
    ids = {config.random_cluster_id() for _ in range(200)}
    assert len(ids) == 200
    for cluster_id in ids:
        assert len(cluster_id) == 22
        assert not cluster_id.startswith("-")
        assert set(cluster_id) <= set(
            "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
        )


def test_redis_config_is_private_and_append_only() -> None:
    text = config.redis_config(16379, Path("/s/redis/data"), Path("/s/redis/redis.log"))
    settings = dict(line.split(" ", 1) for line in text.splitlines())
    assert settings["bind"] == "127.0.0.1"
    assert settings["port"] == "16379"
    assert settings["dir"] == "/s/redis/data"
    # The launcher owns the pid file: Redis truncating it to rewrite it made a running
    # Redis look stopped for an instant.
    assert "pidfile" not in settings
    assert settings["logfile"] == "/s/redis/redis.log"
    assert settings["appendonly"] == "yes"
    assert settings["daemonize"] == "no"


def test_kafka_command_line() -> None:
    argv = config.kafka_jvm_command(
        "java", "/libs/*", Path("/cfg/log4j2.properties"), Path("/n/logs"), Path("/n/s.props")
    )
    assert argv[0] == "java"
    assert "-Xmx512m" in argv and "-Xms256m" in argv and "-XX:+UseG1GC" in argv
    # Room for a cached direct buffer per thread of requests near Kafka's 100 MB limit.
    assert "-XX:MaxDirectMemorySize=2g" in argv
    assert "-Dlog4j2.configurationFile=/cfg/log4j2.properties" in argv
    assert "-Dkafka.logs.dir=/n/logs" in argv
    assert argv[-4:] == ["-cp", "/libs/*", "kafka.Kafka", "/n/s.props"]


def test_env_info_json_shape() -> None:
    info = EnvInfo(
        bootstrap="127.0.0.1:19092,127.0.0.1:19093",
        brokers={1: "127.0.0.1:19093", 0: "127.0.0.1:19092"},
        redis="redis://127.0.0.1:16379/0",
    )
    data = info.to_json()
    assert data == {
        "bootstrap": "127.0.0.1:19092,127.0.0.1:19093",
        "brokers": {"0": "127.0.0.1:19092", "1": "127.0.0.1:19093"},
        "redis": "redis://127.0.0.1:16379/0",
    }
    assert EnvInfo.from_json(data) == info


def test_env_info_of_a_secured_environment_gives_client_settings(tmp_path: Path) -> None:
    certs = LocalTls(tmp_path / "tls").ensure()
    info = EnvInfo(
        bootstrap="127.0.0.1:21792",
        brokers={0: "127.0.0.1:21792"},
        redis="rediss://:pw@127.0.0.1:16589/0",
        sasl_ssl_bootstrap="127.0.0.1:21792",
        tls_dir=str(certs.directory),
        security="sasl_ssl",
    )
    assert EnvInfo.from_json(info.to_json()) == info
    assert info.kafka_config("proxy", "PLAIN") == {
        "security.protocol": "sasl_ssl",
        "ssl.ca.location": str(certs.ca_file),
        "sasl.mechanism": "PLAIN",
        "sasl.username": "proxy",
        "sasl.password": certs.sasl_users["proxy"],
    }
    mixed = EnvInfo(bootstrap="b:1", brokers={0: "b:1"}, redis="redis://r")
    assert mixed.kafka_config() == {}


def test_stale_or_foreign_pid_files_mean_not_running(tmp_path: Path) -> None:
    proc = ManagedProcess(
        name="x",
        pid_file=tmp_path / "x.pid",
        log_file=tmp_path / "x.log",
        marker=str(tmp_path / "x.conf"),
    )
    assert proc.running_pid() is None  # no pid file
    proc.pid_file.write_text("not a pid\n")
    assert proc.running_pid() is None
    # A live process that is not ours (its command line lacks the marker): a reused pid.
    proc.pid_file.write_text(f"{os.getpid()}\n")
    assert proc.running_pid() is None
    # A pid no process has (above the kernel's pid_max limit).
    proc.pid_file.write_text(f"{2**22 + 1}\n")
    assert proc.running_pid() is None
    assert proc.kill() is False


# --- brokers advertising other ports (a fault-injecting proxy in front of them) -----------

BEHIND = Ports(kafka_base=24192, redis=17379, advertised_kafka_base=24200)


def test_advertised_ports_default_to_the_listen_ports() -> None:
    for ports in (Ports(), Ports(kafka_base=19092, advertised_kafka_base=19092)):
        assert not ports.advertises_elsewhere
        assert ports.advertised(2) == ports.client(2) == 19094
        assert ports.inter_broker(0) is None
        assert ports.node_ports(1) == [19093, 19123, 19133, 19193]
        assert props(0, 1, ports)["advertised.listeners"] == "PLAINTEXT://127.0.0.1:19092"


def test_a_node_advertises_other_ports_and_replicates_on_its_own_listener() -> None:
    p = props(0, 1, BEHIND)
    assert p["listeners"] == (
        "PLAINTEXT://127.0.0.1:24192,INTERNAL://127.0.0.1:24242,CONTROLLER://127.0.0.1:24292"
    )
    assert p["advertised.listeners"] == "PLAINTEXT://127.0.0.1:24200,INTERNAL://127.0.0.1:24242"
    assert p["listener.security.protocol.map"] == (
        "PLAINTEXT:PLAINTEXT,INTERNAL:PLAINTEXT,CONTROLLER:PLAINTEXT"
    )
    assert p["inter.broker.listener.name"] == "INTERNAL"
    assert p["controller.listener.names"] == "CONTROLLER"
    assert p["controller.quorum.voters"] == "0@127.0.0.1:24292"


def test_three_nodes_behind_a_proxy_keep_replication_and_quorum_off_it() -> None:
    for node in range(3):
        p = props(node, 3, BEHIND)
        assert p["listeners"] == (
            f"PLAINTEXT://127.0.0.1:{24192 + node},INTERNAL://127.0.0.1:{24242 + node},"
            f"CONTROLLER://127.0.0.1:{24292 + node}"
        )
        assert p["advertised.listeners"] == (
            f"PLAINTEXT://127.0.0.1:{24200 + node},INTERNAL://127.0.0.1:{24242 + node}"
        )
        # Brokers reach each other through these: none may be an advertised client port.
        assert p["controller.quorum.voters"] == (
            "0@127.0.0.1:24292,1@127.0.0.1:24293,2@127.0.0.1:24294"
        )
        assert p["inter.broker.listener.name"] == "INTERNAL"
    assert BEHIND.node_ports(2) == [24194, 24224, 24234, 24244, 24294]


def test_security_adds_tls_and_sasl_listeners_advertised_as_themselves() -> None:
    security = config.KafkaSecurity(
        Path("/k/server.p12"), Path("/k/trust.p12"), "secret", {"proxy": "pw1", "c": "pw2"}
    )
    for ports, plain in ((Ports(), "19092"), (BEHIND, "24200")):
        p = config.server_properties(0, 1, ports, DATA, security)
        tls, sasl = ports.tls(0), ports.sasl_ssl(0)
        assert (tls, sasl) == (ports.kafka_base + 30, ports.kafka_base + 40)
        listeners = p["listeners"].split(",")
        assert f"SSL://127.0.0.1:{tls}" in listeners
        assert f"SASL_SSL://127.0.0.1:{sasl}" in listeners
        advertised = p["advertised.listeners"].split(",")
        assert advertised[0] == f"PLAINTEXT://127.0.0.1:{plain}"
        assert advertised[-2:] == [f"SSL://127.0.0.1:{tls}", f"SASL_SSL://127.0.0.1:{sasl}"]
        assert p["listener.security.protocol.map"].endswith(",SSL:SSL,SASL_SSL:SASL_SSL")
        for name in ("ssl", "sasl_ssl"):
            assert p[f"listener.name.{name}.ssl.keystore.location"] == "/k/server.p12"
            assert p[f"listener.name.{name}.ssl.keystore.password"] == "secret"
        assert p["listener.name.sasl_ssl.plain.sasl.jaas.config"] == (
            "org.apache.kafka.common.security.plain.PlainLoginModule required "
            'user_proxy="pw1" user_c="pw2";'
        )
        assert "ScramLoginModule" in p["listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config"]
        assert p["inter.broker.listener.name"] in ("PLAINTEXT", "INTERNAL")  # not secured


def test_sasl_ssl_mode_leaves_clients_and_replication_nothing_else() -> None:
    security = config.KafkaSecurity(
        Path("/k/server.p12"), Path("/k/trust.p12"), "secret", {"proxy": "pw1"}, "sasl_ssl"
    )
    p = config.server_properties(1, 3, Ports(), DATA, security)
    assert p["listeners"] == "SASL_SSL://127.0.0.1:19093,CONTROLLER://127.0.0.1:19193"
    assert p["advertised.listeners"] == "SASL_SSL://127.0.0.1:19093"
    assert p["listener.security.protocol.map"] == "SASL_SSL:SASL_SSL,CONTROLLER:PLAINTEXT"
    assert p["inter.broker.listener.name"] == "SASL_SSL"
    assert p["sasl.mechanism.inter.broker.protocol"] == "PLAIN"
    assert p["listener.name.sasl_ssl.ssl.truststore.location"] == "/k/trust.p12"
    assert p["authorizer.class.name"] == config.AUTHORIZER
    assert p["super.users"] == "User:broker;User:ANONYMOUS"
    assert p["listener.name.sasl_ssl.plain.sasl.jaas.config"] == (
        "org.apache.kafka.common.security.plain.PlainLoginModule required "
        'username="broker" password="secret" user_proxy="pw1" user_broker="secret";'
    )
    with pytest.raises(ValueError, match="advertised at their own ports"):
        config.server_properties(0, 1, BEHIND, DATA, security)
    with pytest.raises(ValueError, match="security must be one of"):
        config.KafkaSecurity(Path("/k"), Path("/t"), "s", {}, "ssl")


@pytest.mark.parametrize("advertised", [24190, 24194, 24240, 24292, 24294])
def test_advertised_ports_must_not_overlap_the_nodes_own_ports(advertised: int) -> None:
    with pytest.raises(ValueError, match="overlap"):
        Ports(kafka_base=24192, advertised_kafka_base=advertised)


def test_advertised_port_from_environment() -> None:
    env = {"DEDUP_LOCAL_KAFKA_PORT": "24192", "DEDUP_LOCAL_KAFKA_ADVERTISED_PORT": "24200"}
    assert Ports.from_env(env) == Ports(kafka_base=24192, advertised_kafka_base=24200)
    assert Ports.from_env({"DEDUP_LOCAL_KAFKA_ADVERTISED_PORT": " "}).advertised_kafka_base is None
    with pytest.raises(ValueError, match="DEDUP_LOCAL_KAFKA_ADVERTISED_PORT"):
        Ports.from_env({"DEDUP_LOCAL_KAFKA_ADVERTISED_PORT": "proxy"})


def write_state(home: Path, **fields: object) -> None:
    state = {
        "version": 1,
        "brokers": 3,
        "cluster_id": "abc",
        "kafka_port_base": 24192,
        "redis_port": 17379,
        "kafka_version": paths.KAFKA_VERSION,
        **fields,
    }
    home.mkdir(parents=True, exist_ok=True)
    (home / "state.json").write_text(json.dumps(state))


def test_info_gives_clients_the_advertised_addresses(tmp_path: Path) -> None:
    write_state(tmp_path, kafka_advertised_port_base=24200)
    info = LocalEnvironment(home=tmp_path, ports=BEHIND).info()
    assert info.bootstrap == "127.0.0.1:24200,127.0.0.1:24201,127.0.0.1:24202"
    assert info.brokers[1] == "127.0.0.1:24201"
    status = LocalEnvironment(home=tmp_path).status()
    assert status["nodes"]["2"]["address"] == "127.0.0.1:24202"
    assert status["nodes"]["2"]["listen"] == "127.0.0.1:24194"


def test_a_state_file_without_advertised_ports_still_loads(tmp_path: Path) -> None:
    write_state(tmp_path)  # as written before brokers could advertise other ports
    info = LocalEnvironment(home=tmp_path).info()
    assert info.bootstrap == "127.0.0.1:24192,127.0.0.1:24193,127.0.0.1:24194"


# --- Toxiproxy install ----------------------------------------------------------------------

SETUP_SH = Path(__file__).resolve().parents[2] / "deploy" / "setup.sh"


def test_setup_installs_the_versions_the_code_expects() -> None:
    printed = subprocess.run(
        ["bash", str(SETUP_SH), "--versions"], capture_output=True, text=True, check=True
    ).stdout
    assert dict(line.split("=", 1) for line in printed.splitlines()) == {
        "KAFKA_VERSION": paths.KAFKA_VERSION,
        "SPARK_VERSION": paths.SPARK_VERSION,
        "TOXIPROXY_VERSION": paths.TOXIPROXY_VERSION,
    }


def test_toxiproxy_lives_in_the_cache_next_to_the_kafka_jars(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    assert paths.toxiproxy_dir(env) == tmp_path / "kafka-dedup-proxy" / "toxiproxy-2.12.0"
    assert paths.toxiproxy_dir(env).parent == paths.kafka_cache_dir(env).parent
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(MissingRuntimeError, match=r"deploy/setup\.sh"):
        paths.toxiproxy_server()
    binary = paths.toxiproxy_dir() / "toxiproxy-server"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    assert paths.toxiproxy_server() == str(binary)


# --- the proxies of `up --proxies N` --------------------------------------------------------


def test_proxy_plan_ids_and_ports() -> None:
    plan = config.plan_proxies(3, Ports(), brokers=3)
    assert [p.instance_id for p in plan] == ["proxy-1", "proxy-2", "proxy-3"]
    assert [p.listen for p in plan] == [29092, 29192, 29292]
    assert [p.admin for p in plan] == [29080, 29180, 29280]
    assert [p.broker_base for p in plan] == [29093, 29193, 29293]
    assert {p.local_broker_id for p in plan} == {None}
    assert plan[0].bootstrap == "127.0.0.1:29092"
    assert plan[1].admin_url == "http://127.0.0.1:29180"


def test_proxy_plan_ports_never_clash() -> None:
    plan = config.plan_proxies(
        config.MAX_PROXIES, Ports(), brokers=3, workers=config.MAX_LOCAL_WORKERS
    )
    ports = [port for proxy in plan for port in proxy.ports()]
    assert len(ports) == len(set(ports))
    assert plan[0].admin_urls[-1] == f"http://127.0.0.1:{29080 + config.MAX_LOCAL_WORKERS - 1}"
    # What each proxy's own settings check says about its workers' ports agrees.
    from dedup.app.settings import load_settings

    for proxy in plan:
        load_settings(None, **proxy.settings("127.0.0.1:19092", "redis://127.0.0.1:16379/0"))


def test_proxy_plan_sidecar_needs_one_proxy_per_broker() -> None:
    plan = config.plan_proxies(3, Ports(), brokers=3, placement="sidecar")
    assert [p.local_broker_id for p in plan] == [0, 1, 2]
    assert plan[2].settings("k:1", "redis://r")["local_broker_id"] == 2
    with pytest.raises(ValueError, match="need --proxies 1, not 2"):
        config.plan_proxies(2, Ports(), brokers=1, placement="sidecar")
    with pytest.raises(ValueError, match="placement"):
        config.plan_proxies(1, Ports(), brokers=1, placement="nearest")
    with pytest.raises(ValueError, match="workers"):
        config.plan_proxies(1, Ports(), brokers=1, workers=config.MAX_LOCAL_WORKERS + 1)
    assert config.plan_proxies(0, Ports(), brokers=1) == []


def test_proxy_plan_refuses_kafka_or_redis_ports() -> None:
    with pytest.raises(ValueError, match="DEDUP_LOCAL_PROXY_PORT"):
        config.plan_proxies(1, Ports(kafka_base=20092, proxy_base=20192), brokers=1)
    with pytest.raises(ValueError, match="DEDUP_LOCAL_PROXY_PORT"):
        config.plan_proxies(1, Ports(redis=29094), brokers=1)


def test_proxy_port_from_environment() -> None:
    assert Ports.from_env({"DEDUP_LOCAL_PROXY_PORT": "30092"}).proxy_base == 30092
    assert Ports.from_env({}).proxy_base == config.DEFAULT_PROXY_PORT


def test_proxy_settings_render_as_toml_the_proxy_loads(tmp_path: Path) -> None:
    from dedup.app.settings import load_settings

    proxy = config.plan_proxies(1, Ports(), brokers=1, placement="sidecar", workers=2)[0]
    path = tmp_path / "proxy.toml"
    path.write_text(config.render_toml(proxy.settings("a:1,b:2", "redis://x:1/0"), "a header"))
    settings = load_settings(path)
    assert settings.upstream == ["a:1", "b:2"]
    assert (settings.instance_id, settings.placement, settings.local_broker_id) == (
        "proxy-1",
        "sidecar",
        0,
    )
    assert (settings.workers, settings.worker_port_stride) == (2, config.LOCAL_WORKER_PORT_STRIDE)


def test_env_info_json_with_proxies() -> None:
    proxy = ProxyInfo("proxy-1", "127.0.0.1:29092", "http://127.0.0.1:29080", ("http://a", "b"))
    info = EnvInfo(bootstrap="b:1", brokers={0: "b:1"}, redis="redis://r", proxies=(proxy,))
    data = info.to_json()
    assert data["proxies"] == [
        {
            "instance_id": "proxy-1",
            "bootstrap": "127.0.0.1:29092",
            "admin": "http://127.0.0.1:29080",
            "admins": ["http://a", "b"],
        }
    ]
    assert EnvInfo.from_json(data) == info


def test_redis_topologies_take_ports_above_the_redis_port() -> None:
    assert config.redis_data_ports("single", 16379) == [16379]
    assert config.redis_listen_ports("sentinel", 16379) == [
        16379,
        16380,
        16381,
        16389,
        16390,
        16391,
    ]
    assert config.redis_listen_ports("cluster", 16379) == [
        *range(16379, 16385),
        *range(26379, 26385),
    ]
    with pytest.raises(ValueError, match="topology"):
        config.redis_data_ports("ring", 16379)


def test_redis_urls_name_the_topology() -> None:
    assert config.redis_url("single", 16379) == "redis://127.0.0.1:16379/0"
    assert config.redis_url("sentinel", 16379) == (
        "redis+sentinel://127.0.0.1:16389,127.0.0.1:16390,127.0.0.1:16391/dedup/0"
    )
    assert config.redis_url("cluster", 16379) == "redis+cluster://" + ",".join(
        f"127.0.0.1:{p}" for p in range(16379, 16385)
    )


def test_redis_node_configs_per_topology(tmp_path: Path) -> None:
    replica = config.redis_config(
        16380,
        tmp_path,
        tmp_path / "r.log",
        extra=config.redis_node_settings("sentinel", 16379, 1),
    )
    assert "replicaof 127.0.0.1 16379\n" in replica and "appendonly yes\n" in replica
    assert config.redis_node_settings("sentinel", 16379, 0) == ()
    cluster = dict(config.redis_node_settings("cluster", 16379, 3))
    assert cluster["cluster-enabled"] == "yes"
    sentinel = config.sentinel_config(16389, 16379, tmp_path, tmp_path / "s.log")
    assert "sentinel monitor dedup 127.0.0.1 16379 2\n" in sentinel
    assert "pidfile" not in sentinel


def test_the_proxys_principal_gets_the_readmes_list_and_nothing_more() -> None:
    """The sasl_ssl mode's ACLs: `client` may do anything; `proxy` only what the README
    lists for the proxy's principal, never on the cluster or on groups, never "all"."""
    grants = config.acl_grants("snapshots")
    proxy = {
        (g.resource_type, g.name, g.pattern, g.operation)
        for g in grants
        if g.principal == "User:proxy"
    }
    assert proxy == {
        ("topic", "*", "literal", "write"),
        ("topic", "*", "literal", "describe"),
        ("topic", "*", "literal", "read"),
        ("topic", "snapshots", "literal", "create"),
        ("transactional_id", "dedup-proxy-", "prefixed", "write"),
        ("transactional_id", "dedup-proxy-", "prefixed", "describe"),
        ("transactional_id", "*", "literal", "describe"),
    }
    assert {g.principal for g in grants} == {"User:proxy", "User:client"}
    assert {g.operation for g in grants if g.principal == "User:client"} == {"all"}
    mixed = config.KafkaSecurity(Path("/k/s.p12"), Path("/k/t.p12"), "secret", {}, "mixed")
    assert "authorizer.class.name" not in config.server_properties(0, 1, Ports(), DATA, mixed)

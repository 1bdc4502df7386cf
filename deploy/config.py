"""Pure generation of the local environment's configuration: ports, server.properties,
redis.conf, JVM flags. Nothing here touches the file system or starts a process."""

from __future__ import annotations

import base64
import json
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

HOST = "127.0.0.1"
DEFAULT_KAFKA_PORT_BASE = 19092
DEFAULT_REDIS_PORT = 16379
# Controller listeners sit this far above the client listeners.
CONTROLLER_PORT_OFFSET = 100
# Brokers that advertise another address to clients (a fault-injecting proxy in front of
# them) replicate over a listener of their own, this far above the client listeners.
INTER_BROKER_PORT_OFFSET = 50
# Every node also has a TLS client listener (SSL) and one that asks for SASL over TLS
# (SASL_SSL), this far above its plaintext one.
TLS_PORT_OFFSET = 30
SASL_SSL_PORT_OFFSET = 40
SCRAM_MECHANISMS = ("SCRAM-SHA-256", "SCRAM-SHA-512")
# OAUTHBEARER with Kafka's default validator, which takes unsigned tokens (`alg: none`):
# for tests only, never a production setting.
SASL_MECHANISMS = ("PLAIN", *SCRAM_MECHANISMS, "OAUTHBEARER")
MAX_BROKERS = 3
# Proxies of `up --proxies N`: proxy i (1-based) owns the block of PROXY_PORT_BLOCK ports from
# proxy_base - PROXY_ADMIN_BELOW + PROXY_PORT_BLOCK * (i - 1): its admin ports at the start
# (one per worker), its bootstrap port PROXY_ADMIN_BELOW above, then its broker listeners,
# LOCAL_WORKER_PORT_STRIDE apart per worker. With the defaults proxy 1 is the product's
# defaults: bootstrap 29092, brokers 29093+, admin 29080.
DEFAULT_PROXY_PORT = 29092
PROXY_PORT_BLOCK = 100
PROXY_ADMIN_BELOW = 12
LOCAL_WORKER_PORT_STRIDE = 10
MAX_LOCAL_WORKERS = 8  # admin ports and broker ports of 8 workers fit one block
MAX_PROXIES = 16
PLACEMENTS = ("balanced", "sidecar")
SUPPORTED_BROKER_COUNTS = (1, MAX_BROKERS)

# Small heaps: up to three nodes plus the proxy and tests share a 2-core machine.
KAFKA_HEAP_OPTS = ("-Xms256m", "-Xmx512m")
# Java's NIO keeps, per thread, a temporary direct buffer as large as the largest heap buffer
# it read into from a socket or wrote from to a file, and direct memory is capped at -Xmx by
# default. Requests near Kafka's 100 MB limit left one of ~96 MB per network and
# request-handler thread that handled one, and the broker ran out of direct memory. Room for
# all of them; it is taken only by such requests. (Not -Djdk.nio.maxCachedBufferSize: uncached, a
# buffer of the request's size is allocated for every read, and a 95 MB request took 14 s.)
KAFKA_DIRECT_MEMORY_OPT = "-XX:MaxDirectMemorySize=2g"
# The GC settings of Kafka's own kafka-run-class.sh.
KAFKA_JVM_PERFORMANCE_OPTS = (
    "-server",
    "-XX:+UseG1GC",
    "-XX:MaxGCPauseMillis=20",
    "-XX:InitiatingHeapOccupancyPercent=35",
    "-XX:+ExplicitGCInvokesConcurrent",
    "-Djava.awt.headless=true",
)
TOOL_JVM_OPTS = ("-Xmx256m", "-XX:+UseG1GC", "-Djava.awt.headless=true")


@dataclass(frozen=True)
class Ports:
    """The loopback ports of the environment; node ids are 0..n-1.

    Node i listens for clients on ``kafka_base + i`` and tells clients (in Metadata) to
    connect to ``advertised_kafka_base + i``: by default the same port. A different
    advertised base lets something listen there and forward to the brokers (Toxiproxy, to
    break client connections); the nodes then replicate over an inter-broker listener of
    their own (``kafka_base + 50 + i``), and the controllers keep theirs, so neither
    replication nor the KRaft quorum goes through it."""

    kafka_base: int = DEFAULT_KAFKA_PORT_BASE
    redis: int = DEFAULT_REDIS_PORT
    advertised_kafka_base: int | None = None
    # The bootstrap port of the first proxy `up --proxies N` starts (see plan_proxies).
    proxy_base: int = DEFAULT_PROXY_PORT

    def __post_init__(self) -> None:
        if not self.advertises_elsewhere:
            return
        advertised = {self.advertised(n) for n in range(MAX_BROKERS)}
        own = {port for n in range(MAX_BROKERS) for port in self.node_ports(n)}
        if advertised & own:
            raise ValueError(
                f"advertised Kafka ports {sorted(advertised)} overlap the ports the nodes "
                f"listen on ({sorted(own)})"
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Ports:
        env = os.environ if environ is None else environ
        return cls(
            kafka_base=_port(env, "DEDUP_LOCAL_KAFKA_PORT", DEFAULT_KAFKA_PORT_BASE),
            redis=_port(env, "DEDUP_LOCAL_REDIS_PORT", DEFAULT_REDIS_PORT),
            advertised_kafka_base=_optional_port(env, "DEDUP_LOCAL_KAFKA_ADVERTISED_PORT"),
            proxy_base=_port(env, "DEDUP_LOCAL_PROXY_PORT", DEFAULT_PROXY_PORT),
        )

    @property
    def advertised_base(self) -> int:
        """The advertised base in effect (the listen base unless another one is set)."""
        return self.kafka_base if self.advertised_kafka_base is None else self.advertised_kafka_base

    @property
    def advertises_elsewhere(self) -> bool:
        return self.advertised_base != self.kafka_base

    def client(self, node_id: int) -> int:
        """The port node_id listens on for clients."""
        return self.kafka_base + node_id

    def advertised(self, node_id: int) -> int:
        """The port clients are told to use for node_id."""
        return self.advertised_base + node_id

    def tls(self, node_id: int) -> int:
        """The port of node_id's TLS client listener (advertised as itself)."""
        return self.kafka_base + TLS_PORT_OFFSET + node_id

    def sasl_ssl(self, node_id: int) -> int:
        """The port of node_id's SASL_SSL client listener (advertised as itself)."""
        return self.kafka_base + SASL_SSL_PORT_OFFSET + node_id

    def inter_broker(self, node_id: int) -> int | None:
        """The replication listener's port, when replication has a listener of its own."""
        if not self.advertises_elsewhere:
            return None
        return self.kafka_base + INTER_BROKER_PORT_OFFSET + node_id

    def controller(self, node_id: int) -> int:
        return self.kafka_base + CONTROLLER_PORT_OFFSET + node_id

    def node_ports(self, node_id: int) -> list[int]:
        """Every port node_id listens on."""
        replication = self.inter_broker(node_id)
        extra = [] if replication is None else [replication]
        secured = [self.tls(node_id), self.sasl_ssl(node_id)]
        return [self.client(node_id), *secured, *extra, self.controller(node_id)]


def _port(env: Mapping[str, str], name: str, default: int) -> int:
    port = _optional_port(env, name)
    return default if port is None else port


def _optional_port(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        port = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a port number") from None
    # The Kafka base must leave room for the controller ports above it.
    if not 1024 <= port <= 65535 - CONTROLLER_PORT_OFFSET - MAX_BROKERS:
        raise ValueError(
            f"{name}={port} is outside 1024..{65535 - CONTROLLER_PORT_OFFSET - MAX_BROKERS}"
        )
    return port


@dataclass(frozen=True)
class ProxyInstance:
    """One proxy of the local environment (index from 1), as `plan_proxies` lays it out."""

    index: int
    instance_id: str
    listen: int
    admin: int
    broker_base: int
    workers: int
    placement: str
    local_broker_id: int | None

    @property
    def bootstrap(self) -> str:
        return f"{HOST}:{self.listen}"

    @property
    def admin_url(self) -> str:
        return f"http://{HOST}:{self.admin}"

    @property
    def admin_urls(self) -> list[str]:
        """One per worker (worker w serves admin + w)."""
        return [f"http://{HOST}:{self.admin + w}" for w in range(self.workers)]

    def ports(self) -> list[int]:
        """Every port it may listen on, for nodes 0..MAX_BROKERS-1."""
        admins = [self.admin + w for w in range(self.workers)]
        brokers = [
            self.broker_base + w * LOCAL_WORKER_PORT_STRIDE + node
            for w in range(self.workers)
            for node in range(MAX_BROKERS)
        ]
        return [*admins, self.listen, *brokers]

    def settings(self, upstream: str, redis_url: str) -> dict[str, object]:
        """The proxy's settings (its TOML file)."""
        values: dict[str, object] = {
            "upstream": upstream.split(","),
            "listen": self.bootstrap,
            "admin": f"{HOST}:{self.admin}",
            "broker_port_base": self.broker_base,
            "redis": redis_url,
            "instance_id": self.instance_id,
            "placement": self.placement,
            "workers": self.workers,
            "worker_port_stride": LOCAL_WORKER_PORT_STRIDE,
        }
        if self.local_broker_id is not None:
            values["local_broker_id"] = self.local_broker_id
        return values


def plan_proxies(
    count: int, ports: Ports, brokers: int, placement: str = "balanced", workers: int = 1
) -> list[ProxyInstance]:
    """The proxies `up --proxies count` runs: ids proxy-1..N, ports by PROXY_PORT_BLOCK;
    with placement sidecar, proxy i stands beside node i-1 (so one proxy per broker)."""
    if not 0 <= count <= MAX_PROXIES:
        raise ValueError(f"proxies must be in 0..{MAX_PROXIES}, not {count}")
    if not 1 <= workers <= MAX_LOCAL_WORKERS:
        raise ValueError(f"workers must be in 1..{MAX_LOCAL_WORKERS}, not {workers}")
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, not {placement!r}")
    if placement == "sidecar" and count and count != brokers:
        raise ValueError(
            f"placement sidecar puts one proxy beside each broker: {brokers} broker(s) need "
            f"--proxies {brokers}, not {count}"
        )
    plan = [
        ProxyInstance(
            index=i,
            instance_id=f"proxy-{i}",
            listen=ports.proxy_base + PROXY_PORT_BLOCK * (i - 1),
            admin=ports.proxy_base - PROXY_ADMIN_BELOW + PROXY_PORT_BLOCK * (i - 1),
            broker_base=ports.proxy_base + 1 + PROXY_PORT_BLOCK * (i - 1),
            workers=workers,
            placement=placement,
            local_broker_id=i - 1 if placement == "sidecar" else None,
        )
        for i in range(1, count + 1)
    ]
    used = [p for proxy in plan for p in proxy.ports()]
    if used and not (min(used) >= 1024 and max(used) <= 65535):
        raise ValueError(
            f"{count} proxies from port {ports.proxy_base} need ports {min(used)}..{max(used)}: "
            f"set DEDUP_LOCAL_PROXY_PORT lower"
        )
    others = {port for n in range(MAX_BROKERS) for port in ports.node_ports(n)}
    others |= {ports.advertised(n) for n in range(MAX_BROKERS)} | {ports.redis}
    clash = sorted(others & set(used))
    if clash:
        raise ValueError(
            f"proxy ports {clash} are Kafka's or Redis' ports: set DEDUP_LOCAL_PROXY_PORT "
            f"(now {ports.proxy_base}) elsewhere"
        )
    return plan


def render_toml(values: Mapping[str, object], header: str = "") -> str:
    """A flat TOML table of strings, integers, booleans and lists of strings."""
    lines = [f"# {line}" for line in header.splitlines()]
    for key, value in values.items():
        lines.append(f"{key} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


def check_broker_count(brokers: int) -> None:
    if brokers not in SUPPORTED_BROKER_COUNTS:
        raise ValueError(f"brokers must be one of {SUPPORTED_BROKER_COUNTS}, not {brokers}")


def random_cluster_id() -> str:
    """A Kafka Uuid as StorageTool random-uuid prints it: 16 random bytes, base64url, no
    padding. Like Kafka, avoid a leading '-', which command lines would take for a flag."""
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode("ascii").rstrip("=")
        if not text.startswith("-"):
            return text


def quorum_voters(brokers: int, ports: Ports) -> str:
    return ",".join(f"{n}@{HOST}:{ports.controller(n)}" for n in range(brokers))


def replication_settings(brokers: int) -> dict[str, str]:
    """Durability settings scaled to the cluster: with 3 nodes a write needs 2 in-sync
    replicas, so one broker can be killed without losing acknowledged data."""
    check_broker_count(brokers)
    factor = str(brokers)
    min_isr = "2" if brokers >= 3 else "1"
    return {
        "default.replication.factor": factor,
        "min.insync.replicas": min_isr,
        "offsets.topic.replication.factor": factor,
        "transaction.state.log.replication.factor": factor,
        "transaction.state.log.min.isr": min_isr,
        "share.coordinator.state.topic.replication.factor": factor,
        "share.coordinator.state.topic.min.isr": min_isr,
    }


SECURITY_MODES = ("mixed", "sasl_ssl")
BROKER_USER = "broker"  # the brokers' own PLAIN user, for replication in sasl_ssl mode
# The sasl_ssl mode authorizes every request by Kafka's ACLs (`acl_grants`), as a secured
# production cluster does. Super users: the brokers' own principal on the SASL_SSL listener,
# and ANONYMOUS, the principal of the loopback-only PLAINTEXT controller listener, which
# every node's requests to the controllers carry (nothing else can name it: the client
# listener is SASL_SSL only).
AUTHORIZER = "org.apache.kafka.metadata.authorizer.StandardAuthorizer"
SUPER_USERS = (f"User:{BROKER_USER}", "User:ANONYMOUS")


@dataclass(frozen=True)
class AclGrant:
    """One ALLOW ACL: ``principal`` may do ``operation`` on the resource ``resource_type``
    ``name`` (``pattern`` "literal", "*" meaning every such resource, or "prefixed")."""

    principal: str
    resource_type: str  # "topic", "group", "transactional_id", "cluster"
    name: str
    pattern: str
    operation: str  # Kafka's operation names: "read", "write", "describe", "create", "all"


def acl_grants(snapshot_topic: str = "__dedup_snapshots") -> list[AclGrant]:
    """The ACLs of the sasl_ssl mode. ``client`` (the applications, and the tests' admin)
    may do anything. ``proxy``, the proxies' own principal, gets what the README lists for
    it and nothing more, so every test in that mode checks that list: on every topic Write
    (its deduplicated writes; IdempotentWrite is implied), Describe (metadata, offsets) and
    Read (a recovery's replay, DescribeProducers); Create on the snapshot topic; Write and
    Describe on the proxies' own transactional ids (``dedup-proxy-<instance>``: the fence,
    of its own id and of a dead instance's); Describe on every transactional id (when a
    client's open transaction ends, for a recovery)."""
    client = [
        AclGrant("User:client", kind, name, "literal", "all")
        for kind, name in (
            ("topic", "*"),
            ("group", "*"),
            ("transactional_id", "*"),
            ("cluster", "kafka-cluster"),
        )
    ]
    proxy = [
        *(
            AclGrant("User:proxy", "topic", "*", "literal", op)
            for op in ("write", "describe", "read")
        ),
        AclGrant("User:proxy", "topic", snapshot_topic, "literal", "create"),
        *(
            AclGrant("User:proxy", "transactional_id", "dedup-proxy-", "prefixed", op)
            for op in ("write", "describe")
        ),
        AclGrant("User:proxy", "transactional_id", "*", "literal", "describe"),
    ]
    return client + proxy


@dataclass(frozen=True)
class KafkaSecurity:
    """The secured listeners': the key and certificate chain (PKCS#12), the trust store
    (the local CA), and the users of SASL PLAIN (SCRAM users live in the cluster's metadata:
    `LocalEnvironment.up`). ``mode`` "mixed": PLAINTEXT, SSL and SASL_SSL listeners for
    clients; "sasl_ssl": SASL_SSL only, on the client port, replication included (the KRaft
    controller listener stays plaintext, on loopback)."""

    keystore: Path
    truststore: Path
    password: str
    plain_users: Mapping[str, str]
    mode: str = "mixed"

    def __post_init__(self) -> None:
        if self.mode not in SECURITY_MODES:
            raise ValueError(f"security must be one of {SECURITY_MODES}, not {self.mode!r}")


def listener_settings(
    node_id: int, ports: Ports, security: KafkaSecurity | None = None
) -> dict[str, str]:
    """The listeners of one node. Clients get PLAINTEXT, advertised at the port they must
    use; when that is not the node's own port, replication moves to an INTERNAL listener
    advertised as itself, since brokers reach each other through advertised addresses.
    With `security`, clients also get SSL and SASL_SSL listeners, advertised as themselves;
    in its "sasl_ssl" mode, SASL_SSL is the only one (`KafkaSecurity`)."""
    controller = f"CONTROLLER://{HOST}:{ports.controller(node_id)}"
    if security is not None and security.mode == "sasl_ssl":
        if ports.advertises_elsewhere:
            raise ValueError("security sasl_ssl needs brokers advertised at their own ports")
        own = f"SASL_SSL://{HOST}:{ports.client(node_id)}"
        return {
            "listeners": f"{own},{controller}",
            "advertised.listeners": own,
            "listener.security.protocol.map": "SASL_SSL:SASL_SSL,CONTROLLER:PLAINTEXT",
            "inter.broker.listener.name": "SASL_SSL",
            "sasl.mechanism.inter.broker.protocol": "PLAIN",
            "authorizer.class.name": AUTHORIZER,
            "super.users": ";".join(SUPER_USERS),
            **_tls_listener("SASL_SSL", security, trusting=True),
            **_sasl_listener(security, {BROKER_USER: security.password}),
        }
    client = f"PLAINTEXT://{HOST}:{ports.client(node_id)}"
    advertised = f"PLAINTEXT://{HOST}:{ports.advertised(node_id)}"
    listeners, advertised_listeners = [client], [advertised]
    protocols = ["PLAINTEXT:PLAINTEXT"]
    settings: dict[str, str] = {}
    replication = ports.inter_broker(node_id)
    if replication is not None:
        internal = f"INTERNAL://{HOST}:{replication}"
        listeners.append(internal)
        advertised_listeners.append(internal)
        protocols.append("INTERNAL:PLAINTEXT")
    protocols.append("CONTROLLER:PLAINTEXT")
    if security is not None:
        for name, port in (("SSL", ports.tls(node_id)), ("SASL_SSL", ports.sasl_ssl(node_id))):
            listeners.append(f"{name}://{HOST}:{port}")
            advertised_listeners.append(f"{name}://{HOST}:{port}")
            protocols.append(f"{name}:{name}")
            settings |= _tls_listener(name, security)
        settings |= _sasl_listener(security)
    return {
        "listeners": ",".join([*listeners, controller]),
        "advertised.listeners": ",".join(advertised_listeners),
        "listener.security.protocol.map": ",".join(protocols),
        "inter.broker.listener.name": "PLAINTEXT" if replication is None else "INTERNAL",
        **settings,
    }


def _tls_listener(name: str, security: KafkaSecurity, trusting: bool = False) -> dict[str, str]:
    """A listener's certificate; ``trusting``: also the CA, for brokers that connect to it."""
    prefix = f"listener.name.{name.lower()}."
    settings = {
        f"{prefix}ssl.keystore.type": "PKCS12",
        f"{prefix}ssl.keystore.location": str(security.keystore),
        f"{prefix}ssl.keystore.password": security.password,
        f"{prefix}ssl.key.password": security.password,
    }
    if trusting:
        settings |= {
            f"{prefix}ssl.truststore.type": "PKCS12",
            f"{prefix}ssl.truststore.location": str(security.truststore),
            f"{prefix}ssl.truststore.password": security.password,
        }
    return settings


def _sasl_listener(security: KafkaSecurity, own: Mapping[str, str] | None = None) -> dict[str, str]:
    """The SASL_SSL listener's mechanisms and PLAIN users; ``own``: the one user the broker
    itself logs in as (replication over this listener)."""
    users = {**security.plain_users, **(own or {})}
    plain = " ".join(f'user_{user}="{pw}"' for user, pw in users.items())
    login = "".join(f' username="{user}" password="{pw}"' for user, pw in (own or {}).items())
    return {
        "listener.name.sasl_ssl.sasl.enabled.mechanisms": ",".join(SASL_MECHANISMS),
        "listener.name.sasl_ssl.plain.sasl.jaas.config": (
            f"org.apache.kafka.common.security.plain.PlainLoginModule required{login} {plain};"
        ),
        **{
            f"listener.name.sasl_ssl.{mechanism.lower()}.sasl.jaas.config": (
                "org.apache.kafka.common.security.scram.ScramLoginModule required;"
            )
            for mechanism in SCRAM_MECHANISMS
        },
        "listener.name.sasl_ssl.oauthbearer.sasl.jaas.config": (
            "org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule required;"
        ),
    }


def server_properties(
    node_id: int,
    brokers: int,
    ports: Ports,
    data_dir: Path,
    security: KafkaSecurity | None = None,
) -> dict[str, str]:
    """server.properties of one combined broker+controller node."""
    check_broker_count(brokers)
    if not 0 <= node_id < brokers:
        raise ValueError(f"node id {node_id} is not in 0..{brokers - 1}")
    props = {
        "process.roles": "broker,controller",
        "node.id": str(node_id),
        "controller.quorum.voters": quorum_voters(brokers, ports),
        **listener_settings(node_id, ports, security),
        "controller.listener.names": "CONTROLLER",
        "log.dirs": str(data_dir),
        "num.partitions": "1",
        "auto.create.topics.enable": "true",
        "group.initial.rebalance.delay.ms": "0",
        # A node killed with SIGKILL cannot re-register until its old session expires, and
        # its partitions keep it in their ISR until then: 9 s by default, 4 s here.
        "broker.session.timeout.ms": "4000",
        "broker.heartbeat.interval.ms": "1000",
    }
    props.update(replication_settings(brokers))
    if brokers > 1:
        # A rack per node and Kafka's rack-aware selector, so a consumer that names its
        # rack (client.rack, KIP-392) is sent to fetch from that rack's replica.
        props["broker.rack"] = rack_of(node_id)
        props["replica.selector.class"] = RACK_AWARE_SELECTOR
    return props


RACK_AWARE_SELECTOR = "org.apache.kafka.common.replica.RackAwareReplicaSelector"


def rack_of(node_id: int) -> str:
    """The rack of a node of a local cluster of several brokers."""
    return f"rack-{node_id}"


def render_properties(props: Mapping[str, str], header: str = "") -> str:
    lines = [f"# {line}" for line in header.splitlines()]
    lines += [f"{key}={_escape_value(value)}" for key, value in props.items()]
    return "\n".join(lines) + "\n"


def _escape_value(value: str) -> str:
    # java.util.Properties treats a backslash as an escape; paths never need one otherwise.
    return value.replace("\\", "\\\\")


def parse_properties(text: str) -> dict[str, str]:
    """The subset of the java.util.Properties format render_properties writes."""
    props: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", "!")):
            continue
        key, _, value = line.partition("=")
        props[key.strip()] = value.strip().replace("\\\\", "\\")
    return props


def redis_config(
    port: int,
    data_dir: Path,
    log_file: Path,
    extra: tuple[tuple[str, str], ...] = (),
) -> str:
    """A private Redis: its own port, directory and log file, AOF on; `extra` settings
    after these (a replica's ``replicaof``, a cluster node's ``cluster-enabled``)."""
    settings = [
        ("bind", HOST),
        ("port", str(port)),
        ("protected-mode", "yes"),
        # Run in the foreground; the launcher detaches it and keeps its pid.
        ("daemonize", "no"),
        # Keep argv as started: the config path in it tells our redis from another one.
        ("set-proc-title", "no"),
        # No ``pidfile``: the launcher writes the pid file (atomically). Redis would rewrite
        # it by truncating first, and a look at it in that instant saw no process.
        ("logfile", str(log_file)),
        ("dir", str(data_dir)),
        ("appendonly", "yes"),
        ("appendfilename", '"appendonly.aof"'),
        # Redis write(2)s the AOF before it replies (unless a slow fsync makes it postpone),
        # so acknowledged writes survive a SIGKILL of the process; everysec bounds the loss
        # on a machine crash and keeps fsync off the hot path.
        ("appendfsync", "everysec"),
        # AOF is the persistence; RDB snapshots would only add fork pauses.
        ("save", '""'),
        *extra,
    ]
    return "\n".join(f"{key} {value}" for key, value in settings) + "\n"


# --- Redis topologies -----------------------------------------------------------------------
#
# single:   one redis-server on the Redis port P.
# sentinel: data nodes on P (the first primary), P+1, P+2 (its replicas); three Sentinels
#           on P+10, P+11, P+12 watching them under the name SENTINEL_MASTER.
# cluster:  six nodes on P..P+5 (three primaries, three replicas); each node's cluster bus
#           is Redis's default, its port + 10000.

REDIS_TOPOLOGIES = ("single", "sentinel", "cluster")
SENTINEL_MASTER = "dedup"
SENTINEL_PORT_OFFSET = 10
SENTINELS = 3
SENTINEL_DATA_NODES = 3
CLUSTER_NODES = 6
CLUSTER_BUS_OFFSET = 10000
# Quick failovers on one machine: a primary is down after 1 s without an answer.
SENTINEL_DOWN_AFTER_MS = 1000
SENTINEL_FAILOVER_TIMEOUT_MS = 10000
CLUSTER_NODE_TIMEOUT_MS = 2000


def check_redis_topology(topology: str) -> None:
    if topology not in REDIS_TOPOLOGIES:
        raise ValueError(f"redis topology must be one of {REDIS_TOPOLOGIES}, not {topology!r}")


def redis_data_ports(topology: str, base: int) -> list[int]:
    """The ports of the nodes that hold data, node index i on the i-th."""
    check_redis_topology(topology)
    count = {"single": 1, "sentinel": SENTINEL_DATA_NODES, "cluster": CLUSTER_NODES}[topology]
    return [base + i for i in range(count)]


def redis_sentinel_ports(topology: str, base: int) -> list[int]:
    """The Sentinels' ports (none outside the sentinel topology)."""
    check_redis_topology(topology)
    if topology != "sentinel":
        return []
    return [base + SENTINEL_PORT_OFFSET + i for i in range(SENTINELS)]


def redis_listen_ports(topology: str, base: int) -> list[int]:
    """Every port the topology's processes listen on (a cluster's bus ports too)."""
    data = redis_data_ports(topology, base)
    bus = [port + CLUSTER_BUS_OFFSET for port in data] if topology == "cluster" else []
    return [*data, *bus, *redis_sentinel_ports(topology, base)]


def redis_url(topology: str, base: int) -> str:
    """The URL the proxy's `redis` setting takes for the topology (`dedup.redis_connect`)."""
    check_redis_topology(topology)
    if topology == "single":
        return f"redis://{HOST}:{base}/0"
    if topology == "sentinel":
        sentinels = ",".join(f"{HOST}:{p}" for p in redis_sentinel_ports(topology, base))
        return f"redis+sentinel://{sentinels}/{SENTINEL_MASTER}/0"
    nodes = ",".join(f"{HOST}:{p}" for p in redis_data_ports(topology, base))
    return f"redis+cluster://{nodes}"


def redis_node_settings(topology: str, base: int, index: int) -> tuple[tuple[str, str], ...]:
    """The `redis_config` extras of data node `index`: the sentinel topology's first
    replicas follow node 0; cluster nodes run in cluster mode."""
    check_redis_topology(topology)
    if topology == "sentinel" and index > 0:
        return (("replicaof", f"{HOST} {base}"),)
    if topology == "cluster":
        return (
            ("cluster-enabled", "yes"),
            ("cluster-config-file", "nodes.conf"),
            ("cluster-node-timeout", str(CLUSTER_NODE_TIMEOUT_MS)),
            # A replica takes over however long ago it last heard from its primary: on
            # one machine an old replica is better than a slot range nobody serves.
            ("cluster-replica-validity-factor", "0"),
        )
    return ()


def sentinel_config(
    port: int,
    primary_port: int,
    work_dir: Path,
    log_file: Path,
    extra: tuple[tuple[str, str], ...] = (),
) -> str:
    """One Sentinel watching the primary on `primary_port` (quorum 2 of 3). Sentinel rewrites
    this file with what it learns (replicas, other Sentinels, the current primary), so it
    is written once, when the topology is created."""
    settings = [
        ("bind", HOST),
        ("port", str(port)),
        ("daemonize", "no"),
        ("set-proc-title", "no"),
        # No ``pidfile``, as for a data node (see redis_config).
        ("logfile", str(log_file)),
        ("dir", str(work_dir)),
        ("sentinel monitor", f"{SENTINEL_MASTER} {HOST} {primary_port} {SENTINELS // 2 + 1}"),
        ("sentinel down-after-milliseconds", f"{SENTINEL_MASTER} {SENTINEL_DOWN_AFTER_MS}"),
        ("sentinel failover-timeout", f"{SENTINEL_MASTER} {SENTINEL_FAILOVER_TIMEOUT_MS}"),
        ("sentinel parallel-syncs", f"{SENTINEL_MASTER} 1"),
        *extra,
    ]
    return "\n".join(f"{key} {value}" for key, value in settings) + "\n"


def kafka_jvm_command(
    java: str, classpath: str, log4j_config: Path, logs_dir: Path, server_props: Path
) -> list[str]:
    return [
        java,
        *KAFKA_HEAP_OPTS,
        KAFKA_DIRECT_MEMORY_OPT,
        *KAFKA_JVM_PERFORMANCE_OPTS,
        f"-Dlog4j2.configurationFile={log4j_config}",
        f"-Dkafka.logs.dir={logs_dir}",
        "-cp",
        classpath,
        "kafka.Kafka",
        str(server_props),
    ]


def java_command(
    java: str, classpath: str, log4j_config: Path, main_class: str, args: tuple[str, ...]
) -> list[str]:
    return [
        java,
        *TOOL_JVM_OPTS,
        f"-Dlog4j2.configurationFile={log4j_config}",
        "-cp",
        classpath,
        main_class,
        *args,
    ]

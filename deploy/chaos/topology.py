"""Where a chaos run's traffic flows, so that every hop can be broken:

    producer --> Toxiproxy (client links) --> dedup proxy --> Toxiproxy (broker links) --> Kafka
                                                 |
                                               Redis

Three Kafka brokers (as in the seed; replication factor 3, min ISR 2) and Redis run as
local processes in a state home of their own. Each broker listens on ``kafka_base + i``
and advertises the Toxiproxy port ``advertised_kafka_base + i``, so every client's
connection to Kafka (the proxy's, its replays', the read-back consumer's) crosses
Toxiproxy; controller traffic does not. The proxy's own listeners sit behind client links
in the same way (it advertises the Toxiproxy ports through ``advertised_broker_port_base``).

Scenarios that need a group of instances (``kill-proxy-multi``) start ``MULTI_INSTANCES``
proxies on one Redis key prefix with distinct instance ids, each behind client links of
its own (`instance_ports`): instance 0 on the single proxy's ports, the others at
``MULTI_PORT_BASE + 100 * i``. The producer bootstraps through all of them. Their leases
are short (`MULTI_LEASE_SETTINGS`) so that a killed owner's partitions move within seconds.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol

import redis
import structlog

from deploy import paths
from deploy.config import Ports
from deploy.launcher import ProxyProcess
from deploy.local import EnvInfo, LocalEnvError, LocalEnvironment
from deploy.toxiproxy import Toxiproxy, ToxiproxyServer
from proxy.kafka.api_keys import ApiKey
from proxy.kafka.schemas import api_name

BROKERS: Final = 3
KAFKA_BASE: Final = 22092  # brokers listen here (+ node id); controllers at +100
KAFKA_ADVERTISED_BASE: Final = 22292  # Toxiproxy links to the brokers
REDIS_PORT: Final = 16679
TOXIPROXY_API: Final = 22474
PROXY_LISTEN: Final = 22392  # the proxy's bootstrap listener
PROXY_BROKER_BASE: Final = 22393  # its per-broker listeners (+ node id)
PROXY_ADMIN: Final = 22380
CLIENT_BOOTSTRAP: Final = 22592  # Toxiproxy link to the proxy's bootstrap listener
CLIENT_BROKER_BASE: Final = 22593  # Toxiproxy links to its per-broker listeners
HOST: Final = "127.0.0.1"
# A group of instances (kill-proxy-multi): instance 0 on the ports above, instance i >= 1
# at MULTI_PORT_BASE + 100 * i (listener +0, per-broker listeners +1.., admin +10, client
# links: bootstrap +50, per-broker +51..). Clear of the tests' ports (tests/support/ports.py)
# and below the ephemeral range.
MULTI_INSTANCES: Final = 3
MULTI_PORT_BASE: Final = 31000
MULTI_LEASE_SETTINGS: Final = {"DEDUP_PROXY_LEASE_TTL_S": "3", "DEDUP_PROXY_HEARTBEAT_S": "0.5"}
PRODUCE_SAMPLE_S: Final = 0.25  # how often a group's Produce request counts are sampled
PRODUCE_WINDOW: Final = 8  # samples kept: the last two seconds
PRODUCE_REQUESTS: Final = f'dedup_proxy_requests_total{{api="{api_name(ApiKey.PRODUCE)}"}}'

log = structlog.get_logger(__name__)


class Topology(Protocol):
    """What the scenarios and the runner need of a chaos environment, whatever runs it
    (local processes: `ChaosTopology`; containers: `deploy.chaos.containers`)."""

    @property
    def backend(self) -> str: ...
    @property
    def toxiproxy(self) -> Toxiproxy: ...
    @property
    def log_dir(self) -> Path: ...
    @property
    def client_bootstrap(self) -> str: ...
    @property
    def kafka_bootstrap(self) -> str: ...
    @property
    def client_links(self) -> list[str]: ...
    @property
    def broker_links(self) -> list[str]: ...

    def up(self) -> object: ...
    def down(self) -> None: ...
    def start_proxy(self, dedup: bool, log_path: Path, instances: int = 1) -> object:
        """``instances`` > 1: a group of that many instances on one key prefix."""
        ...

    def kill_proxy(self) -> None: ...
    def restart_proxy(self, log_path: Path) -> object: ...
    def stop_proxy(self) -> None: ...
    def kill_owner(self, topic: str, partition: int) -> int:
        """SIGKILL the instance that owns the partition (the one holding its lease; with
        dedup off, the one the producer writes through); returns its index."""
        ...

    def restart_instance(self, index: int, log_path: Path) -> object: ...
    def kill_broker(self, node: int) -> None: ...
    def start_broker(self, node: int) -> None: ...
    def flush_redis(self) -> None: ...
    def restart_redis_empty(self) -> None: ...


def chaos_home() -> Path:
    return paths.state_home().parent / "chaos"


@dataclass
class ChaosTopology:
    """The environment of a chaos run, brought up once and reused by every run.
    ``port_shift`` moves every port (and the state home) so that two suites can run at
    once on one machine."""

    port_shift: int = 0
    home: Path = field(default_factory=chaos_home)
    environment: LocalEnvironment = field(init=False)
    toxiproxy: ToxiproxyServer = field(init=False)
    info: EnvInfo | None = None
    proxies: list[ProxyProcess] = field(default_factory=list)
    # A group's Produce request counts, sampled in the background (`owner_of`, dedup off).
    _produce_counts: deque[list[float | None]] = field(
        default_factory=lambda: deque(maxlen=PRODUCE_WINDOW), repr=False
    )
    _stop_sampling: threading.Event | None = field(default=None, repr=False)
    dedup: bool = True
    log_dir: Path = field(default_factory=lambda: Path("."))
    key_prefix: str = field(default_factory=lambda: f"chaos-{uuid.uuid4().hex[:8]}")
    backend: str = "local"

    def __post_init__(self) -> None:
        if self.port_shift:
            self.home = self.home.with_name(f"{self.home.name}-{self.port_shift}")
        ports = Ports(
            kafka_base=self._port(KAFKA_BASE),
            redis=self._port(REDIS_PORT),
            advertised_kafka_base=self._port(KAFKA_ADVERTISED_BASE),
        )
        self.environment = LocalEnvironment(home=self.home / "local", ports=ports)
        self.toxiproxy = ToxiproxyServer(self.home / "toxiproxy", self._port(TOXIPROXY_API))

    def _port(self, port: int) -> int:
        return port + self.port_shift

    # ------------------------------------------------------------------ lifecycle

    def up(self) -> EnvInfo:
        self.toxiproxy.start()
        link_every_hop(self.toxiproxy, self._port)
        self.info = self.environment.up(brokers=BROKERS)
        return self.info

    def down(self) -> None:
        self.stop_proxy()
        self.environment.down()
        self.toxiproxy.stop()

    # ------------------------------------------------------------------ the proxy

    def start_proxy(self, dedup: bool, log_path: Path, instances: int = 1) -> ProxyProcess:
        """The proxy under test (dedup on, or off for the control runs); with
        ``instances`` > 1 a group of instances, each behind client links of its own."""
        assert self.info is not None
        self.dedup = dedup
        self.log_dir = log_path.parent
        if instances > 1:
            link_instances(self.toxiproxy, self._port, instances)
        self.proxies = [
            self._instance(i, instances, self._instance_log(log_path, i, instances))
            for i in range(instances)
        ]
        if instances > 1:
            self._sample_produce_counts()
        return self.proxies[0]

    def _sample_produce_counts(self) -> None:
        """Each instance's Produce request count every PRODUCE_SAMPLE_S, the last ones kept:
        which instance a producer writes through shows in them even while the producer's
        own thread is held up (a scenario's `inject` runs on it)."""
        stop = self._stop_sampling = threading.Event()
        self._produce_counts.clear()
        self._produce_counts.append([produce_requests(p) for p in self.proxies])

        def sample() -> None:
            while not stop.wait(PRODUCE_SAMPLE_S):
                self._produce_counts.append([produce_requests(p) for p in list(self.proxies)])

        threading.Thread(target=sample, name="chaos-produce-counts", daemon=True).start()

    def _instance(self, index: int, instances: int, log_path: Path) -> ProxyProcess:
        assert self.info is not None
        ports = instance_ports(index, self._port)
        upstream = ",".join(
            f"{HOST}:{self._port(KAFKA_ADVERTISED_BASE) + n}" for n in range(BROKERS)
        )
        group = (
            {"DEDUP_PROXY_INSTANCE_ID": f"chaos-{index}", **MULTI_LEASE_SETTINGS}
            if instances > 1
            else {"DEDUP_PROXY_INSTANCE_ID": "chaos"}
        )
        return ProxyProcess(
            upstream=upstream,
            listen_port=ports.listen,
            admin_port=ports.admin,
            extra_args=[
                *("--broker-port-base", str(ports.broker_base)),
                *("--log-format", "json"),
                *([] if self.dedup else ["--no-dedup"]),
            ],
            env={
                "DEDUP_PROXY_REDIS": self.info.redis,
                "DEDUP_PROXY_REDIS_KEY_PREFIX": self.key_prefix,
                "DEDUP_PROXY_ADVERTISED_BROKER_PORT_BASE": str(ports.client_broker_base),
                "DEDUP_PROXY_METADATA_REFRESH_S": "2",
                **group,
            },
            log_path=log_path,
        ).start(timeout_s=60)

    @staticmethod
    def _instance_log(log_path: Path, index: int, instances: int) -> Path:
        if instances == 1:
            return log_path
        return log_path.with_name(f"{log_path.stem}-inst{index}{log_path.suffix}")

    @property
    def proxy(self) -> ProxyProcess | None:
        """The single proxy (instance 0 of a group)."""
        return self.proxies[0] if self.proxies else None

    def kill_proxy(self) -> None:
        if self.proxy is not None:
            self.proxy.kill()

    def restart_proxy(self, log_path: Path) -> ProxyProcess:
        return self.restart_instance(0, log_path)

    def restart_instance(self, index: int, log_path: Path) -> ProxyProcess:
        """The instance started again as the same instance (ports, id), as a supervisor
        would; it waits for its predecessor's membership to expire."""
        self.proxies[index] = self._instance(index, len(self.proxies), log_path)
        return self.proxies[index]

    def stop_proxy(self) -> None:
        if self._stop_sampling is not None:
            self._stop_sampling.set()
            self._stop_sampling = None
        for process in self.proxies:
            process.stop()
        self.proxies = []

    def kill_owner(self, topic: str, partition: int) -> int:
        index = self.owner_of(topic, partition)
        self.proxies[index].kill()
        log.info("owner killed", topic=topic, partition=partition, instance=index)
        return index

    def owner_of(self, topic: str, partition: int) -> int:
        """The index of the instance holding the partition's lease (GET /v1/ownership of
        each). With dedup off nobody holds it: then the instance the producer writes
        through, the one whose Produce requests grew most since the oldest sample kept (a
        producer writes a partition through the instance whose metadata it got: each names
        itself the leader of a partition without dedup). The producer's thread is held
        while this runs, so the growth is counted up to now rather than over a pause."""
        name = f"{topic}/{partition}"
        holders = [i for i, p in enumerate(self.proxies) if name in ownership(p).get("held", [])]
        if holders:
            return holders[0]
        oldest = self._produce_counts[0] if self._produce_counts else []
        now = [produce_requests(p) for p in self.proxies]
        grown = [0.0] * len(self.proxies)
        for i, (old, new) in enumerate(zip(oldest, now, strict=False)):
            if old is not None and new is not None:
                grown[i] = max(0.0, new - old)
        if max(grown) <= 0:
            raise RuntimeError(f"no instance holds {name} and none is taking Produce requests")
        return grown.index(max(grown))

    # ------------------------------------------------------------------ addresses

    @property
    def client_bootstrap(self) -> str:
        """What the producers are given: the proxy (every instance of a group), through
        Toxiproxy."""
        return ",".join(
            f"{HOST}:{instance_ports(i, self._port).client_bootstrap}"
            for i in range(max(1, len(self.proxies)))
        )

    @property
    def kafka_bootstrap(self) -> str:
        assert self.info is not None
        return self.info.bootstrap

    def flush_redis(self) -> None:
        assert self.info is not None
        redis.Redis.from_url(self.info.redis).flushdb()

    def kill_broker(self, node: int) -> None:
        self.environment.kill_broker(node)

    def start_broker(self, node: int) -> None:
        self.environment.start_broker(node)

    def restart_redis_empty(self) -> None:
        self.environment.kill_redis()
        try:
            self.environment.start_redis(empty=True)
        except LocalEnvError as exc:  # a Redis that dies as it starts: give it one more go
            log.warning("Redis did not come back; starting it again", error=str(exc))
            self.environment.start_redis(empty=True)

    @property
    def client_links(self) -> list[str]:
        """Every instance's client links (one instance's unless a group is running)."""
        return [link for i in range(max(1, len(self.proxies))) for link in instance_links(i)]

    @property
    def broker_links(self) -> list[str]:
        return [broker_link(n) for n in range(BROKERS)]


def link_every_hop(toxiproxy: Toxiproxy, port: Callable[[int], int]) -> None:
    """The Toxiproxy links of the port plan (``port`` shifts a planned port): each broker
    behind the port it advertises, the proxy's listeners behind the ports clients use."""
    for node in range(BROKERS):
        toxiproxy.link(
            broker_link(node),
            f"{HOST}:{port(KAFKA_ADVERTISED_BASE) + node}",
            f"{HOST}:{port(KAFKA_BASE) + node}",
        )
    toxiproxy.link(
        "client-bootstrap", f"{HOST}:{port(CLIENT_BOOTSTRAP)}", f"{HOST}:{port(PROXY_LISTEN)}"
    )
    for node in range(BROKERS):
        toxiproxy.link(
            client_link(node),
            f"{HOST}:{port(CLIENT_BROKER_BASE) + node}",
            f"{HOST}:{port(PROXY_BROKER_BASE) + node}",
        )


@dataclass(frozen=True)
class InstancePorts:
    """One proxy instance's ports: its own listeners, and the Toxiproxy links clients use."""

    listen: int
    broker_base: int
    admin: int
    client_bootstrap: int
    client_broker_base: int


def instance_ports(index: int, port: Callable[[int], int]) -> InstancePorts:
    """Instance 0 on the single proxy's ports; the others at MULTI_PORT_BASE + 100 * i
    (``port`` shifts a planned port)."""
    if index == 0:
        return InstancePorts(
            port(PROXY_LISTEN),
            port(PROXY_BROKER_BASE),
            port(PROXY_ADMIN),
            port(CLIENT_BOOTSTRAP),
            port(CLIENT_BROKER_BASE),
        )
    base = port(MULTI_PORT_BASE + 100 * index)
    return InstancePorts(base, base + 1, base + 10, base + 50, base + 51)


def instance_links(index: int) -> list[str]:
    if index == 0:
        return ["client-bootstrap", *(client_link(n) for n in range(BROKERS))]
    return [f"client-bootstrap-{index}", *(f"proxy-{index}-{n}" for n in range(BROKERS))]


def link_instances(toxiproxy: Toxiproxy, port: Callable[[int], int], instances: int) -> None:
    """The client links of instances 1.. of a group (instance 0's are `link_every_hop`'s)."""
    for index in range(1, instances):
        ports = instance_ports(index, port)
        bootstrap, *brokers = instance_links(index)
        toxiproxy.link(bootstrap, f"{HOST}:{ports.client_bootstrap}", f"{HOST}:{ports.listen}")
        for node, name in enumerate(brokers):
            toxiproxy.link(
                name,
                f"{HOST}:{ports.client_broker_base + node}",
                f"{HOST}:{ports.broker_base + node}",
            )


def ownership(process: ProxyProcess) -> dict[str, Any]:
    """GET /v1/ownership of a running instance."""
    with urllib.request.urlopen(f"{process.admin_url}/v1/ownership", timeout=10) as answer:
        data: dict[str, Any] = json.load(answer)
        return data


def produce_requests(process: ProxyProcess) -> float | None:
    """Its Produce requests so far; None when it does not answer (killed, restarting)."""
    try:
        text = process.metrics_text()
    except (urllib.error.URLError, OSError):
        return None
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(PRODUCE_REQUESTS)
    )


def broker_link(node: int) -> str:
    return f"kafka-{node}"


def client_link(node: int) -> str:
    return f"proxy-{node}"

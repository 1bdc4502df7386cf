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
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Protocol

import redis
import structlog

from deploy import paths
from deploy.config import Ports
from deploy.launcher import ProxyProcess
from deploy.local import EnvInfo, LocalEnvError, LocalEnvironment
from deploy.toxiproxy import Toxiproxy, ToxiproxyServer

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
    def start_proxy(self, dedup: bool, log_path: Path) -> object: ...
    def kill_proxy(self) -> None: ...
    def restart_proxy(self, log_path: Path) -> object: ...
    def stop_proxy(self) -> None: ...
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
    proxy: ProxyProcess | None = None
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

    def start_proxy(self, dedup: bool, log_path: Path) -> ProxyProcess:
        """The proxy under test (dedup on, or off for the control runs)."""
        assert self.info is not None
        self.dedup = dedup
        self.log_dir = log_path.parent
        upstream = ",".join(
            f"{HOST}:{self._port(KAFKA_ADVERTISED_BASE) + n}" for n in range(BROKERS)
        )
        self.proxy = ProxyProcess(
            upstream=upstream,
            listen_port=self._port(PROXY_LISTEN),
            admin_port=self._port(PROXY_ADMIN),
            extra_args=[
                *("--broker-port-base", str(self._port(PROXY_BROKER_BASE))),
                *("--log-format", "json"),
                *([] if dedup else ["--no-dedup"]),
            ],
            env={
                "DEDUP_PROXY_REDIS": self.info.redis,
                "DEDUP_PROXY_REDIS_KEY_PREFIX": self.key_prefix,
                "DEDUP_PROXY_ADVERTISED_BROKER_PORT_BASE": str(self._port(CLIENT_BROKER_BASE)),
                "DEDUP_PROXY_INSTANCE_ID": "chaos",
                "DEDUP_PROXY_METADATA_REFRESH_S": "2",
            },
            log_path=log_path,
        ).start(timeout_s=60)
        return self.proxy

    def kill_proxy(self) -> None:
        if self.proxy is not None:
            self.proxy.kill()

    def restart_proxy(self, log_path: Path) -> ProxyProcess:
        return self.start_proxy(self.dedup, log_path)

    def stop_proxy(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
            self.proxy = None

    # ------------------------------------------------------------------ addresses

    @property
    def client_bootstrap(self) -> str:
        """What the producers are given: the proxy, through Toxiproxy."""
        return f"{HOST}:{self._port(CLIENT_BOOTSTRAP)}"

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
        return ["client-bootstrap", *(client_link(n) for n in range(BROKERS))]

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


def broker_link(node: int) -> str:
    return f"kafka-{node}"


def client_link(node: int) -> str:
    return f"proxy-{node}"

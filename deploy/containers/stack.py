"""Containers of the project's images for tests (testcontainers, without Ryuk: each is a
context manager that removes what it started).

`backend()` is a single-node Kafka and a Redis on a network of their own; its `proxy()` is
the proxy image in front of them. Only the proxy publishes ports, on loopback: a client on
the host reaches Kafka through it and cannot reach the broker itself.
"""

from __future__ import annotations

import contextlib
import random
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from testcontainers.core.container import DockerContainer
from testcontainers.core.network import Network

from deploy.config import random_cluster_id
from deploy.containers.engine import KAFKA_IMAGE, PROXY_IMAGE, REDIS_IMAGE
from deploy.processes import port_bindable

HOST = "127.0.0.1"
# The host ports tests may publish on (below the ephemeral range, clear of the local
# environment's and the integration tests' ports).
HOST_PORT_RANGE = (30000, 32000)
KAFKA_NODE_ID = 1
# The proxy image's ports (deploy/containers/proxy/proxy.toml): admin, bootstrap, brokers.
ADMIN_PORT = 9190
LISTEN_PORT = 9192
BROKER_PORT_BASE = LISTEN_PORT + 1
START_TIMEOUT_S = 120.0


class ContainerFailed(RuntimeError):
    """A container exited or turned unhealthy; the message ends with its last log lines."""


def free_port_block(
    count: int, low: int = HOST_PORT_RANGE[0], high: int = HOST_PORT_RANGE[1]
) -> int:
    """The first of `count` consecutive loopback ports nothing listens on now."""
    starts = list(range(low, high - count))
    random.shuffle(starts)
    for start in starts[:200]:
        if all(port_free(port) for port in range(start, start + count)):
            return start
    raise RuntimeError(f"no {count} free consecutive ports in {low}..{high}")


def port_free(port: int) -> bool:
    """Whether nothing listens on the loopback port now."""
    return port_bindable(HOST, port)


def logs_tail(container: DockerContainer, lines: int = 40) -> str:
    raw: bytes = container.get_wrapped_container().logs(tail=lines)
    return raw.decode(errors="replace")


def state(container: DockerContainer) -> dict[str, Any]:
    wrapped = container.get_wrapped_container()
    wrapped.reload()
    current: dict[str, Any] = wrapped.attrs["State"]
    return current


def wait_healthy(container: DockerContainer, timeout_s: float = START_TIMEOUT_S) -> None:
    """Until the image's HEALTHCHECK passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        current = state(container)
        health = current.get("Health", {}).get("Status")
        if health == "healthy":
            return
        if not current.get("Running") or health == "unhealthy":
            raise ContainerFailed(
                f"{container.image}: {health or current.get('Status')}:\n{logs_tail(container)}"
            )
        if time.monotonic() > deadline:
            raise ContainerFailed(
                f"{container.image} not healthy after {timeout_s:.0f} s:\n{logs_tail(container)}"
            )
        time.sleep(0.5)


class KafkaContainer(DockerContainer):
    """A single-node Kafka (KRaft, combined broker and controller): `alias:9092` on its
    network, which is what it advertises."""

    def __init__(self, network: Network, alias: str = "kafka") -> None:
        super().__init__(KAFKA_IMAGE, hostname=alias)
        self.with_network(network).with_network_aliases(alias)
        self.with_env("KAFKA_CLUSTER_ID", random_cluster_id())
        self.with_env("KAFKA_CFG_NODE_ID", str(KAFKA_NODE_ID))
        self.bootstrap = f"{alias}:9092"


class RedisContainer(DockerContainer):
    """Redis for the dedup state: `redis://alias:6379/0` on its network."""

    def __init__(self, network: Network, alias: str = "redis") -> None:
        super().__init__(REDIS_IMAGE)
        self.with_network(network).with_network_aliases(alias)
        self.url = f"redis://{alias}:6379/0"


class ProxyContainer(DockerContainer):
    """The proxy image, configured by the environment as an operator would, with its
    bootstrap, broker and admin ports published on loopback at `host_port`,
    `host_port + 1` and `host_port + 2`. It advertises the published address, the
    port-forwarding case `advertised_broker_port_base` is for."""

    def __init__(
        self,
        network: Network,
        upstream: str,
        redis: str,
        host_port: int,
        env: dict[str, str] | None = None,
    ) -> None:
        # Hardened as the Kubernetes manifest runs it: the proxy writes no files and needs
        # no capability.
        super().__init__(
            PROXY_IMAGE, read_only=True, cap_drop=["ALL"], security_opt=["no-new-privileges"]
        )
        self.with_network(network)
        self.host_port = host_port
        # Published on loopback only, whatever the engine's default address: testcontainers
        # hands these to docker-py, which also takes (address, port).
        published: dict[str, Any] = self.ports
        published[f"{LISTEN_PORT}/tcp"] = (HOST, host_port)
        published[f"{BROKER_PORT_BASE}/tcp"] = (HOST, host_port + 1)
        published[f"{ADMIN_PORT}/tcp"] = (HOST, host_port + 2)
        settings = {
            "DEDUP_PROXY_UPSTREAM": upstream,
            "DEDUP_PROXY_REDIS": redis,
            "DEDUP_PROXY_ADVERTISED_HOST": HOST,
            "DEDUP_PROXY_NODE_ID_OFFSET": str(KAFKA_NODE_ID),
            "DEDUP_PROXY_ADVERTISED_BROKER_PORT_BASE": str(host_port + 1),
            "DEDUP_PROXY_INSTANCE_ID": f"container-{host_port}",
            **(env or {}),
        }
        for key, value in settings.items():
            self.with_env(key, value)

    @property
    def bootstrap(self) -> str:
        return f"{HOST}:{self.host_port}"

    @property
    def admin_url(self) -> str:
        return f"http://{HOST}:{self.host_port + 2}"

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"{self.admin_url}/metrics", timeout=5) as answer:
            text: str = answer.read().decode()
            return text


@dataclass(frozen=True)
class Backend:
    """Kafka and Redis on a network of their own, for proxy containers to front."""

    network: Network
    kafka: KafkaContainer
    redis: RedisContainer

    @contextlib.contextmanager
    def proxy(self, env: dict[str, str] | None = None) -> Iterator[ProxyContainer]:
        """A healthy proxy container in front of this Kafka; removed on exit."""
        port = free_port_block(3)
        container = ProxyContainer(self.network, self.kafka.bootstrap, self.redis.url, port, env)
        with container:
            wait_healthy(container)
            yield container


@contextlib.contextmanager
def backend() -> Iterator[Backend]:
    """A healthy single-node Kafka and a Redis; everything removed on exit."""
    with Network() as network:
        kafka = KafkaContainer(network)
        redis = RedisContainer(network)
        with kafka, redis:
            wait_healthy(kafka)
            wait_healthy(redis)
            yield Backend(network, kafka, redis)

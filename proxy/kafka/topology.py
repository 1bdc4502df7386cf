"""The upstream cluster as the proxy sees it, and the proxy address that stands for each broker.

Every upstream broker gets a proxy listener on a port derived from its node id
(``broker_port_base + node_id - node_id_offset``), the port-per-broker scheme of
Kroxylicious. Or, with `SniRouting`, every broker shares the bootstrap listener's one TLS
port under a host name of its own (``broker-{node_id}.kafka.example.com``), and the name a
client puts in TLS SNI says which broker it wants. Either mapping is a pure function of
the node id, so every proxy instance and every restart advertises the same address for the
same broker.
"""

from __future__ import annotations

import asyncio
import functools
import re
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import structlog

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True, order=True)
class Endpoint:
    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> Endpoint:
        host, sep, port = text.strip().rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"expected HOST:PORT, got {text!r}")
        return cls(host.strip("[]"), int(port))

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


ListenerReconciler = Callable[[set[int]], Awaitable[None]]
NODE_ID = "{node_id}"


@dataclass(frozen=True)
class SniRouting:
    """One TLS port for the bootstrap and every broker: a client names the one it wants in
    TLS SNI, ``bootstrap_host`` or ``broker_host_pattern`` with a node id in it."""

    bootstrap_host: str
    broker_host_pattern: str  # e.g. "broker-{node_id}.kafka.example.com"
    advertised_port: int

    def __post_init__(self) -> None:
        prefix, _, suffix = self.broker_host_pattern.partition(NODE_ID)
        if NODE_ID not in self.broker_host_pattern or "{" in prefix + suffix or "}" in suffix:
            raise ValueError(
                f"sni_broker_host_pattern {self.broker_host_pattern!r} must hold {NODE_ID} once"
            )
        if not 0 < self.advertised_port < 65536:
            raise ValueError(f"SNI advertised port {self.advertised_port} is not a valid port")
        if self.node_of(self.bootstrap_host) is not None:
            raise ValueError(
                f"sni_bootstrap_host {self.bootstrap_host!r} matches the broker pattern"
            )

    def broker_host(self, node_id: int) -> str:
        return self.broker_host_pattern.replace(NODE_ID, str(node_id))

    def is_bootstrap(self, server_name: str) -> bool:
        return server_name.lower() == self.bootstrap_host.lower()

    def node_of(self, server_name: str) -> int | None:
        """The node id a server name asks for (None: not a broker's name)."""
        found = self._broker_name.fullmatch(server_name)
        return int(found.group(1)) if found else None

    @functools.cached_property
    def _broker_name(self) -> re.Pattern[str]:
        prefix, _, suffix = self.broker_host_pattern.partition(NODE_ID)
        # Host names compare without case; a node id is written as Kafka writes it.
        return re.compile(f"{re.escape(prefix)}(0|[1-9][0-9]{{0,9}}){re.escape(suffix)}", re.I)


class Topology:
    """Upstream broker addresses by node id, and the proxy's advertised address for each."""

    def __init__(
        self,
        bootstrap: list[Endpoint],
        advertised_host: str,
        broker_port_base: int,
        node_id_offset: int = 0,
        advertised_port_base: int | None = None,
        sni: SniRouting | None = None,
    ) -> None:
        self.bootstrap = bootstrap
        self.sni = sni
        self.advertised_host = advertised_host
        self.broker_port_base = broker_port_base
        # Differs from broker_port_base only behind port forwarding (NAT, a TCP relay).
        self.advertised_port_base = (
            broker_port_base if advertised_port_base is None else advertised_port_base
        )
        self.node_id_offset = node_id_offset
        self._upstream: dict[int, Endpoint] = {}
        # Their host names as on the wire, each once, kept with them: every response is
        # searched for them (a response naming none needs no rewrite), and building them per
        # response took 0.7 % of the pass-through's samples.
        self._upstream_hosts: tuple[bytes, ...] = ()
        self._reconciler: ListenerReconciler | None = None
        self._lock = asyncio.Lock()
        self.refreshed = asyncio.Event()  # set once a full broker list has been seen

    def on_brokers_changed(self, reconciler: ListenerReconciler) -> None:
        self._reconciler = reconciler

    def proxy_port(self, node_id: int) -> int:
        """The port the proxy listens on for this broker."""
        return _port(self.broker_port_base, node_id, self.node_id_offset)

    def proxy_endpoint(self, node_id: int) -> Endpoint:
        """The address clients are told for this broker."""
        if self.sni is not None:
            return Endpoint(self.sni.broker_host(node_id), self.sni.advertised_port)
        port = _port(self.advertised_port_base, node_id, self.node_id_offset)
        return Endpoint(self.advertised_host, port)

    def upstream(self, node_id: int) -> Endpoint | None:
        return self._upstream.get(node_id)

    @property
    def node_ids(self) -> set[int]:
        return set(self._upstream)

    def known_upstreams(self, first: list[Endpoint] | None = None) -> list[Endpoint]:
        """``first`` (default: the bootstrap servers), then every known broker, no repeats."""
        known = [self._upstream[n] for n in sorted(self._upstream)]
        return list(dict.fromkeys([*(self.bootstrap if first is None else first), *known]))

    def names_upstream_host(self, payload: bytes, start: int) -> bool:
        """Whether raw bytes from ``start`` on contain an upstream host name: the cheap test
        before decoding a large response that may carry broker endpoints (KIP-951)."""
        return any(payload.find(host, start) >= 0 for host in self._upstream_hosts)

    async def observe(self, brokers: Iterable[tuple[int, str, int]], complete: bool) -> None:
        """Record brokers seen in a response.

        ``complete`` lists (Metadata, DescribeCluster) replace the known set, so brokers that
        left the cluster lose their listener; partial ones (node endpoints) only add.
        """
        seen = {node_id: Endpoint(host, port) for node_id, host, port in brokers}
        async with self._lock:
            before = dict(self._upstream)
            if complete:
                self._upstream = seen
            else:
                self._upstream.update(seen)
            if complete:
                self.refreshed.set()
            if self._upstream == before:
                return
            self._upstream_hosts = tuple(
                dict.fromkeys(endpoint.host.encode() for endpoint in self._upstream.values())
            )
            changed = {
                node_id: str(endpoint)
                for node_id, endpoint in self._upstream.items()
                if before.get(node_id) != endpoint
            }
            gone = sorted(set(before) - set(self._upstream))
            log.info("upstream brokers changed", changed=changed, gone=gone)
            if self._reconciler is not None:
                await self._reconciler(set(self._upstream))


def _port(base: int, node_id: int, offset: int) -> int:
    port = base + node_id - offset
    if not 0 < port < 65536:
        raise ValueError(
            f"broker node id {node_id} maps to port {port}; set the port base and "
            f"node_id_offset so that every node id gets a valid port"
        )
    return port

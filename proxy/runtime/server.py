"""The proxy runtime: a bootstrap listener, one listener per upstream broker, and shutdown.

The bootstrap listener forwards to any upstream bootstrap server. The listener of broker
N forwards to broker N's current address. Listeners follow the upstream topology: a
broker that joins gets one as soon as any response names it, a broker that leaves the
cluster loses its listener at the next full broker list. With SNI routing there is only
the bootstrap listener: the TLS server name a client asks for picks the bootstrap or a
broker (`proxy.kafka.topology.SniRouting`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import ssl
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

import structlog

from proxy.kafka.topology import Endpoint, Topology
from proxy.runtime import background, loop_lag, metrics
from proxy.runtime.chain import FilterChain
from proxy.runtime.cluster import UpstreamCluster
from proxy.runtime.connection import ClientConnection, ConnectionSettings, UpstreamResolver
from proxy.runtime.settings import ProxySettings

log = structlog.get_logger(__name__)


Acceptor = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Service(Protocol):
    """Something a plugged-in layer runs beside the listeners (dedup's state, snapshots)."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...


def topology_of(settings: ProxySettings) -> Topology:
    return Topology(
        bootstrap=settings.upstream_endpoints,
        advertised_host=settings.effective_advertised_host,
        broker_port_base=settings.effective_broker_port_base,
        node_id_offset=settings.node_id_offset,
        advertised_port_base=settings.advertised_broker_port_base,
        sni=settings.sni_routing,
    )


class ProxyServer:
    def __init__(
        self,
        settings: ProxySettings,
        cluster: UpstreamCluster,
        chain: FilterChain,
        services: Sequence[Service] = (),
    ) -> None:
        self.settings = settings
        self.cluster = cluster
        self.topology = cluster.topology
        self.topology.on_brokers_changed(self._reconcile_listeners)
        self.chain = chain
        self._services = list(services)
        self._connection_settings = ConnectionSettings(
            max_frame_bytes=settings.max_frame_bytes,
            max_in_flight=settings.max_in_flight_per_connection,
            connect_timeout_s=settings.upstream_connect_timeout_s,
            upstream_tls=settings.upstream_security.context(),
        )
        listener_tls = settings.listener_tls
        self._listener_tls = listener_tls.context() if listener_tls is not None else None
        self._sni = self.topology.sni
        # The server name each TLS connection asked for, noted during its handshake.
        self._server_names: weakref.WeakKeyDictionary[ssl.SSLObject, str] = (
            weakref.WeakKeyDictionary()
        )
        if self._sni is not None:
            assert self._listener_tls is not None, "SNI routing needs TLS (settings check it)"
            self._listener_tls.sni_callback = self._note_server_name
        self._bootstrap_server: asyncio.Server | None = None
        self._broker_servers: dict[int, asyncio.Server] = {}
        self._connections: dict[ClientConnection, asyncio.Task[None]] = {}
        self._max_connections = settings.max_connections_per_listener
        self._open_per_listener: collections.Counter[str] = collections.Counter()
        self._refresh_task: asyncio.Task[None] | None = None
        self._lag_task: asyncio.Task[None] | None = None
        self._bootstrap_rotation = itertools.count()

    @property
    def last_refresh_ok(self) -> float | None:
        return self.cluster.last_refresh_ok

    # ----------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        # The services first: an instance of a group answers clients once it has joined.
        # Before, it knows no other member and would name the brokers by their own ids, as
        # an instance alone does (a restarted one waits up to a lease for its earlier
        # incarnation to expire), and a client asking it then would drop every node of the
        # group (librdkafka forgets the brokers a Metadata answer leaves out).
        for service in self._services:
            await service.start()
        listen = self.settings.listen_endpoint
        accept = (
            self._acceptor("bootstrap", self._bootstrap_candidates)
            if self._sni is None
            else self._sni_acceptor()
        )
        self._bootstrap_server = await asyncio.start_server(
            accept,
            listen.host,
            listen.port,
            # Several processes may share the bootstrap port; the kernel spreads new
            # connections over them. Broker listeners stay exclusive to one process.
            reuse_port=self.settings.reuse_port or None,
            ssl=self._listener_tls,
        )
        log.info(
            "bootstrap listener open",
            listen=str(listen),
            reuse_port=self.settings.reuse_port,
            tls=self._listener_tls is not None,
            upstream_security=self.settings.upstream_security_protocol,
            advertised_host=self.topology.advertised_host,
            broker_port_base=None if self._sni is not None else self.topology.broker_port_base,
            sni_bootstrap_host=self._sni.bootstrap_host if self._sni is not None else None,
            sni_broker_host_pattern=(
                self._sni.broker_host_pattern if self._sni is not None else None
            ),
            upstream=[str(e) for e in self.topology.bootstrap],
        )
        reached = await self.cluster.refresh_metadata()
        if not reached:
            log.warning("upstream not reachable yet; broker listeners open once it answers")
        self._refresh_task = background.start(
            self.cluster.keep_refreshed(self.settings.metadata_refresh_s, reached),
            "metadata-refresh",
        )
        self._lag_task = background.start(loop_lag.watch(), "event-loop-lag")

    async def shutdown(self) -> None:
        """Close listeners, let every connection answer what it took, then close them."""
        log.info("shutting down", connections=len(self._connections))
        for task in (self._refresh_task, self._lag_task):
            if task is not None:
                task.cancel()
        servers = [s for s in [self._bootstrap_server, *self._broker_servers.values()] if s]
        for server in servers:
            server.close()
        for connection in list(self._connections):
            connection.drain()
        tasks = list(self._connections.values())
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=self.settings.drain_timeout_s)
            for task in late:
                task.cancel()
            if late:
                log.warning("connections closed before answering everything", count=len(late))
                await asyncio.gather(*late, return_exceptions=True)
        await self.chain.drain()
        for service in reversed(self._services):
            await service.close()
        for server in servers:
            with contextlib.suppress(Exception):
                await server.wait_closed()
        self._broker_servers.clear()
        metrics.BROKER_LISTENERS.set(0)
        log.info("shutdown complete")

    # ----------------------------------------------------------------- topology

    async def _reconcile_listeners(self, node_ids: set[int]) -> None:
        if self._sni is not None:  # brokers share the bootstrap listener
            metrics.BROKER_LISTENERS.set(0)
            return
        for node_id in sorted(node_ids - set(self._broker_servers)):
            port = self.topology.proxy_port(node_id)
            listen_host = self.settings.listen_endpoint.host
            try:
                self._broker_servers[node_id] = await asyncio.start_server(
                    self._acceptor(f"broker-{node_id}", self._broker_candidates(node_id)),
                    listen_host,
                    port,
                    ssl=self._listener_tls,
                )
            except OSError as exc:
                log.error("cannot open broker listener", node_id=node_id, error=str(exc))
                continue
            log.info("broker listener open", node_id=node_id, listen=f"{listen_host}:{port}")
        for node_id in sorted(set(self._broker_servers) - node_ids):
            # Open connections stay; new ones are refused as they would be by a gone broker.
            self._broker_servers.pop(node_id).close()
            log.info("broker listener closed", node_id=node_id)
        metrics.BROKER_LISTENERS.set(len(self._broker_servers))

    def broker_ports(self) -> dict[int, int]:
        return {
            node_id: server.sockets[0].getsockname()[1]
            for node_id, server in self._broker_servers.items()
            if server.sockets
        }

    # ----------------------------------------------------------------- connections

    async def _bootstrap_candidates(self) -> list[Endpoint]:
        bootstrap = self.topology.bootstrap
        start = next(self._bootstrap_rotation) % len(bootstrap)
        return self.topology.known_upstreams(bootstrap[start:] + bootstrap[:start])

    def _broker_candidates(self, node_id: int) -> UpstreamResolver:
        async def resolve() -> list[Endpoint]:
            endpoint = self.topology.upstream(node_id)
            if endpoint is None:
                await self.cluster.refresh_metadata()
                endpoint = self.topology.upstream(node_id)
            return [endpoint] if endpoint else []

        return resolve

    def _note_server_name(
        self, connection: ssl.SSLObject, server_name: str | None, _context: ssl.SSLContext
    ) -> None:
        if server_name is not None:
            self._server_names[connection] = server_name

    def _sni_acceptor(self) -> Acceptor:
        """Route each connection by the server name it asked for in its TLS handshake."""
        sni = self._sni
        assert sni is not None

        async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            handshake = writer.get_extra_info("ssl_object")
            name = self._server_names.pop(handshake, None) if handshake is not None else None
            node_id = None if name is None else sni.node_of(name)
            if name is not None and sni.is_bootstrap(name):
                await self._serve(reader, writer, "bootstrap", self._bootstrap_candidates)
            elif node_id is not None:
                listener = f"broker-{node_id}"
                await self._serve(reader, writer, listener, self._broker_candidates(node_id))
            else:
                metrics.CONNECTIONS_REFUSED.labels("sni").inc()
                log.warning(
                    "closing a new connection: its TLS server name names no broker",
                    server_name=name,
                    client=str(writer.get_extra_info("peername")),
                    bootstrap=sni.bootstrap_host,
                    brokers=sni.broker_host_pattern,
                )
                writer.transport.abort()

        return accept

    def _acceptor(self, listener: str, resolve: UpstreamResolver) -> Acceptor:
        async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await self._serve(reader, writer, listener, resolve)

        return accept

    async def _serve(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        listener: str,
        resolve: UpstreamResolver,
    ) -> None:
        if self._open_per_listener[listener] >= self._max_connections:
            metrics.CONNECTIONS_REFUSED.labels(listener).inc()
            log.warning(
                "closing a new connection: the listener has max_connections_per_listener open",
                listener=listener,
                limit=self._max_connections,
            )
            writer.transport.abort()
            return
        self._open_per_listener[listener] += 1
        connection = ClientConnection(
            reader,
            writer,
            listener,
            resolve,
            self.chain,
            self.topology,
            self._connection_settings,
        )
        task = asyncio.current_task()
        assert task is not None
        self._connections[connection] = task
        try:
            await connection.serve()
        finally:
            self._connections.pop(connection, None)
            self._open_per_listener[listener] -= 1

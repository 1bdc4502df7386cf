"""The proxy runtime: a bootstrap listener, one listener per upstream broker, and shutdown.

The bootstrap listener forwards to any upstream bootstrap server. The listener of broker
N forwards to broker N's current address. Listeners follow the upstream topology: a
broker that joins gets one as soon as any response names it, a broker that leaves the
cluster loses its listener at the next full broker list.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Awaitable, Callable

import structlog
from kio.schema.metadata.v12.request import MetadataRequest, MetadataRequestTopic
from kio.schema.types import TopicName

from dedup.produce_filter import DedupProduceHandler
from dedup.service import DedupService
from proxy.filters import FilterContext, default_response_filters
from proxy.kafka.topology import Endpoint, Topology
from proxy.kafka.upstream_client import UpstreamClient, fetch_brokers
from proxy.runtime import metrics
from proxy.runtime.connection import ClientConnection, ConnectionSettings, UpstreamResolver
from proxy.runtime.settings import ProxySettings

log = structlog.get_logger(__name__)


class ProxyServer:
    def __init__(self, settings: ProxySettings) -> None:
        self.settings = settings
        self.topology = Topology(
            bootstrap=settings.upstream_endpoints,
            advertised_host=settings.effective_advertised_host,
            broker_port_base=settings.effective_broker_port_base,
            node_id_offset=settings.node_id_offset,
            advertised_port_base=settings.advertised_broker_port_base,
        )
        self.topology.on_brokers_changed(self._reconcile_listeners)
        self._filters = default_response_filters()
        self._filter_context = FilterContext(self.topology)
        self._connection_settings = ConnectionSettings(
            max_frame_bytes=settings.max_frame_bytes,
            max_in_flight=settings.max_in_flight_per_connection,
            connect_timeout_s=settings.upstream_connect_timeout_s,
        )
        self._bootstrap_server: asyncio.Server | None = None
        self._broker_servers: dict[int, asyncio.Server] = {}
        self._connections: dict[ClientConnection, asyncio.Task[None]] = {}
        self._refresh_task: asyncio.Task[None] | None = None
        self._bootstrap_rotation = itertools.count()
        self.last_refresh_ok: float | None = None
        self.dedup = DedupService(settings, self._refresh_candidates, self.leader_of)
        self._produce_handler = DedupProduceHandler(self.dedup.engine)

    # ----------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        listen = self.settings.listen_endpoint
        self._bootstrap_server = await asyncio.start_server(
            self._acceptor("bootstrap", self._bootstrap_candidates), listen.host, listen.port
        )
        log.info(
            "bootstrap listener open",
            listen=str(listen),
            advertised_host=self.topology.advertised_host,
            broker_port_base=self.topology.broker_port_base,
            upstream=[str(e) for e in self.topology.bootstrap],
        )
        if not await self.refresh_metadata():
            log.warning("upstream not reachable yet; broker listeners open once it answers")
        await self.dedup.start()
        self._refresh_task = asyncio.create_task(self._refresh_loop(), name="metadata-refresh")

    async def shutdown(self) -> None:
        """Close listeners, let every connection answer what it took, then close them."""
        log.info("shutting down", connections=len(self._connections))
        if self._refresh_task is not None:
            self._refresh_task.cancel()
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
        await self._produce_handler.drain()
        await self.dedup.close()
        for server in servers:
            with contextlib.suppress(Exception):
                await server.wait_closed()
        self._broker_servers.clear()
        metrics.BROKER_LISTENERS.set(0)
        log.info("shutdown complete")

    # ----------------------------------------------------------------- topology

    async def refresh_metadata(self) -> bool:
        """Ask the upstream cluster for its brokers; True when one of them answered."""
        for endpoint in self._refresh_candidates():
            try:
                brokers = await fetch_brokers(endpoint, self.settings.upstream_connect_timeout_s)
            except (OSError, TimeoutError, ValueError) as exc:
                metrics.UPSTREAM_ERRORS.labels("metadata").inc()
                log.debug("metadata refresh failed", upstream=str(endpoint), error=str(exc))
                continue
            await self.topology.observe(brokers, complete=True)
            self.last_refresh_ok = asyncio.get_running_loop().time()
            return True
        return False

    async def leader_of(self, topic: str, partition: int) -> Endpoint | None:
        """The upstream address of a partition's leader, asked of the cluster now."""
        request = MetadataRequest(
            topics=(MetadataRequestTopic(topic_id=None, name=TopicName(topic)),),
            allow_auto_topic_creation=False,
            include_topic_authorized_operations=False,
        )
        for endpoint in self._refresh_candidates():
            try:
                async with UpstreamClient(endpoint, self.settings.upstream_connect_timeout_s) as c:
                    response = await c.request(request)
            except (OSError, TimeoutError):
                continue
            brokers = [(int(b.node_id), b.host, int(b.port)) for b in response.brokers]
            await self.topology.observe(brokers, complete=True)
            for found in response.topics:
                for part in found.partitions:
                    if int(part.partition_index) == partition and part.error_code == 0:
                        return self.topology.upstream(int(part.leader_id))
            return None
        return None

    def _refresh_candidates(self) -> list[Endpoint]:
        return self.topology.known_upstreams()

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.metadata_refresh_s)
            if not await self.refresh_metadata():
                log.warning("metadata refresh failed on every known upstream broker")

    async def _reconcile_listeners(self, node_ids: set[int]) -> None:
        for node_id in sorted(node_ids - set(self._broker_servers)):
            port = self.topology.proxy_port(node_id)
            listen_host = self.settings.listen_endpoint.host
            try:
                self._broker_servers[node_id] = await asyncio.start_server(
                    self._acceptor(f"broker-{node_id}", self._broker_candidates(node_id)),
                    listen_host,
                    port,
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
                await self.refresh_metadata()
                endpoint = self.topology.upstream(node_id)
            return [endpoint] if endpoint else []

        return resolve

    def _acceptor(
        self, listener: str, resolve: UpstreamResolver
    ) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
        async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            connection = ClientConnection(
                reader,
                writer,
                listener,
                resolve,
                self._filters,
                self._filter_context,
                self._connection_settings,
                self._produce_handler,
            )
            task = asyncio.current_task()
            assert task is not None
            self._connections[connection] = task
            try:
                await connection.serve()
            finally:
                self._connections.pop(connection, None)

        return accept

"""The upstream Kafka cluster as the runtime follows it: its brokers, and where a
partition's leader is, asked of the cluster with the proxy's own requests."""

from __future__ import annotations

import asyncio

import structlog
from kio.schema.metadata.v12.request import MetadataRequest, MetadataRequestTopic
from kio.schema.types import TopicName

from proxy.kafka.sasl import SaslFailed
from proxy.kafka.topology import Endpoint, Topology
from proxy.kafka.upstream_client import PLAINTEXT, LinkSecurity, UpstreamClient, fetch_brokers
from proxy.runtime import metrics

log = structlog.get_logger(__name__)


class UpstreamCluster:
    def __init__(
        self, topology: Topology, connect_timeout_s: float, security: LinkSecurity = PLAINTEXT
    ) -> None:
        self.topology = topology
        self._connect_timeout_s = connect_timeout_s
        self._security = security
        self.last_refresh_ok: float | None = None  # event loop time of the last good refresh

    def known_upstreams(self) -> list[Endpoint]:
        return self.topology.known_upstreams()

    async def refresh_metadata(self) -> bool:
        """Ask the upstream cluster for its brokers; True when one of them answered."""
        for endpoint in self.known_upstreams():
            try:
                brokers = await fetch_brokers(endpoint, self._connect_timeout_s, self._security)
            except SaslFailed as exc:  # configuration, not the network: say so loudly
                metrics.UPSTREAM_ERRORS.labels("authentication").inc()
                log.error("upstream refused the proxy's credentials", error=str(exc))
                continue
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
        found = await self.leader_id_of(topic, partition)
        return None if found is None else self.topology.upstream(found[0])

    async def leader_id_of(self, topic: str, partition: int) -> tuple[int, int] | None:
        """A partition's leader node id and leader epoch, asked of the cluster now."""
        request = MetadataRequest(
            topics=(MetadataRequestTopic(topic_id=None, name=TopicName(topic)),),
            allow_auto_topic_creation=False,
            include_topic_authorized_operations=False,
        )
        for endpoint in self.known_upstreams():
            try:
                async with UpstreamClient(
                    endpoint, self._connect_timeout_s, self._security
                ) as client:
                    response = await client.request(request)
            except (OSError, TimeoutError):
                continue
            brokers = [(int(b.node_id), b.host, int(b.port)) for b in response.brokers]
            await self.topology.observe(brokers, complete=True)
            for found in response.topics:
                for part in found.partitions:
                    if int(part.partition_index) == partition and part.error_code == 0:
                        return int(part.leader_id), int(part.leader_epoch)
            return None
        return None

"""The upstream Kafka cluster as the runtime follows it: its brokers, and where a
partition's leader is, asked of the cluster with the proxy's own requests."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from kio.schema.errors import ErrorCode
from kio.schema.metadata.v12.request import MetadataRequest, MetadataRequestTopic
from kio.schema.types import TopicName

from proxy.kafka.sasl import SaslFailed
from proxy.kafka.topology import Endpoint, Topology
from proxy.kafka.upstream_client import PLAINTEXT, LinkSecurity, UpstreamClient, fetch_brokers
from proxy.runtime import background, metrics

log = structlog.get_logger(__name__)

# After a refresh that reached no broker, the next one comes this soon, then twice as late
# each time, up to the last (or the refresh interval, if shorter): one connection attempt
# per known broker every few seconds costs a cluster that is down nothing.
FIRST_RETRY_S = 1.0
LAST_RETRY_S = 5.0
# Topics named in one Metadata request of the leader lookups: lookups of many topics at once
# (a producer's first request to them all) share a request, on one connection.
TOPICS_PER_LOOKUP = 100


class UpstreamCluster:
    def __init__(
        self, topology: Topology, connect_timeout_s: float, security: LinkSecurity = PLAINTEXT
    ) -> None:
        self.topology = topology
        self._connect_timeout_s = connect_timeout_s
        self._security = security
        self.last_refresh_ok: float | None = None  # event loop time of the last good refresh
        # topic: the Metadata answer that will name it, asked or about to be
        self._asking: dict[str, asyncio.Future[Any | None]] = {}
        self._gathering: list[str] = []  # topics asked in this turn of the loop, not yet sent

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

    async def keep_refreshed(
        self,
        interval_s: float,
        last_ok: bool,
        first_retry_s: float = FIRST_RETRY_S,
        last_retry_s: float = LAST_RETRY_S,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        """Refresh every ``interval_s`` for as long as the proxy runs. After a refresh that
        reached no broker (``last_ok`` is the one before the first), the next comes sooner:
        ``first_retry_s``, then twice as late each time up to ``last_retry_s``. The proxy
        learns of the cluster's return, and reports itself healthy again, seconds after it,
        not up to an interval later. A pass that fails in a way nobody foresaw is logged and
        counted (`background.one_pass`), never the end of the loop."""
        retry_s = first_retry_s
        while True:
            if last_ok:
                delay, retry_s = interval_s, first_retry_s
            else:
                delay = min(retry_s, interval_s)
                retry_s = min(retry_s * 2, last_retry_s)
            await sleep(delay)
            last_ok = False
            with background.one_pass("metadata-refresh"):
                last_ok = await self.refresh_metadata()
                if not last_ok:
                    log.warning("metadata refresh failed on every known upstream broker")

    async def leader_of(self, topic: str, partition: int) -> Endpoint | None:
        """The upstream address of a partition's leader, asked of the cluster now."""
        found = await self.leader_id_of(topic, partition)
        return None if found is None else self.topology.upstream(found[0])

    async def leader_id_of(self, topic: str, partition: int) -> tuple[int, int] | None:
        """A partition's leader node id and leader epoch, asked of the cluster now; None
        when it is not known (no answer, no leader, or no such partition)."""
        try:
            return await self.partition_leader(topic, partition)
        except NoSuchPartition:
            return None

    async def partition_leader(self, topic: str, partition: int) -> tuple[int, int] | None:
        """As `leader_id_of`, but raises `NoSuchPartition` when a broker answered that the
        topic does not exist or has no such partition (it may be being created: a broker
        can lag behind the controller, so the answer is Kafka's retriable
        UNKNOWN_TOPIC_OR_PARTITION, not a final one)."""
        response = await self._topic_metadata(topic)
        return None if response is None else leader_in_answer(response, topic, partition)

    async def _topic_metadata(self, topic: str) -> Any | None:
        """A Metadata answer that names the topic. One request is shared by every lookup of
        the topic made while it is under way, and by the lookups of other topics made in
        the same turn of the event loop (up to `TOPICS_PER_LOOKUP` topics a request): a
        producer's first request to many partitions, of one topic or of many, asks once,
        not once per partition or topic (each a connection of its own)."""
        asking = self._asking.get(topic)
        if asking is None:
            asking = asyncio.get_running_loop().create_future()
            asking.add_done_callback(_retrieved)
            self._asking[topic] = asking
            if not self._gathering:
                asyncio.get_running_loop().call_soon(self._ask_gathered)
            self._gathering.append(topic)
        # One lookup given up (its request timed out) does not end the others'.
        return await asyncio.shield(asking)

    def _ask_gathered(self) -> None:
        """Send the topics asked in the last turn of the loop, `TOPICS_PER_LOOKUP` a request."""
        topics, self._gathering = self._gathering, []
        for first in range(0, len(topics), TOPICS_PER_LOOKUP):
            named = topics[first : first + TOPICS_PER_LOOKUP]
            request = asyncio.ensure_future(self._ask_topics(named))
            request.add_done_callback(functools.partial(self._answered, named))

    def _answered(self, topics: list[str], done: asyncio.Future[Any | None]) -> None:
        """Each topic's lookups get the request's answer, or what it raised; the next
        lookup of the topic asks again."""
        for topic in topics:
            asking = self._asking.pop(topic)
            if done.cancelled():
                asking.cancel()
            elif (error := done.exception()) is not None:
                asking.set_exception(error)
            else:
                asking.set_result(done.result())

    async def _ask_topics(self, topics: list[str]) -> Any | None:
        """The topics' Metadata answer from the first broker that gives one; None: none
        did."""
        request = MetadataRequest(
            topics=tuple(MetadataRequestTopic(topic_id=None, name=TopicName(t)) for t in topics),
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
            return response
        return None


def _retrieved(done: asyncio.Future[Any | None]) -> None:
    """Every lookup of a topic may have given up before its answer came: its error is
    retrieved here all the same, so it is not reported as never retrieved."""
    if not done.cancelled():
        done.exception()


class NoSuchPartition(LookupError):
    """Kafka answered that the topic does not exist, or has no partition of that index."""


def leader_in_answer(response: Any, topic: str, partition: int) -> tuple[int, int] | None:
    """The partition's leader id and epoch in a Metadata answer; None: not known."""
    for found in response.topics:
        if found.name != topic:
            continue
        if found.error_code == ErrorCode.unknown_topic_or_partition:
            raise NoSuchPartition(f"topic {topic} does not exist")
        if found.error_code != ErrorCode.none:
            return None  # being created, or not ours to see: unknown
        for part in found.partitions:
            if int(part.partition_index) == partition:
                if part.error_code != ErrorCode.none:
                    return None
                return int(part.leader_id), int(part.leader_epoch)
        raise NoSuchPartition(f"topic {topic} has no partition {partition}")
    return None
